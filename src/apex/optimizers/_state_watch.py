"""Noticing when user code rebinds a combined optimizer's state entries.

A combined optimizer's ``state[p]["exp_avg"]`` (and the other per-param entries) are views into flat buffers the
kernels update; the update never reads the dicts. torch's optimizers read ``state[p][k]`` at every step, so code
that rebinds an entry (``state[p]["exp_avg"] = torch.zeros_like(p)`` to reset a moment, ``state[p]["step"] = t``,
``del state[p][k]``, ``state[p] = {}``) changes what torch's next step computes. To do the same, the optimizer's
``state`` and its per-param dicts are dict subclasses that set one shared flag on any write; the next step sees
the flag (O(1), not a walk over the params) and re-combines, which validates the entries and copies them into
new flat buffers. The optimizer's own writes (binding views) go through ``dict.__setitem__`` and set nothing.
The optimizer's ``state`` is watched from its construction, load and unpickling on, so a per-param dict user
code takes before a step is the one the step binds into (as torch fills the dict it handed out).

Copies and pickles of these dicts are plain dicts (``__reduce_ex__``): a ``state_dict()``, a ``copy.copy`` by
checkpoint code or a pickled optimizer never carries these classes, so files still load with
``torch.load(weights_only=True)``, and a copy never flags the original.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Optional


class StateWatch:
    """The flag one optimizer's state dicts share: set by any write through them."""

    __slots__ = ("dirty",)

    def __init__(self) -> None:
        self.dirty = False


def _touch(d: Any) -> None:
    watch = getattr(d, "_watch", None)  # unset while pickle refills a dict before its slots
    if watch is not None:
        watch.dirty = True


class _WatchedWrites:
    """The writes both watched mappings notice the same way: removals, ``|=`` (through ``update``); each
    class says how it stores and updates."""

    __slots__ = ()

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        _touch(self)

    def __ior__(self, other):
        self.update(other)
        return self

    def pop(self, *args):
        out = super().pop(*args)
        _touch(self)
        return out

    def popitem(self):
        out = super().popitem()
        _touch(self)
        return out

    def clear(self) -> None:
        super().clear()
        _touch(self)


class WatchedState(_WatchedWrites, dict):
    """One param's state dict; every write sets its `StateWatch`."""

    __slots__ = ("_watch",)

    def __init__(self, items: Any = (), watch: Optional[StateWatch] = None) -> None:
        dict.__init__(self, items)
        self._watch = watch

    def __setitem__(self, key, value) -> None:
        dict.__setitem__(self, key, value)
        _touch(self)

    def update(self, *args, **kwargs) -> None:
        dict.update(self, *args, **kwargs)
        _touch(self)

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return dict.__getitem__(self, key)

    def __reduce_ex__(self, protocol):
        return dict, (dict(self),)


def _plain_states(items: Iterable) -> defaultdict:
    return defaultdict(dict, ((k, dict(v) if isinstance(v, dict) else v) for k, v in items))


class WatchedStates(_WatchedWrites, defaultdict):
    """An optimizer's ``state`` (param -> `WatchedState`); replacing or removing a param's dict sets the watch,
    reading a missing one makes an empty watched dict (torch's ``defaultdict(dict)`` behaviour) and does not."""

    __slots__ = ("_watch",)

    def __init__(self, watch: StateWatch, items: Any = ()) -> None:
        defaultdict.__init__(self, None)
        self._watch = watch
        for k, v in dict(items).items():
            dict.__setitem__(self, k, WatchedState(v, watch) if isinstance(v, dict) else v)

    def __missing__(self, key):
        value = WatchedState((), self._watch)
        dict.__setitem__(self, key, value)
        return value

    def __setitem__(self, key, value) -> None:
        dict.__setitem__(self, key, WatchedState(value, self._watch) if isinstance(value, dict) else value)
        _touch(self)

    def update(self, *args, **kwargs) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = {} if default is None else default
        return dict.__getitem__(self, key)

    def copy(self) -> defaultdict:
        return _plain_states(self.items())

    def __reduce_ex__(self, protocol):
        return _plain_states, (list(self.items()),)

    def __repr__(self) -> str:
        return repr(_plain_states(self.items()))


def bind(state: dict, key: str, value: Any) -> None:
    """The optimizer's own write of a state entry: sets no watch."""
    dict.__setitem__(state, key, value)
