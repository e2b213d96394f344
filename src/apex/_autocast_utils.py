"""NVIDIA Apex's autocast helpers, which scripts and libraries written against Apex import by name
(``from apex._autocast_utils import _cast_if_autocast_enabled``: NeMo's fused softmax and layer norm,
Megatron-style test utilities reading ``_get_autocast_dtypes``).

Upstream asked CUDA's autocast only. Here each tensor is judged on its own device, by the rule of
:func:`apex._upstream_forms.run_as_fused`: where autocast is on for that device type, a floating-point tensor other
than float64 is cast to that device's autocast dtype. So on CUDA the helpers do what upstream's did, and on an Ascend
NPU or the CPU the same code casts for ``torch.autocast("npu" | "cpu")``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from apex import _device
from apex._upstream_forms import _autocast_on, cast_for_autocast

__all__ = ["_cast_if_autocast_enabled"]


def _get_autocast_dtypes() -> List[torch.dtype]:
    """The low-precision dtypes autocast can run in on the detected device: ``[torch.half, torch.bfloat16]`` where
    that device computes in bfloat16 (any CPU; CUDA from compute capability 8.0; Ascend 910B), else
    ``[torch.half]``. Test suites parametrize over it."""
    return [torch.half, torch.bfloat16] if _device.bf16_supported() else [torch.half]


def _get_current_dtype(dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """The dtype an op runs in now on the detected device: the autocast dtype while autocast is on there, else
    ``torch.float32``. ``dtype`` is accepted and not used, as upstream (whose ``torch.float or dtype`` is always
    float32)."""
    kind = _device.detect_device()
    if _autocast_on(kind):
        return torch.get_autocast_dtype(kind)
    return torch.float32


def _cast_if_autocast_enabled(*args: Any) -> Tuple[Any, ...]:
    """``args`` as a tuple, each floating-point tensor in it (also inside lists, tuples and dicts) cast to the
    autocast dtype of its device where autocast is on there; anything else, float64 tensors included, unchanged.
    With autocast off everywhere the arguments come back as they are (upstream returned the same tuple)."""
    return tuple(cast_for_autocast(a) for a in args)
