"""``SelfMultiheadAttn``: NVIDIA Apex's self-attention module (see :mod:`apex.contrib.multihead_attn.attention`
for the math and the masks)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from apex.contrib.multihead_attn import attention
from apex.contrib.multihead_attn._module import MultiheadAttnBase

__all__ = ["SelfMultiheadAttn"]


class SelfMultiheadAttn(MultiheadAttnBase):
    """``SelfMultiheadAttn(embed_dim, num_heads, dropout=0.0, bias=False, include_norm_add=False, impl="fast",
    separate_qkv_params=False, mask_additive=False)``.

    ``forward(query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None, is_training=True)``
    returns ``(output, None)`` with output of the query's shape (time, batch, embed_dim); ``key`` and ``value``
    must be ``query`` itself or None (the one input is projected to queries, keys and values); dropout applies
    when ``is_training`` is True, whatever the module's ``training`` flag says (upstream's rule).

    Parameters, under upstream's names: ``in_proj_weight`` (3E, E) (per head: its query, key and value rows) or,
    with ``separate_qkv_params``, ``q_weight``, ``k_weight``, ``v_weight`` (E, E); ``out_proj_weight``; the
    biases alike when ``bias``; the layer norm's with ``include_norm_add``. ``mask_additive``: the masks are
    floating-point and added to the scores (upstream refused it with the layer norm and with a time mask; both
    work here).
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=False, include_norm_add=False, impl="fast",
                 separate_qkv_params=False, mask_additive=False):
        super().__init__("SelfMultiheadAttn", embed_dim, num_heads, dropout, bias, include_norm_add, impl)
        for name, flag in (("separate_qkv_params", separate_qkv_params), ("mask_additive", mask_additive)):
            if not isinstance(flag, bool):
                raise TypeError(f"SelfMultiheadAttn: {name} must be a bool, got {type(flag).__name__}")
        self.separate_qkv_params = separate_qkv_params
        self.mask_additive = mask_additive
        e = self.embed_dim
        if separate_qkv_params:
            self.q_weight = nn.Parameter(torch.empty(e, e))
            self.k_weight = nn.Parameter(torch.empty(e, e))
            self.v_weight = nn.Parameter(torch.empty(e, e))
        else:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * e, e))
        self.out_proj_weight = nn.Parameter(torch.empty(e, e))
        if bias:
            if separate_qkv_params:
                self.q_bias = nn.Parameter(torch.empty(e))
                self.k_bias = nn.Parameter(torch.empty(e))
                self.v_bias = nn.Parameter(torch.empty(e))
            else:
                self.in_proj_bias = nn.Parameter(torch.empty(3 * e))
            self.out_proj_bias = nn.Parameter(torch.empty(e))
        else:
            for name in ("q_bias", "k_bias", "v_bias") if separate_qkv_params else ("in_proj_bias",):
                self.register_parameter(name, None)
            self.register_parameter("out_proj_bias", None)
        self._norm_parameters()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform weights (the stacked projection with gain sqrt(2): each of its three parts is initialised
        as an (E, E) matrix would be), zero biases, a unit layer norm."""
        if self.separate_qkv_params:
            for w in (self.q_weight, self.k_weight, self.v_weight):
                nn.init.xavier_uniform_(w)
        else:
            nn.init.xavier_uniform_(self.in_proj_weight, gain=math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj_weight)
        if self.bias:
            for b in (self.q_bias, self.k_bias, self.v_bias) if self.separate_qkv_params else (self.in_proj_bias,):
                nn.init.zeros_(b)
            nn.init.zeros_(self.out_proj_bias)
        self._reset_norm()

    def _per_head(self, parts, width):
        # three (E, ...) tensors into upstream's stacked layout: per head, its q, k and v rows
        h, d = self.num_heads, self.head_dim
        return torch.stack([p.reshape(h, d, *width) for p in parts], dim=1).reshape(3 * self.embed_dim, *width)

    def _input_projection(self):
        if not self.separate_qkv_params:
            return self.in_proj_weight, self.in_proj_bias
        weight = self._per_head((self.q_weight, self.k_weight, self.v_weight), (self.embed_dim,))
        bias = self._per_head((self.q_bias, self.k_bias, self.v_bias), ()) if self.bias else None
        return weight, bias

    def forward(self, query, key=None, value=None, key_padding_mask=None, need_weights=False, attn_mask=None,
                is_training=True):
        where = self._where
        self._check_input("query", query)
        self._same_or_none(where, "key", key, query, "query")
        self._same_or_none(where, "value", value, query, "query")
        t, b, _ = query.shape
        self._check_masks(t, t, b, key_padding_mask, attn_mask, is_training, self.mask_additive)
        x = self._norm(query) if self.include_norm_add else query
        weight, bias = self._input_projection()
        qkv = F.linear(x, weight, bias).view(t, b * self.num_heads, 3, self.head_dim)
        context = attention.attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], self.num_heads, self.scaling,
                                   key_padding_mask, attn_mask, self.mask_additive, self.dropout, is_training)
        out, _ = self._output(context, self.out_proj_bias)
        if self.include_norm_add:
            out = self._residual(query, out, is_training)
        return out, None
