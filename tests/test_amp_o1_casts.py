"""amp.init's O1 cast rules on CPU: which functions run in half, which in float32, which promote, which are
banned, in-place rules, RNNs, and that deactivation puts torch back exactly as it was."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from apex import amp

B, H, C, K, T = 4, 8, 4, 3, 3  # tiny sizes: the rules, not the kernels, are under test
LOWS = (torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def _env(amp_env):
    yield


@pytest.fixture(params=LOWS, ids=["fp16", "bf16"])
def low(request):
    handle = amp.init(enabled=True, patch_type=request.param)
    yield request.param
    handle._deactivate()


def always(dtype):
    return {torch.float32: dtype, torch.float16: dtype, torch.bfloat16: dtype}


def check(fns, expected, shape, low, backward=True):
    """Each fn on an input of each dtype in (fp32, low): output dtype as expected, input grad in the input dtype."""
    for fn, in_dtype in itertools.product(fns, (torch.float32, low)):
        x = torch.randn(shape, dtype=in_dtype).requires_grad_()
        y = fn(x)
        want = expected[in_dtype] if isinstance(expected, dict) else in_dtype
        assert y.dtype == want, (fn, in_dtype, y.dtype)
        if backward:
            y.float().sum().backward()
            assert x.grad.dtype == in_dtype


MATCH = None  # output dtype = input dtype


def test_linear_and_conv_are_half(low):
    lin = nn.Linear(H, H)
    check([lin, functools.partial(F.linear, weight=lin.weight, bias=lin.bias)], always(low), (B, H), low)
    conv = nn.Conv2d(C, C, K)
    check([conv, functools.partial(F.conv2d, weight=conv.weight, bias=conv.bias)], always(low), (B, C, H, H), low)


def test_float_functions(low):
    f32 = always(torch.float32)
    check([nn.Softmax(dim=1), functools.partial(F.softmax, dim=1)], f32, (B, H), low)
    check([nn.GroupNorm(2, C)], f32, (B, C, H, H), low)
    target = torch.randn(B, H)
    mse = nn.MSELoss()
    check([lambda x: mse(x, target), functools.partial(F.mse_loss, target=target)], f32, (B, H), low)
    check([lambda x: x.pow(2.0), lambda x: x**2.0, lambda x: torch.pow(x, 2.0), lambda x: x.sum(),
           lambda x: torch.exp(x), lambda x: x.norm()], f32, (B, H), low)


def test_match_input_functions(low):
    check([nn.ReLU(), F.relu], MATCH, (B, H), low)
    bn = nn.BatchNorm2d(C)
    check([bn], MATCH, (B, C, H, H), low)
    bn.eval()
    f = functools.partial(F.batch_norm, running_mean=bn.running_mean, running_var=bn.running_var,
                          weight=bn.weight, bias=bn.bias, training=False)
    check([bn, f], MATCH, (B, C, H, H), low, backward=False)


def test_matmul_method_and_operator_are_half(low):
    other = torch.randn(H, H)
    check([lambda x: x.matmul(other), lambda x: other.matmul(x), lambda x: x @ other, lambda x: other @ x,
           lambda x: torch.mm(x, other)], always(low), (H, H), low)


def test_cpu_transfer_is_float(low):
    check([lambda x: x.cpu()], always(torch.float32), (B, H), low)


def test_float64_is_left_alone(low):
    lin = nn.Linear(H, H).double()
    assert lin(torch.randn(B, H, dtype=torch.float64)).dtype == torch.float64
    assert torch.randn(B, dtype=torch.float64).sum().dtype == torch.float64


@pytest.mark.parametrize("fn", [lambda x, y: torch.atan2(x, y), lambda x, y: x.atan2(y), lambda x, y: torch.mul(x, y),
                                lambda x, y: x.mul(y), lambda x, y: torch.addcmul(x, x, y),
                                lambda x, y: torch.dot(x, y)])
def test_promote_to_widest(low, fn):
    for xt, yt in itertools.product((torch.float32, low), repeat=2):
        x = torch.randn(B, dtype=xt).requires_grad_()
        y = torch.randn(B, dtype=yt)
        out = fn(x, y)
        assert out.dtype == (torch.float32 if torch.float32 in (xt, yt) else low)
        out.float().sum().backward()
        assert x.grad.dtype == xt


def test_inplace_promote_keeps_self_dtype(low):
    for xt, yt in itertools.product((torch.float32, low), repeat=2):
        leaf = torch.randn(B, dtype=xt).requires_grad_()
        x = leaf.clone()
        out = x.add_(torch.randn(B, dtype=yt))
        assert out.dtype == xt
        out.float().sum().backward()
        assert leaf.grad.dtype == xt


def test_cat_and_stack_match_widest(low):
    ys = [torch.randn(B, dtype=low) for _ in range(3)]
    assert torch.cat([*ys, torch.randn(B)]).dtype == torch.float32
    assert torch.cat([*ys, torch.randn(B, dtype=low)]).dtype == low
    assert torch.stack([*ys, torch.randn(B)]).dtype == torch.float32


def test_inplace_float_function_on_low_precision_raises(low):
    x = torch.randn(B)
    x.exp_()
    assert x.dtype == torch.float32
    with pytest.raises(NotImplementedError, match="exp_"):
        torch.randn(B, dtype=low).exp_()
    y = torch.randn(B, dtype=low)
    with pytest.raises(NotImplementedError, match="__ipow__"):
        y **= 2


def test_binary_cross_entropy_is_banned():
    handle = amp.init()
    target = torch.rand(B, H)
    bce = nn.BCELoss()
    for fn in (lambda x: bce(x, target), functools.partial(F.binary_cross_entropy, target=target)):
        with pytest.raises(NotImplementedError, match="allow_banned=True"):
            fn(torch.rand(B, H, dtype=torch.float16))
    handle._deactivate()
    handle = amp.init(allow_banned=True)
    for fn in (lambda x: bce(x, target), functools.partial(F.binary_cross_entropy, target=target)):
        x = torch.rand(B, H, dtype=torch.float16)
        out = fn(x)
        assert out.dtype == torch.float32
        with amp.disable_casts():
            ref = F.binary_cross_entropy(x.double(), target.double())
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    handle._deactivate()


@pytest.mark.parametrize("cell_cls,tuple_state", [(nn.RNNCell, False), (nn.GRUCell, False), (nn.LSTMCell, True)])
def test_rnn_cells_are_half(low, cell_cls, tuple_state):
    cell = cell_cls(H, H)
    for dtype in (torch.float32, low):
        xs = [torch.randn(B, H, dtype=dtype).requires_grad_() for _ in range(T)]
        hidden = torch.zeros(B, H, dtype=dtype)
        if tuple_state:
            hidden = (hidden, hidden.clone())
        outs = []
        for x in xs:
            hidden = cell(x, hidden)
            outs.append(hidden[0] if tuple_state else hidden)
        assert all(o.dtype == low for o in outs)
        outs[-1].float().sum().backward()
        assert all(x.grad.dtype == dtype for x in xs)
    assert cell.weight_ih.grad.dtype == torch.float32


@pytest.mark.parametrize("kind", ["rnn", "gru", "lstm"])
@pytest.mark.parametrize("layers,bidir", [(1, False), (2, True)])
def test_rnns_are_half(low, kind, layers, bidir):
    if kind == "rnn":
        rnn = nn.RNN(H, H, num_layers=layers, nonlinearity="relu", bidirectional=bidir)
    else:
        rnn = {"gru": nn.GRU, "lstm": nn.LSTM}[kind](H, H, num_layers=layers, bidirectional=bidir)
    for dtype in (torch.float32, low):
        x = torch.randn(T, B, H, dtype=dtype).requires_grad_()
        h0 = torch.zeros(layers * (2 if bidir else 1), B, H, dtype=dtype)
        out, _ = rnn(x, (h0, h0.clone()) if kind == "lstm" else h0)
        assert out.dtype == low
        out[-1].float().sum().backward()
        assert x.grad.dtype == dtype


def test_rnn_packed_sequence_is_half(low):
    rnn = nn.RNN(H, H, num_layers=2)
    for dtype in (torch.float32, low):
        x = torch.randn(T, B, H, dtype=dtype).requires_grad_()
        lens = torch.tensor(sorted([T, T - 1, 2, 1][:B], reverse=True))
        packed = nn.utils.rnn.pack_padded_sequence(x, lens)
        out, _ = rnn(packed, torch.zeros(2, B, H, dtype=dtype))
        assert out.data.dtype == low
        out.data.float().sum().backward()
        assert x.grad.dtype == dtype


def test_rnn_shape_check_still_runs(low):
    rnn = nn.LSTM(H, H)
    with pytest.raises(RuntimeError, match=r"input\.size"):
        rnn(torch.randn(T, B, H + 1, dtype=low))


def test_disable_casts_passes_through(low):
    x = torch.randn(B, H)
    w = torch.randn(H, H)
    with amp.disable_casts():
        assert F.linear(x, w).dtype == torch.float32
        assert torch.randn(B, dtype=low).sum().dtype == low
    assert F.linear(x, w).dtype == low


def test_deactivate_restores_torch_exactly():
    import torch.nn.modules.rnn as rnn_mod

    before_tensor = dict(vars(torch.Tensor))
    before_torch = {n: getattr(torch, n) for n in ("mm", "sum", "cat", "addcmul")}
    before_f = {n: getattr(F, n) for n in ("linear", "softmax", "binary_cross_entropy")}
    before_vf = set(vars(torch._VF))
    before_check = rnn_mod.RNNBase.__dict__["check_input"]
    handle = amp.init()
    assert handle.is_active()
    assert F.linear is not before_f["linear"]
    handle._deactivate()
    handle._deactivate()  # twice is harmless
    assert not handle.is_active()
    assert dict(vars(torch.Tensor)) == before_tensor
    assert {n: getattr(torch, n) for n in before_torch} == before_torch
    assert {n: getattr(F, n) for n in before_f} == before_f
    assert set(vars(torch._VF)) == before_vf
    assert rnn_mod.RNNBase.__dict__["check_input"] is before_check
    assert torch.randn(B, dtype=torch.float16).sum().dtype == torch.float16


def test_second_init_replaces_the_first():
    first = amp.init()
    second = amp.init(patch_type=torch.bfloat16)
    assert not first.is_active() and second.is_active()
    assert F.linear(torch.randn(B, H), torch.randn(H, H)).dtype == torch.bfloat16
    second._deactivate()
    assert F.linear(torch.randn(B, H), torch.randn(H, H)).dtype == torch.float32


def test_registered_and_decorated_functions_cast_under_init():
    import types

    ns = types.SimpleNamespace(f=lambda x: x * 1)
    amp.register_float_function(ns, "f")

    @amp.half_function
    def g(x):
        return x

    handle = amp.init()
    try:
        assert ns.f(torch.randn(B, dtype=torch.float16)).dtype == torch.float32
        assert g(torch.randn(B)).dtype == torch.float16
    finally:
        handle._deactivate()
        from apex.amp import _casts

        _casts._USER_CAST_REGISTRY.pop((id(ns), "f"), None)
    assert g(torch.randn(B)).dtype == torch.float32
    assert getattr(ns.f, "_apex_amp_patch_of", None) is None


def test_linear_values_match_a_half_reference():
    handle = amp.init()
    lin = nn.Linear(H, H)
    x = torch.randn(B, H)
    out = lin(x)
    handle._deactivate()
    ref = F.linear(x.half(), lin.weight.detach().half(), lin.bias.detach().half())
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(out.double(), F.linear(x.double(), lin.weight.double(), lin.bias.double())
                               .detach(), rtol=1e-2, atol=1e-2)
