"""Process-wide amp state.

Kept under upstream's names (``apex.amp._amp_state._amp_state`` with
``opt_properties``, ``loss_scalers``, ``verbosity``, ``handle``,
``allow_incoming_model_not_fp32``, ``min_loss_scale``, ``max_loss_scale``,
``hard_override``) because training code and test suites in the wild read and
set them: the current loss scale as ``amp._amp_state.loss_scalers[0].loss_scale()``,
``_amp_state.handle._deactivate()`` to stop O1's casts,
``allow_incoming_model_not_fp32 = True`` to pass a model that is not float32
to ``amp.initialize``.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, List, Optional

logger = logging.getLogger("apex.amp")


class AmpState:
    def __init__(self) -> None:
        self.opt_properties: Optional[Any] = None  # Properties of the active session
        self.loss_scalers: List[Any] = []
        self.verbosity: int = 1
        # The handle of the latest amp.init() or amp.initialize() (None before either).
        self.handle: Optional[Any] = None
        # The latest amp.init() handle: amp.initialize replaces ``handle`` with its own, and the process-wide casts
        # of an amp.init before it must still end at the next amp.init or amp.deinitialize().
        self.init_handle: Optional[Any] = None
        # True lets amp.initialize accept params and buffers that are not float32 (upstream's escape hatch).
        self.allow_incoming_model_not_fp32: bool = False
        # The latest amp.initialize's loss-scale bounds (upstream records them here).
        self.min_loss_scale: Optional[float] = None
        self.max_loss_scale: float = 2.0**24
        # Upstream's switch to turn option conflicts into warnings; kept for code that sets it. Conflicts
        # always raise here (see _properties).
        self.hard_override: bool = False
        self.session: Optional[Any] = None  # the active _Session (frontend)
        # Every session started and not torn down yet (initialize may be called more than once), held weakly: an
        # earlier session lives as long as one of its models or optimizers does (their patched methods reference
        # it), so a script that initializes new models again and again does not keep every earlier one alive.
        self._sessions: List[weakref.ref] = []

    @property
    def sessions(self) -> List[Any]:
        """The sessions still alive and not torn down, oldest first."""
        return [s for s in (ref() for ref in self._sessions) if s is not None]

    def add_session(self, session: Any) -> None:
        self._sessions = [ref for ref in self._sessions if ref() is not None]
        self._sessions.append(weakref.ref(session))

    def clear_sessions(self) -> None:
        self._sessions = []


_amp_state = AmpState()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def maybe_log(msg: str, *args: Any, level: int = logging.INFO, rank0: bool = False) -> None:
    """amp's messages (options chosen, skipped steps): through the ``apex.amp`` logger when the program configured
    logging (a handler anywhere from ``apex.amp`` up to the root logger), else printed to stdout, as upstream's amp
    printed them, so a script that never set up logging still sees "Gradient overflow. Skipping step" lines.
    ``rank0`` messages (the banner) print on rank 0 only. ``verbosity=0`` keeps them at DEBUG, never printed.
    (amp's warnings go to the logger directly: unconfigured, Python's last-resort handler prints them on stderr,
    which is why apex.amp has no NullHandler.)"""
    if _amp_state.verbosity <= 0:
        logger.log(logging.DEBUG, msg, *args)
        return
    if logger.hasHandlers():
        logger.log(level, msg, *args)
        return
    if logger.level != logging.NOTSET and not logger.isEnabledFor(level):
        return  # a level set on apex.amp itself still decides
    if rank0 and _rank() != 0:
        return
    print(msg % args if args else msg, flush=True)


def master_params(optimizer):
    """Yield the params the optimizer updates: the fp32 masters under O2, the model params otherwise.

    This is what gradient clipping should see between ``scale_loss`` exit and ``step()``. A generator, as
    upstream's; a non-optimizer is refused at the call, not at the first iteration.
    """
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, (list, tuple)):
        raise TypeError(f"amp.master_params: expected an optimizer (an object with param_groups), got "
                        f"{type(optimizer).__name__}")
    return (p for group in groups for p in group["params"])
