"""Base class of the fused optimizers: torch.optim semantics over combined buffers.

Subclasses describe one optimizer's math once and provide two executors:

* ``_kernel_step``: the apex_C kernel over the whole flat buffers (CPU), one
  call per param group x dtype, per-tensor semantics (step counts, skipped
  params) carried by per-segment arrays;
* ``_torch_step``: the same math as torch ops on flat slices (any device, and
  the fallback without the extension).

Params and states are combined lazily at the first ``step()``, per param group and dtype; the flat grad buffer
only when grads must live in it (kept between steps, amp, clipping; see `_flat`).
Each step first checks that params and grads still share the flat buffers and
heals what user code broke (see `_flat.FlatSet`), so no update is ever silently
applied to a stale buffer. Grads that are not the flat buffer's views (fresh
after ``zero_grad(set_to_none=True)``) are read where they are by optimizers
with ``_gather_grads`` (a per-slot grad address table; no copy). A step is all-or-nothing: every group is checked
(and bad input rejected) before the first group is healed or updated.

Subclass API (stable): ``_state_names(group)``, ``_state_fill``, ``_has_step``,
``_validate_group(group)``, ``_kernel_step(s, group)``, ``_torch_step(s, group)``,
``_prepare_args(s, hp, flags)``, ``_grad_scale()``, ``_f32`` / ``_write_back``;
for code that needs every set before a step (global norms): ``_all_sets()``,
``FlatSet.sync_grads()`` and ``_count_event(healed)``.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import math
from typing import Any, Callable, Container, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .. import _core, _device
from .._checkpoint_keys import AMP_MASTERS_KEY, AMP_SCALERS_KEY
from .._checks import FLOAT32_MAX, PLAIN_TYPES, plain_numbers, real_number
from .._tensor_utils import data_ptr, zero_grad_
from ..contrib.combine_tensors import _hook_owning_modules, compact_state_dict
from ._flat import FlatSet, check_grad, check_states
from ._state_check import COUNT, PARAM_SHAPED, STEP, check_unique_params, naming, validate_loaded_state
from ._state_watch import StateWatch, WatchedStates

logger = logging.getLogger("apex.optimizers")

_repeat = itertools.repeat


def _consume(it) -> None:
    collections.deque(it, maxlen=0)


# torch keeps dynamo out of Optimizer.zero_grad (a graph break per param otherwise); so do we
_disable_dynamo = getattr(torch, "_disable_dynamo", lambda fn: fn)


# torch.optim group options we accept only at their default (torch adds them to
# state_dicts; a loaded value that asks for behaviour we do not have must fail).
_TORCH_ONLY_OPTIONS = {
    "maximize": False,
    "capturable": False,
    "differentiable": False,
}
_IGNORED_OPTIONS = ("foreach", "fused")  # executor choices: ours is always fused


def check_torch_options(owner: str, group: dict) -> None:
    """torch.optim's behaviour options (`_TORCH_ONLY_OPTIONS`) at their default only: a group that asks for
    maximize, capturable or differentiable would otherwise get the plain update without a word."""
    for key, default in _TORCH_ONLY_OPTIONS.items():
        if key in group and bool(group[key]) != default:
            raise ValueError(f"{owner} does not implement {key}={group[key]!r}; expected {key}={default}")


def check_no_amsgrad(owner: str, group: dict) -> None:
    """For the classes whose constructor refuses AMSGrad: a group that asks for it (torch.optim.Adam's
    ``amsgrad=True`` in a loaded checkpoint, or an added group) would silently get plain Adam's denominator."""
    if "amsgrad" in group and bool(group["amsgrad"]):
        raise ValueError(f"{owner} does not support the AMSGrad variant: expected amsgrad=False, got "
                         f"amsgrad={group['amsgrad']!r} (a torch.optim.Adam(amsgrad=True) checkpoint needs "
                         "apex.optimizers.NpuFusedAdam or NpuFusedAdamW)")


def load_filling_defaults(opt: torch.optim.Optimizer, state_dict: dict) -> None:
    """torch's ``load_state_dict`` on ``opt`` (states cast to each param's dtype/device), then every loaded group
    takes the options it lacks from the defaults as they were before the load (checkpoints of older versions lack
    newer options). torch's load adds "differentiable" to ``opt.defaults``; classes that do not have it (NVIDIA's,
    the Ascend patch's own) keep their defaults as they were, so a second load does not spread it into the groups.
    """
    defaults = dict(opt.defaults)
    torch.optim.Optimizer.load_state_dict(opt, state_dict)
    if "differentiable" not in defaults:
        opt.defaults.pop("differentiable", None)
    for g in opt.param_groups:
        for key, value in defaults.items():
            g.setdefault(key, value)


def check_group_keys(owner: str, gi: int, group: dict, defaults: dict) -> None:
    """Every option of ``defaults`` is still in the group (user code or a scheduler may delete one after the
    group was added); torch's behaviour options may be absent (their default applies). KeyError, as torch's
    lookups give, but naming the option, the group and the class. Per group: no per-param cost."""
    for key in defaults:
        if key not in group and key not in _TORCH_ONLY_OPTIONS and key not in _IGNORED_OPTIONS:
            needed = sorted(k for k in defaults if k not in _TORCH_ONLY_OPTIONS and k not in _IGNORED_OPTIONS)
            raise KeyError(f"{owner}: param group {gi} has no {key!r} (it was removed after the group was added); "
                           f"every group needs the options {needed}")


# option values a snapshot holds as they are (immutable; compared with their type, so 1, 1.0 and True differ)
_SNAPSHOT_TYPES = PLAIN_TYPES | {torch.dtype}


