"""NpuFusedBertAdam: BERT's Adam (no bias correction, decoupled decay, warmup schedules) on combined buffers."""

from __future__ import annotations

import logging
import math
import weakref
from typing import Callable, Dict, List

import torch
from torch.optim.optimizer import required

from .. import _core
from ._base import CombinedOptimizer, _check_range
from ._flat import FlatSet
from ._functional import settler
from .clip import grad_sum_sq_into

logger = logging.getLogger("apex.optimizers")

# Learning-rate multipliers of the training progress x = step / t_total (0 at the first
# step); `warmup` is the fraction of t_total spent ramping up linearly from 0 to 1.
# Past the end of training (x >= 1) the decaying schedules stay at 0.


def warmup_linear(x: float, warmup: float) -> float:
    """Triangle: up to 1 at x = warmup, then linearly down to 0 at x = 1."""
    if x < warmup:
        return x / warmup
    return max(0.0, (x - 1.0) / (warmup - 1.0))


def warmup_constant(x: float, warmup: float) -> float:
    """Linear warmup, then 1."""
    if x < warmup:
        return x / warmup
    return 1.0


def warmup_cosine(x: float, warmup: float) -> float:
    """Linear warmup, then half a cosine from 1 (x = 0) to 0 (x = 1), as the original's formula."""
    if x < warmup:
        return x / warmup
    return 0.5 * (1.0 + math.cos(math.pi * min(x, 1.0)))


def warmup_poly(x: float, warmup: float, degree: float = 0.5) -> float:
    """Linear warmup, then (1 - x) ** degree."""
    if x < warmup:
        return x / warmup
    return max(0.0, 1.0 - x) ** degree


SCHEDULES: Dict[str, Callable[[float, float], float]] = {
    "warmup_cosine": warmup_cosine,
    "warmup_constant": warmup_constant,
    "warmup_linear": warmup_linear,
    "warmup_poly": warmup_poly,
}


def scheduled_lr(group: dict, step: float) -> float:
    """lr for an update whose step count before this update is ``step`` (0 at the first update)."""
    lr = float(group["lr"])
    if group["t_total"] == -1:
        return lr
    warmup = group["warmup"]
    x = step / group["t_total"]
    return lr * SCHEDULES[group["schedule"]](x, 0.0 if warmup == -1 else warmup)


def bert_adam_math(p, g, m, v, *, lr, beta1, beta2, eps, weight_decay, grad_mul, settle):
    """One BertAdam update on fp32 tensors (in place).

    ``u = m / (sqrt(v) + eps) + weight_decay * p``, ``p -= lr * u``: Adam without bias
    correction, decay added to the update. ``grad_mul`` (scalar or per-element tensor) is
    the clipping coefficient times any unscale factor. ``settle(t)`` rounds a state through
    its storage dtype in place (the update reads the moments as stored).
    """
    if not (isinstance(grad_mul, float) and grad_mul == 1.0):
        g = g * grad_mul
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    settle(m)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    settle(v)
    u = m / (v.sqrt().add_(eps))
    if weight_decay != 0:
        u.add_(p, alpha=weight_decay)
    p.add_(u, alpha=-lr)


class _SegmentLayout:
    """Slot sizes of one FlatSet (a param plus its padding), as python ints and on the buffers' device.

    Built once per set: a rebuilt set is a new FlatSet, and the weak cache drops the old one's.
    """

    def __init__(self, s: FlatSet):
        bounds = [*s.offsets, s.total]
        self.sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        self.lengths = torch.tensor(self.sizes, dtype=torch.int64, device=s.device)


