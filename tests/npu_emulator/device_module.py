"""``torch.npu`` for the emulated device: the device-module API torch and apex ask a PrivateUse1 backend for.

Registered by ``npu_emulator.load()`` with ``torch._register_device_module("npu", ...)``. Random numbers on the
emulated device come from torch's CPU generator (the operators run CPU kernels), so ``torch.manual_seed`` seeds
them and the per-device seeding functions here have nothing more to do.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = [
    "current_device",
    "device",
    "device_count",
    "get_amp_supported_dtype",
    "get_autocast_dtype",
    "is_autocast_enabled",
    "is_available",
    "is_bf16_supported",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "memory_allocated",
    "memory_stats",
    "reset_peak_memory_stats",
    "set_device",
    "synchronize",
]


def _ops():
    return torch.ops.npu_emu


def _index(device: Any = None) -> int:
    """Device index from None (current), an int, "npu:1" or torch.device; a clear error for anything else."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        index = device
    else:
        dev = torch.device(device) if isinstance(device, str) else device
        if not isinstance(dev, torch.device) or dev.type != "npu":
            raise ValueError(f"expected an npu device (int, 'npu:N' or torch.device), got {device!r}")
        index = current_device() if dev.index is None else dev.index
    if not 0 <= index < device_count():
        raise ValueError(f"npu device index must be in [0, {device_count()}), got {index}")
    return index


def is_available() -> bool:
    return True


def device_count() -> int:
    return int(_ops().device_count())


def current_device() -> int:
    return int(_ops().current_device())


def set_device(device: Any) -> None:
    _ops().set_device(_index(device))


@contextlib.contextmanager
def device(device: Any):
    """Context manager: make ``device`` current inside the block."""
    previous = current_device()
    set_device(device)
    try:
        yield
    finally:
        set_device(previous)


def synchronize(device: Any = None) -> None:
    """Every emulated operator completes before it returns: nothing to wait for (the index is still checked)."""
    _index(device)


def _is_in_bad_fork() -> bool:
    return False


def manual_seed(seed: int) -> None:
    int(seed)  # the CPU generator, seeded by torch.manual_seed, drives the emulated device


def manual_seed_all(seed: int) -> None:
    int(seed)


def get_amp_supported_dtype() -> list:
    return [torch.float16, torch.bfloat16]


def is_bf16_supported() -> bool:
    return True


def is_autocast_enabled() -> bool:
    return torch.is_autocast_enabled("npu")


def get_autocast_dtype() -> torch.dtype:
    return torch.get_autocast_dtype("npu")


def memory_stats(device: Any = None) -> dict:
    """Bytes held by live npu tensors of ``device``, their peak, and the number of allocations so far."""
    allocated, peak, count = _ops().memory_stats(_index(device))
    return {"allocated_bytes.all.current": allocated, "allocated_bytes.all.peak": peak,
            "allocation.all.allocated": count}


def memory_allocated(device: Any = None) -> int:
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device: Any = None) -> int:
    return memory_stats(device)["allocated_bytes.all.peak"]


def reset_peak_memory_stats(device: Any = None) -> None:
    _ops().reset_peak_memory(_index(device))
