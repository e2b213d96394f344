"""apex.contrib.xentropy (NVIDIA Apex's SoftmaxCrossEntropyLoss): against the float64 formula
(1 - e) * (lse - x_y) + e * (lse - mean x) with its gradient, and against torch's F.cross_entropy with the same
label smoothing, which is the same loss (the smoothing spread over all C classes)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from apex.contrib import xentropy
from apex.contrib.xentropy import SoftmaxCrossEntropyLoss
from apex.contrib.xentropy import softmax_xentropy as module

loss_fn = SoftmaxCrossEntropyLoss.apply

# float64 reference, from logits rounded to the storage dtype: float32 accumulation over C <= 1000 terms
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1e-5, atol=1e-5),
       torch.float16: dict(rtol=1e-5, atol=1e-5)}
GRAD_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-7), torch.bfloat16: dict(rtol=8e-3, atol=1e-6),
            torch.float16: dict(rtol=1e-3, atol=1e-7)}


def _inputs(rows, classes, dtype, device, pad=0, pad_rows=()):
    logits = (torch.randn(rows, classes) * 3).to(dtype).to(device).requires_grad_()
    labels = torch.randint(0, classes, (rows,))
    labels[list(pad_rows)] = pad
    return logits, labels.to(device)


def _reference64(logits, labels, eps, pad):
    x = logits.detach().double().requires_grad_()
    keep = labels != pad
    lse = torch.logsumexp(x, dim=1)
    y = torch.where(keep, labels, torch.zeros_like(labels))
    loss = (1 - eps) * (lse - x.gather(1, y[:, None]).squeeze(1)) + eps * (lse - x.mean(dim=1))
    return x, loss * keep


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("rows,classes", [(37, 1000), (5, 1), (64, 3)])
def test_against_float64(device, dtype, eps, rows, classes):
    torch.manual_seed(0)
    logits, labels = _inputs(rows, classes, dtype, device, pad=0, pad_rows=range(0, rows, 4))
    losses = loss_fn(logits, labels, eps, 0, dtype == torch.float16)
    assert losses.dtype == torch.float32 and losses.shape == (rows,)
    x64, want = _reference64(logits, labels, eps, 0)
    torch.testing.assert_close(losses.double(), want.detach(), **TOL[dtype])
    dy = torch.randn(rows, device=device)
    losses.backward(dy)
    want.backward(dy.double())
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.double(), x64.grad, **GRAD_TOL[dtype])
    assert not logits.grad[labels == 0].any()  # padding rows: no gradient


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_is_torch_cross_entropy_with_label_smoothing(device, eps):
    torch.manual_seed(1)
    logits, labels = _inputs(50, 300, torch.float32, device, pad=-100, pad_rows=[3, 7, 49])
    ref_logits = logits.detach().clone().requires_grad_()
    losses = loss_fn(logits, labels, eps, -100)
    want = F.cross_entropy(ref_logits, labels, ignore_index=-100, reduction="none", label_smoothing=eps)
    torch.testing.assert_close(losses, want, rtol=1e-6, atol=1e-6)
    losses.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-7)


def test_blocks_give_the_same_bits(monkeypatch):
    torch.manual_seed(2)
    logits, labels = _inputs(41, 97, torch.bfloat16, "cpu", pad_rows=[0, 40])
    whole = loss_fn(logits, labels, 0.2, 0)
    whole.sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    monkeypatch.setattr(module, "_BLOCK_ELEMENTS", 97 * 4)  # blocks of 4 rows, the last one short
    blocked = loss_fn(logits, labels, 0.2, 0)
    blocked.sum().backward()
    torch.testing.assert_close(blocked, whole, rtol=0, atol=0)
    torch.testing.assert_close(logits.grad, grad, rtol=0, atol=0)


def test_upstream_script_forms(device):
    # fairseq / OpenNMT: view to (N*T, C), fp16 logits with half_to_float, padding index, summed; an upstream-style
    # test's default padding_idx=0 makes label 0 padding
    torch.manual_seed(3)
    logits = torch.randn(2, 9, 40, device=device).half().requires_grad_()
    target = torch.randint(1, 40, (2, 9), device=device)
    target[0, -3:] = 1
    losses = xentropy.SoftmaxCrossEntropyLoss.apply(logits.view(-1, 40), target.view(-1), 0.1, 1, True)
    assert losses.dtype == torch.float32 and not losses.view(2, 9)[0, -3:].any()
    losses.sum().backward()
    assert logits.grad.dtype == torch.float16 and not logits.grad[0, -3:].any()
    assert loss_fn(logits.detach().view(-1, 40), torch.zeros(18, dtype=torch.long, device=device)).abs().sum() == 0


def test_empty_non_contiguous_and_autocast(device):
    empty = torch.empty(0, 5, device=device, requires_grad=True)
    out = loss_fn(empty, torch.empty(0, dtype=torch.long, device=device), 0.1)
    out.sum().backward()
    assert out.shape == (0,) and empty.grad.shape == (0, 5)
    torch.manual_seed(4)
    base = torch.randn(30, 20, device=device)
    labels = torch.randint(1, 20, (20,), device=device)
    t = base.t().requires_grad_()  # (20, 30), not contiguous
    c = base.t().contiguous().requires_grad_()
    torch.testing.assert_close(loss_fn(t, labels, 0.1), loss_fn(c, labels, 0.1), rtol=0, atol=0)
    low = torch.float16 if device == "cuda" else torch.bfloat16
    with torch.autocast(device, dtype=low):  # computed in float32 from the logits given, autocast or not
        inside = loss_fn(c, labels, 0.1)
    torch.testing.assert_close(inside, loss_fn(c, labels, 0.1), rtol=0, atol=0)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: loss_fn(torch.randn(3, 4).double(), torch.zeros(3, dtype=torch.long)), TypeError,
     "logits must be a float32, float16 or bfloat16 tensor, got torch.float64"),
    (lambda: loss_fn([[1.0]], torch.zeros(1, dtype=torch.long)), TypeError, "got list"),
    (lambda: loss_fn(torch.randn(2, 3, 4), torch.zeros(2, dtype=torch.long)), ValueError,
     r"logits must have shape \(N, C\) with C >= 1, got \(2, 3, 4\)"),
    (lambda: loss_fn(torch.randn(2, 0), torch.zeros(2, dtype=torch.long)), ValueError, "C >= 1"),
    (lambda: loss_fn(torch.randn(3, 4), torch.zeros(3, dtype=torch.int32)), TypeError,
     "labels must be an int64 tensor, got torch.int32"),
    (lambda: loss_fn(torch.randn(3, 4), torch.zeros(2, dtype=torch.long)), ValueError,
     r"labels must have shape \(3,\), one per row of logits, got \(2,\)"),
    (lambda: loss_fn(torch.randn(3, 4), torch.tensor([1, 4, 0])), ValueError,
     r"label 4 of row 1 is outside \[0, 4\) and is not padding_idx \(0\)"),
    (lambda: loss_fn(torch.randn(3, 4), torch.tensor([1, -1, 0]), 0.0, 2), ValueError, "label -1 of row 1"),
    (lambda: loss_fn(torch.randn(3, 4), torch.ones(3, dtype=torch.long), 1.5), ValueError,
     r"smoothing must be in \[0, 1\], got 1.5"),
    (lambda: loss_fn(torch.randn(3, 4), torch.ones(3, dtype=torch.long), float("nan")), ValueError, "smoothing"),
    (lambda: loss_fn(torch.randn(3, 4), torch.ones(3, dtype=torch.long), "0.1"), TypeError,
     "smoothing must be a real number, got str"),
    (lambda: loss_fn(torch.randn(3, 4), torch.ones(3, dtype=torch.long), 0.1, 1.5), TypeError,
     "padding_idx must be an int"),
    (lambda: loss_fn(torch.randn(3, 4), torch.ones(3, dtype=torch.long), 0.1, 0, "yes"), TypeError,
     "half_to_float must be a bool, got str"),
])
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("which", ["logits", "labels"])
def test_sparse_tensors_are_refused_by_name(which):
    logits, labels = torch.randn(3, 4), torch.tensor([1, 2, 3])
    before = logits.clone()
    args = {"logits": logits, "labels": labels}
    args[which] = args[which].to_sparse()
    with pytest.raises(TypeError, match=rf"SoftmaxCrossEntropyLoss: {which} must be a dense \(strided\) tensor, "
                                        "got layout torch.sparse_coo"):
        loss_fn(args["logits"], args["labels"])
    assert torch.equal(logits, before) and torch.equal(labels, torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("pad", [2**63, 2**70, -2**63 - 1])
def test_padding_idx_beyond_int64_is_refused_by_name(pad):
    with pytest.raises(ValueError, match=rf"padding_idx must be in \[-9223372036854775808, 9223372036854775807\], "
                                         f"got {pad}"):
        loss_fn(torch.randn(3, 4), torch.tensor([1, 2, 3]), 0.0, pad)


@pytest.mark.parametrize("pad", [2**63 - 1, -2**63])
def test_padding_idx_at_the_int64_bounds_pads_nothing(pad):
    logits, labels = torch.randn(3, 4), torch.tensor([1, 2, 3])
    torch.testing.assert_close(loss_fn(logits, labels, 0.0, pad), F.cross_entropy(logits, labels, reduction="none"))