def options_snapshot(options: dict, skip: Container[str] = ("params",)) -> Optional[tuple]:
    """The options (but ``skip``) as a tuple that compares equal only to a snapshot of the same keys, in the
    same order, with values of the same types and equal values; None when a value is not a plain immutable
    one (a tensor, a numpy scalar, a dict: those can change in place or compare loosely). A list is recorded
    as a tuple of its values, so a later in-place change of the list is seen. A NaN never equals a snapshot
    taken before it was set (and no snapshot is kept of options that failed their check)."""
    out = []
    for key, value in options.items():
        if key in skip:
            continue
        kind = type(value)
        if kind in _SNAPSHOT_TYPES:
            out.append((key, kind, value))
        elif kind is tuple or kind is list:
            kinds = tuple(map(type, value))
            if not _SNAPSHOT_TYPES.issuperset(kinds):
                return None
            out.append((key, kind, kinds, tuple(value)))
        else:
            return None
    return tuple(out)


#: values of `CombinedOptimizer.executor`
EXECUTORS = ("auto", "torch", "torch_ops")


def _check_range(name: str, value: Any, lo: float, hi: Optional[float] = None, lo_open: bool = False,
                 hi_open: bool = True, allow_inf: bool = False) -> None:
    """``value`` in the interval; NaN is always rejected, infinity unless ``allow_inf`` (an infinite lr
    or weight decay turns every param into inf/NaN at the first step)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Invalid {name}: expected a scalar, got a tensor of shape {tuple(value.shape)}")
        if value.is_meta:
            raise ValueError(f"Invalid {name}: expected a value, got a meta tensor (it holds none)")
        value = value.item()
    number = real_number(value)
    if number is None:
        raise TypeError(f"Invalid {name}: expected a number, got {type(value).__name__}")
    value = number
    if isinstance(value, int) and not -2**63 <= value < 2**63:  # torch's ops take Python ints as int64
        raise ValueError(f"Invalid {name}: an int must fit in int64 (pass a float for larger values), got {value}")
    # the option's own interval first: a beta of 1e70 is out of [0, 1), whatever float32 can hold
    bad_lo = value <= lo if lo_open else value < lo
    bad_hi = hi is not None and (value >= hi if hi_open else value > hi)
    if bad_lo or bad_hi or math.isnan(value):
        lo_s = f"{'(' if lo_open else '['}{lo}"
        hi_s = f"{hi}{')' if hi_open else ']'}" if hi is not None else ("inf]" if allow_inf else "inf)")
        raise ValueError(f"Invalid {name}: expected a value in {lo_s}, {hi_s}, got {value}")
    if abs(value) > FLOAT32_MAX and not allow_inf:  # the update math runs in float32
        raise ValueError(f"Invalid {name}: expected a finite value (at most {FLOAT32_MAX:.4g}), got {value}")


# group options read as booleans by the updates (NVIDIA's and torch's names)
_FLAG_OPTIONS = ("amsgrad", "bias_correction", "centered", "decoupled_decay", "grad_averaging", "init_zero",
                 "lr_in_momentum", "nesterov")


def check_flags(group: dict) -> None:
    """Boolean group options must have a truth value (a multi-element tensor, for one, has none: it would fail
    the update halfway through)."""
    for key in _FLAG_OPTIONS:
        if key in group:
            try:
                bool(group[key])
            except Exception as exc:  # whatever __bool__ raises, the option is unusable
                raise TypeError(f"Invalid {key}: expected a bool, got {type(group[key]).__name__} "
                                f"({exc})") from exc


def check_betas(betas) -> None:
    """Adam-style ``betas``: a pair, each in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: expected a pair (beta1, beta2), got {betas!r}")
    _check_range("beta parameter at index 0", betas[0], 0.0, 1.0)
    _check_range("beta parameter at index 1", betas[1], 0.0, 1.0)


def _check_adam_group(group: dict) -> None:
    """The checks every Adam-family optimizer (Adam, AdamP, LAMB, NovoGrad) runs first: lr, eps, betas, decay."""
    _check_range("learning rate", group["lr"], 0.0)
    _check_range("epsilon value", group["eps"], 0.0)
    check_betas(group["betas"])
    _check_range("weight_decay value", group["weight_decay"], 0.0)


def _on_host_defaults(method: Callable) -> Callable:
    """Runs ``method`` with CPU as the default device when the caller made another the default.

    The optimizers keep their bookkeeping (segment tables, step counts, skip flags, grad address tables) in
    host tensors made without a device, while every buffer that lives with the params names its device. Code
    that sets ``torch.set_default_device("cuda")`` or NVIDIA Apex's old ``torch.set_default_tensor_type(
    torch.cuda.FloatTensor)`` would move that bookkeeping onto the GPU, where host tables and device tensors
    meet in one op and fail. The default is only asked (one empty tensor): the usual CPU default pays nothing
    else, since a device context is a torch function mode that every op of the step would go through.
    """

    @functools.wraps(method)
    def run(*args, **kwargs):
        if torch.empty(0).device.type == "cpu":
            return method(*args, **kwargs)
        with torch.device("cpu"):
            return method(*args, **kwargs)

    run._on_host_defaults = True
    return run


#: the entry points that may make or read the host bookkeeping (wrapped by `_on_host_defaults` in every class,
#: and run eagerly under torch.compile: `_wrap_host_defaults`)
_HOST_DEFAULT_METHODS = ("__init__", "step", "zero_grad", "load_state_dict", "state_dict", "add_param_group",
                         "combined_grad_buffers", "attach_model_params")


