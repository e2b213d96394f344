"""Gradient-norm clipping over combined grads (the Ascend patch's ``clip_optimizer_grad_norm_fused``).

``torch.nn.utils.clip_grad_norm_`` is the reference: same norm, same clip
coefficient ``max_norm / (total_norm + 1e-6)`` clamped to 1, same return value.
The difference is the cost: on CPU the norm is one pass over each flat grad
buffer (apex_C ``sum_sq`` / ``max_abs``, float64 accumulation) and the scaling
is one more pass (``scale_``), whatever the number of tensors.

Slots of params whose ``.grad is None`` hold stale values in the flat buffer,
so they are left out of the norm (the buffer is read in runs of consecutive
slots that have grads; the zero gaps between slots do not change a norm).

The helpers here are shared with LAMB's ``use_global_grad_norm``.
"""

from __future__ import annotations

import math
from typing import List, Tuple, Union

import torch

from .. import _core
from ._flat import FlatSet

__all__ = ["clip_optimizer_grad_norm_fused"]

# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing
_CLIP_EPS = 1e-6


def healed_sets(opt) -> List[FlatSet]:
    """All flat sets of `opt`, combined now if needed, with user-rebound grads adopted first.

    Same preparation as a step (every group checked before anything is healed), so a later
    ``step()`` finds nothing left to heal and counts no second re-combine event.
    """
    return [s for _, group_sets in opt._prepare_groups() for s in group_sets]


def grad_runs(s: FlatSet) -> List[Tuple[int, int, int, int]]:
    """(lo, hi, k0, k1): element ranges of consecutive slots k0..k1-1 whose params have grads."""
    bounds = [*s.offsets, s.total]
    if not s.n_skipped:
        return [(0, s.total, 0, s.nseg)] if s.nseg else []
    skip = s.skip.tolist()
    runs = []
    k = 0
    while k < s.nseg:
        if skip[k]:
            k += 1
            continue
        j = k + 1
        while j < s.nseg and not skip[j]:
            j += 1
        runs.append((bounds[k], bounds[j], k, j))
        k = j
    return runs


def _host_combine(parts: List[float], norm_type: float) -> float:
    """Norm from per-run partials: sums of squares (2-norm) or maxima (inf-norm)."""
    if norm_type == 2.0:
        return math.sqrt(math.fsum(parts))
    if any(math.isnan(x) for x in parts):
        return math.nan
    return max(parts, default=0.0)


def total_grad_norm(sets: List[FlatSet], norm_type: float, use_kernel: bool = True) -> Union[float, torch.Tensor]:
    """Norm of all grads (params with ``.grad is None`` excluded), before any unscale.

    Empty grads are left out: they change no norm, and torch's infinity and non-positive orders raise on an empty
    tensor (which made the result depend on whether an empty grad shared a set with a non-empty one); with no
    element at all the norm is 0.

    Returns a Python float (float64 accumulation) when every set can use the
    apex_C kernels (and `use_kernel`) and the norm is 2 or inf; otherwise a 0-d
    float32 tensor on the first set's device, computed with torch ops and no
    host sync.
    """
    host: List[float] = []
    dev: List[torch.Tensor] = []
    if norm_type <= 0:
        # torch's combination of per-tensor norms is not a norm of the concatenation for
        # these orders (zero gaps would count): use the per-tensor grads, as torch does.
        for s in sets:
            for p in s.params:
                if p.grad is not None and p.grad.numel():
                    dev.append(torch.linalg.vector_norm(p.grad, norm_type, dtype=torch.float32))
    else:
        for s in sets:
            host_ok = use_kernel and s.uses_kernel and norm_type in (2.0, math.inf)
            for lo, hi, _, _ in grad_runs(s):
                if lo == hi:
                    continue
                g = s.flat_g[lo:hi]
                if host_ok:
                    host.append(_core.sum_sq(g) if norm_type == 2.0 else _core.max_abs(g))
                else:
                    dev.append(torch.linalg.vector_norm(g, norm_type, dtype=torch.float32))
    if not dev:
        return _host_combine(host, norm_type) if host else 0.0
    device = dev[0].device
    parts = [d.to(device) for d in dev]
    if host:
        parts.append(torch.tensor(_host_combine(host, norm_type), dtype=torch.float32, device=device))
    return torch.linalg.vector_norm(torch.stack(parts), norm_type)


def grad_sum_sq_into(a, out: torch.Tensor) -> None:
    """apex_C ``_raw_grad_sum_sq`` over the slots of kernel arguments `a` into `out` (float64, one per slot; 0 for
    skipped slots), reading grads where the update reads them (flat buffer or gather table). `a` outlives the
    call, so no pointer to `out` is left in it."""
    a.seg_out = out.data_ptr()
    try:
        _core.ext._raw_grad_sum_sq(a)
    finally:
        a.seg_out = 0


