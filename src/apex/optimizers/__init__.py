"""Fused optimizers over combined (flat) buffers: torch.optim semantics, one pass per group on CPU."""

from ._base import CombinedOptimizer
from .adadelta import NpuFusedAdadelta
from .adam import NpuFusedAdam, NpuFusedAdamW
from .adamp import NpuFusedAdamP
from .bert_adam import NpuFusedBertAdam
from .clip import clip_optimizer_grad_norm_fused
from .lamb import Lamb, NpuFusedLamb
from .rmsprop import NpuFusedRMSprop
from .rmsprop_tf import NpuFusedRMSpropTF
from .sgd import NpuFusedSGD

__all__ = ["CombinedOptimizer", "NpuFusedAdam", "NpuFusedAdamW"]
__all__ += ["NpuFusedAdadelta", "NpuFusedBertAdam", "NpuFusedRMSprop", "NpuFusedRMSpropTF", "NpuFusedSGD"]
__all__ += ["Lamb", "NpuFusedAdamP", "NpuFusedLamb", "clip_optimizer_grad_norm_fused"]

# the seed's fused clipping, a method of every fused optimizer (see clip.py)
CombinedOptimizer.clip_optimizer_grad_norm_fused = clip_optimizer_grad_norm_fused