def _call_closure(closure: Optional[Callable[[], Any]]) -> Any:
    """``closure()`` with grad enabled (steps run under no_grad), or None without a closure."""
    if closure is None:
        return None
    if not callable(closure):
        raise TypeError(f"step(closure): the closure must be a callable returning the loss (or None), got "
                        f"{type(closure).__name__}")
    with torch.enable_grad():
        return closure()


class _GroupCache:
    """What a param group was combined from, to tell at the next step whether it still holds."""

    __slots__ = ("n", "names", "params", "ptrs", "sets")

    def __init__(self, params: list, sets: List[FlatSet], names: List[str]):
        self.params = params  # the group's list object itself (a strong ref: its id cannot be reused)
        self.n = len(params)
        self.sets = sets
        self.names = names
        self.ptrs = list(map(data_ptr, params))  # in group order, after combining


def group_params(param_group) -> Optional[List[torch.Tensor]]:
    """The params of a group being added, as a list of what to check; None for a set (torch rejects those itself).

    A lone tensor is wrapped; any other iterable is materialised once and stored back, as torch
    does: a generator read by the check would otherwise reach torch empty. Named params (the
    ``(name, tensor)`` pairs of ``module.named_parameters()``, which torch.optim takes since 2.6) are
    returned as their tensors and stored back as they came: torch's ``add_param_group`` splits them
    into ``params`` and ``param_names`` once every check has passed. A group must name all its params
    or none (ValueError, as torch), and a name must be a string.
    """
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
    if "params" not in param_group:
        raise KeyError(f"param_group must have a 'params' entry (the tensors to optimize); it has "
                       f"{sorted(map(str, param_group))}")
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, (set, frozenset)):
        return None
    try:
        materialised = list(params)
    except TypeError:
        raise TypeError(f"param_group['params'] must be a tensor or an iterable of tensors, got "
                        f"{type(params).__name__}") from None
    param_group["params"] = materialised
    named = [isinstance(p, tuple) for p in materialised]
    if not any(named):
        return materialised
    if not all(named):
        raise ValueError(f"all optimizer params should be with/without names: param {named.index(False)} of the "
                         f"group has no name, param {named.index(True)} has one")
    for i, pair in enumerate(materialised):
        if len(pair) != 2 or not isinstance(pair[0], str):
            raise TypeError(f"a named param must be a (name, tensor) pair with a str name, as "
                            f"module.named_parameters() gives; param {i} is {_describe_pair(pair)}")
    return [pair[1] for pair in materialised]


def check_names_agree(owner: str, groups: Sequence[dict], param_group: dict) -> None:
    """A group being added names its params (``(name, tensor)`` pairs) exactly when the existing groups do
    (ValueError, torch's rule, raised here before the group or the optimizer is changed)."""
    params = param_group.get("params")
    if not groups or not isinstance(params, list) or not params:
        return
    named, have = isinstance(params[0], tuple), "param_names" in groups[0]
    if named != have:
        raise ValueError(f"{owner}: all optimizer param groups should be with/without names: cannot add a param "
                         f"group {'with' if named else 'without'} names to groups {'with' if have else 'without'}")


def _describe_pair(pair: tuple) -> str:
    return (f"a tuple of {len(pair)}" if len(pair) != 2 else
            f"a pair whose name is {type(pair[0]).__name__}")


