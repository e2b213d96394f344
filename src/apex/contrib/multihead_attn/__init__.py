"""``apex.contrib.multihead_attn``: NVIDIA Apex's sequence-first multi-head attention modules,
``SelfMultiheadAttn`` and ``EncdecMultiheadAttn``, and ``fast_mask_softmax_dropout_func`` (see
:mod:`apex.contrib.multihead_attn.attention`)."""

from apex.contrib.multihead_attn.encdec_multihead_attn import EncdecMultiheadAttn
from apex.contrib.multihead_attn.mask_softmax_dropout_func import fast_mask_softmax_dropout_func
from apex.contrib.multihead_attn.self_multihead_attn import SelfMultiheadAttn

__all__ = ["EncdecMultiheadAttn", "SelfMultiheadAttn", "fast_mask_softmax_dropout_func"]
