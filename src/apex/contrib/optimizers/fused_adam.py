"""NVIDIA Apex's older ``apex.contrib.optimizers.FusedAdam``: the Adam that ``apex.contrib.optimizers.FP16_Optimizer``
drives with flat fp16 grads and a loss scale.

Its math differs from ``apex.optimizers.FusedAdam`` and from torch's Adam, and is kept as NVIDIA's kernel has it, per
element, in float32, at step ``t`` of the param::

    g      = grad / combined_scale
    m      = beta1 * m + (1 - beta1) * g
    v      = beta2 * v + (1 - beta2) * g * g
    denom  = sqrt(v + eps)   if eps_inside_sqrt   else   sqrt(v) + eps
    update = m / denom + weight_decay * p
    p      = p - step_size * update,  step_size = lr * sqrt(1 - beta2**t) / (1 - beta1**t)  (lr without bias_correction)

``combined_scale`` is the ``scale`` the grads carry, times ``clip = (norm / scale + 1e-6) / max_grad_norm`` when
``max_grad_norm > 0`` and ``clip > 1``, where ``norm`` is the group's grad norm *with* the scale (``grad_norms``, as
FP16_Optimizer passes it; computed from the grads when not given). Weight decay is added to the update, so it is
scaled by ``step_size`` (bias correction included) rather than by ``lr``.

``step(closure=None, grads=None, output_params=None, scale=1.0, grad_norms=None)``: ``grads`` replace ``p.grad``
(low-precision grads of fp32 params), ``output_params`` receive the updated params rounded to their dtype; each is a
list per group, or one list for a single group. NVIDIA needed its ``fused_adam_cuda`` extension; this runs the
same math as torch ops on any device (``use_mt`` is accepted and changes nothing).
"""

from __future__ import annotations

import math
import types
from typing import Any, List, Optional

import torch

from ...optimizers._base import _check_adam_group, _check_range


def _per_group(value: Any, n_groups: int, name: str) -> List[Optional[list]]:
    """``grads`` / ``output_params`` as one list per group (upstream's forms: None, a generator or a flat list for a
    single group, or a list of lists)."""
    if value is None:
        return [None] * n_groups
    if isinstance(value, types.GeneratorType):
        value = [list(value)]
    elif not isinstance(value, (list, tuple)):
        raise TypeError(f"FusedAdam.step: {name} must be a list (per group, or one list for a single group), got "
                        f"{type(value).__name__}")
    elif len(value) == 0 or not isinstance(value[0], (list, tuple)):
        value = [list(value)]
    if len(value) != n_groups:
        raise ValueError(f"FusedAdam.step: {name} has {len(value)} groups, the optimizer has {n_groups}")
    return [None if v is None else list(v) for v in value]


def group_grad_norm(grads: List[Optional[torch.Tensor]]) -> float:
    """The 2-norm of a group's grads (each tensor's norm in float32, then the norm of those), as the scaled norm
    FP16_Optimizer passes in ``grad_norms``; 0 with no grad element. None entries are skipped."""
    present = [g.detach() for g in grads if g is not None and g.numel()]
    if not present:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g, dtype=torch.float32) for g in present])))


class FusedAdam(torch.optim.Optimizer):
    """``FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False,
    weight_decay=0., max_grad_norm=0., amsgrad=False, use_mt=False, amp_scale_adjustment=1.0)``; see the module
    docstring for the math. ``amsgrad=True`` raises RuntimeError, as NVIDIA's."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False,
                 weight_decay=0.0, max_grad_norm=0.0, amsgrad=False, use_mt=False, amp_scale_adjustment=1.0):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm)
        self._check_group(defaults)
        _check_range("amp_scale_adjustment", amp_scale_adjustment, 0.0, lo_open=True)
        self.eps_mode = 0 if eps_inside_sqrt else 1  # NVIDIA's attribute: 0 = eps under the square root
        self._use_multi_tensor = bool(use_mt)
        self._amp_scale_adjustment = amp_scale_adjustment
        super().__init__(params, defaults)

    @staticmethod
    def _check_group(group: dict) -> None:
        _check_adam_group(group)
        _check_range("max_grad_norm", group["max_grad_norm"], 0.0)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=1.0, grad_norms=None):
        """One update of every param with a grad (from ``grads`` or ``p.grad``); returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        n = len(self.param_groups)
        grads_group = _per_group(grads, n, "grads")
        outs_group = _per_group(output_params, n, "output_params")
        _check_range("scale", scale, 0.0, lo_open=True)
        if grad_norms is None:
            grad_norms = [None] * n
        elif len(grad_norms) != n:
            raise ValueError(f"FusedAdam.step: grad_norms has {len(grad_norms)} entries, the optimizer has {n} groups")
        plans = []
        # everything is checked before any param or state changes
        for gi, (group, gs, outs) in enumerate(zip(self.param_groups, grads_group, outs_group)):
            self._check_group(group)
            ps = group["params"]
            gs = [None] * len(ps) if gs is None else gs
            outs = [None] * len(ps) if outs is None else outs
            if len(gs) != len(ps) or len(outs) != len(ps):
                raise ValueError(f"FusedAdam.step: group {gi} has {len(ps)} params, got {len(gs)} grads and "
                                 f"{len(outs)} output params")
            items = []
            for i, (p, g, out) in enumerate(zip(ps, gs, outs)):
                if g is None:
                    g = p.grad
                if g is None:
                    continue
                if not isinstance(g, torch.Tensor):
                    raise TypeError(f"FusedAdam.step: grad of param {i} of group {gi} is {type(g).__name__}")
                if g.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients, please consider SparseAdam "
                                       "instead")
                if g.shape != p.shape or (out is not None and out.shape != p.shape):
                    raise ValueError(f"FusedAdam.step: param {i} of group {gi} has shape {tuple(p.shape)}; its grad "
                                     f"has {tuple(g.shape)}" + ("" if out is None else
                                                                f" and its output param {tuple(out.shape)}"))
                items.append((p, g, out))
            plans.append(items)
        for group, items, norm in zip(self.param_groups, plans, grad_norms):
            if not items:
                continue
            combined = float(scale)
            if group["max_grad_norm"] > 0:
                if norm is None:
                    norm = group_grad_norm([g for _, g, _ in items])
                clip = ((float(norm) / scale) + 1e-6) / group["max_grad_norm"]
                if clip > 1:
                    combined = clip * scale
            self._update(group, items, combined)
        return loss

    def _update(self, group: dict, items: list, combined_scale: float) -> None:
        beta1, beta2 = group["betas"]
        eps, decay, lr = group["eps"], group["weight_decay"], group["lr"]
        for p, g, out in items:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            t = state["step"]
            if group["bias_correction"]:
                step_size = lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
            else:
                step_size = lr
            m, v = state["exp_avg"], state["exp_avg_sq"]
            p32, m32, v32 = p.float(), m.float(), v.float()
            g32 = g.to(device=p.device, dtype=torch.float32) / combined_scale
            m32.mul_(beta1).add_(g32, alpha=1 - beta1)
            v32.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            denom = (v32 + eps).sqrt_() if self.eps_mode == 0 else v32.sqrt().add_(eps)
            update = (m32 / denom).add_(p32, alpha=decay)
            p32 = p32.sub(update, alpha=step_size)
            for dst, src in ((p, p32), (m, m32), (v, v32)):
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
            if out is not None:
                out.copy_(p32)
