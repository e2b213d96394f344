"""apex.mlp (NVIDIA Apex's MLP): nn.Sequential of Linear + activation is the reference, compared exactly (the same
torch ops run) for outputs and grads; autocast against the same layers run on the cast tensors."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

import apex
from apex.mlp import MLP, MlpFunction, mlp_function

SIZES = [12, 32, 16, 1]


def _reference(mlp, activation, bias):
    layers = []
    for i in range(mlp.num_layers):
        lin = nn.Linear(mlp.mlp_sizes[i], mlp.mlp_sizes[i + 1], bias=bias)
        with torch.no_grad():
            lin.weight.copy_(mlp.weights[i])
            if bias:
                lin.bias.copy_(mlp.biases[i])
        layers.append(lin)
        if activation == "relu":
            layers.append(nn.ReLU())
        elif activation == "sigmoid":
            layers.append(nn.Sigmoid())
    return nn.Sequential(*layers).to(mlp.weights[0].dtype)


@pytest.mark.parametrize("activation", ["none", "relu", "sigmoid"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_linear_layers(activation, bias, dtype):
    torch.manual_seed(0)
    mlp = MLP(SIZES, bias=bias, activation=activation).to(dtype)
    ref = _reference(mlp, activation, bias)
    x = torch.empty(7, SIZES[0]).uniform_(-1, 1).to(dtype).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    out, want = mlp(x), ref(xr)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out.mean().mul(10).backward()
    want.mean().mul(10).backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0)
    torch.testing.assert_close(mlp.weights[0].grad, ref[0].weight.grad, rtol=0, atol=0)
    if bias:
        torch.testing.assert_close(mlp.biases[-1].grad, [m for m in ref if isinstance(m, nn.Linear)][-1].bias.grad,
                                   rtol=0, atol=0)


def test_upstream_attributes_parameters_and_init():
    torch.manual_seed(0)
    sizes = [64, 256, 128]
    mlp = MLP(sizes)
    sizes.append(9)  # the module keeps its own copy
    assert (mlp.num_layers, mlp.mlp_sizes, mlp.bias, mlp.activation) == (2, [64, 256, 128], 1, 1)
    assert [n for n, _ in mlp.named_parameters()] == ["weight_0", "bias_0", "weight_1", "bias_1"]
    assert list(mlp.state_dict()) == ["weight_0", "bias_0", "weight_1", "bias_1"]
    assert mlp.weights[1] is mlp.weight_1 and mlp.biases[0] is mlp.bias_0
    assert repr(mlp) == "MLP(MLP sizes: [64, 256, 128], Bias=1, activation=1)"
    std_w = math.sqrt(2.0 / (256 + 64))
    assert abs(mlp.weight_0.std().item() - std_w) < 0.1 * std_w
    assert abs(mlp.bias_0.std().item() - math.sqrt(1 / 256)) < 0.2 * math.sqrt(1 / 256)
    nb = MLP([3, 4], bias=False, activation="none")
    assert (nb.bias, nb.activation, nb.biases) == (0, 0, []) and MLP([3, 4], activation="sigmoid").activation == 2
    mlp.to(torch.float64)  # the lists follow the registered parameters
    assert mlp.weights[0].dtype == torch.float64 and mlp.weights[0] is mlp.weight_0
    assert mlp(torch.randn(2, 64, dtype=torch.float64)).dtype == torch.float64


def test_functional_and_function_forms():
    torch.manual_seed(1)
    mlp = MLP([5, 6, 2], activation="sigmoid")
    x = torch.randn(3, 5)
    want = mlp(x)
    args = (x, *mlp.weights, *mlp.biases)
    torch.testing.assert_close(mlp_function(1, 2, *args), want, rtol=0, atol=0)
    torch.testing.assert_close(MlpFunction.apply(True, 2, *args), want, rtol=0, atol=0)
    assert inspect.getfullargspec(MlpFunction.forward).args == ["ctx", "bias", "activation"]
    assert apex.mlp.MLP is MLP  # lazy attribute of the package


def test_under_autocast_runs_in_the_autocast_dtype(device):
    device = torch.device(device)
    low = torch.float16 if device.type == "cuda" else torch.bfloat16
    torch.manual_seed(2)
    mlp = MLP([8, 16, 4]).to(device)
    x = torch.randn(5, 8, device=device)
    with torch.autocast(device.type, dtype=low):
        out = mlp(x)
    assert out.dtype == low
    with torch.no_grad():
        want = mlp_function(1, 1, x.to(low), *(w.to(low) for w in mlp.weights), *(b.to(low) for b in mlp.biases))
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=0)
    with torch.autocast(device.type, dtype=low):
        mlp(x).float().sum().backward()
    assert mlp.weight_0.grad.dtype == torch.float32


@pytest.mark.parametrize("call,exc,match", [
    (lambda: MLP([4]), ValueError, "at least two positive ints"),
    (lambda: MLP([4, 0]), ValueError, "at least two positive ints"),
    (lambda: MLP("48"), ValueError, "at least two positive ints"),
    (lambda: MLP([4, 2], activation="tanh"), TypeError, "activation must be 'none', 'relu' or 'sigmoid'"),
    (lambda: MLP([4, 2], activation=[]), TypeError, "activation must be 'none', 'relu' or 'sigmoid'"),
    (lambda: MLP([4, 2])(torch.randn(3, 5)), ValueError, r"weight 0 has shape \(2, 4\); expected \(out, 5\)"),
    (lambda: MLP([4, 2])(torch.ones(3, 4, dtype=torch.int64)), TypeError, "floating-point tensor"),
    (lambda: mlp_function(2, 1, torch.ones(1, 2), torch.ones(2, 2)), ValueError, "bias must be 0 or 1"),
    (lambda: mlp_function(iter([1]), 1, torch.ones(1, 2), torch.ones(2, 2)), TypeError,
     "bias must be 0 or 1 \\(or a bool\\), got list_iterator"),
    (lambda: mlp_function(0, 3, torch.ones(1, 2), torch.ones(2, 2)), ValueError, r"activation must be in \[0, 2\]"),
    (lambda: mlp_function(0, True, torch.ones(1, 2), torch.ones(2, 2)), TypeError, "activation must be an int"),
    (lambda: mlp_function(1, 1, torch.ones(1, 2), torch.ones(2, 2)), ValueError, "as many biases as weights"),
    (lambda: mlp_function(1, 1, torch.ones(1, 2), torch.ones(3, 2), torch.ones(2)), ValueError,
     r"bias 0 has shape \(2,\); expected \(3,\)"),
    (lambda: mlp_function(1, 1), TypeError, "expected the input"),
])
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
