"""NpuFusedAdamP: AdamP (Heo et al. 2021) on combined buffers.

Per param, Adam with bias correction (optionally Nesterov) gives the
perturbation ``d = m_hat / (sqrt(v_hat) + eps)`` (Nesterov:
``(beta1 * m + (1 - beta1) * g) / ...``). For params with more than one
dimension, the grad and param are compared in two views, first the channel
view (rows of ``p.view(p.size(0), -1)``), then the layer view (``p.view(1,
-1)``): if the largest absolute cosine similarity of the rows is below
``delta / sqrt(row length)``, the radial part is projected out of ``d`` row by
row (``d -= p_n * <p_n, d>`` with ``p_n = p / (||p_row|| + eps)``) and the
decoupled weight decay is scaled by ``wd_ratio``. Then
``p = p * (1 - lr * weight_decay * ratio) - lr / (1 - beta1^t) * d``.

Cosine similarity is torch's ``F.cosine_similarity(g, p, eps=eps)`` as torch
2.x computes it: ``g.p / (max(||g||, eps) * max(||p||, eps))`` (each norm
clamped on its own; the docs' ``max(||g|| ||p||, eps)`` is not what the code does).

CPU executor, per group x dtype, over ROWS of the flat buffers (a param that
cannot project is one row; the zero gap after each slot is a row of its own,
always skipped): ``_raw_row_dots`` (one pass over grads and params) gives per-row
g.p, g.g, p.p; the decision per param is a few small torch ops on those;
``_raw_adamp_stage_a`` (only when some param projects) gives per-row <p_n, d>;
``_raw_adamp_stage_b`` updates m, v, p. The torch executor runs the same math with
torch ops, elementwise on flat slices and the projection per param (tensor ops
only, no host sync). Low-precision m, v are stored before d is formed in both
executors, so d is computed from the stored moments.
"""

from __future__ import annotations

import math
import weakref
from typing import List

import torch

from .. import _core
from ._base import CombinedOptimizer, _check_adam_group, _check_range
from ._flat import FlatSet

__all__ = ["NpuFusedAdamP", "adamp_projection"]


def _cos_abs(gp: torch.Tensor, gg: torch.Tensor, pp: torch.Tensor, eps: float) -> torch.Tensor:
    """|cosine similarity| from the dot products, with torch's per-norm eps clamp."""
    return gp.abs() / (gg.sqrt().clamp_min(eps) * pp.sqrt().clamp_min(eps))


def adamp_projection(p: torch.Tensor, g: torch.Tensor, d: torch.Tensor, *, delta: float, wd_ratio: float,
                     eps: float) -> torch.Tensor:
    """AdamP's projection of one param (dim > 1, fp32): `d` changed in place; returns the wd ratio (0-d).

    Decided with tensor ops only (no host sync), so it can run on any device.
    """
    rows = p.shape[0]
    pr, gr, dr = p.reshape(rows, -1), g.reshape(rows, -1), d.view(rows, -1)
    gp, gg, pp = (gr * pr).sum(1), (gr * gr).sum(1), (pr * pr).sum(1)
    chan = _cos_abs(gp, gg, pp, eps).max() < delta / math.sqrt(pr.shape[1])
    layer = ~chan & (_cos_abs(gp.sum(), gg.sum(), pp.sum(), eps) < delta / math.sqrt(p.numel()))
    zero = torch.zeros_like(pp)
    inv = torch.where(chan, 1.0 / (pp.sqrt() + eps), torch.where(layer, 1.0 / (pp.sum().sqrt() + eps), zero))
    pn = pr * inv[:, None]
    dots = (pn * dr).sum(1)
    coef = torch.where(layer, dots.sum(), dots)
    dr.sub_(pn * coef[:, None])
    return torch.where(chan | layer, torch.tensor(float(wd_ratio), device=p.device), torch.tensor(1.0, device=p.device))


