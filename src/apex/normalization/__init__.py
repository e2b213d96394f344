"""Fused layer norm and RMS norm modules with NVIDIA Apex's names, on every device.

Upstream's classes need its ``fused_layer_norm_cuda`` extension on CUDA; these run torch's own
kernels on CPU, CUDA and NPU with the same signatures, parameters and results (see
:mod:`apex.normalization.fused_layer_norm`), so code importing them (e.g. transformers' T5)
runs anywhere.
"""

from apex.normalization.fused_layer_norm import (
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
    fused_layer_norm,
    fused_layer_norm_affine,
    fused_rms_norm,
    fused_rms_norm_affine,
    mixed_dtype_fused_layer_norm_affine,
    mixed_dtype_fused_rms_norm_affine,
)

__all__ = [
    "FusedLayerNorm",
    "FusedRMSNorm",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "fused_layer_norm",
    "fused_layer_norm_affine",
    "fused_rms_norm",
    "fused_rms_norm_affine",
    "mixed_dtype_fused_layer_norm_affine",
    "mixed_dtype_fused_rms_norm_affine",
]
