"""The process-wide casts of ``amp.init()``: torch functions and Tensor methods wrapped by policy.

``amp.init`` predates ``amp.initialize``: there is no model whose forward could
run under autocast, so the casts must apply wherever the listed functions are
called. While a handle is active, each name of ``_cast_lists.policy_table()``
is replaced in its namespace by a wrapper that casts the floating tensor
arguments (also inside lists, tuples and dicts) and calls the original;
``_deactivate`` puts every original back (for ``torch.Tensor`` and
``torch._VF``, whose entries are usually inherited or looked up lazily, the
wrapper attribute is deleted again rather than overwritten).

Weight-cast cache: a leaf tensor that requires grad (a parameter) cast to a
low-precision dtype is cast once and reused until ``clear()`` (each
``scale_loss`` exit, i.e. once per iteration), so a weight used by several
layers is not cast several times. A cached cast is not reused when the source
was modified in place since (its version counter moved), nor when it was made
with grad disabled and grad is enabled now (an eval pass between training steps
would otherwise hand the next training forward a cast without a graph to the
weight).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .._tensor_utils import map_tensors
from . import _cast_lists as lists
from ._amp_state import logger
from ._casts import casts_disabled, widest_dtype

_LOW = (torch.float16, torch.bfloat16)


class CastCache:
    """Casts of parameters for one iteration, keyed by (source id, dtype); the source is kept alive by the entry."""

    def __init__(self) -> None:
        self._entries: Dict[Tuple[int, torch.dtype], Tuple[torch.Tensor, int, bool, torch.Tensor]] = {}

    def cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (id(t), dtype)
        grad_on = torch.is_grad_enabled()
        entry = self._entries.get(key)
        if entry is not None:
            src, version, made_with_grad, value = entry
            if src is t and version == t._version and (made_with_grad or not grad_on):
                return value
        value = t.to(dtype)
        self._entries[key] = (t, t._version, grad_on, value)
        return value

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class GlobalCasts:
    """The wrappers one ``amp.init`` handle installed, the cast rules they follow, and how to undo them."""

    def __init__(self, low_dtype: torch.dtype, allow_banned: bool, cache: Optional[CastCache],
                 verbose: bool = False) -> None:
        self.low_dtype = low_dtype
        self.allow_banned = allow_banned
        self.cache = cache
        self.verbose = verbose  # log every cast call (upstream's verbose=True printed them)
        self.enabled = True  # False once the handle is deactivated (a wrapper captured earlier stops casting)
        self._installed: List[Tuple[Any, str, bool, Any, Callable]] = []

    # ---------------------------------------------------------------- casts

    def _to(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.cache is not None and dtype in _LOW and t.is_leaf and t.requires_grad:
            return self.cache.cast(t, dtype)
        return t.to(dtype)

    def cast_half(self, value: Any) -> Any:
        low = self.low_dtype

        def cast(t: torch.Tensor) -> torch.Tensor:
            # float64 stays: a user who asked for double precision keeps it.
            if t.is_floating_point() and t.dtype != low and t.dtype != torch.float64:
                return self._to(t, low)
            return t

        return map_tensors(value, cast)

    def cast_float(self, value: Any) -> Any:
        def cast(t: torch.Tensor) -> torch.Tensor:
            return self._to(t, torch.float32) if t.dtype in _LOW else t

        return map_tensors(value, cast)

    def cast_widest(self, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        dtype = widest_dtype(args, kwargs)
        if dtype is None:
            return args, kwargs

        def cast(t: torch.Tensor) -> torch.Tensor:
            return self._to(t, dtype) if t.is_floating_point() and t.dtype != dtype else t

        return map_tensors(args, cast), map_tensors(kwargs, cast)

    def wrap(self, orig: Callable, name: str, policy: str) -> Callable:
        def wrapper(*args, **kwargs):
            if not self.enabled or casts_disabled():
                return orig(*args, **kwargs)
            if self.verbose:
                logger.info("apex.amp: %s (%s cast)", name, policy)
            if policy == lists.HALF:
                args, kwargs = self.cast_half(args), self.cast_half(kwargs)
            elif policy == lists.FLOAT:
                args, kwargs = self.cast_float(args), self.cast_float(kwargs)
            elif policy in (lists.PROMOTE, lists.SEQUENCE):
                args, kwargs = self.cast_widest(args, kwargs)
            elif policy == lists.BANNED:
                if not self.allow_banned:
                    raise NotImplementedError(lists.FUNCTIONAL_BANNED[name])
                args, kwargs = self.cast_float(args), self.cast_float(kwargs)
            elif policy == lists.INPLACE_FLOAT:
                if args and isinstance(args[0], torch.Tensor) and args[0].dtype in _LOW:
                    raise NotImplementedError(
                        f"amp: cannot run the in-place {name} on a {args[0].dtype} tensor: amp runs {name} in "
                        f"float32, and a {args[0].dtype} tensor cannot hold that result in place. Use the "
                        f"out-of-place form, or cast the tensor to float32 first."
                    )
            return orig(*args, **kwargs)

        try:
            functools.update_wrapper(wrapper, orig)
        except (AttributeError, TypeError):  # some builtins lack __name__/__doc__ in odd builds
            pass
        wrapper._apex_amp_init_original = orig
        return wrapper

    # ---------------------------------------------------------------- install / restore

    def install(self) -> None:
        import torch.nn.functional as F
        import torch.nn.modules.rnn as rnn_mod

        namespaces = {"torch": torch, "torch.nn.functional": F, "torch.Tensor": torch.Tensor,
                      "torch._VF": torch._VF}
        for ns_name, table in lists.policy_table():
            ns = namespaces[ns_name]
            for name, policy in table.items():
                if not hasattr(ns, name):
                    continue
                self._set(ns, name, self.wrap(getattr(ns, name), name, policy))
        # torch's RNN modules refuse an input whose dtype differs from their weights unless autocast is on;
        # under amp the backend call casts both, so only the shape part of that check must still run.
        self._set(rnn_mod.RNNBase, "check_input", _shape_only_check_input(rnn_mod.RNNBase.check_input, self))

    def _set(self, ns: Any, name: str, wrapper: Callable) -> None:
        namespace_dict = ns.__dict__ if isinstance(ns, type) else vars(ns)
        had_own = name in namespace_dict
        previous = namespace_dict.get(name)
        setattr(ns, name, wrapper)
        self._installed.append((ns, name, had_own, previous, wrapper))

    def restore(self) -> List[str]:
        """Put every original back, newest first; returns the names that other code had replaced meanwhile."""
        replaced = []
        for ns, name, had_own, previous, wrapper in reversed(self._installed):
            namespace_dict = ns.__dict__ if isinstance(ns, type) else vars(ns)
            if namespace_dict.get(name) is not wrapper:
                replaced.append(f"{getattr(ns, '__name__', ns)}.{name}")
                continue
            if had_own:
                setattr(ns, name, previous)
            else:
                delattr(ns, name)
        self._installed.clear()
        return replaced

    def __len__(self) -> int:
        return len(self._installed)


def _shape_only_check_input(orig: Callable, casts: GlobalCasts) -> Callable:
    def check_input(self, input, batch_sizes):
        weights = getattr(self, "_flat_weights", None)
        if (casts.enabled and not casts_disabled() and weights and isinstance(input, torch.Tensor)
                and input.dtype != weights[0].dtype):
            input = torch.empty(input.shape, dtype=weights[0].dtype, device="meta")
        return orig(self, input, batch_sizes)

    check_input._apex_amp_init_original = orig
    return check_input
