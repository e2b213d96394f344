"""apex.contrib.fmha (NVIDIA Apex's packed variable-length attention): against per-sequence float64 attention
(upstream's test's reference math), gradients, dropout's switch, empty sequences, the module, bad arguments."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from apex.contrib.fmha import FMHA, FMHAFun

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _packed(lengths, heads, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3, heads, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return qkv, cu


def _reference(qkv, lengths):
    x = qkv.detach().double().requires_grad_()
    out, start = [], 0
    for n in lengths:
        q, k, v = x[start:start + n].unbind(1)  # each (n, heads, d)
        s = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(q.shape[-1])
        out.append(torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v))
        start += n
    return x, torch.cat(out)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("lengths", [[5, 17, 1, 9], [128], [3, 0, 4]])
def test_against_per_sequence_float64(device, dtype, lengths):
    qkv, cu = _packed(lengths, 4, 16, dtype, device)
    out = FMHAFun.apply(qkv, cu, 0.1, 512, False, False)  # not training: no dropout
    x64, want = _reference(qkv, lengths)
    assert out.shape == (sum(lengths), 4, 16) and out.dtype == dtype
    torch.testing.assert_close(out.double(), want.detach(), **TOL[dtype])
    dy = torch.randn_like(out)
    out.backward(dy)
    want.backward(dy.double())
    torch.testing.assert_close(qkv.grad.double(), x64.grad, **TOL[dtype])


def test_sequences_do_not_see_each_other(device):
    qkv, cu = _packed([6, 6], 2, 8, torch.float32, device)
    out = FMHAFun.apply(qkv, cu, 0.0, 16, False, False)
    changed = qkv.detach().clone()
    changed[6:] = torch.randn_like(changed[6:])
    again = FMHAFun.apply(changed, cu, 0.0, 16, False, False)
    assert torch.equal(out[:6], again[:6]) and not torch.equal(out[6:], again[6:])


def test_dropout_only_in_training(device):
    qkv, cu = _packed([10, 7], 2, 8, torch.float32, device)
    a = FMHAFun.apply(qkv, cu, 0.5, 16, True, False)
    b = FMHAFun.apply(qkv, cu, 0.5, 16, True, False)
    assert not torch.equal(a, b)
    assert torch.equal(FMHAFun.apply(qkv, cu, 0.5, 16, False, False), FMHAFun.apply(qkv, cu, 0.0, 16, True, False))


def test_module(device):
    config = SimpleNamespace(attention_probs_dropout_prob=0.1, num_attention_heads=4, hidden_size=32)
    mha = FMHA(config)
    qkv, cu = _packed([5, 3], 4, 8, torch.float32, device)
    flat = qkv.detach().reshape(8, 96)
    out = mha(flat, cu, 8, is_training=False)
    assert out.shape == (8, 32)
    torch.testing.assert_close(out, FMHAFun.apply(qkv.detach(), cu, 0.1, 8, False, False).reshape(8, 32))
    with pytest.raises(ValueError, match="divisible"):
        FMHA(SimpleNamespace(attention_probs_dropout_prob=0.1, num_attention_heads=5, hidden_size=32))
    with pytest.raises(TypeError, match="config needs"):
        FMHA(SimpleNamespace(hidden_size=32))


def test_bad_arguments(device):
    qkv, cu = _packed([4, 4], 2, 8, torch.float32, device)
    cases = [
        (lambda: FMHAFun.apply(qkv[:, :2], cu, 0.0, 8, False, False), ValueError, "total_tokens, 3"),
        (lambda: FMHAFun.apply(qkv, cu.float(), 0.0, 8, False, False), TypeError, "cu_seqlens"),
        (lambda: FMHAFun.apply(qkv, cu[:2], 0.0, 8, False, False), ValueError, "rise from 0"),
        (lambda: FMHAFun.apply(qkv, cu, 0.0, 3, False, False), ValueError, "max_s"),
        (lambda: FMHAFun.apply(qkv, cu, 1.5, 8, False, False), ValueError, "p_dropout"),
        (lambda: FMHAFun.apply(qkv, cu, 0.0, 8, 1, False), TypeError, "is_training"),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=words):
            call()
