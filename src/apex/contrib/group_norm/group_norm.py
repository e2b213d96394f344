"""NVIDIA Apex's ``GroupNorm``: group normalization with an optional SiLU after it, in the input's dtype and memory
format, on every device.

``GroupNorm(num_groups, num_channels, eps=1e-5, affine=True, device=None, dtype=None, act=None)`` computes, per
sample and group of ``num_channels / num_groups`` channels (all their spatial positions),
``y = (x - mean) / sqrt(var + eps) * weight[c] + bias[c]`` (biased variance) and, with ``act`` "silu" or "swish",
``y * sigmoid(y)``. Upstream ran an NHWC CUDA kernel for some channel counts, group counts and dtypes and
``F.group_norm`` for the rest; here one path serves every shape, layout and device: the statistics and the
normalization in float32 (float64 when the input or the parameters are float64) whatever the input's and the
parameters' dtypes (any pairing of float32 / float16 / bfloat16), the result rounded once to the input's dtype and
laid out as the input (channels-last in, channels-last out; upstream's kernel wrote its output NHWC the same way).

The backward keeps what upstream's kernel kept: the input in its own dtype and one mean and one reciprocal standard
deviation per (sample, group), not a float32 copy of the input; it makes the float32 input again when it runs and,
with SiLU, the normalized output from those statistics in one elementwise pass. Gradients come back in the dtypes
of the input, weight and bias.

Upstream's functional names take the same arguments and run the same math (``torch_group_norm``,
``cuda_group_norm_nhwc_one_pass``, ``cuda_group_norm_nhwc_two_pass``, ``cuda_group_norm_v2_nhwc``: the names keep
upstream's kernel choices; none needs CUDA or NHWC input here).
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch
from torch import nn

from apex._checks import check_dense, check_int, check_size, real_number

__all__ = ["GroupNorm"]

_ACTS = (None, "", "silu", "swish")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _act_name(act, where: str) -> Optional[str]:
    name = act.lower() if isinstance(act, str) else act
    if name not in _ACTS:
        raise ValueError(f"{where}: act must be None, '', 'silu' or 'swish', got {act!r}")
    return name or None


def _like_input(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.to(x.dtype).contiguous(memory_format=_format(x))


def _check_eps(eps, where: str) -> float:
    value = real_number(eps)
    if value is None or not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{where}: eps must be a finite number >= 0, got {eps!r}")
    return float(value)


class _GroupNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups, weight, bias, eps, act):
        compute = torch.float64 if torch.float64 in (x.dtype, getattr(weight, "dtype", None),
                                                     getattr(bias, "dtype", None)) else torch.float32
        n, c = x.shape[0], x.shape[1]
        hw = x.numel() // (n * c) if n * c else 0
        wc = None if weight is None else weight.to(compute)
        bc = None if bias is None else bias.to(compute)
        pre, mean, rstd = torch.native_group_norm(_kernel_layout(x.to(compute)), wc, bc, n, c, hw, groups, eps)
        out = torch.nn.functional.silu(pre) if act else pre
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.shape = (n, c, hw, groups, act, compute)
        return _like_input(out, x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        n, c, hw, groups, act, compute = ctx.shape
        xc = _kernel_layout(x.to(compute))
        wc = None if weight is None else weight.to(compute)
        g = grad_out.to(compute)
        if act:
            # the SiLU's input again, in one elementwise pass from the kept statistics: per (sample, channel)
            # x * (rstd * w) + (b - mean * rstd * w); keeping it instead would double what the backward holds
            shape = (n, c) + (1,) * (x.dim() - 2)
            per_channel = c // groups
            scale = rstd.repeat_interleave(per_channel, dim=1)
            if wc is not None:
                scale = scale * wc
            shift = -mean.repeat_interleave(per_channel, dim=1) * scale
            if bias is not None:
                shift = shift + bias.to(compute)
            pre = torch.addcmul(shift.view(shape), xc, scale.view(shape))
            g = torch.ops.aten.silu_backward(g, pre)
        need = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2],
                bias is not None and ctx.needs_input_grad[3]]
        dx, dw, db = torch.ops.aten.native_group_norm_backward(g.contiguous(memory_format=_format(xc)), xc, mean,
                                                               rstd, wc, n, c, hw, groups, need)
        return (None if dx is None else _like_input(dx, x), None,
                None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype), None, None)


def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    # torch's CPU group norm reads channels-last input as it is; elsewhere (a device's own kernel, or the
    # decomposition a backend without one falls back to, which views the input as (N, G, -1)) it is made contiguous
    return t if t.device.type == "cpu" else t.contiguous()


def _format(t: torch.Tensor) -> torch.memory_format:
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format


def _group_norm(where: str, x, groups, weight, bias, eps, act) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{where}: input must be a float32, float16, bfloat16 or float64 tensor, got {got}")
    check_dense(x, f"{where}: input")
    if x.dim() < 2:
        raise ValueError(f"{where}: input must have shape (N, C, ...), got {tuple(x.shape)}")
    groups = check_int(groups, f"{where}: num_groups", 1)
    channels = x.shape[1]
    if channels % groups:
        raise ValueError(f"{where}: the input's {channels} channels do not divide into {groups} groups")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype not in _FLOATS:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{where}: {name} must be a floating-point tensor or None, got {got}")
        check_dense(t, f"{where}: {name}")
        if tuple(t.shape) != (channels,):
            raise ValueError(f"{where}: {name} must have shape ({channels},), one per channel of the input, "
                             f"got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{where}: {name} must be on the input's device ({x.device}), got {t.device}")
    return _GroupNormFunction.apply(x, groups, weight, bias, _check_eps(eps, where), _act_name(act, where))


def torch_group_norm(x, g, w, b, eps, act=""):
    """Upstream's fallback form: ``GroupNorm``'s math on ``x`` with ``g`` groups, weight ``w``, bias ``b``."""
    return _group_norm("torch_group_norm", x, g, w, b, eps, act)


def cuda_group_norm_nhwc_one_pass(x, G, weight, bias, eps, act=None):
    """Upstream's one-pass kernel form; the same math as :class:`GroupNorm` on any device and layout."""
    return _group_norm("cuda_group_norm_nhwc_one_pass", x, G, weight, bias, eps, act)


