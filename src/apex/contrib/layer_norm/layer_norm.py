"""NVIDIA Apex's ``FastLayerNorm`` / ``FastLayerNormFN`` (its persistent-kernel layer norm), on every device.

The math is the layer norm of the last dimension, ``(x - mean) / sqrt(var + eps) * gamma + beta`` (biased
variance), computed in float32 and rounded once to the dtype of ``gamma``, which is upstream's output type (an
fp32 or bf16 input normalised by bf16 weights gives bf16). That is :mod:`apex.normalization`'s mixed-dtype form,
on torch's ``layer_norm``; autograd is torch's, so the grads of x, gamma and beta come back in their own dtypes.

Upstream's kernel exists for a fixed list of hidden sizes on CUDA; here any size works on any device.
``memory_efficient`` (upstream: save the output instead of the input for the backward) is accepted and changes
nothing. The module follows upstream's autocast rule: under ``torch.autocast`` on the input's device, input,
weight and bias are cast to the autocast dtype and the norm runs with autocast off. ``FastLayerNormFN.apply``
takes the dtypes it is given.
"""

from __future__ import annotations

import torch
from torch import nn

from apex._checks import check_dense, check_int, check_size, real_number
from apex._upstream_forms import FunctionForm
from apex.normalization.fused_layer_norm import _layer_norm_form

__all__ = ["FastLayerNorm", "FastLayerNormFN"]


def _fast_layer_norm(where: str, cast: bool, x, gamma, beta, epsilon) -> torch.Tensor:
    for name, t in (("gamma", gamma), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a tensor, got {type(t).__name__}")
        check_dense(t, f"{where}: {name}")
    if gamma.shape != beta.shape or gamma.dtype != beta.dtype:
        raise ValueError(f"{where}: gamma ({gamma.dtype}, shape {tuple(gamma.shape)}) and beta ({beta.dtype}, "
                         f"shape {tuple(beta.shape)}) must have one dtype and shape")
    hidden = gamma.numel()
    if hidden == 0:
        raise ValueError(f"{where}: gamma is empty; expected one weight per hidden unit")
    # upstream reads gamma and beta as flat vectors of the hidden size
    return _layer_norm_form(where, True, cast, x, gamma.reshape(hidden), beta.reshape(hidden), (hidden,), epsilon)


class FastLayerNormFN(FunctionForm):
    """Upstream's ``torch.autograd.Function`` name: ``FastLayerNormFN.apply(x, gamma, beta, epsilon,
    memory_efficient=False)`` normalises the last dimension of ``x`` (whose size must be ``gamma.numel()``).

    ``forward(ctx, ...)`` has upstream's arguments (Megatron-core inspects them); ``apply`` is ``forward(None,
    ...)``. Raises TypeError for non-tensor or non-floating arguments, ValueError for mismatched shapes or
    dtypes of gamma and beta, an input whose last dimension is not the hidden size, or a negative epsilon.
    """

    @staticmethod
    def forward(ctx, x, gamma, beta, epsilon, memory_efficient=False) -> torch.Tensor:
        return _fast_layer_norm("FastLayerNormFN", False, x, gamma, beta, epsilon)


class FastLayerNorm(nn.Module):
    """``FastLayerNorm(hidden_size, eps=1e-5, memory_efficient=False)``: layer norm over the last dimension with
    ``weight`` (ones) and ``bias`` (zeros) of ``hidden_size`` in the default dtype; the output has the weights'
    dtype (see the module docstring for autocast)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, memory_efficient: bool = False) -> None:
        super().__init__()
        hidden_size = check_int(hidden_size, "FastLayerNorm: hidden_size", 1)
        check_size((hidden_size,), "FastLayerNorm: hidden_size", torch.get_default_dtype())
        if real_number(eps) is None:
            raise TypeError(f"FastLayerNorm: eps must be a number >= 0, got {type(eps).__name__}")
        if not eps >= 0:
            raise ValueError(f"FastLayerNorm: eps must be a number >= 0, got {eps!r}")
        self.epsilon = float(eps)
        self.memory_efficient = bool(memory_efficient)
        self.weight = nn.Parameter(torch.empty(int(hidden_size)))
        self.bias = nn.Parameter(torch.empty(int(hidden_size)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fast_layer_norm("FastLayerNorm", True, x, self.weight, self.bias, self.epsilon)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.epsilon}, memory_efficient={self.memory_efficient}"