class NpuFusedBertAdam(CombinedOptimizer):
    """BERT's Adam (pytorch-pretrained-bert ``BertAdam``), fused over combined buffers.

    Args: params, lr (required), warmup=-1, t_total=-1, schedule='warmup_linear', b1=0.9,
    b2=0.99, e=1e-6, weight_decay=0.01, max_grad_norm=-1: the NPU patch's signature, defaults
    included (its docstring lists pytorch-pretrained-bert's b2=0.999 and max_grad_norm=1.0, but
    its code defaults to b2=0.99 and no clipping; code written for the patch gets what it got
    there). Pass ``b2=0.999, max_grad_norm=1.0`` for pytorch-pretrained-bert's ``BertAdam``.

    Per param, with g its gradient::

        g = g * min(max_grad_norm / (||g|| + 1e-6), 1)      # if max_grad_norm > 0
        m = b1 * m + (1 - b1) * g;  v = b2 * v + (1 - b2) * g * g
        p -= lr_t * (m / (sqrt(v) + e) + weight_decay * p)

    with no bias correction. ``lr_t = lr * schedule(step / t_total, warmup)`` when
    ``t_total != -1`` (``step`` counted before this update, per param), else ``lr``.
    ``warmup=-1`` means no warmup (the schedule is evaluated with warmup 0).

    Differences from the NPU patch, all fixes:

    * clipping uses ``max_grad_norm`` (the patch clipped to 1 whatever its value) and is
      per param, BertAdam's documented rule (``clip_grad_norm_(p, max_grad_norm)``); the
      coefficient is folded into the update, so ``p.grad`` is left as it was;
    * ``warmup_cosine`` works (the patch called ``torch.cos`` on a float and crashed);
      past ``t_total`` the decaying schedules stay at 0 (the raw cosine would rise again
      and the poly one turn complex);
    * the step count is a per-param ``state[p]['step']`` and is saved in checkpoints;
    * ``warmup=-1`` with ``t_total`` set no longer halves ``warmup_linear`` (the raw
      formula ``(x - 1) / (warmup - 1)`` with warmup -1 gives ``(1 - x) / 2``).
    """

    def __init__(self, params, lr=required, warmup=-1, t_total=-1, schedule="warmup_linear", b1=0.9, b2=0.99,
                 e=1e-6, weight_decay=0.01, max_grad_norm=-1):
        defaults = dict(
            lr=lr, schedule=schedule, warmup=warmup, t_total=t_total, b1=b1, b2=b2, e=e,
            weight_decay=weight_decay, max_grad_norm=max_grad_norm,
        )
        self._validate_group(defaults)
        super().__init__(params, defaults)

    _gather_grads = True  # the kernels (norm pass and update) read grads only through OptArgs

    def _init_combined(self) -> None:
        # also run when a copy (deepcopy / unpickle) restores only torch's fields
        super()._init_combined()
        self._warned_past_end = False
        self._layouts: weakref.WeakKeyDictionary[FlatSet, _SegmentLayout] = weakref.WeakKeyDictionary()

    def _validate_group(self, group: dict) -> None:
        if group["lr"] is not required:  # a missing lr is reported by torch.optim.Optimizer
            _check_range("learning rate", group["lr"], 0.0)
        schedule = group["schedule"]
        if schedule not in SCHEDULES:
            raise ValueError(f"Invalid schedule parameter: expected one of {sorted(SCHEDULES)}, got {schedule!r}")
        warmup = group["warmup"]
        if warmup != -1:
            _check_range("warmup (-1 or a fraction of t_total)", warmup, 0.0, 1.0)
        t_total = group["t_total"]
        if t_total != -1:
            _check_range("t_total (-1 or a number of steps)", t_total, 0.0, lo_open=True)
        _check_range("b1 parameter", group["b1"], 0.0, 1.0)
        _check_range("b2 parameter", group["b2"], 0.0, 1.0)
        _check_range("epsilon value", group["e"], 0.0)
        _check_range("weight_decay value", group["weight_decay"], 0.0)
        _check_range("max_grad_norm value (<= 0: no clipping)", group["max_grad_norm"], float("-inf"),
                     allow_inf=True)

    def _state_names(self, group: dict) -> List[str]:
        return ["exp_avg", "exp_avg_sq"]

    # -------------------------------------------------------------- helpers
    @staticmethod
    def _counts_before(s: FlatSet, group: dict) -> List[float]:
        """Distinct step counts (before this update) of the updated segments; [] for a constant lr."""
        if group["t_total"] == -1:
            return []
        before = s.steps - 1  # steps were already advanced for this update
        if s.n_skipped:
            before = before[s.skip == 0]
        return torch.unique(before).tolist()

    def _note_progress(self, group: dict, counts: List[float]) -> None:
        """One warning per optimizer when the schedule runs past t_total (its lr stays at the end value)."""
        if self._warned_past_end or not counts or max(counts) < group["t_total"]:
            return
        self._warned_past_end = True
        warmup = 0.0 if group["warmup"] == -1 else group["warmup"]
        factor = SCHEDULES[group["schedule"]](max(counts) / group["t_total"], warmup)
        logger.warning(
            "NpuFusedBertAdam: training past t_total=%s; schedule %r now gives lr multiplier %s",
            group["t_total"], group["schedule"], factor,
        )

    def _clip_coefs_kernel(self, s: FlatSet, group: dict, a) -> torch.Tensor:
        """Per-segment clip coefficient x grad scale, from one float64 norm pass over the grads the update reads
        (`a`: the flat buffer, or the grads where autograd left them); skipped segments are not read."""
        sq = torch.empty(s.nseg, dtype=torch.float64)
        grad_sum_sq_into(a, sq)
        scale = self._grad_scale()
        norms = sq.sqrt_().mul_(abs(scale))
        coefs = torch.clamp(group["max_grad_norm"] / (norms + 1e-6), max=1.0)
        return coefs.mul_(scale).to(torch.float32)

    def _layout(self, s: FlatSet) -> _SegmentLayout:
        layout = self._layouts.get(s)
        if layout is None:
            layout = self._layouts[s] = _SegmentLayout(s)
        return layout

    def _clip_coefs_torch(self, s: FlatSet, group: dict) -> torch.Tensor:
        """Per-segment clip coefficient x grad scale (fp32, on the buffers' device).

        One fp32 norm per segment (slot padding is zero, so it adds nothing), with no
        host-side index or device->host sync.
        """
        pieces = torch.split(s.flat_g, self._layout(s).sizes)
        norms = torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float32))
        scale = self._grad_scale()
        coefs = torch.clamp(group["max_grad_norm"] / (norms.mul_(abs(scale)) + 1e-6), max=1.0)
        return coefs.mul_(scale)

    # ------------------------------------------------------------ executors
    def _kernel_step(self, s: FlatSet, group: dict) -> None:
        counts = self._counts_before(s, group)
        self._note_progress(group, counts)
        hp_tail = [float(group[k]) for k in ("b1", "b2", "e", "weight_decay")]
        a = self._prepare_args(s, [scheduled_lr(group, counts[0] if counts else 0.0), *hp_tail])
        coefs = None
        if group["max_grad_norm"] > 0:
            coefs = self._clip_coefs_kernel(s, group, a)
            a.seg_gmul = coefs.data_ptr()
            a.grad_scale = 1.0  # folded into coefs
        else:
            a.seg_gmul = 0
        try:
            if len(counts) <= 1:
                _core.ext._raw_bert_adam_step(a)
                return
            # Params with different step counts get different scheduled lrs: one pass per count,
            # skipping the other segments (rare: only after params missed updates).
            base_skip = s.skip if s.n_skipped else torch.zeros(s.nseg, dtype=torch.uint8)
            steps_t = s.steps - 1
            for t in counts:
                mask = (base_skip != 0) | (steps_t != t)
                skip = mask.to(torch.uint8)
                a.skip = skip.data_ptr()
                a.hp = [scheduled_lr(group, t), *hp_tail]
                _core.ext._raw_bert_adam_step(a)
        finally:
            # the args outlive this call: leave no pointer to this step's temporaries behind
            a.seg_gmul = 0
            a.skip = s.skip.data_ptr() if s.n_skipped else 0

    def _torch_step(self, s: FlatSet, group: dict) -> None:
        settle = settler(s.dtype)
        coefs = self._clip_coefs_torch(s, group) if group["max_grad_norm"] > 0 else None
        runs = s.active_runs()
        self._note_progress(group, self._counts_before(s, group))
        lengths = self._layout(s).lengths if coefs is not None else None
        for lo, hi, step, k, j in runs:
            if coefs is None:
                grad_mul = self._grad_scale()
            else:  # output_size: no device->host sync to size the result
                grad_mul = torch.repeat_interleave(coefs[k:j], lengths[k:j], output_size=hi - lo)
            p = self._f32(s.flat_p[lo:hi])
            m = self._f32(s.flat_s["exp_avg"][lo:hi])
            v = self._f32(s.flat_s["exp_avg_sq"][lo:hi])
            bert_adam_math(
                p, self._f32(s.flat_g[lo:hi]), m, v, lr=scheduled_lr(group, step - 1), beta1=group["b1"],
                beta2=group["b2"], eps=group["e"], weight_decay=group["weight_decay"], grad_mul=grad_mul,
                settle=settle,
            )
            self._write_back(s.flat_p[lo:hi], p)
            self._write_back(s.flat_s["exp_avg"][lo:hi], m)
            self._write_back(s.flat_s["exp_avg_sq"][lo:hi], v)
        self.last_executor = "torch"
