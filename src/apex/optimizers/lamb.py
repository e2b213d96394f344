"""LAMB as the NPU patch defines it: NpuFusedLamb (combined buffers) and Lamb (per-tensor reference).

Per param (You et al. 2019, "Large Batch Optimization for Deep Learning"), with
the Ascend patch's choices: no bias correction, L2 weight decay added to the update,
weight norm clamped to 10::

    g = grad * c                      c = 1, or 1/||all grads|| when use_global_grad_norm and that norm > 1
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g^2
    u = m / (sqrt(v) + eps) + weight_decay * p
    r = min(||p||, 10) / ||u||        r = 1 if either norm is 0, or if adam=True
    p = p - lr * r * u

The grad multiplier ``c`` is applied inside the update (user grads are left as
they are); the global norm is taken over the grads of all param groups
(params without a grad excluded) and applied to every group whose
``use_global_grad_norm`` is set.

Executors: on CPU one apex_C call per group x dtype (``_raw_lamb_step``) making two passes:
stage 1 updates m, v and sums per-param ||p||^2 and ||u||^2, reading fresh grads where
autograd left them unless a global norm is asked for; the trust ratios are formed from
those sums in the same call; stage 2 applies them. Plus
one ``sum_sq`` pass over the flat grads for the global norm when asked; elsewhere the same math as
torch ops on flat slices. Low-precision m, v are stored before u is formed in
both executors, so u is computed from the stored moments.
"""

from __future__ import annotations

import weakref
from typing import Callable, List, Optional, Union

import torch

from .. import _core
from .._checks import plain_numbers
from ._base import (
    CombinedOptimizer,
    _call_closure,
    _check_adam_group,
    _wrap_host_defaults,
    check_group_keys,
    check_names_agree,
    check_param_kind,
    check_torch_options,
    group_params,
    load_filling_defaults,
)
from ._flat import FlatSet
from ._functional import LAMB_WEIGHT_NORM_CLAMP, l2_grad, lamb_direction, lamb_moments, lamb_trust_ratio
from ._state_check import (
    COUNT,
    PARAM_SHAPED,
    SCALAR,
    check_live_state,
    check_unique_params,
    naming,
    validate_loaded_state,
)
from .clip import grad_runs, prepared_grad_norm

__all__ = ["Lamb", "NpuFusedLamb", "lamb_direction", "lamb_flat_step", "lamb_moments", "lamb_trust_ratio"]


def _validate_lamb_group(group: dict) -> None:
    _check_adam_group(group)
    for key in ("adam", "use_global_grad_norm"):
        if not isinstance(group.get(key, False), bool):
            raise TypeError(f"Invalid {key}: expected a bool, got {type(group[key]).__name__}")


def _lamb_defaults(lr, betas, eps, weight_decay, adam, use_global_grad_norm) -> dict:
    """Both LAMB classes' defaults from their (shared) signature, validated."""
    defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam=adam,
                    use_global_grad_norm=use_global_grad_norm)
    _validate_lamb_group(defaults)
    return defaults


def _global_multiplier(norm: float) -> float:
    """1/norm when the (unscaled) global grad norm exceeds 1, else 1."""
    return 1.0 / norm if norm > 1.0 else 1.0