def check_param_kind(owner: str, i: int, p) -> None:
    """Param i must be a real floating point tensor (any float dtype; callers narrow it further)."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"optimizer params must be tensors; param {i} is {type(p).__name__}")
    if p.is_complex():
        raise TypeError(
            f"{owner} does not support complex params (param {i} has dtype {p.dtype}); "
            "optimize torch.view_as_real(param) instead"
        )
    if not p.is_floating_point():
        raise TypeError(f"{owner} can only optimize floating point params; param {i} has dtype {p.dtype}")
    if p.is_inference():
        raise TypeError(f"{owner} cannot optimize param {i}: it is an inference tensor (made under "
                        "torch.inference_mode()), which cannot be updated in place outside it")


_OPTION_TYPES = (type(None), bool, int, float, str, torch.dtype)


@functools.cache
def _cache_names(cls: type) -> frozenset:
    """The attributes `_init_combined` sets on an instance of ``cls`` (its caches), the executor choice excepted."""
    probe = cls.__new__(cls)
    probe._init_combined()
    return frozenset(probe.__dict__) - {"_executor"}


class CombinedOptimizer(torch.optim.Optimizer):
    """torch.optim.Optimizer whose params, grads and states live in flat buffers.

    Attributes:
        recombine_count: how many steps (or ``combined_grad_buffers`` calls) had to
            (re)build flat buffers or copy grads into them: 1 after the first step, then +1 per
            step that found sharing broken by user code. Fresh grads (after
            ``zero_grad(set_to_none=True)``) that the update reads where they are do not count, nor does
            adopting grads that a step read in place and the user kept for the next one.
        last_executor: what ran the last update: ``"apex_C"`` (C++ kernel, CPU) or ``"torch"``
            (torch on the flat buffers: torch's fused op where it has one for the optimizer and
            device, else plain torch ops).
        executor: ``"auto"`` (default: apex_C where it applies, else torch), ``"torch"``
            (never apex_C) or ``"torch_ops"`` (plain torch ops only, no torch fused op).
        apex_grad_scale: see docs/DESIGN-NOTES.md (amp protocol).
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _wrap_host_defaults(cls)

    #: names of per-param state buffers for a group (order = kernel slots s0, s1, s2)
    def _state_names(self, group: dict) -> List[str]:
        raise NotImplementedError  # pragma: no cover - abstract

    #: initial value of each state buffer (0 unless listed)
    _state_fill: Dict[str, float] = {}
    #: whether state[p] carries a 'step' tensor (torch layout)
    _has_step = True
    #: whether `_kernel_step` reads grads only through ``s.args`` (then the base `step()` lets the
    #: kernel read grads where autograd left them, through a grad address table, instead of copying)
    _gather_grads = False
    # the update reads grad values on the host (norms, trust ratios): not possible for meta params
    _reads_values = False

    def __init__(self, params: Iterable, defaults: dict):
        if not isinstance(defaults, dict):
            raise TypeError(f"{type(self).__name__}: defaults must be a dict of hyperparameters, got "
                            f"{type(defaults).__name__}")
        self._init_combined()
        super().__init__(params, defaults)
        # watched from the start: a per-param dict taken before the first step (``opt.state[p]``) is then the
        # one the first step binds its views into, as torch fills the dict it handed out
        self._watch_state()

    def _init_combined(self) -> None:
        self._groups: Dict[int, _GroupCache] = {}
        self._force_rebuild = False
        self._watch = StateWatch()  # set when user code rebinds a state entry (see _state_watch)
        self._rebuilt = False
        self.recombine_count = 0
        self.last_executor: Optional[str] = None
        self._executor = "auto"
        self.apex_grad_scale: Optional[float] = None
        self._model_pairs: Optional[Dict[int, torch.Tensor]] = None
        # the options of each group's last passed step check, under the optimizer's (`_check_step_group`)
        self._checked_options: Dict[int, tuple] = {}
        self._checked_fingerprint: Optional[tuple] = None
        # fp32 masters of an amp O2 checkpoint loaded before amp.initialize (taken by its master creation)
        self.loaded_amp_masters: Optional[List[Optional[torch.Tensor]]] = None
        self.loaded_amp_scalers: Optional[list] = None

    def __getstate__(self) -> dict:
        """torch's fields plus the optimizer's own options: NVIDIA's classes keep constructor options as
        attributes (``adam_w_mode``, ``set_grad_none``, ...), which torch's ``__getstate__`` drops. Plain values
        only; what `_init_combined` sets (caches of the combined layout) is left out, the executor choice kept."""
        state = super().__getstate__()
        state["_apex_options"] = {k: v for k, v in self._own_options().items() if k not in state}
        return state

    def _own_options(self) -> Dict[str, Any]:
        """The instance's plain-valued attributes but the caches `_init_combined` sets: the constructor options of
        NVIDIA's classes (``adam_w_mode``, ``set_grad_none``, ...), the executor choice, torch's own flags."""
        caches = _cache_names(type(self))
        return {k: v for k, v in self.__dict__.items() if k not in caches and isinstance(v, _OPTION_TYPES)}

    def __setstate__(self, state: dict) -> None:
        # unpickling / deepcopy restore torch's fields and the options: flat buffers are rebuilt at the next step
        state = dict(state)
        options = state.pop("_apex_options", {})
        if "_groups" not in self.__dict__:
            self._init_combined()
        super().__setstate__(state)
        self.__dict__.update(options)
        self._watch_state()

    @property
    def executor(self) -> str:
        return self._executor

    @executor.setter
    def executor(self, value: str) -> None:
        if value not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {value!r}")
        self._executor = value

    # ------------------------------------------------------------------ groups
    def _validate_group(self, group: dict) -> None:
        """Range checks of hyperparameters; raises before anything is changed."""
        if "lr" not in group:
            raise KeyError(f"{type(self).__name__}: a param group needs an 'lr' (a learning rate), and the "
                           f"optimizer's defaults have none; the group has {sorted(map(str, group))}")
        _check_range("learning rate", group["lr"], 0.0)

    def _check_params(self, params: Sequence[torch.Tensor]) -> None:
        devices = set()
        seen: Dict[int, int] = {}
        for i, p in enumerate(params):
            check_param_kind(type(self).__name__, i, p)
            j = seen.setdefault(id(p), i)
            if j != i:  # e.g. appended to group["params"] after construction, which add_param_group cannot see
                raise ValueError(f"{type(self).__name__}: param {i} of a param group is the same tensor as its "
                                 f"param {j}; each param may appear only once")
            if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise TypeError(
                    f"{type(self).__name__} supports float32, float16 and bfloat16 params; param {i} has {p.dtype}"
                )
            if p.is_nested:
                raise TypeError(f"{type(self).__name__} does not support nested tensors as params (param {i})")
            if p.layout != torch.strided:
                raise TypeError(f"{type(self).__name__} does not support sparse params (param {i}, {p.layout})")
            devices.add(p.device)
        if len(devices) > 1:
            raise ValueError(
                f"{type(self).__name__}: all params of a group must be on one device, got {sorted(map(str, devices))}"
            )

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group after our checks: param kinds, a param listed twice (in this group or an
        earlier one: ValueError naming both places), torch-only options and hyperparameter ranges."""
        params = group_params(param_group)
        if params is not None:
            check_unique_params(type(self).__name__, self.param_groups, params, len(self.param_groups))
            check_names_agree(type(self).__name__, self.param_groups, param_group)
            self._check_params(params)
        probe = dict(self.defaults)
        probe.update({k: v for k, v in param_group.items() if k != "params"})
        with naming(f"{type(self).__name__}: param group {len(self.param_groups)}"):
            self._check_torch_options(probe)
            check_flags(probe)
            self._validate_group(probe)
        plain_numbers(self.defaults, self.defaults)
        plain_numbers(param_group, self.defaults)
        super().add_param_group(param_group)

    def _check_torch_options(self, group: dict) -> None:
        check_torch_options(type(self).__name__, group)

    # ------------------------------------------------------------ combining
    def _intact_sets(self, gi: int, group: dict) -> Optional[List[FlatSet]]:
        """The group's flat sets if its params still live in them, else None (re-combine needed).

        The per-step cost: one data_ptr per param, as one map() over the group.
        """
        c = self._groups.get(gi)
        if c is None or self._force_rebuild or self._watch.dirty:
            return None
        ps = group["params"]
        if ps is not c.params or len(ps) != c.n or list(map(data_ptr, ps)) != c.ptrs:
            return None
        s0 = c.sets[0] if c.sets else None
        if s0 is not None and (s0.dtype != ps[0].dtype or s0.device != ps[0].device):
            return None  # e.g. meta tensors, whose data pointers are not unique
        if c.names != self._state_names(group):
            return None  # an option that changes the state layout (e.g. amsgrad) was switched
        for s in c.sets:
            if (s.out_params is not None and not s.out_intact()) or s.buffers_moved():
                return None
        return c.sets

    def _watch_state(self) -> None:
        """``self.state`` as a watched mapping (see `_state_watch`). One this optimizer did not make (after
        torch's ``__init__``, a load, an unpickle, or ``opt.state = ...``) is wrapped and counts as rebound."""
        st = self.state
        if type(st) is not WatchedStates or st._watch is not self._watch:
            self.state = WatchedStates(self._watch, st)
            self._watch.dirty = True

    def _check_rebuild(self, group: dict) -> None:
        """Everything a re-combine of `group` would reject, checked before anything is rebound."""
        ps = group["params"]
        self._check_params(ps)
        for k, p in enumerate(ps):
            g = p.grad
            if g is not None:
                check_grad(k, p, g)
        check_states(ps, self.state, self._state_names(group))

    def _hook_modules_of(self, groups: Iterable[dict]) -> None:
        """Hooks the modules holding the params of the groups about to be (re-)combined, and those holding their
        amp O2 model copies (which `FlatSet.attach_out` combines), for compact state dicts
        (`_hook_owning_modules`). One call for all of them: params no tracked module holds cost one walk over the
        interpreter's objects for the whole pass, and the tracked modules are searched once per pass. Once per
        group (or per set's model copies) it was quadratic in the number of groups: per-param groups, as
        mmengine's paramwise options make, took seconds to minutes at the first step."""
        params = [p for group in groups for p in group["params"]]
        if params and self._model_pairs is not None:
            pairs = self._model_pairs
            params += [m for m in map(pairs.get, map(id, params)) if m is not None]
        if params:
            _hook_owning_modules(params)

    def _build_group(self, gi: int, group: dict) -> List[FlatSet]:
        by_kind: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
        self._check_params(group["params"])
        for p in group["params"]:
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        names = self._state_names(group)
        sets = [FlatSet(ps, self.state, names, self._state_fill, self._has_step, self._state_dtype_for(dtype))
                for (dtype, _), ps in by_kind.items()]
        if self._model_pairs is not None:
            for s in sets:
                models = [self._model_pairs.get(id(p)) for p in s.params]
                s.attach_out(models if any(m is not None for m in models) else None)
        self._groups[gi] = _GroupCache(group["params"], sets, list(names))
        self._rebuilt = True
        if self.recombine_count:
            logger.info("apex: re-combined param group %d (%d params) after its sharing was broken",
                        gi, len(group["params"]))
        return sets

    def _prepare_groups(self, gather: bool = False) -> List[Tuple[dict, List[FlatSet]]]:
        """Checks every group, then heals: re-combines moved params, adopts replaced grads.

        ``gather``: sets the kernel updates may instead read replaced grads where they are
        (`FlatSet.plan_gather`: no copy, ``p.grad`` stays the caller's tensor).
        Raises (bad params, sparse or mismatched grads, bad states) before anything is changed.
        """
        plans = []
        fingerprint = self._options_fingerprint()
        plain = [self._check_step_group(gi, group, fingerprint) for gi, group in enumerate(self.param_groups)]
        self._watch_state()
        for gi, group in enumerate(self.param_groups):
            sets = self._intact_sets(gi, group)
            if sets is None:
                with naming(f"{type(self).__name__}: param group {gi}"):
                    self._check_rebuild(group)
                plans.append((gi, group, None, ()))
                continue
            plans.append((gi, group, sets, [self._plan_grads(s, group, gather) for s in sets]))
        for group, known_plain in zip(self.param_groups, plain):
            if not known_plain:  # every check passed: numpy options become the numbers they hold
                plain_numbers(group, self.defaults)
        healed = False
        self._hook_modules_of(group for _, group, sets, _ in plans if sets is None)
        for gi, group, sets, stale in plans:
            if sets is None:
                # grads were validated by _check_rebuild; the new sets read them in place or adopt them, as below
                stale = [self._plan_grads(s, group, gather) for s in self._build_group(gi, group)]
            for s, gs, todo, counts in stale:
                if todo is None:
                    s.use_flat()
                elif gs is not None:
                    s.use_gather(gs, todo, keep=not self._runs_kernel(s) and self._torch_gather_ok(s, group))
                    healed |= bool(todo[1])
                else:
                    healed |= s.sync_grads(todo) > 0 and counts
        self._force_rebuild = self._watch.dirty = False
        self._count_event(healed)
        return [(group, self._groups[gi].sets) for gi, group, _, _ in plans]

    def _options_fingerprint(self) -> Optional[tuple]:
        """What the group checks read besides a group's own options: the optimizer's defaults and its own options
        (`_own_options`: ``adam_w_mode``, ...); None when one of them is not a plain value. Taken once per step; a
        change makes every group be checked again."""
        defaults = options_snapshot(self.defaults, skip=())
        own = options_snapshot(self._own_options(), skip=())
        return None if defaults is None or own is None else (defaults, own)

    def _check_step_group(self, gi: int, group: dict, fingerprint: Optional[tuple] = None) -> bool:
        """A group as the step finds it: hyperparameters that user code or a scheduler rewrote since
        `add_param_group` are checked again (they would otherwise fail halfway through the update, or be
        rejected by the kernel binding without a name), and optimizers whose update reads grad values on the
        host (`_reads_values`) refuse meta params, which hold none. Raises before anything is changed.

        The checks are a function of the group's options and the optimizer's (``fingerprint``, from
        `_options_fingerprint`), so a group whose options are plain values (Python numbers, strings, bools,
        None, and tuples or lists of them) equal, type for type, to those of its last passed check is not
        checked again: with one group per param (mmengine's paramwise options) the checks were a third of the
        step's cost per group. A tensor or numpy option is checked at every step (it can change in place).
        Returns whether the group's options are known to be plain values (`plain_numbers` has nothing to do)."""
        name = type(self).__name__
        ps = group["params"]
        if self._reads_values and ps and ps[0].device.type == "meta":
            raise RuntimeError(f"{name}: param group {gi} is on the meta device, which holds no values; this "
                               "optimizer's update reads grad norms on the host: materialize the params first "
                               "(e.g. module.to_empty(device=...))")
        snap = options_snapshot(group) if fingerprint is not None else None
        if snap is not None:
            if fingerprint != self._checked_fingerprint:
                self._checked_options.clear()
                self._checked_fingerprint = fingerprint
            elif self._checked_options.get(gi) == snap:
                return True
        check_group_keys(name, gi, group, self.defaults)
        with naming(f"{name}: param group {gi}"):
            self._check_torch_options(group)
            check_flags(group)
            self._validate_group(group)
        if snap is not None:
            self._checked_options[gi] = snap
            return True
        self._checked_options.pop(gi, None)
        return False

    def _plan_grads(self, s: FlatSet, group: dict, gather: bool):
        """How this step's update of `s` gets its grads, as (s, grads, todo, counts): they are the slot views
        already (todo None); read where they are (grads, and todo = `FlatSet.plan_gather`'s plan); adopted into
        the flat buffer (grads None, todo = `FlatSet.pending_grads`), also when the grads the last step read in
        place were kept (then ``counts`` is False: no sharing was broken, see ``recombine_count``; so too when
        amp's ``combined_grad_buffers()`` call adopts them); or as planned
        by the set's owner before this step's checks (`FlatSet.planned_grads`: the master weights' model grads).
        Validates; changes nothing else."""
        planned = s.planned_grads()
        if planned is not None:
            return (s, *planned, True)
        gs, ptrs = s.scan_grads()
        if s.scanned_intact(gs, ptrs):
            return s, None, None, False
        kept = s.kept_since_gather(gs)
        if gather and not kept and self._gathers(s, group):
            return s, gs, s.plan_gather(gs, ptrs), True
        return s, None, s.pending_grads(), not kept

    def _runs_kernel(self, s: FlatSet) -> bool:
        """Whether the update of `s` is the apex_C kernel (else a torch executor)."""
        return self._executor == "auto" and s.args is not None

    def _gathers(self, s: FlatSet, group: dict) -> bool:
        """Whether this step's update of `s` can read grads where they are (kernel or torch executor)."""
        if self._runs_kernel(s):
            return self._gather_grads
        return self._torch_gather_ok(s, group)

    def _torch_gather_ok(self, s: FlatSet, group: dict) -> bool:
        """Whether `_torch_gather_step` applies to `s` (torch executors; default: no, grads are copied in). Where
        it does, it is also the update of steps whose grads are the slot views, so both ways of reading grads
        make the same calls (see `_update`)."""
        return False

    def _torch_gather_step(self, s: FlatSet, group: dict) -> None:
        """The torch executor over each updated slot's param/state views and its grad where it is."""
        raise NotImplementedError  # pragma: no cover - only called where _torch_gather_ok said yes

    def _all_sets(self) -> List[FlatSet]:
        """Every flat set, (re-)combined where params moved; grads are not synced (see FlatSet.sync_grads)."""
        out: List[FlatSet] = []
        self._watch_state()
        found = [(gi, group, self._intact_sets(gi, group)) for gi, group in enumerate(self.param_groups)]
        for gi, group, sets in found:
            if sets is None:
                with naming(f"{type(self).__name__}: param group {gi}"):
                    self._check_rebuild(group)
        self._hook_modules_of(group for _, group, sets in found if sets is None)
        for gi, group, sets in found:
            out += self._build_group(gi, group) if sets is None else sets
        self._force_rebuild = self._watch.dirty = False
        return out

    def _count_event(self, healed: bool) -> None:
        """One re-combine event per call, however many groups it touched."""
        if healed or self._rebuilt:
            self.recombine_count += 1
        self._rebuilt = False

    # ----------------------------------------------------------- amp protocol
    def combined_grad_buffers(self) -> List[torch.Tensor]:
        """Flat grad buffers (one per param group x dtype), combining and healing first."""
        sets = [s for _, group_sets in self._prepare_groups() for s in group_sets]
        return [s.flat_g for s in sets]

    def attach_model_params(self, pairs: Optional[Sequence[Tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """O2: after each step, every model param receives its master's value (fused on CPU)."""
        self._model_pairs = None if pairs is None else {id(m): mp for m, mp in pairs}
        self._force_rebuild = True

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """One update of every param with a grad (torch.optim semantics); returns closure()'s loss."""
        loss = _call_closure(closure)
        self._update(self._prepare_step())
        return loss

    def _prepare_step(self) -> List[Tuple[dict, List[FlatSet]]]:
        """Every group checked, then healed for this step's update; fresh grads are read where they are when the
        executor can. Optimizers that need all grads before the first update (global norms) read them from these
        sets, then pass them to `_update`."""
        return self._prepare_groups(gather=self._executor != "torch_ops" and self._gather_grads)

    def _update(self, prepared: List[Tuple[dict, List[FlatSet]]]) -> None:
        """The update of every prepared set with a grad (`_prepare_step`)."""
        for group, sets in prepared:
            for s in sets:
                if s.n_skipped == s.nseg:
                    continue
                s.advance_steps()
                if self._runs_kernel(s):
                    self._kernel_step(s, group)
                    self.last_executor = "apex_C"
                    s.copy_out()
                else:
                    self.last_executor = "torch"
                    # one torch call per slot whether the grads are read in place or are the slot views: torch's
                    # CPU fused kernels round a tensor's vector body and its scalar tail differently (fused
                    # multiply-add against multiply then add), so a call over a flat run of slots and calls per
                    # slot can differ in the last bit (seen: SGD's momentum, 1 ulp)
                    if s.gathered or self._torch_gather_ok(s, group):
                        self._torch_gather_step(s, group)
                    else:
                        self._torch_step(s, group)
                    s.zero_padding()
                    s.copy_out(fused=False)
                s.step_grads = None  # (the torch call took them; released whatever path ran)
                s.expose_new_states(self.state)

    def _grad_scale(self) -> float:
        return 1.0 if self.apex_grad_scale is None else float(self.apex_grad_scale)

    def folds_grad_scale(self) -> bool:
        """Whether the next update takes a folded amp unscale (``apex_grad_scale``) at no extra cost: the apex_C
        kernel multiplies each grad as it reads it. The torch executors cannot: torch's fused optimizers divide
        the caller's grads in place, so a scale makes them copy the grads in and run unfused ops; amp then
        unscales at the exit instead (one fused pass), and the update reads the grads where they are."""
        if self._executor != "auto" or _core.ext is None:
            return False
        return all(p.device.type == "cpu" for g in self.param_groups for p in g["params"][:1])

    def _state_dtype_for(self, dtype: torch.dtype) -> Optional[torch.dtype]:
        """The storage dtype of the states of params of ``dtype`` (None: the params' own, torch's layout)."""
        return None

    def _prepare_args(self, s: FlatSet, hp: List[float], flags: int = 0):
        if s.state_dtype != s.dtype:  # fp32 states of fp16/bf16 params (`_state_dtype_for`)
            flags |= _core.ext.FLAG_F32_STATES
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

    def _torch_fused_ok(self, s: FlatSet) -> bool:
        """Whether a torch executor may run torch's own fused op over `s`: not the plain-ops executor, fp32, no
        folded grad scale (torch's op would unscale the caller's grads in place), and a device torch lists for its
        fused kernels."""
        return (
            self._executor != "torch_ops"
            and s.dtype == torch.float32
            and self._grad_scale() == 1.0
            and s.device.type in _device.fused_optimizer_devices()
        )

    # Helpers for torch executors: fp32 working copies of low-precision slices.
    @staticmethod
    def _f32(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == torch.float32 else t.float()

    @staticmethod
    def _write_back(dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)

    def _update_runs(self, s: FlatSet, names: Sequence[str],
                     update: Callable[[torch.Tensor, torch.Tensor, List[Optional[torch.Tensor]], float], None]) -> None:
        """The loop of the elementwise torch executors, over each run of segments with a grad.

        ``update(p, g, states, step)`` gets fp32 working copies of the run's param, grad and
        ``names`` states (None for a state the set does not keep) and changes p and the states in
        place; they are then written back to the flat buffers.
        """
        for lo, hi, step, _, _ in s.active_runs():
            p = self._f32(s.flat_p[lo:hi])
            states = [self._f32(s.flat_s[n][lo:hi]) if n in s.flat_s else None for n in names]
            update(p, self._f32(s.flat_g[lo:hi]), states, step)
            self._write_back(s.flat_p[lo:hi], p)
            for n, t in zip(names, states):
                if t is not None:
                    self._write_back(s.flat_s[n][lo:hi], t)

    # ------------------------------------------------------------ state dict
    def state_dict(self) -> dict:
        """torch.optim layout; views into combined buffers are cloned (compact checkpoints)."""
        return compact_state_dict(super().state_dict())

    def _loaded_state_spec(self, group: dict) -> Dict[str, str]:
        """Known per-param state names of a group (with its loaded options) and their kinds (see _state_check)."""
        spec = {name: PARAM_SHAPED for name in self._state_names(group)}
        # per-param steps: required beside the states in torch's layout; in NVIDIA's (group step) only checked,
        # since a torch checkpoint loaded into an NVIDIA-style optimizer carries them
        spec["step"] = COUNT if self._has_step else STEP
        return spec

    def _check_loaded(self, state_dict: Any) -> None:
        """Everything ``load_state_dict`` checks, before it changes anything (see `validate_loaded_state`)."""
        name = type(self).__name__
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict or "state" not in state_dict:
            raise TypeError(f"{name}.load_state_dict expects an optimizer state_dict with 'state' and 'param_groups'")
        probes = []
        for gi, g in enumerate(state_dict["param_groups"] if isinstance(state_dict["param_groups"], (list, tuple))
                               else ()):
            if not isinstance(g, dict):
                raise TypeError(f"{name}.load_state_dict: param group {gi} must be a dict, got {type(g).__name__}")
            probe = dict(self.defaults)
            probe.update({k: v for k, v in g.items() if k != "params"})
            with naming(f"{name}.load_state_dict: param group {gi}"):
                self._check_torch_options(g)
                check_flags(probe)
                self._validate_group(probe)
            probes.append(probe)
        validate_loaded_state(name, self.param_groups, state_dict, lambda gi, _: self._loaded_state_spec(probes[gi]))

    def _check_loaded_masters(self, saved: Any) -> Optional[List[Optional[torch.Tensor]]]:
        """An amp O2 checkpoint's masters (one entry per param, None where the param was its own master)."""
        if saved is None:
            return None
        params = [p for g in self.param_groups for p in g["params"]]
        name = type(self).__name__
        if not isinstance(saved, (list, tuple)) or len(saved) != len(params):
            raise ValueError(f"{name}.load_state_dict: '{AMP_MASTERS_KEY}' must be a list of {len(params)} entries "
                             f"(one per param), got {saved!r:.80}")
        for i, (p, m) in enumerate(zip(params, saved)):
            if m is not None and (not isinstance(m, torch.Tensor) or not m.is_floating_point() or m.shape != p.shape):
                raise ValueError(f"{name}.load_state_dict: '{AMP_MASTERS_KEY}' entry {i}: expected None or a floating "
                                 f"tensor of shape {tuple(p.shape)}, got {m!r:.80}")
        return [None if m is None else m.detach().to(device=p.device, dtype=torch.float32, copy=True)
                for p, m in zip(params, saved)]

    def _check_loaded_scalers(self, saved: Any) -> Optional[list]:
        """An amp checkpoint's loss scalers, validated (`amp.scaler.check_scaler_states`), for an
        `amp.initialize` that comes after this load (the load-then-initialize order)."""
        if saved is None:
            return None
        from ..amp.scaler import check_scaler_states  # imported here: apex.amp imports the optimizers

        return check_scaler_states(saved, f"{type(self).__name__}.load_state_dict: '{AMP_SCALERS_KEY}'")

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load (states cast to each param's dtype/device); buffers are re-combined at the next step.

        Rejected before anything is changed: options we do not implement (maximize, capturable,
        differentiable set), out-of-range hyperparameters, and state entries a step could not use
        (TypeError/ValueError naming the group, param index and key: a non-tensor, non-floating or
        wrongly shaped state, a step that is not a finite count >= 0, an incomplete entry, ids no
        group lists).
        """
        self._check_loaded(state_dict)
        masters = self._check_loaded_masters(state_dict.get(AMP_MASTERS_KEY))
        scalers = self._check_loaded_scalers(state_dict.get(AMP_SCALERS_KEY))
        load_filling_defaults(self, state_dict)
        self._watch_state()  # torch's load made new dicts: watched before user code can take one
        self.loaded_amp_masters = masters
        self.loaded_amp_scalers = scalers
        self._groups.clear()
        self._force_rebuild = True

    @_disable_dynamo
    def _drop_grads(self) -> None:
        """torch's ``zero_grad(set_to_none=True)``, under the same profiler label: every ``p.grad = None``.

        One C-level pass per group, ``map(setattr, ...)``, with no ``p.grad is not None`` test first: a
        None grad set to None stays None, and reading ``p.grad`` makes a Python object for every grad
        autograd left (they have none until read) only to drop it. With 5000 small params, 1.7-2.1 ms
        against torch's 2.4-2.7 ms; the rest is freeing the grads.
        """
        if not hasattr(self, "_zero_grad_profile_name"):
            self._patch_step_function()
        with torch.autograd.profiler.record_function(self._zero_grad_profile_name):
            for group in self.param_groups:
                _consume(map(setattr, group["params"], _repeat("grad"), _repeat(None)))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch: set_to_none=True drops grads (re-bound at the next step), False zeroes them in place.

        With set_to_none=False, a combined group whose grads are all still its views is zeroed
        with one fill per flat grad buffer; other grads are zeroed one by one, as torch does.
        """
        if set_to_none:
            self._drop_grads()
            return
        for gi, group in enumerate(self.param_groups):
            c = self._groups.get(gi)
            ps = group["params"]
            if c is not None and ps is c.params and len(ps) == c.n and all(s.grads_intact() for s in c.sets):
                for s in c.sets:
                    if s.n_skipped < s.nseg:
                        _core.fill_(s.flat_g, 0.0)
                continue
            for p in ps:
                if p.grad is not None:
                    zero_grad_(p.grad)


def _wrap_host_defaults(cls: type) -> None:
    """`_on_host_defaults` around each entry point ``cls`` itself defines (subclasses get theirs at creation).

    They are also kept out of dynamo, as torch keeps its own ``zero_grad``: a function under ``torch.compile``
    that calls them (torch's "compiled optimizer step" recipe, a whole compiled training step, amp's exit
    reaching the combined buffers) breaks the graph there and runs them as they are. Traced, their bookkeeping
    in Python over params and grads broke the graph at every step, and dynamo failed inside its own tracer on
    some of it.
    """
    for name in _HOST_DEFAULT_METHODS:
        fn = cls.__dict__.get(name)
        if callable(fn) and not getattr(fn, "_on_host_defaults", False):
            wrapped = _disable_dynamo(_on_host_defaults(fn))
            wrapped._on_host_defaults = True
            setattr(cls, name, wrapped)


_wrap_host_defaults(CombinedOptimizer)
