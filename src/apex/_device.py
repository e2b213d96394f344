"""Device layer: the one module that knows about npu / cuda / cpu specifics.

Detection order is npu > cuda > cpu:

* ``npu`` when the ``torch_npu`` package is importable *and* reports at least
  one device;
* ``cuda`` when ``torch.cuda.is_available()``;
* ``cpu`` otherwise.

``APEX_DEVICE=cpu|cuda|npu`` overrides the detection; an unknown name raises
ValueError and a device that is not usable here raises RuntimeError, so a CI
job that asks for a device never silently runs on another one.

``torch_npu`` is imported lazily (on the first question about npu) and only
when ``importlib.util.find_spec`` finds it: ``import apex`` never imports it,
and machines without it never pay for it. A ``torch_npu`` that is installed but
cannot import (no CANN runtime) counts as "no npu"; the reason is logged once
and kept for error messages.

Everything amp and the combined-tensor code need from torch_npu goes through
the small wrappers here (overflow flag of older Ascend chips, the native combine
op for private storage formats), so tests can replace torch_npu with a test
double in ``sys.modules``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
import sys
from types import ModuleType
from typing import Any, Callable, Union

import torch

__all__ = [
    "DEVICES",
    "DeviceLike",
    "any_npu_private_format",
    "autocast_device_type",
    "bf16_supported",
    "cuda_available",
    "default_amp_dtype",
    "detect_device",
    "device_available",
    "fused_optimizer_devices",
    "import_torch_npu",
    "npu_available",
    "npu_clear_overflow_flag",
    "npu_combine_op",
    "npu_combined_valid_op",
    "npu_get_overflow_flag",
    "npu_has_private_format",
    "npu_needs_overflow_flag",
    "npu_overflow_supported",
    "npu_storage_format",
]

logger = logging.getLogger(__name__)

DEVICES = ("cpu", "cuda", "npu")

# A device type name ("cuda", "cuda:1"), a torch.device, or None for "the detected one".
DeviceLike = Union[str, torch.device, None]

# Storage formats of torch_npu (ACL format codes) whose memory layout is the
# plain strided one: NCHW, NHWC, ND, NCDHW. Every other code (NC1HWC0,
# FRACTAL_Z, FRACTAL_NZ, ...) is a private, padded layout that only torch_npu
# knows how to place in a flat buffer.
_NPU_BASE_FORMATS = frozenset({0, 1, 2, 30})

# Import hooks, module attributes so tests can replace them with test doubles.
_find_spec = importlib.util.find_spec
_import_module = importlib.import_module

# Why the last torch_npu import failed (None: never tried or succeeded).
_npu_import_error: BaseException | None = None
_npu_import_tried = False


def _reset_npu_import_cache() -> None:
    """Forget a failed torch_npu import (tests; or after the environment changed)."""
    global _npu_import_error, _npu_import_tried
    _npu_import_error = None
    _npu_import_tried = False


def import_torch_npu() -> ModuleType | None:
    """torch_npu if it is (or can be) imported, else None. Never raises.

    A module already in ``sys.modules`` is used as is (this is also how tests
    inject a test double); otherwise it is imported only if ``find_spec``
    locates it. A failed import is remembered, so it is not retried on every
    call.
    """
    global _npu_import_error, _npu_import_tried
    mod = sys.modules.get("torch_npu")
    if mod is not None:
        return mod
    if _npu_import_tried:
        return None
    _npu_import_tried = True
    try:
        if _find_spec("torch_npu") is None:
            return None
    except (ImportError, ValueError) as exc:  # broken meta path entry or a half-initialised module
        _npu_import_error = exc
        return None
    try:
        return _import_module("torch_npu")
    except Exception as exc:  # no CANN runtime raises ImportError/OSError/RuntimeError
        _npu_import_error = exc
        logger.warning("apex: torch_npu is installed but cannot be imported (%s); npu is unavailable", exc)
        return None


def _npu_module(torch_npu: ModuleType) -> Any | None:
    # torch_npu registers itself as torch.npu; its own ``torch_npu.npu`` is the same API.
    return getattr(torch_npu, "npu", None) or getattr(torch, "npu", None)


def _npu_unavailable_reason() -> str | None:
    """None when an npu is usable, else why not (for error messages)."""
    torch_npu = import_torch_npu()
    if torch_npu is None:
        if _npu_import_error is not None:
            return f"torch_npu failed to import: {_npu_import_error}"
        return "torch_npu is not installed"
    npu = _npu_module(torch_npu)
    if npu is None or not hasattr(npu, "is_available"):
        return "torch_npu has no npu module with is_available()"
    try:
        if not npu.is_available():
            return "torch_npu reports no available npu (npu.is_available() is False)"
        count = npu.device_count() if hasattr(npu, "device_count") else 1
    except Exception as exc:  # driver errors surface here
        return f"torch_npu raised while querying devices: {exc}"
    if count < 1:
        return "torch_npu reports 0 npu devices"
    return None


def npu_available() -> bool:
    return _npu_unavailable_reason() is None


def cuda_available() -> bool:
    return bool(torch.cuda.is_available())


def _unavailable_reason(name: str) -> str | None:
    if name == "cpu":
        return None
    if name == "cuda":
        return None if cuda_available() else "torch.cuda.is_available() is False"
    return _npu_unavailable_reason()


def device_available(name: str) -> bool:
    """Whether device type ``name`` ("cpu", "cuda", "npu") is usable here."""
    return _unavailable_reason(_check_name(name, "device_available")) is None


def _check_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or name.strip().lower() not in DEVICES:
        raise ValueError(f"{where}: expected one of {', '.join(DEVICES)}, got {name!r}")
    return name.strip().lower()


def detect_device() -> str:
    """The device type apex runs on: "npu", "cuda" or "cpu" (see module docstring)."""
    override = os.environ.get("APEX_DEVICE", "").strip()
    if override:
        name = _check_name(override, "APEX_DEVICE")
        reason = _unavailable_reason(name)
        if reason is not None:
            raise RuntimeError(f"APEX_DEVICE={override} requests {name}, which is not available here: {reason}")
        return name
    if npu_available():
        return "npu"
    if cuda_available():
        return "cuda"
    return "cpu"


def _device_type(device: DeviceLike, where: str) -> str:
    if device is None:
        return detect_device()
    if isinstance(device, torch.device):
        kind = device.type
    elif isinstance(device, str):
        kind = device.split(":", 1)[0].strip().lower()
    else:
        raise TypeError(f"{where}: expected a device name or torch.device, got {type(device).__name__}")
    return _check_name(kind, where)


def autocast_device_type(device: DeviceLike = None) -> str:
    """``device_type`` argument for ``torch.autocast`` / ``torch.amp.GradScaler``.

    Accepts "cuda:1", torch.device("npu", 0), ... (the index is dropped);
    None means the detected device.
    """
    return _device_type(device, "autocast_device_type")


_AMP_DTYPES = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def default_amp_dtype(device: DeviceLike = None) -> torch.dtype:
    """Low-precision dtype for amp: float16 on cuda/npu, bfloat16 on cpu.

    cpu gets bfloat16 because its autocast and fast kernels target bf16 and
    fp16 on CPU gains nothing. ``APEX_AMP_DTYPE`` (float16/fp16/half or
    bfloat16/bf16) overrides the choice on every device.
    """
    override = os.environ.get("APEX_AMP_DTYPE", "").strip()
    if override:
        dtype = _AMP_DTYPES.get(override.lower())
        if dtype is None:
            raise ValueError(f"APEX_AMP_DTYPE: expected one of {', '.join(_AMP_DTYPES)}, got {override!r}")
        return dtype
    kind = _device_type(device, "default_amp_dtype")
    return torch.bfloat16 if kind == "cpu" else torch.float16


def bf16_supported(device: DeviceLike = None) -> bool:
    """Whether the device type (None: the detected one) computes in bfloat16: always on cpu; on cuda and npu what
    the runtime reports (``is_bf16_supported()``: compute capability 8.0 and later, Ascend 910B and later); an npu
    runtime without that query counts as supporting it, as torch_npu's autocast does. A device type that is not
    usable here gives False; only a ``device`` that names no device raises (TypeError / ValueError)."""
    kind = _device_type(device, "bf16_supported")
    if kind == "cpu":
        return True
    if kind == "cuda":
        module = torch.cuda if cuda_available() else None
    else:
        torch_npu = import_torch_npu()
        module = _npu_module(torch_npu) if torch_npu is not None and npu_available() else None
    if module is None:
        return False
    query = getattr(module, "is_bf16_supported", None)
    if query is None:
        return True
    try:
        return bool(query())
    except Exception:  # a driver error is no bfloat16
        return False


# ---------------------------------------------------------------- fused optimizer kernels


def fused_optimizer_devices() -> frozenset:
    """Device types for which torch has fused optimizer kernels (``torch._fused_adam_``, ``_fused_sgd_``, ...).

    torch's own list where it has one (``torch.utils._foreach_utils._get_fused_kernels_supported_devices``,
    which also names the PrivateUse1 backend, e.g. "npu"); on a torch without it, cuda/xpu/mps, plus cpu from
    torch 2.4 on. Asked on every call, not cached: the PrivateUse1 backend may be renamed after import.
    """
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices as query
    except ImportError:  # older torch: no list to ask
        query = None
    if query is not None:
        return frozenset(query())
    major, minor = (int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    return frozenset({"cuda", "xpu", "mps"} | ({"cpu"} if (major, minor) >= (2, 4) else set()))


#: Device types whose torch fused optimizer kernels compute an element the same way wherever it sits in its
#: tensor, so one call over a flat buffer of several params gives, bit for bit, what one call per param gives.
#: CUDA's do (one elementwise function per element; only the loads are vectorised). CPU's do not: a tensor's
#: vector body and its scalar tail round differently (fused multiply-add against multiply then add).
FUSED_POSITION_FREE_DEVICES = frozenset({"cuda"})


#: Elements per block for the layer functions that work over a large tensor block by block in float32 (focal loss,
#: cross entropy): on the CPU a block's temporaries (1 MiB each) stay in the L2 cache across the dozen elementwise
#: passes (measured: 28 ms against 51 ms for 2^22 on a 3.5M-element focal loss); an accelerator's passes are
#: kernel launches, each with a fixed cost, so there the blocks are 16x larger.
_BLOCK_ELEMENTS = {"cpu": 1 << 18}
_DEFAULT_BLOCK_ELEMENTS = 1 << 22


def block_elements(device: torch.device) -> int:
    """How many elements one block of a blockwise layer function holds on ``device`` (see ``_BLOCK_ELEMENTS``)."""
    return _BLOCK_ELEMENTS.get(device.type, _DEFAULT_BLOCK_ELEMENTS)


def host_scalars_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (step counts) copied to ``device`` without waiting for the device's queued work.

    A blocking host-to-CUDA copy synchronizes the stream, so the host would idle until the backward pass and
    every queued kernel finish before it may enqueue the update. From pageable memory a non-blocking CUDA copy
    stages the values before it returns, so the host may change ``t`` right after. Always a copy (on the host
    too), so that no caller's result aliases ``t``."""
    return t.to(device, non_blocking=device.type == "cuda", copy=True)


