"""Upstream's rule for its fused modules under autocast, shared by apex.normalization and apex.mlp.

Under ``torch.autocast`` on the input's device, upstream's fused ops cast their floating-point tensor arguments to
the autocast dtype and then run with autocast off, so the output has the autocast dtype whatever autocast's own
per-op lists say (``F.layer_norm`` alone would run in float32). float64 tensors and tensors on another device are
left as they are.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch


def autocast_on(device_type: str) -> bool:
    """Whether autocast is enabled for ``device_type`` (False for a device type autocast does not know)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def cast_to_autocast_dtype(device_type: str, tensors: Sequence[Optional[torch.Tensor]]
                           ) -> Tuple[Optional[torch.Tensor], ...]:
    """``tensors`` with every floating-point one on ``device_type`` (float64 excepted) cast to the autocast dtype
    of that device; None entries and the others unchanged."""
    low = torch.get_autocast_dtype(device_type)
    return tuple(t.to(low) if t is not None and t.is_floating_point() and t.dtype != torch.float64
                 and t.device.type == device_type else t for t in tensors)
