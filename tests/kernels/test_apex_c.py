"""Torch-free tests of the apex_C kernel core (numpy + the extension, any Python 3.9+).

References are computed with numpy in float64/float32 from the documented semantics of each kernel:
arithmetic in fp32 (one rounding per operation, no fused multiply-add), stored to the destination dtype with
round-to-nearest-even. Under those rules every elementwise result is exactly determined, so elementwise checks
are bitwise (nan compared as "is nan"); reductions are compared with float64 references within a stated
relative tolerance, and bitwise across thread counts.

Every test that touches a kernel runs at every SIMD level ``apex_C.supported_simd_levels()`` reports.

The public functions take arrays (buffer protocol or DLPack) and check them; numpy has no bfloat16, so bf16 buffers
are uint16 arrays handed over through ``bf16_view``, a DLPack export relabelled as bfloat16. The private ``_raw_*``
functions (address, count, dtype code) are tested for what they still reject.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
from _apex_c_env import BF16, DTYPES, F16, F32, LEVELS, STORAGE, apex_C

pytestmark = pytest.mark.kernels

SIZES = (0, 1, 7, 4097)


# ---------------------------------------------------------------------------------------------------------------
# DLPack from the test side: the ABI structs (DLPack spec v1), to relabel or inspect what numpy exports
# ---------------------------------------------------------------------------------------------------------------
class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype, _capsule_name.argtypes = ctypes.c_char_p, [ctypes.py_object]


def dl_tensor(capsule) -> DLTensor:
    """The DLTensor inside an unconsumed capsule (legacy or versioned)."""
    name = _capsule_name(capsule)
    if name == b"dltensor_versioned":
        return DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, name)).dl_tensor
    assert name == b"dltensor", name
    return DLManagedTensor.from_address(_capsule_pointer(capsule, name)).dl_tensor


class DLOnly:
    """Exposes an array through DLPack only (no buffer protocol), as a torch tensor does.

    ``versioned=False`` plays a producer older than DLPack 1.0 (no max_version keyword); ``relabel`` rewrites the
    exported (code, bits) dtype before the capsule is handed on; the capsules handed out are kept in ``capsules``.
    """

    def __init__(self, arr: np.ndarray, versioned: bool = True, relabel=None, device=(1, 0)):
        self.arr, self.versioned, self.relabel, self.device = arr, versioned, relabel, device
        self.capsules = []

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, max_version=None, **kwargs):
        if not self.versioned and max_version is not None:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        cap = self.arr.__dlpack__(max_version=max_version) if max_version else self.arr.__dlpack__()
        if self.relabel is not None:
            t = dl_tensor(cap)
            t.dtype.code, t.dtype.bits = self.relabel
        self.capsules.append(cap)
        return cap


def bf16_view(arr: np.ndarray, versioned: bool = True) -> DLOnly:
    """A uint16 array of bfloat16 bit patterns, exported as DLPack bfloat16 (code 4, 16 bits)."""
    assert arr.dtype == np.uint16
    return DLOnly(arr, versioned, relabel=(4, 16))


def typed(arr: np.ndarray, dt: int):
    """What a public apex_C function is given for storage `arr` of dtype code `dt`."""
    return bf16_view(arr) if dt == BF16 else arr


# ---------------------------------------------------------------------------------------------------------------
# numpy references
# ---------------------------------------------------------------------------------------------------------------
def bf16_rne(x32: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest, ties to even (reference, written from the definition).

    The kept half is the upper 16 bits; it is bumped by one when the dropped half is above 0x8000, or exactly
    0x8000 with an odd kept half. A carry into the exponent is the correct result (next binade, or inf on
    overflow). nan results are only required to be nan (checked separately).
    """
    u = np.ascontiguousarray(x32, dtype=np.float32).view(np.uint32).astype(np.uint64)
    kept = u >> np.uint64(16)
    dropped = u & np.uint64(0xFFFF)
    up = (dropped > 0x8000) | ((dropped == 0x8000) & ((kept & np.uint64(1)) == 1))
    out = (kept + up.astype(np.uint64)).astype(np.uint16)
    nan = np.isnan(x32)
    out[nan] = (kept[nan].astype(np.uint16) | np.uint16(0x0040))  # some quiet nan with the same sign
    return out


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_f32(stored: np.ndarray, dt: int) -> np.ndarray:
    """What a kernel 'loads': the stored values as float32 (exact for all three dtypes)."""
    if dt == BF16:
        return bf16_to_f32(stored)
    return np.asarray(stored).astype(np.float32)


