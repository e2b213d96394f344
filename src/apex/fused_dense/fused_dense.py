"""NVIDIA Apex's dense layers: ``FusedDense`` (``y = x W^T + b``) and ``FusedDenseGeluDense`` (``y = GELU(x W1^T +
b1) W2^T + b2``), on every device.

Upstream runs each as one cuBLASLt call with the bias (and the GELU) in the GEMM epilogue, CUDA only. Here the same
math runs on torch's ops: ``F.linear`` (whose CPU and CUDA kernels also add the bias inside the GEMM call) and
``F.gelu(..., approximate="tanh")``: cuBLASLt's GELU epilogue is the tanh approximation, which is why torch's own
``_addmm_activation`` falls back to ``gelu(approximate="tanh")`` on CUDA where it cannot use that epilogue. Autograd
is torch's; the backward of the two-layer form keeps what upstream's kept (the input, both weights, the GELU input
and its output).

The input may have any number of leading dimensions (upstream took 2-D input only); shapes and dtypes are checked
before anything runs (ValueError / TypeError naming the tensor, what it should be and what it is).

Under ``torch.autocast`` on the input's device the modules and the functional forms cast input, weights and biases
to the autocast dtype and run with autocast off (upstream's rule), so the output has the autocast dtype. The
``*Func.apply`` forms never cast and always run in the dtypes they are given, as upstream's extension did whatever
autocast said (the tensors must then share one dtype).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from apex._checks import check_int
from apex._upstream_forms import FunctionForm, run_as_fused

__all__ = ["DenseNoBiasFunc", "FusedDense", "FusedDenseFunc", "FusedDenseGeluDense", "FusedDenseGeluDenseFunc"]


def _check_tensor(t, what: str, where: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {what} must be a tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{where}: {what} must be a floating-point tensor, got {t.dtype}")


def _check_layer(x: torch.Tensor, weight, bias, where: str, name: str = "weight", bias_name: str = "bias",
                 features: Optional[int] = None) -> int:
    """Checks one ``x W^T + b`` over inputs of ``features`` features (x's last dimension when None); returns its
    output features."""
    _check_tensor(weight, name, where)
    if weight.dim() != 2:
        raise ValueError(f"{where}: {name} must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    if features is None:
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(f"{where}: the input's last dimension is {x.shape[-1]}, but {name} has shape "
                             f"{tuple(weight.shape)}, which takes {weight.shape[1]} features")
    elif weight.shape[1] != features:
        raise ValueError(f"{where}: {name} must have shape (out_features, {features}), got {tuple(weight.shape)}")
    if bias is not None:
        _check_tensor(bias, bias_name, where)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{where}: {bias_name} must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    return weight.shape[0]


def _check_input(x, where: str) -> None:
    _check_tensor(x, "input", where)
    if x.dim() < 1:
        raise ValueError(f"{where}: input must have at least one dimension (the features), got a 0-d tensor")


def _check_alike(where: str, names, tensors) -> None:
    # after autocast's cast, when it applies: torch's GEMMs take one dtype on one device
    x = tensors[0]
    for name, t in zip(names[1:], tensors[1:]):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise TypeError(f"{where}: {name} must have the input's dtype and device ({x.dtype} on {x.device}), "
                            f"got {t.dtype} on {t.device}")


def _linear(where: str, x, weight, bias) -> torch.Tensor:
    _check_alike(where, ("input", "weight", "bias"), (x, weight, bias))
    return F.linear(x, weight, bias)


def _gelu_linear(where: str, x, weight1, bias1, weight2, bias2) -> torch.Tensor:
    _check_alike(where, ("input", "weight1", "bias1", "weight2", "bias2"), (x, weight1, bias1, weight2, bias2))
    hidden = F.gelu(F.linear(x, weight1, bias1), approximate="tanh")
    return F.linear(hidden, weight2, bias2)


def _dense(where: str, cast: bool, x, weight, bias) -> torch.Tensor:
    _check_input(x, where)
    _check_layer(x, weight, bias, where)
    return run_as_fused(x.device.type, lambda *ts: _linear(where, *ts), (x, weight, bias), cast=cast)


def _dense_gelu_dense(where: str, cast: bool, x, weight1, bias1, weight2, bias2) -> torch.Tensor:
    _check_input(x, where)
    inner = _check_layer(x, weight1, bias1, where, "weight1", "bias1")
    _check_layer(x, weight2, bias2, where, "weight2", "bias2", features=inner)
    return run_as_fused(x.device.type, lambda *ts: _gelu_linear(where, *ts), (x, weight1, bias1, weight2, bias2),
                        cast=cast)


# upstream's private functional names, which some scripts import: upstream's autocast rule, as the modules
def _fused_dense(input, weight, bias):
    return _dense("_fused_dense", True, input, weight, bias)


def _dense_no_bias(input, weight):
    return _dense("_dense_no_bias", True, input, weight, None)


def _fused_dense_gelu_dense(input, weight1, bias1, weight2, bias2):
    return _dense_gelu_dense("_fused_dense_gelu_dense", True, input, weight1, bias1, weight2, bias2)


class FusedDenseFunc(FunctionForm):
    """Upstream's ``torch.autograd.Function`` name: ``FusedDenseFunc.apply(input, weight, bias)`` is
    ``input @ weight.T + bias`` in the dtypes given (no autocast cast); autograd by torch."""

    @staticmethod
    def forward(ctx, input, weight, bias) -> torch.Tensor:
        return _dense("FusedDenseFunc", False, input, weight, bias)


class DenseNoBiasFunc(FunctionForm):
    """Upstream's ``DenseNoBiasFunc.apply(input, weight)``: ``input @ weight.T`` in the dtypes given."""

    @staticmethod
    def forward(ctx, input, weight) -> torch.Tensor:
        return _dense("DenseNoBiasFunc", False, input, weight, None)


class FusedDenseGeluDenseFunc(FunctionForm):
    """Upstream's ``FusedDenseGeluDenseFunc.apply(input, weight1, bias1, weight2, bias2)``: ``GELU_tanh(input @
    weight1.T + bias1) @ weight2.T + bias2`` in the dtypes given (biases may be None)."""

    @staticmethod
    def forward(ctx, input, weight1, bias1, weight2, bias2) -> torch.Tensor:
        return _dense_gelu_dense("FusedDenseGeluDenseFunc", False, input, weight1, bias1, weight2, bias2)


def _features(value, what: str) -> int:
    return check_int(value, what, 1)


def _linear_init(weight: nn.Parameter, bias: Optional[nn.Parameter]) -> None:
    # nn.Linear's initialisation: kaiming-uniform weights with a = sqrt(5), biases uniform in +-1/sqrt(fan_in)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1.0 / math.sqrt(weight.shape[1])
        nn.init.uniform_(bias, -bound, bound)


class FusedDense(nn.Module):
    """``FusedDense(in_features, out_features, bias=True)``: ``nn.Linear``'s parameters (``weight`` out x in,
    ``bias`` or None) and math, under upstream's name and autocast rule.

    Parameters start as ``nn.Linear``'s do (upstream left them uninitialised); ``device`` / ``dtype`` are
    ``nn.Linear``'s keyword arguments. Sizes must be positive ints (TypeError / ValueError)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.in_features = _features(in_features, "FusedDense: in_features")
        self.out_features = _features(out_features, "FusedDense: out_features")
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _linear_init(self.weight, self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _dense("FusedDense", True, input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class FusedDenseGeluDense(nn.Module):
    """``FusedDenseGeluDense(in_features, intermediate_features, out_features, bias=True)``: ``weight1`` /
    ``bias1`` (intermediate x in), GELU (tanh approximation), ``weight2`` / ``bias2`` (out x intermediate).

    Each layer starts as an ``nn.Linear`` of its shape would. ``bias=False`` gives a form without biases
    (``bias1`` / ``bias2`` None), which upstream refused."""

    def __init__(self, in_features: int, intermediate_features: int, out_features: int, bias: bool = True, *,
                 device=None, dtype=None) -> None:
        super().__init__()
        where = "FusedDenseGeluDense"
        self.in_features = _features(in_features, f"{where}: in_features")
        self.intermediate_features = _features(intermediate_features, f"{where}: intermediate_features")
        self.out_features = _features(out_features, f"{where}: out_features")
        # registered in upstream's order, which is the order of model.parameters() and so of the optimizer's
        # state in a checkpoint
        shapes = {"weight1": (self.intermediate_features, self.in_features), "bias1": (self.intermediate_features,),
                  "weight2": (self.out_features, self.intermediate_features), "bias2": (self.out_features,)}
        for name, shape in shapes.items():
            if bias or name.startswith("weight"):
                self.register_parameter(name, nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
            else:
                self.register_parameter(name, None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _linear_init(self.weight1, self.bias1)
        _linear_init(self.weight2, self.bias2)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _dense_gelu_dense("FusedDenseGeluDense", True, input, self.weight1, self.bias1, self.weight2,
                                 self.bias2)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, intermediate_features={self.intermediate_features}, "
                f"out_features={self.out_features}, bias={self.bias1 is not None}")
