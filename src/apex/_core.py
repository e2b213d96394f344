"""Bridge between torch tensors and the torch-free C++ core (`apex_C`).

`apex_C`'s public functions take arrays and tensors and check them themselves.
This bridge uses its private raw fast path instead (``apex_C._raw_*``: address,
element count, dtype code), which skips the per-call DLPack export: it is the
one place that turns tensors into such triples, so the checks that keep that
safe (CPU, contiguous, supported dtype, equal sizes, alive for the call) live
here once. The raw functions still reject what they can see (counts, null or
misaligned addresses, wrapping ranges, partial overlap).

When the extension is missing or cannot be loaded, every function falls back to
torch ops and a single warning says so. ``APEX_REQUIRE_EXT=1`` turns that into
an ImportError, so a broken build can never pass on the fallback.
"""

from __future__ import annotations

import array
import itertools
import math
import operator
import os
import threading
import warnings
from typing import List, Optional, Sequence, Tuple

import torch

from ._tensor_utils import data_ptr, get_dtype, get_is_cpu, is_contiguous, is_neg, numel

__all__ = [
    "DTYPE_CODES",
    "axpy_",
    "copy_",
    "ext",
    "ext_available",
    "ext_error",
    "fill_",
    "has_nonfinite",
    "kernel_dtype",
    "kernel_many",
    "max_abs",
    "num_threads",
    "scale_",
    "scale_many_",
    "simd_level",
    "sum_sq",
    "uses_kernel",
]

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _load():
    try:
        import apex_C

        return apex_C, None
    except ImportError as exc:  # missing or unloadable .so
        if "SIMD level" in str(exc):  # APEX_SIMD names a level this CPU lacks: a user error, not a fallback
            raise
        return None, exc


ext, ext_error = _load()
_warned = False


def _require_or_warn() -> None:
    global _warned
    if ext is not None or _warned:
        return
    _warned = True
    msg = (
        f"apex: the C++ core (apex_C) could not be loaded ({ext_error}); "
        "falling back to torch ops, which are correct but slower on CPU"
    )
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


if ext is None and os.environ.get("APEX_REQUIRE_EXT") == "1":
    raise ImportError(f"APEX_REQUIRE_EXT=1 but the apex_C extension cannot be loaded: {ext_error}") from ext_error


def ext_available() -> bool:
    _require_or_warn()
    return ext is not None


def simd_level() -> Optional[str]:
    return ext.simd_level() if ext is not None else None


def num_threads() -> int:
    """Threads for a kernel call: torch's intra-op setting (what users already tune)."""
    return torch.get_num_threads()


def kernel_dtype(dtype: torch.dtype) -> Optional[int]:
    return DTYPE_CODES.get(dtype)


def uses_kernel(*tensors: torch.Tensor) -> bool:
    """True when every tensor can go through apex_C (CPU, contiguous, fp32/fp16/bf16, no lazy negation: the
    memory of ``x.conj().imag`` holds the negated values, which only torch's ops read right)."""
    if ext is None:
        _require_or_warn()
        return False
    for t in tensors:
        if (not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype not in DTYPE_CODES
                or not t.is_contiguous() or t.is_neg()):
            return False
    return True


def _flat_check(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPE_CODES:
        raise TypeError(f"{name}: expected float32, float16 or bfloat16, got {t.dtype}")


def _pair_check(op: str, src: torch.Tensor, dst: torch.Tensor, dst_name: str) -> None:
    """Both buffers usable, and of one size (checked before either is touched)."""
    _flat_check(src, f"{op} src")
    _flat_check(dst, f"{op} {dst_name}")
    if dst.numel() != src.numel():
        raise ValueError(f"{op}: {dst_name} has {dst.numel()} elements, src has {src.numel()}")


def _buf(t: torch.Tensor) -> Tuple[int, int]:
    """The (address, dtype code) apex_C reads a buffer by; only for tensors `uses_kernel` accepted."""
    return t.data_ptr(), DTYPE_CODES[t.dtype]


def _torch_nonfinite(src: torch.Tensor) -> bool:
    return bool(src.numel()) and not bool(torch.isfinite(src).all())


class _UnscaleScratch(threading.local):
    """Per thread and device, the two one-element tensors torch's fused unscale op takes: the found flag, kept
    only while it reads 0 (a set flag is dropped rather than zeroed, so no write of ours can race a later use on
    another stream), and the factor of the last scale. Allocating and filling both anew cost two allocations
    and two small fills per call, about 5% of an unscale of a 100M-element buffer on an H200 (0.309 -> 0.293 ms)."""

    def __init__(self):
        self.found = {}
        self.factor = {}


_UNSCALE_SCRATCH = _UnscaleScratch()


def _same_float(a: float, b: float) -> bool:
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)  # -0.0 and 0.0 scale differently


