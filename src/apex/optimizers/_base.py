"""Base class of the fused optimizers: torch.optim semantics over combined buffers.

Subclasses describe one optimizer's math once and provide two executors:

* ``_kernel_step``: the apex_C kernel over the whole flat buffers (CPU), one
  call per param group x dtype, per-tensor semantics (step counts, skipped
  params) carried by per-segment arrays;
* ``_torch_step``: the same math as torch ops on flat slices (any device, and
  the fallback without the extension).

Params are combined lazily at the first ``step()``, per param group and dtype.
Each step first checks that params and grads still share the flat buffers and
heals what user code broke (see `_flat.FlatSet`), so no update is ever silently
applied to a stale buffer.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .. import _core
from ..contrib.combine_tensors import compact_state_dict
from ._flat import FlatSet

logger = logging.getLogger("apex.optimizers")

# torch.optim group options we accept only at their default (torch adds them to
# state_dicts; a loaded value that asks for behaviour we do not have must fail).
_TORCH_ONLY_OPTIONS = {
    "maximize": False,
    "capturable": False,
    "differentiable": False,
}
_IGNORED_OPTIONS = ("foreach", "fused")  # executor choices: ours is always fused


def _check_range(name: str, value: Any, lo: float, hi: Optional[float] = None, lo_open: bool = False,
                 hi_open: bool = True) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Invalid {name}: expected a scalar, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"Invalid {name}: expected a number, got {type(value).__name__}")
    bad_lo = value <= lo if lo_open else value < lo
    bad_hi = hi is not None and (value >= hi if hi_open else value > hi)
    if bad_lo or bad_hi or math.isnan(value):
        lo_s = f"{'(' if lo_open else '['}{lo}"
        hi_s = f"{hi}{')' if hi_open else ']'}" if hi is not None else "inf)"
        raise ValueError(f"Invalid {name}: expected a value in {lo_s}, {hi_s}, got {value}")


class CombinedOptimizer(torch.optim.Optimizer):
    """torch.optim.Optimizer whose params, grads and states live in flat buffers."""

    #: names of per-param state buffers for a group (order = kernel slots s0, s1, s2)
    def _state_names(self, group: dict) -> List[str]:
        raise NotImplementedError  # pragma: no cover - abstract

    #: initial value of each state buffer (0 unless listed)
    _state_fill: Dict[str, float] = {}
    #: whether state[p] carries a 'step' tensor (torch layout)
    _has_step = True

    def __init__(self, params: Iterable, defaults: dict):
        self._sets: Dict[int, Tuple[Any, List[FlatSet]]] = {}
        self._force_rebuild = False
        self._rebuilt = False
        self.recombine_count = 0
        self.last_executor: Optional[str] = None
        self.apex_grad_scale: Optional[float] = None
        self._model_pairs: Optional[Dict[int, torch.Tensor]] = None
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups
    def _validate_group(self, group: dict) -> None:
        """Range checks of hyperparameters; raises before anything is changed."""
        _check_range("learning rate", group["lr"], 0.0)

    def _check_params(self, params: Sequence[torch.Tensor]) -> None:
        devices = set()
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"optimizer params must be tensors; param {i} is {type(p).__name__}")
            if not (p.is_floating_point() or p.is_complex()):
                raise TypeError(
                    f"{type(self).__name__} can only optimize floating point params; param {i} has dtype {p.dtype}"
                )
            if p.is_complex():
                raise TypeError(
                    f"{type(self).__name__} does not support complex params (param {i} has dtype {p.dtype}); "
                    "view them as real with torch.view_as_real"
                )
            if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise TypeError(
                    f"{type(self).__name__} supports float32, float16 and bfloat16 params; param {i} has {p.dtype}"
                )
            if p.is_sparse:
                raise TypeError(f"{type(self).__name__} does not support sparse params (param {i})")
            devices.add(p.device)
        if len(devices) > 1:
            raise ValueError(
                f"{type(self).__name__}: all params of a group must be on one device, got {sorted(map(str, devices))}"
            )

    def add_param_group(self, param_group: dict) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self._check_params(params)
        probe = dict(self.defaults)
        probe.update({k: v for k, v in param_group.items() if k != "params"})
        self._check_torch_options(probe)
        self._validate_group(probe)
        super().add_param_group(param_group)

    def _check_torch_options(self, group: dict) -> None:
        for key, default in _TORCH_ONLY_OPTIONS.items():
            if key in group and bool(group[key]) != default:
                raise ValueError(
                    f"{type(self).__name__} does not implement {key}={group[key]!r}; expected {key}={default}"
                )

    # ------------------------------------------------------------ combining
    def _group_sets(self, gi: int, group: dict) -> List[FlatSet]:
        params = group["params"]
        key = (id(params), len(params))
        cached = self._sets.get(gi)
        if cached is not None and cached[0] == key and not self._force_rebuild:
            sets = cached[1]
            broken = [s for s in sets if not s.params_intact() or not s.out_intact()]
            if not broken and sets and sets[0].state_names == self._state_names(group):
                return sets
            logger.info("apex: combined params of group %d were rebound by user code; re-combining", gi)
        return self._build_group(gi, group, key)

    def _build_group(self, gi: int, group: dict, key) -> List[FlatSet]:
        by_kind: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
        self._check_params(group["params"])
        for p in group["params"]:
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        names = self._state_names(group)
        sets = [
            FlatSet(ps, self.state, names, self._state_fill, self._has_step) for ps in by_kind.values() if ps
        ]
        if self._model_pairs is not None:
            for s in sets:
                models = [self._model_pairs.get(id(p)) for p in s.params]
                s.attach_out(models if all(m is not None for m in models) else None)
        self._sets[gi] = (key, sets)
        self._rebuilt = True
        return sets

    def _all_sets(self) -> List[FlatSet]:
        out = []
        for gi, group in enumerate(self.param_groups):
            out += self._group_sets(gi, group)
        self._force_rebuild = False
        return out

    def _count_event(self, healed: bool) -> None:
        """One re-combine event per call, however many groups it touched."""
        if healed or self._rebuilt:
            self.recombine_count += 1
        self._rebuilt = False

    # ----------------------------------------------------------- amp protocol
    def combined_grad_buffers(self) -> List[torch.Tensor]:
        """Flat grad buffers (one per param group x dtype), combining and healing first."""
        sets = self._all_sets()
        adopted = sum(s.sync_grads() for s in sets)
        self._count_event(adopted > 0)
        return [s.flat_g for s in sets]

    def attach_model_params(self, pairs: Optional[Sequence[Tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """O2: after each step, every model param receives its master's value (fused on CPU)."""
        self._model_pairs = None if pairs is None else {id(m): mp for m, mp in pairs}
        self._force_rebuild = True

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        healed = False
        for gi, group in enumerate(self.param_groups):
            for s in self._group_sets(gi, group):
                if s.sync_grads():
                    healed = True
                if s.n_skipped == s.nseg:
                    continue
                s.advance_steps()
                if s.args is not None:
                    self._kernel_step(s, group)
                    self.last_executor = "apex_C"
                else:
                    self._torch_step(s, group)
                s.copy_out()
                s.expose_new_states(self.state)
        self._force_rebuild = False
        self._count_event(healed)
        return loss

    def _grad_scale(self) -> float:
        return 1.0 if self.apex_grad_scale is None else float(self.apex_grad_scale)

    def _prepare_args(self, s: FlatSet, hp: List[float], flags: int = 0):
        a = s.args
        a.hp = hp
        a.flags = flags
        a.grad_scale = self._grad_scale()
        a.skip = s.skip.data_ptr() if s.n_skipped else 0
        a.threads = _core.num_threads()
        return a

    def _kernel_step(self, s: FlatSet, group: dict) -> None:
        raise NotImplementedError  # pragma: no cover - abstract

    def _torch_step(self, s: FlatSet, group: dict) -> None:
        raise NotImplementedError  # pragma: no cover - abstract

    # Helpers for torch executors: fp32 working copies of low-precision slices.
    @staticmethod
    def _f32(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == torch.float32 else t.float()

    @staticmethod
    def _write_back(dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)

    # ------------------------------------------------------------ state dict
    def state_dict(self) -> dict:
        """torch.optim layout; views into combined buffers are cloned (compact checkpoints)."""
        return compact_state_dict(super().state_dict())

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict.get("param_groups", [])
        for g in groups:
            self._check_torch_options(g)
            probe = dict(self.defaults)
            probe.update({k: v for k, v in g.items() if k != "params"})
            self._validate_group(probe)
        super().load_state_dict(state_dict)
        for g in self.param_groups:
            for key in _IGNORED_OPTIONS:
                g.setdefault(key, None)
        self._sets.clear()
        self._force_rebuild = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch: set_to_none=True drops grads (re-bound at the next step), False zeroes buffers."""
        if set_to_none:
            super().zero_grad(set_to_none=True)
            return
        zeroed = set()
        for _, sets in self._sets.values():
            for s in sets:
                self._count_event(s.sync_grads() > 0)
                _core.fill_(s.flat_g, 0.0)
                zeroed.update(id(g) for g in s.grad_views)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p.grad) not in zeroed:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()