def cuda_group_norm_nhwc_two_pass(x, G, weight, bias, eps, act=None):
    """Upstream's two-pass kernel form; the same math as :class:`GroupNorm` on any device and layout."""
    return _group_norm("cuda_group_norm_nhwc_two_pass", x, G, weight, bias, eps, act)


def cuda_group_norm_v2_nhwc(x, G, weight, bias, eps, act=None):
    """Upstream's v2 kernel form; the same math as :class:`GroupNorm` on any device and layout."""
    return _group_norm("cuda_group_norm_v2_nhwc", x, G, weight, bias, eps, act)


@functools.cache
def get_cc_and_sm_count(device_index: int) -> Tuple[Tuple[int, int], int]:
    """Upstream's helper: the compute capability and the multiprocessor count of CUDA device ``device_index``
    (tests use it to pick cases). Needs CUDA: RuntimeError from torch elsewhere."""
    props = torch.cuda.get_device_properties(device_index)
    return (props.major, props.minor), props.multi_processor_count


class GroupNorm(nn.Module):
    """``GroupNorm(num_groups, num_channels, eps=1e-5, affine=True, device=None, dtype=None, act=None)``: see the
    module docstring. ``act`` is None, '' (none), 'silu' or 'swish' (any case); anything else raises ValueError
    here (upstream ignored an unknown name in its fallback path). ``weight`` starts at ones, ``bias`` at zeros."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 device=None, dtype=None, act=None) -> None:
        super().__init__()
        where = "GroupNorm"
        self.num_groups = check_int(num_groups, f"{where}: num_groups", 1)
        self.num_channels = check_int(num_channels, f"{where}: num_channels", 1)
        if self.num_channels % self.num_groups:
            raise ValueError(f"{where}: num_channels must be divisible by num_groups, got {self.num_channels} "
                             f"and {self.num_groups}")
        self.eps = _check_eps(eps, where)
        self.affine = bool(affine)
        # the weights are made here: a count no tensor can have is refused before torch's overflow, which names no
        # argument
        check_size((self.num_channels,), f"{where}: num_channels",
                   (dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()) if self.affine else None)
        self.act = act.lower() if isinstance(act, str) else act
        _act_name(act, where)
        if self.affine:
            self.weight = nn.Parameter(torch.empty(self.num_channels, device=device, dtype=dtype))
            self.bias = nn.Parameter(torch.empty(self.num_channels, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, torch.Tensor) and input.dim() >= 2 and input.shape[1] != self.num_channels:
            raise ValueError(f"GroupNorm: the input has {input.shape[1]} channels (dimension 1); this module "
                             f"normalizes {self.num_channels}")
        return _group_norm("GroupNorm", input, self.num_groups, self.weight, self.bias, self.eps, self.act)

    def extra_repr(self) -> str:
        text = f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"
        return text + (f", act={self.act}" if self.act else "")
