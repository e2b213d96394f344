"""``fast_mask_softmax_dropout_func(is_training, heads, inputs, pad_mask, mask_additive, dropout_prob)``: NVIDIA
Apex's masked softmax with dropout over attention scores of shape (batch * heads, Tq, Tk).

``pad_mask`` (batch, Tk) or None: bool / uint8 (nonzero: the key is padding, its scores -inf) or, with
``mask_additive``, floating-point and added to the scores. The softmax follows torch's rule for the scores' dtype
(float32 arithmetic for float16 / bfloat16) and dropout, with probability ``dropout_prob``, applies when
``is_training``. Differentiable in ``inputs``; the result has the inputs' dtype and shape."""

from __future__ import annotations

from apex._checks import check_floating, check_fraction, check_int
from apex.contrib.multihead_attn import attention

__all__ = ["fast_mask_softmax_dropout_func"]

_WHERE = "fast_mask_softmax_dropout_func"


def fast_mask_softmax_dropout_func(is_training, heads, inputs, pad_mask, mask_additive, dropout_prob):
    """See the module docstring."""
    for name, flag in (("is_training", is_training), ("mask_additive", mask_additive)):
        if not isinstance(flag, bool):
            raise TypeError(f"{_WHERE}: {name} must be a bool, got {type(flag).__name__}")
    heads = check_int(heads, f"{_WHERE}: heads", 1)
    check_floating(inputs, f"{_WHERE}: inputs")
    if inputs.dim() != 3 or inputs.shape[0] % heads:
        raise ValueError(f"{_WHERE}: inputs must have shape (batch * heads, Tq, Tk) with heads={heads}, got "
                         f"{tuple(inputs.shape)}")
    p = check_fraction(dropout_prob, f"{_WHERE}: dropout_prob")
    if pad_mask is not None:
        attention._check_mask(_WHERE, "pad_mask", pad_mask, (inputs.shape[0] // heads, inputs.shape[2]),
                              mask_additive)
        if pad_mask.device != inputs.device:
            raise ValueError(f"{_WHERE}: pad_mask must be on the inputs' device ({inputs.device}), got "
                             f"{pad_mask.device}")
    return attention.mask_softmax_dropout(inputs, heads, pad_mask, None, mask_additive, p, is_training)
