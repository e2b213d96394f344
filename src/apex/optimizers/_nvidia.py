"""Behaviour shared by the NVIDIA-Apex-compatible optimizers (FusedAdam, FusedLAMB, FusedNovoGrad, ...).

NVIDIA's fused optimizers differ from torch.optim in a few ways that user code
can observe, and code written for them must keep working unchanged here:

* one step count per *param group* (``group["step"]``, saved in
  ``state_dict()["param_groups"]``), advanced at every ``step()`` call for every
  group, instead of torch's per-parameter ``state[p]["step"]``;
* ``set_grad_none``: what ``zero_grad()`` does when called without arguments;
* constructor options that are optimizer attributes rather than group options
  (``adam_w_mode``, ``use_nvlamb``, ...), so they are not in state dicts;
* the amp_C kernels as attributes (``multi_tensor_adam``, ...) and a no-op flag
  ``_dummy_overflow_buf``, which subclasses that replace ``step()`` pass to
  ``multi_tensor_applier`` (`AmpCOp`, `OverflowFlag`).

The per-group step is written into the flat set's per-segment step array before
each kernel call, so the kernels (which take per-segment steps) apply NVIDIA's
bias correction.
"""

from __future__ import annotations

import logging
from itertools import chain
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import _core
from .._tensor_utils import zero_grad_
from ._base import _GroupCache, check_betas
from ._flat import FlatSet, check_grad
from ._state_check import check_step_value
from ._state_watch import bind

logger = logging.getLogger("apex.optimizers")

__all__ = ["AmpCOp", "GradScalerMixin", "NvidiaCompatMixin", "OverflowFlag", "ShadowParamsMixin", "ShadowSet",
           "check_betas", "group_device", "group_step", "tensor_lr_and_step"]


class AmpCOp:
    """A class attribute standing for upstream's ``self.multi_tensor_<op> = amp_C.multi_tensor_<op>``.

    Code that subclasses NVIDIA's optimizers and replaces ``step()`` with its own loop over the params calls the
    kernel through that attribute (``multi_tensor_applier(self.multi_tensor_adam, self._dummy_overflow_buf,
    [g, p, m, v], ...)``; fairseq's FusedAdamV2 refuses to start without it). It is the op of
    `apex.multi_tensor_apply.amp_C`, which takes tensors on any device, resolved at first use so that importing
    the optimizers does not import the ops. An op this package does not provide (a CUDA-graph or stage kernel)
    raises AttributeError naming it, so ``hasattr`` answers False. A non-data descriptor: an instance may
    assign its own."""

    def __init__(self, op: str) -> None:
        self.op = op

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        from ..multi_tensor_apply import amp_C

        fn = getattr(amp_C, self.op, None)
        if fn is None:
            raise AttributeError(f"{getattr(owner, '__name__', owner)}.{self.name}: amp_C.{self.op} is a CUDA-only "
                                 "kernel this package does not provide")
        return fn


class OverflowFlag:
    """Upstream's ``self._dummy_overflow_buf``: a one-element int32 zero on the first param's device (the CPU
    for an optimizer without params), the ``noop_flag`` its ``step()`` passes to ``multi_tensor_applier``.
    Made at first access and kept on the instance."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        groups = obj.param_groups
        flag = torch.zeros(1, dtype=torch.int32, device=group_device(groups[0]) if groups else "cpu")
        obj.__dict__[self.name] = flag
        return flag


def group_step(group: dict) -> float:
    """The group's step count as a float (NVIDIA keeps an int, or an int tensor in FusedMixedPrecisionLamb)."""
    step = group.get("step", 0)
    return float(step.item() if isinstance(step, torch.Tensor) else step)


