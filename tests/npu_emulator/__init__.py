"""An emulated ``npu`` device for tests: PyTorch's PrivateUse1 backend, renamed to "npu", over host memory.

``load()`` builds (or finds cached, see ``build.py``) the C++ backend, loads it, renames PrivateUse1 to ``npu``,
registers ``torch.npu`` (``device_module``) and the ``.npu()`` / ``is_npu`` methods. After it::

    x = torch.randn(3, device="npu")          # an npu tensor; its bytes live in host memory
    with torch.autocast("npu", dtype=torch.float16): ...

Every operator without its own kernel runs the CPU kernel on the same memory (a boxed fallback), so results
equal CPU results bit for bit. What this proves and what it cannot: docs/npu-emulator.md.

``site/torch_npu`` is a stand-in for the parts of ``torch_npu`` apex uses, backed by this emulator. Putting
``site_dir()`` on PYTHONPATH makes ``import torch_npu`` load the emulator, in this process or in child
processes (torchrun workers, example scripts), the way the real package loads its backend.

Only for tests: nothing here is shipped in the wheel (the wheel packages ``src/`` only).
"""

from __future__ import annotations

import threading
from pathlib import Path

__all__ = [
    "clear_overflow_flag",
    "fallback_calls",
    "get_overflow_flag",
    "load",
    "loaded",
    "saturation_mode",
    "set_overflow_check",
    "set_saturation_mode",
    "site_dir",
]

_lock = threading.Lock()
_loaded = False


def site_dir() -> Path:
    """The folder to put on PYTHONPATH so that ``import torch_npu`` finds the stand-in."""
    return Path(__file__).resolve().parent / "site"


def loaded() -> bool:
    return _loaded


def load() -> None:
    """Build if needed, load and register the emulated npu backend (idempotent, thread-safe)."""
    global _loaded
    with _lock:
        if _loaded:
            return
        import torch

        from . import build, device_module

        name = torch._C._get_privateuse1_backend_name()
        if name not in ("privateuseone", "npu"):
            raise RuntimeError(f"npu emulator: PrivateUse1 is already taken by the {name!r} backend")
        torch.ops.load_library(str(build.build()))
        if name != "npu":
            torch.utils.rename_privateuse1_backend("npu")
        if not hasattr(torch, "npu"):
            torch._register_device_module("npu", device_module)
        if not hasattr(torch.Tensor, "is_npu"):
            torch.utils.generate_methods_for_privateuse1_backend(
                for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
            )
        _loaded = True


def _ops():
    import torch

    load()
    return torch.ops.npu_emu


def get_overflow_flag() -> bool:
    """Whether some operator produced inf/nan in a floating result since the last clear."""
    return bool(_ops().get_overflow_flag())


def clear_overflow_flag() -> None:
    _ops().clear_overflow_flag()


def set_saturation_mode(on: bool) -> None:
    """Saturation mode (older Ascend chips): non-finite results are clamped to the finite range (nan -> 0),
    and only the overflow flag shows that they happened. Off (INF_NAN mode, the default): values stay as computed."""
    _ops().set_saturation_mode(bool(on))


def saturation_mode() -> bool:
    return bool(_ops().saturation_mode())


def set_overflow_check(on: bool) -> None:
    """Turn the per-operator inf/nan scan (which feeds the overflow flag) on or off; on by default."""
    _ops().set_overflow_check(bool(on))


def fallback_calls() -> int:
    """How many operator calls went through the CPU fallback so far (a measure of the emulated work)."""
    return int(_ops().fallback_calls())
