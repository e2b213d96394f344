"""LayerNorm and RMSNorm with NVIDIA Apex's names and signatures, on torch's own kernels.

Definitions, over the last ``len(normalized_shape)`` dimensions::

    layer norm:  y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias     (biased variance)
    RMS norm:    y = x / sqrt(mean(x^2) + eps) * weight

Statistics are computed in fp32 for fp16/bf16 inputs (torch's opmath), and each output is
rounded once. Output dtype: the input's for the plain forms, the weight's for the
``mixed_dtype_*`` forms and the ``MixedFused*`` modules (upstream's rule: e.g. an fp32 residual
stream normalised into bf16 activations by bf16 weights).

Under autocast (``torch.autocast`` on the input's device, which amp's O1 uses too) the functional
forms and the modules work as upstream's fused ones: floating-point tensors on that device (input,
weight, bias; float64 excepted) are cast to the autocast dtype and the norm runs with autocast off,
so the output has the autocast dtype (``F.layer_norm`` alone would run in float32 there, autocast's
rule for it). The ``*Function.apply`` forms do not cast, as upstream's: they run on the dtypes given,
with autocast off.

Layer norm runs on ``torch.nn.functional.layer_norm``; RMS norm on
``torch.nn.functional.rms_norm`` where torch has it (2.4 and later), else on the formula above. Under
export (``torch.onnx.export``, either exporter, and ``torch.export``) RMS norm takes the formula's plain
ops, which every ONNX opset and backend can express.
Autograd is torch's. ``memory_efficient`` (upstream: the backward recomputes from the output
instead of saving the input) is accepted and recorded; it changes nothing here.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.nn import functional as F

from apex._checks import check_dense, check_size, real_number
from apex._upstream_forms import FunctionForm, run_as_fused

__all__ = [
    "FusedLayerNorm",
    "FusedLayerNormAffineFunction",
    "FusedLayerNormAffineMixedDtypesFunction",
    "FusedLayerNormFunction",
    "FusedRMSNorm",
    "FusedRMSNormAffineFunction",
    "FusedRMSNormAffineMixedDtypesFunction",
    "FusedRMSNormFunction",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "fused_layer_norm",
    "fused_layer_norm_affine",
    "fused_rms_norm",
    "fused_rms_norm_affine",
    "mixed_dtype_fused_layer_norm_affine",
    "mixed_dtype_fused_rms_norm_affine",
]

ShapeLike = Union[int, Sequence[int], torch.Size]
_HAS_RMS_NORM = hasattr(F, "rms_norm")


def _shape(normalized_shape: ShapeLike, where: str) -> Tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        shape = (int(normalized_shape),)
    elif isinstance(normalized_shape, (list, tuple, torch.Size)) and all(
            isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in normalized_shape):
        shape = tuple(int(d) for d in normalized_shape)
    else:
        raise TypeError(f"{where}: normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}")
    if not shape or any(d <= 0 for d in shape):
        raise ValueError(f"{where}: normalized_shape must be non-empty with positive sizes, got {shape}")
    return shape


def _module_shape(where: str, normalized_shape: ShapeLike) -> Tuple[int, ...]:
    shape = _shape(normalized_shape, where)
    # the weights are made here, in the default dtype: a shape no tensor can have is refused before torch's
    # overflow, which names no argument
    check_size(shape, f"{where}: normalized_shape", torch.get_default_dtype())
    return shape


def _as_float(value: numbers.Real) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range
        return math.inf


def _check_eps(where: str, eps: Any) -> None:
    if real_number(eps) is None:
        raise TypeError(f"{where}: eps must be a finite number >= 0, got {type(eps).__name__}")
    if not 0 <= _as_float(eps) < math.inf:
        raise ValueError(f"{where}: eps must be a finite number >= 0, got {eps!r}")


def _check(where: str, x: torch.Tensor, shape: Tuple[int, ...], eps: float,
           params: Sequence[Tuple[str, Optional[torch.Tensor]]]) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{where}: input must be a floating-point tensor, got {got}")
    check_dense(x, f"{where}: input")
    if tuple(x.shape[x.dim() - len(shape):]) != shape or x.dim() < len(shape):
        raise ValueError(f"{where}: input of shape {tuple(x.shape)} does not end with normalized_shape {shape}")
    _check_eps(where, eps)
    for name, p in params:
        if p is None:
            continue
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            got = f"a {p.dtype} tensor" if isinstance(p, torch.Tensor) else type(p).__name__
            raise TypeError(f"{where}: {name} must be a floating-point tensor or None, got {got}")
        check_dense(p, f"{where}: {name}")
        if tuple(p.shape) != shape:
            raise ValueError(f"{where}: {name} has shape {tuple(p.shape)}, expected normalized_shape {shape}")
        if p.device != x.device:
            raise ValueError(f"{where}: {name} is on {p.device}, the input on {x.device}")


def _layer_norm(x: torch.Tensor, shape: Tuple[int, ...], weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    same = all(t is None or t.dtype == x.dtype for t in (weight, bias)) and out_dtype == x.dtype
    if same:
        return F.layer_norm(x, shape, weight, bias, eps)
    # Mixed dtypes: normalise in fp32 (what torch does inside for half types anyway), round once.
    up = [None if t is None else t.float() for t in (weight, bias)]
    return F.layer_norm(x.float(), shape, up[0], up[1], eps).to(out_dtype)


def _rms_formula(x: torch.Tensor, shape: Tuple[int, ...], weight: Optional[torch.Tensor], eps: float,
                 out_dtype: torch.dtype) -> torch.Tensor:
    dims = tuple(range(-len(shape), 0))
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(out_dtype)


def _exporting() -> bool:
    """Whether this call is being traced for export (ONNX, either exporter, or ``torch.export``)."""
    if torch.onnx.is_in_onnx_export():
        return True
    is_exporting = getattr(torch.compiler, "is_exporting", None)  # torch 2.7 and later
    return bool(is_exporting and is_exporting())


def _rms_norm(x: torch.Tensor, shape: Tuple[int, ...], weight: Optional[torch.Tensor], eps: float,
              out_dtype: torch.dtype) -> torch.Tensor:
    # Exported graphs get the formula's plain ops: ONNX has no RMS norm below opset 23 (the TorchScript
    # exporter refuses aten::rms_norm there), and on CUDA F.rms_norm becomes the fused aten op, which the ONNX
    # exporter cannot translate and export's decompositions leave in place
    if not _HAS_RMS_NORM or _exporting():
        return _rms_formula(x, shape, weight, eps, out_dtype)
    if (weight is None or weight.dtype == x.dtype) and out_dtype == x.dtype:
        return F.rms_norm(x, shape, weight, eps)
    return F.rms_norm(x.float(), shape, None if weight is None else weight.float(), eps).to(out_dtype)


def _run(cast: bool, norm, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
         mixed: bool) -> torch.Tensor:
    """``norm(x, weight, bias, out_dtype)`` with upstream's autocast handling (module docstring); the output
    dtype is the input's, or the weight's for the mixed forms, after any cast."""
    return run_as_fused(x.device.type, lambda x, w, b: norm(x, w, b, w.dtype if mixed else x.dtype),
                        (x, weight, bias), cast)


def _layer_norm_form(where: str, mixed: bool, cast: bool, input: torch.Tensor, weight: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor], normalized_shape: ShapeLike, eps: float) -> torch.Tensor:
    shape = _shape(normalized_shape, where)
    _check(where, input, shape, eps, [("weight", weight), ("bias", bias)])
    if mixed and weight is None:
        raise TypeError(f"{where}: weight is required (it sets the output dtype)")
    return _run(cast, lambda x, w, b, out: _layer_norm(x, shape, w, b, eps, out), input, weight, bias, mixed)


def _rms_norm_form(where: str, mixed: bool, cast: bool, input: torch.Tensor, weight: Optional[torch.Tensor],
                   normalized_shape: ShapeLike, eps: float) -> torch.Tensor:
    shape = _shape(normalized_shape, where)
    _check(where, input, shape, eps, [("weight", weight)])
    if mixed and weight is None:
        raise TypeError(f"{where}: weight is required (it sets the output dtype)")
    return _run(cast, lambda x, w, _, out: _rms_norm(x, shape, w, eps, out), input, weight, None, mixed)


# ---------------------------------------------------------------- functional forms (upstream's eps default 1e-6)
def fused_layer_norm_affine(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                            normalized_shape: ShapeLike, eps: float = 1e-6,
                            memory_efficient: bool = False) -> torch.Tensor:
    """Layer norm with ``weight`` and ``bias``; the output has the input's dtype (under autocast: the
    autocast dtype)."""
    return _layer_norm_form("fused_layer_norm_affine", False, True, input, weight, bias, normalized_shape, eps)


def fused_layer_norm(input: torch.Tensor, normalized_shape: ShapeLike, eps: float = 1e-6,
                     memory_efficient: bool = False) -> torch.Tensor:
    """Layer norm without affine parameters."""
    return _layer_norm_form("fused_layer_norm", False, True, input, None, None, normalized_shape, eps)


def mixed_dtype_fused_layer_norm_affine(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                                        normalized_shape: ShapeLike, eps: float = 1e-6,
                                        memory_efficient: bool = False) -> torch.Tensor:
    """Layer norm whose output has the *weight's* dtype (input and weights may differ in dtype)."""
    return _layer_norm_form("mixed_dtype_fused_layer_norm_affine", True, True, input, weight, bias,
                            normalized_shape, eps)