def torch_fused_unscale_(tensors: Sequence[torch.Tensor], scale: float) -> Optional[bool]:
    """``t *= scale`` for every tensor (all on one device) and whether any held an inf/nan before, in one pass
    and one host read of the flag: torch's fused unscale op (on CUDA, one kernel where a check then a multiply
    read each tensor three times). None, with the tensors unchanged, where the backend lacks the op."""
    device = tensors[0].device
    scratch = _UNSCALE_SCRATCH
    found = scratch.found.pop(device, None)
    if found is None:
        found = torch.zeros(1, dtype=torch.float32, device=device)
    cached = scratch.factor.get(device)
    if cached is not None and _same_float(cached[0], scale):
        factor = cached[1]
    else:
        factor = torch.full((1,), scale, dtype=torch.float32, device=device)
        scratch.factor[device] = (scale, factor)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(list(tensors), found, factor)
    except (NotImplementedError, RuntimeError):
        return None
    bad = bool(found.item())
    if not bad:
        scratch.found[device] = found
    return bad


def scale_(src: torch.Tensor, scale: float, out: Optional[torch.Tensor] = None, check: bool = True) -> bool:
    """``out = src * scale`` (``out`` defaults to ``src``); True if any src value is inf/nan."""
    dst = src if out is None else out
    _pair_check("scale_", src, dst, "out")
    if uses_kernel(src, dst):
        return ext._raw_scale_(*_buf(src), *_buf(dst), src.numel(), float(scale), check, num_threads())
    if check and dst is src and src.device.type != "cpu":
        bad = torch_fused_unscale_([src], float(scale))
        if bad is not None:
            return bad
    bad = bool(check) and _torch_nonfinite(src)  # before an in-place scale changes src
    if dst is src:
        src.mul_(scale)
    else:
        dst.copy_(src.reshape(dst.shape).float() * scale)
    return bad


def axpy_(src: torch.Tensor, dst: torch.Tensor, scale: float, check: bool = True) -> bool:
    """``dst += src * scale``; True if any src value is inf/nan."""
    _pair_check("axpy_", src, dst, "dst")
    if uses_kernel(src, dst):
        return ext._raw_axpy_(*_buf(src), *_buf(dst), src.numel(), float(scale), check, num_threads())
    bad = bool(check) and _torch_nonfinite(src)
    dst.add_(src.reshape(dst.shape).to(dst.dtype), alpha=scale)
    return bad


