"""apex.contrib.combine_tensors: layout, in-place rebinding, autograd, parts, validity, errors, checkpoints.

Every test runs on the ``device`` fixture (``--device``); the "other device" in
the mixed-device cases is ``meta``, which exists everywhere.
"""

import copy
import io
import sys
import types
from collections import namedtuple

import pytest
import torch

from apex import _device
from apex.contrib import (
    ALIGN_ELEMENTS,
    change_data_ptr,
    combine_npu,
    combine_tensors,
    compact_state_dict,
    get_part_combined_tensor,
    is_combined_tensor_valid,
    npu_combine_tensors,
    plan_layout,
    register_compact_state_dict_hook,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [0, 1, 7, 4097]
Pair = namedtuple("Pair", "a b")  # module level, so torch.save can pickle it


def _ids(dtypes):
    return [str(d).replace("torch.", "") for d in dtypes]


def _make(sizes, dtype, device):
    return [torch.randn(n, dtype=torch.float32).to(device=device, dtype=dtype) for n in sizes]


def _expected_offsets(numels):
    """Reference for the documented rule: slot i starts at end of slot i-1 rounded up to 32."""
    offsets, end = [], 0
    for n in numels:
        start = -(-end // 32) * 32
        offsets.append(start)
        end = start + n
    return offsets, end


def _snapshot(items):
    """What must not change when combine_tensors raises: pointer, strides and values of every tensor."""
    return [
        (t, t.data_ptr(), t.stride(), t.detach().clone())
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested
        else (t, None, None, None)
        for t in items
    ]


def _assert_unchanged(snapshot):
    for t, ptr, stride, values in snapshot:
        if ptr is None:
            continue
        assert t.data_ptr() == ptr and t.stride() == stride
        if t.device.type != "meta":
            assert torch.equal(t, values)


# ---------------------------------------------------------------- layout


def test_plan_layout_follows_the_32_element_rule():
    numels = [0, 1, 7, 4097, 32, 33, 0, 64]
    tensors = [torch.empty(n) for n in numels]
    assert ALIGN_ELEMENTS == 32
    assert plan_layout(tensors) == _expected_offsets(numels)
    assert plan_layout(numels) == _expected_offsets(numels)  # plain counts are accepted too
    offsets, total = plan_layout(tensors)
    assert all(o % 32 == 0 for o in offsets)
    assert total == offsets[-1] + numels[-1]  # no tail padding


def test_plan_layout_empty_and_bad_entries():
    assert plan_layout([]) == ([], 0)
    for bad in (None, -1, 1.5, True, "7"):
        with pytest.raises(TypeError, match="entry 1"):
            plan_layout([3, bad])


# ---------------------------------------------------------------- combine: storage sharing and values


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
def test_combine_shares_storage_and_keeps_values(device, dtype):
    shapes = [(0,), (1,), (7,), (4097,), (3, 5), (2, 3, 4)]
    tensors = [torch.randn(s).to(device=device, dtype=dtype) for s in shapes]
    before = [t.clone() for t in tensors]
    objects = [id(t) for t in tensors]

    buf = combine_tensors(tensors)

    offsets, total = _expected_offsets([t.numel() for t in tensors])
    assert buf.shape == (total,) and buf.dtype == dtype and buf.device.type == device
    assert [id(t) for t in tensors] == objects
    for t, ref, off in zip(tensors, before, offsets):
        assert t.shape == ref.shape and t.is_contiguous()
        assert torch.equal(t, ref)
        assert t.storage_offset() == off  # data_ptr() reads 0 for empty tensors, so check the slot this way
        assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        if t.numel():
            assert t.data_ptr() == buf.data_ptr() + off * buf.element_size()
    # padding between slots stays zero
    covered = torch.zeros(total, dtype=torch.bool, device=device)
    for t, off in zip(tensors, offsets):
        covered[off:off + t.numel()] = True
    assert not buf[~covered].any()
    # writes through either side are seen by the other
    big = tensors[3]
    big.mul_(2)
    assert torch.equal(buf[offsets[3]:offsets[3] + 4097], before[3].mul(2).reshape(-1))
    buf[offsets[4]:offsets[4] + 15] = 3.0
    assert torch.equal(tensors[4], torch.full((3, 5), 3.0, dtype=dtype, device=device))
    assert is_combined_tensor_valid(buf, tensors)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
def test_combine_single_tensor_of_each_size(device, dtype, size):
    (t,) = _make([size], dtype, device)
    ref = t.clone()
    buf = combine_tensors([t])
    assert buf.numel() == size
    assert torch.equal(t, ref)
    if size:
        assert t.data_ptr() == buf.data_ptr()
        assert torch.equal(buf, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
def test_combine_without_copy_gives_zeros(device, dtype):
    tensors = _make(SIZES, dtype, device)
    buf = combine_tensors(tensors, require_copy_value=False)
    assert not buf.any()
    assert all(not t.any() for t in tensors)
    assert is_combined_tensor_valid(buf, tensors)


def test_float64_is_accepted(device):
    if device == "npu":
        pytest.skip("npu has no float64 support")
    tensors = _make([3, 40], torch.float64, device)
    ref = [t.clone() for t in tensors]
    buf = combine_tensors(tensors)
    assert buf.dtype == torch.float64 and all(torch.equal(a, b) for a, b in zip(tensors, ref))


def test_aliases():
    # apex.contrib.combine_tensors is the callable submodule; torch_npu's name aliases its function, while
    # the Ascend patch's combine_npu is its own function (the patch's layout).
    from apex.contrib.combine_tensors import combine_tensors as combine_fn

    assert npu_combine_tensors is combine_fn and combine_npu is not combine_fn


def test_empty_list(device):
    assert combine_tensors([]) is None  # like the original combine_npu([])
    assert combine_tensors(iter([])) is None
    with pytest.raises(ValueError, match="at least one tensor"):
        combine_tensors([], allow_empty=False)


def test_accepts_any_iterable_and_slices_of_one_tensor(device):
    base = torch.arange(10, dtype=torch.float32, device=device)
    a, b = base[:5], base[5:]  # disjoint views of one storage are fine
    buf = combine_tensors(t for t in (a, b))
    assert torch.equal(buf[:5], base[:5]) and torch.equal(buf[32:37], base[5:])
    a.fill_(-1)  # now decoupled from base: the buffer is their memory
    assert torch.equal(base, torch.arange(10, dtype=torch.float32, device=device))


def test_recombining_moves_to_a_new_buffer(device):
    tensors = _make([5, 9], torch.float32, device)
    first = combine_tensors(tensors)
    ref = [t.clone() for t in tensors]
    second = combine_tensors(tensors)
    assert not is_combined_tensor_valid(first, tensors) and is_combined_tensor_valid(second, tensors)
    assert all(torch.equal(t, r) for t, r in zip(tensors, ref))


# ---------------------------------------------------------------- strides


@pytest.mark.parametrize(
    "make",
    [
        lambda d: torch.randn(2, 3, 4, 5, device=d).to(memory_format=torch.channels_last),
        lambda d: torch.randn(2, 3, 2, 4, 5, device=d).to(memory_format=torch.channels_last_3d),
        lambda d: torch.randn(6, 7, device=d).t(),
        lambda d: torch.randn(2, 3, 4, device=d).permute(2, 0, 1),
        lambda d: torch.randn(4, 1, 3, device=d)[:, :, :],
    ],
    ids=["channels_last", "channels_last_3d", "transposed", "permuted", "size1_dim"],
)
def test_dense_strided_tensors_keep_their_strides(device, make):
    t = make(device)
    ref, stride = t.clone(), t.stride()
    buf = combine_tensors([torch.randn(3, device=device), t])
    assert t.stride() == stride and t.shape == ref.shape
    assert torch.equal(t, ref)
    assert t.data_ptr() == buf.data_ptr() + 32 * buf.element_size()
    t.add_(1)  # every element of the slot is reached exactly once
    assert torch.equal(buf[32:32 + t.numel()].sort().values, (ref + 1).reshape(-1).sort().values)


# ---------------------------------------------------------------- autograd and optimizers


def _mlp(dtype, device):
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.Tanh(), torch.nn.Linear(33, 3)).to(device, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
def test_backward_and_sgd_step_through_combined_params(device, dtype):
    model, ref_model = _mlp(dtype, device), _mlp(dtype, device)
    params = list(model.parameters())
    ids = [id(p) for p in params]
    buf = combine_tensors(params)
    assert [id(p) for p in model.parameters()] == ids
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad and p.is_leaf for p in params)

    x = torch.randn(5, 7).to(device, dtype)
    model(x).square().sum().backward()
    ref_model(x).square().sum().backward()
    for p, r in zip(params, ref_model.parameters()):
        assert p.grad is not None and p.grad.shape == p.shape
        torch.testing.assert_close(p.grad, r.grad)  # same math on the same values: dtype-default tolerance

    lr = 0.125
    torch.optim.SGD(params, lr=lr).step()
    torch.optim.SGD(ref_model.parameters(), lr=lr).step()
    offsets, _ = plan_layout(params)
    for p, r, off in zip(params, ref_model.parameters(), offsets):
        torch.testing.assert_close(p.detach(), r.detach())
        # the step went into the buffer, not into a detached copy
        assert torch.equal(get_part_combined_tensor(buf, off, p.numel()), p.detach().reshape(-1))
    assert is_combined_tensor_valid(buf, params)


# ---------------------------------------------------------------- parts


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
def test_parts_cover_exactly_their_ranges(device, dtype):
    tensors = _make(SIZES, dtype, device)
    buf = combine_tensors(tensors)
    offsets, total = plan_layout(tensors)
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        part = get_part_combined_tensor(buf, off, t.numel())
        assert part.shape == (t.numel(),)
        assert torch.equal(part, t.reshape(-1))
        part.fill_(i + 1)  # writes through the part reach the tensor
        assert torch.all(t == i + 1)
    expected = torch.zeros(total, dtype=dtype, device=device)
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        expected[off:off + t.numel()] = i + 1
    assert torch.equal(buf, expected)  # nothing outside the parts was touched
    assert get_part_combined_tensor(buf, total, 0).numel() == 0


def test_part_errors(device):
    buf = torch.zeros(10, device=device)
    with pytest.raises(ValueError, match="index must be >= 0, got -1"):
        get_part_combined_tensor(buf, -1, 2)
    with pytest.raises(ValueError, match="size must be >= 0, got -2"):
        get_part_combined_tensor(buf, 0, -2)
    with pytest.raises(IndexError, match=r"\[8, 11\).*10 elements"):
        get_part_combined_tensor(buf, 8, 3)
    with pytest.raises(TypeError, match=r"index must be an int, got 1.0 \(float\)"):
        get_part_combined_tensor(buf, 1.0, 2)
    with pytest.raises(TypeError, match=r"size must be an int, got True \(bool\)"):
        get_part_combined_tensor(buf, 1, True)
    with pytest.raises(TypeError, match="combined must be a tensor, got NoneType"):
        get_part_combined_tensor(None, 0, 1)
    with pytest.raises(ValueError, match="contiguous"):
        get_part_combined_tensor(torch.zeros(4, 4, device=device).t(), 0, 1)


# ---------------------------------------------------------------- validity


def test_validity_is_stricter_than_pointer_range(device):
    tensors = _make([5, 40, 3], torch.float32, device)
    buf = combine_tensors(tensors)
    assert is_combined_tensor_valid(buf, tensors)
    assert is_combined_tensor_valid(buf, []) and is_combined_tensor_valid(None, [])
    assert not is_combined_tensor_valid(None, tensors)
    assert not is_combined_tensor_valid(buf, tensors[::-1])  # inside the buffer, but not at the planned slots
    assert not is_combined_tensor_valid(buf, [*tensors, torch.zeros(2, device=device)])  # beyond the buffer
    assert not is_combined_tensor_valid(buf[:40], tensors)  # buffer too short
    change_data_ptr(tensors[2], buf, 1)  # still inside the buffer's address range, at the wrong offset
    assert not is_combined_tensor_valid(buf, tensors)
    change_data_ptr(tensors[2], buf, 96)
    assert is_combined_tensor_valid(buf, tensors)
    assert not is_combined_tensor_valid(buf.half(), tensors)  # other dtype
    assert not is_combined_tensor_valid(buf, [*tensors[:2], None])
    with pytest.raises(TypeError, match="combined must be a tensor or None, got list"):
        is_combined_tensor_valid([1.0], tensors)
    assert not is_combined_tensor_valid(buf, [*tensors[:2], _sparse(tensors[2])])
    tensors[0].data = tensors[0].clone()  # rebound elsewhere
    assert not is_combined_tensor_valid(buf, tensors)


def test_validity_of_empty_tensors(device):
    tensors = [torch.zeros(0, device=device), torch.zeros(2, 0, device=device)]
    buf = combine_tensors(tensors)
    assert buf.numel() == 0 and is_combined_tensor_valid(buf, tensors)
    assert not is_combined_tensor_valid(buf, [torch.zeros(0, device=device)])  # data_ptr 0 alone proves nothing


# ---------------------------------------------------------------- change_data_ptr


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
def test_change_data_ptr(device, dtype):
    src = torch.arange(20).to(device, dtype)
    dst = torch.zeros(2, 3, device=device, dtype=dtype)
    ident = id(dst)
    out = change_data_ptr(dst, src, 4)
    assert out is dst and id(dst) == ident and dst.shape == (2, 3)
    assert torch.equal(dst.reshape(-1), src[4:10])
    dst.fill_(-1)
    assert torch.all(src[4:10] == -1) and src[3] == 3 and src[10] == 10
    src[4] = 7
    assert dst[0, 0] == 7
    change_data_ptr(dst, src, 14)  # last slot that fits
    assert torch.equal(dst.reshape(-1), src[14:])


def test_change_data_ptr_offsets_from_the_first_element_of_src(device):
    storage = torch.arange(10, dtype=torch.float32, device=device)
    src = storage[4:]
    dst = torch.zeros(2, device=device)
    change_data_ptr(dst, src, 1)
    assert torch.equal(dst, storage[5:7])


def test_change_data_ptr_errors_leave_dst_alone(device):
    src = torch.zeros(10, device=device)
    dst = torch.ones(4, device=device)
    snap = _snapshot([dst])
    cases = [
        (TypeError, "same dtype|share a dtype", lambda: change_data_ptr(dst, src.double(), 0)),
        (ValueError, "one device", lambda: change_data_ptr(dst, torch.zeros(10, device="meta"), 0)),
        (ValueError, "offset must be >= 0, got -1", lambda: change_data_ptr(dst, src, -1)),
        (IndexError, r"\[7, 11\).*has 10", lambda: change_data_ptr(dst, src, 7)),
        (TypeError, "dst must be a tensor", lambda: change_data_ptr([1.0], src, 0)),
        (TypeError, "src must be a tensor", lambda: change_data_ptr(dst, None, 0)),
        (TypeError, "offset must be an int", lambda: change_data_ptr(dst, src, 1.5)),
        (ValueError, "non-overlapping and dense", lambda: change_data_ptr(torch.ones(8, device=device)[::2], src, 0)),
        (ValueError, "dst must be a dense .strided. tensor, got layout torch.sparse_coo",
         lambda: change_data_ptr(_sparse(torch.ones(3, device=device)), src, 0)),
        (ValueError, "src must be a contiguous .flat. tensor, got layout torch.sparse_coo",
         lambda: change_data_ptr(dst, _sparse(torch.ones(10, device=device)), 0)),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()
        _assert_unchanged(snap)


# ---------------------------------------------------------------- bad inputs


def _sparse(x):
    """``x`` as a sparse COO tensor; a skip on a device without a sparse layout (the emulated npu has none)."""
    try:
        return x.to_sparse()
    except (NotImplementedError, RuntimeError) as exc:
        pytest.skip(f"{x.device.type} has no sparse layout here ({type(exc).__name__})")


def _nested(*xs):
    """A nested tensor of ``xs``; a skip where the device has none."""
    try:
        return torch.nested.nested_tensor(list(xs), layout=torch.jagged)
    except (NotImplementedError, RuntimeError) as exc:
        pytest.skip(f"{xs[0].device.type} has no nested tensors here ({type(exc).__name__})")


def _bad_cases(device):
    """name -> (exception, message pattern, inputs), the inputs made on first use. Entry 0 is always a good
    tensor: had validation run after mutating anything, it would have been rebound, which the test checks."""
    t = lambda *s: torch.randn(*s, device=device)  # noqa: E731
    shared = t(10)
    same = t(4)
    return {
        "none_entry": (TypeError, "entry 1: expected a tensor, got None", lambda: [t(3), None]),
        "non_tensor": (TypeError, "entry 1: expected a tensor, got float", lambda: [t(3), 2.0]),
        "list_entry": (TypeError, "entry 1: expected a tensor, got list", lambda: [t(3), [1.0, 2.0]]),
        "mixed_dtypes": (TypeError, "entry 0 is torch.float32, entry 1 is torch.float16", lambda: [t(3), t(3).half()]),
        "mixed_devices": (ValueError, "one device.*entry 1 on meta", lambda: [t(3), torch.empty(3, device="meta")]),
        "gaps": (ValueError, "entry 1: .*gaps", lambda: [t(3), t(4, 6)[:, ::2]]),
        "expanded": (ValueError, "entry 1: .*overlapping", lambda: [t(3), t(3, 1).expand(3, 4)]),
        "internal_overlap": (ValueError, "entry 1: .*overlapping", lambda: [t(3), t(9).as_strided((3, 3), (1, 1))]),
        "sparse": (TypeError, "entry 1: expected a dense.*sparse", lambda: [t(3), _sparse(t(3, 3))]),
        "nested": (TypeError, "entry 1: expected a dense .strided. tensor, got a nested tensor",
                   lambda: [t(3), _nested(t(2), t(3))]),
        "complex": (TypeError, "entry 1: .*floating-point tensor, got torch.complex64", lambda: [t(3), t(3).cfloat()]),
        "int64": (TypeError, "floating-point tensor, got torch.int64", lambda: [t(3), torch.arange(3, device=device)]),
        "int32": (TypeError, "got torch.int32", lambda: [t(3), torch.zeros(3, dtype=torch.int32, device=device)]),
        "uint8": (TypeError, "got torch.uint8", lambda: [t(3), torch.zeros(3, dtype=torch.uint8, device=device)]),
        "bool": (TypeError, "got torch.bool", lambda: [t(3), torch.zeros(3, dtype=torch.bool, device=device)]),
        "same_tensor_twice": (ValueError, "entries 1 and 3 are the same tensor", lambda: [t(3), same, t(2), same]),
        "shared_memory": (ValueError, "entries 1 and 2 share memory", lambda: [t(3), shared[:6], shared[4:]]),
    }


@pytest.mark.parametrize("case", list(_bad_cases("cpu")))
def test_bad_inputs_raise_and_change_nothing(device, case):
    exc, msg, make = _bad_cases(device)[case]
    items = make()
    snap = _snapshot(items)
    with pytest.raises(exc, match=msg):
        combine_tensors(items)
    _assert_unchanged(snap)


def test_inference_tensors_combine_only_inside_inference_mode():
    """Outside inference mode, rebinding an inference tensor would leave one torch refuses to use (its version
    counter is gone): TypeError, the tensor unchanged. Inside inference mode they combine like any tensor."""
    with torch.inference_mode():
        a, b = torch.ones(3), torch.full((2,), 2.0)
    with pytest.raises(TypeError, match="entry 1: expected a normal tensor, got an inference tensor"):
        combine_tensors([torch.zeros(4), a])
    assert torch.equal(a, torch.ones(3)) and a.is_inference()
    with torch.inference_mode():
        flat = combine_tensors([a, b])
        assert is_combined_tensor_valid(flat, [a, b])
        assert torch.equal(a, torch.ones(3)) and torch.equal(b, torch.full((2,), 2.0))


def test_not_a_list():
    with pytest.raises(TypeError, match="a single tensor of shape"):
        combine_tensors(torch.zeros(3))
    with pytest.raises(TypeError, match="got None"):
        combine_tensors(None)
    with pytest.raises(TypeError, match="got int"):
        combine_tensors(5)


# ---------------------------------------------------------------- checkpoints


def _bytes_of(obj):
    f = io.BytesIO()
    torch.save(obj, f)
    return f.getvalue()


def _saved_bytes(obj):
    return len(_bytes_of(obj))


def test_module_state_dict_hook_keeps_checkpoints_compact(device):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(256, 256)).to(device)
    buf = combine_tensors(list(model.parameters()))
    small = model[0]
    small_bytes = sum(p.numel() * p.element_size() for p in small.parameters())
    buf_bytes = buf.numel() * buf.element_size()
    assert buf_bytes > 100 * small_bytes
    # compact by default: combining hooked the modules holding the params
    assert _saved_bytes(small.state_dict()) < small_bytes + 4096

    handle = register_compact_state_dict_hook(small)  # the explicit hook still works on top
    sd = small.state_dict()
    assert _saved_bytes(sd) < small_bytes + 4096  # the tensors' own bytes + pickle overhead
    assert hasattr(sd, "_metadata")
    assert is_combined_tensor_valid(buf, list(model.parameters()))  # the module itself is untouched
    fresh = torch.nn.Linear(4, 4).to(device)
    fresh.load_state_dict(torch.load(io.BytesIO(_bytes_of(sd)), weights_only=True))
    assert torch.equal(fresh.weight, small.weight) and torch.equal(fresh.bias, small.bias)

    handle.remove()
    assert _saved_bytes(small.state_dict()) < small_bytes + 4096


def test_module_hook_with_prefix_compacts_only_its_entries(device):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(8, 8)).to(device)
    combine_tensors(list(model.parameters()))
    register_compact_state_dict_hook(model[1])
    sd = model.state_dict()
    assert all(sd[k].untyped_storage().nbytes() == sd[k].numel() * 4 for k in ("1.weight", "1.bias"))
    assert sd["0.weight"].untyped_storage().nbytes() == sd["0.weight"].numel() * 4  # the default hook's


def test_compact_state_dict_clones_views_and_never_mutates(device):
    buf = torch.zeros(1000, device=device)
    view = buf[10:20]
    whole = torch.ones(5, device=device)
    inner = {"exp_avg": view, "step": 3}
    obj = {"state": {0: inner}, "tied": [view, view], "pair": Pair(view, whole), "other": "x"}

    out = compact_state_dict(obj)

    assert obj["state"][0] is inner and inner["exp_avg"] is view  # input untouched (live optimizer state)
    c = out["state"][0]["exp_avg"]
    assert c is not view and torch.equal(c, view) and c.untyped_storage().nbytes() == 40
    assert out["tied"][0] is out["tied"][1] is c  # one clone per distinct view: sharing survives
    assert isinstance(out["pair"], Pair) and out["pair"].b is whole  # compact tensors are not copied
    assert out["state"][0]["step"] == 3 and out["other"] == "x"
    assert _saved_bytes(out) < 4096 < _saved_bytes(obj)


def test_compact_keeps_strides_and_parameter_type(device):
    buf = torch.zeros(500, device=device)
    p = torch.nn.Parameter(torch.randn(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last))
    combine_tensors([torch.zeros(3, device=device), p])
    assert p.untyped_storage().nbytes() > p.numel() * 4
    out = compact_state_dict({"p": p, "b": buf})
    assert isinstance(out["p"], torch.nn.Parameter) and out["p"].stride() == p.stride()
    assert torch.equal(out["p"], p) and out["b"] is buf


def test_optimizer_state_dict_hook(device):
    params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in (3, 50)]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    bufs = [opt.state[p]["momentum_buffer"] for p in params]
    big = torch.zeros(10_000, device=device)
    combined = combine_tensors([*bufs, big])  # states share a buffer with something large
    register_compact_state_dict_hook(opt)
    sd = opt.state_dict()
    assert _saved_bytes(sd) < 4096 < combined.numel() * 4
    for i, p in enumerate(params):
        assert torch.equal(sd["state"][i]["momentum_buffer"], opt.state[p]["momentum_buffer"])
    assert is_combined_tensor_valid(combined, [*bufs, big])  # the live state still shares the buffer
    assert all(opt.state[p]["momentum_buffer"] is b for p, b in zip(params, bufs))


