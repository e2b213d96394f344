"""How upstream's fused ops present themselves, shared by apex.normalization, apex.contrib.layer_norm, apex.mlp,
apex.fused_dense and apex._autocast_utils.

The autocast rule (:func:`run_as_fused`): under ``torch.autocast`` on the input's device, upstream's fused ops cast
their floating-point tensor arguments to the autocast dtype and then run with autocast off, so the output has the
autocast dtype whatever autocast's own per-op lists say (``F.layer_norm`` alone would run in float32). float64
tensors and tensors on another device are left as they are.

The ``torch.autograd.Function`` names (:class:`FunctionForm`): code calls upstream's ``Cls.apply(...)`` and
inspects ``Cls.forward`` (Megatron-core checks ``'memory_efficient' in inspect.getfullargspec(Cls.forward).args``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know: never on there
        return False


def run_as_fused(device_type: str, fn: Callable[..., torch.Tensor], tensors: Sequence[Optional[torch.Tensor]],
                 cast: bool = True) -> torch.Tensor:
    """``fn(*tensors)`` under upstream's autocast rule for ``device_type``: with autocast on there, the tensors
    (with ``cast``) are cast to the autocast dtype and ``fn`` runs with autocast off; None entries stay None."""
    if not _autocast_on(device_type):
        return fn(*tensors)
    if cast:
        low = torch.get_autocast_dtype(device_type)
        tensors = [t.to(low) if _castable(t, device_type) else t for t in tensors]
    with torch.autocast(device_type, enabled=False):
        return fn(*tensors)


def _castable(t: Any, device_type: str) -> bool:
    # autocast's own rule: floating point but never float64, and only tensors on the autocast device
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
            and t.device.type == device_type)


def cast_for_autocast(value: Any) -> Any:
    """``value`` with each floating-point tensor (also inside lists, tuples and dicts) cast to the autocast dtype
    of its own device where autocast is on there; float64 tensors, other values and tensors on devices without
    autocast come back as they are (the same objects), and so does a container in which nothing was cast."""
    if isinstance(value, torch.Tensor):
        kind = value.device.type
        if _castable(value, kind) and _autocast_on(kind):
            return value.to(torch.get_autocast_dtype(kind))
        return value
    if isinstance(value, (list, tuple)) and not isinstance(value, str):
        items = [cast_for_autocast(v) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        if isinstance(value, list):
            return items
        if hasattr(type(value), "_fields"):  # a namedtuple keeps its class
            return type(value)(*items)
        return tuple(items)
    if isinstance(value, dict):
        cast = {k: cast_for_autocast(v) for k, v in value.items()}
        return value if all(cast[k] is v for k, v in value.items()) else cast
    return value


class FunctionForm:
    """Base of the classes standing in for upstream's ``torch.autograd.Function`` subclasses: each defines
    ``forward(ctx, ...)`` with upstream's argument names, running the functional math on the dtypes it is given
    (``ctx`` is not used); ``apply(...)`` is ``forward(None, ...)``, and autograd is torch's, through the ops
    ``forward`` runs."""

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> torch.Tensor:
        return cls.forward(None, *args, **kwargs)  # every subclass defines forward