def copy_(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Dtype-converting copy of equal-sized buffers (round to nearest even)."""
    _pair_check("copy_", src, dst, "dst")
    if uses_kernel(src, dst):
        ext._raw_copy_(*_buf(src), *_buf(dst), src.numel(), num_threads())
    else:
        dst.copy_(src.reshape(dst.shape))


def fill_(dst: torch.Tensor, value: float = 0.0) -> None:
    _flat_check(dst, "fill_ dst")
    if uses_kernel(dst):
        ext._raw_fill_(*_buf(dst), dst.numel(), float(value), num_threads())
    else:
        dst.fill_(value)


def has_nonfinite(src: torch.Tensor) -> bool:
    _flat_check(src, "has_nonfinite src")
    if uses_kernel(src):
        return ext._raw_has_nonfinite(*_buf(src), src.numel(), num_threads())
    return _torch_nonfinite(src)


def sum_sq(src: torch.Tensor) -> float:
    """Sum of squares, accumulated in float64."""
    _flat_check(src, "sum_sq src")
    if uses_kernel(src):
        return ext._raw_sum_sq(*_buf(src), src.numel(), num_threads())
    return float(src.double().pow(2).sum()) if src.numel() else 0.0


def max_abs(src: torch.Tensor) -> float:
    """max |x| (nan if any element is nan; 0 for an empty buffer)."""
    _flat_check(src, "max_abs src")
    if uses_kernel(src):
        return ext._raw_max_abs(*_buf(src), src.numel(), num_threads())
    if not src.numel():
        return 0.0
    if torch.isnan(src).any():
        return float("nan")
    return float(src.abs().max())


_ARRAY_CODES = {torch.int64: "q", torch.uint8: "B"}


def int_table(values: Sequence[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A writable int64 (or uint8) CPU tensor of per-tensor `values` (addresses, counts, flags), built through
    an array: 0.14 ms for 5000 addresses, where ``torch.tensor(list)`` converts element by element (0.30 ms
    warm, about 1 ms right after a kernel pass has evicted the caches)."""
    code = _ARRAY_CODES[dtype]
    if not len(values):
        return torch.zeros(0, dtype=dtype)
    return torch.frombuffer(array.array(code, values), dtype=dtype)


def kernel_many(tensors: Sequence[torch.Tensor]) -> bool:
    """True when `scale_many_` runs as one apex_C call: contiguous CPU tensors of one kernel dtype, none with
    torch's lazy negation bit (see `uses_kernel`). Without apex_C, the first call with tensors warns once, as
    `uses_kernel` does: the callers then take torch's ops."""
    if not tensors or not all(map(isinstance, tensors, itertools.repeat(torch.Tensor))):
        return False
    if ext is None:
        _require_or_warn()
        return False
    dtype = tensors[0].dtype
    return (
        dtype in DTYPE_CODES
        and all(map(operator.is_, map(get_dtype, tensors), itertools.repeat(dtype)))
        and all(map(get_is_cpu, tensors))  # (no torch.device object per tensor, as .device.type makes)
        and all(map(is_contiguous, tensors))
        and not any(map(is_neg, tensors))
    )


def scale_many_(tensors: Sequence[torch.Tensor], scale: float, check: bool = True) -> bool:
    """``t *= scale`` in place for every tensor (disjoint memory); True if any value was inf/nan.

    One apex_C call over an address table when `kernel_many` holds (grads left where autograd
    put them: no flat buffer, no copy); ``scale == 1`` only checks. Otherwise one `scale_` per
    tensor (torch ops where apex_C does not apply).
    """
    ts = list(tensors)
    if not ts:
        return False
    if kernel_many(ts):
        return _scale_gather_unchecked(ts, scale, check)
    for i, t in enumerate(ts):  # the whole list before any write: a bad tensor must not leave earlier ones scaled
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.device.type == "meta":
            what = type(t).__name__ if not isinstance(t, torch.Tensor) else f"{t.dtype} on {t.device}"
            raise TypeError(f"scale_many_: tensor {i} must be a floating-point tensor holding values, got {what}")
    found = False
    for t in ts:
        if check or scale != 1.0:
            found |= scale_(t, scale, check=check)
    return bool(found)


def _scale_gather_unchecked(tensors: List[torch.Tensor], scale: float, check: bool = True) -> bool:
    """`scale_many_`'s one apex_C call. Unchecked: the caller has established that the list is non-empty and
    that `kernel_many` holds for it (CPU, one kernel dtype, contiguous, no negation bit); the kernel reads and
    writes numel() elements of the first tensor's dtype at each data_ptr(), whatever the tensors are."""
    addr = int_table(list(map(data_ptr, tensors)))
    sizes = int_table(list(map(numel, tensors)))
    return ext._raw_scale_gather_(addr.data_ptr(), sizes.data_ptr(), len(tensors), DTYPE_CODES[tensors[0].dtype],
                                  float(scale), bool(check), num_threads())
