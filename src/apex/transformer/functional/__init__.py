"""``apex.transformer.functional``: fused scale-mask softmax (:mod:`.fused_softmax`) and rotary position embeddings
(:mod:`.fused_rope`) under upstream's names."""

from apex.transformer.functional.fused_rope import (
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_2d,
    fused_apply_rotary_pos_emb_cached,
    fused_apply_rotary_pos_emb_thd,
)
from apex.transformer.functional.fused_softmax import FusedScaleMaskSoftmax, GenericFusedScaleMaskSoftmax

__all__ = [
    "FusedScaleMaskSoftmax",
    "GenericFusedScaleMaskSoftmax",
    "fused_apply_rotary_pos_emb",
    "fused_apply_rotary_pos_emb_2d",
    "fused_apply_rotary_pos_emb_cached",
    "fused_apply_rotary_pos_emb_thd",
]
