"""NVIDIA Apex's ``index_mul_2d(in1, in2, idx1)``: ``in1[idx1] * in2`` for 2-D ``in1`` (M, F) and ``in2`` (N, F)
and a 1-D index ``idx1`` of N rows of ``in1``, differentiable twice (upstream wrote a backward-of-backward kernel
for force fields, where the loss holds a gradient: OpenFold and molecular-dynamics models).

Here it is torch's ``index_select`` followed by a product, so autograd supplies every order of derivative and each
device runs its own kernels: the rows of ``in1`` gathered once, multiplied by ``in2`` (the product of two
numbers in the inputs' dtype rounds once, as the fused kernel's did); the gradient of ``in1`` sums the rows that
share an index (``index_add``), which on an accelerator, as upstream's atomics, is in no fixed order.

Upstream took float32 and float16; bfloat16 and float64 work too. The arguments are checked before anything runs:
TypeError for what is not a tensor of a taken dtype, ValueError for shapes and devices that do not fit, each
naming the argument; an index outside ``[0, M)`` fails in ``index_select`` (IndexError on the CPU).
"""

from __future__ import annotations

import torch

__all__ = ["index_mul_2d"]

_WHERE = "index_mul_2d"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _tensor(value, name: str, dtypes, words: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype not in dtypes:
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"{_WHERE}: {name} must be {words}, got {got}")
    return value


def _check(in1, in2, idx1) -> None:
    words = "a float32, float16, bfloat16 or float64 tensor"
    _tensor(in1, "in1", _DTYPES, words)
    _tensor(in2, "in2", _DTYPES, words)
    _tensor(idx1, "idx1", (torch.int64, torch.int32), "an int64 or int32 tensor")
    if in2.dtype != in1.dtype:
        raise TypeError(f"{_WHERE}: in1 and in2 must have one dtype, got {in1.dtype} and {in2.dtype}")
    if in1.dim() != 2 or in2.dim() != 2:
        raise ValueError(f"{_WHERE}: in1 and in2 must be 2-D, got shapes {tuple(in1.shape)} and {tuple(in2.shape)}")
    if idx1.dim() != 1:
        raise ValueError(f"{_WHERE}: idx1 must be 1-D, got shape {tuple(idx1.shape)}")
    if in2.shape[0] != idx1.shape[0]:
        raise ValueError(f"{_WHERE}: idx1 must hold one index per row of in2 ({in2.shape[0]}), got {idx1.shape[0]}")
    if in1.shape[1] != in2.shape[1]:
        raise ValueError(f"{_WHERE}: in1 and in2 must have the same number of columns, got {in1.shape[1]} and "
                         f"{in2.shape[1]} (no broadcasting)")
    if not (in1.device == in2.device == idx1.device):
        raise ValueError(f"{_WHERE}: in1, in2 and idx1 must be on one device, got {in1.device}, {in2.device} and "
                         f"{idx1.device}")


def index_mul_2d(in1: torch.Tensor, in2: torch.Tensor, idx1: torch.Tensor) -> torch.Tensor:
    """``in1[idx1] * in2``, shape of ``in2``, in the inputs' dtype; see the module docstring."""
    _check(in1, in2, idx1)
    return torch.mul(torch.index_select(in1, 0, idx1), in2)
