"""apex: mixed-precision training for PyTorch on Ascend NPU, CUDA and CPU.

Subpackages load on first use (``apex.amp``, ``apex.optimizers``,
``apex.parallel``, ``apex.contrib``), so ``import apex`` stays cheap.
"""

import importlib

__version__ = "0.1.0"

_SUBMODULES = ("amp", "optimizers", "parallel", "contrib", "fp16_utils", "normalization")


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"apex.{name}")
    raise AttributeError(f"module 'apex' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_SUBMODULES))
