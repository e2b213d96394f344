"""NVIDIA Apex's ``MLP``: a stack of linear layers, each followed by the same activation, on every device.

``MLP(mlp_sizes, bias=True, activation='relu')`` has ``len(mlp_sizes) - 1`` layers; layer i maps
``mlp_sizes[i]`` features to ``mlp_sizes[i + 1]`` with ``weight_i`` (out x in) and, with ``bias``, ``bias_i``,
then applies the activation (``'relu'``, ``'sigmoid'`` or ``'none'``), after the last layer too. Upstream runs it
as one CUDA extension call; here each layer is ``torch.nn.functional.linear`` and the activation, so autograd,
devices and dtypes are torch's. Under ``torch.autocast`` on the input's device the input, weights and biases are
cast to the autocast dtype and the layers run with autocast off (upstream's rule, which gives the same result as
letting autocast cast each linear).

The attributes scripts read are upstream's: ``weights`` and ``biases`` (lists of the parameters, also
registered as ``weight_<i>`` / ``bias_<i>``), ``num_layers``, ``mlp_sizes``, and ``bias`` / ``activation`` as
upstream's integer codes (bias 0/1; activation 0 none, 1 relu, 2 sigmoid).
"""

from __future__ import annotations

import math
import numbers
from typing import List, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from apex._checks import check_int
from apex._upstream_forms import FunctionForm, run_as_fused

__all__ = ["MLP", "MlpFunction", "mlp_function"]

_ACTIVATIONS = {"none": 0, "relu": 1, "sigmoid": 2}


def _layers(bias: int, activation: int, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    where = "mlp_function"
    if not isinstance(bias, int):  # a bool is an int
        raise TypeError(f"{where}: bias must be 0 or 1 (or a bool), got {type(bias).__name__}")
    if bias not in (0, 1):
        raise ValueError(f"{where}: bias must be 0 or 1 (or a bool), got {bias!r}")
    activation = check_int(activation, f"{where}: activation", 0, 2)  # 0 none, 1 relu, 2 sigmoid
    bias = int(bias)
    if not tensors:
        raise TypeError(f"{where}: expected the input, then the weights and the biases")
    x, params = tensors[0], list(tensors[1:])
    for k, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{where}: argument {k + 2} must be a floating-point tensor, got {got}")
    if bias and len(params) % 2:
        raise ValueError(f"{where}: with bias={bias}, expected as many biases as weights; got {len(params)} "
                         "weight and bias tensors")
    n = len(params) // (1 + bias)
    weights, biases = params[:n], (params[n:] if bias else [None] * n)
    features = x.shape[-1] if x.dim() else None
    for i, (w, b) in enumerate(zip(weights, biases)):
        if w.dim() != 2 or w.shape[1] != features:
            raise ValueError(f"{where}: weight {i} has shape {tuple(w.shape)}; expected (out, {features})")
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"{where}: bias {i} has shape {tuple(b.shape)}; expected ({w.shape[0]},)")
        features = w.shape[0]
    return run_as_fused(x.device.type, lambda x, *ps: _run(x, ps[:n], ps[n:], activation), (x, *weights, *biases))


def _run(x, weights, biases, activation) -> torch.Tensor:
    # the activation overwrites the linear's fresh output (its backward keeps input and weight, not the output),
    # as nn.ReLU(inplace=True) after nn.Linear does: one allocation less per layer
    for w, b in zip(weights, biases):
        x = F.linear(x, w, b)
        if activation == 1:
            x = x.relu_()
        elif activation == 2:
            x = x.sigmoid_()
    return x


def mlp_function(bias: int, activation: int, *args: torch.Tensor) -> torch.Tensor:
    """Upstream's functional form: ``mlp_function(bias, activation, input, *weights, *biases)`` with the integer
    codes of :class:`MLP` (autocast handled as the module does)."""
    return _layers(bias, activation, args)


class MlpFunction(FunctionForm):
    """Upstream's ``torch.autograd.Function`` name: ``MlpFunction.apply(bias, activation, input, *weights,
    *biases)``; ``forward(ctx, bias, activation, *args)`` has upstream's arguments."""

    @staticmethod
    def forward(ctx, bias, activation, *args) -> torch.Tensor:
        return _layers(bias, activation, args)


class MLP(nn.Module):
    """``MLP(mlp_sizes, bias=True, activation='relu')``: see the module docstring.

    Weights start as normal(0, sqrt(2 / (in + out))) and biases as normal(0, sqrt(1 / out)), upstream's
    initialisation. Raises ValueError for fewer than two sizes or a non-positive size, TypeError for an unknown
    activation (as upstream).
    """

    def __init__(self, mlp_sizes: Sequence[int], bias: bool = True, activation: str = "relu") -> None:
        super().__init__()
        sizes = list(mlp_sizes) if isinstance(mlp_sizes, (list, tuple)) else None
        if sizes is None or len(sizes) < 2 or any(
                isinstance(s, bool) or not isinstance(s, numbers.Integral) or s <= 0 for s in sizes):
            raise ValueError(f"MLP: mlp_sizes must be a list of at least two positive ints, got {mlp_sizes!r}")
        if not isinstance(activation, str) or activation not in _ACTIVATIONS:  # (a list is unhashable)
            raise TypeError(f"MLP: activation must be 'none', 'relu' or 'sigmoid', got {activation!r}")
        self.num_layers = len(sizes) - 1
        self.mlp_sizes = [int(s) for s in sizes]
        self.bias = 1 if bias else 0
        self.activation = _ACTIVATIONS[activation]
        self.weights: List[nn.Parameter] = []
        self.biases: List[nn.Parameter] = []
        for i in range(self.num_layers):
            w = nn.Parameter(torch.empty(self.mlp_sizes[i + 1], self.mlp_sizes[i]))
            setattr(self, f"weight_{i}", w)
            self.weights.append(w)
            if self.bias:
                b = nn.Parameter(torch.empty(self.mlp_sizes[i + 1]))
                setattr(self, f"bias_{i}", b)
                self.biases.append(b)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in self.weights:
            nn.init.normal_(w, 0.0, math.sqrt(2.0 / float(w.shape[0] + w.shape[1])))
        for b in self.biases:
            nn.init.normal_(b, 0.0, math.sqrt(1.0 / float(b.shape[0])))

    def _apply(self, fn, *args, **kwargs):
        # .to() / .half() / .cuda() replace the registered parameters; keep the two lists pointing at them
        out = super()._apply(fn, *args, **kwargs)
        self.weights = [getattr(self, f"weight_{i}") for i in range(self.num_layers)]
        self.biases = [getattr(self, f"bias_{i}") for i in range(self.num_layers)] if self.bias else []
        return out

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _layers(self.bias, self.activation, (input, *self.weights, *self.biases))

    def extra_repr(self) -> str:
        return f"MLP sizes: {self.mlp_sizes}, Bias={self.bias}, activation={self.activation}"
