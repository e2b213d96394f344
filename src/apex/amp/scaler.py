"""Loss scaler: static or dynamic, with the Ascend patch's tunables (growth/backoff factors, window, min/max scale).

Dynamic scaling: an overflow (inf/nan in the gradients) multiplies the scale by
``backoff_factor`` (never below ``min_loss_scale``, and without one never below 2**-126,
the smallest normal float32: a float32 loss times a smaller scale is zero or subnormal,
and halving on would reach 0, whose reciprocal the unscale cannot take) and resets the
count of clean steps; ``scale_window`` clean steps in a row multiply it by ``growth_factor``
(never above ``max_loss_scale``). A static scale never changes and never asks
for a step to be skipped.

Every value that reaches a scaler is checked where it enters (constructor,
``load``): a non-finite or non-positive scale would skip every later step (or
silently zero the gradients), so it is rejected with nothing changed. A loaded
count of clean steps at or above ``scale_window`` (a checkpoint written with a
larger window) is accepted: the growth test is ``>=``, so the next clean step
grows the scale and restarts the count.
"""

from __future__ import annotations

import math
import re
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from .._checks import check_int, real_number

_SMALLEST_SCALE = 2.0 ** -126  # the smallest normal float32: the floor of a dynamic backoff without min_loss_scale


