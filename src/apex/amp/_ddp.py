"""Hook point for ``combine_ddp``: all-reducing combined gradient buffers across ranks.

amp validates the option (it requires ``combine_grad``) and owns the flat
buffers; the distributed part belongs to ``apex.parallel.combine_ddp``
(:class:`apex.parallel.combine_ddp.CombineDDP`), which is the default backend.
Another backend can be installed with :func:`register_backend` (tests use this
to observe the calls).

A backend is a callable ``backend(session) -> hook``, called once by
``amp.initialize(..., combine_ddp=True)`` after every option was checked, with
the session (``models``, ``optimizers``, ``ddp_replica_count``,
``device_type``, ``properties``); the models are not cast yet. The hook object
may provide (amp calls only what exists):

``before_backward(combined_list, delay_unscale)``
    at ``scale_loss`` entry, after amp prepared each optimizer's grads, with the
    optimizers' :class:`apex.amp._combined.CombinedGrads` (None for an optimizer
    without combined grads);
``before_unscale(combined)``
    at every ``scale_loss`` exit that unscales, once per optimizer, after its
    grads were combined and before they are unscaled and checked;
``agree_overflow(found) -> bool``
    after the overflow check of an exit: the flag every rank must act on;
``teardown()``
    at ``amp.deinitialize()``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

_backend: Optional[Callable[[Any], Any]] = None


def register_backend(backend: Optional[Callable[[Any], Any]]) -> None:
    """Install a combine_ddp backend; None restores the default (apex.parallel's)."""
    global _backend
    if backend is not None and not callable(backend):
        raise TypeError(f"register_backend: expected a callable or None, got {type(backend).__name__}")
    _backend = backend


def registered() -> bool:
    """Whether a backend other than the default is installed."""
    return _backend is not None


def create(session: Any) -> Any:
    if _backend is not None:
        return _backend(session)
    from ..parallel.combine_ddp import CombineDDP  # torch.distributed is imported only when used

    return CombineDDP(session)


def call(hook: Any, name: str, *args: Any) -> Any:
    """``hook.name(*args)`` if the hook has that method, else None."""
    method = getattr(hook, name, None) if hook is not None else None
    return method(*args) if method is not None else None
