"""The math of NVIDIA Apex's multi-head attention modules, shared by both of them and by both ``impl`` values.

Tensors are sequence-first, ``(time, batch, embed)``, as fairseq's. For ``H`` heads of ``d = embed / H``
features, with ``scale = d ** -0.5``::

    q, k, v  = projections of the input(s), each head's d features side by side  (T, B*H, d)
    scores   = scale * q k^T                                     (B*H, Tq, Tk), the scale inside the product
    scores  += masks: a key padding mask (B, Tk) and/or a time mask (Tq, Tk): a bool or uint8 mask sets the
               scores where it is nonzero to -inf; an additive one (``mask_additive``) is added
    probs    = dropout(softmax(scores))                           dropout only when ``is_training``
    out      = (probs v) heads concatenated, then the output projection

The input projection's output is laid out per head: for head ``h`` its ``3d`` (self attention: q, k, v) or ``2d``
(the key/value projection of encoder-decoder attention: k, v) rows follow one another, which is how upstream's
``in_proj_weight`` is read, so checkpoints carry over. A row whose keys are all masked has no softmax: its
probabilities are NaN, as upstream's were.

``include_norm_add`` wraps the block in a pre-norm residual: ``query + dropout(attention(layer_norm(query)))``
(eps 1e-5; dropout with the same probability, only when ``is_training``).

Upstream's two ``impl`` values were two implementations of this one function (CUDA kernels and a torch
reference), so here they are the same code: the only thing ``impl`` still selects is where the layer norm's
parameters live (``lyr_nrm_gamma_weights`` / ``lyr_nrm_beta_weights`` for "fast", a ``FusedLayerNorm`` named
``lyr_nrm`` for "default"), which is what their checkpoints hold. Softmax follows torch's rule for the scores'
dtype (float32 arithmetic for float16 / bfloat16, the result rounded once), as the kernels did. Under autocast
every product follows autocast's rules.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F

__all__ = ["attend", "mask_softmax_dropout"]

_FLAGS = (torch.bool, torch.uint8)


def _check_mask(where: str, name: str, mask, shape, additive: bool) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a tensor or None, got {type(mask).__name__}")
    if additive:
        if not mask.is_floating_point():
            raise TypeError(f"{where}: {name} must be a floating-point tensor (the mask is additive), got "
                            f"{mask.dtype}")
    elif mask.dtype not in _FLAGS:
        raise TypeError(f"{where}: {name} must be a bool or uint8 tensor (nonzero: masked), got {mask.dtype}; "
                        f"an additive mask needs mask_additive=True")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{where}: {name} must have shape {tuple(shape)}, got {tuple(mask.shape)}")


def _apply(scores: torch.Tensor, mask: torch.Tensor, additive: bool) -> torch.Tensor:
    # scores (batch, heads, Tq, Tk); mask broadcast to it
    if additive:
        return scores + mask.to(scores.dtype)
    return scores.masked_fill(mask.to(device=scores.device, dtype=torch.bool), float("-inf"))


def mask_softmax_dropout(scores: torch.Tensor, heads: int, pad_mask: Optional[torch.Tensor],
                         time_mask: Optional[torch.Tensor], additive: bool, dropout: float,
                         training: bool) -> torch.Tensor:
    """``dropout(softmax(scores + masks))`` over scores of shape (batch * heads, Tq, Tk); masks checked by the
    caller."""
    if pad_mask is not None or time_mask is not None:
        bh, tq, tk = scores.shape
        s = scores.view(bh // heads, heads, tq, tk)
        if pad_mask is not None:
            s = _apply(s, pad_mask[:, None, None, :], additive)
        if time_mask is not None:
            s = _apply(s, time_mask, additive)
        scores = s.reshape(bh, tq, tk)
    probs = F.softmax(scores, dim=-1)
    if training and dropout > 0:
        probs = F.dropout(probs, p=dropout, training=True)
    return probs


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, scale: float,
           pad_mask: Optional[torch.Tensor], time_mask: Optional[torch.Tensor], additive: bool, dropout: float,
           training: bool) -> torch.Tensor:
    """Scaled dot-product attention over ``q`` (Tq, B*H, d), ``k`` and ``v`` (Tk, B*H, d); returns (Tq, B, H*d)."""
    tq, bh, d = q.shape
    qb, kb, vb = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    scores = torch.baddbmm(qb.new_empty(bh, tq, kb.shape[1]), qb, kb.transpose(1, 2), beta=0.0, alpha=scale)
    probs = mask_softmax_dropout(scores, heads, pad_mask, time_mask, additive, dropout, training)
    context = torch.bmm(probs, vb)
    return context.transpose(0, 1).reshape(tq, bh // heads, heads * d)
