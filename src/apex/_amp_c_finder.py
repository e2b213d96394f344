"""``import amp_C`` falls back to apex's multi-tensor ops when NVIDIA's compiled ``amp_C`` is absent.

NVIDIA's tests and Megatron-style code write ``import amp_C``. This package ships no top-level
module of that name (NVIDIA's build installs a compiled one there, and two modules of one name
would shadow each other by ``sys.path`` order). Instead ``import apex`` appends this finder to
the *end* of ``sys.meta_path``: Python asks it only after every regular finder failed to locate
``amp_C``, so an installed NVIDIA ``amp_C`` always wins, and without one ``import amp_C`` yields a
module holding the ops of :mod:`apex.multi_tensor_apply.amp_C` (the same function objects).
Importing torch is deferred to that moment: ``import apex`` stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Optional

NAME = "amp_C"
SOURCE = "apex.multi_tensor_apply.amp_C"


class _AmpCLoader(importlib.abc.Loader):
    def create_module(self, spec) -> Optional[ModuleType]:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        src = importlib.import_module(SOURCE)
        module.__doc__ = src.__doc__
        for name in src.__all__:
            setattr(module, name, getattr(src, name))
        module.__all__ = list(src.__all__)
        module.__apex_fallback__ = True  # how `python -m apex` and tests tell it from NVIDIA's


class AmpCFallbackFinder(importlib.abc.MetaPathFinder):
    """Finds ``amp_C`` only; consulted last."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME:
            return None
        return importlib.machinery.ModuleSpec(NAME, _AmpCLoader(), origin=SOURCE)


def install() -> None:
    """Append the finder to ``sys.meta_path`` once."""
    if not any(isinstance(f, AmpCFallbackFinder) for f in sys.meta_path):
        sys.meta_path.append(AmpCFallbackFinder())
