"""Extras beyond amp: combined (flat-buffer) tensors, as in the Ascend patch.

``apex.contrib.combine_tensors`` is the submodule (``import apex.contrib.combine_tensors as ct``
gives ``ct.combine_npu``, ``ct.get_part_combined_tensor``, ...), and it is callable: calling it
calls :func:`apex.contrib.combine_tensors.combine_tensors`, so ``from apex.contrib import
combine_tensors; combine_tensors(params)`` works too. Every other public name of the submodule
is re-exported here.
"""

from apex.contrib import combine_tensors as _combine_tensors
from apex.contrib.combine_tensors import *  # noqa: F403  (re-exports exactly combine_tensors.__all__)

# The star import bound the function over the submodule's name; the callable submodule serves both uses.
combine_tensors = _combine_tensors

__all__ = list(_combine_tensors.__all__)
