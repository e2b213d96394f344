"""Checks of what enters an optimizer: param lists at construction, state dicts at load.

Everything here only reads; it raises (TypeError for a wrong kind of value,
ValueError for a wrong value) naming the group, the param index and the key,
so that the caller can check first and change nothing when a check fails.
A value that passed is what every later ``step()`` can work with: a state
entry that only fails (or silently gives NaN) at the next step is rejected here.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any, Callable, Dict, Iterator, List, Sequence

import torch

from .._checks import FLOAT32_MAX, real_number  # steps are kept as float32 (as torch keeps them)

#: kinds of state entries (`validate_loaded_state`'s ``spec`` values)
PARAM_SHAPED = "param"  # a floating tensor of the param's shape
STEP = "step"  # a finite count >= 0: a number or a 1-element real tensor
COUNT = "count"  # a STEP that an entry with param-shaped states must have (torch's per-param layout)

SCALAR = "scalar"  # a finite number or 1-element floating tensor, within float32's range (kept as float32)


@contextlib.contextmanager
def naming(where: str) -> Iterator[None]:
    """TypeError / ValueError raised inside are re-raised (same type) with ``where: `` in front."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where}: {exc}") from exc


def check_unique_params(owner: str, groups: Sequence[dict], params: Sequence[Any], gi: int) -> None:
    """Params of the group being added as group ``gi``: each tensor once, in no earlier group.

    torch rejects a param shared by two groups (ValueError) and only warns about one listed twice
    in a group; a fused optimizer would update such a param twice per step, so both are errors.
    """
    seen: Dict[int, int] = {}
    for i, p in enumerate(params):
        j = seen.setdefault(id(p), i)
        if j != i:
            raise ValueError(
                f"{owner}: param {i} of param group {gi} is the same tensor as param {j} of that group; "
                "each param may appear only once"
            )
    # one C-level disjointness test over every earlier param (torch's own check builds a set of them all at each
    # add); positions are looked up only to name a shared param. 2000 one-param groups: 0.56 s in all, against
    # 1.28 s for a dict of every earlier param's position per added group and 1.9 s for torch's own check
    earlier = itertools.chain.from_iterable(group["params"] for group in groups)
    if seen.keys().isdisjoint(map(id, earlier)):
        return
    for g, group in enumerate(groups):
        if seen.keys().isdisjoint(map(id, group["params"])):
            continue
        where = {id(p): k for k, p in enumerate(group["params"])}
        i = next(i for i, p in enumerate(params) if id(p) in where)
        raise ValueError(
            f"{owner}: some parameters appear in more than one parameter group: param {i} of param group {gi} "
            f"is param {where[id(params[i])]} of param group {g}"
        )


def _real_tensor_form(value: torch.Tensor, what: str) -> None:
    if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
        raise TypeError(f"{what}: expected a number or a 1-element real tensor, got a {value.dtype} tensor of "
                        f"shape {tuple(value.shape)}")


def _real_number(value: Any, what: str) -> float:
    if isinstance(value, torch.Tensor):
        _real_tensor_form(value, what)
        return float(value.item())
    number = real_number(value)
    if number is None:
        raise TypeError(f"{what}: expected a number, got {value!r} ({type(value).__name__})")
    return float(number)


def check_step_value(value: Any, what: str, *, host_only: bool = False) -> None:
    """A step count: a number or a one-element real tensor (TypeError otherwise), finite, >= 0 and within
    float32's range (ValueError otherwise: bias corrections and schedules divide by or raise to it). The one
    check of a step count wherever one is read: a checkpoint's, a rebound per-param or group ``step``.

    ``host_only``: a tensor on another device is checked for its form only (reading its value would wait for
    the device), as the per-step checks need."""
    if host_only and isinstance(value, torch.Tensor) and value.device.type != "cpu":
        _real_tensor_form(value, what)
        return
    v = _real_number(value, what)
    if not math.isfinite(v) or v < 0 or v > FLOAT32_MAX:
        raise ValueError(f"{what}: expected a finite step count >= 0 (at most {FLOAT32_MAX:.4g}, kept as float32), "
                         f"got {v}")


