"""Upstream's fused rotary position embeddings (RoPE), on every device.

For the first ``d2`` features of each head (``d2`` = the frequencies' last dimension, even; the other ``d - d2``
pass through unchanged), with ``x = [x1, x2]`` split in halves and ``rot(x) = [-x2, x1]``::

    out = x * cos + rot(x) * sin           (cos, sin of the frequencies, or given)

in the input's dtype, as upstream's kernel computes it (and Megatron's unfused reference): cos and sin rounded to
that dtype, each product and the sum rounded, so both give the same bits. The backward applies the transpose,
``dx = dy * cos + rot^T(dy * sin)`` with ``rot^T([y1, y2]) = [y2, -y1]``, keeping only the frequencies (or cos and
sin), as upstream's.

* :func:`fused_apply_rotary_pos_emb`: ``t`` (s, b, h, d) and ``freqs`` (>= s, 1, 1, d2); position = the index
  along s. ``transpose_output_memory=True`` lays the output out as (b, s, h, d) in memory, so ``out.transpose(0,
  1)`` is contiguous.
* :func:`fused_apply_rotary_pos_emb_cached`: the same with ``cos_`` / ``sin_`` given.
* :func:`fused_apply_rotary_pos_emb_thd`: packed sequences, ``t`` (T, h, d) with ``cu_seqlens`` (b + 1,) the
  cumulative lengths; positions restart at 0 in each sequence.
* :func:`fused_apply_rotary_pos_emb_2d`: images, ``t`` (b, img_h * img_w, h, d): the first d/2 features rotate by
  the row (``cos_h`` / ``sin_h``, (1, >= img_h, 1, d/2)), the last d/2 by the column (``cos_w`` / ``sin_w``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from apex._checks import check_floating

__all__ = [
    "FusedRoPE2DFunc",
    "FusedRoPECachedFunc",
    "FusedRoPEFunc",
    "FusedRoPETHDFunc",
    "fused_apply_rotary_pos_emb",
    "fused_apply_rotary_pos_emb_2d",
    "fused_apply_rotary_pos_emb_cached",
    "fused_apply_rotary_pos_emb_thd",
]


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> None:
    """``out = x * cos + rot(x) * sin`` (``transpose``: ``x * cos + rot^T(x * sin)``) over x's last dimension, in
    x's dtype: cos and sin rounded to it, then two rounded products and a rounded sum, as upstream's kernel (no
    fused multiply-add, which would round once where it rounds three times). Half by half, so no rotated copy of x
    is made: with ``[x1, x2]``, ``[c1, c2]``, ``[s1, s2]`` the halves,
    forward ``[x1 c1 - x2 s1, x2 c2 + x1 s2]``, transpose ``[x1 c1 + x2 s2, x2 c2 - x1 s1]``."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    c1, c2 = cos.chunk(2, dim=-1)
    s1, s2 = sin.chunk(2, dim=-1)
    o1, o2 = out.chunk(2, dim=-1)
    if transpose:
        torch.mul(x1, c1, out=o1).add_(x2 * s2)
        torch.mul(x2, c2, out=o2).sub_(x1 * s1)
    else:
        torch.mul(x1, c1, out=o1).sub_(x2 * s1)
        torch.mul(x2, c2, out=o2).add_(x1 * s2)


