"""``multi_tensor_applier``: NVIDIA Apex's entry point for the ``amp_C`` multi-tensor ops.

``multi_tensor_applier(op, noop_flag, tensor_lists, *args)`` calls
``op(chunk_size, noop_flag, tensor_lists, *args)`` with the applier's ``chunk_size`` (upstream's
default 2048 * 32 elements). ``op`` is one of :mod:`apex.multi_tensor_apply.amp_C`'s ops, which
run on CPU, CUDA and NPU, or any callable with that signature (NVIDIA's compiled ``amp_C`` ops
work too where that extension is installed).

``import amp_C``: this distribution ships no top-level ``amp_C`` module, so it never hides or
replaces NVIDIA's compiled extension; a last-resort finder, installed at interpreter start-up by the
wheel's ``apex-amp_C.pth`` (and by ``import apex``), makes ``import amp_C`` yield these ops wherever
NVIDIA's is not installed, whatever was imported before (see ``_apex_amp_c``).
:func:`register_amp_C` binds ours explicitly, e.g. over a broken or CUDA-only one.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType
from typing import Any, Callable

from apex._checks import check_int
from apex.multi_tensor_apply import amp_C

__all__ = ["MultiTensorApply", "multi_tensor_applier", "register_amp_C"]


class MultiTensorApply:
    """Calls multi-tensor ops with a fixed ``chunk_size``.

    ``available`` is always True here (upstream sets it False when its CUDA extension failed to
    import); ``check_avail()`` is kept for code that calls it.
    """

    available = True
    warned = False

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = check_int(chunk_size, "MultiTensorApply: chunk_size", 1)

    def check_avail(self) -> None:
        """Nothing to check: the ops need no compiled extension."""

    def __call__(self, op: Callable[..., Any], noop_flag_buffer, tensor_lists, *args: Any) -> Any:
        if not callable(op):
            raise TypeError(f"multi_tensor_applier: op must be callable (an amp_C op), got {type(op).__name__}")
        self.check_avail()
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)

    def __repr__(self) -> str:
        return f"MultiTensorApply(chunk_size={self.chunk_size})"


multi_tensor_applier = MultiTensorApply(2048 * 32)


def register_amp_C(force: bool = False) -> ModuleType:
    """Make ``import amp_C`` resolve; returns the ``amp_C`` module now in use.

    Without ``force``: the ``amp_C`` that ``import amp_C`` finds (NVIDIA's compiled extension where
    installed, else apex's ops through the fallback finder) is returned as it is; one that is
    installed but fails to import is replaced by ours, with a RuntimeWarning. With ``force=True``
    ours replaces any ``amp_C`` in ``sys.modules`` (NVIDIA's CUDA-only ops cannot take CPU or NPU
    tensors).
    """
    if not force:
        current = sys.modules.get("amp_C")
        if current is not None:
            return current
        try:
            return importlib.import_module("amp_C")
        except (ImportError, OSError) as err:  # e.g. a CUDA build whose libraries are missing here
            warnings.warn(f"register_amp_C: the installed amp_C does not import ({err}); binding apex's "
                          "amp_C-compatible ops instead", RuntimeWarning, stacklevel=2)
    sys.modules["amp_C"] = amp_C
    return amp_C
