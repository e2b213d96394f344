"""``apex.transformer.layers``: the layer norms of NVIDIA Apex's Megatron-style package (see
:mod:`apex.transformer.layers.layer_norm`)."""

from apex.transformer.layers.layer_norm import FastLayerNorm, FusedLayerNorm, MixedFusedLayerNorm

__all__ = ["FastLayerNorm", "FusedLayerNorm", "MixedFusedLayerNorm"]
