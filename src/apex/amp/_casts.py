"""O1 casting: value casts, user-registered function casts, decorators, ``disable_casts``.

O1 runs each amp-initialized model's forward under ``torch.autocast``; autocast's
op lists are fixed inside torch, so functions a user wants cast differently are
named with ``register_{half,float,promote}_function(module, name)``. While an O1
session is active, ``module.name`` is replaced by a wrapper that casts the
floating-point tensor arguments (also inside lists, tuples and dicts) and calls
the original; teardown puts the original back. ``amp.initialize`` patches
nothing in torch globally, and only the attribute named is wrapped: references
taken before (``from torch import matmul``) and tensor methods are not
intercepted. (The older ``amp.init()`` API does patch torch's listed functions
process-wide, see ``_global_casts``; registered functions cast under an active
``amp.init`` handle too.)

"half" means the session's low-precision dtype (fp16 or bf16). "promote" casts
every floating tensor argument to the widest floating dtype among them.

Registered functions and the ``*_function`` decorators cast whenever an O1
session is active (inside or outside the model's forward), as upstream's
patching did, except inside ``disable_casts()``. Inside the forward, autocast
still applies to the ops the function runs: for ops on autocast's own lists its
policy wins, unless the session was started with ``user_cast_preferred=True``,
which runs registered functions with autocast disabled so the user's cast holds.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .._tensor_utils import map_tensors
from ._amp_state import _amp_state, logger

_local = threading.local()

HALF, FLOAT, PROMOTE = "half", "float", "promote"

# (module, name) -> kind, in registration order; read when an O1 session starts.
_USER_CAST_REGISTRY: Dict[Tuple[int, str], Tuple[Any, str, str]] = {}


# ---------------------------------------------------------------- value casts


def cast_tensors(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor cast to ``dtype``; containers are rebuilt, never mutated."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return map_tensors(value, cast)


def _floating_dtypes(value: Any, out: List[torch.dtype]) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            out.append(value.dtype)
    elif isinstance(value, dict):
        for v in value.values():
            _floating_dtypes(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _floating_dtypes(v, out)


def widest_dtype(args: Any, kwargs: Any) -> Optional[torch.dtype]:
    found: List[torch.dtype] = []
    _floating_dtypes(args, found)
    _floating_dtypes(kwargs, found)
    if not found:
        return None
    return functools.reduce(torch.promote_types, found)


# ---------------------------------------------------------------- cast context


def casts_disabled() -> bool:
    return getattr(_local, "disabled", 0) > 0


def cast_session():
    """What registered-function casts follow right now: the active O1 session, else an active ``amp.init``
    handle (both have ``low_dtype``, ``device_type``, ``user_cast_preferred``), else None."""
    if casts_disabled():
        return None
    session = _amp_state.session
    if session is not None and session.patch_functions:
        return session
    handle = _amp_state.init_handle
    if handle is not None and getattr(handle, "function_patches", None) is not None and handle.is_active():
        return handle
    return None


@contextlib.contextmanager
def disable_casts():
    """Run the block without amp's casts: no autocast, no registered-function or decorator casts."""
    _local.disabled = getattr(_local, "disabled", 0) + 1
    session = _amp_state.session
    try:
        if session is not None and session.patch_functions:
            with torch.autocast(session.device_type, enabled=False):
                yield
        else:
            yield
    finally:
        _local.disabled -= 1