# ------------------------------------------------------------------ fused
def lamb_flat_step(opt: CombinedOptimizer, s: FlatSet, *, grad_mul: Union[float, torch.Tensor], l2: float,
                   beta1: float, beta2: float, beta3: Optional[float], eps: float, weight_decay: float, bc1: float,
                   bc2: float, lr: float,
                   trust_ratio: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]) -> None:
    """One LAMB update of a FlatSet in torch ops (the torch executor of NpuFusedLamb and FusedLAMB).

    Per run of slots with a grad: ``g = grad * grad_mul + l2 * p`` (a new tensor when either term
    applies: user grads stay as they are), `lamb_moments`, the moments stored, `lamb_direction`
    from the stored (possibly rounded) moments as the kernel computes it, then
    ``p -= lr * r * u`` with ``r = trust_ratio(||p||, ||u||)`` per param (r = 1 when None). The
    norms cover the params only, not the zero gaps between slots, as the kernel's.
    """
    bounds = [*s.offsets, s.total]
    for lo, hi, k0, k1 in grad_runs(s):
        p = opt._f32(s.flat_p[lo:hi])
        g = opt._f32(s.flat_g[lo:hi])
        if isinstance(grad_mul, torch.Tensor):
            g = g * grad_mul.to(g.device)
        elif grad_mul != 1.0:
            g = g * grad_mul
        g = l2_grad(g, p, 1.0, l2)
        m_st, v_st = s.flat_s["exp_avg"][lo:hi], s.flat_s["exp_avg_sq"][lo:hi]
        m, v = opt._f32(m_st), opt._f32(v_st)
        lamb_moments(g, m, v, beta1=beta1, beta2=beta2, beta3=beta3)
        opt._write_back(m_st, m)
        opt._write_back(v_st, v)
        u = lamb_direction(p, opt._f32(m_st), opt._f32(v_st), eps=eps, weight_decay=weight_decay, bc1=bc1, bc2=bc2)
        if trust_ratio is None:
            p.add_(u, alpha=-lr)
        else:
            # pieces: param k0, gap, param k0+1, gap, ... (norms over the params only)
            pieces = []
            for k in range(k0, k1):
                n = s.params[k].numel()
                pieces += [n, bounds[k + 1] - bounds[k] - n]
            p_norm = torch.stack(torch._foreach_norm(list(torch.split(p, pieces)[0::2])))
            u_norm = torch.stack(torch._foreach_norm(list(torch.split(u, pieces)[0::2])))
            ratio = trust_ratio(p_norm, u_norm)
            slots = torch.tensor([bounds[k + 1] - bounds[k] for k in range(k0, k1)], device=p.device)
            scale = torch.repeat_interleave(ratio, slots, output_size=hi - lo)
            p.addcmul_(scale, u, value=-lr)
        opt._write_back(s.flat_p[lo:hi], p)


class _KernelPlan:
    """Kernel arguments of one FlatSet for LAMB, whose segments are the params *without* the zero gaps
    between slots: segment 2k is param k, segment 2k+1 the gap after it (always skipped). The gaps must
    stay out of the norms: with eps=0 a gap's update would be 0/0 and poison its param's ||u||."""

    def __init__(self, s: FlatSet):
        bounds = []
        for off, p in zip(s.offsets, s.params):
            bounds += [off, off + p.numel()]
        bounds.append(s.total)
        self.seg = torch.tensor(bounds, dtype=torch.int64)
        self.skip = torch.tensor([0, 1] * s.nseg, dtype=torch.uint8)
        self.norms = torch.zeros(4 * s.nseg, dtype=torch.float64)  # (||p||^2, ||u||^2) per segment
        self.ratio = torch.ones(2 * s.nseg, dtype=torch.float32)
        # grads read where they are: the set's per-slot addresses at the param segments (gaps are skipped)
        self.gtab = torch.zeros(2 * s.nseg, dtype=torch.int64)
        a = _core.ext.OptArgs()
        src = s.args
        a.p, a.g, a.s0, a.s1 = src.p, src.g, src.s0, src.s1
        a.pdt, a.gdt, a.sdt = src.pdt, src.gdt, src.sdt
        a.seg = self.seg.data_ptr()
        a.nseg = 2 * s.nseg
        a.skip = self.skip.data_ptr()
        self.args = a


