"""Upstream's (Megatron's) fused scale + mask + softmax over attention scores, on every device.

The fused forms compute ``softmax(x * scale)`` over the last dimension in float32 and return it in the input's
dtype, one rounding:

* padding mask (:func:`scaled_masked_softmax`, ``ScaledMaskedSoftmax``): scores (b, np, sq, sk), a bool mask
  (b or 1, 1, sq, sk) broadcast over the heads; a masked position's scaled score is replaced by -10000 (the
  kernel's constant), and a row whose every key is masked gives zeros, not a uniform row;
* causal (:func:`scaled_upper_triang_masked_softmax`, ``ScaledUpperTriangMaskedSoftmax``): scores (batches, sq,
  sk) with sq == sk; key j > query i gets probability exactly 0;
* no mask (``ScaledSoftmax``).

Their backward is the softmax's, ``dx = scale * y * (dy - sum(dy * y))`` in float32 from the saved output (the
only tensor kept, as upstream's kernels), returned in the input's dtype. The functional forms take upstream's
autocast rule (cast to the autocast dtype, run with autocast off); the ``*.apply`` forms run in the dtype given.

:class:`FusedScaleMaskSoftmax` chooses between that fused math and the plain torch sequence (optional float32
upcast, scale, the caller's ``mask_func``, softmax) by upstream's rule (:meth:`FusedScaleMaskSoftmax.
is_kernel_available`: the shapes its CUDA kernels took), so a model gives on every device what it gave on CUDA
with upstream's extension, shape for shape.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from apex._upstream_forms import run_as_fused
from apex.transformer.enums import AttnMaskType

__all__ = [
    "FusedScaleMaskSoftmax",
    "GenericFusedScaleMaskSoftmax",
    "GenericScaledMaskedSoftmax",
    "ScaledMaskedSoftmax",
    "ScaledSoftmax",
    "ScaledUpperTriangMaskedSoftmax",
    "generic_scaled_masked_softmax",
    "scaled_masked_softmax",
    "scaled_upper_triang_masked_softmax",
]

_MASKED_SCORE = -10000.0  # what upstream's kernel writes for a masked position's scaled score


def _check_scores(x, where: str, dims: int) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{where}: inputs must be a floating-point tensor, got {got}")
    if x.dim() != dims:
        raise ValueError(f"{where}: inputs must have {dims} dimensions, got shape {tuple(x.shape)}")


def _check_scale(scale, where: str) -> float:
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"{where}: scale must be a finite number, got {scale!r}")
    return float(scale)


def _check_mask(mask, x: torch.Tensor, where: str) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dtype not in (torch.bool, torch.uint8):
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"{where}: mask must be a bool (or uint8) tensor, got {got}")
    b, _, sq, sk = x.shape
    if mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (sq, sk):
        raise ValueError(f"{where}: mask must have shape ({b} or 1, 1, {sq}, {sk}) for inputs of shape "
                         f"{tuple(x.shape)}, got {tuple(mask.shape)}")
    return mask if mask.dtype == torch.bool else mask.bool()


def _forward(x: torch.Tensor, scale: float, mask: Optional[torch.Tensor], causal: bool) -> torch.Tensor:
    scores = x.float() * scale
    if mask is not None:
        scores = scores.masked_fill(mask, _MASKED_SCORE)
    if causal:
        sq, sk = scores.shape[-2:]
        above = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu_(1)
        scores = scores.masked_fill(above, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:
        probs = probs.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)
    return probs.to(x.dtype)


def _backward(grad: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    y = probs.float()
    g = grad.float()
    dx = y * (g - (g * y).sum(dim=-1, keepdim=True))
    return dx.mul_(scale).to(probs.dtype)


class _SoftmaxFunction(torch.autograd.Function):
    """Shared autograd of the fused forms: saves the output only."""

    @staticmethod
    def forward(ctx, x, scale, mask, causal):
        probs = _forward(x, scale, mask, causal)
        ctx.save_for_backward(probs)
        ctx.scale = scale
        return probs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (probs,) = ctx.saved_tensors
        return _backward(grad, probs, ctx.scale), None, None, None


class ScaledUpperTriangMaskedSoftmax:
    """Upstream's ``ScaledUpperTriangMaskedSoftmax.apply(inputs, scale)``: causal softmax of ``inputs * scale``,
    inputs (batches, sq, sq), in the dtype given."""

    @staticmethod
    def apply(inputs, scale):
        where = "ScaledUpperTriangMaskedSoftmax"
        _check_scores(inputs, where, 3)
        if inputs.shape[1] != inputs.shape[2]:
            raise ValueError(f"{where}: the causal mask is only for self attention (sq == sk), got inputs of "
                             f"shape {tuple(inputs.shape)}")
        return _SoftmaxFunction.apply(inputs, _check_scale(scale, where), None, True)


class ScaledMaskedSoftmax:
    """Upstream's ``ScaledMaskedSoftmax.apply(inputs, mask, scale)``: inputs (b, np, sq, sk), bool mask (b or 1, 1,
    sq, sk); masked scores become -10000, fully masked rows give zeros; in the dtype given."""

    @staticmethod
    def apply(inputs, mask, scale):
        where = "ScaledMaskedSoftmax"
        _check_scores(inputs, where, 4)
        return _SoftmaxFunction.apply(inputs, _check_scale(scale, where), _check_mask(mask, inputs, where), False)


class GenericScaledMaskedSoftmax(ScaledMaskedSoftmax):
    """Upstream's ``GenericScaledMaskedSoftmax.apply(inputs, mask, scale)`` (its kernel without the sequence-length
    limits): the same math as :class:`ScaledMaskedSoftmax`."""


class ScaledSoftmax:
    """Upstream's ``ScaledSoftmax.apply(inputs, scale)``: softmax of ``inputs * scale`` over the last dimension
    (inputs (b, np, sq, sk)), in the dtype given."""

    @staticmethod
    def apply(inputs, scale):
        where = "ScaledSoftmax"
        _check_scores(inputs, where, 4)
        return _SoftmaxFunction.apply(inputs, _check_scale(scale, where), None, False)


def scaled_upper_triang_masked_softmax(inputs, _, scale):
    """Upstream's functional form: scores (b, np, sq, sq), the second argument ignored (the mask is causal), under
    upstream's autocast rule; returns (b, np, sq, sq)."""
    where = "scaled_upper_triang_masked_softmax"
    _check_scores(inputs, where, 4)
    b, np_, sq, sk = inputs.shape
    if sq != sk:
        raise ValueError(f"{where}: the causal mask is only for self attention (sq == sk), got inputs of shape "
                         f"{tuple(inputs.shape)}")
    scale = _check_scale(scale, where)
    probs = run_as_fused(inputs.device.type, lambda x: ScaledUpperTriangMaskedSoftmax.apply(x, scale),
                         (inputs.reshape(b * np_, sq, sk),))
    return probs.view(b, np_, sq, sk)


