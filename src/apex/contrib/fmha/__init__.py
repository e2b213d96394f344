"""``apex.contrib.fmha``: NVIDIA Apex's fused multi-head attention over packed variable-length sequences (BERT;
see :mod:`apex.contrib.fmha.fmha`)."""

from apex.contrib.fmha.fmha import FMHA, FMHAFun

__all__ = ["FMHA", "FMHAFun"]