def _apply(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``t`` with its first ``cos.shape[-1]`` features rotated, the rest copied; into ``out`` (a tensor of t's
    shape and dtype, any layout) when given."""
    d2 = cos.shape[-1]
    if out is None:
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    _rotate_into(out[..., :d2], t[..., :d2], cos, sin, transpose)
    if d2 < t.shape[-1]:
        out[..., d2:] = t[..., d2:]
    return out


def _check_input(t, where: str, dims: int, layout: str) -> None:
    check_floating(t, f"{where}: t")
    if t.dim() != dims:
        raise ValueError(f"{where}: t must have shape {layout}, got {tuple(t.shape)}")


def _check_table(table, name: str, where: str, t: torch.Tensor, rows: int, row_dim: int, width: Optional[int]):
    """A frequency / cos / sin table: floating point, on t's device, at least ``rows`` long along ``row_dim``, of
    even width at most t's head dimension (``width``: exactly)."""
    check_floating(table, f"{where}: {name}")
    if table.device != t.device:
        raise ValueError(f"{where}: {name} must be on t's device ({t.device}), got {table.device}")
    d = t.shape[-1]
    d2 = table.shape[-1] if table.dim() == 4 else -1
    ok_width = d2 == width if width is not None else 0 < d2 <= d and d2 % 2 == 0
    ones = table.dim() == 4 and all(table.shape[i] == 1 for i in range(3) if i != row_dim)
    if not ones or table.shape[row_dim] < rows or not ok_width:
        want = f"{width}" if width is not None else f"d2 (even, <= {d})"
        shape = ["1", "1", "1", want]
        shape[row_dim] = f">= {rows}"
        raise ValueError(f"{where}: {name} must have shape ({', '.join(shape)}), got {tuple(table.shape)}")


def _sbhd_tables(cos: torch.Tensor, sin: torch.Tensor, s: int) -> Tuple[torch.Tensor, torch.Tensor]:
    return cos[:s], sin[:s]


class FusedRoPEFunc(torch.autograd.Function):
    """Upstream's ``FusedRoPEFunc.apply(t, freqs, transpose_output_memory=False)``."""

    @staticmethod
    def forward(ctx, t, freqs, transpose_output_memory=False):
        where = "fused_apply_rotary_pos_emb"
        _check_input(t, where, 4, "(s, b, h, d)")
        _check_table(freqs, "freqs", where, t, t.shape[0], 0, None)
        f = freqs[: t.shape[0]].float()
        ctx.save_for_backward(freqs)
        ctx.transpose_output_memory = bool(transpose_output_memory)
        return _apply(t, f.cos(), f.sin(), False, _output(t, transpose_output_memory))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (freqs,) = ctx.saved_tensors
        f = freqs[: grad.shape[0]].float()
        return _apply(grad, f.cos(), f.sin(), True, _output(grad, ctx.transpose_output_memory)), None, None


class FusedRoPECachedFunc(torch.autograd.Function):
    """Upstream's ``FusedRoPECachedFunc.apply(t, cos_, sin_, transpose_output_memory=False)``."""

    @staticmethod
    def forward(ctx, t, cos_, sin_, transpose_output_memory=False):
        where = "fused_apply_rotary_pos_emb_cached"
        _check_input(t, where, 4, "(s, b, h, d)")
        _check_table(cos_, "cos_", where, t, t.shape[0], 0, None)
        _check_table(sin_, "sin_", where, t, t.shape[0], 0, cos_.shape[-1])
        ctx.save_for_backward(cos_, sin_)
        ctx.transpose_output_memory = bool(transpose_output_memory)
        cos, sin = _sbhd_tables(cos_, sin_, t.shape[0])
        return _apply(t, cos, sin, False, _output(t, transpose_output_memory))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        cos_, sin_ = ctx.saved_tensors
        cos, sin = _sbhd_tables(cos_, sin_, grad.shape[0])
        return _apply(grad, cos, sin, True, _output(grad, ctx.transpose_output_memory)), None, None, None


def _output(t: torch.Tensor, transpose_memory: bool) -> torch.Tensor:
    # (s, b, h, d) contiguous, or laid out as (b, s, h, d) in memory
    if transpose_memory:
        return torch.empty((t.shape[1], t.shape[0], *t.shape[2:]), dtype=t.dtype, device=t.device).transpose(0, 1)
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _thd_positions(cu_seqlens, total: int, where: str) -> torch.Tensor:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64) \
            or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        got = (f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor)
               else type(cu_seqlens).__name__)
        raise TypeError(f"{where}: cu_seqlens must be a 1-D int32 / int64 tensor of b + 1 offsets, got {got}")
    offsets = cu_seqlens.long()
    lengths = offsets[1:] - offsets[:-1]
    # one host read of b + 1 offsets, which the per-token positions need anyway (their count)
    first, last, shortest = (int(v) for v in torch.stack((offsets[0], offsets[-1], lengths.min())).tolist())
    if first != 0 or last != total or shortest < 0:
        raise ValueError(f"{where}: cu_seqlens must rise from 0 to t's {total} tokens, got "
                         f"{cu_seqlens.tolist() if cu_seqlens.numel() <= 16 else cu_seqlens}")
    starts = torch.repeat_interleave(offsets[:-1], lengths, output_size=total)
    return torch.arange(total, device=offsets.device) - starts


class FusedRoPETHDFunc(torch.autograd.Function):
    """Upstream's ``FusedRoPETHDFunc.apply(t, cu_seqlens, freqs)``."""

    @staticmethod
    def forward(ctx, t, cu_seqlens, freqs):
        where = "fused_apply_rotary_pos_emb_thd"
        _check_input(t, where, 3, "(t, h, d)")
        positions = _thd_positions(cu_seqlens, t.shape[0], where)
        longest = int(positions.max()) + 1 if positions.numel() else 0
        _check_table(freqs, "freqs", where, t, longest, 0, None)
        ctx.save_for_backward(positions, freqs)
        f = freqs.float()[positions].squeeze(2)  # (T, 1, d2)
        return _apply(t, f.cos(), f.sin(), False)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        positions, freqs = ctx.saved_tensors
        f = freqs.float()[positions].squeeze(2)
        return _apply(grad, f.cos(), f.sin(), True), None, None