class NvidiaCompatMixin:
    """Per-group steps and ``set_grad_none`` for CombinedOptimizer subclasses (list it first in the bases)."""

    set_grad_none: bool = True

    def _advance_group_steps(self) -> None:
        for group in self.param_groups:
            step = group.get("step")
            if step is None:
                group["step"] = 1
            elif isinstance(step, torch.Tensor):
                step += 1  # in place, as NVIDIA does with its device-side step tensor
            else:
                group["step"] = step + 1

    def _prepare_counted_step(self):
        """`_prepare_step`, then the per-group step counts advanced: only once every grad has been accepted, so
        a rejected step leaves the counts as they were."""
        self._check_group_steps()
        prepared = self._prepare_step()
        self._advance_group_steps()
        return prepared

    def _check_group_steps(self) -> None:
        """Every group's ``step`` (user code may rebind it) is a count >= 0, before anything is updated. A step
        held in a device tensor is checked for its form only (reading it would wait for the device)."""
        for gi, group in enumerate(self.param_groups):
            step = group.get("step")
            if step is not None:
                check_step_value(step, f"{type(self).__name__}: param group {gi}: 'step'", host_only=True)

    @staticmethod
    def _use_group_step(s: FlatSet, group: dict) -> float:
        """Writes the group's step into the per-segment step array the kernels read; returns it."""
        step = group_step(group)
        s.steps.fill_(step)
        return step

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """``set_to_none=None`` (NVIDIA's call without arguments) follows ``set_grad_none``.

        NVIDIA's ``set_grad_none=False`` calls torch's ``zero_grad()``, whose default became
        ``set_to_none=True`` in torch 2.0; here it means what it documents: grads are zeroed
        in place (and stay bound to the combined buffers).
        """
        if set_to_none is None:
            set_to_none = self.set_grad_none
        super().zero_grad(set_to_none=bool(set_to_none))

    def load_state_dict(self, state_dict: dict) -> None:
        """Also accepts torch.optim checkpoints: a group without ``step`` takes the largest per-param step."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            if "step" in group:
                continue
            steps = [
                float(self.state[p]["step"]) for p in group["params"]
                if p in self.state and "step" in self.state[p]
            ]
            for p in group["params"]:
                if p in self.state:
                    self.state[p].pop("step", None)  # NVIDIA's layout: the step lives in the group
            if steps:
                group["step"] = int(max(steps))
                logger.info("apex: group without 'step' in the loaded state dict: using the params' step %d",
                            group["step"])


def group_device(group: dict) -> torch.device:
    """Where a group's tensor hyperparameters live: its first param's device (the CPU for an empty group)."""
    return group["params"][0].device if group["params"] else torch.device("cpu")


def tensor_lr_and_step(group: dict, step=None) -> None:
    """NVIDIA's tensor hyperparameters: ``lr`` a float32 0-d tensor and (when ``step`` is given, or the group
    has one) ``step`` an int32 tensor ``[step]``, on the group's device (the first param's; CPU when empty)."""
    device = group_device(group)
    lr = group["lr"]
    group["lr"] = (lr.detach().to(device=device, dtype=torch.float32, copy=True) if isinstance(lr, torch.Tensor)
                   else torch.tensor(float(lr), dtype=torch.float32, device=device))
    step = group.get("step", step)
    if step is not None:
        group["step"] = (step.detach().to(device=device, copy=True) if isinstance(step, torch.Tensor)
                         else torch.tensor([int(step)], dtype=torch.int32, device=device))


class GradScalerMixin:
    """torch GradScaler's optimizer-side contract (``_step_supports_amp_scaling``; list it before the class
    that defines ``_grad_scale``).

    With the attribute set, ``GradScaler.step`` hands the optimizer the scale and the inf/NaN flags instead
    of unscaling the grads itself: a step whose grads hold inf/NaN is skipped (no update, step counts
    unchanged) and the unscale ``1 / scale`` is folded into the update, so the grads are read once and
    never rewritten. Both contracts are served: NVIDIA's ``step(grad_scaler=scaler)`` keyword (what torch
    passes when ``step`` has that parameter) and torch's attributes ``grad_scale`` / ``found_inf``.
    Grads already unscaled by ``scaler.unscale_(optimizer)`` (to clip them) are not unscaled again.

    ``_unscale_grads_after = True``: after an update that folded the unscale in, the grads are unscaled in
    place as well, so user code reading them after ``scaler.step()`` sees what ``unscale_`` would have left
    (NVIDIA's capturable FusedAdam writes the unscaled grads back); the update itself used the scaled grads
    times ``1 / scale`` in fp32, as NVIDIA's kernel does.
    """

    _scaler_inv = 1.0
    _unscale_grads_after = False

    def _grad_scale(self) -> float:
        return super()._grad_scale() * self._scaler_inv

    def _scaled_update(self, grad_scaler, update: Callable[[], None]) -> None:
        """``update()`` with the scaler's unscale folded in, or nothing when the grads hold inf/NaN."""
        scale, found_inf = self._scaler_inputs(grad_scaler)
        if found_inf:
            return  # NVIDIA: no update and no step count advance on overflow
        self._scaler_inv = 1.0 if scale is None else 1.0 / scale
        try:
            update()
        finally:
            self._scaler_inv = 1.0
        if self._unscale_grads_after and scale is not None and scale != 1.0:
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, 1.0 / scale)

    def _scaler_inputs(self, grad_scaler) -> Tuple[Optional[float], bool]:
        """(scale the grads still carry or None, whether they hold inf/NaN) from a GradScaler, by either
        contract; (None, False) without one."""
        if grad_scaler is not None:  # NVIDIA's contract: the scaler passed as a keyword
            per_opt = getattr(grad_scaler, "_per_optimizer_states", {}).get(id(self), {})
            stage = getattr(per_opt.get("stage"), "name", None)
            if stage == "UNSCALED":  # scaler.unscale_(self) ran: grads unscaled, flags recorded
                found = per_opt.get("found_inf_per_device", {})
                return None, any(float(v) != 0 for v in found.values())
            found = grad_scaler._check_inf_per_device(self)  # also records the flags for scaler.update()
            scale = grad_scaler._get_scale_async()
            return float(scale), any(float(v) != 0 for v in found.values())
        # torch's current contract: GradScaler.step sets these two attributes for the call
        found_inf = getattr(self, "found_inf", None)
        scale = getattr(self, "grad_scale", None)
        return (None if scale is None else float(scale)), bool(found_inf is not None and float(found_inf) != 0)