def _segment_sums_sq(s: FlatSet) -> List[float]:
    """Per-slot sums of squared grads (float64; 0 for slots without a grad) read through the set's kernel
    arguments: from the flat buffer, or where autograd left the grads when the set is gathered."""
    a = s.args
    out = torch.zeros(s.nseg, dtype=torch.float64)
    if s.n_skipped == s.nseg:  # no grad at all (a new optimizer, a restored one): there is no grad buffer to read
        return out.tolist()
    a.skip = s.skip.data_ptr() if s.n_skipped else 0
    a.threads = _core.num_threads()
    grad_sum_sq_into(a, out)
    return out.tolist()


def prepared_grad_norm(sets: List[FlatSet], use_kernel: bool = True) -> Union[float, torch.Tensor]:
    """2-norm of all grads of sets prepared for a step (`CombinedOptimizer._prepare_step`), before any unscale;
    params with ``.grad is None`` are excluded.

    Kernel sets are read per slot by apex_C ``_raw_grad_sum_sq`` (float64, summed exactly on the host), whether their
    grads are in the flat buffer or read where they are: the norm has the same bits either way. A Python float
    when every set is a kernel set; otherwise a 0-d float32 tensor as `total_grad_norm` returns it.
    """
    host: List[float] = []
    rest: List[FlatSet] = []
    for s in sets:
        if use_kernel and s.args is not None:
            host += _segment_sums_sq(s)
        else:
            rest.append(s)  # not gathered (only kernel steps read grads in place): the flat buffers hold them
    if not rest:
        return math.sqrt(math.fsum(host))
    total = total_grad_norm(rest, 2.0, use_kernel)
    if isinstance(total, float):  # nothing to read outside the kernel sets (empty sets)
        return math.sqrt(math.fsum([*host, total * total]))
    if not host:
        return total
    part = torch.tensor(math.sqrt(math.fsum(host)), dtype=torch.float32, device=total.device)
    return torch.linalg.vector_norm(torch.stack([total.float(), part]))


def clip_optimizer_grad_norm_fused(self, max_norm: float, norm_type: float = 2.0,
                                   error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clips the grads of all param groups in place to a total norm of at most `max_norm`.

    Same result as ``torch.nn.utils.clip_grad_norm_(all params of the optimizer, max_norm,
    norm_type, error_if_nonfinite)``: grads are multiplied by
    ``min(1, max_norm / (total_norm + 1e-6))`` and the total norm (before clipping) is returned
    as a 0-d float32 tensor (torch returns it in the grads' dtype; float32 keeps bf16/fp16 norms
    exact). Params whose ``.grad is None`` are ignored, as in torch, and so are empty grads (no
    elements: they change no norm; torch's infinity and non-positive orders raise on them). With no
    grad element at all the norm is 0.

    When amp has folded the unscale into the step (``apex_grad_scale`` set), the grads in the
    buffers are still scaled: the norm returned and compared with `max_norm` is that of the
    unscaled grads, and the stored grads keep their scale.

    Unlike torch, a negative or NaN `max_norm` (which torch would turn into a sign flip or NaN
    grads) raises ValueError. Raises RuntimeError for a non-finite total norm when
    `error_if_nonfinite` is set, before any grad is changed.
    """
    if not callable(getattr(self, "_grad_scale", None)):
        raise TypeError(f"clip_optimizer_grad_norm_fused: expected an apex optimizer (as its first argument, or "
                        f"called as its method), got {type(self).__name__}")
    try:
        max_norm = float(max_norm)
        norm_type = float(norm_type)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"clip_optimizer_grad_norm_fused: expected numbers for max_norm and norm_type, "
            f"got {type(max_norm).__name__} and {type(norm_type).__name__}"
        ) from exc
    if math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"clip_optimizer_grad_norm_fused: expected max_norm >= 0, got {max_norm}")
    if math.isnan(norm_type):
        raise ValueError("clip_optimizer_grad_norm_fused: expected a norm_type that is not NaN")

    sets = healed_sets(self)
    gs = self._grad_scale()
    use_kernel = self.executor == "auto"
    total = total_grad_norm(sets, norm_type, use_kernel)
    if isinstance(total, float):
        total *= gs
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped. "
                "Pass error_if_nonfinite=False to scale the grads anyway."
            )
        coef = max_norm / (total + _CLIP_EPS)
        if coef < 1.0 or math.isnan(coef):  # torch multiplies by min(coef, 1); 1 is a no-op
            for s in sets:
                _core.scale_(s.flat_g, coef, check=False)
        device = sets[0].device if sets else torch.device("cpu")
        return torch.tensor(total, dtype=torch.float32, device=device)

    total = total * gs
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped. "
            "Pass error_if_nonfinite=False to scale the grads anyway."
        )
    coef_t = (max_norm / (total + _CLIP_EPS)).clamp(max=1.0)
    for s in sets:
        if use_kernel and s.uses_kernel:
            coef = float(coef_t)
            if coef < 1.0 or math.isnan(coef):
                _core.scale_(s.flat_g, coef, check=False)
        else:
            s.flat_g.mul_(coef_t.to(s.device))
    return total