# ---------------------------------------------------------------- npu overflow flag (older Ascend chips)


def _require_torch_npu(what: str) -> ModuleType:
    torch_npu = import_torch_npu()
    if torch_npu is None:
        why = f": {_npu_import_error}" if _npu_import_error is not None else " (torch_npu is not installed)"
        raise RuntimeError(f"{what} needs torch_npu, which is unavailable{why}")
    return torch_npu


def _npu_util(torch_npu: ModuleType, name: str) -> Callable[..., Any] | None:
    # The overflow helpers live in torch_npu.npu.utils and are re-exported as torch_npu.npu.<name>.
    npu = _npu_module(torch_npu)
    for owner in (getattr(npu, "utils", None), npu):
        fn = getattr(owner, name, None) if owner is not None else None
        if callable(fn):
            return fn
    return None


def npu_overflow_supported() -> bool:
    """True when the npu runs in INF_NAN mode (wraps ``is_support_inf_nan``).

    Then an overflow produces inf/nan in the values, and amp uses the ordinary
    non-finite check. False means saturation mode (older Ascend chips): overflow
    saturates silently and is only visible in the global float-status register,
    read with :func:`npu_get_overflow_flag`. A torch_npu too old to have
    ``is_support_inf_nan`` predates INF_NAN mode, so the answer is False.
    Raises RuntimeError when torch_npu is unavailable.
    """
    fn = _npu_util(_require_torch_npu("npu_overflow_supported()"), "is_support_inf_nan")
    return bool(fn()) if fn is not None else False


