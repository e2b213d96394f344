"""NVIDIA Apex's fused convolution functions (MLPerf ResNet / SSD / Mask R-CNN heads), on every device::

    ConvBiasReLU(x, weight, bias, padding, stride)             relu(conv2d(x, weight) + bias)
    ConvBias(x, weight, bias, padding, stride)                 conv2d(x, weight) + bias
    ConvBiasMaskReLU(x, weight, bias, mask, padding, stride)   relu((conv2d(x, weight) + bias) * mask)
    ConvFrozenScaleBiasReLU(x, weight, scale, bias, padding, stride)
                                                               relu(conv2d(x, weight) * scale + bias)

``x`` (N, C, H, W) and ``weight`` (K, C, R, S) in any memory format (upstream's cuDNN kernels took channels-last;
the output follows the input's format, as torch's convolution does), ``bias`` / ``scale`` of K elements (upstream:
shape (1, K, 1, 1); (K,) works too), ``mask`` of the output's shape (any dtype: nonzero keeps), ``padding`` and
``stride`` ints (or pairs) as ``F.conv2d`` takes them, no dilation or groups. The frozen scale and bias of the last
form get no gradient (upstream's: a folded, frozen batch norm); the others differentiate in ``x``, ``weight`` and
``bias``.

Under autocast on the input's device, floating inputs are cast to the autocast dtype and the function runs with
autocast off (upstream cast to float16 under CUDA's autocast; each device's autocast dtype here, bfloat16 on the
CPU by default), so the output has that dtype. The convolution and bias are one ``F.conv2d`` call, whose kernels add
the bias themselves; the rest is torch's elementwise ops, autograd torch's. Shapes, dtypes and arguments are
checked before anything runs (TypeError / ValueError naming the argument).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F

from apex._checks import check_floating
from apex._upstream_forms import FunctionForm, run_as_fused

__all__ = ["ConvBias", "ConvBiasMaskReLU", "ConvBiasReLU", "ConvFrozenScaleBiasReLU"]


def _pair(value, name: str, where: str, minimum: int):
    items = value if isinstance(value, (tuple, list)) else (value,)
    if not (1 <= len(items) <= 2) or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum
                                         for v in items):
        raise TypeError(f"{where}: {name} must be an int >= {minimum} or a pair of them, got {value!r}")
    return tuple(items) if len(items) == 2 else items[0]


def _check(where: str, x, weight, per_channel, padding, stride):
    check_floating(x, f"{where}: x")
    check_floating(weight, f"{where}: weight")
    if x.dim() != 4 or weight.dim() != 4:
        raise ValueError(f"{where}: x (N, C, H, W) and weight (K, C, R, S) must be 4-D, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"{where}: weight takes {weight.shape[1]} input channels, x has {x.shape[1]}")
    k = weight.shape[0]
    for name, t in per_channel:
        check_floating(t, f"{where}: {name}")
        if t.numel() != k or (t.dim() != 1 and tuple(t.shape) != (1, k, 1, 1)):
            raise ValueError(f"{where}: {name} must have shape (1, {k}, 1, 1) or ({k},), got {tuple(t.shape)}")
    pad = _pair(padding, "padding", where, 0)
    st = _pair(stride, "stride", where, 1)
    for name, t in [("weight", weight), *per_channel]:
        if t.device != x.device:
            raise ValueError(f"{where}: {name} must be on x's device ({x.device}), got {t.device}")
    if not torch.is_autocast_enabled(x.device.type):
        for name, t in [("weight", weight), *per_channel]:
            if t.dtype != x.dtype:
                raise TypeError(f"{where}: {name} must have x's dtype ({x.dtype}) outside autocast, got {t.dtype}")
    return pad, st


def _channel(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1, 1, 1)


def _conv(x, weight, bias: Optional[torch.Tensor], pad, st) -> torch.Tensor:
    return F.conv2d(x, weight, None if bias is None else bias.reshape(-1), st, pad)


class ConvBiasReLU_(FunctionForm):
    """``ConvBiasReLU_.apply(x, weight, bias, padding, stride)``; see the module docstring."""

    @staticmethod
    def forward(ctx, x, weight, bias, padding, stride):
        pad, st = _check("ConvBiasReLU", x, weight, [("bias", bias)], padding, stride)
        return run_as_fused(x.device.type, lambda a, w, b: torch.relu(_conv(a, w, b, pad, st)), [x, weight, bias])


class ConvBias_(FunctionForm):
    """``ConvBias_.apply(x, weight, bias, padding, stride)``; see the module docstring."""

    @staticmethod
    def forward(ctx, x, weight, bias, padding, stride):
        pad, st = _check("ConvBias", x, weight, [("bias", bias)], padding, stride)
        return run_as_fused(x.device.type, lambda a, w, b: _conv(a, w, b, pad, st), [x, weight, bias])


class ConvBiasMaskReLU_(FunctionForm):
    """``ConvBiasMaskReLU_.apply(x, weight, bias, mask, padding, stride)``; see the module docstring."""

    @staticmethod
    def forward(ctx, x, weight, bias, mask, padding, stride):
        where = "ConvBiasMaskReLU"
        pad, st = _check(where, x, weight, [("bias", bias)], padding, stride)
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"{where}: mask must be a tensor, got {type(mask).__name__}")
        if mask.device != x.device:
            raise ValueError(f"{where}: mask must be on x's device ({x.device}), got {mask.device}")

        def run(a, w, b):
            out = _conv(a, w, b, pad, st)
            if mask.shape != out.shape:
                raise ValueError(f"{where}: mask must have the output's shape {tuple(out.shape)}, got "
                                 f"{tuple(mask.shape)}")
            return torch.relu(out * mask.to(out.dtype))

        return run_as_fused(x.device.type, run, [x, weight, bias])


class ConvFrozenScaleBiasReLU_(FunctionForm):
    """``ConvFrozenScaleBiasReLU_.apply(x, weight, scale, bias, padding, stride)``; see the module docstring."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias, padding, stride):
        pad, st = _check("ConvFrozenScaleBiasReLU", x, weight, [("scale", scale), ("bias", bias)], padding, stride)

        def run(a, w, s, b):
            return torch.relu(torch.addcmul(_channel(b.detach()), _conv(a, w, None, pad, st), _channel(s.detach())))

        return run_as_fused(x.device.type, run, [x, weight, scale, bias])


ConvBiasReLU = ConvBiasReLU_.apply
ConvBias = ConvBias_.apply
ConvBiasMaskReLU = ConvBiasMaskReLU_.apply
ConvFrozenScaleBiasReLU = ConvFrozenScaleBiasReLU_.apply