# ------------------------------------------------------------------ fp32 shadows of low-precision params
class _StateByModel:
    """The optimizer state seen through shadow tensors: entries are keyed by the model params."""

    def __init__(self, state, model_of: Dict[int, torch.Tensor]):
        self._state = state
        self._model_of = model_of

    def _key(self, p: torch.Tensor) -> torch.Tensor:
        return self._model_of.get(id(p), p)

    def get(self, p, default=None):
        return self._state.get(self._key(p), default)

    def __getitem__(self, p):
        return self._state[self._key(p)]


class ShadowSet(FlatSet):
    """Flat buffers over fp32 master weights (shadows) of low-precision model params.

    The kernels update the shadows with fp32 states and write the rounded result into the model
    params in the same pass (the model params are the set's ``out`` copies). States are keyed by
    the model params, so ``optimizer.state[model_param]`` and ``state_dict()`` look as if the
    model params were optimized directly.

    Grads, per step, one of two ways: the kernel reads the model grads where autograd left them,
    in the model dtype (`bind_model_grads`: a per-slot address table, ``gdt`` = the model dtype,
    which the kernels take beside fp32 params; the shadows have no grad then, as NVIDIA's masters,
    and no fp32 grad buffer is made), or, for the torch executors, the optimizers that need the flat
    grad buffer and grads that cannot be read in place, they are converted into the flat fp32 grad
    buffer, whose slot views become the shadows' grads (`mirror_grads`).
    """

    def __init__(self, shadows: List[torch.Tensor], models: List[torch.Tensor], state, names, fill, has_step):
        self._keyed = _StateByModel(state, {id(s): m for s, m in zip(shadows, models)})
        super().__init__(shadows, self._keyed, names, fill, has_step)
        self.attach_out(models)
        # (model grads, `plan_gather` plan) bound by `bind_model_grads` for the next update; None: this step mirrors
        self._model_plan: Optional[tuple] = None
        self._reads_models = False  # this step's update reads the model grads (the plan was taken)

    def expose_new_states(self, state) -> None:
        super().expose_new_states(self._keyed)

    def mirror_grads(self) -> None:
        """Shadow grads = model grads, converted to fp32 in the flat grad buffer; None where the model has none."""
        self._model_plan = None
        dst, src = [], []
        for k, (shadow, model) in enumerate(zip(self.params, self.out_params)):
            g = model.grad
            if g is None:
                shadow.grad = None
                continue
            check_grad(k, model, g)
            dst.append(self.grad_views[k])
            src.append(g)
            if shadow.grad is not self.grad_views[k]:
                shadow.grad = self.grad_views[k]
        if dst:
            torch._foreach_copy_(dst, src)

    def bind_model_grads(self) -> bool:
        """The next kernel update reads the model grads in place, in the model dtype; returns False, with
        nothing changed, when one of them cannot be read in place (layout, alignment, or memory the update
        writes): `mirror_grads` then. Raises (sparse, dtype, device or shape) before anything is changed."""
        gs, ptrs = self.scan_grads(self.out_params)
        plan = self.plan_gather(gs, ptrs, of=self.out_params)
        if plan[1]:
            return False
        for shadow in self.params:
            if shadow.grad is not None:  # views a mirroring step bound; the model grads are what this step reads
                shadow.grad = None
        self._model_plan = (gs, plan)
        return True

    def planned_grads(self):
        """The model grads and their plan from `bind_model_grads` (read once: the step's grad plan), or None."""
        plan, self._model_plan = self._model_plan, None
        self._reads_models = plan is not None
        return plan

    def apply_model_grads(self) -> None:
        """After the step's checks: the kernel reads the model grads (model dtype) where the plan read them in
        place, or the flat fp32 grad buffer when this step mirrored."""
        if not self._reads_models:  # mirrored: the flat buffer holds every grad (the shadows' grads are its views)
            self.use_flat()
        if self.args is not None:
            self.args.gdt = _core.DTYPE_CODES[self.out_params[0].dtype if self._reads_models else self.dtype]


