"""``apex.contrib.sparsity``: NVIDIA Apex's automatic sparsity (ASP): 2:4 structured pruning of a model's weights
and masked training afterwards (see :mod:`apex.contrib.sparsity.asp` and
:mod:`apex.contrib.sparsity.sparse_masklib`)."""

from apex.contrib.sparsity.asp import ASP
from apex.contrib.sparsity.sparse_masklib import create_mask

__all__ = ["ASP", "create_mask"]
