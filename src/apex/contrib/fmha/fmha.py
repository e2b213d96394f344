"""NVIDIA Apex's ``FMHAFun`` and ``FMHA``: self-attention over sequences packed end to end (no padding), as MLPerf
BERT feeds it, on every device.

``FMHAFun.apply(qkv, cu_seqlens, p_dropout, max_s, is_training, zero_tensors)``: ``qkv`` of shape
(total_tokens, 3, heads, head_dim) holding each token's query, key and value, ``cu_seqlens`` the int32 offsets of
the sequences (batch + 1 of them, from 0 to total_tokens). Each token attends to the tokens of its own sequence::

    context = dropout(softmax(q k^T / sqrt(head_dim))) v          per sequence and head

with the scores and the softmax in float32 and the probabilities rounded to the inputs' dtype before the product
with the values (what upstream's kernels and its test's reference do); dropout with ``p_dropout`` only when
``is_training``. The result has shape (total_tokens, heads, head_dim) and the inputs' dtype; the gradient flows to
``qkv``. ``max_s`` chose among upstream's kernels (sequences up to 128, 256, 384 or 512 tokens, head_dim 64, fp16);
here any length, head size and floating dtype work, and ``max_s`` must be at least the longest sequence.
``zero_tensors`` is accepted (upstream zeroed its work buffers with it).

The sequences are gathered into one padded batch for a single batched product, keys beyond each length masked,
and scattered back; reading the lengths waits for the device once per call. ``FMHA(config)``: the module over it,
``forward(qkv, cu_seqlens, max_s, is_training=True, zero_tensors=False)`` with ``qkv`` (total, 3 * hidden) and a
config giving ``attention_probs_dropout_prob``, ``num_attention_heads`` and ``hidden_size``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from apex._checks import check_floating, check_fraction, check_int
from apex._upstream_forms import FunctionForm

__all__ = ["FMHA", "FMHAFun"]

_WHERE = "FMHAFun"


def _check(qkv, cu_seqlens, p_dropout, max_s, is_training, zero_tensors):
    check_floating(qkv, f"{_WHERE}: qkv")
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"{_WHERE}: qkv must have shape (total_tokens, 3, heads, head_dim), got {tuple(qkv.shape)}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64) \
            or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        got = (f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor)
               else type(cu_seqlens).__name__)
        raise TypeError(f"{_WHERE}: cu_seqlens must be a 1-D int32 tensor of batch + 1 offsets, got {got}")
    p = check_fraction(p_dropout, f"{_WHERE}: p_dropout")
    limit = check_int(max_s, f"{_WHERE}: max_s", 1)
    for name, flag in (("is_training", is_training), ("zero_tensors", zero_tensors)):
        if not isinstance(flag, bool):
            raise TypeError(f"{_WHERE}: {name} must be a bool, got {type(flag).__name__}")
    offsets = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    if offsets[0] != 0 or offsets[-1] != qkv.shape[0] or any(n < 0 for n in lengths):
        raise ValueError(f"{_WHERE}: cu_seqlens must rise from 0 to total_tokens ({qkv.shape[0]}), got "
                         f"{offsets[:8]}{'...' if len(offsets) > 8 else ''}")
    if lengths and max(lengths) > limit:
        raise ValueError(f"{_WHERE}: a sequence has {max(lengths)} tokens, more than max_s ({limit})")
    return p, lengths


def _attention(qkv: torch.Tensor, lengths, p: float, training: bool) -> torch.Tensor:
    total, _, heads, d = qkv.shape
    batch, longest = len(lengths), max(lengths, default=0)
    if total == 0 or batch == 0:
        return qkv.new_zeros(total, heads, d) + qkv.sum() * 0  # keeps the graph for an empty batch
    device = qkv.device
    lens = torch.tensor(lengths, device=device)
    pos = torch.arange(longest, device=device)
    valid = pos[None, :] < lens[:, None]  # (batch, longest)
    seq = torch.repeat_interleave(torch.arange(batch, device=device), lens)
    starts = torch.cumsum(lens, 0) - lens
    slot = seq * longest + (torch.arange(total, device=device) - starts[seq])
    padded = qkv.new_zeros(batch * longest, 3, heads, d).index_copy(0, slot, qkv)
    q, k, v = padded.view(batch, longest, 3, heads, d).permute(2, 0, 3, 1, 4)  # each (batch, heads, L, d)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(qkv.dtype)
    if training and p > 0:
        probs = F.dropout(probs, p=p, training=True)
    context = torch.matmul(probs, v)  # (batch, heads, L, d)
    return context.transpose(1, 2).reshape(batch * longest, heads, d).index_select(0, slot)


class FMHAFun(FunctionForm):
    """Upstream's ``torch.autograd.Function``: ``FMHAFun.apply(qkv, cu_seqlens, p_dropout, max_s, is_training,
    zero_tensors)``; autograd through torch's ops. See the module docstring."""

    @staticmethod
    def forward(ctx, qkv, cu_seqlens, p_dropout, max_s, is_training, zero_tensors):
        p, lengths = _check(qkv, cu_seqlens, p_dropout, max_s, is_training, zero_tensors)
        return _attention(qkv, lengths, p, is_training)


class FMHA(nn.Module):
    """``FMHA(config)``; see the module docstring."""

    def __init__(self, config):
        super().__init__()
        try:
            self.p_dropout = check_fraction(config.attention_probs_dropout_prob, "FMHA: attention_probs_dropout_prob")
            self.h = check_int(config.num_attention_heads, "FMHA: num_attention_heads", 1)
            self.hidden_size = check_int(config.hidden_size, "FMHA: hidden_size", 1)
        except AttributeError as err:
            raise TypeError(f"FMHA: config needs attention_probs_dropout_prob, num_attention_heads and hidden_size "
                            f"({err})") from None
        if self.hidden_size % self.h:
            raise ValueError(f"FMHA: hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                             f"({self.h})")
        self.d = self.hidden_size // self.h

    def forward(self, qkv, cu_seqlens, max_s, is_training=True, zero_tensors=False):
        if not isinstance(qkv, torch.Tensor) or qkv.shape[-1] != 3 * self.hidden_size:
            got = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
            raise ValueError(f"FMHA: qkv must have shape (total_tokens, {3 * self.hidden_size}), got {got}")
        context = FMHAFun.apply(qkv.view(-1, 3, self.h, self.d), cu_seqlens, self.p_dropout, max_s, is_training,
                                zero_tensors)
        return context.view(-1, self.hidden_size)
