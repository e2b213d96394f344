"""FusedNovoGrad with NVIDIA Apex's signature, defaults and semantics, on combined buffers.

NovoGrad (Ginsburg et al., "Stochastic Gradient Methods with Layer-wise Adaptive
Moments", used in Jasper) keeps the second moment *per tensor*: a running norm of
each param's gradient instead of an elementwise average. As NVIDIA's FusedNovoGrad,
per param group with the group's step count ``t``::

    n  = ||grad||  per tensor                 (norm_type=2: L2; norm_type=0: max |grad|)
    gn = sqrt(beta2 * gn^2 + (1 - beta2) * n^2)     (L2)      gn = beta2 * gn + (1 - beta2) * n   (inf)
         gn starts at 0 (init_zero=True) or at the tensor's first norm (init_zero=False)
    bc1 = 1 - beta1^t,  bc2 = sqrt(1 - beta2^t)     (both 1 with bias_correction=False)
    d  = gn / bc2 + eps
    beta3 = 1 - beta1 with grad_averaging, else 1

    reg_inside_moment=False (default):  m = beta1 * m + beta3 * grad
                                        p = p - lr * ((m / bc1) / d + weight_decay * p)
    reg_inside_moment=True:             m = beta1 * m + beta3 * (grad / d + weight_decay * p)
                                        p = p - lr * m / bc1

State: ``state[p]["exp_avg"]`` (m) and ``state[p]["exp_avg_sq"]``, a 0-d float32
tensor holding gn (the norm itself, not its square, as NVIDIA stores it; NVIDIA keeps
these in ``group["exp_avg_sq"]`` as one tensor per dtype, which cannot survive params
being skipped or added, so they are per param here).

Executors on CPU: the per-tensor norms in one apex_C pass (``_raw_grad_sum_sq``; the
inf norm via torch's foreach norm), then the elementwise update on the apex_C SGD
kernel, which takes a per-tensor grad multiplier: with ``reg_inside_moment=True`` it
is exactly one SGD-with-momentum pass (grad multiplier 1/d, momentum beta1, dampening
1 - beta3, lr/bc1); in the default mode too (``FLAG_DECOUPLED``: momentum beta1,
dampening 1 - beta3, then the per-tensor multiplier 1/(bc1*d) on the updated m and the
weight decay after it). The norm pass and the SGD pass read the grads where autograd
left them after ``zero_grad(set_to_none=True)`` (no copy into the flat grad buffer). Elsewhere,
or with beta1 = 0 (a momentum-free SGD pass would not write m), the same math runs as
torch ops on flat slices (fresh grads copied in first).
"""

from __future__ import annotations

import math
import weakref
from typing import Dict, List

import torch

from .. import _core
from ._base import CombinedOptimizer, _call_closure, _check_adam_group, check_no_amsgrad
from ._flat import FlatSet
from ._nvidia import AmpCOp, NvidiaCompatMixin, OverflowFlag
from ._state_check import SCALAR, _check_entry
from ._state_watch import bind
from .clip import grad_runs, grad_sum_sq_into

__all__ = ["FusedNovoGrad"]


def _current_grads(s: FlatSet) -> List[torch.Tensor]:
    """Each slot's grad where the update reads it: the param's grad (a slot view, or a fresh tensor read in
    place), or for params without a grad (skipped; their norm is not used) the param itself, a tensor of the
    slot's shape that needs no flat grad buffer."""
    if not s.gathered:
        return s.grad_views
    return [p if p.grad is None else p.grad for p in s.params]


class _Norms:
    """Per-FlatSet running per-tensor grad norms; state[p]["exp_avg_sq"] entries are 0-d views of `gn`."""

    def __init__(self, s: FlatSet, state):
        self.gn = torch.zeros(s.nseg, dtype=torch.float32)
        self.seen = torch.zeros(s.nseg, dtype=torch.bool)
        self.sums = torch.zeros(s.nseg, dtype=torch.float64)  # kernel output of _raw_grad_sum_sq
        self.gmul = torch.ones(s.nseg, dtype=torch.float32)
        for k, p in enumerate(s.params):
            st = state.get(p)
            old = st.get("exp_avg_sq") if st else None
            if old is not None:
                self.gn[k] = float(old)
                self.seen[k] = True
                bind(st, "exp_avg_sq", self.gn[k])
        self.n_unseen = int((~self.seen).sum())


