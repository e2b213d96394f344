"""LARC: layer-wise adaptive rate control around any optimizer (upstream ``apex.parallel.LARC``).

You, Gitman & Ginsburg, "Large Batch Training of Convolutional Networks" (2017). Before the
wrapped optimizer's step, each param with a grad gets a local learning rate::

    local = trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)
    clip=True  (LARC clipping):  factor = min(local / lr, 1)   so that lr * factor = min(lr, local)
    clip=False (LARC scaling):   factor = local                so that the step uses lr * local

and its grad becomes ``(g + weight_decay * p) * factor``. The group's ``weight_decay`` is
folded in this way and set to 0 for the wrapped step (it would otherwise be applied a second
time), then restored. A param whose weight or grad norm is 0 is left as it is (and, as
upstream, gets no weight decay in that step).

As upstream: the grads are changed in place (so the wrapper works with any optimizer,
including our fused ones, whose grads are views into combined buffers), and ``param_groups``,
``state``, ``state_dict``, ``zero_grad`` ... are the wrapped optimizer's.

Beyond upstream: LARC is a ``torch.optim.Optimizer`` subclass (without state of its own), so
``amp.initialize`` and torch's LR schedulers accept it directly; norms are accumulated in
float32 for fp16/bf16 params; ``step(closure)`` evaluates the closure first; the weight decay
is restored even if the wrapped step raises; LARC objects can be pickled and deep-copied.
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional

import torch

from .._checks import FLOAT32_MAX, check_bool, real_number
from ..optimizers._state_check import check_unique_params

__all__ = ["LARC"]

_MISSING = object()


#: the smallest normal float32: a trust coefficient below it is 0 (or a subnormal) once the update, which works in
#: float32, multiplies by it, and no weight would ever change
_FLOAT32_TINY = 1.1754943508222875e-38


def _check_number(name: str, value: Any, positive: bool) -> float:
    """``value`` as a float the float32 rescaling can use: finite and at most float32's largest value (an inf
    or an overflowing trust coefficient writes inf/NaN into the weights at the first step). ``positive``: also at
    least float32's smallest normal value (a trust coefficient of 0 freezes every weight); otherwise 0 is allowed
    (an eps of 0 only drops the guard of the denominator, which LARC never lets reach 0)."""
    number = real_number(value)
    if number is None:
        raise TypeError(f"LARC: {name} must be a real number, got {value!r:.80} ({type(value).__name__})")
    try:
        value = float(number)
    except OverflowError:  # an int beyond the float range
        value = math.inf
    low = _FLOAT32_TINY if positive else 0.0
    if not low <= value <= FLOAT32_MAX:
        if positive:
            raise ValueError(f"LARC: {name} must be a finite number > 0 within float32's normal range "
                             f"[{_FLOAT32_TINY:.6g}, {FLOAT32_MAX:.6g}], got {number!r}")
        raise ValueError(f"LARC: {name} must be a finite number >= 0 within float32's range "
                         f"(<= {FLOAT32_MAX:.6g}), got {number!r}")
    return value


def _check_group(gi: int, group: dict, earlier: List[dict]) -> None:
    """What LARC's rescaling needs of a wrapped group: finite lr / weight_decay, each param once.

    torch.optim only warns about a param listed twice in one group; LARC would rescale its grad
    twice, so it is an error here (as in apex.optimizers).
    """
    for key in ("lr", "weight_decay"):
        value = group.get(key)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        value = real_number(value)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"LARC: param group {gi} has {key}={value}; expected a finite value")
    params = group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    check_unique_params("LARC", earlier, params, gi)


class LARC(torch.optim.Optimizer):
    """Wraps `optimizer` and rescales each param's grad by its LARC local learning rate before stepping.

    Args:
        optimizer: the optimizer to wrap (any torch.optim.Optimizer, including apex's fused ones).
        trust_coefficient: eta of the paper (default 0.02); finite, > 0 and within float32's normal range.
        clip: True: the effective rate is ``min(lr, local)``; False: ``lr * local`` (a bool, or 0/1).
        eps: added to the denominator of the local rate (default 1e-8); finite, >= 0, within float32's range.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, trust_coefficient: float = 0.02, clip: bool = True,
                 eps: float = 1e-8):
        # No torch.optim.Optimizer.__init__: LARC owns no params or state, everything is the wrapped optimizer's.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"LARC wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        for gi, group in enumerate(optimizer.param_groups):
            _check_group(gi, group, optimizer.param_groups[:gi])
        trust_coefficient = _check_number("trust_coefficient", trust_coefficient, positive=True)
        eps = _check_number("eps", eps, positive=False)
        clip = check_bool(clip, "LARC: clip")
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip

    # ------------------------------------------------------------------ delegation
    def __getstate__(self) -> dict:
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"LARC(trust_coefficient={self.trust_coefficient}, clip={self.clip}, eps={self.eps}, {self.optim!r})"

    @property
    def state(self):
        return self.optim.state

    @property
    def param_groups(self) -> List[dict]:
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: List[dict]) -> None:
        self.optim.param_groups = value

    @property
    def defaults(self) -> dict:
        return self.optim.defaults

    def state_dict(self) -> dict:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        if set_to_none is None:
            self.optim.zero_grad()
        else:
            self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """The wrapped optimizer's add_param_group, after LARC's checks (which a torch optimizer lacks)."""
        if isinstance(param_group, dict) and "params" in param_group:
            params = param_group["params"]
            if not isinstance(params, (torch.Tensor, set, frozenset)):
                param_group["params"] = list(params)  # read twice: a generator would reach the optimizer empty
            probe = dict(self.optim.defaults)
            probe.update(param_group)
            _check_group(len(self.optim.param_groups), probe, self.optim.param_groups)
        self.optim.add_param_group(param_group)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def _rescale_grads(self, group: dict, weight_decay: float) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        p_norm = torch.stack([n.to(params[0].device) for n in torch._foreach_norm(params, 2.0, dtype=torch.float32)])
        g_norm = torch.stack([n.to(params[0].device) for n in torch._foreach_norm(grads, 2.0, dtype=torch.float32)])
        local = self.trust_coefficient * p_norm / (g_norm + p_norm * weight_decay + self.eps)
        if self.clip:
            lr = torch.as_tensor(group["lr"], dtype=torch.float32, device=local.device)
            local = torch.clamp(local / lr, max=1.0)  # lr == 0 gives inf, clamped to 1 (as upstream)
        keep = ((p_norm != 0) & (g_norm != 0)).tolist()
        factors = local.tolist()
        idx = [i for i, k in enumerate(keep) if k]
        if not idx:
            return
        for i in idx:
            if torch._debug_has_internal_overlap(grads[i]) != 0:
                # an expanded grad (stride 0) refuses in-place writes; torch's optimizers only read it, so it
                # is replaced by a copy here rather than failing halfway through the grads
                grads[i] = params[i].grad = grads[i].clone(memory_format=torch.contiguous_format)
        sel_g = [grads[i] for i in idx]
        if weight_decay != 0:
            torch._foreach_add_(sel_g, [params[i] for i in idx], alpha=weight_decay)
        torch._foreach_mul_(sel_g, [factors[i] for i in idx])

    def step(self, closure: Optional[Callable[[], Any]] = None):
        """Rescales the grads, runs the wrapped optimizer's step with weight decay off, restores it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        saved = [group.get("weight_decay", _MISSING) for group in self.optim.param_groups]
        try:
            for group, wd in zip(self.optim.param_groups, saved):
                group["weight_decay"] = 0
                self._rescale_grads(group, 0.0 if wd is _MISSING else float(wd))
            self.optim.step()
        finally:
            for group, wd in zip(self.optim.param_groups, saved):
                if wd is _MISSING:
                    group.pop("weight_decay", None)
                else:
                    group["weight_decay"] = wd
        return loss