def npu_needs_overflow_flag(device: DeviceLike = None) -> bool:
    """Whether amp must read the overflow register instead of checking values.

    False on cpu/cuda (without touching torch_npu); on npu: not INF_NAN mode.
    """
    if _device_type(device, "npu_needs_overflow_flag") != "npu":
        return False
    return not npu_overflow_supported()


def npu_get_overflow_flag() -> bool:
    """Read the npu float-status register: True if an overflow happened since the last clear."""
    fn = _npu_util(_require_torch_npu("npu_get_overflow_flag()"), "get_npu_overflow_flag")
    if fn is None:
        raise RuntimeError("npu_get_overflow_flag(): this torch_npu has no get_npu_overflow_flag")
    flag = fn()
    if isinstance(flag, torch.Tensor):  # some versions hand back the raw status tensor
        return bool(flag.ne(0).any())
    return bool(flag)


def npu_clear_overflow_flag() -> None:
    """Reset the npu float-status register (before the backward pass whose overflow amp checks)."""
    fn = _npu_util(_require_torch_npu("npu_clear_overflow_flag()"), "clear_npu_overflow_flag")
    if fn is None:
        raise RuntimeError("npu_clear_overflow_flag(): this torch_npu has no clear_npu_overflow_flag")
    fn()


# ---------------------------------------------------------------- npu storage formats and native combine


