"""Pieces of the Ascend patch's ``apex.contrib.combine_tensors`` API beyond combining itself.

* :func:`get_aligned_storage_size`: the Ascend patch's slot size rule, ``ceil(n / align) * align
  + pad`` elements for a tensor whose storage holds ``n`` elements.
* :class:`CallableModule`: lets ``apex.contrib.combine_tensors`` be the *module* (so ``import
  apex.contrib.combine_tensors as ct; ct.combine_npu(...)`` works, as in the Ascend layout)
  and still be callable as the function (``from apex.contrib import combine_tensors;
  combine_tensors(params)``).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from apex import _device
from apex._checks import check_int

__all__ = ["CallableModule", "get_aligned_storage_size"]

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


def _storage_elements(tensor: torch.Tensor) -> int:
    """Elements of storage ``tensor`` holds: for an npu tensor in a private format what torch_npu reports
    (those formats pad the storage), else the elements the tensor spans from its first one (its numel when
    dense).

    torch_npu sizes the whole storage behind a tensor. The patch's combine kept a storage per tensor and
    moved its data pointer, so that size stayed the tensor's own; here a combined tensor is a view of the
    buffer's storage, and torch_npu would report the whole buffer. Base-format storage holds exactly the
    elements, so the span is that same per-tensor size, before and after combining.
    """
    if tensor.device.type == "npu" and _device.npu_has_private_format(tensor):
        native = _device._torch_npu_attr(("get_storage_size",))
        if native is not None:
            return int(native(tensor))
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.size(), tensor.stride()))


def get_aligned_storage_size(tensor: torch.Tensor, align: int = 16, pad: int = 32) -> int:
    """``ceil(n / align) * align + pad``: the elements the Ascend patch reserved for a tensor whose storage
    holds ``n`` elements (with the defaults: rounded up to 16 elements, plus 32 more).

    ``n`` is torch_npu's storage size for an npu tensor in a private format (which counts the format's
    padding), else the elements the tensor spans (its numel for a dense tensor), also after
    :func:`combine_npu` made it a view of the combined buffer: ``y.data_ptr() == x.data_ptr() +
    get_aligned_storage_size(x) * x.element_size()`` holds for consecutive ``x, y`` on every device, as
    with the patch. (For a base-format view such as ``x[1:]`` that is the view's span, where the patch
    reported the whole storage behind it.) This is the patch's rule, not this package's layout:
    :func:`apex.contrib.plan_layout` gives where ``combine_tensors`` puts each slot.

    Raises TypeError for a non-tensor or non-int ``align``/``pad``, ValueError for ``align < 1`` or
    ``pad < 0``, and RuntimeError (the patch's error type) for dtypes other than float32, float16 and
    bfloat16 (the patch accepted float32 and float16 only).
    """
    where = "get_aligned_storage_size"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: expected a tensor, got {type(tensor).__name__}")
    align = check_int(align, f"{where}: align", 1)
    pad = check_int(pad, f"{where}: pad", 0)
    if tensor.dtype not in _SUPPORTED:
        raise RuntimeError(f"{where}: combined tensors hold float32, float16 or bfloat16, got {tensor.dtype}")
    n = _storage_elements(tensor)
    return -(-n // align) * align + pad  # integer ceil: n / align in floats rounds past 2**53


class CallableModule(types.ModuleType):
    """A module that, when called, calls its attribute named by ``__call_target__``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, self.__call_target__)(*args, **kwargs)