def fused_rms_norm_affine(input: torch.Tensor, weight: torch.Tensor, normalized_shape: ShapeLike,
                          eps: float = 1e-6, memory_efficient: bool = False) -> torch.Tensor:
    """RMS norm with ``weight``; the output has the input's dtype (under autocast: the autocast dtype)."""
    return _rms_norm_form("fused_rms_norm_affine", False, True, input, weight, normalized_shape, eps)


def fused_rms_norm(input: torch.Tensor, normalized_shape: ShapeLike, eps: float = 1e-6,
                   memory_efficient: bool = False) -> torch.Tensor:
    """RMS norm without a weight."""
    return _rms_norm_form("fused_rms_norm", False, True, input, None, normalized_shape, eps)


def mixed_dtype_fused_rms_norm_affine(input: torch.Tensor, weight: torch.Tensor,
                                      normalized_shape: ShapeLike, eps: float = 1e-6,
                                      memory_efficient: bool = False) -> torch.Tensor:
    """RMS norm whose output has the *weight's* dtype."""
    return _rms_norm_form("mixed_dtype_fused_rms_norm_affine", True, True, input, weight, normalized_shape, eps)


# ---------------------------------------------------------------- upstream's autograd.Function names
class _ApplyForm(FunctionForm):
    """Upstream's layer / RMS norm ``Function`` names: ``Cls.apply(input, ..., normalized_shape, eps,
    memory_efficient=False)`` runs the functional form's math without its autocast casts (upstream's ``apply``
    takes the dtypes it is given)."""