def _scores_as_fused(inputs, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    # upstream's autocast rule on the scores' device (anything but a tensor goes on to fn's own check)
    return run_as_fused(inputs.device.type if isinstance(inputs, torch.Tensor) else "cpu", fn, (inputs,))


def scaled_masked_softmax(inputs, mask, scale):
    """Upstream's functional form: :class:`ScaledMaskedSoftmax` (or :class:`ScaledSoftmax` when ``mask`` is None)
    under upstream's autocast rule."""
    if mask is None:
        return _scores_as_fused(inputs, lambda x: ScaledSoftmax.apply(x, scale))
    return _scores_as_fused(inputs, lambda x: ScaledMaskedSoftmax.apply(x, mask, scale))


def generic_scaled_masked_softmax(inputs, mask, scale):
    """Upstream's functional form of :class:`GenericScaledMaskedSoftmax`, under upstream's autocast rule."""
    return _scores_as_fused(inputs, lambda x: GenericScaledMaskedSoftmax.apply(x, mask, scale))


def _warp_batches(sk: int) -> int:
    # upstream's launch shape: 128 threads per block, 32-thread warps for rows of more than 16 keys, two rows per
    # warp up to 128 keys, one beyond
    pow2 = 1 << max(0, (sk - 1).bit_length())
    warp = min(pow2, 32)
    return (128 // warp) * (2 if pow2 <= 128 else 1)


class FusedScaleMaskSoftmax(torch.nn.Module):
    """Upstream's module: ``FusedScaleMaskSoftmax(input_in_fp16, input_in_bf16, attn_mask_type,
    scaled_masked_softmax_fusion, mask_func, softmax_in_fp32, scale)``; ``forward(input, mask)`` on scores (b, np,
    sq, sk). See the module docstring for the two paths and when each runs.

    Raises RuntimeError for both fp16 and bf16 flags, or a scale without ``softmax_in_fp32`` (upstream's checks),
    ValueError for an unknown ``attn_mask_type`` with fusion on."""

    def __init__(self, input_in_fp16: bool, input_in_bf16: bool, attn_mask_type: AttnMaskType,
                 scaled_masked_softmax_fusion: bool, mask_func: Optional[Callable], softmax_in_fp32: bool,
                 scale: Optional[float]) -> None:
        super().__init__()
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        if self.input_in_fp16 and self.input_in_bf16:
            raise RuntimeError("both fp16 and bf16 flags cannot be active at the same time.")
        self.input_in_float16 = self.input_in_fp16 or self.input_in_bf16
        self.attn_mask_type = attn_mask_type
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale
        if not (scale is None or softmax_in_fp32):
            raise RuntimeError("softmax should be in fp32 when scaled")
        if scale is not None:
            _check_scale(scale, type(self).__name__)
        if mask_func is not None and not callable(mask_func):
            raise TypeError(f"{type(self).__name__}: mask_func must be callable or None, got "
                            f"{type(mask_func).__name__}")
        if self.scaled_masked_softmax_fusion:
            if attn_mask_type == AttnMaskType.causal:
                self.fused_softmax_func = scaled_upper_triang_masked_softmax
            elif attn_mask_type == AttnMaskType.padding:
                self.fused_softmax_func = scaled_masked_softmax
            else:
                raise ValueError(f"Invalid attn_mask_type: {attn_mask_type!r} (expected AttnMaskType.padding or "
                                 "AttnMaskType.causal)")

    def forward(self, input: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        _check_scores(input, type(self).__name__, 4)
        if self.is_kernel_available(mask, *input.size()):
            return self.forward_fused_softmax(input, mask)
        return self.forward_torch_softmax(input, mask)

    def is_kernel_available(self, mask, b: int, np: int, sq: int, sk: int) -> bool:
        """Upstream's rule for its CUDA kernels: fusion on, fp16/bf16 input (by the flags), a padding or causal
        mask type, 16 < sk <= 16384, sq, sk and b * np multiples of 4, and the rows per thread block (2 per
        32-thread warp up to 128 keys, 1 beyond; 4 warps) dividing b * np (causal) or sq (padding)."""
        attn_batches = b * np
        if not (self.scaled_masked_softmax_fusion and self.input_in_float16
                and self.attn_mask_type in (AttnMaskType.causal, AttnMaskType.padding)
                and 16 < sk <= 16384 and sq % 4 == 0 and sk % 4 == 0 and attn_batches % 4 == 0):
            return False
        per_block = self.get_batch_per_block(sq, sk, b, np)
        if self.attn_mask_type == AttnMaskType.causal:
            return attn_batches % per_block == 0
        return sq % per_block == 0

    def forward_fused_softmax(self, input: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        scale = self.scale if self.scale is not None else 1.0
        return self.fused_softmax_func(input, mask, scale)

    def forward_torch_softmax(self, input: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        if self.input_in_float16 and self.softmax_in_fp32:
            input = input.float()
        if self.scale is not None:
            input = input * self.scale
        masked = self.mask_func(input, mask) if mask is not None and self.mask_func is not None else input
        probs = torch.softmax(masked, dim=-1)
        if self.input_in_float16 and self.softmax_in_fp32:
            probs = probs.half() if self.input_in_fp16 else probs.bfloat16()
        return probs

    @staticmethod
    def get_batch_per_block(sq: int, sk: int, b: int, np: int) -> int:
        """Rows of scores one thread block of upstream's kernel takes (its launch shape, from sk alone)."""
        return _warp_batches(sk)


class GenericFusedScaleMaskSoftmax(FusedScaleMaskSoftmax):
    """Upstream's variant without the kernel's sequence-length limits: with fusion on, the fused padding-mask math
    runs for every sk >= 1 (its ``attn_mask_type`` is always padding)."""

    def __init__(self, input_in_fp16: bool, input_in_bf16: bool, scaled_masked_softmax_fusion: bool,
                 mask_func: Optional[Callable], softmax_in_fp32: bool, scale: Optional[float]) -> None:
        super().__init__(input_in_fp16, input_in_bf16, AttnMaskType.padding, scaled_masked_softmax_fusion,
                         mask_func, softmax_in_fp32, scale)

    def is_kernel_available(self, mask, b: int, np: int, sq: int, sk: int) -> bool:
        return bool(self.scaled_masked_softmax_fusion) and sk > 0