def _lower_to(low: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(low) if t.is_floating_point() and t.dtype not in (low, torch.float64) else t

    return cast


def _raise_low(t: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 to float32; any other tensor (float64 too) as it is."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _call_cast(orig: Callable, kind: str, args: tuple, kwargs: dict):
    session = cast_session()
    if session is None:
        return orig(*args, **kwargs)
    if kind == HALF:
        # float64 stays, as upstream's casts leave it: a user who asked for double precision keeps it
        args, kwargs = (map_tensors(v, _lower_to(session.low_dtype)) for v in (args, kwargs))
    elif kind == FLOAT:
        args, kwargs = (map_tensors(v, _raise_low) for v in (args, kwargs))
    else:
        dtype = widest_dtype(args, kwargs)
        if dtype is not None:
            args = cast_tensors(args, dtype)
            kwargs = cast_tensors(kwargs, dtype)
    if session.user_cast_preferred:
        with torch.autocast(session.device_type, enabled=False):
            return orig(*args, **kwargs)
    return orig(*args, **kwargs)


def make_cast_wrapper(orig: Callable, kind: str) -> Callable:
    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        return _call_cast(orig, kind, args, kwargs)

    wrapper._apex_amp_original = orig
    wrapper._apex_amp_kind = kind
    return wrapper


# ---------------------------------------------------------------- decorators


def half_function(fn: Callable) -> Callable:
    """Decorator: under an active O1 session, call ``fn`` with float32 tensor args cast to the low dtype (float64
    stays)."""
    return make_cast_wrapper(fn, HALF)


def float_function(fn: Callable) -> Callable:
    """Decorator: under an active O1 session, call ``fn`` with float16/bfloat16 tensor args cast to float32."""
    return make_cast_wrapper(fn, FLOAT)


def promote_function(fn: Callable) -> Callable:
    """Decorator: under an active O1 session, cast floating tensor args to the widest dtype among them."""
    return make_cast_wrapper(fn, PROMOTE)


# ---------------------------------------------------------------- registry


def _describe(module: Any) -> str:
    return getattr(module, "__name__", None) or type(module).__name__


def check_replaceable(module: Any, name: str, where: str) -> None:
    """``module.name`` exists, is callable, and can be replaced by a wrapper (amp patches it while a session is
    active): TypeError/ValueError naming it otherwise. Probed by setting the attribute to what it holds, then
    putting back exactly what was there (an inherited attribute is not left as an own one), so nothing changes."""
    if not isinstance(name, str):
        raise TypeError(f"{where}: name must be a str, got {type(name).__name__}")
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")
    value = getattr(module, name)
    if not callable(value):
        raise ValueError(f"{module}.{name} is not callable (got {type(value).__name__})")
    own = getattr(module, "__dict__", None)
    had_own = isinstance(own, Mapping) and name in own
    try:
        setattr(module, name, own[name] if had_own else value)
    except (AttributeError, TypeError) as exc:
        raise TypeError(f"{where}: {_describe(module)}.{name} cannot be replaced ({exc}); amp wraps the attribute "
                        f"while an O1 session is active, so it must be a settable attribute of a module or class "
                        f"(wrap the function in a module of your own, or use the *_function decorators)") from exc
    if not had_own:
        own = getattr(module, "__dict__", None)
        if isinstance(own, Mapping) and name in own:
            delattr(module, name)


def check_registry(where: str) -> None:
    """Every registered function can still be patched (one may have been deleted or frozen since)."""
    for module, name, kind in list(_USER_CAST_REGISTRY.values()):
        check_replaceable(module, name, f"{where}: registered {kind} function")


def _register(module: Any, name: str, kind: str) -> None:
    check_replaceable(module, name, f"register_{kind}_function")
    # installed first and recorded last: a registration that fails records nothing
    undo = []
    try:
        session = _amp_state.session
        if session is not None and session.patch_functions:
            undo.append(session.function_patches.install(module, name, kind))
        handle = _amp_state.init_handle
        if handle is not None and getattr(handle, "function_patches", None) is not None and handle.is_active():
            undo.append(handle.function_patches.install(module, name, kind))
    except BaseException:
        for step in reversed(undo):
            step()
        raise
    _USER_CAST_REGISTRY[(id(module), name)] = (module, name, kind)


def register_half_function(module: Any, name: str) -> None:
    """Cast the args of ``module.name`` to the low-precision dtype while an O1 session is active."""
    _register(module, name, HALF)


def register_float_function(module: Any, name: str) -> None:
    """Cast the args of ``module.name`` to float32 while an O1 session is active."""
    _register(module, name, FLOAT)


def register_promote_function(module: Any, name: str) -> None:
    """Cast the args of ``module.name`` to their widest floating dtype while an O1 session is active."""
    _register(module, name, PROMOTE)


class FunctionPatches:
    """The module attributes one session has wrapped, and how to put them back."""

    def __init__(self) -> None:
        self._installed: Dict[Tuple[int, str], Tuple[Any, str, Callable, Callable]] = {}

    def install_registry(self) -> None:
        """Every registered function, or none: a failure puts back the ones this call installed."""
        undo = []
        try:
            for module, name, kind in list(_USER_CAST_REGISTRY.values()):
                undo.append(self.install(module, name, kind))
        except BaseException:
            for step in reversed(undo):
                step()
            raise

    def install(self, module: Any, name: str, kind: str) -> Callable[[], None]:
        """Wrap ``module.name``; returns what undoes exactly this install."""
        key = (id(module), name)
        current = getattr(module, name)
        previous = self._installed.get(key)
        if previous is not None and current is previous[3]:
            orig = previous[2]  # re-registration with another kind: wrap the original again
        else:
            # A wrapper left by another session (not torn down) is unwrapped, never stacked.
            orig = getattr(current, "_apex_amp_patch_of", current)
        wrapper = make_cast_wrapper(orig, kind)
        wrapper._apex_amp_patch_of = orig  # marks registry wrappers (decorated functions are left alone)
        setattr(module, name, wrapper)
        self._installed[key] = (module, name, orig, wrapper)

        def undo() -> None:
            if getattr(module, name, None) is wrapper:
                setattr(module, name, current)
            if previous is None:
                self._installed.pop(key, None)
            else:
                self._installed[key] = previous

        return undo

    def restore(self) -> None:
        for module, name, orig, wrapper in self._installed.values():
            if getattr(module, name, None) is wrapper:
                setattr(module, name, orig)
            else:
                logger.warning(
                    "apex.amp: %s.%s was replaced by other code while amp was active; leaving it as it is",
                    getattr(module, "__name__", module), name,
                )
        self._installed.clear()

    def __len__(self) -> int:
        return len(self._installed)
