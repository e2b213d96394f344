"""FusedMixedPrecisionLamb: NVIDIA Apex's LAMB over fp32 master copies of low-precision params.

What it does (NVIDIA's semantics, on combined buffers):

* The model keeps its params in ``reduced_precision_dtype`` (fp16 or bf16). For each such
  param the optimizer holds an fp32 *master* copy, made from the param's value at the first
  ``step()`` (so a DDP broadcast after construction is picked up), and fp32 moments
  ``state[p]["exp_avg"]`` / ``state[p]["exp_avg_sq"]`` keyed by the model param.
* Each step reads the model grads, runs the LAMB math of `FusedLAMB` (global grad-norm
  clipping by ``max_grad_norm``, per-group step count, trust ratio when weight_decay != 0
  or use_nvlamb) on the masters in fp32, and writes the rounded result back into the model
  params. On CPU the master update and the low-precision copy are one kernel pass.
* Params of any other dtype (or all of them when ``reduced_precision_dtype=None``) are
  updated in place in their own dtype, as FusedLAMB does.
* ``group["lr"]`` is a float32 tensor and ``group["step"]`` an int32 tensor of shape [1]
  on the params' device, as in NVIDIA's class (``step=`` sets the starting count).
* torch's ``GradScaler`` drives it without a separate unscale pass
  (``_step_supports_amp_scaling``): a step with inf/NaN grads is skipped (no update, step
  count unchanged) and the unscale is folded into the update. Clipping compares the
  *unscaled* norm with ``max_grad_norm``, which is what NVIDIA's scaled comparison amounts to.

Differences from NVIDIA: if a model param is rebound (``p.data = ...``, ``model.to(...)``)
its master is re-created from the new value instead of silently overwriting it; in-place
writes into model params (``model.load_state_dict``) are not seen, exactly as with NVIDIA's
masters. The grads are read, never overwritten. Master values are not part of
``state_dict()`` (as NVIDIA's): after loading, masters are re-made from the model params.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from .._checks import check_int
from ._base import _call_closure
from ._nvidia import AmpCOp, GradScalerMixin, ShadowParamsMixin, tensor_lr_and_step
from .fused_lamb import FusedLAMB

__all__ = ["FusedMixedPrecisionLamb"]

_REDUCED = (torch.float16, torch.bfloat16)


class FusedMixedPrecisionLamb(GradScalerMixin, ShadowParamsMixin, FusedLAMB):
    """LAMB with fp32 master weights for low-precision params, as ``apex.optimizers.FusedMixedPrecisionLamb``.

    Args: params, lr=1e-3, step=0, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
    weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True, max_grad_norm=1.0,
    use_nvlamb=False, reduced_precision_dtype=None (torch.float16 or torch.bfloat16).

    ``step(closure=None)``; also accepts NVIDIA's ``grad_scaler=`` keyword (the older GradScaler
    contract). ``zero_grad()`` is torch's (set_to_none=True).
    """

    # upstream's kernel handles (see `AmpCOp`): its mixed-precision variants
    multi_tensor_l2norm = AmpCOp("multi_tensor_l2norm_mp")
    multi_tensor_lamb = AmpCOp("multi_tensor_lamb_mp")

    _step_supports_amp_scaling = True

    def __init__(self, params, lr=1e-3, step=0, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True, max_grad_norm=1.0,
                 use_nvlamb=False, reduced_precision_dtype=None):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        if reduced_precision_dtype is not None and reduced_precision_dtype not in _REDUCED:
            raise ValueError(
                "FusedMixedPrecisionLamb: reduced_precision_dtype must be None, torch.float16 or torch.bfloat16, "
                f"got {reduced_precision_dtype!r}"
            )
        step = check_int(step, "FusedMixedPrecisionLamb: step", 0)
        self.reduced_precision_dtype = reduced_precision_dtype
        self._initial_step = step
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=False, adam_w_mode=adam_w_mode,
                         grad_averaging=grad_averaging, set_grad_none=True, max_grad_norm=max_grad_norm,
                         use_nvlamb=use_nvlamb)

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict) -> None:
        """NVIDIA keeps lr and step as tensors on the params' device; every group gets its own."""
        super().add_param_group(param_group)
        tensor_lr_and_step(self.param_groups[-1], self._initial_step)

    @property
    def param_groups_full_precision(self) -> List[dict]:
        """NVIDIA's attribute: per group, the fp32 master of each param (None where the param has none)."""
        return self._master_lists(lambda p: None)

    def _shadow_dtypes(self) -> Tuple[torch.dtype, ...]:
        return () if self.reduced_precision_dtype is None else (self.reduced_precision_dtype,)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """One update. Honours torch GradScaler: skipped on inf/NaN grads, unscale folded into the update."""
        unknown = set(kwargs) - {"grad_scaler"}
        if unknown:
            raise TypeError(f"FusedMixedPrecisionLamb.step() got unexpected keyword arguments {sorted(unknown)}")
        loss = _call_closure(closure)
        self._scaled_update(kwargs.get("grad_scaler"), self._master_step)
        return loss

    def _master_step(self) -> None:
        self._sync_shadows()
        self._lamb_step()
