"""apex: mixed-precision training for PyTorch on Ascend NPU, CUDA and CPU.

Subpackages load on first use (``apex.amp``, ``apex.optimizers``, ``apex.parallel``,
``apex.contrib``, the Ascend patch's ``apex.dump``, and NVIDIA Apex's ``apex.fp16_utils``,
``apex.normalization``, ``apex.mlp``, ``apex.fused_dense``, ``apex.multi_tensor_apply`` and
``apex.transformer``'s functional part), as do NVIDIA's top-level helpers
(``check_cudnn_version_and_warn``, ``DeprecatedFeatureWarning``, ``deprecated_warning``), so ``import apex`` stays
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


# NVIDIA Apex's top-level helpers, which import torch: loaded on first use
_HELPERS = ("check_cudnn_version_and_warn", "DeprecatedFeatureWarning", "deprecated_warning")


def __getattr__(name):
    if name in _SUBMODULES:
        try:
            return _importlib.import_module(f"apex.{name}")
        except ImportError as err:
            raise ImportError(f"apex.{name} is part of this apex but failed to import: {err}") from err
    if name in _HELPERS:
        return getattr(_importlib.import_module("apex._upstream_api"), name)
    raise AttributeError(f"module 'apex' has no attribute {name!r}")


def __dir__():
    # a submodule already imported is in globals() too: each name once
    return sorted(set(globals()) | set(_SUBMODULES) | set(_HELPERS))
