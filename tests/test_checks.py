"""apex._checks.check_int, the one int rule the subpackages share: what it takes, what it refuses and with which
exception (TypeError for the form, ValueError for the range), and that the callers get the same answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import apex
from apex._checks import check_fraction, check_int
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


@pytest.mark.parametrize("value,want", [(0, 0.0), (1, 1.0), (0.25, 0.25), (np.float32(0.5), 0.5)])
def test_check_fraction_takes_reals_in_the_unit_interval(value, want):
    got = check_fraction(value, "p")
    assert got == want and type(got) is float


@pytest.mark.parametrize("value,error", [(1.5, ValueError), (-0.1, ValueError), (float("nan"), ValueError),
                                         (True, TypeError), ("0.1", TypeError), (None, TypeError)])
def test_check_fraction_refuses(value, error):
    with pytest.raises(error, match=r"^p must be"):
        check_fraction(value, "p")


@pytest.mark.parametrize("call", [
    lambda v: __import__("apex.contrib.multihead_attn", fromlist=["x"]).SelfMultiheadAttn(8, 2, dropout=v),
    lambda v: __import__("apex.contrib.transducer", fromlist=["x"]).TransducerJoint(dropout_prob=v),
    lambda v: __import__("apex.contrib.xentropy", fromlist=["x"]).SoftmaxCrossEntropyLoss.apply(
        torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64), v),
], ids=["SelfMultiheadAttn", "TransducerJoint", "SoftmaxCrossEntropyLoss"])
def test_fraction_callers_answer_alike(call):
    with pytest.raises(ValueError, match=r"must be in \[0, 1\], got 2"):
        call(2)
    with pytest.raises(TypeError, match="must be a real number, got str"):
        call("0.1")