class NpuFusedLamb(CombinedOptimizer):
    """LAMB with the NPU patch's semantics (see the module docstring), fused over combined buffers.

    Args: params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0, adam=False,
    use_global_grad_norm=False. ``adam`` and ``use_global_grad_norm`` are group options (the
    Ascend patch kept them on the optimizer), so they can differ per group and are saved in state_dict.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0, adam=False,
                 use_global_grad_norm=False):
        super().__init__(params, _lamb_defaults(lr, betas, eps, weight_decay, adam, use_global_grad_norm))

    _gather_grads = True  # stage 1 reads grads only through OptArgs (stage 2 reads none)

    def _init_combined(self) -> None:
        # also run when a copy (deepcopy / unpickle) restores only torch's fields
        super()._init_combined()
        self._plans: weakref.WeakKeyDictionary[FlatSet, _KernelPlan] = weakref.WeakKeyDictionary()
        self._global_mul: Union[float, torch.Tensor] = 1.0

    def _validate_group(self, group: dict) -> None:
        _validate_lamb_group(group)

    def _state_names(self, group: dict) -> List[str]:
        return ["exp_avg", "exp_avg_sq"]

    @torch.no_grad()
    def step(self, closure=None):
        loss = _call_closure(closure)
        prepared = self._prepare_step()
        self._global_mul = 1.0
        if any(g["use_global_grad_norm"] for g in self.param_groups):
            # the norm needs every group's grads before any group is updated (read where the update reads them)
            total = prepared_grad_norm([s for _, sets in prepared for s in sets], self.executor == "auto")
            gs = self._grad_scale()
            if isinstance(total, float):
                self._global_mul = _global_multiplier(total * gs)
            else:
                total = total * gs
                self._global_mul = torch.where(total > 1.0, 1.0 / total, torch.ones_like(total))
        self._update(prepared)
        return loss

    def _group_mul(self, group: dict) -> Union[float, torch.Tensor]:
        """Grad multiplier of a group: amp's unscale times the global-norm divisor."""
        mul = self._global_mul if group["use_global_grad_norm"] else 1.0
        return self._grad_scale() * mul

    def _plan(self, s: FlatSet) -> _KernelPlan:
        plan = self._plans.get(s)
        if plan is None:
            plan = self._plans[s] = _KernelPlan(s)
        return plan

    def _kernel_step(self, s: FlatSet, group: dict) -> None:
        b1, b2 = group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        plan = self._plan(s)
        plan.skip[0::2].copy_(s.skip)  # params without a grad; gaps stay skipped
        a = plan.args
        a.out, a.odt = s.args.out, s.args.odt  # O2 model copies, written by stage 2
        a.threads = _core.num_threads()
        a.flags = 0  # no bias correction
        a.grad_scale = float(self._group_mul(group))
        # stage 1's hyperparameters (beta3 unused: m takes 1 - beta1), then stage 2's, then the weight-norm clamp
        a.hp = [b1, b2, eps, wd, 0.0, group["lr"], eps, wd, 0.0, 0.0, LAMB_WEIGHT_NORM_CLAMP]
        a.seg_out = plan.norms.data_ptr()
        if s.gathered:
            plan.gtab[0::2].copy_(s.gtab)
            a.gtab = plan.gtab.data_ptr()
        else:
            a.g = s.flat_g.data_ptr()  # the set makes its flat grad buffer on demand
            a.gtab = 0
        if group["adam"]:
            a.seg_mul = 0  # the kernel's default multiplier is 1
        else:
            a.flags = _core.ext.FLAG_TRUST_RATIO | _core.ext.FLAG_CLAMP_WEIGHT_NORM
            a.seg_mul = plan.ratio.data_ptr()
        _core.ext._raw_lamb_step(a)

    def _torch_step(self, s: FlatSet, group: dict) -> None:
        b1, b2 = group["betas"]
        lamb_flat_step(self, s, grad_mul=self._group_mul(group), l2=0.0, beta1=b1, beta2=b2, beta3=None,
                       eps=group["eps"], weight_decay=group["weight_decay"], bc1=1.0, bc2=1.0, lr=group["lr"],
                       trust_ratio=None if group["adam"] else lamb_trust_ratio)


# ------------------------------------------------------------------ per-tensor reference
#: Lamb's per-param state: moments, step count and the last norms kept for logging
_LAMB_STATE = {"exp_avg": PARAM_SHAPED, "exp_avg_sq": PARAM_SHAPED, "step": COUNT, "weight_norm": SCALAR,
               "adam_norm": SCALAR, "trust_ratio": SCALAR}


def _check_params(opt: torch.optim.Optimizer, params) -> None:
    """Real floating point params only, in CombinedOptimizer's words (any float dtype: the math runs in fp32)."""
    for i, p in enumerate(params):
        check_param_kind(type(opt).__name__, i, p)