def check_live_state(owner: str, gi: int, k: int, p: torch.Tensor, st: Any,
                     names: Sequence[str] = ("exp_avg", "exp_avg_sq")) -> None:
    """A param's state as a per-tensor step will read it (user code may have rebound it since the last step): an
    empty dict (a fresh start; pass one for a param without an entry), else a dict holding ``names`` as
    floating-point tensors shaped like the param, on its device, and a step count."""
    where = f"{owner}: state of param {k} in group {gi}"
    if not isinstance(st, dict):
        raise TypeError(f"{where}: expected a dict of state entries (optimizer.state[param]), got {type(st).__name__}")
    if not st:
        return
    for key in names:
        v = st.get(key)
        if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.shape != p.shape or v.device != p.device:
            got = (f"{v.dtype} tensor of shape {tuple(v.shape)} on {v.device}" if isinstance(v, torch.Tensor)
                   else type(v).__name__)
            raise ValueError(f"{where}: {key!r} must be a floating-point tensor of shape {tuple(p.shape)} on "
                             f"{p.device}, got {got}")
    check_step_value(st.get("step"), f"{where}: 'step'", host_only=True)


def _check_entry(what: str, kind: str, value: Any, p: torch.Tensor) -> None:
    if kind == PARAM_SHAPED:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{what}: expected a tensor of shape {tuple(p.shape)}, got {type(value).__name__}")
        if not value.is_floating_point():
            raise TypeError(f"{what}: expected a floating point tensor, got dtype {value.dtype}")
        if value.shape != p.shape:
            raise ValueError(f"{what}: expected shape {tuple(p.shape)} (the param's), got {tuple(value.shape)}")
        if value.device.type == "meta" and p.device.type != "meta":
            raise ValueError(f"{what}: a meta tensor holds no values to load")
    elif kind in (STEP, COUNT):
        check_step_value(value, what)
    elif kind == SCALAR:
        v = _real_number(value, what)
        if not math.isfinite(v) or abs(v) > FLOAT32_MAX:
            raise ValueError(f"{what}: expected a finite value within float32's range (|v| <= {FLOAT32_MAX:.4g}, "
                             f"kept as float32), got {v}")


def validate_loaded_state(owner: str, param_groups: List[dict], state_dict: Any,
                          spec: Callable[[int, dict], Dict[str, str]]) -> None:
    """Checks an optimizer state_dict against the optimizer's current groups; changes nothing.

    ``spec(gi, saved_group)`` gives the known state names of group ``gi`` and their kinds; other
    names are kept as torch keeps them. Of the param-shaped and COUNT names, an entry holds all or none.
    """
    if not isinstance(state_dict, dict) or "param_groups" not in state_dict or "state" not in state_dict:
        raise TypeError(f"{owner}.load_state_dict expects an optimizer state_dict with 'state' and 'param_groups'")
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(saved_groups, (list, tuple)) or not isinstance(saved_state, dict):
        raise TypeError(f"{owner}.load_state_dict: 'param_groups' must be a list and 'state' a dict, got "
                        f"{type(saved_groups).__name__} and {type(saved_state).__name__}")
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"{owner}.load_state_dict: loaded state dict has a different number of parameter groups "
                         f"({len(saved_groups)}) than the optimizer ({len(param_groups)})")
    owner_of: Dict[Any, tuple] = {}
    for gi, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
            raise TypeError(f"{owner}.load_state_dict: param group {gi} must be a dict with a 'params' list")
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"{owner}.load_state_dict: loaded param group {gi} has {len(saved['params'])} params, "
                             f"the optimizer's has {len(group['params'])}")
        if "step" in saved:
            check_step_value(saved["step"], f"{owner}.load_state_dict: param group {gi} 'step'")
        for k, (key, p) in enumerate(zip(saved["params"], group["params"])):
            if key in owner_of:
                raise ValueError(f"{owner}.load_state_dict: param group {gi} lists param id {key!r} twice (index "
                                 f"{owner_of[key][1]} of group {owner_of[key][0]} and index {k})")
            owner_of[key] = (gi, k, p)
    specs = {gi: spec(gi, saved) for gi, saved in enumerate(saved_groups)}
    for key, entry in saved_state.items():
        where = owner_of.get(key)
        if where is None:
            raise ValueError(f"{owner}.load_state_dict: 'state' has an entry for param id {key!r}, which no param "
                             "group lists")
        gi, k, p = where
        prefix = f"{owner}.load_state_dict: state of param {k} in param group {gi}"
        if not isinstance(entry, dict):
            raise TypeError(f"{prefix}: expected a dict of state names, got {type(entry).__name__}")
        kinds = specs[gi]
        for name, kind in kinds.items():
            if name in entry:
                _check_entry(f"{prefix}, key {name!r}", kind, entry[name], p)
        shaped = [n for n, kind in kinds.items() if kind in (PARAM_SHAPED, COUNT)]
        present = [n for n in shaped if n in entry]
        if present and len(present) != len(shaped):
            missing = [n for n in shaped if n not in entry]
            raise ValueError(f"{prefix}: has {present} but lacks {missing}; expected all of {shaped} or none")