def test_compact_state_dict_refuses_a_container_that_contains_itself():
    sd = {"w": torch.zeros(8)[:2]}
    sd["again"] = [sd]
    with pytest.raises(ValueError, match="a dict contains itself"):
        compact_state_dict(sd)
    shared = torch.zeros(8)
    same = {"a": shared[:2], "b": shared[:2]}  # one object twice, no cycle: both copied
    out = compact_state_dict({"x": same, "y": same})
    assert out["x"]["a"].untyped_storage().nbytes() == 8 and torch.equal(out["y"]["b"], shared[:2])


def test_hook_rejects_other_objects():
    with pytest.raises(TypeError, match=r"nn\.Module or Optimizer, got dict"):
        register_compact_state_dict_hook({})


# ---------------------------------------------------------------- npu private formats (test double)


def _fake_torch_npu(calls):
    """Test double for torch_npu: records the calls of its native combine/validity ops."""
    fake = types.ModuleType("torch_npu")

    def native_combine(tensors, require_copy_value=True):
        calls.append(("combine", [id(t) for t in tensors], require_copy_value))
        return "native-buffer"

    def native_valid(combined, tensors):
        calls.append(("valid", combined, len(tensors)))
        return True

    fake.utils = types.SimpleNamespace(npu_combine_tensors=native_combine, is_combined_tensor_valid=native_valid)
    return fake


