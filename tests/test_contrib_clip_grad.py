"""apex.contrib.clip_grad.clip_grad_norm_ (NVIDIA Apex's name): torch.nn.utils.clip_grad_norm_ is the reference.

Same inputs on copies, compared bitwise (both sides run torch's math); bad arguments raise before any grad moves.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from apex.contrib.clip_grad import clip_grad_norm_
from apex.contrib.clip_grad import clip_grad_norm_ as via_module

SHAPES = [(3, 4), (1,), (0,), (5, 1, 2), (), (33,)]


def _params(dtypes, scale=10.0, none_at=(2,)):
    g = torch.Generator().manual_seed(1)
    ps = []
    for k, s in enumerate(SHAPES):
        dtype = dtypes[k % len(dtypes)]
        p = torch.nn.Parameter(torch.randn(s, generator=g).to(dtype))
        if k not in none_at:
            p.grad = (torch.randn(s, generator=g) * scale).to(dtype)
        ps.append(p)
    return ps


def _copies(ps):
    out = []
    for p in ps:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


@pytest.mark.parametrize("dtypes", [[torch.float32], [torch.bfloat16], [torch.float16],
                                    [torch.float32, torch.float16, torch.bfloat16, torch.float64]], ids=str)
@pytest.mark.parametrize("norm_type", [2.0, 1, 3.5, math.inf, "inf"])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # clipped / left alone
def test_matches_torch(dtypes, norm_type, max_norm):
    ps = _params(dtypes)
    ref = _copies(ps)
    total = clip_grad_norm_(ps, max_norm, norm_type=norm_type)
    want = torch.nn.utils.clip_grad_norm_([q for q in ref if q.grad is not None], max_norm, norm_type=norm_type)
    assert total.shape == () and torch.equal(total, want)
    for p, q in zip(ps, ref):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert p.grad.dtype == q.grad.dtype and torch.equal(p.grad, q.grad)


def test_single_tensor_generators_and_no_grads():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    assert torch.equal(clip_grad_norm_(p, 1.0), torch.tensor(6.0))
    torch.testing.assert_close(p.grad.norm(), torch.tensor(1.0), rtol=1e-6, atol=0)
    model = torch.nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    assert clip_grad_norm_(model.parameters(), 1e9) > 0  # a generator, consumed once
    assert torch.equal(via_module([torch.nn.Parameter(torch.ones(2))], 1.0), torch.tensor(0.0))
    assert torch.equal(clip_grad_norm_([], 1.0), torch.tensor(0.0))


def test_nonfinite_norm():
    ps = _params([torch.float32])
    ps[0].grad[0, 0] = float("nan")
    before = [None if p.grad is None else p.grad.clone() for p in ps]
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(ps, 1.0, error_if_nonfinite=True)
    for p, b in zip(ps, before):  # raised before scaling
        if b is not None:
            torch.testing.assert_close(p.grad, b, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(clip_grad_norm_(ps, 1.0))  # without the flag: torch's behaviour


@pytest.mark.parametrize("args,kwargs,exc,match", [
    ((5, 1.0), {}, TypeError, "parameters must be a tensor or an iterable of tensors, got int"),
    (([torch.ones(1), "w"], 1.0), {}, TypeError, r"parameters\[1\] must be a tensor, got str"),
    ((None, 1.0), {}, TypeError, "got NoneType"),
    ((..., -1.0), {}, ValueError, "max_norm must be >= 0, got -1.0"),
    ((..., float("nan")), {}, ValueError, "max_norm must be >= 0"),
    ((..., None), {}, TypeError, "max_norm must be a number, got None"),
    ((..., True), {}, TypeError, "max_norm must be a number, got True"),
    ((..., "big"), {}, ValueError, "max_norm must be a number or 'inf', got 'big'"),
    ((..., torch.ones(2)), {}, TypeError, r"max_norm must be a number, got a tensor of shape \(2,\)"),
    ((..., 1.0), {"norm_type": 0}, ValueError, "norm_type must be a positive number or 'inf', got 0.0"),
    ((..., 1.0), {"norm_type": "two"}, ValueError, "norm_type must be a number or 'inf', got 'two'"),
    ((..., 1.0), {"error_if_nonfinite": "yes"}, TypeError, "error_if_nonfinite must be a bool"),
])
def test_bad_arguments_change_nothing(args, kwargs, exc, match):
    ps = _params([torch.float32])
    before = [None if p.grad is None else p.grad.clone() for p in ps]
    args = tuple(ps if a is ... else a for a in args)
    with pytest.raises(exc, match=match):
        clip_grad_norm_(*args, **kwargs)
    for p, b in zip(ps, before):
        assert (p.grad is None and b is None) or torch.equal(p.grad, b)


@pytest.mark.parametrize("max_norm", [np.float32(0.5), np.float64(0.5), np.int64(1), "0.5", torch.tensor(0.5)],
                         ids=lambda v: type(v).__name__)
def test_max_norm_is_read_as_upstream_float_reads_it(max_norm):
    ps = _params([torch.float32])
    ref = _copies(ps)
    total = clip_grad_norm_(ps, max_norm)
    assert torch.equal(total, torch.nn.utils.clip_grad_norm_([q for q in ref if q.grad is not None], float(max_norm)))
    for p, q in zip(ps, ref):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)


def test_tensor_max_norm_is_read_out():
    ps = _params([torch.float32])
    ref = _copies(ps)
    total = clip_grad_norm_(ps, torch.tensor(0.5))
    assert torch.equal(total, torch.nn.utils.clip_grad_norm_([q for q in ref if q.grad is not None], 0.5))


def test_empty_grads_are_left_out_of_every_norm():
    """An empty grad changes no p-norm: the infinity norm is the max over the others (torch's foreach infinity
    norm raises on an empty tensor), and only empty grads give tensor(0.)."""
    from apex.contrib.clip_grad import clip_grad_norm_

    ps = [torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 0))]
    for p, g in zip(ps, (torch.zeros(0), torch.tensor([3.0, -4.0, 1.0]), torch.zeros(2, 0))):
        p.grad = g
    assert clip_grad_norm_(ps, 1.0, norm_type="inf").item() == 4.0
    torch.testing.assert_close(ps[1].grad, torch.tensor([3.0, -4.0, 1.0]) * (1.0 / (4.0 + 1e-6)))
    assert clip_grad_norm_([ps[0], ps[2]], 1.0, norm_type=float("inf")).item() == 0.0


def _with_grad(p, grad):
    p.grad = grad
    return p


@pytest.mark.parametrize("make,match", [
    (lambda: _with_grad(torch.zeros(3, requires_grad=True), torch.ones(3).to_sparse()),
     r"must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    (lambda: _with_grad(torch.zeros(3, device="meta", requires_grad=True), torch.ones(3, device="meta")),
     "must hold values, got a tensor on the meta device"),
])
def test_sparse_and_meta_grads_are_refused_by_name_changing_nothing(make, match):
    ps = _params([torch.float32])
    before = [None if p.grad is None else p.grad.clone() for p in ps]
    bad = make()
    with pytest.raises(TypeError, match=rf"clip_grad_norm_: parameters\[{len(ps)}\].grad {match}"):
        clip_grad_norm_([*ps, bad], 1e-3)
    for p, b in zip(ps, before):
        assert (p.grad is None and b is None) or torch.equal(p.grad, b)
    if not bad.is_meta:
        assert torch.equal(bad.grad.to_dense(), torch.ones(3))
