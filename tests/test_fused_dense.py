"""apex.fused_dense (NVIDIA Apex's FusedDense / FusedDenseGeluDense) and apex._autocast_utils.

References: nn.Linear (and nn.Linear -> tanh GELU -> nn.Linear) with the same parameters, compared exactly (the
same torch ops run) for outputs and every grad; the float64 math written from the formulas (GELU's tanh form:
0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))) with per-dtype tolerances; the autocast rule against the same
layers run on the cast tensors with autocast off, exactly."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import apex
from apex._autocast_utils import _cast_if_autocast_enabled, _get_autocast_dtypes, _get_current_dtype
from apex.fused_dense import (
    DenseNoBiasFunc,
    FusedDense,
    FusedDenseFunc,
    FusedDenseGeluDense,
    FusedDenseGeluDenseFunc,
)
from apex.fused_dense.fused_dense import _dense_no_bias, _fused_dense, _fused_dense_gelu_dense

# float64 reference against each storage dtype: a K-term dot product in that dtype's precision (K <= 64 here)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
       torch.float16: dict(rtol=4e-3, atol=4e-3)}
DTYPES = list(TOL)


def _low(device: str) -> torch.dtype:
    return torch.float16 if device == "cuda" else torch.bfloat16


def _gelu_tanh64(h: torch.Tensor) -> torch.Tensor:
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))


def _linear_twin(dense: FusedDense) -> nn.Linear:
    lin = nn.Linear(dense.in_features, dense.out_features, bias=dense.bias is not None,
                    device=dense.weight.device, dtype=dense.weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(dense.weight)
        if dense.bias is not None:
            lin.bias.copy_(dense.bias)
    return lin


def _grads(module: nn.Module):
    return [p.grad for p in module.parameters()]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 12), (2, 3, 12), (12,), (0, 12)])
def test_dense_is_linear(device, dtype, bias, shape):
    torch.manual_seed(0)
    dense = FusedDense(12, 5, bias=bias).to(device, dtype)
    lin = _linear_twin(dense)
    x = torch.empty(shape, device=device).uniform_(-1, 1).to(dtype).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    out, want = dense(x), lin(xr)
    assert out.shape == (*shape[:-1], 5) and out.dtype == dtype
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    dy = torch.randn_like(out)
    out.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0)
    for g, r in zip(_grads(dense), _grads(lin)):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_against_float64(device, dtype):
    # NVIDIA's own check: y = x W^T + b, dW = dy^T x, dx = dy W, db = sum(dy), here against float64
    torch.manual_seed(1)
    dense = FusedDense(64, 48).to(device, dtype)
    x = torch.randn(33, 64, device=device).to(dtype).requires_grad_()
    y = dense(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, w64, b64, dy64 = (t.detach().double() for t in (x, dense.weight, dense.bias, dy))
    tol = TOL[dtype]
    torch.testing.assert_close(y.double(), x64 @ w64.t() + b64, **tol)
    torch.testing.assert_close(dense.weight.grad.double(), dy64.t() @ x64, **tol)
    torch.testing.assert_close(x.grad.double(), dy64 @ w64, **tol)
    torch.testing.assert_close(dense.bias.grad.double(), dy64.sum(0), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_dense_gelu_dense_is_linear_tanh_gelu_linear(device, dtype, bias):
    torch.manual_seed(2)
    block = FusedDenseGeluDense(10, 24, 6, bias=bias).to(device, dtype)
    first = nn.Linear(10, 24, bias=bias, device=device, dtype=dtype)
    second = nn.Linear(24, 6, bias=bias, device=device, dtype=dtype)
    with torch.no_grad():
        first.weight.copy_(block.weight1)
        second.weight.copy_(block.weight2)
        if bias:
            first.bias.copy_(block.bias1)
            second.bias.copy_(block.bias2)
    x = torch.randn(4, 3, 10, device=device).to(dtype).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    out = block(x)
    want = second(F.gelu(first(xr), approximate="tanh"))
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    dy = torch.randn_like(out)
    out.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0)
    pairs = [(block.weight1, first.weight), (block.weight2, second.weight)]
    if bias:
        pairs += [(block.bias1, first.bias), (block.bias2, second.bias)]
    for p, r in pairs:
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_gelu_dense_against_float64(device, dtype):
    torch.manual_seed(3)
    block = FusedDenseGeluDense(32, 64, 16).to(device, dtype)
    x = torch.randn(20, 32, device=device).to(dtype).requires_grad_()
    y = block(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    params64 = [p.detach().double().requires_grad_() for p in (block.weight1, block.bias1, block.weight2, block.bias2)]
    x64 = x.detach().double().requires_grad_()
    w1, b1, w2, b2 = params64
    y64 = _gelu_tanh64(x64 @ w1.t() + b1) @ w2.t() + b2
    y64.backward(dy.double())
    tol = TOL[dtype]
    torch.testing.assert_close(y.double(), y64.detach(), **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    for p, r in zip((block.weight1, block.bias1, block.weight2, block.bias2), params64):
        torch.testing.assert_close(p.grad.double(), r.grad, **tol)


def test_gelu_is_the_tanh_approximation():
    # cuBLASLt's GELU epilogue (upstream's kernel) is the tanh form; the erf form differs by up to ~5e-4 near |h|=2
    torch.manual_seed(4)
    w1 = torch.eye(8, dtype=torch.float64)
    w2 = torch.eye(8, dtype=torch.float64)
    x = torch.linspace(-4, 4, 64, dtype=torch.float64).reshape(8, 8)
    out = FusedDenseGeluDenseFunc.apply(x, w1, None, w2, None)
    torch.testing.assert_close(out, _gelu_tanh64(x), rtol=1e-12, atol=1e-12)
    assert (out - F.gelu(x)).abs().max() > 1e-4


def test_gradcheck_float64():
    torch.manual_seed(5)
    args = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in [(3, 4), (5, 4), (5,), (2, 5), (2,)]]
    assert torch.autograd.gradcheck(lambda *a: FusedDenseGeluDenseFunc.apply(*a), args)
    assert torch.autograd.gradcheck(lambda *a: FusedDenseFunc.apply(*a), args[:3])
    assert torch.autograd.gradcheck(lambda *a: DenseNoBiasFunc.apply(*a), args[:2])


def test_upstream_names_and_forms():
    torch.manual_seed(6)
    dense = FusedDense(6, 4)
    x = torch.randn(3, 6)
    want = F.linear(x, dense.weight, dense.bias)
    for out in (FusedDenseFunc.apply(x, dense.weight, dense.bias), _fused_dense(x, dense.weight, dense.bias)):
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    for out in (DenseNoBiasFunc.apply(x, dense.weight), _dense_no_bias(x, dense.weight)):
        torch.testing.assert_close(out, F.linear(x, dense.weight), rtol=0, atol=0)
    block = FusedDenseGeluDense(6, 8, 2)
    ps = (block.weight1, block.bias1, block.weight2, block.bias2)
    torch.testing.assert_close(_fused_dense_gelu_dense(x, *ps), block(x), rtol=0, atol=0)
    assert inspect.getfullargspec(FusedDenseFunc.forward).args == ["ctx", "input", "weight", "bias"]
    assert inspect.getfullargspec(FusedDenseGeluDenseFunc.forward).args == [
        "ctx", "input", "weight1", "bias1", "weight2", "bias2"]
    assert list(dense.state_dict()) == ["weight", "bias"]
    assert list(block.state_dict()) == ["weight1", "bias1", "weight2", "bias2"]
    assert list(FusedDense(6, 4, bias=False).state_dict()) == ["weight"]
    assert (block.in_features, block.intermediate_features, block.out_features) == (6, 8, 2)
    assert apex.fused_dense.FusedDense is FusedDense  # lazy attribute of the package
    assert "fused_dense" in dir(apex)


def test_initialisation_is_nn_linear():
    # same seed, same draws: nn.Linear's kaiming-uniform weight, then its bias bound 1/sqrt(in_features)
    torch.manual_seed(7)
    dense = FusedDense(20, 9)
    torch.manual_seed(7)
    lin = nn.Linear(20, 9)
    torch.testing.assert_close(dense.weight, lin.weight, rtol=0, atol=0)
    torch.testing.assert_close(dense.bias, lin.bias, rtol=0, atol=0)
    torch.manual_seed(8)
    block = FusedDenseGeluDense(20, 9, 3)
    torch.manual_seed(8)
    w1 = nn.Linear(20, 9).weight
    torch.manual_seed(8)
    nn.Linear(20, 9)
    second = nn.Linear(9, 3)
    torch.testing.assert_close(block.weight1, w1, rtol=0, atol=0)
    torch.testing.assert_close(block.weight2, second.weight, rtol=0, atol=0)
    assert FusedDense(3, 2, dtype=torch.bfloat16).weight.dtype == torch.bfloat16


def test_under_autocast_runs_in_the_autocast_dtype(device):
    low = _low(device)
    torch.manual_seed(9)
    dense = FusedDense(8, 16).to(device)
    block = FusedDenseGeluDense(16, 32, 4).to(device)
    x = torch.randn(5, 8, device=device)
    with torch.autocast(device, dtype=low):
        h = dense(x)
        out = block(h)
    assert (h.dtype, out.dtype) == (low, low)
    with torch.no_grad():
        want_h = F.linear(x.to(low), dense.weight.to(low), dense.bias.to(low))
        want = FusedDenseGeluDenseFunc.apply(want_h, *(p.to(low) for p in block.parameters()))
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=0)
    with torch.autocast(device, dtype=low):
        block(dense(x)).float().sum().backward()
    assert dense.weight.grad.dtype == torch.float32 and block.bias2.grad.dtype == torch.float32
    # the Function forms never cast: fp32 in, fp32 out, the same bits as outside autocast
    with torch.autocast(device, dtype=low):
        kept = FusedDenseFunc.apply(x, dense.weight, dense.bias)
    assert kept.dtype == torch.float32
    torch.testing.assert_close(kept, FusedDenseFunc.apply(x, dense.weight, dense.bias), rtol=0, atol=0)


def test_script_style_cast_then_function(device):
    # what model code written against upstream does: view to 2-D, cast under autocast, run the Function with
    # autocast off, view back
    low = _low(device)
    torch.manual_seed(10)
    block = FusedDenseGeluDense(8, 16, 8).to(device)
    x = torch.randn(2, 3, 8, device=device)
    with torch.autocast(device, dtype=low):
        args = _cast_if_autocast_enabled(x.view(6, 8), block.weight1, block.bias1, block.weight2, block.bias2)
        with torch.autocast(device, enabled=False):
            out = FusedDenseGeluDenseFunc.apply(*args).view(2, 3, -1)
        want = block(x)
    assert out.dtype == low
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_amp_trains_it_like_nn_linear(amp_env, opt_level):
    # a model of FusedDense / FusedDenseGeluDense under amp steps bit for bit like the same model of nn.Linear
    from apex import amp

    def build(kind):
        torch.manual_seed(11)
        if kind == "fused":
            return nn.Sequential(FusedDense(12, 16), nn.ReLU(), FusedDenseGeluDense(16, 24, 4))
        lin1 = nn.Linear(12, 16)
        first, second = nn.Linear(16, 24), nn.Linear(24, 4)

        class GeluBlock(nn.Module):
            def __init__(self):
                super().__init__()
                self.first, self.second = first, second

            def forward(self, x):
                return self.second(F.gelu(self.first(x), approximate="tanh"))

        return nn.Sequential(lin1, nn.ReLU(), GeluBlock())

    results = []
    for kind in ("fused", "linear"):
        model = build(kind)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
        torch.manual_seed(12)
        for _ in range(3):
            x, target = torch.randn(8, 12), torch.randn(8, 4)
            loss = F.mse_loss(model(x).float(), target)
            opt.zero_grad()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        results.append([p.detach().clone() for p in amp.master_params(opt)])
        amp.deinitialize()
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: FusedDense(4, 2)(torch.randn(3, 5)), ValueError,
     r"FusedDense: the input's last dimension is 5, but weight has shape \(2, 4\), which takes 4 features"),
    (lambda: FusedDense(4, 2)(torch.ones(3, 4, dtype=torch.int64)), TypeError, "input must be a floating-point"),
    (lambda: FusedDense(4, 2)(torch.tensor(1.0)), ValueError, "at least one dimension"),
    (lambda: FusedDense(4, 2)([1.0] * 4), TypeError, "input must be a tensor, got list"),
    (lambda: FusedDense(4, 2)(torch.randn(3, 4, dtype=torch.float64)), TypeError,
     r"weight must have the input's dtype and device \(torch.float64 on cpu\), got torch.float32 on cpu"),
    (lambda: FusedDense(0, 2), ValueError, "in_features must be >= 1, got 0"),
    (lambda: FusedDense(4, 2.5), TypeError, "out_features must be an int"),
    (lambda: FusedDense(True, 2), TypeError, "in_features must be an int, got True"),
    (lambda: FusedDenseGeluDense(4, -1, 2), ValueError, "intermediate_features must be >= 1"),
    (lambda: FusedDenseFunc.apply(torch.randn(2, 4), torch.randn(4), None), ValueError,
     r"weight must be 2-D \(out_features, in_features\), got shape \(4,\)"),
    (lambda: FusedDenseFunc.apply(torch.randn(2, 4), torch.randn(3, 4), torch.randn(4)), ValueError,
     r"bias must have shape \(3,\), got \(4,\)"),
    (lambda: FusedDenseFunc.apply(torch.randn(2, 4), torch.randn(3, 4), "b"), TypeError, "bias must be a tensor"),
    (lambda: FusedDenseFunc.apply(torch.randn(2, 4).half(), torch.randn(3, 4), None), TypeError,
     "weight must have the input's dtype"),
    (lambda: FusedDenseGeluDenseFunc.apply(torch.randn(2, 4), torch.randn(8, 4), None, torch.randn(3, 7), None),
     ValueError, r"weight2 must have shape \(out_features, 8\), got \(3, 7\)"),
    (lambda: FusedDenseGeluDenseFunc.apply(torch.randn(2, 4), torch.randn(8, 4), torch.randn(7), torch.randn(3, 8),
                                           None), ValueError, r"bias1 must have shape \(8,\), got \(7,\)"),
    (lambda: DenseNoBiasFunc.apply(torch.randn(2, 4), torch.ones(3, 4, dtype=torch.int32)), TypeError,
     "weight must be a floating-point tensor"),
])
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_bad_call_leaves_the_module_unchanged():
    torch.manual_seed(13)
    block = FusedDenseGeluDense(4, 6, 2)
    before = {k: v.clone() for k, v in block.state_dict().items()}
    with pytest.raises(ValueError):
        block(torch.randn(3, 5, requires_grad=True))
    for k, v in block.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert all(p.grad is None for p in block.parameters())


SETTINGS = settings(max_examples=40, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
dims = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@SETTINGS
@given(x_shape=dims, w_shape=dims, b_shape=st.one_of(st.none(), dims),
       dtypes=st.tuples(*[st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64])] * 3))
def test_any_shapes_give_linear_or_a_documented_error(x_shape, w_shape, b_shape, dtypes):
    def make(shape, dtype):
        return torch.ones(shape, dtype=dtype) if dtype == torch.int64 else torch.randn(shape).to(dtype)

    x, w = make(x_shape, dtypes[0]), make(w_shape, dtypes[1])
    b = None if b_shape is None else make(b_shape, dtypes[2])
    try:
        out = FusedDenseFunc.apply(x, w, b)
    except (TypeError, ValueError):
        return
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=0, atol=0)


# ---------------------------------------------------------------- apex._autocast_utils


def test_cast_if_autocast_enabled(device):
    low = _low(device)
    x = torch.randn(3, device=device)
    d = torch.randn(2, device=device, dtype=torch.float64)
    i = torch.arange(3, device=device)
    args = (x, [x, (d, i)], {"k": x}, None, 2.5, "s")
    same = _cast_if_autocast_enabled(*args)
    assert isinstance(same, tuple) and all(a is b for a, b in zip(same, args))
    with torch.autocast(device, dtype=low):
        cast = _cast_if_autocast_enabled(*args)
        assert _get_current_dtype() == (low if device == apex._device.detect_device() else torch.float32)
    assert cast[0].dtype == low and cast[1][0].dtype == low and cast[2]["k"].dtype == low
    assert cast[1][1][0] is d and cast[1][1][1] is i and cast[3:] == (None, 2.5, "s")
    assert isinstance(cast[1], list) and isinstance(cast[1][1], tuple)
    torch.testing.assert_close(cast[0], x.to(low), rtol=0, atol=0)


def test_autocast_dtypes_and_current_dtype():
    assert _get_current_dtype() == torch.float32
    assert _get_current_dtype(torch.float16) == torch.float32  # upstream ignores the argument
    dtypes = _get_autocast_dtypes()
    assert dtypes[0] == torch.half and set(dtypes) <= {torch.half, torch.bfloat16}
    if apex._device.detect_device() == "cpu":
        assert dtypes == [torch.half, torch.bfloat16]
