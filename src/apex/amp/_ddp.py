"""Hook point for ``combine_ddp``: all-reducing combined gradient buffers across ranks.

amp validates the option (it requires ``combine_grad``) and owns the flat
buffers; the distributed part (broadcast of params from rank 0, buffer-length
agreement across ranks, bucketed all-reduce of the flat grads pre-divided by
the world size) belongs to ``apex.parallel``, which plugs in here with
:func:`register_backend`.

A backend is a callable ``backend(session) -> hook``; it is called once by
``amp.initialize(..., combine_ddp=True)`` with the session (``models``,
``optimizers``, ``ddp_replica_count``, ``device_type``) and may return None or
an object with ``before_unscale(combined)``, called at every ``scale_loss`` exit
with that optimizer's :class:`apex.amp._combined.CombinedGrads` (its
``flat_buffers()``) after the grads were combined and before they are
unscaled.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

_backend: Optional[Callable[[Any], Any]] = None


def register_backend(backend: Optional[Callable[[Any], Any]]) -> None:
    """Install (or, with None, remove) the combine_ddp backend."""
    global _backend
    if backend is not None and not callable(backend):
        raise TypeError(f"register_backend: expected a callable or None, got {type(backend).__name__}")
    _backend = backend


def registered() -> bool:
    return _backend is not None


def create(session: Any) -> Any:
    if _backend is None:
        raise RuntimeError(
            "combine_ddp=True needs the combined-buffer all-reduce of apex.parallel, and no combine_ddp backend "
            "is registered (apex.amp._ddp.register_backend)"
        )
    return _backend(session)
