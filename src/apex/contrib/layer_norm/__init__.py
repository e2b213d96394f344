"""``apex.contrib.layer_norm``: NVIDIA Apex's ``FastLayerNorm`` (see :mod:`apex.contrib.layer_norm.layer_norm`)."""

from apex.contrib.layer_norm.layer_norm import FastLayerNorm, FastLayerNormFN

__all__ = ["FastLayerNorm", "FastLayerNormFN"]
