"""apex.contrib.group_norm (NVIDIA Apex's GroupNorm with optional SiLU): against F.group_norm (+ F.silu) in
float64 on the same (rounded) input and parameters, with one rounding to the input's dtype allowed; float32 in and
out without SiLU against torch's own group norm, bitwise; what the backward keeps."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn import functional as F

from apex.contrib.group_norm import GroupNorm
from apex.contrib.group_norm.group_norm import (
    cuda_group_norm_nhwc_one_pass,
    cuda_group_norm_nhwc_two_pass,
    cuda_group_norm_v2_nhwc,
    torch_group_norm,
)

LOW = (torch.float16, torch.bfloat16)
# output rounded once to the input's dtype: half an ulp of values up to ~4 (bf16: 2^-8 relative), grads the same
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def _reference64(x, groups, weight, bias, eps, act):
    # contiguous: torch's decomposition of group norm, which backends without a kernel of their own run (the
    # emulated npu), cannot take channels-last input
    x64 = x.detach().double().contiguous().requires_grad_()
    w64 = None if weight is None else weight.detach().double().requires_grad_()
    b64 = None if bias is None else bias.detach().double().requires_grad_()
    y = F.group_norm(x64, groups, w64, b64, eps)
    return (F.silu(y) if act else y), x64, w64, b64


def _data(shape, xdtype, wdtype, device, channels_last):
    x = (-2.3 + 0.5 * torch.randn(shape)).to(xdtype).to(device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = torch.rand(shape[1], dtype=wdtype, device=device)
    b = torch.rand(shape[1], dtype=wdtype, device=device)
    return x.requires_grad_(), w.requires_grad_(), b.requires_grad_()


@pytest.mark.parametrize("xdtype", [torch.float32, *LOW])
@pytest.mark.parametrize("wdtype", [torch.float32, *LOW])
@pytest.mark.parametrize("act", ["", "swish"])
@pytest.mark.parametrize("channels_last", [True, False])
def test_against_float64(device, xdtype, wdtype, act, channels_last):
    torch.manual_seed(0)
    x, w, b = _data((3, 64, 5, 7), xdtype, wdtype, device, channels_last)
    y = cuda_group_norm_nhwc_one_pass(x, 16, w, b, 1e-5, act)
    assert y.dtype == xdtype and y.shape == x.shape
    assert y.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    want, x64, w64, b64 = _reference64(x, 16, w, b, 1e-5, act)
    torch.testing.assert_close(y.double(), want.detach(), **TOL[xdtype])
    dy = (0.1 * torch.randn(x.shape)).to(xdtype).to(device)
    y.backward(dy)
    want.backward(dy.double())
    assert (x.grad.dtype, w.grad.dtype, b.grad.dtype) == (xdtype, wdtype, wdtype)
    torch.testing.assert_close(x.grad.double(), x64.grad, **TOL[xdtype])
    # weight / bias grads sum 3 x 35 terms per channel, each rounded once in the parameters' dtype
    torch.testing.assert_close(w.grad.double(), w64.grad, **TOL[wdtype])
    torch.testing.assert_close(b.grad.double(), b64.grad, **TOL[wdtype])


@pytest.mark.parametrize("shape", [(4, 12), (2, 12, 9), (2, 12, 3, 4), (2, 12, 2, 3, 2), (0, 12, 3)])
def test_float32_is_torch_group_norm(device, shape):
    torch.manual_seed(1)
    x, w, b = _data(shape, torch.float32, torch.float32, device, False)
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = GroupNorm(3, 12, device=device)
    with torch.no_grad():
        y.weight.copy_(w)
        y.bias.copy_(b)
    out, want = y(x), F.group_norm(xr, 3, wr, br, 1e-5)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    dy = torch.randn_like(out)
    out.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0)
    torch.testing.assert_close(y.weight.grad, wr.grad, rtol=0, atol=0)
    torch.testing.assert_close(y.bias.grad, br.grad, rtol=0, atol=0)


def test_without_affine_and_other_forms(device):
    torch.manual_seed(2)
    x = torch.randn(2, 8, 6, device=device, requires_grad=True)
    gn = GroupNorm(4, 8, affine=False, act="SiLU")
    assert gn.weight is None and gn.act == "silu" and list(gn.state_dict()) == []
    out = gn(x)
    want, x64, _, _ = _reference64(x, 4, None, None, 1e-5, "silu")
    torch.testing.assert_close(out.double(), want.detach(), **TOL[torch.float32])
    out.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, **TOL[torch.float32])
    w, b = torch.rand(8, device=device), torch.rand(8, device=device)
    forms = [torch_group_norm, cuda_group_norm_nhwc_one_pass, cuda_group_norm_nhwc_two_pass, cuda_group_norm_v2_nhwc]
    outs = [f(x.detach(), 2, w, b, 1e-3, "swish") for f in forms]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=0, atol=0)


def test_module_defaults_and_repr():
    gn = GroupNorm(32, 320, act="swish", dtype=torch.float16)
    assert (gn.num_groups, gn.num_channels, gn.eps, gn.affine, gn.act) == (32, 320, 1e-5, True, "swish")
    assert gn.weight.dtype == torch.float16 and bool((gn.weight == 1).all()) and not gn.bias.any()
    assert list(gn.state_dict()) == ["weight", "bias"]
    assert repr(gn) == "GroupNorm(32, 320, eps=1e-05, affine=True, act=swish)"
    assert repr(GroupNorm(2, 4)) == "GroupNorm(2, 4, eps=1e-05, affine=True)"


def test_backward_keeps_the_input_in_its_dtype():
    # upstream's kernel kept x (fp16) and per-group statistics, not a float32 copy of x
    torch.manual_seed(3)
    x = torch.randn(2, 64, 8, 8, dtype=torch.float16, requires_grad=True)
    gn = GroupNorm(16, 64, act="silu")
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = gn(x)
    assert not [s for s in saved if s[0] != torch.float16 and s[1] >= x.numel()], saved
    out.float().sum().backward()
    assert x.grad.dtype == torch.float16 and torch.isfinite(x.grad).all()


def test_compiles_to_one_graph():
    torch._dynamo.reset()
    model = torch.nn.Sequential(GroupNorm(4, 16, act="silu"), torch.nn.Conv2d(16, 16, 3, padding=1))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 16, 6, 6).to(memory_format=torch.channels_last).requires_grad_()
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, model(x), rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize("call,exc,match", [
    (lambda: GroupNorm(3, 8), ValueError, "num_channels must be divisible by num_groups, got 8 and 3"),
    (lambda: GroupNorm(0, 8), ValueError, "num_groups must be >= 1"),
    (lambda: GroupNorm(2, 8.0), TypeError, "num_channels must be an int"),
    (lambda: GroupNorm(2, 8, act="gelu"), ValueError, "act must be None, '', 'silu' or 'swish', got 'gelu'"),
    (lambda: GroupNorm(2, 8, eps=-1.0), ValueError, "eps must be a finite number >= 0"),
    (lambda: GroupNorm(2, 8)(torch.randn(2, 6, 3)), ValueError,
     r"the input has 6 channels \(dimension 1\); this module normalizes 8"),
    (lambda: GroupNorm(2, 8)(torch.ones(2, 8, dtype=torch.int64)), TypeError, "input must be a float32"),
    (lambda: GroupNorm(2, 8)(torch.randn(8)), ValueError, r"input must have shape \(N, C, ...\)"),
    (lambda: torch_group_norm(torch.randn(2, 8), 3, None, None, 1e-5), ValueError,
     "8 channels do not divide into 3 groups"),
    (lambda: torch_group_norm(torch.randn(2, 8), 2, torch.ones(4), None, 1e-5), ValueError,
     r"weight must have shape \(8,\), one per channel of the input, got \(4,\)"),
    (lambda: torch_group_norm(torch.randn(2, 8), 2, None, [0.0] * 8, 1e-5), TypeError, "bias must be a floating"),
    (lambda: torch_group_norm(torch.randn(2, 8), 2, None, None, float("nan")), ValueError, "eps must be"),
    (lambda: cuda_group_norm_nhwc_one_pass(torch.randn(2, 8), 2, None, None, 1e-5, "relu"), ValueError, "act must"),
])
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def _nested(*shapes):
    with warnings.catch_warnings():  # torch's "prototype stage" notice for the strided nested layout
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.randn(s) for s in shapes])


@pytest.mark.parametrize("call,match", [
    (lambda x, w: torch_group_norm(x.to_sparse(), 2, None, None, 1e-5),
     r"torch_group_norm: input must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    (lambda x, w: torch_group_norm(_nested((4, 3), (4, 2)), 2, None, None, 1e-5),
     "torch_group_norm: input must be a dense .* got a nested tensor"),
    (lambda x, w: cuda_group_norm_v2_nhwc(x, 2, w.to_sparse(), None, 1e-5), "weight must be a dense"),
    (lambda x, w: cuda_group_norm_nhwc_two_pass(x, 2, w, w.to_sparse(), 1e-5), "bias must be a dense"),
    (lambda x, w: GroupNorm(2, 4)(x.to_sparse()), "GroupNorm: input must be a dense"),
])
def test_sparse_and_nested_tensors_are_refused_by_name(call, match):
    x, w = torch.randn(2, 4, 3), torch.ones(4)
    before = x.clone()
    with pytest.raises(TypeError, match=match):
        call(x, w)
    assert torch.equal(x, before) and torch.equal(w, torch.ones(4))


@pytest.mark.parametrize("channels,kwargs,match", [
    (2**62, {}, "num_channels is 4611686018427387904: 18446744073709551616 bytes of torch.float32"),
    (2**61, {"dtype": torch.float64}, "num_channels is 2305843009213693952: 18446744073709551616 bytes of "
                                      "torch.float64"),
    (2**63, {"affine": False}, "num_channels is 9223372036854775808: 9223372036854775808 elements"),
])
def test_channel_counts_no_tensor_can_have_are_refused_by_name(channels, kwargs, match):
    with pytest.raises(ValueError, match=f"GroupNorm: {match}, more than a tensor holds"):
        GroupNorm(1, channels, **kwargs)
