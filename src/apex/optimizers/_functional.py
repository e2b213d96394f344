"""Per-tensor optimizer math shared by both optimizer families and `apex.multi_tensor_apply.amp_C`.

Every function updates fp32 working tensors in place (or returns a new one) with torch ops;
the torch executors run them on flat slices, amp_C's multi-tensor ops on each tensor. A
``settle(t)`` argument (see `settler`) rounds a state through its storage dtype in place,
so the terms after it read the state as stored, as the apex_C kernels do.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["adagrad_math", "adam_math", "l2_grad", "lamb_direction", "lamb_moments", "lamb_trust_ratio", "settler"]

#: the NPU patch's LAMB clamps the weight norm of its trust ratio to this value
LAMB_WEIGHT_NORM_CLAMP = 10.0


def l2_grad(g: torch.Tensor, p: torch.Tensor, grad_scale: float, weight_decay: float) -> torch.Tensor:
    """``g * grad_scale + weight_decay * p`` (L2 decay); a new tensor when either term applies, never g changed."""
    if grad_scale != 1.0:
        g = g * grad_scale
    if weight_decay != 0:
        g = g.add(p, alpha=weight_decay)
    return g


def _keep(t: torch.Tensor) -> None:
    """fp32 storage: the working value is the stored value."""


def settler(dtype: torch.dtype) -> Callable[[torch.Tensor], None]:
    """In-place rounding of an fp32 working copy through a storage dtype (no-op for fp32)."""
    if dtype == torch.float32:
        return _keep
    return lambda t: t.copy_(t.to(dtype))


def adam_math(p, g, m, v, vmax, *, lr, beta1, beta2, eps, weight_decay, step, amsgrad, decoupled, grad_scale,
              bias_correction=True, settle: Callable[[torch.Tensor], None] = _keep) -> None:
    """One Adam(W) update on fp32 tensors (in place): torch.optim.Adam's formulas, the apex_C ``_raw_adam_step`` math.

    ``decoupled`` shrinks p by ``1 - lr * weight_decay`` first (AdamW), else the decay is added
    to the grad (L2). ``vmax`` (AMSGrad's running maximum) is read only with ``amsgrad``.
    ``bias_correction=False`` (NVIDIA's FusedAdam option) divides by neither ``1 - beta^step``.
    The moments are settled before the update reads them.
    """
    g = l2_grad(g, p, grad_scale, 0.0 if decoupled else weight_decay)
    if decoupled and weight_decay != 0:
        p.mul_(1 - lr * weight_decay)
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    settle(m)
    settle(v)
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2_sqrt = (1 - beta2**step) ** 0.5 if bias_correction else 1.0
    if amsgrad:
        torch.maximum(vmax, v, out=vmax)
        denom = vmax.sqrt().div_(bc2_sqrt).add_(eps)
    else:
        denom = v.sqrt().div_(bc2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bc1)


def adagrad_math(p, g, h, *, lr, eps, weight_decay, decoupled, grad_scale,
                 settle: Callable[[torch.Tensor], None] = _keep) -> None:
    """One Adagrad update without lr decay on fp32 tensors (in place), as NVIDIA's FusedAdagrad.

    ``h += g^2``, ``p -= lr * (g / (sqrt(h) + eps) (+ weight_decay * p when decoupled))``; without
    ``decoupled`` the decay is added to the grad first (L2). The update reads h as settled.
    """
    g = l2_grad(g, p, grad_scale, 0.0 if decoupled else weight_decay)
    h.addcmul_(g, g)
    settle(h)
    u = g / h.sqrt().add_(eps)
    if decoupled and weight_decay != 0:
        u.add_(p, alpha=weight_decay)
    p.add_(u, alpha=-lr)


# ------------------------------------------------------------------ LAMB (NpuFusedLamb, Lamb, FusedLAMB, amp_C)
def lamb_moments(g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, beta1: float, beta2: float,
                 beta3: Optional[float] = None) -> None:
    """``m = beta1 m + beta3 g``, ``v = beta2 v + (1 - beta2) g^2`` in place, from the (already multiplied) grad.

    ``beta3`` defaults to ``1 - beta1``; NVIDIA's ``grad_averaging=False`` passes 1.
    """
    m.mul_(beta1).add_(g, alpha=1 - beta1 if beta3 is None else beta3)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)


def lamb_direction(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, eps: float, weight_decay: float,
                   bc1: float = 1.0, bc2: float = 1.0) -> torch.Tensor:
    """``u = (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p`` (a new tensor; bc 1: no bias correction)."""
    m_hat = m / bc1 if bc1 != 1.0 else m
    v_hat = v / bc2 if bc2 != 1.0 else v
    u = m_hat / v_hat.sqrt().add_(eps)
    if weight_decay != 0:
        u.add_(p, alpha=weight_decay)
    return u


def lamb_trust_ratio(p_norm: torch.Tensor, u_norm: torch.Tensor, adam: bool = False,
                     max_weight_norm: Optional[float] = LAMB_WEIGHT_NORM_CLAMP) -> torch.Tensor:
    """``min(||p||, max_weight_norm) / ||u||`` elementwise over per-param norms; 1 where either norm is 0 (or adam).

    ``max_weight_norm=None``: no clamp (NVIDIA's FusedLAMB).
    """
    if adam:
        return torch.ones_like(p_norm)
    w = p_norm if max_weight_norm is None else p_norm.clamp(max=max_weight_norm)
    return torch.where((w == 0) | (u_norm == 0), torch.ones_like(w), w / u_norm)
