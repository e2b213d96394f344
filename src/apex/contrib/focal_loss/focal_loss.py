"""NVIDIA Apex's ``FocalLoss``: the sigmoid focal loss of RetinaNet / EfficientDet over anchors, with label
smoothing and padded classes, on every device.

``FocalLoss.apply(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
label_smoothing=0.0)`` (or ``focal_loss(...)``, the same arguments) takes

* ``cls_output``: logits of shape ``(*anchors, C)`` (float32, float16, bfloat16 or float64), where the last
  dimension may be padded beyond the ``num_real_classes`` real classes (upstream's kernel wanted it padded for
  vector loads; nothing here needs it);
* ``cls_targets_at_level``: int64 labels of shape ``anchors``: a class index in ``[0, num_real_classes)`` for a
  positive anchor, -1 for a negative one (every class a negative), -2 for an anchor to ignore;
* ``num_positives_sum``: a one-element floating tensor, the normaliser;

and returns a float32 scalar, ``sum / num_positives_sum`` over the real classes of the anchors not ignored of::

    loss = alpha * (1 - p)^gamma * bce(x, 1 - s/2)        the anchor's own class
    loss = (1 - alpha) * p^gamma * bce(x, s/2)             every other class
    p = sigmoid(x),   bce(x, t) = -(t log p + (1 - t) log(1 - p)) = (1 - t) x + softplus(-x)

with ``s`` = ``label_smoothing``: the targets are smoothed towards 1/2 while the modulating factor keeps the
unsmoothed ones (TensorFlow's EfficientDet loss; ``torchvision.ops.sigmoid_focal_loss`` with ``reduction="sum"``
when ``s`` is 0). Padded classes and ignored anchors give 0 and get a zero gradient. The gradient of an element is
``w * (c * bce - (t - p))`` with ``w`` its modulating weight and ``c`` = ``gamma * (1 - p)`` for a negative,
``-gamma * p`` for a positive.

Like upstream's kernel, the forward computes that gradient (in float32, float64 for float64 logits) and keeps it in
the logits' dtype, and the backward scales it by ``grad / num_positives_sum``: the saved tensor is the size of the
logits, and the logits themselves are not kept. Work runs over blocks of anchors, so no float32 copy of half
logits exists whole.

Arguments are checked before anything runs (TypeError / ValueError naming the argument). Labels on the CPU are
also checked: -2, -1 or a real class. On an accelerator that check would wait for the device, so there any other
label makes its anchor a negative one, which is what upstream's kernel did with it.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from apex._checks import check_dense, check_fraction, check_int, real_number
from apex._device import block_elements

__all__ = ["FocalLoss", "focal_loss"]

# elements of one block of anchors (None: the device's choice, apex._device.block_elements): bounds each float32
# temporary whatever the number of anchors is
_BLOCK_ELEMENTS = None

_WHERE = "FocalLoss"
_IGNORE = -2
_NEGATIVE = -1
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _real(value, name: str) -> float:
    number = real_number(value)
    if number is None:
        raise TypeError(f"{_WHERE}: {name} must be a real number, got {type(value).__name__}")
    number = float(number)
    if not math.isfinite(number):
        raise ValueError(f"{_WHERE}: {name} must be finite, got {number}")
    return number


def _check(cls_output, labels, num_positives_sum, num_real_classes, alpha, gamma,
           label_smoothing) -> Tuple[int, float, float, float]:
    if not isinstance(cls_output, torch.Tensor) or cls_output.dtype not in _DTYPES:
        got = cls_output.dtype if isinstance(cls_output, torch.Tensor) else type(cls_output).__name__
        raise TypeError(f"{_WHERE}: cls_output must be a float32, float16, bfloat16 or float64 tensor, got {got}")
    check_dense(cls_output, f"{_WHERE}: cls_output")
    if cls_output.dim() < 1:
        raise ValueError(f"{_WHERE}: cls_output must have a class dimension (shape (*anchors, C)), got a scalar")
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64:
        got = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise TypeError(f"{_WHERE}: cls_targets_at_level must be an int64 tensor, got {got}")
    check_dense(labels, f"{_WHERE}: cls_targets_at_level")
    if labels.shape != cls_output.shape[:-1]:
        raise ValueError(f"{_WHERE}: cls_targets_at_level must have shape {tuple(cls_output.shape[:-1])} (cls_output's "
                         f"without its class dimension), got {tuple(labels.shape)}")
    if labels.device != cls_output.device:
        raise ValueError(f"{_WHERE}: cls_targets_at_level must be on cls_output's device ({cls_output.device}), "
                         f"got {labels.device}")
    if not isinstance(num_positives_sum, torch.Tensor) or not num_positives_sum.is_floating_point():
        got = num_positives_sum.dtype if isinstance(num_positives_sum, torch.Tensor) \
            else type(num_positives_sum).__name__
        raise TypeError(f"{_WHERE}: num_positives_sum must be a floating tensor of one element, got {got}")
    check_dense(num_positives_sum, f"{_WHERE}: num_positives_sum")
    if num_positives_sum.numel() != 1:
        raise ValueError(f"{_WHERE}: num_positives_sum must have one element, got shape "
                         f"{tuple(num_positives_sum.shape)}")
    if num_positives_sum.device != cls_output.device and num_positives_sum.device.type != "cpu":
        raise ValueError(f"{_WHERE}: num_positives_sum must be on cls_output's device ({cls_output.device}) or the "
                         f"CPU, got {num_positives_sum.device}")
    classes = cls_output.shape[-1]
    real = check_int(num_real_classes, f"{_WHERE}: num_real_classes", 1, max(1, classes))
    if real > classes:  # only reachable with C == 0
        raise ValueError(f"{_WHERE}: num_real_classes ({real}) exceeds cls_output's {classes} classes")
    a = _real(alpha, "alpha")
    g = _real(gamma, "gamma")
    if g < 0:
        raise ValueError(f"{_WHERE}: gamma must be >= 0, got {g}")
    s = check_fraction(label_smoothing, f"{_WHERE}: label_smoothing")
    if labels.device.type == "cpu" and labels.numel():
        bad = (labels < _IGNORE) | (labels >= real)
        if bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(f"{_WHERE}: label {int(labels[where])} at {where} is not a class in [0, {real}), "
                             f"{_NEGATIVE} (negative) or {_IGNORE} (ignored)")
    return real, a, g, s


def _blocks(anchors: int, classes: int, device: torch.device):
    step = max(1, (_BLOCK_ELEMENTS or block_elements(device)) // max(1, classes))
    for start in range(0, anchors, step):
        yield start, min(anchors, start + step)


def _partial_grad(x: torch.Tensor, y: torch.Tensor, alpha: float, gamma: float, s: float,
                  loss_total: torch.Tensor) -> torch.Tensor:
    """The loss's gradient for one block of anchors, before the normaliser: ``x`` the real classes' logits in the
    compute dtype, ``y`` their labels. Adds the block's loss to ``loss_total``."""
    positive = y.unsqueeze(1) == torch.arange(x.shape[1], device=x.device)
    p = torch.sigmoid(x)
    # scalars as tensors of the compute dtype: where() would make Python floats float32. torch.tensor, as
    # Tensor.new_tensor fails on a view carrying torch's lazy negation bit (``z.conj().imag``)
    def scalar(v: float) -> torch.Tensor:
        return torch.tensor(v, dtype=x.dtype, device=x.device)

    one_minus_t = torch.where(positive, scalar(s / 2), scalar(1 - s / 2))
    bce = torch.addcmul(-F.logsigmoid(x), one_minus_t, x)
    # q: the predicted probability of the wrong answer (1 - p for the anchor's class, p for the others); one pow
    # gives both modulating factors, and d(q^gamma)/dx = q^gamma * gamma * (1 - q) * (-1 or +1)
    q = torch.where(positive, 1 - p, p)
    weight = q.pow(gamma).mul_(torch.where(positive, scalar(alpha), scalar(1 - alpha)))
    slope = torch.where(positive, q - 1, 1 - q).mul_(gamma)
    # an ignored anchor is left out, not weighted by 0: a non-finite logit there must not reach the sums
    ignored = y.eq(_IGNORE).unsqueeze(1)
    loss_total += torch.sum((weight * bce).masked_fill_(ignored, 0.0))
    # t - p = (1 - p) - (1 - t)
    return slope.mul_(bce).sub_(1 - p).add_(one_minus_t).mul_(weight).masked_fill_(ignored, 0.0)


