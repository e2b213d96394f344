"""Argument checks the subpackages share: one rule per kind of value, so the same mistake gets the same
exception type and wording wherever it is made. TypeError when the value has the wrong form, ValueError when it
has the right form and is out of range."""

from __future__ import annotations

import numbers
import operator
import sys
from typing import Any, Container, Optional, Union

import torch

__all__ = ["FLOAT32_MAX", "INT64_MAX", "INT64_MIN", "check_bool", "check_dense", "check_fraction", "check_int",
           "check_size", "plain_numbers", "real_number"]

#: the largest finite float32: hyperparameters and step counts the updates hold in float32 must not exceed it
FLOAT32_MAX = 3.4028234663852886e38

#: the range of torch's int64, which is what a Python int becomes when it reaches an op
INT64_MIN = -2**63
INT64_MAX = 2**63 - 1


def real_number(value: Any) -> Optional[Union[int, float]]:
    """The Python int or float a real scalar stands for; None when ``value`` is not one.

    Taken as torch.optim takes them: ints and floats, numpy's real scalars (``np.float32(1e-3)``,
    ``np.int64(2)``: what indexing a numpy array gives) and any other ``numbers.Real`` (``Fraction``), read as
    the int or float they hold. Never a bool, numpy's included: ``True`` for a learning rate or a scale is a
    mistake, not 1. Not a numpy array, even of one element: torch's ops refuse one where they take a number.
    Tensors are not handled here: each caller reads its one-element tensors with its own checks.
    """
    if type(value) is int or type(value) is float:
        return value
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return operator.index(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def plain_numbers(options: dict, keys: Container[str]) -> None:
    """Rewrites the numpy scalars (and other non-builtin reals) among ``options``' values under ``keys`` (an
    optimizer's own options: entries a user added to a group are not ours to change), also inside a tuple or list
    such as ``betas``, as the Python numbers they hold.

    The updates then compute with what they compute with for a Python number: arithmetic on a numpy float32
    stays in float32 (``1 - np.float32(0.9)``), and torch's ops refuse numpy values in some arguments."""
    for key, value in options.items():
        kind = type(value)
        if kind in PLAIN_TYPES or key not in keys:
            continue
        if kind is tuple or kind is list:
            if not all(type(v) in PLAIN_TYPES for v in value):
                plain = list(map(_plain, value))
                options[key] = plain if kind is list else tuple(plain)
        else:
            options[key] = _plain(value)


#: values plain_numbers leaves as they are without asking (what a param group holds but numbers and tensors): the
#: immutable builtins, whose value is their meaning
PLAIN_TYPES = frozenset((int, float, bool, str, type(None)))


def _plain(value: Any) -> Any:
    """``value`` as the Python number it holds, or as it is when it holds none."""
    if type(value) in PLAIN_TYPES:
        return value
    number = real_number(value)
    return value if number is None else number


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


def check_floating(value: Any, what: str) -> None:
    """TypeError unless ``value`` is a floating-point tensor; the message names what it got (its dtype, or its
    type when it is no tensor). ``what`` names the argument ("FMHAFun: qkv")."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"{what} must be a floating-point tensor, got {got}")


def check_fraction(value: Any, what: str) -> float:
    """``value`` as a Python float in [0, 1]: a probability (dropout) or a share (label smoothing). Taken as
    `real_number` takes reals; NaN is out of range. ``what`` names the value in the message
    ("SelfMultiheadAttn: dropout")."""
    number = real_number(value)
    if number is None:
        raise TypeError(f"{what} must be a real number, got {type(value).__name__}")
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"{what} must be in [0, 1], got {number}")
    return float(number)



def check_bool(value: Any, what: str) -> bool:
    """``value`` as a Python bool: an on/off option.

    Taken: ``True`` / ``False``, numpy's bools (what comparing numpy values gives) and the ints 0 and 1 (upstream
    scripts pass flags parsed with ``type=int``). Never a string or any other object: Python's truth value would
    read ``"no"`` or ``"False"`` as on. ``what`` names the option in the message ("LARC: clip").
    """
    if isinstance(value, bool):
        return value
    np = sys.modules.get("numpy")  # numpy's bools can only exist once numpy is imported
    if np is not None and isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, numbers.Integral):
        if value in (0, 1):
            return bool(value)
        raise ValueError(f"{what} must be True or False (or 0/1), got {value!r}")
    raise TypeError(f"{what} must be True or False, got {value!r:.80} ({type(value).__name__})")


def check_dense(value: torch.Tensor, what: str, *, meta: bool = True) -> None:
    """TypeError unless the tensor ``value`` is dense: strided layout and not nested (a nested tensor may report
    the strided layout). Sparse and nested tensors otherwise pass the dtype and shape checks and fail deep inside
    torch with messages that name no argument. ``meta=False`` also refuses a tensor on the meta device, for callers
    that must read or change values. ``what`` names the argument ("FocalLoss: cls_output")."""
    if value.is_nested or value.layout != torch.strided:
        got = "a nested tensor" if value.is_nested else f"layout {value.layout}"
        raise TypeError(f"{what} must be a dense (strided) tensor, got {got}")
    if not meta and value.is_meta:
        raise TypeError(f"{what} must hold values, got a tensor on the meta device")


def check_size(shape: Any, what: str, dtype: Optional[torch.dtype] = None) -> None:
    """ValueError unless a tensor of ``shape`` (sizes already checked to be ints >= 0) can exist: each size, its
    element count and, when ``dtype`` is given, its size in bytes must fit in int64, as torch counts them. Past that
    torch fails with an overflow naming no argument. ``what`` names the size argument ("GroupNorm: num_channels")."""
    sizes = tuple(int(d) for d in shape)
    shown = sizes[0] if len(sizes) == 1 else sizes
    numel = 1
    for d in sizes:
        numel *= d
    if max(sizes, default=0) > INT64_MAX or numel > INT64_MAX:
        raise ValueError(f"{what} is {shown}: {numel} elements, more than a tensor holds (at most {INT64_MAX}, "
                         "int64)")
    if dtype is not None and numel * dtype.itemsize > INT64_MAX:
        raise ValueError(f"{what} is {shown}: {numel * dtype.itemsize} bytes of {dtype}, more than a tensor holds "
                         f"(at most {INT64_MAX} bytes, int64)")
