"""Megatron's layer norms: ``apex.normalization``'s ``FusedLayerNorm`` and ``MixedFusedLayerNorm`` and
``apex.contrib.layer_norm``'s ``FastLayerNorm``, each taking ``sequence_parallel_enabled`` (keyword only, default
False) and recording it on the module and, as an attribute of the same name, on its weight and bias: Megatron and
NeMo read that attribute to all-reduce the gradients of parameters replicated across a sequence-parallel group.
The normalization itself is the base class's. The marks are set again after every ``.to()`` / ``.cuda()`` /
``.half()``: where torch makes new parameter objects for the moved tensors (a backend whose tensors cannot take the
old ones' place, such as an out-of-tree device), attributes set on the old ones would be lost."""

from __future__ import annotations

import torch

from apex.contrib.layer_norm import FastLayerNorm as _FastLayerNorm
from apex.normalization import FusedLayerNorm as _FusedLayerNorm
from apex.normalization import MixedFusedLayerNorm as _MixedFusedLayerNorm

__all__ = ["FastLayerNorm", "FusedLayerNorm", "MixedFusedLayerNorm"]


def _mark(module: torch.nn.Module, enabled) -> None:
    if not isinstance(enabled, bool):
        raise TypeError(f"{type(module).__name__}: sequence_parallel_enabled must be a bool, got "
                        f"{type(enabled).__name__}")
    module.sequence_parallel_enabled = enabled
    for p in (module.weight, module.bias):
        if p is not None:
            p.sequence_parallel_enabled = enabled


class _Marked:
    """Re-marks the parameters after torch moves or casts them (see the module docstring)."""

    def _apply(self, fn, *args, **kwargs):
        result = super()._apply(fn, *args, **kwargs)
        _mark(self, self.sequence_parallel_enabled)
        return result


class FusedLayerNorm(_Marked, _FusedLayerNorm):
    """``FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, *, sequence_parallel_enabled=False)``."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, *,
                 sequence_parallel_enabled: bool = False):
        super().__init__(normalized_shape=normalized_shape, eps=eps, elementwise_affine=elementwise_affine)
        _mark(self, sequence_parallel_enabled)


class MixedFusedLayerNorm(_Marked, _MixedFusedLayerNorm):
    """``MixedFusedLayerNorm(normalized_shape, eps=1e-5, *, sequence_parallel_enabled=False, memory_efficient=False)``:
    output in the weights' dtype."""

    def __init__(self, normalized_shape, eps: float = 1e-5, *, sequence_parallel_enabled: bool = False, **kwargs):
        super().__init__(normalized_shape=normalized_shape, eps=eps, **kwargs)
        _mark(self, sequence_parallel_enabled)


class FastLayerNorm(_Marked, _FastLayerNorm):
    """``FastLayerNorm(hidden_size, eps=1e-5, *, sequence_parallel_enabled=False)``: output in the weights'
    dtype."""

    def __init__(self, hidden_size, eps: float = 1e-5, *, sequence_parallel_enabled: bool = False):
        super().__init__(hidden_size=hidden_size, eps=eps)
        _mark(self, sequence_parallel_enabled)