class ShadowParamsMixin:
    """Optimizes params of `_shadow_dtypes()` through fp32 master weights (shadows), made once from the model
    params and never re-read from them (NVIDIA FusedMixedPrecisionLamb, FusedAdam with ``master_weights``);
    list it before CombinedOptimizer. Their states are fp32, keyed by the model params."""

    def _shadow_dtypes(self) -> Tuple[torch.dtype, ...]:
        return (torch.float16, torch.bfloat16)

    def _f32_states(self, dtype: torch.dtype) -> bool:
        """Whether params of ``dtype`` keep fp32 states: shadowed ones, and those `_state_dtype_for` says so of."""
        return dtype in self._shadow_dtypes() or self._state_dtype_for(dtype) == torch.float32

    def _init_combined(self) -> None:
        # also run when a copy (deepcopy / unpickle) restores only torch's fields: masters are made again from the
        # model params at the next step (they are not part of state_dict either)
        super()._init_combined()
        # id(model param) -> (model param, fp32 shadow, model data_ptr when the shadow was made)
        self._shadows: Dict[int, Tuple[torch.Tensor, torch.Tensor, int]] = {}

    def _shadow_for(self, p: torch.Tensor) -> torch.Tensor:
        rec = self._shadows.get(id(p))
        if rec is not None and rec[0] is p and rec[2] == p.data_ptr():
            return rec[1]  # still in sync (masters keep their fp32 value across re-combines)
        return p.detach().to(torch.float32, copy=True)

    def _build_group(self, gi: int, group: dict) -> List[FlatSet]:
        low = self._shadow_dtypes()
        # amp O2 hands fp32 masters and pairs them with its model copies itself
        if not low or self._model_pairs is not None or all(p.dtype not in low for p in group["params"]):
            return super()._build_group(gi, group)
        self._check_params(group["params"])
        by_kind: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
        for p in group["params"]:
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        names = self._state_names(group)
        sets: List[FlatSet] = []
        for (dtype, _), ps in by_kind.items():
            if dtype not in low:
                sets.append(FlatSet(ps, self.state, names, self._state_fill, self._has_step,
                                    self._state_dtype_for(dtype)))
                continue
            s = ShadowSet([self._shadow_for(p) for p in ps], ps, self.state, names, self._state_fill,
                          self._has_step)
            for shadow, p in zip(s.params, ps):
                self._shadows[id(p)] = (p, shadow, p.data_ptr())
            sets.append(s)
        self._groups[gi] = _GroupCache(group["params"], sets, list(names))
        self._rebuilt = True
        return sets

    def _intact_sets(self, gi: int, group: dict) -> Optional[List[FlatSet]]:
        """The base check compares a group's first set with its first param; a shadow set holds fp32 copies
        of the group's low-precision params, so it is checked against the params it writes instead."""
        c = self._groups.get(gi)
        if c is None or self._force_rebuild or self._watch.dirty or not c.sets or not isinstance(c.sets[0], ShadowSet):
            return super()._intact_sets(gi, group)
        ps = group["params"]
        if ps is not c.params or len(ps) != c.n or [p.data_ptr() for p in ps] != c.ptrs:
            return None
        if c.names != self._state_names(group):
            return None
        for s in c.sets:
            if not s.params_intact() or (s.out_params is not None and not s.out_intact()) or s.buffers_moved():
                return None
        return c.sets

    def _master_lists(self, plain: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> List[dict]:
        """Per group ``{"params": [...]}``: the fp32 shadow of each shadowed param (made at the first step),
        ``plain(p)`` for the others and for params not combined yet."""
        def master(p: torch.Tensor) -> Optional[torch.Tensor]:
            rec = self._shadows.get(id(p))
            return rec[1] if rec is not None and rec[0] is p else plain(p)

        return [{"params": [master(p) for p in group["params"]]} for group in self.param_groups]

    def _sync_shadows(self) -> None:
        """Before a step: the model grads bound for the kernel to read in place where this step's update of the
        set can (`_gathers`), else converted into the shadows' grads. Nothing to do (not even a walk over the
        params) where no dtype is shadowed."""
        if not self._shadow_dtypes():
            return
        self._all_sets()  # re-combines what moved, so the sets below are the ones the step updates
        for gi, group in enumerate(self.param_groups):
            for s in self._groups[gi].sets:
                if not isinstance(s, ShadowSet):
                    continue
                gather = self._executor == "auto" and s.args is not None and self._gathers(s, group)
                if not (gather and s.bind_model_grads()):
                    s.mirror_grads()

    def _prepare_step(self):
        prepared = super()._prepare_step()
        for _, sets in prepared:
            for s in sets:
                if isinstance(s, ShadowSet):
                    s.apply_model_grads()
        return prepared

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """As the next class in line decides; the model grads of shadowed params are zeroed too (the base class
        zeroes the flat grad buffers, which here hold the shadows' copies)."""
        super().zero_grad(set_to_none=set_to_none)
        for c in self._groups.values():
            for s in c.sets:
                if isinstance(s, ShadowSet):
                    for model in s.out_params:
                        if model.grad is not None:
                            zero_grad_(model.grad)

    def combined_grad_buffers(self) -> List[torch.Tensor]:
        if any(isinstance(s, ShadowSet) for s in self._all_sets()):
            raise RuntimeError(
                f"{type(self).__name__}: combined grad buffers are fp32 copies for fp16/bf16 params, which amp "
                "cannot scale in place; expected fp32 params here (amp O2 masters), got low-precision params"
            )
        return super().combined_grad_buffers()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts loaded states to the param dtype; fp32 states (`_f32_states`) stay fp32."""
        self._check_loaded(state_dict)  # before this method reads the state_dict itself
        saved_state = state_dict.get("state", {}) if isinstance(state_dict, dict) else {}
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict.get("param_groups", [])))
        super().load_state_dict(state_dict)
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for old_id, p in zip(saved_ids, params):
            entry = saved_state.get(old_id)
            if not entry or not self._f32_states(p.dtype):
                continue
            for name, value in entry.items():
                if name != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    bind(self.state[p], name, value.detach().to(device=p.device, dtype=torch.float32, copy=True))
