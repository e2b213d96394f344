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

from ..._checks import plain_numbers
from ...optimizers._base import (
    _check_adam_group,
    _check_range,
    check_flags,
    check_group_keys,
    check_names_agree,
    check_no_amsgrad,
    check_param_kind,
    check_torch_options,
    group_params,
    load_filling_defaults,
)
from ...optimizers._state_check import (
    COUNT,
    PARAM_SHAPED,
    check_live_state,
    check_unique_params,
    naming,
    validate_loaded_state,
)

#: constructor options kept as attributes (NVIDIA's), carried by copies and pickles
_OPTION_ATTRS = ("eps_mode", "_use_multi_tensor", "_amp_scale_adjustment")

#: the per-param state a step keeps (torch.optim.Adam's names and layout)
_STATE_SPEC = {"exp_avg": PARAM_SHAPED, "exp_avg_sq": PARAM_SHAPED, "step": COUNT}


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
    for gi, v in enumerate(value):
        if v is not None and not isinstance(v, (list, tuple)):
            raise TypeError(f"FusedAdam.step: {name} for group {gi} must be a list (one entry per param) or None, "
                            f"got {type(v).__name__}")
    return [None if v is None else list(v) for v in value]


def _grad_norms(grad_norms: Any, n_groups: int) -> list:
    """``grad_norms``: one entry per group, None (computed from the grads when clipping needs it) or the group's
    scaled grad norm, a number >= 0."""
    if grad_norms is None:
        return [None] * n_groups
    if isinstance(grad_norms, torch.Tensor) and grad_norms.dim() == 1:
        grad_norms = list(grad_norms.unbind())
    if not isinstance(grad_norms, (list, tuple)):
        raise TypeError(f"FusedAdam.step: grad_norms must be a list of one norm per param group ({n_groups}), got "
                        f"{type(grad_norms).__name__}")
    if len(grad_norms) != n_groups:
        raise ValueError(f"FusedAdam.step: grad_norms has {len(grad_norms)} entries, the optimizer has {n_groups} "
                         "groups")
    for gi, norm in enumerate(grad_norms):
        if norm is not None:
            _check_range(f"grad_norms[{gi}] (the grad norm of param group {gi})", norm, 0.0)
    return list(grad_norms)


def _repeats_memory(t: torch.Tensor) -> bool:
    """Whether elements of ``t`` share memory (an expanded view): an in-place write to it is refused."""
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))


def _check_output(gi: int, i: int, p: torch.Tensor, out: Any) -> None:
    """An output param receives the updated param, rounded to its own floating dtype, in place."""
    where = f"FusedAdam.step: output param {i} of group {gi}"
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{where} must be a tensor or None, got {type(out).__name__}")
    if not out.is_floating_point():
        raise TypeError(f"{where} must be a real floating point tensor, got dtype {out.dtype}")
    if out.shape != p.shape:
        raise ValueError(f"{where} has shape {tuple(out.shape)}; expected the param's {tuple(p.shape)}")
    if out.is_inference():
        raise TypeError(f"{where} is an inference tensor (made under torch.inference_mode()), which cannot be "
                        "written in place outside it")
    if _repeats_memory(out):
        raise ValueError(f"{where} repeats memory (an expanded view, stride {tuple(out.stride())}): the updated "
                         "param cannot be written into it")


