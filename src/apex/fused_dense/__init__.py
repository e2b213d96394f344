"""``apex.fused_dense``: NVIDIA Apex's ``FusedDense`` and ``FusedDenseGeluDense`` (see
:mod:`apex.fused_dense.fused_dense`)."""

from apex.fused_dense.fused_dense import (
    DenseNoBiasFunc,
    FusedDense,
    FusedDenseFunc,
    FusedDenseGeluDense,
    FusedDenseGeluDenseFunc,
)

__all__ = ["DenseNoBiasFunc", "FusedDense", "FusedDenseFunc", "FusedDenseGeluDense", "FusedDenseGeluDenseFunc"]
