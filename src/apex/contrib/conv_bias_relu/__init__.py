"""``apex.contrib.conv_bias_relu``: NVIDIA Apex's fused 2-D convolution + bias (+ mask) (+ ReLU) functions (see
:mod:`apex.contrib.conv_bias_relu.conv_bias_relu`)."""

from apex.contrib.conv_bias_relu.conv_bias_relu import (
    ConvBias,
    ConvBiasMaskReLU,
    ConvBiasReLU,
    ConvFrozenScaleBiasReLU,
)

__all__ = ["ConvBias", "ConvBiasMaskReLU", "ConvBiasReLU", "ConvFrozenScaleBiasReLU"]
