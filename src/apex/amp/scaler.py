"""Loss scaler: static or dynamic, with the seed's tunables.

Dynamic scaling: an overflow (inf/nan in the gradients) multiplies the scale by
``backoff_factor`` (never below ``min_loss_scale``) and resets the count of clean
steps; ``scale_window`` clean steps in a row multiply it by ``growth_factor``
(never above ``max_loss_scale``). A static scale never changes and never asks
for a step to be skipped.
"""

from __future__ import annotations

import math
from typing import Optional, Union


class LossScaler:
    def __init__(
        self,
        loss_scale: Union[str, float],
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        min_loss_scale: Optional[float] = None,
        max_loss_scale: float = 2.0**24,
        backoff_factor: float = 0.5,
    ) -> None:
        if loss_scale == "dynamic":
            self.dynamic = True
            self._loss_scale = float(min(max_loss_scale, init_scale))
        else:
            self.dynamic = False
            self._loss_scale = float(loss_scale)
        self._max_loss_scale = float(max_loss_scale)
        self._min_loss_scale = None if min_loss_scale is None else float(min_loss_scale)
        self._scale_seq_len = int(scale_window)
        self._growth_factor = float(scale_factor)
        self._backoff_factor = float(backoff_factor)
        self._unskipped = 0
        self._has_overflow = False

    def loss_scale(self) -> float:
        return self._loss_scale

    def clear_overflow_state(self) -> None:
        self._has_overflow = False

    def record_overflow(self, found: bool) -> None:
        if found:
            self._has_overflow = True

    def has_overflow(self) -> bool:
        return self._has_overflow

    def update_scale(self) -> bool:
        """Apply the outcome of one unscale; True means "skip the next step" (dynamic overflow only)."""
        if self._has_overflow and self.dynamic:
            should_skip = True
            new = self._loss_scale * self._backoff_factor
            if self._min_loss_scale is not None:
                new = max(self._min_loss_scale, new)
            self._loss_scale = new
            self._unskipped = 0
        else:
            should_skip = False
            self._unskipped += 1
        if self.dynamic and self._unskipped == self._scale_seq_len:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * self._growth_factor)
            self._unskipped = 0
        return should_skip

    def state(self) -> dict:
        return {"loss_scale": self._loss_scale, "unskipped": self._unskipped}

    def load(self, loss_scale: float, unskipped: int) -> None:
        self._loss_scale = float(loss_scale)
        self._unskipped = int(unskipped)

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, loss_scale={self._loss_scale}, unskipped={self._unskipped})"


def check_scale_value(name: str, value, allow_none: bool = False) -> Optional[float]:
    """A finite positive float (or None when allowed); raises TypeError/ValueError naming the option."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        expected = "a positive number or None" if allow_none else "a positive number"
        raise TypeError(f"amp.initialize: {name} must be {expected}, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"amp.initialize: {name} must be a finite positive number, got {value}")
    return value