def _loaded_torch_npu() -> ModuleType | None:
    # Tensors can only live on npu if torch_npu is already loaded: never import it just to ask.
    return sys.modules.get("torch_npu")


def npu_storage_format(tensor: torch.Tensor) -> int | None:
    """torch_npu's storage format code of an npu tensor; None for other devices and for non-tensors (callers
    validate their inputs themselves and must get their own error for those)."""
    torch_npu = _loaded_torch_npu()
    if torch_npu is None or getattr(getattr(tensor, "device", None), "type", None) != "npu":
        return None
    get_format = getattr(torch_npu, "get_npu_format", None)
    return int(get_format(tensor)) if get_format is not None else None


def npu_has_private_format(tensor: torch.Tensor) -> bool:
    """True for npu tensors stored in a private (padded, non-strided) format such as FRACTAL_NZ."""
    fmt = npu_storage_format(tensor)
    return fmt is not None and fmt not in _NPU_BASE_FORMATS


def any_npu_private_format(tensors) -> bool:
    """Whether any of ``tensors`` needs torch_npu's native combine (see :func:`npu_has_private_format`).

    Without torch_npu loaded no tensor can be on npu: answered without looking at the tensors.
    """
    if _loaded_torch_npu() is None:
        return False
    return any(npu_has_private_format(t) for t in tensors)


def _torch_npu_attr(names) -> Callable[..., Any] | None:
    torch_npu = _loaded_torch_npu() or import_torch_npu()
    if torch_npu is None:
        return None
    owners = (getattr(torch_npu, "utils", None), torch_npu, _npu_module(torch_npu))
    for name in names:
        for owner in owners:
            fn = getattr(owner, name, None) if owner is not None else None
            if callable(fn):
                return fn
    return None


def npu_combine_op() -> Callable[..., Any] | None:
    """torch_npu's native combine op (``combine(tensors, require_copy_value)``) or None.

    Current torch_npu exposes ``torch_npu.utils.npu_combine_tensors``; older
    builds and the original patch used ``combine_npu``.
    """
    return _torch_npu_attr(("npu_combine_tensors", "combine_npu"))


def npu_combined_valid_op() -> Callable[..., Any] | None:
    """torch_npu's ``is_combined_tensor_valid(combined, tensors)`` or None."""
    return _torch_npu_attr(("is_combined_tensor_valid",))