class FusedRoPE2DFunc(torch.autograd.Function):
    """Upstream's ``FusedRoPE2DFunc.apply(t, img_h, img_w, cos_h, sin_h, cos_w, sin_w)``."""

    @staticmethod
    def forward(ctx, t, img_h, img_w, cos_h, sin_h, cos_w, sin_w):
        ctx.save_for_backward(cos_h, sin_h, cos_w, sin_w)
        ctx.img = (img_h, img_w)
        return _apply_2d(t, img_h, img_w, cos_h, sin_h, cos_w, sin_w, False)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        cos_h, sin_h, cos_w, sin_w = ctx.saved_tensors
        return (_apply_2d(grad, *ctx.img, cos_h, sin_h, cos_w, sin_w, True), None, None, None, None, None, None)


def _apply_2d(t, img_h, img_w, cos_h, sin_h, cos_w, sin_w, transpose: bool) -> torch.Tensor:
    b, s, h, d = t.shape
    grid = t.reshape(b, img_h, img_w, h, d)
    out = torch.empty(grid.shape, dtype=t.dtype, device=t.device)
    half = d // 2
    rows = (cos_h[:, :img_h].unsqueeze(2), sin_h[:, :img_h].unsqueeze(2))  # (1, img_h, 1, 1, d/2)
    cols = (cos_w[:, :img_w].unsqueeze(1), sin_w[:, :img_w].unsqueeze(1))  # (1, 1, img_w, 1, d/2)
    _rotate_into(out[..., :half], grid[..., :half], *rows, transpose)
    _rotate_into(out[..., half:], grid[..., half:], *cols, transpose)
    return out.view(b, s, h, d)


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor,
                               transpose_output_memory: bool = False) -> torch.Tensor:
    """RoPE on ``t`` (s, b, h, d) with ``freqs`` (>= s, 1, 1, d2); see the module docstring."""
    return FusedRoPEFunc.apply(t, freqs, transpose_output_memory)


def fused_apply_rotary_pos_emb_cached(t: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor,
                                      transpose_output_memory: bool = False) -> torch.Tensor:
    """RoPE on ``t`` (s, b, h, d) with the cosines and sines given, (>= s, 1, 1, d2) each."""
    return FusedRoPECachedFunc.apply(t, cos_, sin_, transpose_output_memory)


def fused_apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE on packed sequences ``t`` (T, h, d), positions restarting at each offset of ``cu_seqlens``."""
    return FusedRoPETHDFunc.apply(t, cu_seqlens, freqs)


def fused_apply_rotary_pos_emb_2d(t: torch.Tensor, img_h: int, img_w: int, cos_h: torch.Tensor, sin_h: torch.Tensor,
                                  cos_w: torch.Tensor, sin_w: torch.Tensor) -> torch.Tensor:
    """2-D RoPE on ``t`` (b, img_h * img_w, h, d): rows rotate the first d/2 features, columns the last d/2."""
    where = "fused_apply_rotary_pos_emb_2d"
    _check_input(t, where, 4, "(b, img_h * img_w, h, d)")
    for name, v in (("img_h", img_h), ("img_w", img_w)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TypeError(f"{where}: {name} must be a positive int, got {v!r}")
    if t.shape[1] != img_h * img_w:
        raise ValueError(f"{where}: the sequence length should be img_h * img_w = {img_h * img_w}, got {t.shape[1]}")
    if t.shape[-1] % 4:
        raise ValueError(f"{where}: the head dimension must be a multiple of 4 (two halves, each rotated by "
                         f"halves), got {t.shape[-1]}")
    half = t.shape[-1] // 2
    _check_table(cos_h, "cos_h", where, t, img_h, 1, half)
    _check_table(sin_h, "sin_h", where, t, img_h, 1, half)
    _check_table(cos_w, "cos_w", where, t, img_w, 1, half)
    _check_table(sin_w, "sin_w", where, t, img_w, 1, half)
    if cos_h.shape != sin_h.shape or cos_w.shape != sin_w.shape:
        raise ValueError(f"{where}: cos_h / sin_h and cos_w / sin_w must have the same shapes, got "
                         f"{tuple(cos_h.shape)} / {tuple(sin_h.shape)} and {tuple(cos_w.shape)} / "
                         f"{tuple(sin_w.shape)}")
    return FusedRoPE2DFunc.apply(t, img_h, img_w, cos_h, sin_h, cos_w, sin_w)
