"""Flatten / unflatten of dense tensors: NVIDIA apex_C's two functions, behind ``apex_C.flatten`` / ``unflatten``.

``flatten(tensors)`` is one new 1-D tensor with the elements of every tensor, in order, each in its logical
(row-major) order. ``unflatten(flat, tensors)`` is the inverse as views: tensor k of the result views
``flat[offset_k : offset_k + numel_k]`` with the shape of ``tensors[k]``, so writing into the views writes into
``flat`` (the post-accumulation all-reduce idiom: scale grads into views of one buffer, all-reduce the buffer,
scale back). ``flat`` keeps its own dtype, which may differ from the tensors' (an fp16 buffer for fp32 grads), and
may be longer than the tensors need, as torch's ``_unflatten_dense_tensors`` allows.

Both check their arguments before touching anything and name the offending entry.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import torch

from apex._checks import check_dense

__all__ = ["flatten", "unflatten"]


def _dense_list(where: str, tensors: Any) -> List[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{where}: tensors must be a list or tuple of tensors, got {type(tensors).__name__}")
    for k, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: tensors[{k}] must be a tensor, got {type(t).__name__}")
        check_dense(t, f"{where}: tensors[{k}]")
    return list(tensors)


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new 1-D tensor with the elements of ``tensors`` one after another.

    Always new memory (torch's own flatten returns a view when given one contiguous tensor). The tensors must
    share a device; mixed dtypes are promoted as ``torch.cat`` promotes them. Raises
    TypeError for a non-sequence, a non-tensor, sparse or nested entry; ValueError for an empty sequence or mixed
    devices.
    """
    ts = _dense_list("apex_C.flatten", tensors)
    if not ts:
        raise ValueError("apex_C.flatten: expected at least one tensor, got an empty sequence")
    device = ts[0].device
    for k, t in enumerate(ts):
        if t.device != device:
            raise ValueError(f"apex_C.flatten: tensors[{k}] is on {t.device}, tensors[0] on {device}; expected "
                             "one device")
    return torch.cat([t.reshape(-1) for t in ts])


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Views of ``flat`` with the shapes of ``tensors``, consecutive from element 0.

    ``flat`` must be a 1-D dense tensor with at least as many elements as the tensors together (a longer one
    leaves its tail unused); its dtype and device are kept. Raises TypeError for a non-tensor, sparse or nested
    ``flat`` or bad ``tensors``; ValueError for a ``flat`` that is not 1-D or is too short.
    """
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"apex_C.unflatten: flat must be a tensor, got {type(flat).__name__}")
    check_dense(flat, "apex_C.unflatten: flat")
    ts = _dense_list("apex_C.unflatten", tensors)
    if flat.dim() != 1:
        raise ValueError(f"apex_C.unflatten: flat must be 1-D, got shape {tuple(flat.shape)}")
    need = sum(t.numel() for t in ts)
    if flat.numel() < need:
        raise ValueError(f"apex_C.unflatten: flat has {flat.numel()} elements; the {len(ts)} tensors need {need}")
    out = []
    offset = 0
    for t in ts:
        n = t.numel()
        out.append(flat.narrow(0, offset, n).view(t.shape))
        offset += n
    return out