def _number(where: str, name: str, value: Any) -> float:
    """A real number (a 1-element tensor is read out); TypeError otherwise."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{where}: {name} must be a number, got a {value.dtype} tensor of shape "
                            f"{tuple(value.shape)}")
        value = value.item()
    number = real_number(value)
    if number is None:
        raise TypeError(f"{where}: {name} must be a number, got {value!r} ({type(value).__name__})")
    return float(number)


def _positive(where: str, name: str, value: Any) -> float:
    value = _number(where, name, value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: {name} must be a finite positive number, got {value}")
    return value


# A loss scale and its inverse (the unscale factor) must both be normal float32 numbers: outside this range the
# scaled loss or the unscaled grads overflow or flush to zero in every step, and no overflow check can catch it.
SCALE_RANGE = (2.0 ** -126, 2.0 ** 126)


def in_scale_range(where: str, name: str, value: float) -> float:
    lo, hi = SCALE_RANGE
    if not lo <= value <= hi:
        raise ValueError(f"{where}: {name} must be in [2**-126, 2**126] (its inverse must be a normal float32 too), "
                         f"got {value}")
    return value


def _scale(where: str, name: str, value: Any) -> float:
    return in_scale_range(where, name, _positive(where, name, value))


class LossScaler:
    """``loss_scale``: ``"dynamic"`` or a finite positive number (a static scale).

    Raises TypeError/ValueError for a non-number or a non-finite / non-positive scale or factor,
    ``scale_window`` < 1, ``growth`` < 1, ``backoff`` > 1, or ``min_loss_scale > max_loss_scale``.
    Upstream's ``_overflow_buf`` flag protocol is kept (see that property).
    """

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
        where = "LossScaler"
        max_loss_scale = _scale(where, "max_loss_scale", max_loss_scale)
        min_loss_scale = None if min_loss_scale is None else _scale(where, "min_loss_scale", min_loss_scale)
        if min_loss_scale is not None and min_loss_scale > max_loss_scale:
            raise ValueError(f"{where}: min_loss_scale ({min_loss_scale}) is larger than max_loss_scale "
                             f"({max_loss_scale})")
        growth = _positive(where, "scale_factor", scale_factor)
        if growth < 1.0:
            raise ValueError(f"{where}: scale_factor must be >= 1, got {growth}")
        backoff = _positive(where, "backoff_factor", backoff_factor)
        if backoff > 1.0:
            raise ValueError(f"{where}: backoff_factor must be in (0, 1], got {backoff}")
        window = check_int(scale_window, f"{where}: scale_window", 1, integral_float=True)
        if loss_scale == "dynamic":
            self.dynamic = True
            # clamped into [min, max] at both ends: an initial scale below min_loss_scale would otherwise be
            # raised to it by the first overflow's back-off
            scale = min(max_loss_scale, _scale(where, "init_scale", init_scale))
            if min_loss_scale is not None:
                scale = max(min_loss_scale, scale)
        elif isinstance(loss_scale, str):
            raise ValueError(f"{where}: loss_scale must be 'dynamic' or a positive number, got {loss_scale!r}")
        else:
            self.dynamic = False
            scale = _scale(where, "loss_scale", loss_scale)
        self._loss_scale = scale
        self._max_loss_scale = max_loss_scale
        self.carried_overflow = False  # found at a delay_overflow_check exit, not yet acted on (see scale_loss)
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = window
        self._growth_factor = growth
        self._backoff_factor = backoff
        self._unskipped = 0
        self._has_overflow = False
        self._overflow_flag: Optional[torch.Tensor] = None

    def loss_scale(self) -> float:
        return self._loss_scale

    @property
    def _overflow_buf(self) -> torch.Tensor:
        """Upstream's overflow flag: a one-element tensor that multi-tensor ops (``amp_C.multi_tensor_scale``) set
        nonzero when they meet inf/nan. Scripts that unscale and all-reduce grads themselves swap their own flag in
        before calling ``update_scale()`` (BERT pretraining's post-accumulation all-reduce).

        amp's own unscale records overflows without it, so the flag is only made on first access (a zero int32
        tensor on the detected device) or when one is assigned. From then on ``clear_overflow_state()`` zeroes
        it, and a dynamic ``update_scale()`` reads it (one host sync) and counts a nonzero value as an overflow.
        """
        if self._overflow_flag is None:
            from apex import _device

            self._overflow_flag = torch.zeros(1, dtype=torch.int, device=_device.detect_device())
        return self._overflow_flag

    @_overflow_buf.setter
    def _overflow_buf(self, flag: Any) -> None:
        if not isinstance(flag, torch.Tensor) or flag.numel() != 1 or flag.is_complex() or flag.is_sparse:
            got = (f"a {flag.dtype} tensor of shape {tuple(flag.shape)}" if isinstance(flag, torch.Tensor)
                   else f"{flag!r} ({type(flag).__name__})")
            raise TypeError(f"LossScaler._overflow_buf must be a one-element real tensor (an overflow flag), got {got}")
        self._overflow_flag = flag

    def clear_overflow_state(self) -> None:
        self._has_overflow = False
        if self._overflow_flag is not None:
            self._overflow_flag.zero_()

    def record_overflow(self, found: bool) -> None:
        if found:
            self._has_overflow = True

    def has_overflow(self) -> bool:
        return self._has_overflow

    def update_scale(self) -> bool:
        """Apply the outcome of one unscale; True means "skip the next step" (dynamic overflow only).

        A dynamic scaler whose ``_overflow_buf`` exists also counts a nonzero flag there as an overflow.
        """
        if self.dynamic and not self._has_overflow and self._overflow_flag is not None:
            self._has_overflow = bool(self._overflow_flag.item())
        if self._has_overflow and self.dynamic:
            should_skip = True
            new = self._loss_scale * self._backoff_factor
            self._loss_scale = max(_SMALLEST_SCALE if self._min_loss_scale is None else self._min_loss_scale, new)
            self._unskipped = 0
        else:
            should_skip = False
            self._unskipped += 1
        # >=: a count loaded from a run with a larger window still leads to growth (at the next clean step)
        if self.dynamic and self._unskipped >= self._scale_seq_len:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * self._growth_factor)
            self._unskipped = 0
        return should_skip

    def state(self) -> dict:
        return {"loss_scale": self._loss_scale, "unskipped": self._unskipped}

    @staticmethod
    def check_state(key: str, loss_scale: Any, unskipped: Any, where: str = "amp.load_state_dict") -> tuple:
        """(scale, unskipped) validated; TypeError/ValueError naming ``key`` and the entry otherwise."""
        return (_scale(where, f"{key}['loss_scale']", loss_scale),
                check_int(unskipped, f"{where}: {key}['unskipped']", 0, integral_float=True))

    def load(self, loss_scale: float, unskipped: int) -> None:
        """Sets the state after checking it (nothing changes when a value is rejected).

        The scale is taken as saved, even outside [min_loss_scale, max_loss_scale]: the next
        growth or backoff brings it back inside. It must be in `SCALE_RANGE` (its inverse a normal float32).
        """
        scale, count = self.check_state("loss_scale", loss_scale, unskipped)
        self._loss_scale = scale
        self._unskipped = count

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, loss_scale={self._loss_scale}, unskipped={self._unskipped})"


def check_scale_value(name: str, value, allow_none: bool = False, scale: bool = False) -> Optional[float]:
    """A finite positive float (or None when allowed), within `SCALE_RANGE` when it is a loss ``scale``; raises
    TypeError/ValueError naming the option."""
    if value is None and allow_none:
        return None
    number = real_number(value)
    if number is None:
        expected = "a positive number or None" if allow_none else "a positive number"
        raise TypeError(f"amp.initialize: {name} must be {expected}, got {value!r} ({type(value).__name__})")
    value = float(number)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"amp.initialize: {name} must be a finite positive number, got {value}")
    return in_scale_range("amp.initialize", name, value) if scale else value


_KEY = re.compile(r"loss_scaler(\d{1,9})$")  # an index beyond 9 digits is no loss amp can have (MAX_LOSSES)


def scaler_states(scalers: Sequence[LossScaler]) -> dict:
    """``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}``: upstream's ``amp.state_dict()`` format."""
    return {f"loss_scaler{idx}": scaler.state() for idx, scaler in enumerate(scalers)}


