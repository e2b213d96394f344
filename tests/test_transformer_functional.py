"""apex.transformer (NVIDIA Apex's enums and functional part): fused scale-mask softmax against the float64 formula
(scale, masked score -10000, fully masked rows zero, causal keys above the diagonal zero) and against the torch
path, the path choice by upstream's kernel rule; RoPE against the rotate-half formula computed the way upstream's
kernel and Megatron's unfused reference compute it (in the input's dtype), bitwise, and against float64."""

from __future__ import annotations

import math

import pytest
import torch

import apex
from apex.transformer import AttnMaskType, AttnType, LayerType, ModelType
from apex.transformer.functional import (
    FusedScaleMaskSoftmax,
    GenericFusedScaleMaskSoftmax,
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_2d,
    fused_apply_rotary_pos_emb_cached,
    fused_apply_rotary_pos_emb_thd,
)
from apex.transformer.functional.fused_softmax import (
    ScaledMaskedSoftmax,
    ScaledSoftmax,
    ScaledUpperTriangMaskedSoftmax,
    scaled_masked_softmax,
    scaled_upper_triang_masked_softmax,
)

LOW = (torch.float16, torch.bfloat16)
# one rounding to the output dtype from float32 math (values in [0, 1])
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-7), torch.float16: dict(rtol=1e-3, atol=5e-4),
       torch.bfloat16: dict(rtol=8e-3, atol=4e-3)}
# grads: y * (dy - sum(dy * y)) cancels; float32 within a few ulps of the largest term
GRAD_TOL = {**TOL, torch.float32: dict(rtol=1e-5, atol=1e-6)}


def _mask_fill(scores, mask):
    return scores.masked_fill(mask, -10000.0)


def _softmax64(x, scale, mask=None, causal=False):
    s = x.detach().double().requires_grad_()
    z = s * scale
    if mask is not None:
        z = z.masked_fill(mask, -10000.0)
    if causal:
        z = z.masked_fill(torch.ones(z.shape[-2:], dtype=torch.bool, device=z.device).triu(1), float("-inf"))
    y = torch.softmax(z, dim=-1)
    if mask is not None:
        y = y * (~mask.all(dim=-1, keepdim=True))
    return s, y


# ---------------------------------------------------------------- enums


def test_enums_and_package():
    assert (AttnMaskType.padding.value, AttnMaskType.causal.value) == (1, 2)
    assert (AttnType.self_attn.value, LayerType.decoder.value, ModelType.encoder_and_decoder.value) == (1, 2, 2)
    assert apex.transformer.functional.FusedScaleMaskSoftmax is FusedScaleMaskSoftmax
    with pytest.raises(ImportError):
        from apex.transformer import parallel_state  # noqa: F401  (model parallelism is not part of this package)


# ---------------------------------------------------------------- softmax


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_masked_softmax_against_float64(device, dtype, scale):
    torch.manual_seed(0)
    x = (torch.randn(2, 3, 8, 40) * 4).to(dtype).to(device).requires_grad_()
    mask = torch.rand(2, 1, 8, 40, device=device) < 0.4
    mask[0, 0, 3] = True  # a row whose every key is masked: zeros, and no gradient
    y = ScaledMaskedSoftmax.apply(x, mask, scale)
    assert y.dtype == dtype
    s64, want = _softmax64(x, scale, mask)
    torch.testing.assert_close(y.double(), want.detach(), **TOL[dtype])
    assert not y[0, :, 3].any()
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), s64.grad, **GRAD_TOL[dtype])
    assert not x.grad[0, :, 3].any() and not x.grad[mask.expand_as(x)].any()


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
def test_causal_and_unmasked_softmax(device, dtype):
    torch.manual_seed(1)
    x = (torch.randn(6, 24, 24) * 3).to(dtype).to(device).requires_grad_()
    y = ScaledUpperTriangMaskedSoftmax.apply(x, 0.5)
    s64, want = _softmax64(x, 0.5, causal=True)
    torch.testing.assert_close(y.double(), want.detach(), **TOL[dtype])
    assert not y.triu(1).any()
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), s64.grad, **GRAD_TOL[dtype])
    assert not x.grad.triu(1).any()
    x4 = x.detach().view(2, 3, 24, 24)
    torch.testing.assert_close(scaled_upper_triang_masked_softmax(x4, None, 0.5), y.detach().view(2, 3, 24, 24),
                               rtol=0, atol=0)
    plain = ScaledSoftmax.apply(x4, 2.0)
    torch.testing.assert_close(plain.double(), torch.softmax(x4.double() * 2, -1), **TOL[dtype])
    torch.testing.assert_close(scaled_masked_softmax(x4, None, 2.0), plain, rtol=0, atol=0)


