"""``EncdecMultiheadAttn``: NVIDIA Apex's encoder-decoder attention module (see
:mod:`apex.contrib.multihead_attn.attention` for the math and the masks)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from apex.contrib.multihead_attn import attention
from apex.contrib.multihead_attn._module import MultiheadAttnBase

__all__ = ["EncdecMultiheadAttn"]


class EncdecMultiheadAttn(MultiheadAttnBase):
    """``EncdecMultiheadAttn(embed_dim, num_heads, dropout=0.0, bias=False, include_norm_add=False, impl="fast")``.

    ``forward(query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None, is_training=True)``
    returns ``(output, None)``, output of the query's shape (Tq, batch, embed_dim): the queries are projected from
    ``query`` (the decoder's states, layer-normed first with ``include_norm_add``), keys and values from ``key``
    (the encoder's output, Tk x batch x embed_dim); ``value`` must be ``key`` itself or None. Masks are bool or
    uint8 (nonzero: masked): ``key_padding_mask`` (batch, Tk), ``attn_mask`` (Tq, Tk).

    Parameters, under upstream's names: ``in_proj_weight_q`` (E, E), ``in_proj_weight_kv`` (2E, E) (per head: its
    key rows, then its value rows), ``out_proj_weight``, the biases alike when ``bias`` (upstream's "fast"
    implementation refused biases; they work with either ``impl`` here), the layer norm's with
    ``include_norm_add``.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=False, include_norm_add=False, impl="fast"):
        super().__init__("EncdecMultiheadAttn", embed_dim, num_heads, dropout, bias, include_norm_add, impl)
        e = self.embed_dim
        self.in_proj_weight_q = nn.Parameter(torch.empty(e, e))
        self.in_proj_weight_kv = nn.Parameter(torch.empty(2 * e, e))
        self.out_proj_weight = nn.Parameter(torch.empty(e, e))
        if bias:
            self.in_proj_bias_q = nn.Parameter(torch.empty(e))
            self.in_proj_bias_kv = nn.Parameter(torch.empty(2 * e))
            self.out_proj_bias = nn.Parameter(torch.empty(e))
        else:
            for name in ("in_proj_bias_q", "in_proj_bias_kv", "out_proj_bias"):
                self.register_parameter(name, None)
        self._norm_parameters()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform weights (the stacked key/value projection with gain sqrt(1.5): each half is initialised
        as an (E, E) matrix would be), zero biases, a unit layer norm."""
        nn.init.xavier_uniform_(self.in_proj_weight_q)
        nn.init.xavier_uniform_(self.in_proj_weight_kv, gain=math.sqrt(1.5))
        nn.init.xavier_uniform_(self.out_proj_weight)
        if self.bias:
            for b in (self.in_proj_bias_q, self.in_proj_bias_kv, self.out_proj_bias):
                nn.init.zeros_(b)
        self._reset_norm()

    def forward(self, query, key, value=None, key_padding_mask=None, need_weights=False, attn_mask=None,
                is_training=True):
        where = self._where
        self._check_input("query", query)
        tq, b, _ = query.shape
        self._check_input("key", key, batch=b)
        self._same_or_none(where, "value", value, key, "key")
        tk = key.shape[0]
        self._check_masks(tq, tk, b, key_padding_mask, attn_mask, is_training, False)
        x = self._norm(query) if self.include_norm_add else query
        h, d = self.num_heads, self.head_dim
        q = F.linear(x, self.in_proj_weight_q, self.in_proj_bias_q).view(tq, b * h, d)
        kv = F.linear(key, self.in_proj_weight_kv, self.in_proj_bias_kv).view(tk, b * h, 2, d)
        context = attention.attend(q, kv[:, :, 0], kv[:, :, 1], h, self.scaling, key_padding_mask, attn_mask,
                                   False, self.dropout, is_training)
        out, _ = self._output(context, self.out_proj_bias)
        if self.include_norm_add:
            out = self._residual(query, out, is_training)
        return out, None