class FusedNovoGrad(NvidiaCompatMixin, CombinedOptimizer):
    """NovoGrad as ``apex.optimizers.FusedNovoGrad`` (see the module docstring for the exact math).

    Args: params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.,
    amsgrad=False, reg_inside_moment=False, grad_averaging=True, norm_type=2, init_zero=False,
    set_grad_none=True.

    As NVIDIA: ``amsgrad=True`` raises RuntimeError; norm types other than 2 and 0 (inf) raise
    RuntimeError (here when the group is added, not at the first step).
    """

    # upstream's kernel handles, for subclasses that replace step() (see `AmpCOp`)
    multi_tensor_novograd = AmpCOp("multi_tensor_novograd")
    _dummy_overflow_buf = OverflowFlag()

    _has_step = False
    _gather_grads = True  # the norm pass and the SGD kernel read grads only through OptArgs
    _reads_values = True  # per-tensor grad norms, blended on the host

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, reg_inside_moment=False, grad_averaging=True, norm_type=2, init_zero=False,
                 set_grad_none=True):
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, norm_type=norm_type, init_zero=init_zero)
        self._validate_group(defaults)
        self.moment_mode = 0 if reg_inside_moment else 1  # NVIDIA's attribute
        self.set_grad_none = bool(set_grad_none)
        super().__init__(params, defaults)

    def _init_combined(self) -> None:
        # also run when a copy (deepcopy / unpickle) restores only torch's fields
        super()._init_combined()
        self._norms: weakref.WeakKeyDictionary[FlatSet, _Norms] = weakref.WeakKeyDictionary()
        self._fell_back = False

    def _validate_group(self, group: dict) -> None:
        _check_adam_group(group)
        check_no_amsgrad(type(self).__name__, group)
        if group["norm_type"] not in (0, 2) or isinstance(group["norm_type"], bool):
            raise RuntimeError(
                f"FusedNovoGrad only support l2/inf norm now: expected norm_type 2 (L2) or 0 (inf), "
                f"got {group['norm_type']!r}"
            )

    def _state_names(self, group: dict) -> List[str]:
        return ["exp_avg"]

    def _check_rebuild(self, group: dict) -> None:
        """Also the per-tensor norms user code may have set (``state[p]["exp_avg_sq"] = ...``), before the step
        count moves: each becomes one float32 slot of the set's norm table."""
        super()._check_rebuild(group)
        for k, p in enumerate(group["params"]):
            st = self.state.get(p)
            if st and "exp_avg_sq" in st:
                _check_entry(f"state 'exp_avg_sq' of param {k}", SCALAR, st["exp_avg_sq"], p)

    def _loaded_state_spec(self, group: dict) -> Dict[str, str]:
        return {**super()._loaded_state_spec(group), "exp_avg_sq": SCALAR}  # the per-tensor grad norm

    @torch.no_grad()
    def step(self, closure=None):
        """One NovoGrad update of every param with a grad. Returns the closure's loss (None without one)."""
        loss = _call_closure(closure)
        prepared = self._prepare_counted_step()
        self._fell_back = False
        self._update(prepared)
        if self._fell_back:
            self.last_executor = "torch"
        return loss

    def _gathers(self, s: FlatSet, group: dict) -> bool:
        # with beta1 = 0 the kernel step runs the torch math, which reads the flat grad buffer
        return group["betas"][0] != 0 and super()._gathers(s, group)

    # ------------------------------------------------------------ per-tensor norms
    def _aux(self, s: FlatSet) -> _Norms:
        aux = self._norms.get(s)
        if aux is None:
            aux = self._norms[s] = _Norms(s, self.state)
        return aux

    def _grad_norms(self, s: FlatSet, group: dict, aux: _Norms, a) -> torch.Tensor:
        """Per-segment norms of the (unscaled) grads, float32 on the CPU; skipped segments hold junk.

        `a`: the kernel step's arguments (None in the torch executor), whose grad source (flat buffer or the
        grads where autograd left them) the L2 norm pass reads."""
        gs = abs(self._grad_scale())
        if group["norm_type"] == 2 and a is not None:
            grad_sum_sq_into(a, aux.sums)
            return (aux.sums.sqrt() * gs).to(torch.float32)
        order = 2.0 if group["norm_type"] == 2 else math.inf
        grads = _current_grads(s)
        if order == math.inf:  # torch's inf norm of an empty tensor raises; its max |grad| is taken as 0
            grads = [g if g.numel() else g.new_zeros(1) for g in grads]
        norms = torch._foreach_norm(grads, order, dtype=torch.float32)
        return (torch.stack(norms).cpu() * gs).to(torch.float32)

    def _blend(self, s: FlatSet, group: dict, aux: _Norms, a=None) -> torch.Tensor:
        """Updates gn for the segments with a grad; returns d = gn / bc2 + eps per segment."""
        b2 = group["betas"][1]
        n = self._grad_norms(s, group, aux, a)
        start = aux.gn if group["init_zero"] else torch.where(aux.seen, aux.gn, n)
        if group["norm_type"] == 2:
            new = (b2 * start.double().square() + (1 - b2) * n.double().square()).sqrt().float()
        else:
            new = (b2 * start.double() + (1 - b2) * n.double()).float()
        active = s.skip == 0 if s.n_skipped else torch.ones(s.nseg, dtype=torch.bool)
        aux.gn.copy_(torch.where(active, new, aux.gn))
        step = self._use_group_step(s, group)
        bc2 = math.sqrt(1 - b2**step) if group["bias_correction"] else 1.0
        return aux.gn.double() / bc2 + group["eps"]

    def _expose_norms(self, s: FlatSet, aux: _Norms) -> None:
        """state[p]["exp_avg_sq"] for params updated for the first time."""
        if not aux.n_unseen:
            return
        active = (s.skip == 0) if s.n_skipped else torch.ones(s.nseg, dtype=torch.bool)
        new = active & ~aux.seen
        for k in torch.nonzero(new).flatten().tolist():
            bind(self.state[s.params[k]], "exp_avg_sq", aux.gn[k])
        aux.seen |= active
        aux.n_unseen = int((~aux.seen).sum())

    def _scalars(self, group: dict, step: float):
        b1 = group["betas"][0]
        bc1 = 1 - b1**step if group["bias_correction"] else 1.0
        b3 = 1 - b1 if group["grad_averaging"] else 1.0
        return b1, bc1, b3

    # ------------------------------------------------------------ executors
    def _kernel_step(self, s: FlatSet, group: dict) -> None:
        if group["betas"][0] == 0:
            self._torch_step(s, group)
            s.copy_out(fused=False)  # the base class expects the kernel to have written the model copies
            self._fell_back = True
            return
        aux = self._aux(s)
        a = self._prepare_args(s, [], 0)
        d = self._blend(s, group, aux, a)
        step = float(s.steps[0]) if s.nseg else 0.0
        b1, bc1, b3 = self._scalars(group, step)
        lr, wd = group["lr"], group["weight_decay"]
        a.first = 0  # m starts at zero: never the SGD kernel's "buffer = grad" first update
        try:
            if self.moment_mode == 0:
                aux.gmul.copy_(1.0 / d)
                a.seg_gmul = aux.gmul.data_ptr()
                a.seg_mul = 0
                a.hp = [lr / bc1, b1, 1.0 - b3, wd]
                _core.ext._raw_sgd_step(a)
            else:
                # m = b1*m + b3*g, then p = p - lr * (m / (bc1*d) + wd * p) with m as stored: the decay after the
                # momentum and a per-tensor multiplier on it (FLAG_DECOUPLED), one pass
                aux.gmul.copy_(1.0 / (bc1 * d))
                a.seg_gmul = 0
                a.seg_mul = aux.gmul.data_ptr()
                a.flags = _core.ext.FLAG_DECOUPLED
                a.hp = [lr, b1, 1.0 - b3, wd]
                _core.ext._raw_sgd_step(a)
        finally:
            a.first = s.first.data_ptr()
            a.seg_gmul = 0
            a.seg_mul = 0
            a.flags = 0
        self._expose_norms(s, aux)

    def _torch_step(self, s: FlatSet, group: dict) -> None:
        aux = self._aux(s)
        d = self._blend(s, group, aux)
        step = float(s.steps[0]) if s.nseg else 0.0
        b1, bc1, b3 = self._scalars(group, step)
        lr, wd = group["lr"], group["weight_decay"]
        gs = self._grad_scale()
        bounds = [*s.offsets, s.total]
        for lo, hi, k0, k1 in grad_runs(s):
            lengths = torch.tensor([bounds[k + 1] - bounds[k] for k in range(k0, k1)])
            inv_d = torch.repeat_interleave((1.0 / d[k0:k1]).float(), lengths, output_size=hi - lo).to(s.device)
            p = self._f32(s.flat_p[lo:hi])
            g = self._f32(s.flat_g[lo:hi]) * gs
            m_st = s.flat_s["exp_avg"][lo:hi]
            m = self._f32(m_st)
            if self.moment_mode == 0:
                g.mul_(inv_d)
                if wd != 0:
                    g.add_(p, alpha=wd)
                m.mul_(b1).add_(g, alpha=b3)
                self._write_back(m_st, m)
                p.add_(self._f32(m_st), alpha=-lr / bc1)
            else:
                m.mul_(b1).add_(g, alpha=b3)
                self._write_back(m_st, m)
                u = self._f32(m_st).mul(inv_d).div_(bc1)
                if wd != 0:
                    u.add_(p, alpha=wd)
                p.add_(u, alpha=-lr)
            self._write_back(s.flat_p[lo:hi], p)
        self._expose_norms(s, aux)
        self.last_executor = "torch"
