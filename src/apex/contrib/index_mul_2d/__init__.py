"""``apex.contrib.index_mul_2d``: NVIDIA Apex's fused ``in1[idx1] * in2`` (see
:mod:`apex.contrib.index_mul_2d.index_mul_2d`)."""

from apex.contrib.index_mul_2d.index_mul_2d import index_mul_2d

__all__ = ["index_mul_2d"]