@pytest.mark.parametrize("shape,expected", [
    ((4, 12, 24, 24), True),     # keys 24 -> 32-wide warps, 2 rows each, 8 per block: 24 % 8 == 0
    ((32, 12, 4, 216), True),    # keys 216 -> 1 row per warp, 4 per block: 4 % 4 == 0
    ((32, 12, 4, 214), False),   # sk % 4 (upstream's own test shape: its torch path)
    ((4, 12, 20, 20), False),    # 20 % 8 != 0
    ((4, 12, 24, 16), False),    # sk must exceed 16
    ((1, 3, 24, 24), False),     # b * np must be a multiple of 4
    ((4, 12, 24, 18), False),    # sk % 4
    ((2, 2, 8, 16384), True),
    ((2, 2, 8, 16388), False),
])
def test_kernel_rule(shape, expected):
    fn = FusedScaleMaskSoftmax(True, False, AttnMaskType.padding, True, _mask_fill, True, None)
    assert fn.is_kernel_available(None, *shape) is expected
    assert not FusedScaleMaskSoftmax(False, False, AttnMaskType.padding, True, _mask_fill, True,
                                     None).is_kernel_available(None, *shape)
    assert [FusedScaleMaskSoftmax.get_batch_per_block(4, sk, 1, 1) for sk in (17, 32, 128, 129, 4096)] == \
        [8, 8, 8, 4, 4]
    assert GenericFusedScaleMaskSoftmax(True, False, True, _mask_fill, True, None).is_kernel_available(
        None, 1, 1, 1, 3)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("mask_type", [AttnMaskType.padding, AttnMaskType.causal])
def test_module_paths(device, dtype, mask_type):
    torch.manual_seed(2)
    fp16, bf16 = dtype == torch.float16, dtype == torch.bfloat16
    fused = FusedScaleMaskSoftmax(fp16, bf16, mask_type, True, _mask_fill, True, 0.5)
    plain = FusedScaleMaskSoftmax(fp16, bf16, mask_type, False, _mask_fill, True, 0.5)
    x = torch.randn(4, 12, 24, 24, device=device).to(dtype)
    if mask_type == AttnMaskType.causal:
        mask = torch.ones(24, 24, dtype=torch.bool, device=device).triu(1).expand(4, 1, 24, 24)
    else:
        mask = torch.rand(4, 1, 24, 24, device=device) < 0.3
    out, ref = fused(x, mask), plain(x, mask)
    assert out.dtype == ref.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])
    # the torch path is the plain sequence, exactly
    want = torch.softmax(_mask_fill(x.float() * 0.5, mask), dim=-1).to(dtype)
    torch.testing.assert_close(ref, want, rtol=0, atol=0)
    # a shape the kernels did not take runs the torch path in the fused module too
    odd = torch.randn(1, 3, 5, 7, device=device).to(dtype)
    odd_mask = torch.zeros(1, 1, 5, 7, dtype=torch.bool, device=device)
    torch.testing.assert_close(fused(odd, odd_mask), plain(odd, odd_mask), rtol=0, atol=0)


def test_module_under_autocast(device):
    low = torch.float16 if device == "cuda" else torch.bfloat16
    fn = FusedScaleMaskSoftmax(low == torch.float16, low == torch.bfloat16, AttnMaskType.padding, True, _mask_fill,
                               False, None)
    x = torch.randn(4, 12, 24, 24, device=device, requires_grad=True)
    mask = torch.rand(4, 1, 24, 24, device=device) < 0.3
    with torch.autocast(device, dtype=low):
        out = fn(x, mask)
    assert out.dtype == low
    torch.testing.assert_close(out, ScaledMaskedSoftmax.apply(x.detach().to(low), mask, 1.0), rtol=0, atol=0)
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32


