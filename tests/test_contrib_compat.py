"""The Ascend patch's contrib API: module-style combine_tensors access and get_aligned_storage_size."""

import importlib

import pytest
import torch

import apex.contrib
import apex.contrib.combine_tensors as ct
from apex.contrib import combine_tensors, get_aligned_storage_size


def test_module_style_access():
    assert ct is importlib.import_module("apex.contrib.combine_tensors")
    assert apex.contrib.combine_tensors is ct
    for name in ("combine_npu", "get_part_combined_tensor", "is_combined_tensor_valid", "change_data_ptr",
                 "get_aligned_storage_size", "npu_combine_tensors"):
        assert callable(getattr(ct, name)), name
    assert set(ct.__all__) <= set(dir(apex.contrib))


def test_package_name_is_callable_and_combines(device):
    params = [torch.randn(3, 4, device=device), torch.randn(5, device=device)]
    values = [p.clone() for p in params]
    flat = combine_tensors(params)  # the README form: calling the module calls the function
    assert ct.is_combined_tensor_valid(flat, params)
    for p, v in zip(params, values):
        assert torch.equal(p, v)
    again = [torch.ones(2, device=device)]
    flat2 = ct.combine_npu(again)
    assert torch.equal(ct.get_part_combined_tensor(flat2, 0, 2), again[0])
    from apex.contrib.combine_tensors import combine_tensors as fn

    assert fn is not ct.combine_npu and fn([]) is None and combine_tensors([]) is None and ct.combine_npu([]) is None


def test_ascend_computation_scenario(device):
    # The Ascend test's arithmetic on a combined buffer; combine_npu lays it out as the patch did.
    x = torch.zeros((2, 2, 2, 2), device=device)
    y = torch.zeros((4, 4), device=device)
    z = torch.zeros((3, 3, 3), device=device)
    flat = ct.combine_npu([x, y, z])
    mask = ct.combine_npu([torch.ones_like(t) for t in (x, y, z)])
    assert flat.is_contiguous() and flat.data_ptr() == x.data_ptr()
    offsets, total = ct.plan_ascend_layout([x, y, z])
    assert flat.numel() == total and y.data_ptr() == x.data_ptr() + offsets[1] * x.element_size()
    flat += 2
    assert (x.sum(), y.sum(), z.sum()) == (32, 32, 54)
    for t in (x, y, z):
        t.mul_(2)
    assert (flat * mask).sum() == 236 == x.sum() + y.sum() + z.sum()


@pytest.mark.parametrize("shape,expected", [((2, 2, 2, 2), 48), ((4, 4), 48), ((3, 3, 3), 64), ((1,), 48),
                                            ((0,), 32), ((17,), 64), ((32,), 64)])
def test_aligned_storage_size_default_rule(shape, expected):
    # ceil(n / 16) * 16 + 32
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert get_aligned_storage_size(torch.zeros(shape, dtype=dtype)) == expected


def test_aligned_storage_size_arguments_and_views():
    t = torch.zeros(10)
    assert get_aligned_storage_size(t, align=4, pad=0) == 12
    assert get_aligned_storage_size(t, align=1, pad=5) == 15
    base = torch.zeros(6, 8)
    assert get_aligned_storage_size(base[:, :3]) == 80  # spans 5 * 8 + 3 = 43 elements: 48 + 32
    assert get_aligned_storage_size(base[:, :3], align=1, pad=0) == 43
    assert get_aligned_storage_size(base.t(), align=1, pad=0) == 48


