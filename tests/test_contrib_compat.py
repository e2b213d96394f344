"""The Ascend patch's contrib API: module-style combine_tensors access and get_aligned_storage_size."""

import importlib

import pytest
import torch

import apex.contrib
import apex.contrib.combine_tensors as ct
from apex.contrib import combine_tensors, get_aligned_storage_size, plan_layout


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

    assert fn is ct.combine_npu and fn([]) is None and combine_tensors([]) is None


def test_ascend_computation_scenario(device):
    # The Ascend test's arithmetic on a combined buffer, with this package's layout (plan_layout) for the mask.
    x = torch.zeros((2, 2, 2, 2), device=device)
    y = torch.zeros((4, 4), device=device)
    z = torch.zeros((3, 3, 3), device=device)
    flat = ct.combine_npu([x, y, z])
    mask = ct.combine_npu([torch.ones_like(t) for t in (x, y, z)])
    assert flat.is_contiguous() and flat.data_ptr() == x.data_ptr()
    offsets, total = plan_layout([x, y, z])
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
