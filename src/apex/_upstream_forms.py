"""How upstream's fused ops present themselves, shared by apex.normalization, apex.contrib.layer_norm and apex.mlp.

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
        tensors = [t.to(low) if t is not None and t.is_floating_point() and t.dtype != torch.float64
                   and t.device.type == device_type else t for t in tensors]
    with torch.autocast(device_type, enabled=False):
        return fn(*tensors)


class FunctionForm:
    """Base of the classes standing in for upstream's ``torch.autograd.Function`` subclasses: each defines
    ``forward(ctx, ...)`` with upstream's argument names, running the functional math on the dtypes it is given
    (``ctx`` is not used); ``apply(...)`` is ``forward(None, ...)``, and autograd is torch's, through the ops
    ``forward`` runs."""

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> torch.Tensor:
        return cls.forward(None, *args, **kwargs)  # every subclass defines forward
