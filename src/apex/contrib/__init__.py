"""Extras beyond amp: combined (flat-buffer) tensors, as in the Ascend patch."""

from apex.contrib import combine_tensors as _combine_tensors
from apex.contrib.combine_tensors import *  # noqa: F403  (re-exports exactly combine_tensors.__all__)

__all__ = list(_combine_tensors.__all__)
