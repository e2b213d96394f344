"""apex.contrib.focal_loss (NVIDIA Apex's fused focal loss): against a float64 form of TensorFlow's EfficientDet
focal loss (targets smoothed towards 1/2, modulating factor from the unsmoothed ones), which with no smoothing is
torchvision's ``sigmoid_focal_loss(reduction="sum")``; padded classes and ignored anchors; the backward's
scaling; bad arguments."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn import functional as F

from apex.contrib.focal_loss import focal_loss
from apex.contrib.focal_loss import focal_loss as module
from apex.contrib.focal_loss.focal_loss import FocalLoss

loss_fn = FocalLoss.apply

# float64 reference from logits rounded to the storage dtype: float32 arithmetic, float32 sums of <= 3000 terms;
# half grads are the float32 gradient rounded twice (kept in the logits' dtype, then scaled), as upstream's
TOL = {torch.float32: dict(rtol=2e-6, atol=1e-6), torch.float64: dict(rtol=1.2e-7, atol=1e-12),  # float32 loss
       torch.bfloat16: dict(rtol=2e-6, atol=1e-6), torch.float16: dict(rtol=2e-6, atol=1e-6)}
GRAD_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-7), torch.float64: dict(rtol=1e-12, atol=1e-14),
            torch.bfloat16: dict(rtol=1.6e-2, atol=1e-6), torch.float16: dict(rtol=2e-3, atol=1e-7)}


def _reference64(x, labels, npos, real, alpha, gamma, s):
    x = x[..., :real]
    t = F.one_hot(labels.clamp(min=0), real).double() * (labels >= 0).unsqueeze(-1)
    p = x.sigmoid()
    p_t = t * p + (1 - t) * (1 - p)
    alpha_t = t * alpha + (1 - t) * (1 - alpha)
    ce = F.binary_cross_entropy_with_logits(x, t * (1 - s) + 0.5 * s, reduction="none")
    return (alpha_t * (1 - p_t) ** gamma * ce * (labels != -2).unsqueeze(-1)).sum() / npos


def _inputs(shape, classes, real, dtype, device):
    x = (torch.randn(*shape, classes) * 3).to(dtype).to(device).requires_grad_()
    labels = torch.randint(-2, real, shape).to(device)
    return x, labels


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("s", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("gamma", [0.0, 1.5, 2.0])
@pytest.mark.parametrize("shape,classes,real", [((2, 7, 5, 9), 96, 90), ((13,), 8, 8), ((3, 4), 1, 1), ((0, 5), 8, 3)])
def test_against_float64(device, dtype, s, gamma, shape, classes, real):
    torch.manual_seed(0)
    x, labels = _inputs(shape, classes, real, dtype, device)
    npos = torch.tensor(11.0, device=device)
    loss = loss_fn(x, labels, npos, real, 0.25, gamma, s)
    assert loss.dtype == torch.float32 and loss.shape == ()
    x64 = x.detach().double().requires_grad_()
    want = _reference64(x64, labels, 11.0, real, 0.25, gamma, s)
    torch.testing.assert_close(loss.double(), want.detach(), **TOL[dtype])
    loss.backward(torch.tensor(1.5, device=device))
    want.backward(torch.tensor(1.5, dtype=torch.float64, device=device))
    assert x.grad.dtype == dtype and x.grad.shape == x.shape
    torch.testing.assert_close(x.grad.double(), x64.grad, **GRAD_TOL[dtype])
    assert not x.grad[..., real:].any()  # padded classes
    assert not x.grad[labels == -2].any()  # ignored anchors


def test_is_torchvision_sigmoid_focal_loss_summed(device):
    # torchvision's loss (written out here: torchvision is not a test dependency), per anchor as upstream's test
    torch.manual_seed(1)
    x = torch.randn(12, 8, device=device, requires_grad=True)
    classes = torch.randint(0, 8, (12,), device=device)
    y = F.one_hot(classes, 8).float()
    p = x.sigmoid()
    ce = F.binary_cross_entropy_with_logits(x, y, reduction="none")
    p_t = p * y + (1 - p) * (1 - y)
    want = ((0.24 * y + 0.76 * (1 - y)) * ce * (1 - p_t) ** 2.0).sum()
    one = torch.ones([], device=device)
    got = sum(focal_loss.FocalLoss.apply(x[i:i + 1], classes[i:i + 1], one, 8, 0.24, 2.0, 0.0) for i in range(12))
    torch.testing.assert_close(got, want)
    (gx,) = torch.autograd.grad(got, x)
    (wx,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(gx, wx)


def test_functional_form_and_package(device):
    x, labels = _inputs((6,), 4, 4, torch.float32, device)
    npos = torch.tensor(3.0, device=device)
    args = (x, labels, npos, 4, 0.25, 2.0, 0.1)
    assert torch.equal(focal_loss.focal_loss(*args), loss_fn(*args))
    assert module is focal_loss and focal_loss.FocalLoss is FocalLoss


def test_non_finite_logits_of_ignored_anchors_stay_out(device):
    x = torch.randn(4, 6, device=device)
    x[1] = float("nan")
    x[2, 3] = float("inf")
    x.requires_grad_()
    labels = torch.tensor([0, -2, -2, 5], device=device)
    loss = loss_fn(x, labels, torch.tensor(2.0, device=device), 6, 0.25, 2.0, 0.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert not x.grad[1:3].any()


def test_layout_blocks_and_repeated_backward(device, monkeypatch):
    torch.manual_seed(2)
    base = torch.randn(5, 33, 40, device=device)  # a permuted view: anchors are not rows of memory
    x = base.permute(1, 0, 2)
    labels = torch.randint(-2, 37, (33, 5), device=device)
    npos = torch.tensor(9.0, device=device)
    xa = x.detach().clone().requires_grad_()
    whole = loss_fn(xa, labels, npos, 37, 0.25, 2.0, 0.1)
    whole.backward(retain_graph=True)
    first = xa.grad.clone()
    whole.backward()  # the saved gradient is not consumed by the first backward
    torch.testing.assert_close(xa.grad, 2 * first, rtol=0, atol=0)
    monkeypatch.setattr(module, "_BLOCK_ELEMENTS", 64)  # one anchor per block
    xb = x.detach().requires_grad_()
    blocked = loss_fn(xb, labels, npos, 37, 0.25, 2.0, 0.1)
    blocked.backward()
    torch.testing.assert_close(blocked, whole, rtol=1e-6, atol=0)
    assert torch.equal(xb.grad, first)


def test_backward_scales_by_grad_over_normaliser(device):
    torch.manual_seed(3)
    x, labels = _inputs((20,), 10, 10, torch.float32, device)
    (g1,) = torch.autograd.grad(loss_fn(x, labels, torch.tensor(1.0, device=device), 10, 0.25, 2.0, 0.0), x)
    (g2,) = torch.autograd.grad(loss_fn(x, labels, torch.tensor(4.0, device=device), 10, 0.25, 2.0, 0.0), x,
                                torch.tensor(8.0, device=device))
    torch.testing.assert_close(g2, 2 * g1)
    # the normaliser may be a CPU scalar whatever the logits' device, in any floating dtype
    cpu = loss_fn(x, labels, torch.tensor([4.0], dtype=torch.float64), 10, 0.25, 2.0, 0.0)
    torch.testing.assert_close(cpu, loss_fn(x, labels, torch.tensor(4.0, device=device), 10, 0.25, 2.0, 0.0))


def _ok(device):
    return dict(cls_output=torch.randn(3, 8, device=device),
                cls_targets_at_level=torch.tensor([0, -1, -2], device=device),
                num_positives_sum=torch.tensor(1.0, device=device), num_real_classes=6, alpha=0.25, gamma=2.0,
                label_smoothing=0.0)


@pytest.mark.parametrize("key,value,error,words", [
    ("cls_output", [[0.0]], TypeError, "cls_output must be"),
    ("cls_output", "int", TypeError, "cls_output must be"),
    ("cls_output", "scalar", ValueError, "class dimension"),
    ("cls_targets_at_level", "int32", TypeError, "int64"),
    ("cls_targets_at_level", "shape", ValueError, "shape (3,)"),
    ("num_positives_sum", 2.0, TypeError, "num_positives_sum"),
    ("num_positives_sum", "int", TypeError, "num_positives_sum"),
    ("num_positives_sum", "two", ValueError, "one element"),
    ("num_real_classes", 9, ValueError, "num_real_classes"),
    ("num_real_classes", 0, ValueError, "num_real_classes"),
    ("num_real_classes", 2.0, TypeError, "num_real_classes"),
    ("alpha", "0.25", TypeError, "alpha"),
    ("alpha", float("nan"), ValueError, "alpha"),
    ("gamma", -1.0, ValueError, "gamma"),
    ("gamma", True, TypeError, "gamma"),
    ("label_smoothing", 1.5, ValueError, "label_smoothing"),
    ("label_smoothing", None, TypeError, "label_smoothing"),
])
def test_bad_arguments(device, key, value, error, words):
    kwargs = _ok(device)
    kwargs[key] = {
        "int": torch.ones(3, 8, dtype=torch.int64, device=device) if key == "cls_output"
        else torch.tensor(1, device=device),
        "scalar": torch.tensor(1.0, device=device),
        "int32": kwargs["cls_targets_at_level"].int(),
        "shape": kwargs["cls_targets_at_level"][:2],
        "two": torch.ones(2, device=device),
    }.get(value, value) if isinstance(value, str) and key not in ("alpha",) else value
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        loss_fn(*kwargs.values())


@pytest.mark.parametrize("label", [6, 7, -3])
def test_labels_outside_the_real_classes_are_refused_on_the_cpu(label):
    kwargs = _ok("cpu")
    kwargs["cls_targets_at_level"][1] = label
    with pytest.raises(ValueError, match=rf"label {label} at \(1,\)"):
        loss_fn(*kwargs.values())


def test_labels_on_another_device_are_refused(device):
    if device == "cpu":
        pytest.skip("needs a second device")
    kwargs = _ok(device)
    kwargs["cls_targets_at_level"] = kwargs["cls_targets_at_level"].cpu()
    with pytest.raises(ValueError, match="cls_output's device"):
        loss_fn(*kwargs.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logits_with_the_lazy_negation_bit(device, dtype):
    # the imaginary part of a conjugate is a view that negates on read (is_neg()); it is the same logits
    # all classes real, so both inputs are read whole and in one layout: the bits must agree
    z = torch.randn(4, 4, dtype=torch.complex64 if dtype == torch.float32 else torch.complex128, device=device)
    lazy = z.conj().imag.requires_grad_()
    if not lazy.is_neg():  # a backend may resolve the negation when it takes the view (the emulated npu does)
        pytest.skip(f"x.conj().imag carries no negation bit on {device}")
    labels, npos = torch.tensor([0, 1, -1, -2], device=device), torch.tensor([2.0], device=device)
    resolved = lazy.detach().resolve_neg().requires_grad_()
    want = loss_fn(resolved, labels, npos, 4, 0.25, 2.0, 0.1)
    (want_grad,) = torch.autograd.grad(want, resolved)
    got = loss_fn(lazy, labels, npos, 4, 0.25, 2.0, 0.1)
    (got_grad,) = torch.autograd.grad(got, lazy)
    assert torch.equal(got, want)
    assert torch.equal(got_grad, want_grad)


def _nested(*shapes):
    with warnings.catch_warnings():  # torch's "prototype stage" notice for the strided nested layout
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.randn(s) for s in shapes])


@pytest.mark.parametrize("key,make,got", [
    ("cls_output", lambda t: t.to_sparse(), "layout torch.sparse_coo"),
    ("cls_output", lambda t: _nested((3, 8), (2, 8)), "a nested tensor"),
    ("cls_targets_at_level", lambda t: t.to_sparse(), "layout torch.sparse_coo"),
    ("num_positives_sum", lambda t: t.reshape(1).to_sparse(), "layout torch.sparse_coo"),
])
def test_sparse_and_nested_tensors_are_refused_by_name(key, make, got):
    kwargs = _ok("cpu")
    before = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    bad = dict(kwargs, **{key: make(kwargs[key])})
    with pytest.raises(TypeError, match=rf"FocalLoss: {key} must be a dense \(strided\) tensor, got {got}"):
        loss_fn(*bad.values())
    assert all(torch.equal(kwargs[k], v) for k, v in before.items())
