"""NpuFusedAdam / NpuFusedAdamW: torch.optim.Adam(W) math on combined buffers."""

from __future__ import annotations

from typing import List

import torch

from .. import _core
from ._base import CombinedOptimizer, _check_range
from ._flat import FlatSet


def adam_math(p, g, m, v, vmax, *, lr, beta1, beta2, eps, weight_decay, step, amsgrad, decoupled, grad_scale):
    """One Adam(W) update on fp32 tensors (in place); torch.optim.Adam's formulas."""
    if grad_scale != 1.0:
        g = g * grad_scale
    if weight_decay != 0:
        if decoupled:
            p.mul_(1 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1**step
    bc2_sqrt = (1 - beta2**step) ** 0.5
    if amsgrad:
        torch.maximum(vmax, v, out=vmax)
        denom = vmax.sqrt().div_(bc2_sqrt).add_(eps)
    else:
        denom = v.sqrt().div_(bc2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bc1)


class NpuFusedAdam(CombinedOptimizer):
    """Adam (Kingma & Ba) with torch.optim.Adam's semantics, fused over combined buffers.

    Args: params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False.
    """

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
            decoupled_weight_decay=self._decoupled,
        )
        self._validate_group(defaults)
        super().__init__(params, defaults)

    def _validate_group(self, group: dict) -> None:
        _check_range("learning rate", group["lr"], 0.0)
        _check_range("epsilon value", group["eps"], 0.0)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"Invalid betas: expected a pair (beta1, beta2), got {betas!r}")
        _check_range("beta parameter at index 0", betas[0], 0.0, 1.0)
        _check_range("beta parameter at index 1", betas[1], 0.0, 1.0)
        _check_range("weight_decay value", group["weight_decay"], 0.0)
        if bool(group.get("decoupled_weight_decay", self._decoupled)) != self._decoupled:
            raise ValueError(
                f"{type(self).__name__} has decoupled_weight_decay={self._decoupled}; got "
                f"{group.get('decoupled_weight_decay')!r} (use {'NpuFusedAdamW' if not self._decoupled else 'NpuFusedAdam'})"
            )

    def _state_names(self, group: dict) -> List[str]:
        names = ["exp_avg", "exp_avg_sq"]
        if group["amsgrad"]:
            names.append("max_exp_avg_sq")
        return names

    def _kernel_step(self, s: FlatSet, group: dict) -> None:
        b1, b2 = group["betas"]
        flags = (_core.ext.FLAG_AMSGRAD if group["amsgrad"] else 0) | (
            _core.ext.FLAG_DECOUPLED if self._decoupled else 0
        )
        a = self._prepare_args(s, [group["lr"], b1, b2, group["eps"], group["weight_decay"]], flags)
        _core.ext.adam_step(a)

    def _torch_step(self, s: FlatSet, group: dict) -> None:
        b1, b2 = group["betas"]
        amsgrad = group["amsgrad"]
        for lo, hi, step, _, _ in s.active_runs():
            p = self._f32(s.flat_p[lo:hi])
            g = self._f32(s.flat_g[lo:hi])
            m = self._f32(s.flat_s["exp_avg"][lo:hi])
            v = self._f32(s.flat_s["exp_avg_sq"][lo:hi])
            vm = self._f32(s.flat_s["max_exp_avg_sq"][lo:hi]) if amsgrad else None
            adam_math(
                p, g, m, v, vm, lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                weight_decay=group["weight_decay"], step=step, amsgrad=amsgrad, decoupled=self._decoupled,
                grad_scale=self._grad_scale(),
            )
            self._write_back(s.flat_p[lo:hi], p)
            self._write_back(s.flat_s["exp_avg"][lo:hi], m)
            self._write_back(s.flat_s["exp_avg_sq"][lo:hi], v)
            if amsgrad:
                self._write_back(s.flat_s["max_exp_avg_sq"][lo:hi], vm)
        self.last_executor = "torch"


class NpuFusedAdamW(NpuFusedAdam):
    """AdamW (decoupled weight decay) with torch.optim.AdamW's semantics and defaults (weight_decay=1e-2)."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