class FusedLayerNormAffineFunction(_ApplyForm):
    """``apply(input, weight, bias, normalized_shape, eps, memory_efficient=False)``:
    :func:`fused_layer_norm_affine` without its autocast casts."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
        return _layer_norm_form("FusedLayerNormAffineFunction", False, False, input, weight, bias,
                                normalized_shape, eps)


class FusedLayerNormFunction(_ApplyForm):
    """``apply(input, normalized_shape, eps, memory_efficient=False)``: :func:`fused_layer_norm` without its
    autocast casts."""

    @staticmethod
    def forward(ctx, input, normalized_shape, eps, memory_efficient=False):
        return _layer_norm_form("FusedLayerNormFunction", False, False, input, None, None, normalized_shape, eps)


class FusedLayerNormAffineMixedDtypesFunction(_ApplyForm):
    """``apply(input, weight, bias, normalized_shape, eps, memory_efficient=False)``:
    :func:`mixed_dtype_fused_layer_norm_affine` without its autocast casts."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
        return _layer_norm_form("FusedLayerNormAffineMixedDtypesFunction", True, False, input, weight, bias,
                                normalized_shape, eps)


class FusedRMSNormAffineFunction(_ApplyForm):
    """``apply(input, weight, normalized_shape, eps, memory_efficient=False)``: :func:`fused_rms_norm_affine`
    without its autocast casts."""

    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps, memory_efficient=False):
        return _rms_norm_form("FusedRMSNormAffineFunction", False, False, input, weight, normalized_shape, eps)


class FusedRMSNormFunction(_ApplyForm):
    """``apply(input, normalized_shape, eps, memory_efficient=False)``: :func:`fused_rms_norm` without its
    autocast casts."""

    @staticmethod
    def forward(ctx, input, normalized_shape, eps, memory_efficient=False):
        return _rms_norm_form("FusedRMSNormFunction", False, False, input, None, normalized_shape, eps)


class FusedRMSNormAffineMixedDtypesFunction(_ApplyForm):
    """``apply(input, weight, normalized_shape, eps, memory_efficient=False)``:
    :func:`mixed_dtype_fused_rms_norm_affine` without its autocast casts."""

    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps, memory_efficient=False):
        return _rms_norm_form("FusedRMSNormAffineMixedDtypesFunction", True, False, input, weight,
                              normalized_shape, eps)