def test_private_npu_formats_go_to_torch_npu(monkeypatch):
    """With a torch_npu test double in sys.modules and every tensor reported as FRACTAL_NZ-like,
    combine_tensors hands the list to torch_npu's native op and rebinds nothing itself."""
    calls = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls))
    monkeypatch.setattr(_device, "any_npu_private_format", lambda tensors: True)
    tensors = [torch.randn(3), torch.randn(4)]
    ptrs = [t.data_ptr() for t in tensors]
    assert combine_tensors(tensors, require_copy_value=False) == "native-buffer"
    assert calls == [("combine", [id(t) for t in tensors], False)]
    assert [t.data_ptr() for t in tensors] == ptrs
    assert is_combined_tensor_valid(torch.zeros(1), tensors)
    assert calls[-1][0] == "valid"


def test_private_npu_format_without_native_op_is_an_error(monkeypatch):
    """torch_npu test double without any combine op: a clear RuntimeError, nothing rebound."""
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(_device, "any_npu_private_format", lambda tensors: True)
    tensors = [torch.randn(3)]
    snap = _snapshot(tensors)
    with pytest.raises(RuntimeError, match="npu_combine_tensors"):
        combine_tensors(tensors)
    _assert_unchanged(snap)


def test_deepcopy_of_combined_module_is_independent(device):
    model = torch.nn.Linear(3, 3).to(device)
    buf = combine_tensors(list(model.parameters()))
    clone = copy.deepcopy(model)
    clone.weight.data.fill_(5)
    assert not torch.any(buf == 5)
