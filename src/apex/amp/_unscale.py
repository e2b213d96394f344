"""Unscale + non-finite check of grads where they are, for every device and layout.

CPU tensors of one apex_C dtype take one apex_C pass over their address table (`_core.scale_many_`); the others
take torch's fused ``_amp_foreach_non_finite_check_and_unscale_`` (one launch per device and one host read for
the flag, where the per-tensor form would read one per grad), and plain torch ops where the backend lacks it.
Sparse grads are scaled in place through their values (an uncoalesced grad is scaled as it is: coalescing
would make a new tensor and leave the grad itself scaled).
"""

from __future__ import annotations

from typing import Dict, List

import torch

from .. import _core


def _unscale_fallback(tensors: List[torch.Tensor], inv: float, check: bool) -> bool:
    found = False
    for t in tensors:
        if check:
            values = t.coalesce().values() if t.is_sparse else t
            found = found or (bool(values.numel()) and not bool(torch.isfinite(values).all()))
        t.mul_(inv)
    return found


def unscale_(tensors: List[torch.Tensor], inv: float, check: bool) -> bool:
    """Multiply in place by ``inv``; True if any input value was inf/nan (only looked at when ``check``)."""
    if not tensors:
        return False
    if not check:
        if inv != 1.0:
            torch._foreach_mul_(tensors, inv)
        return False
    found = False
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for device, ts in by_device.items():
        if device.type == "cpu":
            by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
            for t in ts:
                by_dtype.setdefault(t.dtype, []).append(t)
            rest = []
            for group in by_dtype.values():
                if _core.kernel_many(group):  # one apex_C pass over the grads where they are
                    found |= _core._scale_gather_unchecked(group, inv, check=True)
                else:
                    rest += group
            if not rest:
                continue
            ts = rest
        if any(t.is_sparse for t in ts):
            found |= _unscale_fallback(ts, inv, check)
            continue
        bad = _core.torch_fused_unscale_(ts, inv)
        found |= _unscale_fallback(ts, inv, check) if bad is None else bad  # None: a backend without the op
    return found
