"""NVIDIA Apex's older ``apex.contrib.optimizers.FP16_Optimizer``: fp16 model params, fp32 master copies, loss
scaling, around ``apex.contrib.optimizers.FusedAdam`` (or any optimizer whose ``step`` takes ``grads``,
``output_params``, ``scale`` and ``grad_norms``), as old BERT fine-tuning scripts use it::

    optimizer = FusedAdam(groups, lr=lr, bias_correction=False, max_grad_norm=1.0)
    optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True)
    optimizer.backward(loss)
    optimizer.step()
    optimizer.zero_grad()

Construction replaces every group's params by fp32 masters (``fp32_groups``; the model's own params are
``fp16_groups``). ``step()`` takes each group's grad norm (of the scaled grads) first: a non-finite one skips the
step and backs the dynamic scale off (``max(scale / 2, 1)``); otherwise the optimizer updates the masters from the
model's grads divided by the scale (and clipped, see FusedAdam's ``max_grad_norm``) and writes them into the model
params. The dynamic scale starts at 2**16 and doubles after every 1000 steps without overflow.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List

import torch

from ..._checks import check_int
from ..._wrapped_optimizer import WrapsOptimizer
from ...fp16_utils.loss_scaler import _check_positive
from .fused_adam import group_grad_norm


def _takes_flat_grads(optimizer: Any) -> bool:
    try:
        names = inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):
        return False
    return all(n in names for n in ("grads", "output_params", "scale", "grad_norms"))


class FP16_Optimizer(WrapsOptimizer):
    """``FP16_Optimizer(init_optimizer, static_loss_scale=1.0, dynamic_loss_scale=False, dynamic_loss_args=None,
    verbose=True)``; see the module docstring. ``dynamic_loss_args`` (NVIDIA refused any) may give
    ``init_scale``, ``scale_factor`` and ``scale_window``."""

    def __init__(self, init_optimizer, static_loss_scale=1.0, dynamic_loss_scale=False, dynamic_loss_args=None,
                 verbose=True):
        if not isinstance(init_optimizer, torch.optim.Optimizer) or not _takes_flat_grads(init_optimizer):
            raise TypeError(
                "apex.contrib.optimizers.FP16_Optimizer drives an optimizer whose step() takes grads, output_params, "
                f"scale and grad_norms (apex.contrib.optimizers.FusedAdam); got {type(init_optimizer).__name__}. "
                "For other optimizers use apex.fp16_utils.FP16_Optimizer or apex.amp."
            )
        if not isinstance(verbose, bool):
            raise TypeError(f"FP16_Optimizer: verbose must be True or False, got {verbose!r}")
        scale_factor, scale_window, init_scale = 2.0, 1000, 2.0 ** 16
        if dynamic_loss_scale:
            if dynamic_loss_args is not None:
                if not isinstance(dynamic_loss_args, dict) or set(dynamic_loss_args) - {
                        "init_scale", "scale_factor", "scale_window"}:
                    raise ValueError("FP16_Optimizer: dynamic_loss_args may hold init_scale, scale_factor and "
                                     f"scale_window, got {dynamic_loss_args!r}")
                init_scale = self._positive(dynamic_loss_args.get("init_scale", init_scale), "init_scale")
                scale_factor = self._scale_factor(dynamic_loss_args.get("scale_factor", scale_factor))
                scale_window = self._scale_window(dynamic_loss_args.get("scale_window", scale_window))
        else:
            init_scale = self._positive(static_loss_scale, "static_loss_scale")
        self.optimizer = init_optimizer
        self.fp16_groups: List[List[torch.Tensor]] = []
        self.fp32_groups: List[List[torch.Tensor]] = []
        for group in init_optimizer.param_groups:
            model = list(group["params"])
            masters = [p.detach().clone().float() for p in model]
            self.fp16_groups.append(model)
            self.fp32_groups.append(masters)
            group["params"] = masters
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.verbose = verbose

    @staticmethod
    def _positive(value: Any, name: str, where: str = "FP16_Optimizer") -> float:
        return float(_check_positive(value, name, where))

    @classmethod
    def _scale_factor(cls, value: Any, where: str = "FP16_Optimizer") -> float:
        factor = cls._positive(value, "scale_factor", where)
        if factor <= 1:  # the scale must grow after a window and shrink at an overflow
            raise ValueError(f"{where}: scale_factor must be > 1, got {factor}")
        return factor

    @staticmethod
    def _scale_window(value: Any, where: str = "FP16_Optimizer") -> int:
        return check_int(value, f"{where}: scale_window", 1, integral_float=True)

    # ------------------------------------------------------------ training
    def zero_grad(self, set_grads_to_None: bool = True) -> None:
        """The model params' grads: set to None (default), or zeroed in place."""
        for group in self.fp16_groups:
            for p in group:
                if set_grads_to_None:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_()

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss.float() * loss_scale).backward()``: the model params get scaled grads."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"FP16_Optimizer.backward: loss must be a tensor, got {type(loss).__name__}")
        (loss.float() * self.cur_scale).backward()

    def step(self, closure=None):
        """Update the masters and the model from the model's scaled grads, or skip on inf/nan (see the module)."""
        if closure is not None:
            raise RuntimeError("apex.contrib.optimizers.FP16_Optimizer.step does not take a closure")
        fp16_grads = [[p.grad for p in group] for group in self.fp16_groups]
        norms = [group_grad_norm(grads) for grads in fp16_grads]
        if any(n != n or n in (float("inf"), float("-inf")) for n in norms):
            self._update_scale(True)
            return None
        self.optimizer.step(grads=fp16_grads, output_params=self.fp16_groups, scale=self.cur_scale,
                            grad_norms=norms)
        self._update_scale(False)
        return None

    def _update_scale(self, skip: bool) -> None:
        if self.dynamic_loss_scale:
            if skip:
                if self.verbose:
                    print(f"\nGrad overflow on iteration {self.cur_iter}")
                    print(f"Using dynamic loss scale of {self.cur_scale}")
                self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
                self.last_overflow_iter = self.cur_iter
            elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                self.cur_scale *= self.scale_factor
        elif skip:
            print(f"\nGrad overflow on iteration {self.cur_iter}")
            print(f"Using static loss scale of {self.cur_scale}")
        self.cur_iter += 1

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """The loss-scale fields, the wrapped optimizer's state dict and the fp32 masters (NVIDIA's keys)."""
        sd: Dict[str, Any] = {"dynamic_loss_scale": self.dynamic_loss_scale, "cur_scale": self.cur_scale,
                              "cur_iter": self.cur_iter}
        if self.dynamic_loss_scale:
            sd.update(last_overflow_iter=self.last_overflow_iter, scale_factor=self.scale_factor,
                      scale_window=self.scale_window)
        sd["optimizer_state_dict"] = self.optimizer.state_dict()
        sd["fp32_groups"] = self.fp32_groups
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Everything `state_dict` saved; the masters are copied in place. Every field is checked as the
        constructor checks it (``scale_factor > 1``, ``scale_window >= 1``, ``cur_scale > 0``, counters ints) before
        the wrapped optimizer's state is loaded or anything is set; a rejected call changes nothing."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"FP16_Optimizer.load_state_dict: expected a dict, got {type(state_dict).__name__}")
        where = "FP16_Optimizer.load_state_dict"
        need = ["dynamic_loss_scale", "cur_scale", "cur_iter", "optimizer_state_dict", "fp32_groups"]
        missing = [k for k in need if k not in state_dict]
        if missing:
            raise KeyError(f"{where}: missing {missing}")
        dynamic = state_dict["dynamic_loss_scale"]
        # NVIDIA's class saved its constructor argument as given: 0 and 1 also occur
        if not (isinstance(dynamic, bool) or (type(dynamic) is int and dynamic in (0, 1))):
            raise TypeError(f"{where}: 'dynamic_loss_scale' must be True or False, got {dynamic!r:.80}")
        dynamic = bool(dynamic)
        missing = [k for k in ("last_overflow_iter", "scale_factor", "scale_window") if dynamic and k not in state_dict]
        if missing:
            raise KeyError(f"{where}: missing {missing} (saved with dynamic_loss_scale=True)")
        saved = state_dict["fp32_groups"]
        if not isinstance(saved, (list, tuple)) or len(saved) != len(self.fp32_groups) or any(
                not isinstance(a, (list, tuple)) or len(a) != len(b)
                or any(not isinstance(s, torch.Tensor) or s.shape != m.shape for s, m in zip(a, b))
                for a, b in zip(saved, self.fp32_groups)):
            raise ValueError(f"{where}: 'fp32_groups' does not match this optimizer's "
                             "groups (number, lengths or shapes)")
        for gi, group in enumerate(saved):
            for i, value in enumerate(group):
                if not value.is_floating_point() or value.is_meta:
                    raise TypeError(f"{where}: 'fp32_groups' entry {i} of group {gi} must be "
                                    f"a real floating point tensor holding values, got a {value.dtype} tensor"
                                    + (" on the meta device" if value.is_meta else ""))
        # every field converted and checked as the constructor checks it, before the wrapped optimizer's load (itself
        # all-or-nothing) and before any field is set
        scale = self._positive(state_dict["cur_scale"], "cur_scale", where)
        cur_iter = check_int(state_dict["cur_iter"], f"{where}: 'cur_iter'", 0, integral_float=True)
        if dynamic:
            last_overflow_iter = check_int(state_dict["last_overflow_iter"], f"{where}: 'last_overflow_iter'", -1,
                                           integral_float=True)
            scale_factor = self._scale_factor(state_dict["scale_factor"], where)
            scale_window = self._scale_window(state_dict["scale_window"], where)
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        self.dynamic_loss_scale = dynamic
        self.cur_scale = scale
        self.cur_iter = cur_iter
        if dynamic:
            self.last_overflow_iter = last_overflow_iter
            self.scale_factor = scale_factor
            self.scale_window = scale_window
        with torch.no_grad():
            for current, stored in zip(self.fp32_groups, saved):
                for master, value in zip(current, stored):
                    master.copy_(value)
