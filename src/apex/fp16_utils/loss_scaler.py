"""Loss scalers of the ``FP16_Optimizer`` API: a static one and a dynamic one.

Both keep upstream's attribute names (``cur_scale``, ``cur_iter``, ``last_overflow_iter``,
``scale_factor``, ``scale_window``) and methods (``has_overflow``, ``update_scale``,
``loss_scale``, ``scale_gradient``, ``backward``), since training scripts read them.

Dynamic rule: an overflow divides the scale by ``scale_factor`` (never below 1) and records
the iteration; otherwise the scale is multiplied by ``scale_factor`` whenever the number of
iterations since the last overflow is a multiple of ``scale_window`` (a run that starts
clean first grows after ``scale_window`` iterations, since the last overflow counts as iteration -1).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, Mapping, Tuple

import torch

from apex import _core
from apex._checks import check_int, real_number

__all__ = ["DynamicLossScaler", "LossScaler", "to_python_float"]


def to_python_float(t: Any) -> float:
    """The Python number held by a one-element tensor (or the first item of a sequence)."""
    if hasattr(t, "item"):
        return t.item()
    try:
        return t[0]
    except (IndexError, KeyError, TypeError):
        raise TypeError(f"to_python_float: expected a one-element tensor or a non-empty sequence, got {t!r}") from None


def _check_positive(value: Any, name: str, where: str) -> float:
    number = real_number(value)
    if number is None:
        raise TypeError(f"{where}: {name} must be a number, got {type(value).__name__}")
    if isinstance(number, int) and number >= 2**63:  # beyond what a tensor multiplies by as an integer
        try:
            number = float(number)
        except OverflowError:
            raise ValueError(f"{where}: {name} must be a finite number > 0, got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{where}: {name} must be a finite number > 0, got {number}")
    return number


def _fields(state: Any, required: Tuple[str, ...], where: str) -> Dict[str, Any]:
    """``state`` as a mapping holding every key of ``required``; raises naming what is missing."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{where}: expected a dict (a state_dict()), got {type(state).__name__}")
    missing = [k for k in required if k not in state]
    if missing:
        raise KeyError(f"{where}: the state lacks {missing} (it has {sorted(map(str, state))})")
    return state


def _grads(params: Iterable[Any]):
    for p in params:
        g = getattr(p, "grad", None)
        if g is not None:
            yield g


class LossScaler:
    """A loss scale that never changes; never reports an overflow.

    Args:
        scale: the constant factor the loss is multiplied by before ``backward``.
    """

    def __init__(self, scale: float = 1) -> None:
        self.cur_scale = _check_positive(scale, "scale", "LossScaler")

    def has_overflow(self, params: Iterable[Any]) -> bool:
        return False

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        pass

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module, grad_in, grad_out):
        """A backward hook that multiplies the incoming gradients by the loss scale."""
        return tuple(self.loss_scale * g if g is not None else None for g in grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        if not isinstance(loss, torch.Tensor):  # (a list or str times the scale would be repeated, not scaled)
            raise TypeError(f"{type(self).__name__}.backward: loss must be a tensor, got {type(loss).__name__}")
        (loss * self.loss_scale).backward(retain_graph=retain_graph)

    def state_dict(self) -> Dict[str, Any]:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        where = "LossScaler.load_state_dict"
        self.cur_scale = _check_positive(_fields(state, ("cur_scale",), where)["cur_scale"], "cur_scale", where)


class DynamicLossScaler(LossScaler):
    """A loss scale that backs off on overflow and grows after ``scale_window`` clean iterations.

    Args:
        init_scale: the first scale tried (default 2**32).
        scale_factor: divisor on overflow, multiplier on growth (default 2; must be > 1).
        scale_window: clean iterations between growths (default 1000).
    """

    def __init__(self, init_scale: float = 2**32, scale_factor: float = 2.0, scale_window: int = 1000) -> None:
        where = "DynamicLossScaler"
        self.cur_scale = _check_positive(init_scale, "init_scale", where)
        self.scale_factor = _check_positive(scale_factor, "scale_factor", where)
        if self.scale_factor <= 1.0:  # a divisor on overflow that does not shrink the scale would grow it
            raise ValueError(f"{where}: scale_factor must be > 1, got {scale_factor!r}")
        self.scale_window = check_int(scale_window, f"{where}: scale_window", 1)
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def has_overflow_serial(self, params: Iterable[Any]) -> bool:
        """True if any param's grad holds an inf or nan (params without a grad are skipped)."""
        return any(self._has_inf_or_nan(g) for g in _grads(params))

    def has_overflow(self, params: Iterable[Any]) -> bool:
        return self.has_overflow_serial(params)

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        # One pass through the core's non-finite check where it applies (CPU, fp32/fp16/bf16,
        # contiguous); torch's isfinite elsewhere.
        if _core.uses_kernel(x):
            return _core.has_nonfinite(x)
        return bool(x.numel()) and not bool(torch.isfinite(x).all())

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter,
                "scale_factor": self.scale_factor, "scale_window": self.scale_window}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores a `state_dict`; every field is checked before any is applied (a bad one changes nothing)."""
        where = "DynamicLossScaler.load_state_dict"
        state = _fields(state, ("cur_scale", "cur_iter", "last_overflow_iter"), where)
        cur_scale = _check_positive(state["cur_scale"], "cur_scale", where)
        cur_iter = check_int(state["cur_iter"], f"{where}: cur_iter", 0)
        last_overflow_iter = check_int(state["last_overflow_iter"], f"{where}: last_overflow_iter", -1)
        scale_factor = _check_positive(state.get("scale_factor", self.scale_factor), "scale_factor", where)
        if scale_factor <= 1.0:
            raise ValueError(f"{where}: scale_factor must be > 1, got {scale_factor!r}")
        scale_window = check_int(state.get("scale_window", self.scale_window), f"{where}: scale_window", 1)
        self.cur_scale, self.cur_iter, self.last_overflow_iter = cur_scale, cur_iter, last_overflow_iter
        self.scale_factor, self.scale_window = scale_factor, scale_window
