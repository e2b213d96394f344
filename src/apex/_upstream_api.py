"""The helpers NVIDIA Apex's top-level package defines, for code that imports them from ``apex``:
``check_cudnn_version_and_warn``, ``DeprecatedFeatureWarning`` and ``deprecated_warning``. Loaded on first use
(``import apex`` does not import torch)."""

from __future__ import annotations

import warnings

import torch

__all__ = ["DeprecatedFeatureWarning", "check_cudnn_version_and_warn", "deprecated_warning"]


def check_cudnn_version_and_warn(global_option: str, required_cudnn_version: int) -> bool:
    """True when torch's cuDNN is available at version ``required_cudnn_version`` or later (cuDNN's integer form,
    8400 for 8.4.0); otherwise a UserWarning naming ``global_option`` (the feature that needs it) and False.
    Every feature of this package runs without cuDNN: the answer concerns code of its own that needs it."""
    if not isinstance(global_option, str):
        raise TypeError(f"check_cudnn_version_and_warn: global_option must be a str, got "
                        f"{type(global_option).__name__}")
    if isinstance(required_cudnn_version, bool) or not isinstance(required_cudnn_version, int):
        raise TypeError(f"check_cudnn_version_and_warn: required_cudnn_version must be an int, got "
                        f"{type(required_cudnn_version).__name__}")
    available = torch.backends.cudnn.is_available()
    version = torch.backends.cudnn.version() if available else None
    if available and version is not None and version >= required_cudnn_version:
        return True
    found = "cuDNN is not available" if not available else f"found cuDNN {version}"
    warnings.warn(f"`{global_option}` depends on cuDNN {required_cudnn_version} or later, but {found}",
                  stacklevel=2)
    return False


class DeprecatedFeatureWarning(FutureWarning):
    """Warns of a feature that a later release removes."""


def deprecated_warning(msg: str) -> None:
    """Warns ``msg`` as a DeprecatedFeatureWarning once per job: on rank 0 of an initialised process group, or in
    a process without one."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(msg, DeprecatedFeatureWarning, stacklevel=2)