# ---------------------------------------------------------------- modules (upstream's eps default 1e-5)
class FusedLayerNorm(nn.Module):
    """``torch.nn.LayerNorm``'s behaviour under upstream's name and signature.

    Args: normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False.
    With ``elementwise_affine``: ``weight`` (ones) and ``bias`` (zeros) of ``normalized_shape``.
    """

    def __init__(self, normalized_shape: ShapeLike, eps: float = 1e-5, elementwise_affine: bool = True,
                 memory_efficient: bool = False) -> None:
        super().__init__()
        self.normalized_shape = torch.Size(_module_shape(type(self).__name__, normalized_shape))
        _check_eps(type(self).__name__, eps)
        self.eps = eps
        self.elementwise_affine = bool(elementwise_affine)
        self.memory_efficient = bool(memory_efficient)
        if self.elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape))
            self.bias = nn.Parameter(torch.empty(self.normalized_shape))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        shape = tuple(self.normalized_shape)
        if self.elementwise_affine:
            return fused_layer_norm_affine(input, self.weight, self.bias, shape, self.eps, self.memory_efficient)
        return fused_layer_norm(input, shape, self.eps, self.memory_efficient)

    def extra_repr(self) -> str:
        return "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}".format(**self.__dict__)


class FusedRMSNorm(nn.Module):
    """RMS norm (Zhang & Sennrich 2019) under upstream's name and signature; what transformers' T5 uses.

    Args: normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False.
    With ``elementwise_affine``: ``weight`` (ones) of ``normalized_shape``; no bias.
    """

    def __init__(self, normalized_shape: ShapeLike, eps: float = 1e-5, elementwise_affine: bool = True,
                 memory_efficient: bool = False) -> None:
        super().__init__()
        self.normalized_shape = torch.Size(_module_shape(type(self).__name__, normalized_shape))
        _check_eps(type(self).__name__, eps)
        self.eps = eps
        self.elementwise_affine = bool(elementwise_affine)
        self.memory_efficient = bool(memory_efficient)
        if self.elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            nn.init.ones_(self.weight)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        shape = tuple(self.normalized_shape)
        if self.elementwise_affine:
            return fused_rms_norm_affine(input, self.weight, shape, self.eps, self.memory_efficient)
        return fused_rms_norm(input, shape, self.eps, self.memory_efficient)

    def extra_repr(self) -> str:
        return "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}".format(**self.__dict__)


def _no_affine_switch(cls_name: str, kwargs: dict) -> None:
    if "elementwise_affine" in kwargs:
        raise ValueError(f"{cls_name} does not support the `elementwise_affine` argument: it always has weights")
    if kwargs:
        raise TypeError(f"{cls_name}: unexpected keyword arguments {sorted(kwargs)}")


class MixedFusedLayerNorm(FusedLayerNorm):
    """FusedLayerNorm whose output has the weights' dtype (Megatron's mixed-precision layer norm).

    Args: normalized_shape, eps=1e-5, *, memory_efficient=False. Always affine; passing
    ``elementwise_affine`` raises ValueError, as upstream.
    """

    def __init__(self, normalized_shape: ShapeLike, eps: float = 1e-5, *, memory_efficient: bool = False,
                 **kwargs) -> None:
        _no_affine_switch(type(self).__name__, kwargs)
        super().__init__(normalized_shape=normalized_shape, eps=eps, elementwise_affine=True,
                         memory_efficient=memory_efficient)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return mixed_dtype_fused_layer_norm_affine(input, self.weight, self.bias, tuple(self.normalized_shape),
                                                   self.eps, self.memory_efficient)


class MixedFusedRMSNorm(FusedRMSNorm):
    """FusedRMSNorm whose output has the weight's dtype.

    Args: normalized_shape, eps=1e-5, *, memory_efficient=False. Always affine; passing
    ``elementwise_affine`` raises ValueError, as upstream.
    """

    def __init__(self, normalized_shape: ShapeLike, eps: float = 1e-5, *, memory_efficient: bool = False,
                 **kwargs) -> None:
        _no_affine_switch(type(self).__name__, kwargs)
        super().__init__(normalized_shape=normalized_shape, eps=eps, elementwise_affine=True,
                         memory_efficient=memory_efficient)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return mixed_dtype_fused_rms_norm_affine(input, self.weight, tuple(self.normalized_shape), self.eps,
                                                 self.memory_efficient)
