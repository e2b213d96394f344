"""FusedAdam with NVIDIA Apex's signature, defaults and semantics, on combined buffers.

Per param group, with the group's step count ``t`` (NVIDIA keeps one per group)::

    g = grad (+ weight_decay * p                  when adam_w_mode=False: L2, as torch.optim.Adam)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g^2
    u = (m / bc1) / (sqrt(v / bc2) + eps)        bc1 = 1 - beta1^t, bc2 = 1 - beta2^t (1 with bias_correction=False)
    p = p - lr * (u + weight_decay * p)         (the decay term only when adam_w_mode=True: AdamW)

so ``adam_w_mode=True`` (the default) is torch.optim.AdamW and ``adam_w_mode=False``
torch.optim.Adam: the same math as NpuFusedAdam(W), with a per-group step count and
optional bias correction. Executors: the apex_C ``adam_step`` kernel on CPU (one pass
per group x dtype), NpuFusedAdam's torch ops on flat slices elsewhere; both shrink p by
``1 - lr * weight_decay`` before the Adam step, which is ``p - lr * (u + weight_decay * p)``
up to rounding.

fp16 / bf16 params: as NVIDIA, the moments are fp32 and each param is updated in fp32
and rounded once. This runs on fp32 shadows of those params (`ShadowParamsMixin`),
re-read from the params before every step, with the grads converted into them; the
kernel writes the rounded params in the same pass. States stay keyed by the params.

``capturable`` / ``master_weights`` (NVIDIA's CUDA-graph variants) are not available.
"""

from __future__ import annotations

from typing import List

import torch

from .. import _core
from ._base import CombinedOptimizer, _call_closure, _check_adam_group
from ._flat import FlatSet
from ._functional import adam_math, settler
from ._nvidia import NvidiaCompatMixin, ShadowParamsMixin

__all__ = ["FusedAdam"]

_LEGACY_STEP_ARGS_MSG = (
    "FusedAdam has been updated.  Simply initialize it identically to torch.optim.Adam, and call step() "
    "with no arguments."
)


class FusedAdam(NvidiaCompatMixin, ShadowParamsMixin, CombinedOptimizer):
    """Adam / AdamW as ``apex.optimizers.FusedAdam``; drop-in for NVIDIA's class (see the module docstring).

    Args: params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
    weight_decay=0., amsgrad=False, set_grad_none=True, capturable=False, master_weights=False.

    ``amsgrad=True`` raises RuntimeError, as NVIDIA does. ``step()`` takes a closure;
    NVIDIA's removed step arguments (``grads``, ``output_params``, ``scale``, ``grad_norms``)
    raise NVIDIA's RuntimeError; ``grad_scaler`` is accepted and ignored (NVIDIA reads it
    only in its capturable mode). ``zero_grad()`` without arguments follows ``set_grad_none``.
    """

    _gather_grads = True  # the kernel reads grads only through OptArgs

    _has_step = False  # NVIDIA: group["step"], no per-param step

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True, capturable=False, master_weights=False):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if capturable:
            raise ValueError(
                "FusedAdam(capturable=True): CUDA-graph capture is not supported by apex's combined-buffer "
                "executors; expected capturable=False"
            )
        if master_weights:
            # NVIDIA allows master weights only with capturable=True, which is unavailable here
            raise RuntimeError("Master weights is currently only supported with the capturable version.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        self._validate_group(defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = bool(set_grad_none)
        self.capturable = False
        self.master_weights = False
        self._init_shadows()
        super().__init__(params, defaults)

    def _validate_group(self, group: dict) -> None:
        _check_adam_group(group)

    def _state_names(self, group: dict) -> List[str]:
        return ["exp_avg", "exp_avg_sq"]

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None, grad_scaler=None):
        """One update of every param with a grad. Returns the closure's loss (None without a closure)."""
        if any(a is not None for a in (grads, output_params, scale, grad_norms)):
            raise RuntimeError(_LEGACY_STEP_ARGS_MSG)
        loss = _call_closure(closure)
        self._sync_shadows()
        self._update(self._prepare_counted_step())
        return loss

    def _kernel_step(self, s: FlatSet, group: dict) -> None:
        self._use_group_step(s, group)
        b1, b2 = group["betas"]
        flags = _core.ext.FLAG_DECOUPLED if self.adam_w_mode else 0
        if not group["bias_correction"]:
            flags |= _core.ext.FLAG_NO_BIAS_CORRECTION
        a = self._prepare_args(s, [group["lr"], b1, b2, group["eps"], group["weight_decay"]], flags)
        _core.ext.adam_step(a)

    def _torch_step(self, s: FlatSet, group: dict) -> None:
        step = self._use_group_step(s, group)
        b1, b2 = group["betas"]
        settle = settler(s.dtype)
        lr = float(group["lr"])

        def update(p, g, states, _):  # `step` is the group's (NVIDIA's bias correction)
            adam_math(
                p, g, *states, None, lr=lr, beta1=b1, beta2=b2, eps=group["eps"],
                weight_decay=group["weight_decay"], step=step, amsgrad=False, decoupled=self.adam_w_mode,
                bias_correction=group["bias_correction"], grad_scale=self._grad_scale(), settle=settle,
            )

        self._update_runs(s, ["exp_avg", "exp_avg_sq"], update)
        self.last_executor = "torch"
