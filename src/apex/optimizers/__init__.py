"""Fused optimizers over combined (flat) buffers: torch.optim semantics, one pass per group on CPU."""

from .. import _torch_workarounds  # noqa: F401  (imported for its effect)
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

# the Ascend patch's fused clipping, a method of every fused optimizer (see clip.py)
CombinedOptimizer.clip_optimizer_grad_norm_fused = clip_optimizer_grad_norm_fused

# NVIDIA Apex's optimizers (signatures, defaults and semantics of apex.optimizers upstream)
from .fused_adagrad import FusedAdagrad  # noqa: E402
from .fused_adam import FusedAdam  # noqa: E402
from .fused_lamb import FusedLAMB  # noqa: E402
from .fused_mixed_precision_lamb import FusedMixedPrecisionLamb  # noqa: E402
from .fused_novograd import FusedNovoGrad  # noqa: E402
from .fused_sgd import FusedSGD  # noqa: E402

__all__ += ["FusedAdagrad", "FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad", "FusedSGD"]
