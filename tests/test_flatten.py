"""apex_C.flatten / apex_C.unflatten (NVIDIA apex_C's two functions) and apex.parallel.distributed's names for them.

References: torch.cat of the reshaped tensors (flatten) and narrow+view (unflatten); views must alias the flat
buffer. Exact comparisons (no arithmetic happens).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import apex._flatten as fl

apex_C = pytest.importorskip("apex_C")

SHAPES = [(3, 4), (1,), (0,), (2, 3, 5), ()]


def _tensors(dtype=torch.float32, shapes=SHAPES):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("fn", [apex_C.flatten, fl.flatten], ids=["apex_C", "apex._flatten"])
def test_flatten_concatenates_in_order(fn, dtype):
    ts = _tensors(dtype)
    flat = fn(ts)
    assert flat.dim() == 1 and flat.dtype == dtype and flat.numel() == sum(t.numel() for t in ts)
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in ts]))
    ts[0].fill_(7)
    assert not torch.equal(flat[:12], ts[0].reshape(-1))  # new memory, even for one tensor
    one = fn([ts[0]])
    ts[0].fill_(1)
    assert torch.equal(one, torch.full((12,), 7.0, dtype=dtype))


def test_flatten_reads_non_contiguous_tensors_in_logical_order():
    base = torch.arange(24.0).reshape(4, 6)
    ts = [base.t(), base[:, ::2], base[1]]
    assert torch.equal(apex_C.flatten(ts), torch.cat([t.reshape(-1) for t in ts]))


def test_flatten_promotes_mixed_dtypes_as_cat():
    ts = [torch.ones(2, dtype=torch.float16), torch.ones(3, dtype=torch.float32)]
    assert apex_C.flatten(ts).dtype == torch.float32


@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fn", [apex_C.unflatten, fl.unflatten], ids=["apex_C", "apex._flatten"])
def test_unflatten_gives_views_of_flat(fn, flat_dtype):
    ts = _tensors(torch.float32)
    n = sum(t.numel() for t in ts)
    flat = torch.arange(n + 5, dtype=flat_dtype)  # a longer buffer leaves its tail unused
    views = fn(flat, ts)
    assert [v.shape for v in views] == [t.shape for t in ts]
    assert all(v.dtype == flat_dtype for v in views)  # e.g. an fp16 all-reduce buffer for fp32 grads
    offset = 0
    for v, t in zip(views, ts):
        assert torch.equal(v.reshape(-1), flat[offset:offset + t.numel()])
        if t.numel():
            assert v.data_ptr() == flat.data_ptr() + offset * flat.element_size()
        offset += t.numel()
    views[0].fill_(-1)  # writes through to flat
    assert torch.equal(flat[:12], torch.full((12,), -1, dtype=flat_dtype))
    assert torch.equal(fn(apex_C.flatten(ts), ts)[3], ts[3])  # round trip


def test_unflatten_of_a_strided_flat():
    flat = torch.arange(24.0)[::2]
    views = apex_C.unflatten(flat, [torch.empty(2, 3), torch.empty(6)])
    assert torch.equal(views[0], torch.tensor([[0.0, 2, 4], [6, 8, 10]]))
    views[1].zero_()
    assert torch.equal(flat[6:], torch.zeros(6))


@pytest.mark.parametrize("call,exc,match", [
    (lambda: apex_C.flatten([]), ValueError, "expected at least one tensor"),
    (lambda: apex_C.flatten(torch.ones(3)), TypeError, "list or tuple of tensors, got Tensor"),
    (lambda: apex_C.flatten([torch.ones(2), 3.0]), TypeError, r"tensors\[1\] must be a tensor, got float"),
    (lambda: apex_C.flatten([torch.ones(2).to_sparse()]), TypeError, r"tensors\[0\] must be a dense"),
    (lambda: apex_C.flatten([torch.ones(2), torch.ones(2, device="meta")]), ValueError,
     r"tensors\[1\] is on meta, tensors\[0\] on cpu"),
    (lambda: apex_C.unflatten(torch.ones(5), [torch.ones(2, 3)]), ValueError,
     "flat has 5 elements; the 1 tensors need 6"),
    (lambda: apex_C.unflatten(torch.ones(2, 3), [torch.ones(6)]), ValueError, r"flat must be 1-D, got shape \(2, 3\)"),
    (lambda: apex_C.unflatten([1.0], [torch.ones(1)]), TypeError, "flat must be a tensor, got list"),
    (lambda: apex_C.unflatten(torch.ones(3), {"a": torch.ones(3)}), TypeError, "list or tuple of tensors, got dict"),
    (lambda: apex_C.unflatten(torch.ones(3).to_sparse(), [torch.ones(3)]), TypeError, "flat must be a dense"),
])
def test_bad_arguments_raise_clear_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_apex_c_import_stays_torch_free():
    # the two forwarding functions import apex (and torch) only when called
    code = ("import sys, apex_C\n"
            "assert 'torch' not in sys.modules and 'apex' not in sys.modules\n"
            "assert callable(apex_C.flatten) and callable(apex_C.unflatten)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-S", "-c", code], check=True, env=env, timeout=300)


def test_parallel_distributed_exports_upstream_names():
    from apex.parallel import distributed

    assert distributed.flatten is fl.flatten and distributed.unflatten is fl.unflatten


def _nested():
    with warnings.catch_warnings():  # torch's "prototype stage" notice for the strided nested layout
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


@pytest.mark.parametrize("call,match", [
    (lambda n: apex_C.flatten([torch.ones(2), n]), r"apex_C.flatten: tensors\[1\] must be a dense \(strided\) "
     "tensor, got a nested tensor"),
    (lambda n: apex_C.unflatten(torch.ones(6), [n]), r"apex_C.unflatten: tensors\[0\] must be a dense"),
    (lambda n: apex_C.unflatten(n, [torch.ones(2)]), "apex_C.unflatten: flat must be a dense .* nested tensor"),
])
def test_nested_tensors_are_refused_by_name(call, match):
    # a nested tensor reports the strided layout, so the layout check alone lets it through
    nested = _nested()
    before = [t.clone() for t in nested.unbind()]
    with pytest.raises(TypeError, match=match):
        call(nested)
    assert all(torch.equal(a, b) for a, b in zip(nested.unbind(), before))
