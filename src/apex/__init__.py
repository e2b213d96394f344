"""apex: mixed-precision training for PyTorch on Ascend NPU, CUDA and CPU.

Subpackages load on first use (``apex.amp``, ``apex.optimizers``, ``apex.parallel``,
``apex.contrib``, the Ascend patch's ``apex.dump``, and NVIDIA Apex's ``apex.fp16_utils``,
``apex.normalization``, ``apex.mlp``, ``apex.fused_dense``, ``apex.multi_tensor_apply`` and
``apex.transformer``'s functional part), so ``import apex`` stays
cheap. Where NVIDIA's compiled ``amp_C`` is not installed, ``import amp_C`` yields apex's multi-tensor ops:
the wheel's ``apex-amp_C.pth`` installs that fallback finder (``_apex_amp_c``) at interpreter start-up,
and ``import apex`` installs it where ``.pth`` files did not run (``python -S``, a source tree on
``PYTHONPATH``).
"""

import importlib as _importlib

import _apex_amp_c

_apex_amp_c.install()

__version__ = "0.1.0"

_SUBMODULES = ("amp", "optimizers", "parallel", "contrib", "fp16_utils", "normalization", "multi_tensor_apply", "mlp",
               "fused_dense", "transformer", "dump")


def __getattr__(name):
    if name in _SUBMODULES:
        try:
            return _importlib.import_module(f"apex.{name}")
        except ImportError as err:
            raise ImportError(f"apex.{name} is part of this apex but failed to import: {err}") from err
    raise AttributeError(f"module 'apex' has no attribute {name!r}")


def __dir__():
    # a submodule already imported is in globals() too: each name once
    return sorted(set(globals()) | set(_SUBMODULES))