class Lamb(torch.optim.Optimizer):
    """Non-fused LAMB, one tensor at a time in torch ops: same semantics as NpuFusedLamb.

    Args: params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0, adam=False,
    use_global_grad_norm=False (the last is an addition to the Ascend patch's Lamb, for parity with
    NpuFusedLamb). Math is in float32 whatever the param dtype; states are stored in the param
    dtype; complex and integer params are rejected (TypeError), and a step checks every param and
    grad (sparse, shape) before it updates any. As the Ascend patch's Lamb, ``state[p]`` also records the
    last ``weight_norm``, ``adam_norm`` and ``trust_ratio`` (0-d tensors) for logging.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0, adam=False,
                 use_global_grad_norm=False):
        super().__init__(params, _lamb_defaults(lr, betas, eps, weight_decay, adam, use_global_grad_norm))

    def add_param_group(self, param_group: dict) -> None:
        # torch.optim.Optimizer.__init__ adds its groups through here, so this covers construction too
        params = group_params(param_group)
        if params is not None:
            _check_params(self, params)
            check_unique_params(type(self).__name__, self.param_groups, params, len(self.param_groups))
            check_names_agree(type(self).__name__, self.param_groups, param_group)
        probe = dict(self.defaults)
        probe.update({k: v for k, v in param_group.items() if k != "params"})
        with naming(f"{type(self).__name__}: param group {len(self.param_groups)}"):
            check_torch_options(type(self).__name__, probe)
            _validate_lamb_group(probe)
        plain_numbers(self.defaults, self.defaults)
        plain_numbers(param_group, self.defaults)
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, after the checks of `CombinedOptimizer.load_state_dict` (nothing changes on failure); a
        loaded group without one of the options (a checkpoint of an older version) takes the default, as there."""
        name = type(self).__name__
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list):
            raise TypeError(f"{name}.load_state_dict expects an optimizer state_dict with 'state' and 'param_groups'")
        for gi, g in enumerate(state_dict["param_groups"]):
            if not isinstance(g, dict):
                raise TypeError(f"{name}.load_state_dict: param groups must be dicts, got {type(g).__name__}")
            probe = dict(self.defaults)
            probe.update({k: v for k, v in g.items() if k != "params"})
            with naming(f"{name}.load_state_dict: param group {gi}"):
                check_torch_options(name, probe)
                _validate_lamb_group(probe)
        validate_loaded_state(name, self.param_groups, state_dict, lambda gi, _: _LAMB_STATE)
        load_filling_defaults(self, state_dict)

    def _check_step_inputs(self) -> None:
        """Everything a step could fail on, for every group, before the first param or state is touched."""
        name = type(self).__name__
        for gi, group in enumerate(self.param_groups):
            check_group_keys(name, gi, group, self.defaults)
            with naming(f"{name}: param group {gi}"):
                check_torch_options(name, group)
                _validate_lamb_group(group)  # options rewritten since add_param_group (a scheduler, user code)
            _check_params(self, group["params"])
            for k, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                if g.layout != torch.strided:
                    raise RuntimeError(
                        f"{type(self).__name__} does not support sparse gradients: param {k} has a grad with "
                        f"layout {g.layout}; expected a dense (strided) grad"
                    )
                if g.shape != p.shape:
                    raise RuntimeError(
                        f"grad of param {k} has shape {tuple(g.shape)}; expected the param's {tuple(p.shape)}"
                    )
                if any(st == 0 and n > 1 for st, n in zip(p.stride(), p.shape)):
                    raise RuntimeError(f"{name}: param {k} of group {gi} repeats memory (an expanded view, stride "
                                       f"{tuple(p.stride())}): an in-place update cannot write it")
                check_live_state(name, gi, k, p, self.state.get(p, {}))

    def _global_norm(self) -> Optional[torch.Tensor]:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return None
        # each grad's norm as the update reads it, in float32; float64 grads (which vector_norm will not narrow
        # in the same call) are normed in float64, then rounded
        norms = [torch.linalg.vector_norm(gr).float() if gr.dtype == torch.float64
                 else torch.linalg.vector_norm(gr, dtype=torch.float32) for gr in grads]
        dev = norms[0].device
        return torch.linalg.vector_norm(torch.stack([n.to(dev) for n in norms]))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _call_closure(closure)
        self._check_step_inputs()
        for group in self.param_groups:  # every check passed: numpy options become the numbers they hold
            plain_numbers(group, self.defaults)
        gnorm = self._global_norm() if any(g["use_global_grad_norm"] for g in self.param_groups) else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                g = p.grad.float()
                if gnorm is not None and group["use_global_grad_norm"]:
                    g = g * torch.where(gnorm > 1.0, 1.0 / gnorm, torch.ones_like(gnorm)).to(g.device)
                m, v = state["exp_avg"].float(), state["exp_avg_sq"].float()
                lamb_moments(g, m, v, beta1=b1, beta2=b2)
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
                pf = p.float()
                u = lamb_direction(pf, state["exp_avg"].float(), state["exp_avg_sq"].float(), eps=group["eps"],
                                   weight_decay=group["weight_decay"])
                w_norm = torch.linalg.vector_norm(pf)
                u_norm = torch.linalg.vector_norm(u)
                ratio = lamb_trust_ratio(w_norm, u_norm)
                state["weight_norm"], state["adam_norm"], state["trust_ratio"] = (
                    w_norm.clamp(max=LAMB_WEIGHT_NORM_CLAMP), u_norm, ratio)
                if group["adam"]:
                    ratio = torch.ones_like(ratio)
                p.copy_(pf.sub_(u.mul_(ratio), alpha=group["lr"]))
        return loss


_wrap_host_defaults(Lamb)  # its step counts are host tensors too (see _base._on_host_defaults)