def _check_grad(gi: int, i: int, p: torch.Tensor, g: Any) -> None:
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"FusedAdam.step: grad of param {i} of group {gi} is {type(g).__name__}; expected a tensor")
    if g.layout != torch.strided:
        raise RuntimeError("FusedAdam does not support sparse gradients, please consider SparseAdam instead")
    if not g.is_floating_point():
        raise TypeError(f"FusedAdam.step: grad of param {i} of group {gi} has dtype {g.dtype}; expected a real "
                        "floating point grad")
    if g.shape != p.shape:
        raise ValueError(f"FusedAdam.step: param {i} of group {gi} has shape {tuple(p.shape)}; its grad has "
                         f"{tuple(g.shape)}")
    if g.is_meta and not p.is_meta:
        raise ValueError(f"FusedAdam.step: grad of param {i} of group {gi} is a meta tensor, which holds no values")


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
    docstring for the math. ``amsgrad=True`` raises RuntimeError, as NVIDIA's.

    Params must be real floating point tensors (complex, integer and bool ones raise TypeError). ``step`` checks
    every argument (grads: real floating point tensors of the params' shapes; output params: writable floating
    point tensors of those shapes; ``grad_norms``: one number >= 0 or None per group), every group's options
    and every param's state before it updates the first param; ``load_state_dict`` checks the groups and states
    the same way (torch.optim.Adam's layout: ``step``, ``exp_avg``, ``exp_avg_sq``), so a rejected call changes
    nothing. A group asking for AMSGrad or for torch.optim's maximize/capturable/differentiable raises
    ValueError."""

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

    def __getstate__(self) -> dict:
        # torch's keeps only defaults, state and groups: a copy or an unpickled optimizer must keep the eps rule
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in _OPTION_ATTRS if k in self.__dict__})
        return state

    @staticmethod
    def _check_group(group: dict) -> None:
        _check_adam_group(group)
        _check_range("max_grad_norm", group["max_grad_norm"], 0.0)

    def _validate(self, group: dict, where: str) -> None:
        """Every option a step reads, in a group being added, loaded or stepped; raises naming ``where``."""
        name = type(self).__name__
        with naming(where):
            check_torch_options(name, group)
            check_flags(group)
            check_no_amsgrad(name, group)
            self._check_group(group)

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group after the checks: real floating point params, each once, and the options."""
        name = type(self).__name__
        params = group_params(param_group)
        if params is not None:
            check_unique_params(name, self.param_groups, params, len(self.param_groups))
            check_names_agree(name, self.param_groups, param_group)
            for i, p in enumerate(params):
                check_param_kind(name, i, p)
        probe = dict(self.defaults)
        probe.update({k: v for k, v in param_group.items() if k != "params"})
        self._validate(probe, f"{name}: param group {len(self.param_groups)}")
        plain_numbers(self.defaults, self.defaults)
        plain_numbers(param_group, self.defaults)
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load (states cast to each param's dtype and device), after checking every group and state entry
        as a step would (nothing changes on failure); a loaded group without one of the options (an older
        checkpoint) takes the default."""
        name = type(self).__name__
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), (list, tuple)):
            raise TypeError(f"{name}.load_state_dict expects an optimizer state_dict with 'state' and 'param_groups'")
        for gi, g in enumerate(state_dict["param_groups"]):
            if not isinstance(g, dict):
                raise TypeError(f"{name}.load_state_dict: param group {gi} must be a dict, got {type(g).__name__}")
            probe = dict(self.defaults)
            probe.update({k: v for k, v in g.items() if k != "params"})
            self._validate(probe, f"{name}.load_state_dict: param group {gi}")
        validate_loaded_state(name, self.param_groups, state_dict, lambda gi, _: _STATE_SPEC)
        load_filling_defaults(self, state_dict)

    def _plan(self, gi: int, group: dict, gs: Optional[list], outs: Optional[list]) -> list:
        """(param, grad, output) of every param of the group with a grad, after checking all the step will use:
        the group's options, each param, grad, output param and the state the update reads."""
        name = type(self).__name__
        check_group_keys(name, gi, group, self.defaults)
        self._validate(group, f"{name}: param group {gi}")
        ps = group["params"]
        gs = [None] * len(ps) if gs is None else gs
        outs = [None] * len(ps) if outs is None else outs
        if len(gs) != len(ps) or len(outs) != len(ps):
            raise ValueError(f"FusedAdam.step: group {gi} has {len(ps)} params, got {len(gs)} grads and "
                             f"{len(outs)} output params")
        items = []
        for i, (p, g, out) in enumerate(zip(ps, gs, outs)):
            check_param_kind(name, i, p)
            if _repeats_memory(p):
                raise ValueError(f"{name}: param {i} of group {gi} repeats memory (an expanded view, stride "
                                 f"{tuple(p.stride())}): an in-place update cannot write it")
            if out is not None:
                _check_output(gi, i, p, out)
            if g is None:
                g = p.grad
            if g is None:
                continue
            _check_grad(gi, i, p, g)
            check_live_state(name, gi, i, p, self.state.get(p, {}))
            items.append((p, g, out))
        return items

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=1.0, grad_norms=None):
        """One update of every param with a grad (from ``grads`` or ``p.grad``); returns the closure's loss.
        Every argument, group, param and state is checked before the first param or state changes."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        n = len(self.param_groups)
        grads_group = _per_group(grads, n, "grads")
        outs_group = _per_group(output_params, n, "output_params")
        _check_range("scale", scale, 0.0, lo_open=True)
        scale = float(scale)
        norms = _grad_norms(grad_norms, n)
        plans = [self._plan(gi, group, gs, outs)
                 for gi, (group, gs, outs) in enumerate(zip(self.param_groups, grads_group, outs_group))]
        for group in self.param_groups:  # every check passed: numpy options become the numbers they hold
            plain_numbers(group, self.defaults)
        for group, items, norm in zip(self.param_groups, plans, norms):
            if not items:
                continue
            combined = scale
            max_norm = float(group["max_grad_norm"])
            if max_norm > 0:
                norm = group_grad_norm([g for _, g, _ in items]) if norm is None else float(norm)
                clip = ((norm / scale) + 1e-6) / max_norm
                if clip > 1:
                    combined = clip * scale
            self._update(group, items, combined)
        return loss

    def _update(self, group: dict, items: list, combined_scale: float) -> None:
        # Python numbers: one-element tensor options (accepted by the checks) cannot be an ``alpha``
        beta1, beta2 = map(float, group["betas"])
        eps, decay, lr = float(group["eps"]), float(group["weight_decay"]), float(group["lr"])
        bias_correction = bool(group["bias_correction"])
        for p, g, out in items:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            t = state["step"]
            if bias_correction:
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
