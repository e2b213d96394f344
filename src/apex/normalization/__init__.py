"""Fused layer norm and RMS norm modules with NVIDIA Apex's names, on every device.

Upstream's classes need its ``fused_layer_norm_cuda`` extension on CUDA; these run torch's own
kernels on CPU, CUDA and NPU with the same signatures, parameters and results, so code
importing them (e.g. transformers' T5) runs anywhere. The functional forms
(``fused_layer_norm_affine``, ``fused_rms_norm``, ``mixed_dtype_fused_layer_norm_affine``, ...)
live in :mod:`apex.normalization.fused_layer_norm`, as upstream's do; they are not re-exported
here, so that name keeps meaning the submodule.
"""

from apex.normalization.fused_layer_norm import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm"]
