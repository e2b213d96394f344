"""Argument checks the subpackages share: one rule per kind of value, so the same mistake gets the same
exception type and wording wherever it is made. TypeError when the value has the wrong form, ValueError when it
has the right form and is out of range."""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch

__all__ = ["FLOAT32_MAX", "check_int"]

#: the largest finite float32: hyperparameters and step counts the updates hold in float32 must not exceed it
FLOAT32_MAX = 3.4028234663852886e38


def check_int(value: Any, what: str, minimum: Optional[int] = None, maximum: Optional[int] = None, *,
              integral_float: bool = False) -> int:
    """``value`` as a Python int in ``[minimum, maximum]`` (either bound may be None).

    Taken: ints and what ``operator.index`` takes (numpy integers, one-element integer tensors); never a bool
    (``True`` for a count is a mistake, not 1). ``integral_float``: also a float with an integral value, as
    checkpoints written by other tools hold counters (``1000.0``). ``what`` names the value in the message
    ("amp.initialize: num_losses").
    """
    v = None
    if not isinstance(value, bool) and not (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        if integral_float and isinstance(value, float) and value.is_integer():
            v = int(value)
        else:
            try:
                v = operator.index(value)
            except TypeError:
                v = None
    if v is None:
        raise TypeError(f"{what} must be an int, got {value!r:.80} ({type(value).__name__})")
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        if maximum is None:
            raise ValueError(f"{what} must be >= {minimum}, got {v}")
        if minimum is None:
            raise ValueError(f"{what} must be <= {maximum}, got {v}")
        raise ValueError(f"{what} must be in [{minimum}, {maximum}], got {v}")
    return v
