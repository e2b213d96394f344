"""NVIDIA Apex's transducer (RNN-T) modules, on torch's ops on every device.

``TransducerJoint(pack_output=False, relu=False, dropout=False, opt=1, fwd_tile_size=4, dropout_prob=0,
probe_mask=False)``, ``forward(f, g, f_len, g_len, batch_offset=None, packed_batch=0)``: the joint of an encoder
output ``f`` (B, T, H) and a prediction-network output ``g`` (B, U, H), ``h[b, t, u] = f[b, t] + g[b, u]``, then
ReLU and dropout (in training) when asked. Only ``t < f_len[b]`` and ``u < g_len[b]`` are meaningful: the padded
output (B, T, U, H) holds -1 elsewhere (finite, so a loss that reads it by mistake gets no NaN), and with
``pack_output`` the output is those rows only, (packed_batch, H), batch by batch, ``t`` then ``u`` (``batch_offset``
= ``cumsum(f_len * g_len)``). With ``probe_mask`` (and ReLU or dropout) ``mask_probe`` receives each call's uint8
mask of the elements kept, in the output's layout. The gradients are those of the expression, zero where the
output was padding.

``TransducerLoss(fuse_softmax_backward=True, opt=1, packed_input=False)``, ``forward(x, label, f_len, y_len,
blank_idx, batch_offset=None, max_f_len=None, debug_list=None)``: the RNN-T loss ``-log P(y | x)`` per sequence
(Graves 2012) from joint logits ``x`` (B, T, U, V) (or, with ``packed_input``, (N, V) rows packed as the joint packs
them, ``batch_offset`` = ``cumsum(f_len * (y_len + 1))``), labels (B, >= max y_len), ``f_len`` frames and ``y_len``
labels per sequence. In log space, with ``p = log_softmax(x)``::

    alpha(0, 0) = 0
    alpha(t, u) = logaddexp(alpha(t-1, u) + p(t-1, u, blank), alpha(t, u-1) + p(t, u-1, y[u-1]))
    loss = -(alpha(T-1, U) + p(T-1, U, blank))          T = f_len, U = y_len

computed in float32 (float64 for float64 logits) one anti-diagonal of the (t, u) lattice at a time for the whole
batch, up to the longest sequence's (``f_len.max()``, ``y_len.max() + 1``; with padded input on an accelerator, the
logits' T and U), whatever ``max_f_len`` says, with the backward variables ``beta`` the same way; the loss has the
logits' dtype. The gradient with respect to the logits is ``softmax(x) * occupancy(t, u) - (probability of the blank
and label transitions out of (t, u))`` scaled by each sequence's loss gradient, zero outside the lattice: what
upstream's kernel computed with ``fuse_softmax_backward``; without it upstream went through an fp16 ``log_softmax``,
here both use the one float32 form. The forward keeps the logits, one log-sum-exp per (b, t, u) and the lattices
(upstream kept the log-softmax, the logits' size). ``debug_list=[]`` receives ``alpha`` and ``beta`` (float32, (B,
T, U + 1), padded layout for either input form, T = ``max_f_len`` for packed input); they are meaningful inside each
sequence's lattice and -inf past the longest one.

Arguments and shapes are checked before anything runs; lengths and labels in CPU tensors are also checked against
the shapes (on an accelerator that check would wait for the device). The packed forms read their lengths and
``batch_offset`` once on any device (on an accelerator, one wait): they decide the layout, and a ``batch_offset``
that is not the cumsum the lengths give (``f_len * g_len`` for the joint, ``f_len * (y_len + 1)`` for the loss), or
a ``max_f_len`` below ``f_len.max()``, raises ValueError naming the entry. ``opt`` and ``fwd_tile_size`` chose
upstream's CUDA kernels and are accepted (``opt`` 0 or 1); ReLU and dropout work with either (upstream's ``opt=0``
refused them).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from apex._checks import INT64_MAX, check_dense, check_floating, check_fraction, check_int
from apex._device import block_elements

__all__ = ["TransducerJoint", "TransducerLoss"]

_INTS = (torch.int32, torch.int64, torch.int16, torch.uint8)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _lengths(where: str, name: str, t, batch: int, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype not in _INTS:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{where}: {name} must be an integer tensor, got {got}")
    check_dense(t, f"{where}: {name}")
    if tuple(t.shape) != (batch,):
        raise ValueError(f"{where}: {name} must have shape ({batch},), one length per sequence, got "
                         f"{tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{where}: {name} must be on the input's device ({device}), got {t.device}")
    return t.long()


def _check_range(where: str, name: str, t: torch.Tensor, low: int, high: int) -> None:
    # values are checked where reading them does not wait for a device
    if t.device.type == "cpu" and t.numel():
        bad = (t < low) | (t > high)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0]) if t.dim() == 1 else tuple(int(v) for v in bad.nonzero()[0])
            raise ValueError(f"{where}: {name} at {i} is {int(t.reshape(-1)[bad.reshape(-1).nonzero()[0, 0]])}, "
                             f"outside [{low}, {high}]")


def _check_offsets(where: str, offsets: List[int], sizes: List[int], rule: str) -> None:
    """ValueError naming the first entry of ``offsets`` (host ints) that is not the running sum of ``sizes``: an
    offset that disagrees with the lengths would read or place another sequence's rows."""
    end = 0
    for i, (got, n) in enumerate(zip(offsets, sizes)):
        end += n
        if got != end:
            raise ValueError(f"{where}: batch_offset[{i}] is {got}, but the lengths give {end} (batch_offset must "
                             f"be the cumsum of {rule})")


