"""Process-wide amp state.

Kept under upstream's names (``apex.amp._amp_state._amp_state`` with
``opt_properties``, ``loss_scalers`` and ``verbosity``) because training code
in the wild reads the current loss scale as
``amp._amp_state.loss_scalers[0].loss_scale()``.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

logger = logging.getLogger("apex.amp")


class AmpState:
    def __init__(self) -> None:
        self.opt_properties: Optional[Any] = None  # Properties of the active session
        self.loss_scalers: List[Any] = []
        self.verbosity: int = 1
        self.session: Optional[Any] = None  # the active _Session (frontend)
        # Every session ever started and not yet torn down (initialize may be called more than once).
        self.sessions: List[Any] = []


_amp_state = AmpState()


def maybe_log(msg: str, *args: Any, level: int = logging.INFO) -> None:
    """Log through ``apex.amp`` unless verbosity is 0 (then only at DEBUG)."""
    logger.log(level if _amp_state.verbosity > 0 else logging.DEBUG, msg, *args)


def master_params(optimizer):
    """Yield the params the optimizer updates: the fp32 masters under O2, the model params otherwise.

    This is what gradient clipping should see between ``scale_loss`` exit and ``step()``.
    """
    for group in optimizer.param_groups:
        yield from group["params"]