@pytest.mark.parametrize("call,exc,match", [
    (lambda: FusedScaleMaskSoftmax(True, True, AttnMaskType.padding, True, _mask_fill, True, None), RuntimeError,
     "both fp16 and bf16"),
    (lambda: FusedScaleMaskSoftmax(True, False, AttnMaskType.padding, True, _mask_fill, False, 2.0), RuntimeError,
     "softmax should be in fp32 when scaled"),
    (lambda: FusedScaleMaskSoftmax(True, False, "padding", True, _mask_fill, True, None), ValueError,
     "Invalid attn_mask_type"),
    (lambda: FusedScaleMaskSoftmax(True, False, AttnMaskType.padding, True, "f", True, None), TypeError,
     "mask_func must be callable"),
    (lambda: FusedScaleMaskSoftmax(True, False, AttnMaskType.padding, True, _mask_fill, True, None)(
        torch.randn(3, 4, 4), None), ValueError, r"inputs must have 4 dimensions, got shape \(3, 4, 4\)"),
    (lambda: FusedScaleMaskSoftmax(True, False, AttnMaskType.padding, False, _mask_fill, True, None)(
        torch.ones(1, 1, 4, 4, dtype=torch.long), None), TypeError, "inputs must be a floating-point tensor"),
    (lambda: ScaledMaskedSoftmax.apply(torch.randn(2, 3, 4, 5), torch.zeros(2, 3, 4, 5, dtype=torch.bool), 1.0),
     ValueError, r"mask must have shape \(2 or 1, 1, 4, 5\)"),
    (lambda: ScaledMaskedSoftmax.apply(torch.randn(2, 3, 4, 5), torch.zeros(2, 1, 4, 5), 1.0), TypeError,
     "mask must be a bool"),
    (lambda: ScaledSoftmax.apply(torch.randn(2, 3, 4, 5), float("inf")), TypeError, "scale must be a finite"),
    (lambda: ScaledUpperTriangMaskedSoftmax.apply(torch.randn(2, 3, 4), 1.0), ValueError, "sq == sk"),
    (lambda: ScaledSoftmax.apply(torch.ones(2, 3, 4, 5, dtype=torch.long), 1.0), TypeError, "floating-point"),
])
def test_softmax_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ---------------------------------------------------------------- RoPE


def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_reference(t, cos, sin):
    """The formula computed as Megatron's unfused code computes it: cos / sin in t's dtype, ops in t's dtype."""
    d2 = cos.shape[-1]
    rot, rest = t[..., :d2], t[..., d2:]
    cos, sin = cos.to(t.dtype), sin.to(t.dtype)
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("rotary", [1.0, 0.5])
@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("transpose_output_memory", [False, True])
def test_rope_is_the_formula(device, dtype, rotary, cached, transpose_output_memory):
    torch.manual_seed(3)
    s, b, h, d = 12, 3, 2, 16
    base = torch.rand(b, s, h, d, device=device).to(dtype)
    t = base.transpose(0, 1).requires_grad_()  # (s, b, h, d), not contiguous
    tr = t.detach().clone().requires_grad_()
    freqs = torch.rand(s + 5, 1, 1, int(d * rotary), device=device)  # longer than s: the first s rows are used
    if cached:
        out = fused_apply_rotary_pos_emb_cached(t, freqs.cos(), freqs.sin(), transpose_output_memory)
    else:
        out = fused_apply_rotary_pos_emb(t, freqs, transpose_output_memory)
    want = _rope_reference(tr, freqs[:s].cos(), freqs[:s].sin())
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert out.transpose(0, 1).is_contiguous() is transpose_output_memory
    dy = torch.randn_like(out)
    out.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(t.grad, tr.grad, rtol=0, atol=0)