def _flag(where: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be a bool, got {type(value).__name__}")
    return value


def _opt(where: str, value) -> int:
    return check_int(value, f"{where}: opt", 0, 1)


# ---------------------------------------------------------------------------------------------------- joint


class _PackedJoint(torch.autograd.Function):
    """The packed joint rows, sequence by sequence: rows ``t * g_len + u`` of sequence ``b`` are
    ``f[b, t] + g[b, u]``, written straight into the output (no gather, no padded tensor). The backward sums each
    sequence's block of gradients over ``u`` for ``f`` and over ``t`` for ``g``, accumulating in float32 (float64
    for float64) and rounding once."""

    @staticmethod
    def forward(ctx, f, g, lengths):
        rows = sum(fl * gl for fl, gl in lengths)
        out = f.new_empty(rows, f.shape[-1])
        start = 0
        for b, (fl, gl) in enumerate(lengths):
            n = fl * gl
            torch.add(f[b, :fl, None, :], g[b, None, :gl, :], out=out[start:start + n].view(fl, gl, -1))
            start += n
        ctx.lengths = lengths
        ctx.shapes = (f.shape, g.shape)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        f_shape, g_shape = ctx.shapes
        acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
        f_grad = grad.new_zeros(f_shape)
        g_grad = grad.new_zeros(g_shape)
        start = 0
        for b, (fl, gl) in enumerate(ctx.lengths):
            n = fl * gl
            block = grad[start:start + n].view(fl, gl, -1)
            f_grad[b, :fl] = block.sum(1, dtype=acc)
            g_grad[b, :gl] = block.sum(0, dtype=acc)
            start += n
        return f_grad, g_grad, None


class TransducerJoint(nn.Module):
    """Upstream's transducer joint; see the module docstring."""

    def __init__(self, pack_output=False, relu=False, dropout=False, opt=1, fwd_tile_size=4, dropout_prob=0,
                 probe_mask=False):
        super().__init__()
        where = "TransducerJoint"
        self.pack_output = _flag(where, "pack_output", pack_output)
        self.relu = _flag(where, "relu", relu)
        self.dropout = _flag(where, "dropout", dropout)
        self.opt = _opt(where, opt)
        self.fwd_tile_size = check_int(fwd_tile_size, f"{where}: fwd_tile_size", 1)
        self.dropout_prob = check_fraction(dropout_prob, f"{where}: dropout_prob")
        _flag(where, "probe_mask", probe_mask)
        self.mask_probe: Optional[List[torch.Tensor]] = [] if (relu or dropout) and probe_mask else None

    def forward(self, f, g, f_len, g_len, batch_offset=None, packed_batch=0):
        where = "TransducerJoint"
        for name, t in (("f", f), ("g", g)):
            check_floating(t, f"{where}: {name}")
            check_dense(t, f"{where}: {name}")
            if t.dim() != 3:
                raise ValueError(f"{where}: {name} must be 3-D, (B, T, H) / (B, U, H), got {tuple(t.shape)}")
        if g.shape[0] != f.shape[0] or g.shape[2] != f.shape[2]:
            raise ValueError(f"{where}: f {tuple(f.shape)} and g {tuple(g.shape)} must share B and H")
        if g.dtype != f.dtype or g.device != f.device:
            raise TypeError(f"{where}: f and g must have one dtype and device, got {f.dtype} on {f.device} and "
                            f"{g.dtype} on {g.device}")
        b, t_max, _ = f.shape
        u_max = g.shape[1]
        fl = _lengths(where, "f_len", f_len, b, f.device)
        gl = _lengths(where, "g_len", g_len, b, f.device)
        _check_range(where, "f_len", fl, 0, t_max)
        _check_range(where, "g_len", gl, 0, u_max)
        if self.pack_output:
            if batch_offset is None or (isinstance(packed_batch, int) and packed_batch == 0):
                raise ValueError(f"{where}: pack_output needs batch_offset and packed_batch")
            rows = check_int(packed_batch, f"{where}: packed_batch", 0)
            off = _lengths(where, "batch_offset", batch_offset, b, f.device)
            # the packed layout is decided by the lengths: read them and the offsets once (on an accelerator, one
            # wait)
            f_host, g_host, off_host = torch.stack([fl, gl, off]).tolist() if b else ([], [], [])
            lengths = list(zip(f_host, g_host))
            if any(not (0 <= a <= t_max and 0 <= c <= u_max) for a, c in lengths):
                raise ValueError(f"{where}: f_len must be in [0, {t_max}] and g_len in [0, {u_max}], got "
                                 f"{f_host} and {g_host}")
            total = sum(a * c for a, c in lengths)
            if total != rows:
                raise ValueError(f"{where}: packed_batch is {rows}, but the lengths give {total} rows "
                                 f"(sum of f_len * g_len)")
            _check_offsets(where, off_host, [a * c for a, c in lengths], "f_len * g_len")
            h = _PackedJoint.apply(f, g, lengths)
        else:
            h = f[:, :, None, :] + g[:, None, :, :]
        keep = None
        if self.relu:
            keep = h > 0
            h = torch.relu(h)
        if self.dropout and self.training and self.dropout_prob > 0:
            drop_keep = torch.rand(h.shape, device=h.device) >= self.dropout_prob
            keep = drop_keep if keep is None else keep & drop_keep
            scale = 0.0 if self.dropout_prob == 1 else 1.0 / (1.0 - self.dropout_prob)
            h = h * drop_keep * scale
        if not self.pack_output:
            t_ok = torch.arange(t_max, device=f.device) < fl[:, None]  # (B, T)
            u_ok = torch.arange(u_max, device=f.device) < gl[:, None]  # (B, U)
            valid = t_ok[:, :, None] & u_ok[:, None, :]  # (B, T, U)
            h = h.masked_fill(~valid[..., None], -1.0)
            if keep is not None:
                keep = keep & valid[..., None]
        if self.mask_probe is not None and keep is not None:
            self.mask_probe.append(keep.to(torch.uint8))
        return h


# ---------------------------------------------------------------------------------------------------- loss


def _row_blocks(rows: int, width: int, device: torch.device):
    step = max(1, block_elements(device) // max(1, width))
    for lo in range(0, rows, step):
        yield lo, min(rows, lo + step)


def _log_sum_exp_rows(x2d: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    out = torch.empty(x2d.shape[0], dtype=compute, device=x2d.device)
    for lo, hi in _row_blocks(x2d.shape[0], x2d.shape[1], x2d.device):
        out[lo:hi] = torch.logsumexp(x2d[lo:hi].to(compute), dim=1)
    return out


def _diagonals(t_max: int, u_max: int, device: torch.device, first: int = 0):
    """(t, u) index tensors of each anti-diagonal t + u = n >= first of a t_max x u_max lattice, n increasing."""
    for n in range(first, t_max + u_max - 1):
        t = torch.arange(max(0, n - u_max + 1), min(n, t_max - 1) + 1, device=device)
        yield t, n - t


def _lattices(blank: torch.Tensor, emit: torch.Tensor, fl: torch.Tensor, yl: torch.Tensor
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """alpha and beta over (B, T, U1) from the blank and label log-probabilities of each lattice node; beta is
    -inf outside each sequence's lattice, alpha is computed everywhere (no valid node depends on the others)."""
    _, t_max, u1 = blank.shape
    inf = float("-inf")
    alpha = torch.full_like(blank, inf)
    alpha[:, 0, 0] = 0.0
    for t, u in _diagonals(t_max, u1, blank.device, first=1):
        tp, up = (t - 1).clamp_(min=0), (u - 1).clamp_(min=0)
        via_t = torch.where(t > 0, alpha[:, tp, u] + blank[:, tp, u], inf)
        via_u = torch.where(u > 0, alpha[:, t, up] + emit[:, t, up], inf)
        alpha[:, t, u] = torch.logaddexp(via_t, via_u)
    beta = torch.full_like(blank, inf)
    last_t, last_u = (fl - 1)[:, None], yl[:, None]
    for t, u in reversed(list(_diagonals(t_max, u1, blank.device))):
        tn, un = (t + 1).clamp_(max=t_max - 1), (u + 1).clamp_(max=u1 - 1)
        via_t = torch.where(t + 1 <= last_t, beta[:, tn, u], inf) + blank[:, t, u]
        via_u = torch.where(u + 1 <= last_u, beta[:, t, un], inf) + emit[:, t, u]
        val = torch.logaddexp(via_t, via_u)
        val = torch.where((t == last_t) & (u == last_u), blank[:, t, u], val)
        beta[:, t, u] = torch.where((t <= last_t) & (u <= last_u), val, inf)
    return alpha, beta


class _TransducerLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, label, fl, yl, rows_index, grid, debug_extent, blank_idx, debug_list):
        # rows_index: for each (b, t, u) node of the (B, T, U1) grid, its row of x2d (-1: none); the grid ends at
        # the longest sequence, debug_extent is the (T, U1) of the documented padded layout
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        x2d = x.reshape(-1, x.shape[-1])
        lse = _log_sum_exp_rows(x2d, compute)
        b, t_max, u1 = grid
        node_row = rows_index.clamp(min=0)
        lab = torch.zeros(b, u1, dtype=torch.long, device=x.device)
        width = min(u1, label.shape[1])
        lab[:, :width] = label[:, :width].long()
        rows_flat = node_row.view(-1)
        lse_node = lse[rows_flat].view(b, t_max, u1)
        blank = x2d[rows_flat, blank_idx].to(compute).view(b, t_max, u1) - lse_node
        emit_cols = lab[:, None, :].expand(b, t_max, u1).reshape(-1)
        emit = x2d[rows_flat, emit_cols].to(compute).view(b, t_max, u1) - lse_node
        alpha, beta = _lattices(blank, emit, fl, yl)
        log_p = beta[:, 0, 0]
        if isinstance(debug_list, list) and not debug_list:
            debug_list += [_padded(alpha, debug_extent), _padded(beta, debug_extent)]
        ctx.save_for_backward(x, lse, alpha, beta, blank, emit, rows_index, lab, fl, yl)
        ctx.blank_idx = blank_idx
        return (-log_p).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, loss_grad):
        x, lse, alpha, beta, blank, emit, rows_index, lab, fl, yl = ctx.saved_tensors
        blank_idx = ctx.blank_idx
        b, t_max, u1 = alpha.shape
        compute = alpha.dtype
        inf = float("-inf")
        log_p = beta[:, 0, 0][:, None, None]
        t = torch.arange(t_max, device=x.device)[None, :, None]
        u = torch.arange(u1, device=x.device)[None, None, :]
        last_t, last_u = (fl - 1)[:, None, None], yl[:, None, None]
        inside = (t <= last_t) & (u <= last_u)
        # the blank out of (t, u) leads to (t + 1, u), or ends the lattice at its last node
        beta_down = torch.cat([beta[:, 1:], torch.full_like(beta[:, :1], inf)], dim=1)
        beta_down = torch.where(t + 1 <= last_t, beta_down, inf)
        beta_down = torch.where((t == last_t) & (u == last_u), 0.0, beta_down)
        beta_right = torch.cat([beta[:, :, 1:], torch.full_like(beta[:, :, :1], inf)], dim=2)
        beta_right = torch.where(u + 1 <= last_u, beta_right, inf)
        g = loss_grad.to(compute)[:, None, None]
        occ_blank = torch.where(inside, torch.exp(alpha + blank + beta_down - log_p), 0.0) * g
        occ_emit = torch.where(inside, torch.exp(alpha + emit + beta_right - log_p), 0.0) * g
        occ = occ_blank + occ_emit
        x2d = x.reshape(-1, x.shape[-1])
        grad2d = torch.zeros_like(x2d)
        rows_flat = rows_index.view(-1)
        node_of_row = torch.full((x2d.shape[0],), -1, dtype=torch.long, device=x.device)
        has = rows_flat >= 0
        node_of_row[rows_flat[has]] = torch.arange(rows_flat.numel(), device=x.device)[has]
        occ_f, blank_f, emit_f = occ.view(-1), occ_blank.view(-1), occ_emit.view(-1)
        lab_f = lab[:, None, :].expand(b, t_max, u1).reshape(-1)
        inside_f = inside.expand(b, t_max, u1).reshape(-1)
        for lo, hi in _row_blocks(x2d.shape[0], x2d.shape[1], x.device):
            nodes = node_of_row[lo:hi]
            n = nodes.clamp(min=0)
            live = (nodes >= 0) & inside_f[n]  # padding rows get zero, whatever their logits hold
            weight = torch.where(live, occ_f[n], 0.0)
            block = torch.exp(x2d[lo:hi].to(compute) - lse[lo:hi, None]) * weight[:, None]
            block[:, blank_idx] -= torch.where(live, blank_f[n], 0.0)
            block.scatter_add_(1, lab_f[n][:, None], -torch.where(live, emit_f[n], 0.0)[:, None])
            grad2d[lo:hi] = block.masked_fill_(~live[:, None], 0.0)
        return grad2d.view(x.shape), None, None, None, None, None, None, None, None


def _padded(lattice: torch.Tensor, extent: Tuple[int, int]) -> torch.Tensor:
    b, t_run, u_run = lattice.shape
    if (t_run, u_run) == extent:
        return lattice
    out = lattice.new_full((b, *extent), float("-inf"))
    out[:, :t_run, :u_run] = lattice
    return out


class TransducerLoss(nn.Module):
    """Upstream's RNN-T loss; see the module docstring."""

    def __init__(self, fuse_softmax_backward=True, opt=1, packed_input=False):
        super().__init__()
        where = "TransducerLoss"
        self.fuse_softmax_backward = _flag(where, "fuse_softmax_backward", fuse_softmax_backward)
        self.opt = _opt(where, opt)
        self.packed_input = _flag(where, "packed_input", packed_input)

    def forward(self, x, label, f_len, y_len, blank_idx, batch_offset=None, max_f_len=None, debug_list=None):
        where = "TransducerLoss"
        if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"{where}: x must be a float32, float16, bfloat16 or float64 tensor, got {got}")
        check_dense(x, f"{where}: x")
        if not isinstance(label, torch.Tensor) or label.dtype not in _INTS or label.dim() != 2:
            got = (f"{label.dtype} of shape {tuple(label.shape)}" if isinstance(label, torch.Tensor)
                   else type(label).__name__)
            raise TypeError(f"{where}: label must be a 2-D integer tensor (B, max labels), got {got}")
        check_dense(label, f"{where}: label")
        if label.device != x.device:
            raise ValueError(f"{where}: label must be on x's device ({x.device}), got {label.device}")
        b = label.shape[0]
        vocab = x.shape[-1] if x.dim() else 0
        blank = check_int(blank_idx, f"{where}: blank_idx", 0, max(0, vocab - 1))
        fl = _lengths(where, "f_len", f_len, b, x.device)
        yl = _lengths(where, "y_len", y_len, b, x.device)
        _check_range(where, "label", label, 0, vocab - 1)
        if self.packed_input:
            if batch_offset is None or max_f_len is None:
                raise ValueError(f"{where}: packed_input needs batch_offset and max_f_len")
            if x.dim() != 2:
                raise ValueError(f"{where}: packed x must be 2-D (rows, V), got {tuple(x.shape)}")
            t_max = check_int(max_f_len, f"{where}: max_f_len", 1)
            u1 = label.shape[1] + 1
            off = _lengths(where, "batch_offset", batch_offset, b, x.device)
            _check_range(where, "f_len", fl, 1, INT64_MAX)
            _check_range(where, "y_len", yl, 0, u1 - 1)
            # the lengths set the lattice's extent and the rows' layout: read them once (on an accelerator, one
            # wait); a loop bounded by max_f_len instead would cost what max_f_len says, not what the data holds
            sizes = fl * (yl + 1)
            f_host, y_host, off_host = torch.stack([fl, yl, off]).tolist() if b else ([], [], [])
            if b and not (min(f_host) >= 1 and min(y_host) >= 0 and max(y_host) <= u1 - 1):
                raise ValueError(f"{where}: f_len must be >= 1 and y_len in [0, {u1 - 1}] (the labels' width), "
                                 f"got {f_host} and {y_host}")
            t_need = max(f_host, default=1)
            if t_need > t_max:
                raise ValueError(f"{where}: max_f_len is {t_max}, less than the longest f_len ({t_need}); it must "
                                 "be at least f_len.max()")
            _check_offsets(where, off_host, [a * (c + 1) for a, c in zip(f_host, y_host)], "f_len * (y_len + 1)")
            if b and off_host[-1] != x.shape[0]:
                raise ValueError(f"{where}: batch_offset ends at {off_host[-1]}, but x has {x.shape[0]} rows")
            t_run, u_run = t_need, max(y_host, default=0) + 1
            start = torch.cumsum(sizes, 0) - sizes
            t = torch.arange(t_run, device=x.device)[None, :, None]
            u = torch.arange(u_run, device=x.device)[None, None, :]
            rows = start[:, None, None] + t * (yl[:, None, None] + 1) + u
            inside = (t < fl[:, None, None]) & (u <= yl[:, None, None])
            rows_index = torch.where(inside, rows, -1)
        else:
            if x.dim() != 4 or x.shape[0] != b:
                raise ValueError(f"{where}: x must have shape (B={b}, T, U, V), got {tuple(x.shape)}")
            _, t_max, u1, _ = x.shape
            if label.shape[1] < u1 - 1:
                raise ValueError(f"{where}: label must hold U - 1 = {u1 - 1} labels per sequence, got "
                                 f"{label.shape[1]}")
            _check_range(where, "f_len", fl, 1, t_max)
            _check_range(where, "y_len", yl, 0, u1 - 1)
            t_run, u_run = t_max, u1
            if fl.device.type == "cpu" and b:
                # no lattice reaches past the longest sequence; on an accelerator reading that would wait, and x's
                # own extent bounds the work there
                t_run, u_run = int(fl.max()), int(yl.max()) + 1
            rows_index = torch.arange(b * t_max * u1, device=x.device).view(b, t_max, u1)
            rows_index = rows_index[:, :t_run, :u_run].contiguous()
        if debug_list is not None and not isinstance(debug_list, list):
            raise TypeError(f"{where}: debug_list must be a list or None, got {type(debug_list).__name__}")
        return _TransducerLossFunction.apply(x, label, fl, yl, rows_index, (b, t_run, u_run), (t_max, u1), blank,
                                             debug_list)
