"""NVIDIA Apex's ``SoftmaxCrossEntropyLoss``: per-row softmax cross entropy with label smoothing, on every device.

``SoftmaxCrossEntropyLoss.apply(logits, labels, smoothing=0.0, padding_idx=0, half_to_float=False)`` takes logits
of shape (N, C) (float32, float16 or bfloat16) and int64 labels of shape (N,) and returns the N losses, in float32
whatever the logits' dtype (upstream's kernel wrote them so), without reduction::

    loss_i = (1 - smoothing) * (lse_i - x_i[y_i]) + smoothing * (lse_i - mean_k x_ik),   lse_i = log sum_k exp x_ik

that is ``(1 - smoothing) * NLL + smoothing * (-mean_k log p_ik)``: the smoothing mass spread over all C classes,
the target's included. Rows whose label equals ``padding_idx`` (0 by default, as upstream) get loss 0 and no
gradient. The gradient with respect to the logits is ``g_i * (softmax(x_i) - (1 - smoothing) * onehot(y_i) -
smoothing / C)``, returned in the logits' dtype.

Everything is computed in float32 from the logits as given (upstream's accumulation type), row block by row block,
so the float32 copy of a large vocabulary's logits never exists whole; the backward keeps what upstream's did: the
logits, each row's log-sum-exp and the labels. ``half_to_float`` chose where upstream's kernel kept that
log-sum-exp; it is accepted (a bool) and changes nothing here, where it is always float32, for any logits dtype.

Arguments are checked before anything runs (TypeError / ValueError naming the argument); labels on the CPU are also
checked against [0, C) (padding rows excepted); on an accelerator that check would wait for the device, so there an
out-of-range label fails in torch's gather, as ``F.cross_entropy``'s would.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch.autograd.function import once_differentiable

from apex._checks import INT64_MAX, INT64_MIN, check_dense, check_fraction, check_int
from apex._device import block_elements

__all__ = ["SoftmaxCrossEntropyLoss"]

# float32 elements of one block of rows (None: the device's choice, apex._device.block_elements): bounds the
# temporary copy whatever N x C is
_BLOCK_ELEMENTS = None

_WHERE = "SoftmaxCrossEntropyLoss"


def _check(logits, labels, smoothing, padding_idx, half_to_float) -> Tuple[float, int]:
    if not isinstance(logits, torch.Tensor) or logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"{_WHERE}: logits must be a float32, float16 or bfloat16 tensor, got {got}")
    check_dense(logits, f"{_WHERE}: logits")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"{_WHERE}: logits must have shape (N, C) with C >= 1, got {tuple(logits.shape)}")
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64:
        got = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise TypeError(f"{_WHERE}: labels must be an int64 tensor, got {got}")
    check_dense(labels, f"{_WHERE}: labels")
    if labels.shape != (logits.shape[0],):
        raise ValueError(f"{_WHERE}: labels must have shape ({logits.shape[0]},), one per row of logits, "
                         f"got {tuple(labels.shape)}")
    if labels.device != logits.device:
        raise ValueError(f"{_WHERE}: labels must be on the logits' device ({logits.device}), got {labels.device}")
    eps = check_fraction(smoothing, f"{_WHERE}: smoothing")
    # compared with the int64 labels: beyond int64 it could never match one
    pad = check_int(padding_idx, f"{_WHERE}: padding_idx", INT64_MIN, INT64_MAX)
    if not isinstance(half_to_float, bool):
        raise TypeError(f"{_WHERE}: half_to_float must be a bool, got {type(half_to_float).__name__}")
    if labels.device.type == "cpu" and labels.numel():
        bad = (labels != pad) & ((labels < 0) | (labels >= logits.shape[1]))
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise ValueError(f"{_WHERE}: label {int(labels[row])} of row {row} is outside [0, {logits.shape[1]}) "
                             f"and is not padding_idx ({pad})")
    return float(eps), pad


def _blocks(rows: int, classes: int, device: torch.device):
    step = max(1, (_BLOCK_ELEMENTS or block_elements(device)) // classes)
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _rows(logits: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    # float32 and row-contiguous: the reductions then run in one order whatever the logits' layout, so a transposed
    # view gives the bits its contiguous copy gives
    return logits[lo:hi].float().contiguous()


class SoftmaxCrossEntropyLoss(torch.autograd.Function):
    """Upstream's ``torch.autograd.Function``: ``SoftmaxCrossEntropyLoss.apply(logits, labels, smoothing=0.0,
    padding_idx=0, half_to_float=False)`` -> float32 losses of shape (N,); see the module docstring."""

    @staticmethod
    def forward(ctx, logits, labels, smoothing=0.0, padding_idx=0, half_to_float=False):
        eps, pad = _check(logits, labels, smoothing, padding_idx, half_to_float)
        rows, classes = logits.shape
        keep = labels != pad
        target = torch.where(keep, labels, torch.zeros_like(labels)).unsqueeze(1)  # padding rows read class 0
        losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for lo, hi in _blocks(rows, classes, logits.device):
            x = _rows(logits, lo, hi)
            lse[lo:hi] = torch.logsumexp(x, dim=1)
            nll = lse[lo:hi] - x.gather(1, target[lo:hi]).squeeze(1)
            smooth = lse[lo:hi] - x.mean(dim=1)
            losses[lo:hi] = nll * (1.0 - eps) + smooth * eps
        losses.masked_fill_(~keep, 0.0)
        ctx.save_for_backward(logits, lse, target, keep)
        ctx.smoothing = eps
        return losses

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        logits, lse, target, keep = ctx.saved_tensors
        eps = ctx.smoothing
        rows, classes = logits.shape
        g = torch.where(keep, grad_loss.float(), torch.zeros((), dtype=torch.float32, device=grad_loss.device))
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        # g * (softmax - eps / C) over the row, then g * (eps - 1) added at the target: three passes over a block
        # (the shifted exponent, its scaling, the store), the target a gather-sized scatter
        at_target = (g * (eps - 1.0)).unsqueeze(1)
        direct = grad.dtype == torch.float32  # float32 logits: each block is computed where its grad goes
        for lo, hi in _blocks(rows, classes, logits.device):
            gi = g[lo:hi].unsqueeze(1)
            p = torch.sub(_rows(logits, lo, hi), lse[lo:hi].unsqueeze(1), out=grad[lo:hi] if direct else None)
            p.exp_()
            torch.addcmul(gi * (-eps / classes), p, gi, out=p)
            p.scatter_add_(1, target[lo:hi], at_target[lo:hi])
            if not direct:
                grad[lo:hi] = p
        return grad, None, None, None, None