class FocalLoss(torch.autograd.Function):
    """Upstream's ``torch.autograd.Function``: ``FocalLoss.apply(cls_output, cls_targets_at_level,
    num_positives_sum, num_real_classes, alpha, gamma, label_smoothing=0.0)`` -> float32 scalar; see the module
    docstring."""

    @staticmethod
    def forward(ctx, cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
                label_smoothing=0.0):
        real, a, g, s = _check(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha,
                               gamma, label_smoothing)
        classes = cls_output.shape[-1]
        compute = torch.float64 if cls_output.dtype == torch.float64 else torch.float32
        logits = cls_output.reshape(-1, classes)
        labels = cls_targets_at_level.reshape(-1)
        partial = torch.zeros(cls_output.shape, dtype=cls_output.dtype, device=cls_output.device)
        flat = partial.view(-1, classes)
        total = torch.zeros((), dtype=compute, device=cls_output.device)
        for lo, hi in _blocks(logits.shape[0], classes, cls_output.device):
            x = logits[lo:hi, :real].to(compute)
            flat[lo:hi, :real] = _partial_grad(x, labels[lo:hi], a, g, s, total)
        normaliser = num_positives_sum.detach().reshape(()).to(device=cls_output.device, dtype=torch.float32)
        ctx.save_for_backward(partial, normaliser)
        return (total * normaliser.to(compute).reciprocal()).float()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        partial, normaliser = ctx.saved_tensors
        compute = torch.float64 if partial.dtype == torch.float64 else torch.float32
        scale = grad_loss.reshape(()).to(compute) / normaliser.to(compute)
        if partial.dtype in (torch.float32, torch.float64):
            grad = partial * scale
        else:  # scaled in float32 and rounded once, block by block
            grad = torch.empty_like(partial)
            src, dst = partial.view(-1, max(1, partial.shape[-1])), grad.view(-1, max(1, partial.shape[-1]))
            for lo, hi in _blocks(src.shape[0], src.shape[1], partial.device):
                dst[lo:hi] = src[lo:hi].float().mul_(scale)
        return grad, None, None, None, None, None, None


def focal_loss(cls_output: torch.Tensor, cls_targets_at_level: torch.Tensor, num_positive_sum: torch.Tensor,
               num_real_classes: int, alpha: float, gamma: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """The fused focal loss: ``FocalLoss.apply`` with the same arguments (see the module docstring)."""
    return FocalLoss.apply(cls_output, cls_targets_at_level, num_positive_sum, num_real_classes, alpha, gamma,
                           label_smoothing)
