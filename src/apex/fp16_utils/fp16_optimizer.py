"""FP16_Optimizer: fp32 master weights and loss scaling around any ``torch.optim.Optimizer``.

The wrapped optimizer's fp16/bf16 params are replaced, in its param groups, by fp32 master
copies (their optimizer state moves along); fp32 params are used as they are. The loop is::

    optimizer.zero_grad()
    loss = model(x)
    optimizer.backward(loss)         # scaled backward, overflow check, grads -> masters, unscale
    optimizer.clip_master_grads(1.0) # optional
    optimizer.step()                 # skipped on overflow; masters -> model params

With a dynamic loss scale an overflow (inf/nan in a model grad) skips that ``step()`` and backs
the scale off; see :class:`~apex.fp16_utils.DynamicLossScaler`. Works on every device; the
overflow check runs on the core's non-finite kernel on CPU.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from apex._checks import real_number
from apex._wrapped_optimizer import WrapsOptimizer
from apex.fp16_utils.fp16util import (
    _check_grads_to_masters,
    _check_params_to_models,
    _copy_grads_to_masters,
    _copy_params_to_models,
    clip_grad_norm,
    master_params_to_model_params,  # noqa: F401  (upstream's module has these names too)
    model_grads_to_master_grads,  # noqa: F401
)
from apex.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler, _check_positive

__all__ = ["FP16_Optimizer"]

_LOW = (torch.float16, torch.bfloat16)


def _flag(value: Any, name: str, where: str) -> bool:
    """A saved flag: a bool (or a number / one-element tensor, as older checkpoints may hold)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return bool(value.item())
    if isinstance(value, (bool, int, float)):
        return bool(value)
    raise TypeError(f"{where}: {name} must be a bool, got {type(value).__name__}"
                    + (f" with {value.numel()} elements" if isinstance(value, torch.Tensor) else ""))