def _validate_adamp_group(group: dict) -> None:
    _check_adam_group(group)
    _check_range("delta", group["delta"], 0.0)
    _check_range("wd_ratio", group["wd_ratio"], 0.0)
    if not isinstance(group.get("nesterov", False), bool):
        raise TypeError(f"Invalid nesterov: expected a bool, got {type(group['nesterov']).__name__}")


class _RowPlan:
    """Row layout of one FlatSet and the per-row arrays the AdamP kernels read (built once).

    Param k contributes its rows (one row if it cannot project), then one "gap" row for the zero
    gap up to the next slot. Gap rows are always skipped: with eps=0 their update would be 0/0,
    and they must not enter any row sum.
    """

    def __init__(self, s: FlatSet):
        starts, row_param, gaps, lens, numels, eligible, within = [], [], [], [], [], [], []
        for k, p in enumerate(s.params):
            off, n = s.offsets[k], p.numel()
            proj = p.dim() > 1 and n > 0
            rows = p.shape[0] if proj else 1
            width = n // rows if proj else n
            starts += [off + width * torch.arange(rows, dtype=torch.int64), torch.tensor([off + n])]
            within += [width * torch.arange(rows + 1, dtype=torch.int64)]  # the gap row's is never read
            row_param.append(torch.full((rows + 1,), k, dtype=torch.int64))
            gaps += [False] * rows + [True]
            lens.append(float(max(width, 1)))
            numels.append(float(max(n, 1)))
            eligible.append(proj)
        self.seg = torch.cat([*starts, torch.tensor([s.total], dtype=torch.int64)])
        # gather mode: row r's grad starts this many bytes into its param's grad (see `bind_grads`)
        self.row_byte_offset = torch.cat(within) * s.flat_p.element_size()  # grads have the params' dtype
        self.gtab = torch.zeros(len(self.row_byte_offset), dtype=torch.int64)
        self.row_param = torch.cat(row_param)
        self.nrows = len(self.row_param)
        self.gap_rows = torch.tensor(gaps, dtype=torch.bool)
        self.row_len = torch.tensor(lens, dtype=torch.float64)
        self.numel = torch.tensor(numels, dtype=torch.float64)
        self.eligible = torch.tensor(eligible, dtype=torch.bool)
        self.any_eligible = bool(self.eligible.any())
        self.ineligible_rows = (~self.eligible[self.row_param] | self.gap_rows).to(torch.uint8)
        self.steps = torch.zeros(self.nrows, dtype=torch.float32)
        self.skip = self.gap_rows.to(torch.uint8)  # + rows of params without a grad, per step
        self.aux_skip = torch.zeros(self.nrows, dtype=torch.uint8)  # rows _raw_row_dots / stage A leave out
        self.dots = torch.zeros(3 * self.nrows, dtype=torch.float64)
        self.coef = torch.zeros(self.nrows, dtype=torch.float64)
        self.mul = torch.zeros(self.nrows, dtype=torch.float32)
        self.wdr = torch.ones(self.nrows, dtype=torch.float32)
        self.layer_rows = torch.zeros(self.nrows, dtype=torch.bool)

        a = _core.ext.OptArgs()
        src = s.args
        a.p, a.g, a.s0, a.s1 = src.p, src.g, src.s0, src.s1
        a.pdt, a.gdt, a.sdt = src.pdt, src.gdt, src.sdt
        a.seg = self.seg.data_ptr()
        a.nseg = self.nrows
        a.steps = self.steps.data_ptr()
        self.args = a

    def bind_grads(self, s: FlatSet) -> None:
        """Where the row kernels read grads: the flat grad buffer, or, when the set reads grads where autograd
        left them (`FlatSet.gathered`), a per-row address table built from the set's per-slot one. Rows of
        params without a grad get an address too, but are skipped (`refresh_skip`), so it is never read."""
        if s.gathered:
            torch.add(s.gtab[self.row_param], self.row_byte_offset, out=self.gtab)
            self.args.gtab = self.gtab.data_ptr()
        else:
            self.args.g = s.flat_g.data_ptr()  # the set makes its flat grad buffer on demand
            self.args.gtab = 0

    def refresh_skip(self, s: FlatSet) -> None:
        if s.n_skipped:
            torch.bitwise_or(self.gap_rows.to(torch.uint8), s.skip[self.row_param], out=self.skip)
        else:
            self.skip.copy_(self.gap_rows)


