"""apex.contrib.conv_bias_relu (NVIDIA Apex's fused convolution + bias (+ mask) (+ ReLU) functions): against
F.conv2d and the elementwise ops in float64, gradients included, channels-last and contiguous, autocast, bad
arguments."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from apex.contrib.conv_bias_relu import ConvBias, ConvBiasMaskReLU, ConvBiasReLU, ConvFrozenScaleBiasReLU

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _inputs(device, dtype, channels_last, pad=1, stride=2):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 9, 9, generator=g)
    w = torch.randn(16, 8, 3, 3, generator=g) * 0.2
    b = torch.randn(1, 16, 1, 1, generator=g)
    s = torch.rand(1, 16, 1, 1, generator=g) + 0.5
    out_hw = (9 + 2 * pad - 3) // stride + 1
    mask = (torch.randn(2, 16, out_hw, out_hw, generator=g) > 0).to(torch.int8)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = x.to(device=device, dtype=dtype).to(memory_format=fmt).requires_grad_()
    w = w.to(device=device, dtype=dtype).requires_grad_()
    return x, w, b.to(device=device, dtype=dtype).requires_grad_(), s.to(device=device, dtype=dtype), \
        mask.to(device).to(memory_format=fmt)


def _reference(kind, x, w, b, s, mask, pad, stride):
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    conv = F.conv2d(x64, w64, None, stride, pad)
    if kind == "bias_relu":
        out = torch.relu(conv + b64)
    elif kind == "bias":
        out = conv + b64
    elif kind == "mask":
        out = torch.relu((conv + b64) * mask.double())
    else:
        out = torch.relu(conv * s.double() + b64.detach())
    return out, (x64, w64, b64)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("kind", ["bias_relu", "bias", "mask", "frozen"])
def test_against_float64(device, dtype, channels_last, kind):
    pad, stride = 1, 2
    x, w, b, s, mask = _inputs(device, dtype, channels_last, pad, stride)
    if kind == "bias_relu":
        out = ConvBiasReLU(x, w, b, pad, stride)
    elif kind == "bias":
        out = ConvBias(x, w, b, pad, stride)
    elif kind == "mask":
        out = ConvBiasMaskReLU(x, w, b, mask, pad, stride)
    else:
        out = ConvFrozenScaleBiasReLU(x, w, s, b, pad, stride)
    want, (x64, w64, b64) = _reference(kind, x, w, b, s, mask, pad, stride)
    assert out.dtype == dtype and out.shape == want.shape
    assert out.is_contiguous(memory_format=torch.channels_last) == channels_last
    torch.testing.assert_close(out.double(), want.detach(), **TOL[dtype])
    dy = torch.randn(out.shape, device=device)
    out.backward(dy.to(dtype))
    want.backward(dy.to(dtype).double())
    torch.testing.assert_close(x.grad.double(), x64.grad, **TOL[dtype])
    # the weight's gradient sums N * H * W products: an element may cancel far below the largest
    tol = dict(TOL[dtype], atol=TOL[dtype]["atol"] * max(1.0, float(w64.grad.abs().max())))
    torch.testing.assert_close(w.grad.double(), w64.grad, **tol)
    if kind == "frozen":
        assert b.grad is None
    else:
        assert b.grad.shape == b.shape
        torch.testing.assert_close(b.grad.double(), b64.grad, **TOL[dtype])


def test_autocast_casts_to_the_devices_dtype(device):
    x, w, b, _, _ = _inputs(device, torch.float32, True)
    low = torch.get_autocast_dtype(device)
    with torch.autocast(device_type=device):
        out = ConvBiasReLU(x, w, b.view(-1), 1, 1)
    assert out.dtype == low
    want = torch.relu(F.conv2d(x.to(low), w.to(low), b.to(low).view(-1), 1, 1))
    torch.testing.assert_close(out, want)


def test_bad_arguments(device):
    x, w, b, s, mask = _inputs(device, torch.float32, False)
    cases = [
        (lambda: ConvBias(x[0], w, b, 1, 2), ValueError, "4-D"),
        (lambda: ConvBias(x, w[:, :4], b, 1, 2), ValueError, "input channels"),
        (lambda: ConvBias(x, w, b[:, :8], 1, 2), ValueError, "bias must have shape"),
        (lambda: ConvBias(x, w, b, -1, 2), TypeError, "padding"),
        (lambda: ConvBias(x, w, b, 1, 0), TypeError, "stride"),
        (lambda: ConvBias(x, w.double(), b, 1, 2), TypeError, "dtype"),
        (lambda: ConvBias(x.long(), w, b, 1, 2), TypeError, "x must be"),
        (lambda: ConvBiasMaskReLU(x, w, b, mask[:, :, :2], 1, 2), ValueError, "mask must have"),
        (lambda: ConvFrozenScaleBiasReLU(x, w, s.view(-1)[:3], b, 1, 2), ValueError, "scale must have"),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=words):
            call()
