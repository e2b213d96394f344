"""Torch-free tests of the apex_C kernel core (numpy + the extension, any Python 3.8+).

References are computed with numpy in float64/float32 from the documented semantics of each kernel:
arithmetic in fp32 (one rounding per operation, no fused multiply-add), stored to the destination dtype with
round-to-nearest-even. Under those rules every elementwise result is exactly determined, so elementwise checks
are bitwise (nan compared as "is nan"); reductions are compared with float64 references within a stated
relative tolerance, and bitwise across thread counts.

Every test that touches a kernel runs at every SIMD level ``apex_C.supported_simd_levels()`` reports.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

try:
    import apex_C
except ImportError as exc:  # a build that cannot load must fail loudly where the extension is required
    if os.environ.get("APEX_REQUIRE_EXT") == "1":
        raise
    pytest.skip(f"apex_C is not importable ({exc}); set APEX_REQUIRE_EXT=1 to make this an error",
                allow_module_level=True)

pytestmark = pytest.mark.kernels

F32, F16, BF16 = 0, 1, 2
DTYPES = {"f32": F32, "f16": F16, "bf16": BF16}
STORAGE = {F32: np.float32, F16: np.float16, BF16: np.uint16}
LEVELS = apex_C.supported_simd_levels()
SIZES = (0, 1, 7, 4097)


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
    apex_C.copy_(src.addr, F32, dst.addr, F16, x.size, 2)
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
    apex_C.copy_(src.addr, F32, dst.addr, BF16, x.size, 2)
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
    apex_C.copy_(src.addr, dt, dst.addr, F32, every.size, 2)
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
            apex_C.copy_(src.addr, sdt, dst.addr, ddt, n, 2)
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
                found = apex_C.scale_(src.addr, sdt, dst.addr, ddt, n, s, True, 2)
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
                found = apex_C.scale_(buf.addr, dt, buf.addr, dt, n, 1.0 / 3.0, check, 2)
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
            found = apex_C.axpy_(src.addr, sdt, dst.addr, ddt, n, 0.375, True, 2)
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
                apex_C.fill_(buf.addr, dt, n, value, 2)
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
            got = [apex_C.sum_sq(buf.addr, dt, n, t) for t in (1, 2, 3, 8)]
            assert len(set(got)) == 1, f"sum_sq depends on the thread count: {got}"
            assert got[0] == pytest.approx(want_sum, rel=SUM_RTOL, abs=0.0), f"sum_sq n={n} off={offset}"
            got_max = [apex_C.max_abs(buf.addr, dt, n, t) for t in (1, 2, 3, 8)]
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
        apex_C.segment_sum_sq(buf.addr, dt, seg.ctypes.data, len(lengths), out.ctypes.data, t)
        assert out[-1] == -1.0, "segment_sum_sq wrote past out[nseg-1]"
        results.append(out[:-1].copy())
    for r in results[1:]:
        assert bits(r.view(np.uint32)).tobytes() == bits(results[0].view(np.uint32)).tobytes(), \
            "segment_sum_sq depends on the thread count"
    np.testing.assert_allclose(results[0], want, rtol=SUM_RTOL, atol=0.0)
    out = np.full(1, -1.0)
    apex_C.segment_sum_sq(buf.addr, dt, 0, 0, 0, 2)  # nseg=0: nothing to do, no pointer needed
    apex_C.segment_sum_sq(buf.addr, dt, seg.ctypes.data, 0, out.ctypes.data, 2)
    assert out[0] == -1.0


# ---------------------------------------------------------------------------------------------------------------
# non-finite detection at every position that matters
# ---------------------------------------------------------------------------------------------------------------
def bad_value(kind: str, dt: int):
    v = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan}[kind]
    return from_f32(np.array([v], np.float32), dt)[0]


def probe_positions(n: int) -> list:
    """First, middle and last element, and windows of 70 (> one unrolled 512-bit fp16 vector: 64) at the start
    (the alignment peel), around the middle (where 2 threads split the range: the first thread's SIMD tail)
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
            assert apex_C.has_nonfinite(src.addr, dt, n, threads) is False
            for kind in ("inf", "-inf", "nan"):
                for i in probe_positions(n):
                    src.view[i] = bad_value(kind, dt)
                    where = f"{kind} at {i} of {n} (offset {offset}, {threads} threads)"
                    assert apex_C.has_nonfinite(src.addr, dt, n, threads) is True, f"has_nonfinite missed {where}"
                    assert apex_C.scale_(src.addr, dt, dst.addr, dt, n, 0.5, True, threads) is True, \
                        f"scale_ missed {where}"
                    assert apex_C.scale_(src.addr, dt, dst.addr, dt, n, 0.5, False, threads) is False, \
                        f"scale_ with check=False reported {where}"
                    assert apex_C.axpy_(src.addr, dt, acc.addr, dt, n, 0.5, True, threads) is True, \
                        f"axpy_ missed {where}"
                    src.view[i] = x[i]
            # in place, and the reductions, at first / middle / last only (each call rewrites or rescans all)
            for kind in ("inf", "-inf", "nan"):
                for i in sorted({0, n // 2, n - 1}):
                    work = Buf(x, dt, offset)
                    work.view[i] = bad_value(kind, dt)
                    m = apex_C.max_abs(work.addr, dt, n, threads)
                    assert (np.isnan(m) if kind == "nan" else m == np.inf), f"max_abs with {kind} at {i}: {m}"
                    ss = apex_C.sum_sq(work.addr, dt, n, threads)
                    assert (np.isnan(ss) if kind == "nan" else ss == np.inf), f"sum_sq with {kind} at {i}: {ss}"
                    assert apex_C.scale_(work.addr, dt, work.addr, dt, n, 0.5, True, threads) is True
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
    assert apex_C.has_nonfinite(buf.addr, dt, x.size, 2) is False
    assert apex_C.scale_(buf.addr, dt, buf.addr, dt, x.size, 1.0, True, 2) is False
    assert_same(buf.view, x, dt, "scale by 1 keeps extremes")


# ---------------------------------------------------------------------------------------------------------------
# thread-count independence (elementwise: bitwise; flags identical)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(DTYPES))
def test_results_identical_for_1_and_2_threads(level, rng, name):
    dt = DTYPES[name]
    n = (1 << 17) + 13  # large enough that 2 threads really split the range
    x, y = random_values(rng, n, dt), random_values(rng, n, dt)
    outs = []
    for threads in (1, 2):
        src = Buf(x, dt, 1)
        scaled = Buf(np.zeros(n, STORAGE[dt]), dt, 0)
        acc = Buf(y, dt, 1)
        conv = Buf(np.zeros(n, np.float32), F32, 0)
        filled = Buf(np.zeros(n, STORAGE[dt]), dt, 1)
        flags = (
            apex_C.scale_(src.addr, dt, scaled.addr, dt, n, 1.0 / 3.0, True, threads),
            apex_C.axpy_(src.addr, dt, acc.addr, dt, n, -0.7, True, threads),
            apex_C.has_nonfinite(src.addr, dt, n, threads),
        )
        apex_C.copy_(src.addr, dt, conv.addr, F32, n, threads)
        apex_C.fill_(filled.addr, dt, n, 0.3, threads)
        apex_C.scale_(src.addr, dt, src.addr, dt, n, 3.0, True, threads)
        outs.append((flags, [bits(b.view).tobytes() for b in (scaled, acc, conv, filled, src)]))
    assert outs[0][0] == outs[1][0]
    for k, name_ in enumerate(("scale_", "axpy_", "copy_", "fill_", "scale_ in place")):
        assert outs[0][1][k] == outs[1][1][k], f"{name_} differs between 1 and 2 threads"


# ---------------------------------------------------------------------------------------------------------------
# 50M elements (one allocation of 200 MB per buffer)
# ---------------------------------------------------------------------------------------------------------------
BIG = 50_000_000


def _big_case(dt: int) -> None:
    pattern = random_values(np.random.default_rng(50), 4099, dt)  # length coprime with every vector width
    x = np.resize(pattern, BIG)
    dst = np.empty(BIG, STORAGE[dt])
    assert apex_C.scale_(x.ctypes.data, dt, dst.ctypes.data, dt, BIG, 0.5, True, 0) is False
    want = from_f32(f32_mul(to_f32(pattern, dt), 0.5), dt)
    assert np.array_equal(bits(dst).reshape(-1)[: BIG - BIG % 4099].reshape(-1, 4099), np.broadcast_to(
        bits(want), (BIG // 4099, 4099))), "scale_ on 50M elements"
    assert np.array_equal(bits(dst[BIG - BIG % 4099:]), bits(want[: BIG % 4099]))
    p64 = to_f32(pattern, dt).astype(np.float64)
    reps, rest = divmod(BIG, 4099)
    want_sum = reps * math.fsum((p64 ** 2).tolist()) + math.fsum((p64[:rest] ** 2).tolist())
    assert apex_C.sum_sq(x.ctypes.data, dt, BIG, 0) == pytest.approx(want_sum, rel=1e-10)
    assert apex_C.max_abs(x.ctypes.data, dt, BIG, 0) == float(np.max(np.abs(p64)))
    for i in (0, BIG // 2, BIG - 1):
        keep = x[i]
        x[i] = bad_value("inf", dt)
        assert apex_C.has_nonfinite(x.ctypes.data, dt, BIG, 0) is True, f"inf at {i} of 50M"
        x[i] = keep
    assert apex_C.has_nonfinite(x.ctypes.data, dt, BIG, 0) is False


def test_50m_f32(level):
    t0 = time.perf_counter()
    _big_case(F32)
    assert time.perf_counter() - t0 < 10.0, "50M-element kernels far slower than memory speed"


@pytest.mark.full
@pytest.mark.parametrize("dt", [F16, BF16], ids=["f16", "bf16"])
def test_50m_16bit(level, dt):
    _big_case(dt)


# ---------------------------------------------------------------------------------------------------------------
# argument validation: ValueError, and nothing written
# ---------------------------------------------------------------------------------------------------------------
def _calls(addr_a: int, addr_b: int, n: int, dt: int):
    """Every buffer kernel, called with the given addresses / count / dtype."""
    return {
        "scale_": lambda: apex_C.scale_(addr_a, dt, addr_b, dt, n, 2.0, True, 2),
        "axpy_": lambda: apex_C.axpy_(addr_a, dt, addr_b, dt, n, 2.0, True, 2),
        "copy_": lambda: apex_C.copy_(addr_a, dt, addr_b, dt, n, 2),
        "fill_": lambda: apex_C.fill_(addr_b, dt, n, 2.0, 2),
        "has_nonfinite": lambda: apex_C.has_nonfinite(addr_a, dt, n, 2),
        "sum_sq": lambda: apex_C.sum_sq(addr_a, dt, n, 2),
        "max_abs": lambda: apex_C.max_abs(addr_a, dt, n, 2),
    }


def test_bad_arguments_raise_value_error(level):
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
    }
    for case, (x, y, n, dt, text) in cases.items():
        for fname, call in _calls(x, y, n, dt).items():
            with pytest.raises(ValueError, match=text):
                call()
            assert np.array_equal(src, np.arange(64, dtype=np.float32)), f"{fname} ({case}) wrote its source"
            assert not dst.any(), f"{fname} ({case}) wrote its destination"
    with pytest.raises(ValueError, match="same dtype"):
        apex_C.scale_(a, F32, a, F16, 8, 2.0, True, 2)
    assert np.array_equal(src, np.arange(64, dtype=np.float32))


def test_partially_overlapping_buffers_rejected(level):
    """Elementwise kernels are safe in place (src == dst) but not on shifted views of one buffer."""
    x = np.arange(100, dtype=np.float32)
    a = x.ctypes.data
    calls = {
        "scale_": lambda: apex_C.scale_(a, F32, a + 4, F32, 99, 2.0, True, 1),
        "axpy_": lambda: apex_C.axpy_(a + 4, F32, a, F32, 99, 2.0, True, 1),
        "copy_": lambda: apex_C.copy_(a, F32, a + 2, F16, 50, 1),
    }
    for fname, call in calls.items():
        with pytest.raises(ValueError, match="overlap"):
            call()
        assert np.array_equal(x, np.arange(100, dtype=np.float32)), f"{fname} wrote before rejecting"


def test_copy_in_place_with_dtype_change_rejected(level):
    x = np.arange(8, dtype=np.float32)
    with pytest.raises(ValueError, match="same dtype"):
        apex_C.copy_(x.ctypes.data, F32, x.ctypes.data, F16, 8, 1)


def test_empty_buffers_accept_null(level):
    for fname, call in _calls(0, 0, 0, F32).items():
        result = call()
        assert result in (None, False, 0.0), f"{fname} on an empty buffer returned {result!r}"


def test_segment_sum_sq_bad_arguments():
    x = np.ones(32, np.float32)
    out = np.zeros(4)
    good = np.array([0, 8, 16, 32], np.int64)
    with pytest.raises(ValueError, match="nseg"):
        apex_C.segment_sum_sq(x.ctypes.data, F32, good.ctypes.data, -1, out.ctypes.data, 1)
    with pytest.raises(ValueError, match="required"):
        apex_C.segment_sum_sq(x.ctypes.data, F32, 0, 3, out.ctypes.data, 1)
    with pytest.raises(ValueError, match="required"):
        apex_C.segment_sum_sq(x.ctypes.data, F32, good.ctypes.data, 3, 0, 1)
    for bad in ([0, 16, 8, 32], [-4, 8, 16, 32]):
        seg = np.array(bad, np.int64)
        with pytest.raises(ValueError, match="non-decreasing"):
            apex_C.segment_sum_sq(x.ctypes.data, F32, seg.ctypes.data, 3, out.ctypes.data, 1)
    with pytest.raises(ValueError, match="dtype code"):
        apex_C.segment_sum_sq(x.ctypes.data, 7, good.ctypes.data, 3, out.ctypes.data, 1)
    assert not out.any(), "a rejected call wrote its output"


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


def test_thread_count_setting():
    before = apex_C.get_num_threads()
    try:
        apex_C.set_num_threads(3)
        assert apex_C.get_num_threads() == 3
        apex_C.set_num_threads(0)  # back to the environment / hardware default
        assert apex_C.get_num_threads() >= 1
    finally:
        apex_C.set_num_threads(before)


# ---------------------------------------------------------------------------------------------------------------
# optimizer kernels: argument validation (their math is tested through apex.optimizers)
# ---------------------------------------------------------------------------------------------------------------
# every optimizer kernel the module binds (they share one argument check), found by name
OPT_KERNELS = sorted(n for n in dir(apex_C) if n.endswith("_step") or "_stage" in n or n == "row_dots")
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
    for kernel, missing in [("adam_step", "steps"), ("adamp_stage_a", "steps"), ("adamp_stage_b", "steps"),
                            ("adagrad_step", "steps"), ("lamb_stage1", "seg_out"), ("row_dots", "seg_out"),
                            ("adamp_stage_a", "seg_out")]
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


# ---------------------------------------------------------------------------------------------------------------
# environment: APEX_SIMD / APEX_NUM_THREADS in a fresh interpreter, fork safety
# ---------------------------------------------------------------------------------------------------------------
def _python(code: str, **env) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.pop("APEX_SIMD", None)
    full_env.pop("APEX_NUM_THREADS", None)
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
        assert apex_C.sum_sq(x.ctypes.data, 0, x.size, 1) == float((x.astype(np.float64) ** 2).sum())
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


def test_apex_num_threads_env():
    r = _python("import apex_C; print(apex_C.get_num_threads())", APEX_NUM_THREADS="3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "3"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_after_threaded_call():
    n = 1 << 20
    x = np.resize(np.arange(1, 1000, dtype=np.float32), n)
    want = float(np.sum(x.astype(np.float64) ** 2))
    assert apex_C.sum_sq(x.ctypes.data, F32, n, 2) == pytest.approx(want, rel=SUM_RTOL)
    assert apex_C.scale_(x.ctypes.data, F32, x.ctypes.data, F32, n, 1.0, True, 2) is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+ warns about fork when threads exist
        pid = os.fork()
    if pid == 0:  # child: must never return into pytest
        code = 1
        try:
            signal.alarm(30)  # a deadlocked kernel fails the test instead of hanging it
            y = np.empty(n, np.float32)
            ok = apex_C.sum_sq(x.ctypes.data, F32, n, 2) == pytest.approx(want, rel=SUM_RTOL)
            ok = ok and apex_C.scale_(x.ctypes.data, F32, y.ctypes.data, F32, n, 2.0, True, 2) is False
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
    assert apex_C.sum_sq(x.ctypes.data, F32, n, 2) == pytest.approx(want, rel=SUM_RTOL)
