"""``apex.contrib.group_norm``: NVIDIA Apex's ``GroupNorm`` with an optional fused SiLU (see
:mod:`apex.contrib.group_norm.group_norm`)."""

from apex.contrib.group_norm.group_norm import GroupNorm

__all__ = ["GroupNorm"]
