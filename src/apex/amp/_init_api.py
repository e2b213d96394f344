"""``amp.init()``: upstream amp's older entry point, process-wide O1 casts with a handle.

``amp.init()`` checks its arguments, deactivates a handle a previous
``amp.init`` left active (casts never stack), installs the casts of
``_global_casts`` (plus the functions named with ``register_*_function``) and
returns an ``AmpHandle``; ``enabled=False`` returns a ``NoOpHandle`` and patches
nothing. The handle is recorded as ``_amp_state.handle``.
"""

from __future__ import annotations

from typing import Any, Union

import torch

from ._amp_state import _amp_state, logger
from ._casts import check_registry
from .handle import AmpHandle, NoOpHandle, _check_loss_scale


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"amp.init: {name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def init(enabled: bool = True, loss_scale: Union[str, float] = "dynamic", enable_caching: bool = True,
         verbose: bool = False, allow_banned: bool = False, patch_type: torch.dtype = torch.float16):
    """Start O1 casting of torch's listed functions process-wide; returns the handle (see docs/amp.md).

    ``loss_scale``: "dynamic" or a positive number, for ``handle.scale_loss``
    and ``handle.wrap_optimizer``. ``enable_caching``: cast each parameter once
    per iteration. ``allow_banned``: run the banned functions
    (``binary_cross_entropy``) in float32 instead of raising.
    ``patch_type``: the low-precision dtype, torch.float16 or torch.bfloat16.
    """
    for name, value in (("enabled", enabled), ("enable_caching", enable_caching), ("verbose", verbose),
                        ("allow_banned", allow_banned)):
        _check_bool(name, value)
    loss_scale = _check_loss_scale(loss_scale)
    if patch_type not in (torch.float16, torch.bfloat16):
        raise ValueError(f"amp.init: patch_type must be torch.float16 or torch.bfloat16, got {patch_type!r}")

    if enabled:
        check_registry("amp.init")  # before the earlier handle is touched

    previous = _amp_state.init_handle
    replaced = isinstance(previous, AmpHandle) and previous.is_active()
    if replaced:
        previous._deactivate()
    if not enabled:
        handle: Any = NoOpHandle()
    else:
        handle = AmpHandle(loss_scale=loss_scale, enable_caching=enable_caching, verbose=verbose,
                           patch_type=patch_type, allow_banned=allow_banned)
        try:
            handle._activate()  # all or nothing
        except BaseException:
            if replaced:
                previous._activate()
            raise
    if replaced:
        logger.warning("apex.amp: amp.init was called while an earlier amp.init handle was active; the earlier "
                       "handle is deactivated")
    _amp_state.handle = handle
    _amp_state.init_handle = handle
    return handle