def load_scaler_states(scalers: Sequence[LossScaler], entries: List[Tuple[int, str, float, int]]) -> None:
    """`check_scaler_states` entries into ``scalers`` (an entry beyond them, a loss ``num_losses`` did not ask for,
    is skipped)."""
    for idx, _, scale, unskipped in entries:
        if idx < len(scalers):
            scalers[idx].load(scale, unskipped)


def check_scaler_states(state_dict: Any, where: str) -> List[Tuple[int, str, float, int]]:
    """Every entry of a `scaler_states` dict, validated: (index, key, scale, unskipped) in the dict's order.

    Raises RuntimeError for keys other than ``loss_scalerN`` (upstream's message), TypeError for a non-dict or an
    entry that is not a ``{"loss_scale", "unskipped"}`` dict or holds a non-number, ValueError for a non-finite
    or non-positive scale, a negative count, or two keys naming one scaler (``loss_scaler0``, ``loss_scaler00``);
    before anything is set.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"{where}: expected a dict, got {type(state_dict).__name__}")
    unexpected = [k for k in state_dict if not isinstance(k, str) or _KEY.match(k) is None]
    if unexpected:
        raise RuntimeError("Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
                           + ", ".join(f'"{k}"' for k in unexpected) + f". ({where})")
    out = []
    seen = {}
    for key, entry in state_dict.items():
        idx = int(_KEY.match(key).group(1))
        if idx in seen:  # "loss_scaler0" and "loss_scaler00": which one was meant cannot be told
            raise ValueError(f"{where}: keys {seen[idx]!r} and {key!r} both name loss scaler {idx}; keep one")
        seen[idx] = key
        if not isinstance(entry, dict) or "loss_scale" not in entry or "unskipped" not in entry:
            raise TypeError(f"{where}: {key} must be a dict with 'loss_scale' and 'unskipped', got {entry!r}")
        scale, unskipped = LossScaler.check_state(key, entry["loss_scale"], entry["unskipped"], where)
        out.append((idx, key, scale, unskipped))
    return out
