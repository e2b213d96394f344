"""apex.contrib.layer_norm (NVIDIA Apex's FastLayerNorm / FastLayerNormFN).

References: torch's layer_norm, on the tensors as given when all share one dtype (torch computes half types in
float32 and rounds once) and on their float32 upcasts otherwise, rounded once to the weights' dtype (upstream's
output type); compared exactly, grads against autograd of the same reference. Plus a float64 reference with
tolerances of the output dtype (fp32 1e-5, bf16 2e-2, fp16 2e-3 relative).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.nn import functional as F

from apex.contrib.layer_norm import FastLayerNorm, FastLayerNormFN

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _reference(x, gamma, beta, eps):
    h = gamma.numel()
    if x.dtype == gamma.dtype == beta.dtype:
        return F.layer_norm(x, (h,), gamma, beta, eps)
    return F.layer_norm(x.float(), (h,), gamma.float(), beta.float(), eps).to(gamma.dtype)


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("itype", DTYPES)
@pytest.mark.parametrize("wtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 16), (2, 3, 33), (1, 1)])
def test_fn_matches_the_float32_reference_in_the_weight_dtype(itype, wtype, shape):
    torch.manual_seed(0)
    h = shape[-1]
    x = torch.randn(shape).to(itype).requires_grad_()
    gamma = (torch.randn(h) * 0.2 + 1).to(wtype).requires_grad_()
    beta = (torch.randn(h) * 0.2).to(wtype).requires_grad_()
    y = FastLayerNormFN.apply(x, gamma, beta, 1e-5)
    xr, gr, br = (t.detach().clone().requires_grad_() for t in (x, gamma, beta))
    want = _reference(xr, gr, br, 1e-5)
    assert y.dtype == wtype and y.shape == x.shape
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    exact = F.layer_norm(x.double(), (h,), gamma.double(), beta.double(), 1e-5)
    torch.testing.assert_close(y.double(), exact, rtol=TOL[wtype], atol=TOL[wtype])
    dz = torch.randn(shape).to(wtype)
    y.backward(dz)
    want.backward(dz)
    for got, ref in ((x, xr), (gamma, gr), (beta, br)):
        assert got.grad.dtype == got.dtype
        torch.testing.assert_close(got.grad, ref.grad, rtol=0, atol=0)


def test_module_defaults_memory_efficient_and_repr():
    m = FastLayerNorm(12, eps=1e-6, memory_efficient=True)
    assert torch.equal(m.weight, torch.ones(12)) and torch.equal(m.bias, torch.zeros(12))
    assert m.weight.dtype == torch.get_default_dtype() and m.epsilon == 1e-6 and m.memory_efficient
    x = torch.randn(5, 12)
    torch.testing.assert_close(m(x), F.layer_norm(x, (12,), eps=1e-6), rtol=0, atol=0)
    assert repr(m) == "FastLayerNorm(12, eps=1e-06, memory_efficient=True)"
    # memory_efficient changes nothing here, in forward or backward
    assert torch.equal(FastLayerNormFN.apply(x, m.weight, m.bias, 1e-6, True), m(x))


def test_forward_has_upstreams_arguments():
    assert inspect.getfullargspec(FastLayerNormFN.forward).args == ["ctx", "x", "gamma", "beta", "epsilon",
                                                                     "memory_efficient"]


def test_module_under_autocast_runs_in_the_autocast_dtype(device):
    device = torch.device(device)
    low = torch.float16 if device.type == "cuda" else torch.bfloat16
    torch.manual_seed(1)
    m = FastLayerNorm(16).to(device)
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
        m.bias.uniform_(-0.5, 0.5)
    x = torch.randn(4, 16, device=device)
    with torch.autocast(device.type, dtype=low):
        y = m(x)
        z = FastLayerNormFN.apply(x, m.weight, m.bias, 1e-5)  # apply takes the dtypes it is given
    assert y.dtype == low and z.dtype == torch.float32
    torch.testing.assert_close(y, _reference(x.to(low), m.weight.to(low), m.bias.to(low), 1e-5), rtol=0, atol=0)
    with torch.autocast(device.type, dtype=low):
        m(x).float().sum().backward()
    assert m.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("call,exc,match", [
    (lambda: FastLayerNormFN.apply(torch.ones(2, 4), torch.ones(4), torch.ones(3), 1e-5), ValueError,
     r"gamma \(torch.float32, shape \(4,\)\) and beta \(torch.float32, shape \(3,\)\)"),
    (lambda: FastLayerNormFN.apply(torch.ones(2, 4), torch.ones(4), torch.ones(4).bfloat16(), 1e-5), ValueError,
     "must have one dtype and shape"),
    (lambda: FastLayerNormFN.apply(torch.ones(2, 5), torch.ones(4), torch.ones(4), 1e-5), ValueError,
     r"input of shape \(2, 5\) does not end with normalized_shape \(4,\)"),
    (lambda: FastLayerNormFN.apply(torch.ones(2, 4), torch.ones(4), torch.ones(4), -1.0), ValueError, "eps"),
    (lambda: FastLayerNormFN.apply(torch.ones(2, 4), [1.0] * 4, torch.ones(4), 1e-5), TypeError,
     "gamma must be a tensor, got list"),
    (lambda: FastLayerNormFN.apply(torch.ones(2, 0), torch.ones(0), torch.ones(0), 1e-5), ValueError, "gamma is empty"),
    (lambda: FastLayerNormFN.apply(torch.ones(2, 4, dtype=torch.int64), torch.ones(4), torch.ones(4), 1e-5),
     TypeError, "floating-point"),
    (lambda: FastLayerNorm(0), ValueError, "hidden_size must be >= 1, got 0"),
    (lambda: FastLayerNorm(True), TypeError, "hidden_size must be an int, got True"),
    (lambda: FastLayerNorm(8.0), TypeError, "hidden_size must be an int, got 8.0"),
    (lambda: FastLayerNorm(8, eps=float("nan")), ValueError, "eps must be a number >= 0"),
])
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("which", ["gamma", "beta"])
def test_sparse_weights_are_refused_by_name(which):
    x, gamma, beta = torch.randn(2, 4), torch.ones(4), torch.zeros(4)
    args = {"gamma": gamma, "beta": beta}
    args[which] = args[which].to_sparse()
    with pytest.raises(TypeError, match=rf"FastLayerNormFN: {which} must be a dense \(strided\) tensor, got layout "
                                        "torch.sparse_coo"):
        FastLayerNormFN.apply(x, args["gamma"], args["beta"], 1e-5)
    assert torch.equal(gamma, torch.ones(4)) and torch.equal(beta, torch.zeros(4))


@pytest.mark.parametrize("size,match", [
    (2**63, "9223372036854775808 elements, more than a tensor holds"),
    (2**62, "18446744073709551616 bytes of torch.float32, more than a tensor holds"),
])
def test_hidden_sizes_no_tensor_can_have_are_refused_by_name(size, match):
    with pytest.raises(ValueError, match=f"FastLayerNorm: hidden_size is {size}: {match}"):
        FastLayerNorm(size)
