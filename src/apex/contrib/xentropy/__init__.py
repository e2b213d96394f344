"""``apex.contrib.xentropy``: NVIDIA Apex's fused softmax cross entropy with label smoothing (see
:mod:`apex.contrib.xentropy.softmax_xentropy`)."""

from apex.contrib.xentropy.softmax_xentropy import SoftmaxCrossEntropyLoss

__all__ = ["SoftmaxCrossEntropyLoss"]
