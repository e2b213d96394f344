"""apex.contrib.multihead_attn (NVIDIA Apex's SelfMultiheadAttn, EncdecMultiheadAttn and
fast_mask_softmax_dropout_func): against torch's ``nn.MultiheadAttention`` in float64 with the same weights
(upstream's per-head stacked projection rearranged into torch's q/k/v blocks), the masks' conventions (bool and
uint8: nonzero is masked; additive), the pre-norm residual, dropout's switch, both ``impl`` layouts, autocast and
bad arguments."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from apex.contrib.multihead_attn import EncdecMultiheadAttn, SelfMultiheadAttn, fast_mask_softmax_dropout_func

E, H, T, B = 32, 4, 7, 3
D = E // H

# float64 reference from the same (rounded) weights and inputs: fp32 GEMMs of <= 32 terms and a softmax over 7
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=5e-2, atol=5e-2),
       torch.float16: dict(rtol=5e-3, atol=5e-3)}


def _torch_layout(stacked: torch.Tensor, parts: int) -> torch.Tensor:
    # upstream: per head, its q/k/v rows in turn; torch: all heads' q rows, then k, then v
    return stacked.reshape(H, parts, D, *stacked.shape[1:]).transpose(0, 1).reshape(parts * E, *stacked.shape[1:])


def _reference_self(layer, x, **masks):
    ref = nn.MultiheadAttention(E, H, bias=layer.bias, dtype=torch.float64, device=x.device)
    with torch.no_grad():
        w = layer._input_projection()[0].detach().double()
        ref.in_proj_weight.copy_(_torch_layout(w, 3))
        ref.out_proj.weight.copy_(layer.out_proj_weight.double())
        if layer.bias:
            ref.in_proj_bias.copy_(_torch_layout(layer._input_projection()[1].detach().double(), 3))
            ref.out_proj.bias.copy_(layer.out_proj_bias.double())
    x64 = x.detach().double().requires_grad_()
    out = ref(x64, x64, x64, need_weights=False, **masks)[0]
    return ref, x64, out


def _masks(kind, device):
    pad = torch.zeros(B, T, dtype=torch.bool, device=device)
    pad[0, -2:] = pad[2, -1] = True
    time = torch.triu(torch.ones(T, T, dtype=torch.bool, device=device), 1)
    return {"none": {}, "pad": dict(key_padding_mask=pad), "pad_uint8": dict(key_padding_mask=pad.to(torch.uint8)),
            "time": dict(attn_mask=time), "both": dict(key_padding_mask=pad, attn_mask=time)}[kind]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("mask", ["none", "pad", "pad_uint8", "time", "both"])
def test_self_attention_against_torch_float64(device, dtype, bias, separate, mask):
    torch.manual_seed(0)
    layer = SelfMultiheadAttn(E, H, bias=bias, separate_qkv_params=separate).to(device=device, dtype=dtype)
    if bias:
        with torch.no_grad():
            for p in layer.parameters():
                if p.dim() == 1:
                    p.normal_()
    x = torch.randn(T, B, E, device=device).to(dtype).requires_grad_()
    masks = _masks(mask, device)
    out, weights = layer(x, x, x, is_training=True, **masks)
    assert weights is None and out.shape == x.shape and out.dtype == dtype
    ref_masks = {k: v.bool() for k, v in masks.items()}
    ref, x64, want = _reference_self(layer, x, **ref_masks)
    torch.testing.assert_close(out.double(), want.detach(), **TOL[dtype])
    dy = torch.randn_like(out)
    out.backward(dy)
    want.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, **TOL[dtype])
    w_grad = layer.in_proj_weight.grad if not separate else torch.cat(
        [g.grad.reshape(H, 1, D, E) for g in (layer.q_weight, layer.k_weight, layer.v_weight)], 1).reshape(3 * E, E)
    _close_to_scale(w_grad, _per_head(ref.in_proj_weight.grad), dtype)
    _close_to_scale(layer.out_proj_weight.grad, ref.out_proj.weight.grad, dtype)


def _close_to_scale(got, want, dtype):
    # weight gradients sum T * B products: in half precision an element can cancel to far below the others, so
    # the absolute tolerance is taken relative to the gradient's largest element
    tol = TOL[dtype]
    scale = float(want.abs().max())
    torch.testing.assert_close(got.double(), want, rtol=tol["rtol"], atol=tol["atol"] * max(1.0, scale))


def _per_head(torch_layout: torch.Tensor) -> torch.Tensor:
    return torch_layout.reshape(3, H, D, E).transpose(0, 1).reshape(3 * E, E)


def test_separate_parameters_are_the_stacked_projection(device):
    torch.manual_seed(1)
    sep = SelfMultiheadAttn(E, H, bias=True, separate_qkv_params=True).to(device)
    one = SelfMultiheadAttn(E, H, bias=True).to(device)
    with torch.no_grad():
        for p in sep.parameters():
            p.normal_()
        w, b = sep._input_projection()
        one.in_proj_weight.copy_(w)
        one.in_proj_bias.copy_(b)
        one.out_proj_weight.copy_(sep.out_proj_weight)
        one.out_proj_bias.copy_(sep.out_proj_bias)
    x = torch.randn(T, B, E, device=device)
    assert torch.equal(sep(x, x, x)[0], one(x, x, x)[0])
    # head h's query rows are q_weight's rows of head h
    assert torch.equal(w.view(H, 3, D, E)[2, 0], sep.q_weight.view(H, D, E)[2])


def test_additive_masks(device):
    torch.manual_seed(2)
    layer = SelfMultiheadAttn(E, H, bias=True, mask_additive=True).to(device)
    flags = SelfMultiheadAttn(E, H, bias=True).to(device)
    flags.load_state_dict(layer.state_dict())
    x = torch.randn(T, B, E, device=device)
    masks = _masks("both", device)
    additive = {k: v.float() * -1e30 for k, v in masks.items()}
    torch.testing.assert_close(layer(x, None, None, **additive)[0], flags(x, **masks)[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="floating-point"):
        layer(x, key_padding_mask=masks["key_padding_mask"])


def test_encdec_against_torch_float64(device):
    torch.manual_seed(3)
    tk = 5
    layer = EncdecMultiheadAttn(E, H, bias=True).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 1:
                p.normal_()
    q = torch.randn(T, B, E, device=device, requires_grad=True)
    k = torch.randn(tk, B, E, device=device, requires_grad=True)
    pad = torch.zeros(B, tk, dtype=torch.uint8, device=device)
    pad[1, 3:] = 1
    time = torch.rand(T, tk, device=device) > 0.8
    time[:, 0] = False
    out, _ = layer(q, k, k, key_padding_mask=pad, attn_mask=time)
    ref = nn.MultiheadAttention(E, H, dtype=torch.float64, device=device)
    with torch.no_grad():
        kv = layer.in_proj_weight_kv.double().reshape(H, 2, D, E).transpose(0, 1).reshape(2 * E, E)
        ref.in_proj_weight.copy_(torch.cat([layer.in_proj_weight_q.double(), kv]))
        kvb = layer.in_proj_bias_kv.double().reshape(H, 2, D).transpose(0, 1).reshape(2 * E)
        ref.in_proj_bias.copy_(torch.cat([layer.in_proj_bias_q.double(), kvb]))
        ref.out_proj.weight.copy_(layer.out_proj_weight.double())
        ref.out_proj.bias.copy_(layer.out_proj_bias.double())
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    want = ref(q64, k64, k64, key_padding_mask=pad.bool(), attn_mask=time, need_weights=False)[0]
    torch.testing.assert_close(out.double(), want.detach(), **TOL[torch.float32])
    out.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(q.grad.double(), q64.grad, **TOL[torch.float32])
    torch.testing.assert_close(k.grad.double(), k64.grad, **TOL[torch.float32])


@pytest.mark.parametrize("cls", [SelfMultiheadAttn, EncdecMultiheadAttn])
def test_norm_add_and_the_two_layouts(device, cls):
    torch.manual_seed(4)
    fast = cls(E, H, include_norm_add=True, impl="fast").to(device)
    default = cls(E, H, include_norm_add=True, impl="default").to(device)
    plain = cls(E, H).to(device)
    fast_keys, default_keys = set(fast.state_dict()), set(default.state_dict())
    assert {"lyr_nrm_gamma_weights", "lyr_nrm_beta_weights"} <= fast_keys
    assert {"lyr_nrm.weight", "lyr_nrm.bias"} <= default_keys
    with torch.no_grad():
        fast.lyr_nrm_gamma_weights.normal_()
        fast.lyr_nrm_beta_weights.normal_()
        default.lyr_nrm.weight.copy_(fast.lyr_nrm_gamma_weights)
        default.lyr_nrm.bias.copy_(fast.lyr_nrm_beta_weights)
        for name, p in plain.named_parameters():
            getattr(fast, name).copy_(p)
            getattr(default, name).copy_(p)
    x = torch.randn(T, B, E, device=device)
    k = x if cls is SelfMultiheadAttn else torch.randn(5, B, E, device=device)
    normed = F.layer_norm(x, (E,), fast.lyr_nrm_gamma_weights, fast.lyr_nrm_beta_weights, 1e-5)
    want = x + plain(normed, normed if cls is SelfMultiheadAttn else k)[0]
    torch.testing.assert_close(fast(x, k, is_training=False)[0], want)
    torch.testing.assert_close(default(x, k, is_training=False)[0], want)


def test_dropout_follows_is_training(device):
    torch.manual_seed(5)
    layer = SelfMultiheadAttn(E, H, dropout=1.0, bias=True, include_norm_add=True).to(device)
    x = torch.randn(T, B, E, device=device)
    layer.eval()  # upstream's rule: is_training decides, not the module's mode
    assert torch.equal(layer(x, is_training=True)[0], x)  # every probability and the residual branch dropped
    assert not torch.equal(layer(x, is_training=False)[0], x)
    half = SelfMultiheadAttn(E, H, dropout=0.5).to(device)
    a, b = half(x, is_training=True)[0], half(x, is_training=True)[0]
    assert not torch.equal(a, b)
    assert torch.equal(half(x, is_training=False)[0], half(x, is_training=False)[0])


@pytest.mark.parametrize("additive", [False, True])
def test_fast_mask_softmax_dropout_func(device, additive):
    torch.manual_seed(6)
    x = torch.randn(B * H, T, T, device=device, dtype=torch.float16, requires_grad=True)
    flag = torch.rand(B, T, device=device) > 0.6
    flag[:, 0] = False
    mask = flag.half() * -10000 if additive else flag.to(torch.uint8)
    y = fast_mask_softmax_dropout_func(True, H, x, mask, additive, 0.0)
    x64 = x.detach().double().requires_grad_()
    s = x64.view(B, H, T, T)
    s = s + mask.double()[:, None, None] if additive else s.masked_fill(flag[:, None, None], float("-inf"))
    want = torch.softmax(s, -1).view(B * H, T, T)
    assert y.dtype == torch.float16 and y.shape == x.shape
    torch.testing.assert_close(y.double(), want.detach(), rtol=2e-3, atol=1e-3)
    g = torch.randn_like(y)
    y.backward(g)
    want.backward(g.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-2, atol=2e-3)
    assert torch.equal(fast_mask_softmax_dropout_func(False, H, x, None, False, 0.9), torch.softmax(x, -1))


def test_autocast(device):
    torch.manual_seed(7)
    layer = SelfMultiheadAttn(E, H, bias=True, include_norm_add=True).to(device)
    x = torch.randn(T, B, E, device=device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        out = layer(x, is_training=False)[0]
    torch.testing.assert_close(out.float(), layer(x, is_training=False)[0], rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(embed_dim=30, num_heads=4), ValueError, "divisible"),
    (dict(embed_dim=32, num_heads=0), ValueError, "num_heads"),
    (dict(embed_dim=32.0, num_heads=4), TypeError, "embed_dim"),
    (dict(embed_dim=32, num_heads=4, impl="cuda"), ValueError, "impl"),
    (dict(embed_dim=32, num_heads=4, dropout=1.5), ValueError, "dropout"),
    (dict(embed_dim=32, num_heads=4, dropout="0.1"), TypeError, "dropout"),
    (dict(embed_dim=32, num_heads=4, bias=1), TypeError, "bias"),
])
@pytest.mark.parametrize("cls", [SelfMultiheadAttn, EncdecMultiheadAttn])
def test_bad_constructor_arguments(cls, kwargs, error, words):
    with pytest.raises(error, match=words):
        cls(**kwargs)


def test_bad_forward_arguments(device):
    layer = SelfMultiheadAttn(E, H).to(device)
    encdec = EncdecMultiheadAttn(E, H).to(device)
    x = torch.randn(T, B, E, device=device)
    cases = [
        (lambda: layer(x[0]), ValueError, "shape"),
        (lambda: layer(x.double()), TypeError, "dtype"),
        (lambda: layer(x, x.clone(), x), ValueError, "key must be query"),
        (lambda: layer(x, key_padding_mask=torch.zeros(B, T + 1, dtype=torch.bool, device=device)), ValueError,
         "key_padding_mask must have shape"),
        (lambda: layer(x, attn_mask=torch.zeros(T, T, device=device)), TypeError, "bool or uint8"),
        (lambda: layer(x, is_training=1), TypeError, "is_training"),
        (lambda: encdec(x, torch.randn(4, B + 1, E, device=device)), ValueError, "batch size"),
        (lambda: encdec(x, x, x.clone()), ValueError, "value must be key"),
        (lambda: fast_mask_softmax_dropout_func(True, 5, x, None, False, 0.0), ValueError, "heads"),
        (lambda: fast_mask_softmax_dropout_func(True, H, x.view(B * H, T, -1)[:, :, :T], None, False, 2.0),
         ValueError, "dropout_prob"),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=words):
            call()