def from_f32(x32: np.ndarray, dt: int) -> np.ndarray:
    """What a kernel 'stores': float32 values rounded (RNE) to the storage dtype."""
    x32 = np.asarray(x32, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        if dt == F32:
            return x32.copy()
        if dt == F16:
            return x32.astype(np.float16)
        return bf16_rne(x32)


def f32_mul(x32: np.ndarray, s: float) -> np.ndarray:
    """fp32 product with one rounding: the float64 product of two floats is exact, then rounded once."""
    with np.errstate(over="ignore", invalid="ignore"):
        return (x32.astype(np.float64) * float(np.float32(s))).astype(np.float32)


def f32_add(a32: np.ndarray, b32: np.ndarray) -> np.ndarray:
    """fp32 sum with one rounding (double rounding through float64 is innocuous for +: 53 >= 2*24+2)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return (a32.astype(np.float64) + b32.astype(np.float64)).astype(np.float32)


def random_values(rng: np.random.Generator, n: int, dt: int) -> np.ndarray:
    """Finite values of dtype `dt` spread over many binades (rounding is exercised everywhere)."""
    spread = {F32: 6.0, F16: 2.0, BF16: 20.0}[dt]
    x = rng.standard_normal(n) * 10.0 ** rng.uniform(-spread, spread, n)
    if dt == F16:
        x = np.clip(x, -6.0e4, 6.0e4)
    return from_f32(x.astype(np.float32), dt)


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def assert_same(got: np.ndarray, want: np.ndarray, dt: int, what: str) -> None:
    """Bitwise equality of stored values; any nan matches any nan."""
    got_nan = np.isnan(to_f32(got, dt))
    want_nan = np.isnan(to_f32(want, dt))
    mism = (got_nan != want_nan) | (~got_nan & (bits(got) != bits(want)))
    if mism.any():
        idx = np.flatnonzero(mism)
        i = int(idx[0])
        raise AssertionError(
            f"{what}: {idx.size} of {got.size} elements differ; first at {i}: "
            f"got {to_f32(got, dt)[i]!r} (bits {int(bits(got)[i]):#x}), "
            f"expected {to_f32(want, dt)[i]!r} (bits {int(bits(want)[i]):#x})"
        )


class Buf:
    """A storage array with guard elements on both sides, to catch writes outside [start, start + n)."""

    GUARD = 67  # more than one 512-bit vector of fp16 plus change

    def __init__(self, values: np.ndarray, dt: int, offset: int = 0):
        self.dt = dt
        self.n = values.size
        self.start = self.GUARD + offset
        sentinel = {F32: np.float32(-7.25), F16: np.float16(-7.25), BF16: np.uint16(0xC0E8)}[dt]
        self.base = np.full(self.n + self.start + self.GUARD, sentinel, dtype=STORAGE[dt])
        self.view[...] = values
        self.guard_bits = bits(self.base).copy()

    @property
    def view(self) -> np.ndarray:
        return self.base[self.start:self.start + self.n]

    @property
    def obj(self):
        """The buffer as the public functions take it (bf16: through DLPack)."""
        return typed(self.view, self.dt)

    @property
    def addr(self) -> int:
        return self.base.ctypes.data + self.start * self.base.itemsize

    def assert_guards(self, what: str) -> None:
        now = bits(self.base)
        outside = np.ones(self.base.size, dtype=bool)
        outside[self.start:self.start + self.n] = False
        changed = np.flatnonzero(outside & (now != self.guard_bits))
        assert changed.size == 0, f"{what}: wrote outside its range at base indices {changed[:8].tolist()}"


@pytest.fixture(params=LEVELS)
def level(request):
    """Runs the test at one SIMD level, restoring the previous level afterwards."""
    previous = apex_C.simd_level()
    apex_C.set_simd_level(request.param)
    assert apex_C.simd_level() == request.param
    yield request.param
    apex_C.set_simd_level(previous)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# ---------------------------------------------------------------------------------------------------------------
# dtype conversion exactness (copy_)
# ---------------------------------------------------------------------------------------------------------------
def tricky_f32() -> np.ndarray:
    """f32 values at every fp16 / bf16 rounding decision: ties, tie +- 1 ulp, limits, specials."""
    h = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)  # all finite halves >= 0
    mids = ((h[:-1] + h[1:]) / 2).astype(np.float32)  # exact in f32: 12 significant bits
    up = np.nextafter(mids, np.float32(np.inf))
    down = np.nextafter(mids, np.float32(0))
    kept = np.arange(0, 0x7F80, 7, dtype=np.uint32) << np.uint32(16)
    bf_ties = np.concatenate([kept | np.uint32(0x8000), kept | np.uint32(0x7FFF), kept | np.uint32(0x8001)])
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65519.99, 65520.0, 65536.0, -65520.0, 1e-8, 2.0 ** -24,
         2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -14, 2.0 ** -14 * (1 - 2.0 ** -12), np.finfo(np.float32).max,
         np.finfo(np.float32).tiny, 1e-45],
        dtype=np.float32,
    )
    more = np.array([0x7F7F8000, 0x7F7E8000, 0x7F7FFFFF, 0xFF7F8000, 0x7FC00001, 0x7F800001, 0xFFFFFFFF,
                     0x00000001, 0x80008000], dtype=np.uint32).view(np.float32)
    vals = np.concatenate([mids, up, down, bf_ties.view(np.float32), special, more])
    return np.concatenate([vals, -vals])


@pytest.mark.parametrize("offset", [0, 1])
def test_f32_to_f16_matches_numpy(level, offset):
    x = tricky_f32()
    rng = np.random.default_rng(7)
    x = np.concatenate([x, rng.integers(0, 2 ** 32, 1 << 16, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    src, dst = Buf(x, F32, offset), Buf(np.zeros(x.size, np.float16), F16, offset)
    apex_C.copy_(src.obj, dst.obj, 2)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16)
    assert_same(dst.view, want, F16, "f32 -> f16")
    dst.assert_guards("copy_ f32->f16")


@pytest.mark.parametrize("offset", [0, 1])
def test_f32_to_bf16_round_nearest_even(level, offset):
    x = tricky_f32()
    rng = np.random.default_rng(8)
    x = np.concatenate([x, rng.integers(0, 2 ** 32, 1 << 16, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    src, dst = Buf(x, F32, offset), Buf(np.zeros(x.size, np.uint16), BF16, offset)
    apex_C.copy_(src.obj, dst.obj, 2)
    assert_same(dst.view, bf16_rne(x), BF16, "f32 -> bf16")
    dst.assert_guards("copy_ f32->bf16")


def test_bf16_rne_reference_itself():
    """The reference helper on hand-checked cases (ties to even, overflow, inf, nan)."""
    cases = {
        0x3F808000: 0x3F80,  # tie, kept even -> down
        0x3F818000: 0x3F82,  # tie, kept odd -> up
        0x3F808001: 0x3F81,  # above tie -> up
        0x3F807FFF: 0x3F80,  # below tie -> down
        0x7F7FFFFF: 0x7F80,  # max float rounds to inf
        0x7F7F8000: 0x7F80,  # tie at the top, kept odd -> inf
        0x7F7E8000: 0x7F7E,  # tie at the top, kept even -> stays
        0x7F800000: 0x7F80,  # inf
        0xFF800000: 0xFF80,  # -inf
        0x80000001: 0x8000,  # tiny negative denormal -> -0
    }
    x = np.array(list(cases), dtype=np.uint32).view(np.float32)
    assert bf16_rne(x).tolist() == list(cases.values())
    nan = bf16_rne(np.array([np.nan], np.float32))
    assert np.isnan(bf16_to_f32(nan))[0]


@pytest.mark.parametrize("dt", [F16, BF16], ids=["f16", "bf16"])
def test_16bit_to_f32_exact_for_all_patterns(level, dt):
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    src = Buf(every.view(STORAGE[dt]), dt, 1)
    dst = Buf(np.zeros(every.size, np.float32), F32, 1)
    apex_C.copy_(src.obj, dst.obj, 2)
    assert_same(dst.view, to_f32(every.view(STORAGE[dt]), dt), F32, f"{dt} -> f32")
    dst.assert_guards("copy_ to f32")


@pytest.mark.parametrize("sname", list(DTYPES))
@pytest.mark.parametrize("dname", list(DTYPES))
def test_copy_every_dtype_pair(level, rng, sname, dname):
    sdt, ddt = DTYPES[sname], DTYPES[dname]
    for n in SIZES:
        for offset in (0, 1):
            x = random_values(rng, n, sdt)
            src, dst = Buf(x, sdt, offset), Buf(np.zeros(n, STORAGE[ddt]), ddt, offset)
            apex_C.copy_(src.obj, dst.obj, 2)
            assert_same(dst.view, from_f32(to_f32(x, sdt), ddt), ddt, f"copy {sname}->{dname} n={n} off={offset}")
            dst.assert_guards(f"copy {sname}->{dname} n={n}")
            assert_same(src.view, x, sdt, "copy_ must not modify its source")


# ---------------------------------------------------------------------------------------------------------------
# scale_ / axpy_ / fill_
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sname", list(DTYPES))
@pytest.mark.parametrize("dname", list(DTYPES))
def test_scale_out_of_place(level, rng, sname, dname):
    sdt, ddt = DTYPES[sname], DTYPES[dname]
    for n in SIZES:
        for offset in (0, 1):
            for s in (1.0 / 3.0, 65536.0, 2.0 ** -16):
                x = random_values(rng, n, sdt)
                src, dst = Buf(x, sdt, offset), Buf(np.zeros(n, STORAGE[ddt]), ddt, offset)
                found = apex_C.scale_(src.obj, dst.obj, s, True, 2)
                assert found is False, f"finite input reported non-finite (n={n})"
                want = from_f32(f32_mul(to_f32(x, sdt), s), ddt)
                assert_same(dst.view, want, ddt, f"scale {sname}->{dname} n={n} off={offset} s={s}")
                dst.assert_guards("scale_")
                assert_same(src.view, x, sdt, "scale_ out of place must not modify its source")


@pytest.mark.parametrize("name", list(DTYPES))
def test_scale_in_place(level, rng, name):
    dt = DTYPES[name]
    for n in SIZES:
        for offset in (0, 1):
            for check in (True, False):
                x = random_values(rng, n, dt)
                buf = Buf(x, dt, offset)
                found = apex_C.scale_(buf.obj, buf.obj, 1.0 / 3.0, check, 2)
                assert found is False
                assert_same(buf.view, from_f32(f32_mul(to_f32(x, dt), 1.0 / 3.0), dt), dt, f"in-place n={n}")
                buf.assert_guards("scale_ in place")


@pytest.mark.parametrize("sname", list(DTYPES))
@pytest.mark.parametrize("dname", list(DTYPES))
def test_axpy(level, rng, sname, dname):
    sdt, ddt = DTYPES[sname], DTYPES[dname]
    for n in SIZES:
        for offset in (0, 1):
            x, y = random_values(rng, n, sdt), random_values(rng, n, ddt)
            src, dst = Buf(x, sdt, offset), Buf(y, ddt, 1 - offset)  # also relatively misaligned
            found = apex_C.axpy_(src.obj, dst.obj, 0.375, True, 2)
            assert found is False
            want = from_f32(f32_add(to_f32(y, ddt), f32_mul(to_f32(x, sdt), 0.375)), ddt)
            assert_same(dst.view, want, ddt, f"axpy {sname}->{dname} n={n} off={offset}")
            dst.assert_guards("axpy_")
            assert_same(src.view, x, sdt, "axpy_ must not modify its source")


@pytest.mark.parametrize("name", list(DTYPES))
def test_fill(level, name):
    dt = DTYPES[name]
    for n in SIZES:
        for offset in (0, 1):
            for value in (0.0, -0.0, 1.5, 0.1, 1e6, -np.inf, np.nan, 1e-30):
                buf = Buf(np.ones(n, STORAGE[dt]) if dt != BF16 else np.full(n, 0x3F80, np.uint16), dt, offset)
                apex_C.fill_(buf.obj, value, 2)
                want = from_f32(np.full(n, value, np.float32), dt)
                assert_same(buf.view, want, dt, f"fill {name} n={n} value={value}")
                buf.assert_guards("fill_")


# ---------------------------------------------------------------------------------------------------------------
# reductions
# ---------------------------------------------------------------------------------------------------------------
SUM_RTOL = 1e-12  # positive terms in float64: error <= ~(1024 + n/16384) * 2^-53 relative; far below this


@pytest.mark.parametrize("name", list(DTYPES))
def test_sum_sq_and_max_abs(level, rng, name):
    dt = DTYPES[name]
    for n in (*SIZES, 16384, 16385, (1 << 17) + 3):
        for offset in (0, 1):
            x = random_values(rng, n, dt)
            buf = Buf(x, dt, offset)
            x64 = to_f32(x, dt).astype(np.float64)
            want_sum = math.fsum((x64 * x64).tolist()) if n <= 4097 else float(np.sum(x64 * x64))
            want_max = float(np.max(np.abs(x64))) if n else 0.0
            got = [apex_C.sum_sq(buf.obj, t) for t in (1, 2, 3, 8)]
            assert len(set(got)) == 1, f"sum_sq depends on the thread count: {got}"
            assert got[0] == pytest.approx(want_sum, rel=SUM_RTOL, abs=0.0), f"sum_sq n={n} off={offset}"
            got_max = [apex_C.max_abs(buf.obj, t) for t in (1, 2, 3, 8)]
            assert got_max == [want_max] * 4, f"max_abs n={n} off={offset}: {got_max} vs {want_max}"


@pytest.mark.parametrize("name", list(DTYPES))
def test_segment_sum_sq(level, rng, name):
    dt = DTYPES[name]
    # empty segments, one-element, SIMD-tail sized, and segments longer than a reduction chunk (16384)
    lengths = [0, 1, 7, 0, 16, 17, 4097, 16384, 16385, 40000, 3, 0]
    start = 5  # the first segment need not start at element 0
    seg = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64) + start
    total = int(seg[-1])
    x = random_values(rng, total, dt)
    buf = Buf(x, dt, 1)
    x64 = to_f32(x, dt).astype(np.float64)
    want = [math.fsum((x64[a:b] ** 2).tolist()) for a, b in zip(seg[:-1], seg[1:])]
    results = []
    for t in (1, 2, 3):
        out = np.full(len(lengths) + 1, -1.0)
        apex_C.segment_sum_sq(buf.obj, seg, out[:-1], t)
        assert out[-1] == -1.0, "segment_sum_sq wrote past out[nseg-1]"
        results.append(out[:-1].copy())
        raw = np.full(len(lengths) + 1, -1.0)
        apex_C._raw_segment_sum_sq(buf.addr, dt, seg.ctypes.data, len(lengths), raw.ctypes.data, t)
        assert bits(raw.view(np.uint32)).tobytes() == bits(out.view(np.uint32)).tobytes(), "raw path differs"
    for r in results[1:]:
        assert bits(r.view(np.uint32)).tobytes() == bits(results[0].view(np.uint32)).tobytes(), \
            "segment_sum_sq depends on the thread count"
    np.testing.assert_allclose(results[0], want, rtol=SUM_RTOL, atol=0.0)
    out = np.full(1, -1.0)
    apex_C._raw_segment_sum_sq(buf.addr, dt, 0, 0, 0, 2)  # nseg=0: nothing to do, no pointer needed
    apex_C._raw_segment_sum_sq(buf.addr, dt, seg.ctypes.data, 0, out.ctypes.data, 2)
    apex_C.segment_sum_sq(buf.obj, seg[:1], out[:0], 2)  # one offset, no segment
    apex_C.segment_sum_sq(buf.obj, seg[:0], out[:0], 2)
    assert out[0] == -1.0


# ---------------------------------------------------------------------------------------------------------------
# non-finite detection at every position that matters
# ---------------------------------------------------------------------------------------------------------------
def bad_value(kind: str, dt: int):
    v = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan}[kind]
    return from_f32(np.array([v], np.float32), dt)[0]


def probe_positions(n: int) -> list:
    """First, middle and last element, and windows of 70 (> one unrolled 512-bit fp16 vector: 64) at the start
    (the alignment peel), around the middle (inside the range of the pieces threads take in turn)
    and at the end (the last SIMD tail). Large n repeats only the windows small n cannot reach."""
    if n <= 200:
        return list(range(n))
    mid = n // 2
    head = range(70) if n <= 5000 else range(3)
    return sorted(set(head) | set(range(mid - 70, mid + 70)) | set(range(n - 70, n)))


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("n", [1, 7, 33, 4097, 70001])
def test_nonfinite_detected_everywhere(level, rng, name, n):
    dt = DTYPES[name]
    x = random_values(rng, n, dt)
    for offset in (0, 1) if n <= 5000 else (1,):  # the alignment peel is covered by the small sizes
        src = Buf(x, dt, offset)
        dst = Buf(np.zeros(n, STORAGE[dt]), dt, offset)
        acc = Buf(np.zeros(n, STORAGE[dt]), dt, offset)
        for threads in (1, 2) if n >= 65536 else (2,):  # below 2 x 32768 elements one thread does it all
            assert apex_C.has_nonfinite(src.obj, threads) is False
            for kind in ("inf", "-inf", "nan"):
                for i in probe_positions(n):
                    src.view[i] = bad_value(kind, dt)
                    where = f"{kind} at {i} of {n} (offset {offset}, {threads} threads)"
                    assert apex_C.has_nonfinite(src.obj, threads) is True, f"has_nonfinite missed {where}"
                    assert apex_C.scale_(src.obj, dst.obj, 0.5, True, threads) is True, \
                        f"scale_ missed {where}"
                    assert apex_C.scale_(src.obj, dst.obj, 0.5, False, threads) is False, \
                        f"scale_ with check=False reported {where}"
                    assert apex_C.axpy_(src.obj, acc.obj, 0.5, True, threads) is True, \
                        f"axpy_ missed {where}"
                    src.view[i] = x[i]
            # in place, and the reductions, at first / middle / last only (each call rewrites or rescans all)
            for kind in ("inf", "-inf", "nan"):
                for i in sorted({0, n // 2, n - 1}):
                    work = Buf(x, dt, offset)
                    work.view[i] = bad_value(kind, dt)
                    m = apex_C.max_abs(work.obj, threads)
                    assert (np.isnan(m) if kind == "nan" else m == np.inf), f"max_abs with {kind} at {i}: {m}"
                    ss = apex_C.sum_sq(work.obj, threads)
                    assert (np.isnan(ss) if kind == "nan" else ss == np.inf), f"sum_sq with {kind} at {i}: {ss}"
                    assert apex_C.scale_(work.obj, work.obj, 0.5, True, threads) is True
                    got = to_f32(work.view, dt)[i]
                    assert (np.isnan(got) if kind == "nan" else got == to_f32(bad_value(kind, dt), dt)), \
                        f"in-place scale_ changed the non-finite value at {i}: {got}"
        src.assert_guards("non-finite probes")


@pytest.mark.parametrize("name", list(DTYPES))
def test_extremes_are_finite(level, name):
    """Largest finite values, subnormals and signed zeros are not reported as non-finite."""
    dt = DTYPES[name]
    if dt == F32:
        vals = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max, 1e-45, -0.0, 0.0], np.float32)
    elif dt == F16:
        vals = np.array([65504, -65504, 2.0 ** -24, -0.0, 0.0], np.float16)
    else:
        vals = np.array([0x7F7F, 0xFF7F, 0x0001, 0x8000, 0x0000], np.uint16)
    x = np.resize(vals, 4101)
    buf = Buf(x, dt, 1)
    assert apex_C.has_nonfinite(buf.obj, 2) is False
    assert apex_C.scale_(buf.obj, buf.obj, 1.0, True, 2) is False
    assert_same(buf.view, x, dt, "scale by 1 keeps extremes")


# ---------------------------------------------------------------------------------------------------------------
# thread-count independence (elementwise: bitwise; flags identical)
# ---------------------------------------------------------------------------------------------------------------
def _use_pool(name: str) -> None:
    """Selects a thread pool for the calls that follow; skips when the process cannot have an OpenMP runtime."""
    if name == "openmp":
        try:
            import torch  # noqa: F401  (loads the OpenMP runtime torch's CPU ops run on)
        except ImportError:
            pytest.skip("torch is not installed: no OpenMP runtime in this process")
        try:
            apex_C.set_thread_pool("openmp")
        except ValueError as e:
            pytest.skip(f"this torch runs without an OpenMP runtime: {e}")
    else:
        apex_C.set_thread_pool(name)
    assert apex_C.thread_pool() == name


@pytest.fixture(params=["threads", "openmp"])
def pool(request):
    """Runs the test's threaded calls on one thread pool, then back to the default choice."""
    _use_pool(request.param)
    yield request.param
    apex_C.set_thread_pool("auto")


@pytest.mark.parametrize("name", list(DTYPES))
def test_results_identical_for_1_2_and_3_threads(level, pool, rng, name):
    dt = DTYPES[name]
    n = (1 << 17) + 13  # large enough that 2 threads really split the range (into pieces taken in turn)
    x, y = random_values(rng, n, dt), random_values(rng, n, dt)
    outs = []
    for threads in (1, 2, 3):
        src = Buf(x, dt, 1)
        scaled = Buf(np.zeros(n, STORAGE[dt]), dt, 0)
        acc = Buf(y, dt, 1)
        conv = Buf(np.zeros(n, np.float32), F32, 0)
        filled = Buf(np.zeros(n, STORAGE[dt]), dt, 1)
        flags = (
            apex_C.scale_(src.obj, scaled.obj, 1.0 / 3.0, True, threads),
            apex_C.axpy_(src.obj, acc.obj, -0.7, True, threads),
            apex_C.has_nonfinite(src.obj, threads),
        )
        apex_C.copy_(src.obj, conv.obj, threads)
        apex_C.fill_(filled.obj, 0.3, threads)
        apex_C.scale_(src.obj, src.obj, 3.0, True, threads)
        outs.append((flags, [bits(b.view).tobytes() for b in (scaled, acc, conv, filled, src)]))
    for t in (1, 2):
        assert outs[0][0] == outs[t][0]
        for k, name_ in enumerate(("scale_", "axpy_", "copy_", "fill_", "scale_ in place")):
            assert outs[0][1][k] == outs[t][1][k], f"{name_} differs between 1 and {t + 1} threads"


# ---------------------------------------------------------------------------------------------------------------
# 50M elements (one allocation of 200 MB per buffer)
# ---------------------------------------------------------------------------------------------------------------
BIG = 50_000_000


def _big_case(dt: int) -> None:
    pattern = random_values(np.random.default_rng(50), 4099, dt)  # length coprime with every vector width
    x = np.resize(pattern, BIG)
    dst = np.empty(BIG, STORAGE[dt])
    assert apex_C.scale_(typed(x, dt), typed(dst, dt), 0.5, True, 0) is False
    want = from_f32(f32_mul(to_f32(pattern, dt), 0.5), dt)
    assert np.array_equal(bits(dst).reshape(-1)[: BIG - BIG % 4099].reshape(-1, 4099), np.broadcast_to(
        bits(want), (BIG // 4099, 4099))), "scale_ on 50M elements"
    assert np.array_equal(bits(dst[BIG - BIG % 4099:]), bits(want[: BIG % 4099]))
    p64 = to_f32(pattern, dt).astype(np.float64)
    reps, rest = divmod(BIG, 4099)
    want_sum = reps * math.fsum((p64 ** 2).tolist()) + math.fsum((p64[:rest] ** 2).tolist())
    assert apex_C.sum_sq(typed(x, dt), 0) == pytest.approx(want_sum, rel=1e-10)
    assert apex_C.max_abs(typed(x, dt), 0) == float(np.max(np.abs(p64)))
    for i in (0, BIG // 2, BIG - 1):
        keep = x[i]
        x[i] = bad_value("inf", dt)
        assert apex_C.has_nonfinite(typed(x, dt), 0) is True, f"inf at {i} of 50M"
        x[i] = keep
    assert apex_C.has_nonfinite(typed(x, dt), 0) is False
    assert apex_C._raw_has_nonfinite(x.ctypes.data, dt, BIG, 0) is False


def test_50m_f32(level):
    t0 = time.perf_counter()
    _big_case(F32)
    assert time.perf_counter() - t0 < 10.0, "50M-element kernels far slower than memory speed"


@pytest.mark.full
@pytest.mark.parametrize("dt", [F16, BF16], ids=["f16", "bf16"])
def test_50m_16bit(level, dt):
    _big_case(dt)


# ---------------------------------------------------------------------------------------------------------------
# public API: what the objects describe is checked before any memory is touched
# ---------------------------------------------------------------------------------------------------------------
def _public_calls(src, dst):
    """Every public buffer function on the given objects."""
    return {
        "scale_": lambda: apex_C.scale_(src, dst, 2.0),
        "axpy_": lambda: apex_C.axpy_(src, dst, 2.0),
        "copy_": lambda: apex_C.copy_(src, dst),
        "fill_": lambda: apex_C.fill_(dst, 2.0),
        "has_nonfinite": lambda: apex_C.has_nonfinite(src),
        "sum_sq": lambda: apex_C.sum_sq(src),
        "max_abs": lambda: apex_C.max_abs(src),
    }


def test_public_functions_reject_raw_addresses():
    """The calling pattern of the old raw API, with the hostile counts, is a TypeError: nothing runs."""
    x = np.arange(64, dtype=np.float32)
    a = x.ctypes.data
    hostile = [
        lambda: apex_C.fill_(a, 0, 2 ** 62, 0.0),
        lambda: apex_C.scale_(a, 0, a, 0, 2 ** 62 + 1, 2.0),
        lambda: apex_C.has_nonfinite(a, 0, 2 ** 63 - 1),
        lambda: apex_C.max_abs(a, 0, 2 ** 63 - 1),
        lambda: apex_C.sum_sq(a, 0, 2 ** 63 - 1),
        lambda: apex_C.copy_(a, 0, a + 4, 0, 8),
        lambda: apex_C.axpy_(a, 0, a, 0, 8, 1.0),
        lambda: apex_C.segment_sum_sq(a, 0, a, 3, a, 1),
    ]
    for call in hostile:
        with pytest.raises(TypeError):
            call()
    for call in _public_calls(a, a).values():
        with pytest.raises(TypeError, match="raw addresses are not accepted"):
            call()
    assert np.array_equal(x, np.arange(64, dtype=np.float32))


def test_public_unsupported_element_types():
    for bad in (np.arange(8, dtype=np.int32), np.arange(8, dtype=np.float64), np.zeros(8, np.uint16),
                np.zeros(8, np.complex64), b"abcdefgh", bytearray(8)):
        for call in _public_calls(bad, bad).values():
            with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
                call()
    for bad in (None, 3.5, "text", [1.0, 2.0], object()):
        for call in _public_calls(bad, bad).values():
            with pytest.raises(TypeError, match="buffer protocol or __dlpack__"):
                call()


def test_public_non_contiguous_rejected():
    base = np.arange(64, dtype=np.float32)
    want = base.copy()
    for strided in (base[::2], DLOnly(base[::2]), DLOnly(base[::2], versioned=False)):
        dst = np.zeros(32, np.float32)
        for fname, call in _public_calls(strided, dst).items():
            if fname == "fill_":
                continue
            with pytest.raises(ValueError, match="C-contiguous"):
                call()
        with pytest.raises(ValueError, match="C-contiguous"):
            apex_C.fill_(strided, 1.0)
        assert not dst.any()
    assert np.array_equal(base, want)
    # 2-D C-contiguous is fine (flat semantics), Fortran order is not
    m = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert apex_C.sum_sq(m) == float((m.astype(np.float64) ** 2).sum())
    with pytest.raises(ValueError, match="C-contiguous"):
        apex_C.sum_sq(np.asfortranarray(m))
    with pytest.raises(ValueError, match="C-contiguous"):
        apex_C.sum_sq(DLOnly(np.asfortranarray(m)))


def test_public_sizes_must_agree():
    src, dst = np.ones(8, np.float32), np.zeros(7, np.float32)
    for fname in ("scale_", "axpy_", "copy_"):
        with pytest.raises(ValueError, match="expected equal sizes"):
            _public_calls(src, dst)[fname]()
    assert not dst.any()


def test_public_partial_overlap_rejected_in_place_allowed():
    x = np.arange(100, dtype=np.float32)
    for fname in ("scale_", "axpy_", "copy_"):
        with pytest.raises(ValueError, match="overlap partially"):
            _public_calls(x[:-1], x[1:])[fname]()
    with pytest.raises(ValueError, match="same dtype"):  # same start, other dtype: an f16 view of the same bytes
        apex_C.copy_(x[:50], x.view(np.float16)[:50])
    assert np.array_equal(x, np.arange(100, dtype=np.float32))
    assert apex_C.scale_(x, x, 2.0) is False
    assert np.array_equal(x, np.arange(100, dtype=np.float32) * 2)


def test_public_read_only_destination_rejected():
    x = np.arange(16, dtype=np.float32)
    x.flags.writeable = False
    dst = np.zeros(16, np.float32)
    for fname, call in _public_calls(dst, x).items():
        if fname in ("has_nonfinite", "sum_sq", "max_abs"):
            continue
        with pytest.raises(ValueError, match="read-only"):
            call()
    # reading a read-only array is fine, through the buffer protocol and through DLPack 1.x
    assert apex_C.sum_sq(x) == float((np.arange(16.0) ** 2).sum())
    assert apex_C.sum_sq(DLOnly(x)) == apex_C.sum_sq(x)
    apex_C.copy_(x, dst)
    assert np.array_equal(dst, x)
    with pytest.raises(ValueError, match="READ_ONLY"):  # versioned export marks it read-only
        apex_C.fill_(DLOnly(x), 1.0)
    with pytest.raises(BufferError):  # numpy refuses a legacy (unversioned) export of a read-only array
        apex_C.fill_(DLOnly(x, versioned=False), 1.0)
    assert np.array_equal(x, np.arange(16, dtype=np.float32))


def test_public_misaligned_and_non_cpu_rejected():
    raw = np.zeros(65, np.uint8)
    odd = raw[1:].view(np.float32)  # unaligned float32 view
    for obj in (odd, DLOnly(odd)):
        with pytest.raises(ValueError, match="aligned"):
            apex_C.fill_(obj, 1.0)
    assert not raw.any()
    x = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="CPU"):
        apex_C.fill_(DLOnly(x, device=(2, 0)), 1.0)
    assert not x.any()


def test_public_dlpack_capsule_consumed_and_deleter_called():
    """The capsule is renamed to used_dltensor[_versioned] and the producer's deleter runs by the time the call
    returns (numpy's deleter drops the reference the export took on the array)."""
    for versioned in (True, False):
        x = np.arange(1000, dtype=np.float32)
        obj = DLOnly(x, versioned=versioned)
        before = sys.getrefcount(x)  # counts taken outside asserts: pytest's rewriting holds extra references
        assert apex_C.scale_(obj, obj, 0.5) is False
        after = sys.getrefcount(x)
        assert after == before, "the DLPack deleter was not called"
        assert len(obj.capsules) == 1, "one object passed as src and dst is exported once"
        names = {_capsule_name(c) for c in obj.capsules}
        assert names == {b"used_dltensor_versioned" if versioned else b"used_dltensor"}, names
        assert np.array_equal(x, np.arange(1000, dtype=np.float32) * np.float32(0.5))
        # also when a check rejects the call after the capsule was taken
        arr = np.zeros(4, np.int32)
        bad = DLOnly(arr, versioned=versioned)
        before = sys.getrefcount(arr)
        with pytest.raises(TypeError):
            apex_C.fill_(bad, 1.0)
        after = sys.getrefcount(arr)
        assert after == before, "the DLPack deleter was not called on a rejected call"


def test_public_bad_dlpack_producers():
    x = np.zeros(4, np.float32)

    class NotCapsule:
        def __dlpack__(self, **kw):
            return 12345

        def __dlpack_device__(self):
            return (1, 0)

    class Reused(DLOnly):  # hands out a capsule that was already consumed
        def __dlpack__(self, **kw):
            cap = super().__dlpack__(**kw)
            apex_C.sum_sq(DLOnlyCapsule(cap))
            return cap

    class DLOnlyCapsule:
        def __init__(self, cap):
            self.cap = cap

        def __dlpack__(self, **kw):
            return self.cap

    class BadDevice(DLOnly):
        def __dlpack_device__(self):
            return "cpu"

    with pytest.raises(TypeError, match="PyCapsule"):
        apex_C.fill_(NotCapsule())
    with pytest.raises(TypeError, match="used_dltensor"):
        apex_C.fill_(Reused(x))
    with pytest.raises(TypeError, match="__dlpack_device__"):
        apex_C.fill_(BadDevice(x))
    for code_bits in ((2, 8), (1, 32), (5, 64)):  # float8-like, uint32, complex
        with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
            apex_C.fill_(DLOnly(x, relabel=code_bits))
    assert not x.any()


def test_public_bf16_slice_touches_only_its_slice(level):
    """A bf16 slice of a bigger buffer carries its own dtype and extent: scaling it cannot reach its neighbours
    (with raw addresses, a float32 dtype code on this slice overwrote the next slice)."""
    flat = np.full(64, 0x3F80, np.uint16)  # bf16 1.0
    part = flat[16:32]
    apex_C.scale_(bf16_view(part), bf16_view(part), 0.5)
    assert (bf16_to_f32(flat[16:32]) == 0.5).all()
    assert (bf16_to_f32(np.concatenate([flat[:16], flat[32:]])) == 1.0).all()


def test_public_other_buffer_exporters():
    import array
    a = array.array("f", [1.0, -2.0, 3.0])
    assert apex_C.sum_sq(a) == 14.0
    assert apex_C.max_abs(memoryview(a)) == 3.0
    apex_C.scale_(a, a, 2.0)
    assert list(a) == [2.0, -4.0, 6.0]
    with pytest.raises(ValueError, match="read-only"):
        apex_C.fill_(memoryview(a).toreadonly(), 0.0)


def test_public_segment_sum_sq_checks():
    x = np.ones(32, np.float32)
    out = np.zeros(3)
    good = np.array([0, 8, 16, 32], np.int64)
    apex_C.segment_sum_sq(x, good, out)
    assert out.tolist() == [8.0, 8.0, 16.0]
    out[:] = 0
    with pytest.raises(TypeError, match="int64"):
        apex_C.segment_sum_sq(x, good.astype(np.int32), out)
    with pytest.raises(TypeError, match="float64"):
        apex_C.segment_sum_sq(x, good, out.astype(np.float32))
    with pytest.raises(ValueError, match=r"len\(seg\) == len\(out\) \+ 1"):
        apex_C.segment_sum_sq(x, good[:3], out)
    for bad in ([0, 16, 8, 32], [-4, 8, 16, 32]):
        with pytest.raises(ValueError, match=r"non-decreasing|>= 0"):
            apex_C.segment_sum_sq(x, np.array(bad, np.int64), out)
    with pytest.raises(ValueError, match="past the end of src"):
        apex_C.segment_sum_sq(x, np.array([0, 8, 16, 33], np.int64), out)
    with pytest.raises(ValueError, match="past the end of src"):
        apex_C.segment_sum_sq(x, np.array([0, 8, 16, 2 ** 40], np.int64), out)
    ro = out.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        apex_C.segment_sum_sq(x, good, ro)
    shared = np.zeros(32, np.float64)
    with pytest.raises(ValueError, match="share memory"):
        apex_C.segment_sum_sq(shared.view(np.float32), good, shared[:3])
    assert not out.any() and not shared.any(), "a rejected call wrote its output"


# ---------------------------------------------------------------------------------------------------------------
# private raw path: ValueError for everything it can see, and nothing written
# ---------------------------------------------------------------------------------------------------------------
def _calls(addr_a: int, addr_b: int, n: int, dt: int):
    """Every raw buffer kernel, called with the given addresses / count / dtype."""
    return {
        "_raw_scale_": lambda: apex_C._raw_scale_(addr_a, dt, addr_b, dt, n, 2.0, True, 2),
        "_raw_axpy_": lambda: apex_C._raw_axpy_(addr_a, dt, addr_b, dt, n, 2.0, True, 2),
        "_raw_copy_": lambda: apex_C._raw_copy_(addr_a, dt, addr_b, dt, n, 2),
        "_raw_fill_": lambda: apex_C._raw_fill_(addr_b, dt, n, 2.0, 2),
        "_raw_has_nonfinite": lambda: apex_C._raw_has_nonfinite(addr_a, dt, n, 2),
        "_raw_sum_sq": lambda: apex_C._raw_sum_sq(addr_a, dt, n, 2),
        "_raw_max_abs": lambda: apex_C._raw_max_abs(addr_a, dt, n, 2),
    }


def test_raw_bad_arguments_raise_value_error(level):
    src = np.arange(64, dtype=np.float32)
    dst = np.zeros(64, dtype=np.float32)
    a, b = src.ctypes.data, dst.ctypes.data
    cases = {
        "negative n": (a, b, -1, F32, "non-negative"),
        "null address": (0, 0, 8, F32, "null"),
        "bad dtype 3": (a, b, 8, 3, "dtype code"),
        "bad dtype -1": (a, b, 8, -1, "dtype code"),
        "misaligned f32": (a + 1, b + 1, 8, F32, "aligned"),
        "misaligned f16": (a + 1, b + 1, 8, F16, "aligned"),
        "n = 2**48 + 1": (a, b, 2 ** 48 + 1, F32, "2\\*\\*48"),
        "n = 2**62": (a, b, 2 ** 62, F32, "2\\*\\*48"),
        "n = 2**63 - 1": (a, b, 2 ** 63 - 1, F16, "2\\*\\*48"),
        "range wraps": (2 ** 64 - 64, 2 ** 64 - 64, 1 << 20, F32, "wraps"),
    }
    for case, (x, y, n, dt, text) in cases.items():
        for fname, call in _calls(x, y, n, dt).items():
            with pytest.raises(ValueError, match=text):
                call()
            assert np.array_equal(src, np.arange(64, dtype=np.float32)), f"{fname} ({case}) wrote its source"
            assert not dst.any(), f"{fname} ({case}) wrote its destination"
    with pytest.raises(ValueError, match="same dtype"):
        apex_C._raw_scale_(a, F32, a, F16, 8, 2.0, True, 2)
    for big in (2 ** 64, -1):  # not an address at all
        with pytest.raises(TypeError):
            apex_C._raw_fill_(big, F32, 8, 0.0)
    assert np.array_equal(src, np.arange(64, dtype=np.float32))


def test_raw_hostile_counts_from_review(level):
    """The exact calls that crashed or answered wrongly, now on the raw path: ValueError, nothing written."""
    x = np.zeros(64, np.float32)
    x[0] = np.inf
    a = x.ctypes.data
    with pytest.raises(ValueError, match=r"exceeds the limit 2\*\*48"):
        apex_C._raw_fill_(a, 0, 2 ** 62, 0.0)
    with pytest.raises(ValueError, match=r"exceeds the limit 2\*\*48"):
        apex_C._raw_scale_(a, 0, a, 0, 2 ** 62 + 1, 2.0)
    with pytest.raises(ValueError, match=r"exceeds the limit 2\*\*48"):  # the overlap check cannot wrap
        apex_C._raw_scale_(a, 0, a + 4, 0, 2 ** 62, 2.0)
    for fn in (apex_C._raw_has_nonfinite, apex_C._raw_max_abs, apex_C._raw_sum_sq):
        with pytest.raises(ValueError, match=r"exceeds the limit 2\*\*48"):
            fn(a, 0, 2 ** 63 - 1)
    assert apex_C._raw_has_nonfinite(a, 0, 64) is True
    assert x[0] == np.inf and not x[1:].any()


def test_raw_partially_overlapping_buffers_rejected(level):
    """Elementwise kernels are safe in place (src == dst) but not on shifted views of one buffer."""
    x = np.arange(100, dtype=np.float32)
    a = x.ctypes.data
    calls = {
        "_raw_scale_": lambda: apex_C._raw_scale_(a, F32, a + 4, F32, 99, 2.0, True, 1),
        "_raw_axpy_": lambda: apex_C._raw_axpy_(a + 4, F32, a, F32, 99, 2.0, True, 1),
        "_raw_copy_": lambda: apex_C._raw_copy_(a, F32, a + 2, F16, 50, 1),
    }
    for fname, call in calls.items():
        with pytest.raises(ValueError, match="overlap"):
            call()
        assert np.array_equal(x, np.arange(100, dtype=np.float32)), f"{fname} wrote before rejecting"


def test_raw_copy_in_place_with_dtype_change_rejected(level):
    x = np.arange(8, dtype=np.float32)
    with pytest.raises(ValueError, match="same dtype"):
        apex_C._raw_copy_(x.ctypes.data, F32, x.ctypes.data, F16, 8, 1)


def test_raw_empty_buffers_accept_null(level):
    for fname, call in _calls(0, 0, 0, F32).items():
        result = call()
        assert result in (None, False, 0.0), f"{fname} on an empty buffer returned {result!r}"
    for fname, call in _public_calls(np.zeros(0, np.float32), np.zeros(0, np.float32)).items():
        result = call()
        assert result in (None, False, 0.0), f"{fname} on an empty array returned {result!r}"


def test_raw_matches_public(level, rng):
    x = random_values(rng, 4097, F32)
    a, b = np.zeros(4097, np.float32), np.zeros(4097, np.float32)
    apex_C._raw_scale_(x.ctypes.data, F32, a.ctypes.data, F32, x.size, 0.3, True, 2)
    apex_C.scale_(x, b, 0.3, True, 2)
    assert bits(a).tobytes() == bits(b).tobytes()
    assert apex_C._raw_sum_sq(x.ctypes.data, F32, x.size, 2) == apex_C.sum_sq(x, 2)


def test_raw_segment_sum_sq_bad_arguments():
    x = np.ones(32, np.float32)
    out = np.zeros(4)
    good = np.array([0, 8, 16, 32], np.int64)
    s, o = good.ctypes.data, out.ctypes.data
    with pytest.raises(ValueError, match="non-negative"):
        apex_C._raw_segment_sum_sq(x.ctypes.data, F32, s, -1, o, 1)
    with pytest.raises(ValueError, match="null"):
        apex_C._raw_segment_sum_sq(x.ctypes.data, F32, 0, 3, o, 1)
    with pytest.raises(ValueError, match="null"):
        apex_C._raw_segment_sum_sq(x.ctypes.data, F32, s, 3, 0, 1)
    # the table is not read before its count and address pass: a bogus non-null address is never dereferenced
    with pytest.raises(ValueError, match="2\\*\\*48"):
        apex_C._raw_segment_sum_sq(x.ctypes.data, F32, 8, 2 ** 62, o, 1)
    with pytest.raises(ValueError, match="aligned"):
        apex_C._raw_segment_sum_sq(x.ctypes.data, F32, s + 4, 3, o, 1)
    with pytest.raises(ValueError, match="aligned"):
        apex_C._raw_segment_sum_sq(x.ctypes.data, F32, s, 3, o + 1, 1)
    with pytest.raises(ValueError, match="wraps"):
        apex_C._raw_segment_sum_sq(x.ctypes.data, F32, 2 ** 64 - 16, 3, o, 1)
    for bad in ([0, 16, 8, 32], [-4, 8, 16, 32], [0, 8, 16, 2 ** 50]):
        seg = np.array(bad, np.int64)
        with pytest.raises(ValueError, match=r"non-decreasing|>= 0|2\*\*48"):
            apex_C._raw_segment_sum_sq(x.ctypes.data, F32, seg.ctypes.data, 3, o, 1)
    with pytest.raises(ValueError, match="dtype code"):
        apex_C._raw_segment_sum_sq(x.ctypes.data, 7, s, 3, o, 1)
    with pytest.raises(ValueError, match="disjoint"):
        apex_C._raw_segment_sum_sq(x.ctypes.data, F32, s, 3, x.ctypes.data, 1)
    assert not out.any(), "a rejected call wrote its output"


# ---------------------------------------------------------------------------------------------------------------
# the thread split: exact cover without overflow for any count
# ---------------------------------------------------------------------------------------------------------------
def _check_split(n, threads, min_per, align):
    ranges = apex_C._split_range(n, threads, min_per, align)
    if n <= 0:
        assert ranges == []
        return
    assert ranges[0][0] == 0 and ranges[-1][1] == n, (n, threads, ranges[:2], ranges[-2:])
    assert len(ranges) <= max(threads, 1)
    for (b0, e0), (b1, e1) in zip(ranges, ranges[1:]):
        assert b0 < e0 == b1 < e1, "ranges must be non-empty and contiguous"
        assert (e0 - b0) % max(align, 1) == 0 or len(ranges) == 1, "inner boundaries must be aligned"


def test_thread_split_covers_huge_counts():
    for n in (2 ** 63 - 1, 2 ** 63 - 2, 2 ** 62 + 1, 2 ** 48, 2 ** 16 * 3 + 1, 1, 0):
        for threads in (1, 2, 3, 7, 256, 4096):
            for align in (1, 64, 2 ** 20):
                _check_split(n, threads, 1 << 16, align)


try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # property tests need hypothesis (the test dependency group)
    given = None

if given is not None:

    @settings(max_examples=300, deadline=None)
    @given(st.integers(-5, 2 ** 63 - 1), st.integers(-3, 512), st.integers(-2, 2 ** 20), st.integers(-2, 4096))
    def test_thread_split_property(n, threads, min_per, align):
        _check_split(n, threads, min_per, align)


def test_simd_level_selection():
    previous = apex_C.simd_level()
    try:
        for lvl in LEVELS:
            apex_C.set_simd_level(lvl)
            assert apex_C.simd_level() == lvl
        apex_C.set_simd_level("baseline")
        apex_C.set_simd_level("auto")
        assert apex_C.simd_level() == LEVELS[-1], "'auto' picks the best supported level"
        foreign = "neon" if "neon" not in LEVELS else "avx512"
        for bad in ("bogus", foreign, "AVX2 "):
            apex_C.set_simd_level(LEVELS[0])
            with pytest.raises(ValueError, match="not supported"):
                apex_C.set_simd_level(bad)
            assert apex_C.simd_level() == LEVELS[0], "a rejected level changed the selection"
    finally:
        apex_C.set_simd_level(previous)
    assert LEVELS[0] == "baseline"


def test_compiler_is_named():
    """The module says which compiler built it (the bench records it: vectorised loops differ between them)."""
    assert re.fullmatch(r"(clang|gcc) \S.*", apex_C.compiler), apex_C.compiler


def test_thread_count_setting():
    before = apex_C.get_num_threads()
    try:
        apex_C.set_num_threads(3)
        assert apex_C.get_num_threads() == 3
        apex_C.set_num_threads(0)  # back to the environment / hardware default
        assert apex_C.get_num_threads() >= 1
    finally:
        apex_C.set_num_threads(before)


@pytest.mark.parametrize("threads", [2**31, 2**63, 2**80, -(2**31) - 1, -(2**80), np.int64(2**40), True])
def test_thread_counts_outside_int_saturate(threads):
    """A thread count is a request (capped at run time), so any integer is one: past the C int range it saturates
    rather than failing pybind's conversion; the results equal a 1-thread call's."""
    x = np.linspace(-3, 3, 100001, dtype=np.float32)
    assert apex_C.sum_sq(x, threads=threads) == apex_C.sum_sq(x, threads=1)
    assert apex_C.max_abs(x, threads=threads) == 3.0
    assert not apex_C.has_nonfinite(x, threads=threads)
    y = np.empty_like(x)
    apex_C.copy_(x, y, threads=threads)
    apex_C.scale_(y, y, 2.0, threads=threads)
    apex_C.axpy_(x, y, -2.0, threads=threads)
    apex_C.fill_(x, 1.0, threads=threads)
    assert not y.any() and (x == 1).all()
    seg, out = np.array([0, 5, 100001], dtype=np.int64), np.empty(2)
    apex_C.segment_sum_sq(x, seg, out, threads=threads)
    assert out.tolist() == [5.0, 99996.0]
    before = apex_C.get_num_threads()
    try:
        apex_C.set_num_threads(threads)
        n = apex_C.get_num_threads()
        assert n == min(int(threads), 2**31 - 1) if threads > 0 else n >= 1
    finally:
        apex_C.set_num_threads(before)


@pytest.mark.parametrize("threads", [1.5, "2", None, [1]])
def test_thread_counts_that_are_not_integers_are_refused(threads):
    x = np.ones(8, dtype=np.float32)
    with pytest.raises(TypeError, match="threads: int"):
        apex_C.sum_sq(x, threads=threads)
    with pytest.raises(TypeError, match="n: int"):
        apex_C.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------------------------
# optimizer kernels: argument validation (their math is tested through apex.optimizers)
# ---------------------------------------------------------------------------------------------------------------
# every optimizer kernel the module binds (they share one argument check), found by name
OPT_KERNELS = sorted(n for n in dir(apex_C)
                     if n.endswith("_step") or "_stage" in n or n in ("_raw_row_dots", "_raw_grad_sum_sq"))
VALID_COMBOS = [  # (param, grad, out copy or None)
    (F32, F32, None), (F32, F16, None), (F32, BF16, None), (F32, F32, F16), (F32, F32, BF16),
    (F32, F16, F16), (F32, BF16, BF16), (F16, F16, None), (BF16, BF16, None),
]
INVALID_COMBOS = [
    (F16, F32, None), (F16, BF16, None), (BF16, F32, None), (BF16, F16, None), (F16, F16, F16),
    (BF16, BF16, F32), (F32, F32, F32), (F32, F16, BF16), (F32, F16, F32), (F32, BF16, F16),
]


def _opt_args(pdt: int, gdt: int, odt, out_addr: int) -> apex_C.OptArgs:
    a = apex_C.OptArgs()
    a.pdt, a.gdt = pdt, gdt
    if odt is not None:
        a.out, a.odt = out_addr, odt
    return a


@pytest.mark.parametrize("kernel", OPT_KERNELS)
def test_optimizer_dtype_combinations(kernel):
    fn = getattr(apex_C, kernel)
    spare = np.zeros(8, np.float32)
    for pdt, gdt, odt in VALID_COMBOS:
        fn(_opt_args(pdt, gdt, odt, spare.ctypes.data))  # nseg = 0: accepted, nothing to do
    for pdt, gdt, odt in INVALID_COMBOS:
        with pytest.raises(ValueError, match="unsupported dtype combination"):
            fn(_opt_args(pdt, gdt, odt, spare.ctypes.data))
    assert not spare.any()


@pytest.mark.parametrize("kernel", OPT_KERNELS)
def test_optimizer_argument_errors(kernel):
    fn = getattr(apex_C, kernel)
    for field, value in (("pdt", 3), ("gdt", -1)):
        a = apex_C.OptArgs()
        setattr(a, field, value)
        with pytest.raises(ValueError, match="dtype code"):
            fn(a)
    a = apex_C.OptArgs()
    a.out, a.odt = 64, 9
    with pytest.raises(ValueError, match="dtype code"):
        fn(a)
    a = apex_C.OptArgs()
    a.hp = [0.1] * 13
    with pytest.raises(ValueError, match="at most 12"):
        fn(a)
    a = apex_C.OptArgs()
    a.nseg = -1
    with pytest.raises(ValueError, match="nseg"):
        fn(a)
    a = apex_C.OptArgs()
    a.nseg = 1  # p, g and seg missing
    with pytest.raises(ValueError, match="required"):
        fn(a)


REQUIRED_INPUTS = [
    (kernel, missing)
    for kernel, missing in [("_raw_adam_step", "steps"), ("_raw_adamp_stage_a", "steps"),
                            ("_raw_adamp_stage_b", "steps"), ("_raw_adagrad_step", "steps"),
                            ("_raw_lamb_stage1", "seg_out"), ("_raw_row_dots", "seg_out"),
                            ("_raw_grad_sum_sq", "seg_out"), ("_raw_adamp_stage_a", "seg_out")]
    if hasattr(apex_C, kernel)
]


@pytest.mark.parametrize(("kernel", "missing"), REQUIRED_INPUTS)
def test_optimizer_required_per_segment_inputs(kernel, missing):
    p, g = np.zeros(4, np.float32), np.ones(4, np.float32)
    states = [np.zeros(4, np.float32) for _ in range(3)]
    seg = np.array([0, 4], np.int64)
    steps = np.ones(1, np.float32)
    seg_out = np.zeros(4, np.float64)
    a = apex_C.OptArgs()
    a.p, a.g, a.seg, a.nseg = p.ctypes.data, g.ctypes.data, seg.ctypes.data, 1
    a.s0, a.s1, a.s2 = (st.ctypes.data for st in states)  # only the input under test is missing
    a.steps, a.seg_out = steps.ctypes.data, seg_out.ctypes.data
    setattr(a, missing, 0)
    with pytest.raises(ValueError, match=missing):
        getattr(apex_C, kernel)(a)
    assert not p.any() and not any(st.any() for st in states)


def _full_args(n=8, nseg=2):
    """A valid _raw_adam_step argument set over n elements in nseg equal slots, with the arrays it points into."""
    bufs = {k: np.zeros(n, np.float32) for k in ("p", "g", "s0", "s1", "s2")}
    seg = np.linspace(0, n, nseg + 1).astype(np.int64)
    steps = np.ones(nseg, np.float32)
    a = apex_C.OptArgs()
    for k, v in bufs.items():
        setattr(a, k, v.ctypes.data)
    a.seg, a.nseg, a.steps = seg.ctypes.data, nseg, steps.ctypes.data
    a.hp = [1e-3, 0.9, 0.999, 1e-8, 0.0]
    return a, bufs, seg, steps


def test_optimizer_valid_call_runs():
    a, bufs, _seg, _steps = _full_args()
    bufs["g"][:] = 1.0
    apex_C._raw_adam_step(a)
    assert (bufs["p"] < 0).all()


@pytest.mark.parametrize("kernel", OPT_KERNELS)
def test_optimizer_segment_table_validated(kernel):
    """nseg, the offsets, seg_end and every address are checked before the kernel reads or writes anything."""
    fn = getattr(apex_C, kernel)
    extra = np.zeros(64, np.float64)
    cases = []
    for nseg, text in ((2 ** 62, "2\\*\\*48"), (2 ** 48 + 1, "2\\*\\*48")):
        cases.append((lambda a, nseg=nseg: setattr(a, "nseg", nseg), text))
    for table, text in (([0, 6, 4], "non-decreasing"), ([-2, 4, 8], ">= 0"), ([0, 4, 2 ** 50], "2\\*\\*48")):
        arr = np.array(table, np.int64)
        cases.append((lambda a, arr=arr: setattr(a, "seg", arr.ctypes.data), text))
    for e in ([5, 8], [0, 3]):  # past its slot, before its slot's start
        arr = np.array(e, np.int64)
        cases.append((lambda a, arr=arr: setattr(a, "seg_end", arr.ctypes.data), "outside its slot"))
    cases += [
        (lambda a: setattr(a, "seg", a.seg + 4), "aligned"),
        (lambda a: setattr(a, "p", a.p + 2), "aligned"),
        (lambda a: setattr(a, "s1", a.s1 + 1), "aligned"),
        (lambda a: setattr(a, "steps", a.steps + 1), "aligned"),
        (lambda a: setattr(a, "seg_out", extra.ctypes.data + 4), "aligned"),
        (lambda a: setattr(a, "p", 2 ** 64 - 16), "wraps"),
        (lambda a: setattr(a, "g", 2 ** 64 - 8), "wraps"),
        (lambda a: setattr(a, "seg_mul", 2 ** 64 - 4), "wraps"),
    ]
    for mutate, text in cases:
        a, bufs, _seg, _steps = _full_args()
        bufs["g"][:] = 1.0
        mutate(a)
        with pytest.raises(ValueError, match=text):
            fn(a)
        assert not any(bufs[k].any() for k in ("p", "s0", "s1", "s2")), f"{kernel} wrote before rejecting"


# ---------------------------------------------------------------------------------------------------------------
# environment: APEX_SIMD / APEX_NUM_THREADS in a fresh interpreter, fork safety
# ---------------------------------------------------------------------------------------------------------------
def _python(code: str, **env) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.pop("APEX_SIMD", None)
    full_env.pop("APEX_NUM_THREADS", None)
    full_env.pop("APEX_THREAD_POOL", None)
    full_env.update(env)
    # the child finds this very apex_C first, whether it is installed or built in place
    full_env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(apex_C.__file__), full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("lvl", [*LEVELS, "auto"])
def test_apex_simd_env_forces_level(lvl):
    r = _python(
        """
        import numpy as np, apex_C
        x = np.arange(1000, dtype=np.float32)
        assert apex_C.sum_sq(x, 1) == float((x.astype(np.float64) ** 2).sum())
        print(apex_C.simd_level())
        """,
        APEX_SIMD=lvl,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (LEVELS[-1] if lvl == "auto" else lvl)


def test_apex_simd_env_rejects_unsupported_level():
    r = _python("import apex_C", APEX_SIMD="no-such-level")
    assert r.returncode != 0, "an unsupported APEX_SIMD must not be ignored silently"
    assert "no-such-level" in r.stderr and "not supported" in r.stderr, r.stderr


def test_thread_pool_setting():
    try:
        for bad in ("bogus", "OpenMP", ""):
            apex_C.set_thread_pool("threads")
            with pytest.raises(ValueError, match="unknown thread pool"):
                apex_C.set_thread_pool(bad)
            assert apex_C.thread_pool() == "threads", "a rejected pool changed the selection"
        apex_C.set_thread_pool("auto")
        assert apex_C.thread_pool() in ("openmp", "threads")
    finally:
        apex_C.set_thread_pool("auto")


def test_thread_pool_without_openmp_runtime():
    r = _python(
        """
        import apex_C
        print(apex_C.thread_pool())  # no torch: no OpenMP runtime loaded (numpy's BLAS brings none here)
        try:
            apex_C.set_thread_pool("openmp")
        except ValueError as e:
            print("refused:", e)
        print(apex_C.thread_pool())
        """
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    if lines[0] == "openmp":
        pytest.skip("something in this interpreter's startup loads an OpenMP runtime")
    assert lines[0] == "threads"
    assert lines[1].startswith("refused:") and "no OpenMP runtime" in lines[1], lines
    assert lines[2] == "threads"


def test_thread_pool_is_torchs_openmp_team_and_threads_after_fork():
    torch = pytest.importorskip("torch")
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("this torch's parallel backend is not OpenMP")
    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    r = _python(
        """
        import os, signal, warnings
        import numpy as np, torch, apex_C
        x = np.ones(1 << 20, np.float32)
        print(apex_C.thread_pool())
        torch.ones(1 << 22).mul_(2.0)  # torch's team exists and its workers spin
        assert apex_C.sum_sq(x, 2) == float(1 << 20)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            signal.alarm(30)  # a team that waits for the parent's pool threads would hang here
            ok = apex_C.thread_pool() == "threads" and apex_C.sum_sq(x, 2) == float(1 << 20)
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        print(apex_C.thread_pool(), apex_C.sum_sq(x, 2) == float(1 << 20))
        """,
        APEX_THREAD_POOL="",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["openmp", "child", "0", "openmp", "True"], r.stdout


@pytest.mark.parametrize("value, want", [("threads", "threads"), ("openmp", "openmp"), ("auto", "openmp"),
                                         ("bogus", "openmp")])
def test_apex_thread_pool_env(value, want):
    torch = pytest.importorskip("torch")
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("this torch's parallel backend is not OpenMP")
    r = _python("import torch, apex_C; print(apex_C.thread_pool())", APEX_THREAD_POOL=value)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == want


def test_apex_num_threads_env():
    r = _python("import apex_C; print(apex_C.get_num_threads())", APEX_NUM_THREADS="3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "3"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_after_threaded_call():
    n = 1 << 20
    x = np.resize(np.arange(1, 1000, dtype=np.float32), n)
    want = float(np.sum(x.astype(np.float64) ** 2))
    assert apex_C.sum_sq(x, 2) == pytest.approx(want, rel=SUM_RTOL)
    assert apex_C.scale_(x, x, 1.0, True, 2) is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+ warns about fork when threads exist
        pid = os.fork()
    if pid == 0:  # child: must never return into pytest
        code = 1
        try:
            signal.alarm(30)  # a deadlocked kernel fails the test instead of hanging it
            y = np.empty(n, np.float32)
            ok = apex_C.sum_sq(x, 2) == pytest.approx(want, rel=SUM_RTOL)
            ok = ok and apex_C.scale_(x, y, 2.0, True, 2) is False
            ok = ok and bool(np.array_equal(y, x * np.float32(2.0)))
            code = 0 if ok else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("forked child did not finish a threaded kernel within 60 s")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child failed, wait status {status}"
    # and the parent still works after the fork
    assert apex_C.sum_sq(x, 2) == pytest.approx(want, rel=SUM_RTOL)


def test_private_flush_denormal_setter_sets_and_clears_the_mode():
    """`apex_C._set_flush_denormal` sets the calling thread's mode as torch.set_flush_denormal does (an fp32 denormal
    through a multiply becomes a signed zero) and clears it again; where the CPU has no such mode it says False."""
    x = np.array([1e-40, -1e-40, 1.5], np.float32)
    out = np.zeros_like(x)
    if not apex_C._set_flush_denormal(True):
        assert apex_C._set_flush_denormal(False) is False
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        apex_C._raw_copy_(x.ctypes.data, F32, out.ctypes.data, F32, x.size, 1)
    finally:
        assert apex_C._set_flush_denormal(False) is True
    assert out.view(np.uint32).tolist() == [0, 0x80000000, np.float32(1.5).view(np.uint32)]
    apex_C._raw_copy_(x.ctypes.data, F32, out.ctypes.data, F32, x.size, 1)
    assert out.view(np.uint32).tolist() == x.view(np.uint32).tolist()
    with pytest.raises(TypeError):
        apex_C._set_flush_denormal("yes")