class NpuFusedAdamP(CombinedOptimizer):
    """AdamP with the Ascend patch's signature and defaults, fused over combined buffers.

    Args: params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, delta=0.1,
    wd_ratio=0.1, nesterov=False. State per param (as timm/clovaai): step, exp_avg, exp_avg_sq.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, delta=0.1, wd_ratio=0.1,
                 nesterov=False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, delta=delta, wd_ratio=wd_ratio,
                        nesterov=nesterov)
        _validate_adamp_group(defaults)
        super().__init__(params, defaults)

    def _init_combined(self) -> None:
        # also run when a copy (deepcopy / unpickle) restores only torch's fields
        super()._init_combined()
        self._plans: weakref.WeakKeyDictionary[FlatSet, _RowPlan] = weakref.WeakKeyDictionary()

    _gather_grads = True  # the row kernels read grads only through their OptArgs (see _RowPlan.bind_grads)

    def _validate_group(self, group: dict) -> None:
        _validate_adamp_group(group)

    def _state_names(self, group: dict) -> List[str]:
        return ["exp_avg", "exp_avg_sq"]

    # ------------------------------------------------------------ CPU kernels
    def _plan(self, s: FlatSet) -> _RowPlan:
        plan = self._plans.get(s)
        if plan is None:
            plan = self._plans[s] = _RowPlan(s)
        return plan

    def _decide(self, plan: _RowPlan, s: FlatSet, group: dict) -> bool:
        """Fills plan.mul (1/(||p view||+eps) on projected rows, else 0) and plan.wdr; True if any projects."""
        eps, delta = group["eps"], group["delta"]
        d = plan.dots.view(-1, 3)
        gp, gg, pp = d[:, 0], d[:, 1], d[:, 2]
        rp = plan.row_param
        active = plan.eligible.clone()
        if s.n_skipped:
            active &= s.skip == 0
        row_max = torch.full((s.nseg,), -math.inf, dtype=torch.float64)
        row_max.scatter_reduce_(0, rp, _cos_abs(gp, gg, pp, eps).masked_fill_(plan.gap_rows, -math.inf), "amax")
        chan = active & (row_max < delta / plan.row_len.sqrt())
        tot = torch.zeros(s.nseg, 3, dtype=torch.float64).index_add_(0, rp, d)
        layer = active & ~chan & (_cos_abs(tot[:, 0], tot[:, 1], tot[:, 2], eps) < delta / plan.numel.sqrt())
        proj = chan | layer
        if not bool(proj.any()):
            return False
        chan_r, layer_r = chan[rp], layer[rp]
        inv_layer = (1.0 / (tot[:, 2].sqrt() + eps))[rp]
        mul = torch.where(chan_r, 1.0 / (pp.sqrt() + eps), torch.where(layer_r, inv_layer, torch.zeros_like(pp)))
        plan.mul.copy_(mul.masked_fill_(plan.gap_rows, 0.0))
        plan.wdr.copy_(torch.where(proj[rp], torch.full_like(pp, group["wd_ratio"]), torch.ones_like(pp)))
        plan.aux_skip.copy_((plan.mul == 0).to(torch.uint8))
        plan.layer_rows.copy_(layer_r & ~plan.gap_rows)
        return True

    def _kernel_step(self, s: FlatSet, group: dict) -> None:
        plan = self._plan(s)
        a = plan.args
        b1, b2 = group["betas"]
        a.hp = [group["lr"], b1, b2, group["eps"], group["weight_decay"]]
        a.flags = _core.ext.FLAG_NESTEROV if group["nesterov"] else 0
        a.grad_scale = self._grad_scale()
        a.threads = _core.num_threads()
        a.out, a.odt = s.args.out, s.args.odt
        torch.index_select(s.steps, 0, plan.row_param, out=plan.steps)
        plan.refresh_skip(s)
        plan.bind_grads(s)
        a.seg_mul = a.seg_aux = a.seg_out = 0
        projects = False
        if plan.any_eligible:
            # row dots only over rows of params that may project and have a grad
            torch.bitwise_or(plan.ineligible_rows, plan.skip, out=plan.aux_skip)
            a.skip = plan.aux_skip.data_ptr()
            a.seg_out = plan.dots.data_ptr()
            _core.ext._raw_row_dots(a)
            projects = self._decide(plan, s, group)
        if projects:
            a.skip = plan.aux_skip.data_ptr()  # stage A reads projected rows only
            a.seg_mul = plan.mul.data_ptr()
            a.seg_aux = plan.wdr.data_ptr()
            a.seg_out = plan.coef.data_ptr()
            _core.ext._raw_adamp_stage_a(a)
            self._layer_sums(plan, s)
        a.skip = plan.skip.data_ptr()
        _core.ext._raw_adamp_stage_b(a)
        a.seg_out = a.seg_mul = a.seg_aux = 0

    @staticmethod
    def _layer_sums(plan: _RowPlan, s: FlatSet) -> None:
        """Layer-view params use one coefficient for all their rows: the sum of their row partials."""
        rp = plan.row_param
        per_param = torch.zeros(s.nseg, dtype=torch.float64).index_add_(0, rp, plan.coef)
        plan.coef.copy_(torch.where(plan.layer_rows, per_param[rp], plan.coef))

    # ------------------------------------------------------------ torch ops
    def _torch_step(self, s: FlatSet, group: dict) -> None:
        b1, b2 = group["betas"]
        eps, lr, wd = group["eps"], group["lr"], group["weight_decay"]
        gs = self._grad_scale()
        bounds = [*s.offsets, s.total]
        for lo, hi, step, k0, k1 in s.active_runs():
            p = self._f32(s.flat_p[lo:hi])
            g = self._f32(s.flat_g[lo:hi])
            if gs != 1.0:
                g = g * gs
            m_st, v_st = s.flat_s["exp_avg"][lo:hi], s.flat_s["exp_avg_sq"][lo:hi]
            m, v = self._f32(m_st), self._f32(v_st)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            self._write_back(m_st, m)
            self._write_back(v_st, v)
            m, v = self._f32(m_st), self._f32(v_st)  # the stored moments, as the kernel reads them
            denom = v.sqrt().div_(math.sqrt(1 - b2**step)).add_(eps)
            d = (m.mul(b1).add_(g, alpha=1 - b1) if group["nesterov"] else m).div(denom)
            ratios = []
            for k in range(k0, k1):
                prm = s.params[k]
                a, n = bounds[k] - lo, prm.numel()
                if prm.dim() > 1 and n > 0:
                    view = (slice(a, a + n),)
                    ratios.append(adamp_projection(
                        p[view].view(prm.shape), g[view].view(prm.shape), d[view].view(prm.shape),
                        delta=group["delta"], wd_ratio=group["wd_ratio"], eps=eps))
                else:
                    ratios.append(torch.ones((), device=p.device))
            if wd > 0:
                lengths = torch.tensor([bounds[k + 1] - bounds[k] for k in range(k0, k1)], device=p.device)
                decay = 1.0 - lr * wd * torch.stack(ratios)
                p.mul_(torch.repeat_interleave(decay, lengths, output_size=hi - lo))
            p.add_(d, alpha=-lr / (1 - b1**step))
            self._write_back(s.flat_p[lo:hi], p)
