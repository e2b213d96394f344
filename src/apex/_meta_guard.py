"""One C++ call that tells whether many tensors have the metadata of tensors validated before.

A step after ``zero_grad(set_to_none=True)`` (torch's default) reads autograd's fresh grads in place, so it must
validate every one of them at every step: dtype, device, shape, element layout and the lazy negation bit. From
Python that is one attribute read per property per grad, 0.15-0.3 us each inside torch's getters (5000 grads:
about 5 ms per step, more than the update itself). torch's own guard for compiled graphs,
``torch._C._dynamo.guards.TensorGuards``, compares the Python type, dispatch keys (which carry the layout and the
negation and conjugation bits), dtype, device, ``requires_grad``, sizes and strides of many tensors against those
of example tensors in one call, about 0.18 us per tensor. The grads of a step that passed the full validation are
the examples; grads that match them in all of these properties pass the same validation, so it can be skipped.

The guard is a private torch API. It is used only after `_works` has shown, on this torch, that it accepts a
tensor like its example and rejects each difference the validation looks for; otherwise, and on any error it
raises later, callers run the full validation. A guard only matches under the thread-local dispatch key sets it
was built under (`MetaGuard.__init__`). It keeps no reference to its example tensors (checked by
`_works` too), so fresh grads are not kept alive by it. `LastValidated` keeps a caller's guard between calls and
decides when to build a new one.
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch

try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except Exception:  # absent or renamed in this torch: the full validation always runs
    _TensorGuards = None


def _dispatch_tls():
    """The thread's local include and exclude dispatch key sets."""
    return torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()


class MetaGuard:
    """The metadata of one list of tensors, to compare later lists with (`matches`)."""

    __slots__ = ("_check", "_tls", "hits")

    def __init__(self, check, tls) -> None:
        self._check = check
        # The guard compares dispatch keys with the thread's local sets of the moment applied, on both sides: under
        # sets that exclude a key (the negation bit's, say) tensors that differ only in it would compare equal.
        # Compared under the sets it was built under only.
        self._tls = tls
        self.hits = 0  # how many lists matched since it was made

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether `tensors` (as many as the examples) have the examples' metadata, one by one."""
        try:
            ok = _dispatch_tls() == self._tls and bool(self._check(*tensors))
        except Exception:  # a different length, or a torch whose guard changed its contract: not a match
            return False
        self.hits += ok
        return ok


def _build(tensors: Sequence[torch.Tensor]):
    # no dynamic dims (None, not a list): every size and stride is compared exactly
    return _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None).check


def _works() -> bool:
    """Whether the guard behaves as `MetaGuard` relies on, on this torch."""
    if _TensorGuards is None:
        return False
    try:
        _dispatch_tls()
        base = torch.zeros(2, 3)
        ref = weakref.ref(base)
        check = _build([base])
        del base
        if ref() is not None:  # it would keep a step's fresh grads alive
            return False
        like = torch.ones(2, 3)
        unlike = [
            torch.zeros(2, 3, dtype=torch.float64),
            torch.zeros(3, 2),
            torch.zeros(6),
            torch.zeros(3, 2).t(),  # same shape, other strides
            torch.zeros(2, 3)._neg_view(),
            torch.zeros(2, 3, requires_grad=True),
            torch.nn.Parameter(torch.zeros(2, 3)),
            torch.zeros(2, 3, device="meta"),
            torch.zeros(2, 3).to_sparse(),
        ]
        return check(like) is True and not any(check(t) for t in unlike)
    except Exception:
        return False


_USABLE: Optional[bool] = None


def guard(tensors: Sequence[torch.Tensor]) -> Optional[MetaGuard]:
    """A guard of the metadata of `tensors` (validated by the caller), or None where this torch has no usable one."""
    global _USABLE
    if _USABLE is None:
        _USABLE = _works()
    if not _USABLE:
        return None
    try:
        return MetaGuard(_build(tensors), _dispatch_tls())
    except Exception:
        return None


#: the most misses after which a guard that never matched is replaced (`LastValidated.record`)
PATIENCE_MAX = 64


class LastValidated:
    """The metadata of the last tensors a caller validated, for one key (what they were validated against): later
    tensors `like` them, under the same key, pass the same validation.

    Building a guard costs about as much as a validation, so where the tensors' metadata or the key change at every
    call, guards that never matched are replaced after twice as many misses each time (up to `PATIENCE_MAX`), while
    one odd call after matching ones is forgotten at the next."""

    __slots__ = ("_guard", "_key", "_misses", "_patience")

    def __init__(self) -> None:
        self._key = None
        self._guard: Optional[MetaGuard] = None
        self._misses, self._patience = 0, 1

    def like(self, key, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether `tensors` have, one by one, the metadata of the last recorded ones, recorded under `key`."""
        if self._guard is not None and self._key == key and self._guard.matches(tensors):
            return True
        self._misses += 1
        return False

    def record(self, key, tensors: Sequence[torch.Tensor]) -> None:
        """Makes `tensors` (just validated against `key`) the examples, unless the guard missed fewer times than
        its patience."""
        g = self._guard
        if g is not None:
            if not g.hits and self._misses < self._patience:
                return
            self._patience = 1 if g.hits else min(2 * self._patience, PATIENCE_MAX)
        self._guard = guard(tensors)
        self._key = key
        self._misses = 0
