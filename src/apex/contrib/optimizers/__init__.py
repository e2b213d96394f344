"""NVIDIA Apex's older ``apex.contrib.optimizers``: ``FP16_Optimizer`` with ``FusedAdam`` (the pair old BERT
fine-tuning scripts import: ``from apex.contrib.optimizers import FP16_Optimizer, FusedAdam``), and ``FusedLAMB``.

NVIDIA's needed its CUDA extensions (``fused_adam_cuda``, ``fused_lamb_cuda``); these run on every device. Its
distributed optimizers (``DistributedFusedAdam``, ``DistributedFusedLAMB``) are not provided.
"""

from ...optimizers.fused_lamb import FusedLAMB as _FusedLAMB
from .fp16_optimizer import FP16_Optimizer
from .fused_adam import FusedAdam


class FusedLAMB(_FusedLAMB):
    """NVIDIA's contrib ``FusedLAMB(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
    weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True,
    max_grad_norm=1.0)``: the math of :class:`apex.optimizers.FusedLAMB` with ``use_nvlamb=False`` (its kernel's
    per-tensor trust ratio only where weight decay is non-zero), which this signature lacks."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True, max_grad_norm=1.0):
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adam_w_mode=adam_w_mode,
                         grad_averaging=grad_averaging, set_grad_none=set_grad_none, max_grad_norm=max_grad_norm,
                         use_nvlamb=False)


__all__ = ["FP16_Optimizer", "FusedAdam", "FusedLAMB"]