def test_rope_float32_against_float64(device):
    torch.manual_seed(4)
    t = torch.randn(9, 2, 3, 8, device=device, requires_grad=True)
    freqs = torch.randn(9, 1, 1, 8, device=device, dtype=torch.float64)
    out = fused_apply_rotary_pos_emb(t, freqs.float())
    t64 = t.detach().double().requires_grad_()
    want = t64 * freqs.cos() + _rotate_half(t64) * freqs.sin()
    torch.testing.assert_close(out.double(), want.detach(), rtol=1e-6, atol=1e-6)
    dy = torch.randn_like(out)
    out.backward(dy)
    want.backward(dy.double())
    torch.testing.assert_close(t.grad.double(), t64.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_packed_sequences(device, dtype):
    torch.manual_seed(5)
    cu = torch.tensor([0, 7, 7, 19, 20, 32], dtype=torch.int32, device=device)
    t = torch.rand(32, 2, 8, device=device).to(dtype).requires_grad_()
    tr = t.detach().clone().requires_grad_()
    freqs = torch.rand(12, 1, 1, 4, device=device)
    out = fused_apply_rotary_pos_emb_thd(t, cu, freqs)
    pieces = [_rope_reference(x.unsqueeze(1), freqs[: x.shape[0]].cos(), freqs[: x.shape[0]].sin()).squeeze(1)
              for x in torch.split(tr, [7, 0, 12, 1, 12])]
    want = torch.cat(pieces)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    dy = torch.randn_like(out)
    out.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(t.grad, tr.grad, rtol=0, atol=0)


def test_rope_2d(device):
    torch.manual_seed(6)
    b, ih, iw, h, d = 2, 3, 5, 2, 8
    t = torch.rand(b, ih * iw, h, d, device=device).requires_grad_()
    tr = t.detach().clone().requires_grad_()
    eh, ew = torch.rand(1, ih + 2, 1, d // 2, device=device), torch.rand(1, iw, 1, d // 2, device=device)
    out = fused_apply_rotary_pos_emb_2d(t, ih, iw, eh.cos(), eh.sin(), ew.cos(), ew.sin())
    grid = tr.view(b, ih, iw, h, d)
    q1 = _rope_reference(grid[..., : d // 2], eh.cos()[:, :ih].unsqueeze(2), eh.sin()[:, :ih].unsqueeze(2))
    q2 = _rope_reference(grid[..., d // 2:], ew.cos()[:, :iw].unsqueeze(1), ew.sin()[:, :iw].unsqueeze(1))
    want = torch.cat((q1, q2), dim=-1).view(b, ih * iw, h, d)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    dy = torch.randn_like(out)
    out.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(t.grad, tr.grad, rtol=0, atol=0)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: fused_apply_rotary_pos_emb(torch.randn(4, 2, 3), torch.randn(4, 1, 1, 2)), ValueError,
     r"t must have shape \(s, b, h, d\)"),
    (lambda: fused_apply_rotary_pos_emb(torch.randn(4, 1, 1, 8), torch.randn(3, 1, 1, 8)), ValueError,
     r"freqs must have shape \(>= 4, 1, 1, d2 \(even, <= 8\)\), got \(3, 1, 1, 8\)"),
    (lambda: fused_apply_rotary_pos_emb(torch.randn(4, 1, 1, 8), torch.randn(4, 1, 1, 3)), ValueError, "even"),
    (lambda: fused_apply_rotary_pos_emb(torch.randn(4, 1, 1, 8), torch.randn(4, 1, 1, 10)), ValueError, "<= 8"),
    (lambda: fused_apply_rotary_pos_emb(torch.randn(4, 2, 1, 8), torch.randn(4, 2, 1, 8)), ValueError,
     r"freqs must have shape \(>= 4, 1, 1, d2"),
    (lambda: fused_apply_rotary_pos_emb(torch.ones(4, 1, 1, 8, dtype=torch.long), torch.randn(4, 1, 1, 8)),
     TypeError, "t must be a floating-point"),
    (lambda: fused_apply_rotary_pos_emb_cached(torch.randn(4, 1, 1, 8), torch.randn(4, 1, 1, 8),
                                               torch.randn(4, 1, 1, 6)), ValueError, "sin_ must have shape"),
    (lambda: fused_apply_rotary_pos_emb_thd(torch.randn(10, 1, 8), torch.tensor([0, 4, 9], dtype=torch.int32),
                                            torch.randn(8, 1, 1, 8)), ValueError, "rise from 0 to t's 10 tokens"),
    (lambda: fused_apply_rotary_pos_emb_thd(torch.randn(10, 1, 8), torch.tensor([0, 6, 4, 10]),
                                            torch.randn(8, 1, 1, 8)), ValueError, "rise from 0"),
    (lambda: fused_apply_rotary_pos_emb_thd(torch.randn(10, 1, 8), [0, 10], torch.randn(8, 1, 1, 8)), TypeError,
     "cu_seqlens must be a 1-D int32"),
    (lambda: fused_apply_rotary_pos_emb_thd(torch.randn(10, 1, 8), torch.tensor([0, 10]), torch.randn(8, 1, 1, 8)),
     ValueError, r"freqs must have shape \(>= 10"),
    (lambda: fused_apply_rotary_pos_emb_2d(torch.randn(1, 6, 1, 8), 2, 2, *[torch.randn(1, 2, 1, 4)] * 4),
     ValueError, "img_h \\* img_w = 4, got 6"),
    (lambda: fused_apply_rotary_pos_emb_2d(torch.randn(1, 4, 1, 6), 2, 2, *[torch.randn(1, 2, 1, 3)] * 4),
     ValueError, "multiple of 4"),
    (lambda: fused_apply_rotary_pos_emb_2d(torch.randn(1, 4, 1, 8), 2, 2, torch.randn(1, 1, 1, 4),
                                           *[torch.randn(1, 2, 1, 4)] * 3), ValueError,
     r"cos_h must have shape \(1, >= 2, 1, 4\)"),
    (lambda: fused_apply_rotary_pos_emb_2d(torch.randn(1, 4, 1, 8), 2.0, 2, *[torch.randn(1, 2, 1, 4)] * 4),
     TypeError, "img_h must be a positive int"),
])
def test_rope_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_rope_transposed_grad_layout_and_empty():
    t = torch.randn(0, 2, 1, 4, requires_grad=True)
    out = fused_apply_rotary_pos_emb(t, torch.randn(0, 1, 1, 4))
    out.sum().backward()
    assert out.shape == (0, 2, 1, 4) and t.grad.shape == t.shape
    assert math.isfinite(float(fused_apply_rotary_pos_emb(torch.randn(3, 1, 1, 4), torch.randn(3, 1, 1, 2)).sum()))