@pytest.mark.parametrize("n", [2**53 + 1, 2**60 + 17])
def test_aligned_storage_size_is_exact_past_float_precision(n):
    t = torch.empty(n, device="meta")  # no memory: only the element count matters
    assert get_aligned_storage_size(t, 1, 0) == n
    assert get_aligned_storage_size(t) == -(-n // 16) * 16 + 32


def test_aligned_storage_size_bad_arguments():
    with pytest.raises(TypeError, match="expected a tensor"):
        get_aligned_storage_size([1.0, 2.0])
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        get_aligned_storage_size(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"got torch\.int32"):
        get_aligned_storage_size(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="align must be >= 1"):
        get_aligned_storage_size(torch.zeros(3), align=0)
    with pytest.raises(ValueError, match="pad must be >= 0"):
        get_aligned_storage_size(torch.zeros(3), pad=-1)
    with pytest.raises(TypeError, match="align must be an int"):
        get_aligned_storage_size(torch.zeros(3), align=2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_combine_npu_follows_the_ascend_layout(device, dtype):
    # Slot i holds ceil(n_i / 16) * 16 + 32 elements, slots back to back, the buffer exactly their sum:
    # data pointers step by get_aligned_storage_size and the storage is the sum of those sizes.
    shapes = [(2, 2, 2, 2), (4, 4), (3, 3, 3), (1,), (0,), (17,)]
    tensors = [torch.randn(s, device=device).to(dtype) for s in shapes]
    values = [t.clone() for t in tensors]
    sizes = [get_aligned_storage_size(t) for t in tensors]
    assert sizes == [48, 48, 64, 48, 32, 64]
    flat = ct.combine_npu(tensors)
    assert flat.dtype == dtype and flat.numel() == sum(sizes)
    assert flat.untyped_storage().nbytes() == sum(sizes) * flat.element_size()
    start = 0
    for t, v, size in zip(tensors, values, sizes):
        if t.numel():
            assert t.data_ptr() == flat.data_ptr() + start * flat.element_size()
        assert torch.equal(t, v)
        start += size
    # combined, each tensor still reports its own slot (torch_npu sizes the storage behind a view, which
    # is now the buffer's), so code written for the patch can step from one tensor to the next
    assert [get_aligned_storage_size(t) for t in tensors] == sizes
    for x, y in zip(tensors[:3], tensors[1:4]):
        assert y.data_ptr() == x.data_ptr() + get_aligned_storage_size(x) * x.element_size()
    assert ct.plan_ascend_layout(tensors) == ([0, 48, 96, 160, 208, 240], 304)
    assert ct.plan_ascend_layout([16, 0, 5]) == ([0, 48, 80], 128)
    # the padding is zero, so whole-buffer reductions see only the tensors
    assert flat.float().sum().item() == pytest.approx(sum(v.float().sum().item() for v in values), rel=1e-3, abs=1e-3)
    assert ct.is_combined_tensor_valid(flat, tensors)
    assert not ct.is_combined_tensor_valid(flat, tensors[::-1])


def test_combine_npu_keeps_the_checks_of_combine_tensors(device):
    with pytest.raises(TypeError, match="combine_npu: all tensors must share one dtype"):
        ct.combine_npu([torch.zeros(2, device=device), torch.zeros(2, device=device, dtype=torch.float16)])
    t = torch.zeros(3, device=device)
    with pytest.raises(ValueError, match="combine_npu: entries 0 and 1 are the same tensor"):
        ct.combine_npu([t, t])
    with pytest.raises(ValueError, match="combine_npu: expected at least one tensor"):
        ct.combine_npu([], allow_empty=False)
    with pytest.raises(TypeError, match="plan_ascend_layout: entry 0"):
        ct.plan_ascend_layout([-1])
    zeros = [torch.ones(3, device=device), torch.ones(2, device=device)]
    flat = ct.combine_npu(zeros, require_copy_value=False)
    assert flat.numel() == 96 and all(torch.equal(z, torch.zeros_like(z)) for z in zeros)


def test_both_layouts_are_valid_but_not_mixed(device):
    a = [torch.randn(5, device=device), torch.randn(40, device=device)]
    b = [torch.randn(5, device=device), torch.randn(40, device=device)]
    flat_a, flat_b = combine_tensors(a), ct.combine_npu(b)
    assert ct.is_combined_tensor_valid(flat_a, a) and ct.is_combined_tensor_valid(flat_b, b)
    assert a[1].data_ptr() - a[0].data_ptr() == 32 * 4 and b[1].data_ptr() - b[0].data_ptr() == 48 * 4
    assert not ct.is_combined_tensor_valid(flat_a, b) and not ct.is_combined_tensor_valid(flat_b, a)
