"""apex._checks.check_int, the one int rule the subpackages share: what it takes, what it refuses and with which
exception (TypeError for the form, ValueError for the range), and that the callers get the same answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import apex
from apex._checks import check_int
from apex.fp16_utils import DynamicLossScaler


@pytest.mark.parametrize("value, expected", [
    (3, 3), (np.int64(4), 4), (np.uint8(5), 5), (torch.tensor(6), 6), (torch.tensor([7]), 7), (-2, -2),
])
def test_takes_ints_numpy_ints_and_one_element_integer_tensors(value, expected):
    out = check_int(value, "x")
    assert out == expected and type(out) is int


@pytest.mark.parametrize("value", [True, False, 1.0, 1.5, "3", None, torch.tensor(True), torch.tensor(1.0),
                                   torch.tensor([1, 2]), np.float32(2.0), [1]])
def test_refuses_other_forms_with_type_error(value):
    with pytest.raises(TypeError, match=r"^x must be an int, got "):
        check_int(value, "x")


def test_integral_floats_only_where_asked():
    assert check_int(1000.0, "x", integral_float=True) == 1000
    with pytest.raises(TypeError):
        check_int(1000.5, "x", integral_float=True)
    with pytest.raises(TypeError):
        check_int(float("inf"), "x", integral_float=True)


@settings(max_examples=200, deadline=None)
@given(v=st.integers(-2**70, 2**70), lo=st.none() | st.integers(-100, 100), hi=st.none() | st.integers(-100, 100))
def test_bounds_are_inclusive_and_the_message_names_them(v, lo, hi):
    inside = (lo is None or v >= lo) and (hi is None or v <= hi)
    if inside:
        assert check_int(v, "x", lo, hi) == v
        return
    with pytest.raises(ValueError, match=r"^x must be (>=|<=|in \[)"):
        check_int(v, "x", lo, hi)


@pytest.mark.parametrize("call", [
    lambda v: apex.amp.initialize(torch.nn.Linear(2, 2), num_losses=v, verbosity=0),
    lambda v: DynamicLossScaler(scale_window=v),
    lambda v: apex.contrib.get_aligned_storage_size(torch.zeros(3), align=v),
], ids=["amp.initialize", "DynamicLossScaler", "get_aligned_storage_size"])
def test_callers_answer_alike(call):
    with pytest.raises(TypeError, match=r"must be an int, got 1\.5"):
        call(1.5)
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        call(0)