class FP16_Optimizer(WrapsOptimizer):
    """Wrap ``init_optimizer`` with fp32 masters for its fp16/bf16 params and a loss scaler.

    Args:
        init_optimizer: a ``torch.optim.Optimizer`` over the model's params (fp16, bf16 or fp32).
        static_loss_scale: the constant scale when ``dynamic_loss_scale`` is False.
        dynamic_loss_scale: use a :class:`DynamicLossScaler`.
        dynamic_loss_args: keyword arguments for that scaler (``init_scale``, ``scale_factor``,
            ``scale_window``).
        verbose: print the master-copy summary and a line per skipped step.
    """

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: Optional[Dict[str, Any]] = None,
                 verbose: bool = True) -> None:
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"FP16_Optimizer: init_optimizer must be a torch.optim.Optimizer, got {type(init_optimizer).__name__}")
        if dynamic_loss_args is not None and not isinstance(dynamic_loss_args, dict):
            raise TypeError(
                f"FP16_Optimizer: dynamic_loss_args must be a dict or None, got {type(dynamic_loss_args).__name__}")
        for gi, group in enumerate(init_optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.requires_grad and p.dtype not in (*_LOW, torch.float32):
                    raise TypeError(f"FP16_Optimizer: param {pi} of group {gi} is {p.dtype}; wrapped params must "
                                    "be float16, bfloat16 or float32")
        # The scaler first: a bad argument raises before the optimizer is touched.
        if dynamic_loss_scale:
            self.loss_scaler = DynamicLossScaler(**(dynamic_loss_args or {}))
        else:
            self.loss_scaler = LossScaler(static_loss_scale)
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self.verbose = verbose
        self.optimizer = init_optimizer
        self.fp16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_fp16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_fp32_groups: List[List[torch.Tensor]] = []
        for gi, group in enumerate(self.optimizer.param_groups):
            low, masters, fp32 = [], [], []
            for i, p in enumerate(group["params"]):
                if not p.requires_grad:
                    continue
                if p.dtype in _LOW:
                    master = p.detach().clone().float()
                    master.requires_grad_(True)
                    group["params"][i] = master
                    low.append(p)
                    masters.append(master)
                    if p in self.optimizer.state:
                        self.optimizer.state[master] = self.optimizer.state.pop(p)
                else:
                    fp32.append(p)
            if verbose:
                print(f"FP16_Optimizer processing param group {gi}: {len(low)} fp16/bf16 params get fp32 masters, "
                      f"{len(fp32)} fp32 params are used as they are")
            self.fp16_groups.append(low)
            self.fp32_from_fp16_groups.append(masters)
            self.fp32_from_fp32_groups.append(fp32)
        # A state_dict round trip casts any moved state to the masters' dtype (torch's load rule).
        self.optimizer.load_state_dict(self.optimizer.state_dict())
        self.overflow = False
        self.first_closure_call_this_step = True
        self.clip_grad_norm = clip_grad_norm

    # ---------------------------------------------------------------- grads
    def zero_grad(self, set_grads_to_None: bool = False) -> None:
        """Zero (or set to None) the grads of the masters, the fp32 params and the fp16/bf16 model params."""
        def clear(p: torch.Tensor) -> None:
            if set_grads_to_None:
                p.grad = None
            elif p.grad is not None:
                # As torch's zero_grad: views (combined grad buffers, DDP buckets) cannot detach_ in place.
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

        for group in self.optimizer.param_groups:
            for p in group["params"]:
                clear(p)
        for group in self.fp16_groups:
            for p in group:
                clear(p)

    def _model_params(self) -> List[torch.Tensor]:
        return [p for group in self.fp16_groups for p in group] + [p for g in self.fp32_from_fp32_groups for p in g]

    def _check_overflow(self) -> bool:
        self.overflow = self.loss_scaler.has_overflow(self._model_params())
        return self.overflow

    def _update_scale(self, has_overflow: bool = False) -> None:
        self.loss_scaler.update_scale(has_overflow)

    def _every_group(self, check, copy, where: str) -> None:
        """``check`` every (model params, masters) group pair, then ``copy`` each: a refused group (a sparse grad)
        must not leave the earlier groups' masters updated and the later ones stale."""
        pairs = [(list(low), list(masters)) for low, masters in zip(self.fp16_groups, self.fp32_from_fp16_groups)]
        for low, masters in pairs:
            check(low, masters, False, where)
        for low, masters in pairs:
            copy(low, masters, False)

    def _master_params_to_model_params(self) -> None:
        self._every_group(_check_params_to_models, _copy_params_to_models,
                          "FP16_Optimizer: master_params_to_model_params")

    def _model_grads_to_master_grads(self) -> None:
        self._every_group(_check_grads_to_masters, _copy_grads_to_masters,
                          "FP16_Optimizer: model_grads_to_master_grads")

    def _downscale_master(self) -> None:
        if self.loss_scale == 1.0:
            return
        inv = 1.0 / self.loss_scale
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.detach().mul_(inv)

    def update_master_grads(self) -> None:
        """Check the model grads for overflow (dynamic scale), then copy them to the masters and unscale.

        Called by :meth:`backward` unless ``update_master_grads=False`` (accumulate several backward
        passes first, then call this once). On overflow nothing is copied and the next ``step()`` is
        skipped.
        """
        if self.dynamic_loss_scale:
            self._check_overflow()
            if self.overflow:
                return
        self._model_grads_to_master_grads()
        self._downscale_master()

    def inspect_master_grad_data(self) -> Optional[List[List[Optional[torch.Tensor]]]]:
        """Per param group, each master's (or fp32 param's) grad data, None where it has no grad;
        None (with a message) after an overflow, when the masters' grads are stale."""
        if self.overflow:
            print("FP16_Optimizer.inspect_master_grad_data: the last backward overflowed, so the master grads "
                  "were not updated; returning None")
            return None
        return [[p.grad.data if p.grad is not None else None for p in group["params"]]
                for group in self.optimizer.param_groups]

    def clip_master_grads(self, max_norm: float, norm_type: float = 2):
        """Clip the masters' grads to total norm ``max_norm``; returns the norm before clipping, or -1 when
        the last backward overflowed (nothing is clipped then)."""
        for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
            if real_number(value) is None:
                raise TypeError(f"FP16_Optimizer.clip_master_grads: {name} must be a number, got {value!r}")
        if self.overflow:
            return -1
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return self.clip_grad_norm(params, max_norm, norm_type)

    # ---------------------------------------------------------------- loss scale
    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler.cur_scale = _check_positive(value, "loss_scale", "FP16_Optimizer")

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """``(loss.float() * loss_scale).backward()``, then :meth:`update_master_grads` unless told not to."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"FP16_Optimizer.backward: loss must be a tensor, got {type(loss).__name__}")
        self.loss_scaler.backward(loss.float(), retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    # ---------------------------------------------------------------- step
    def _report_skip(self, scale: float) -> None:
        if self.verbose:
            print(f"FP16_Optimizer: gradient overflow, skipping the step; loss scale {scale} -> {self.loss_scale}")

    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None):
        """Update the masters (unless the last backward overflowed), then copy them into the model params.

        Also advances the loss scaler. With a ``closure`` (which must call :meth:`backward` itself), the
        closure is re-run after every overflow until the grads are finite, backing the scale off each time.
        """
        scale = self.loss_scale
        # a step that raises (its closure, the wrapped optimizer) leaves the scaler as it found it
        scaler_before = self.loss_scaler.state_dict()
        try:
            self._update_scale(self.overflow)
            if self.overflow:
                self._report_skip(scale)
                return None
            if closure is not None:
                result = self._step_with_closure(closure)
            else:
                result = self.optimizer.step()
        except BaseException:
            self.loss_scaler.load_state_dict(scaler_before)
            raise
        self._master_params_to_model_params()
        return result

    def _step_with_closure(self, closure: Callable[[], torch.Tensor]):
        def wrapped_closure():
            # The first evaluation reuses the forward the caller already ran on the current model
            # params; later ones (optimizers such as LBFGS re-evaluate) need the masters copied back.
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                self._master_params_to_model_params()
            loss = closure()
            while self.overflow:
                scale = self.loss_scale
                self._update_scale(self.overflow)
                self._report_skip(scale)
                loss = closure()
            return loss

        try:
            return self.optimizer.step(wrapped_closure)
        finally:
            self.first_closure_call_this_step = True

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """The scaler's state, the flags, the wrapped optimizer's ``state_dict()`` and the fp32 masters.

        The scaler is saved as a plain dict (``{"cur_scale": ..., ...}``), so the checkpoint loads
        with ``torch.load(weights_only=True)``.
        """
        return {
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": [[m.detach().clone() for m in group] for group in self.fp32_from_fp16_groups],
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (also accepts a saved scaler object, as older checkpoints hold).

        Everything is checked before anything changes: the keys, and that the saved masters match the
        current ones group by group in count and shape.
        """
        where = "FP16_Optimizer.load_state_dict"
        if not isinstance(state_dict, dict):
            raise TypeError(f"{where}: expected a dict, got {type(state_dict).__name__}")
        needed = ("loss_scaler", "dynamic_loss_scale", "overflow", "optimizer_state_dict", "fp32_from_fp16")
        missing = [k for k in needed if k not in state_dict]
        if missing:
            raise KeyError(f"{where}: the state_dict lacks {missing}")
        saved = state_dict["fp32_from_fp16"]
        if not isinstance(saved, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in saved):
            raise TypeError(f"{where}: fp32_from_fp16 must be a list of lists of tensors, got "
                            f"{type(saved).__name__}")
        if len(saved) != len(self.fp32_from_fp16_groups):
            raise ValueError(f"{where}: {len(saved)} saved master groups, the optimizer has "
                             f"{len(self.fp32_from_fp16_groups)}")
        for gi, (current, old) in enumerate(zip(self.fp32_from_fp16_groups, saved)):
            if len(current) != len(old):
                raise ValueError(f"{where}: group {gi}: {len(old)} saved masters, {len(current)} current ones")
            for pi, (c, o) in enumerate(zip(current, old)):
                if not isinstance(o, torch.Tensor) or o.device.type == "meta" or o.is_complex():
                    what = (type(o).__name__ if not isinstance(o, torch.Tensor)
                            else "a meta tensor (no values)" if o.device.type == "meta" else f"{o.dtype}")
                    raise TypeError(f"{where}: group {gi} master {pi}: expected a real tensor holding values, "
                                    f"got {what}")
                if tuple(c.shape) != tuple(o.shape):
                    raise ValueError(f"{where}: group {gi} master {pi}: saved shape {tuple(o.shape)}, current "
                                     f"{tuple(c.shape)}")
        scaler_state = state_dict["loss_scaler"]
        flags = {k: _flag(state_dict.get(k, True), k, where)
                 for k in ("dynamic_loss_scale", "overflow", "first_closure_call_this_step")}
        if isinstance(scaler_state, LossScaler):
            scaler = scaler_state
        else:
            scaler = DynamicLossScaler() if flags["dynamic_loss_scale"] else LossScaler()
            scaler.load_state_dict(scaler_state)
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        self.loss_scaler = scaler
        self.dynamic_loss_scale = flags["dynamic_loss_scale"]
        self.overflow = flags["overflow"]
        self.first_closure_call_this_step = flags["first_closure_call_this_step"]
        with torch.no_grad():
            for current, old in zip(self.fp32_from_fp16_groups, saved):
                for c, o in zip(current, old):
                    c.copy_(o)

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic_loss_scale else "static"
        return f"FP16_Optimizer({type(self.optimizer).__name__}, {kind} loss scale {self.loss_scale})"
