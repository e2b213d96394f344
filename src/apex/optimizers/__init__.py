"""Fused optimizers over combined (flat) buffers: torch.optim semantics, one pass per group on CPU."""

from ._base import CombinedOptimizer
from .adam import NpuFusedAdam, NpuFusedAdamW

__all__ = ["CombinedOptimizer", "NpuFusedAdam", "NpuFusedAdamW"]
