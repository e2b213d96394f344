"""fp16 / bf16 storage conversions of the apex_C kernels: exact bits at every SIMD level (torch-free, numpy only).

The contract (csrc/combine_tensors/common.h): loads are exact (every 16-bit pattern; an fp16 signalling nan is
quieted, its payload kept), stores round to nearest even with subnormal results kept, overflow to inf, and a nan
keeps its sign and the top bits of its payload with the quiet bit set (fp16: 10 bits, bf16: 7), as x86 F16C and
torch's CPU casts give them. Levels may use hardware conversions (F16C, AArch64 FCVTL / FCVTN under clang builds)
only where they give these bits, so every level is compared with references written from the definition and with
the baseline level.

Proof for float32 -> 16 bit without all 2^32 inputs (fast tier): every upper 16-bit pattern (sign, exponent, top
7 mantissa bits) is combined with every low 16-bit value that sits on or next to a rounding boundary
(k * 0x1000 - 1, k * 0x1000, k * 0x1000 + 1): fp16 rounds at bit 13 for normal results and at bits >= 14 for
subnormal ones, bf16 at bit 16, and below the rounding bit only "zero / nonzero" matters (sticky). The full tier
runs all 2^32 inputs.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
from _apex_c_env import BF16, F16, F32, LEVELS, STORAGE, apex_C

pytestmark = pytest.mark.kernels

SUPPORTED = LEVELS
# Every level a build for this architecture contains; the ones this CPU lacks are skipped with a reason.
KNOWN_LEVELS = {"x86_64": ["baseline", "avx2", "avx512"], "aarch64": ["baseline", "neon"]}
ARCH = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
LEVELS = KNOWN_LEVELS.get(ARCH, SUPPORTED)
QUIET32 = np.uint32(0x00400000)


@pytest.fixture(params=LEVELS)
def level(request):
    """Runs the test at one SIMD level (skipped where this CPU lacks it), restoring the previous level."""
    if request.param not in SUPPORTED:
        pytest.skip(f"this CPU does not support SIMD level {request.param!r} (supported: {SUPPORTED})")
    previous = apex_C.simd_level()
    apex_C.set_simd_level(request.param)
    yield request.param
    apex_C.set_simd_level(previous)


def test_known_levels_cover_the_supported_ones():
    assert set(SUPPORTED) <= set(LEVELS), f"a supported level has no conversion tests: {SUPPORTED} vs {LEVELS}"
    assert SUPPORTED[0] == "baseline"


# ---------------------------------------------------------------------------------------------------------------
# references, written from the definitions (numpy's float16 cast is used only for non-nan values: it rounds to
# nearest even with subnormals, which is the IEEE conversion)
# ---------------------------------------------------------------------------------------------------------------
def f16_bits_to_f32_bits(h: np.ndarray) -> np.ndarray:
    """Exact widening; a nan's payload moved up unchanged and the quiet bit set."""
    h = h.astype(np.uint16)
    out = h.view(np.float16).astype(np.float32).view(np.uint32).copy()
    em = (h & 0x7FFF).astype(np.uint32)
    nan = em > 0x7C00
    sign = (h.astype(np.uint32) & 0x8000) << 16
    out[nan] = sign[nan] | np.uint32(0x7F800000) | (em[nan] << 13) | QUIET32
    return out


def bf16_bits_to_f32_bits(h: np.ndarray) -> np.ndarray:
    out = h.astype(np.uint32) << 16
    nan = (out & 0x7FFFFFFF) > 0x7F800000
    out[nan] |= QUIET32
    return out


def f32_bits_to_f16_bits(u: np.ndarray) -> np.ndarray:
    u = u.astype(np.uint32)
    with np.errstate(over="ignore", invalid="ignore"):
        out = u.view(np.float32).astype(np.float16).view(np.uint16).copy()
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    out[nan] = (((u[nan] >> 16) & 0x8000) | ((u[nan] >> 13) & 0x3FF) | 0x7E00).astype(np.uint16)
    return out


def f32_bits_to_bf16_bits(u: np.ndarray) -> np.ndarray:
    u = u.astype(np.uint64)
    kept, dropped = u >> 16, u & 0xFFFF
    up = (dropped > 0x8000) | ((dropped == 0x8000) & ((kept & 1) == 1))
    out = (kept + up).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    out[nan] = kept[nan].astype(np.uint16) | np.uint16(0x0040)
    return out


def boundary_inputs() -> np.ndarray:
    """Every upper half x the low halves on and next to each rounding boundary (see the module docstring)."""
    low = sorted({v & 0xFFFF for k in range(17) for v in (k * 0x1000 - 1, k * 0x1000, k * 0x1000 + 1)})
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    return (high[:, None] | np.array(low, dtype=np.uint32)[None, :]).ravel()


def convert(src_bits: np.ndarray, sdt: int, ddt: int, threads: int = 2) -> np.ndarray:
    src = np.ascontiguousarray(src_bits).view(STORAGE[sdt])
    dst = np.zeros(src.size, STORAGE[ddt])
    apex_C._raw_copy_(src.ctypes.data, sdt, dst.ctypes.data, ddt, src.size, threads)
    return dst.view(np.uint32 if ddt == F32 else np.uint16)


def assert_bits(got: np.ndarray, want: np.ndarray, inputs: np.ndarray, what: str) -> None:
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = int(bad[0])
        raise AssertionError(f"{what}: {bad.size} of {got.size} differ; first input {int(inputs[i]):#x} -> "
                             f"{int(got[i]):#x}, expected {int(want[i]):#x}")


# ---------------------------------------------------------------------------------------------------------------
# exhaustive / boundary conversions at every level
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", [F16, BF16], ids=["f16", "bf16"])
def test_every_16bit_pattern_widens_exactly(level, dt):
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = f16_bits_to_f32_bits(every) if dt == F16 else bf16_bits_to_f32_bits(every)
    assert_bits(convert(every, dt, F32), want, every, f"{level}: 16-bit -> f32")


@pytest.mark.parametrize("dt", [F16, BF16], ids=["f16", "bf16"])
def test_narrowing_at_every_rounding_boundary(level, dt):
    x = boundary_inputs()
    want = f32_bits_to_f16_bits(x) if dt == F16 else f32_bits_to_bf16_bits(x)
    assert_bits(convert(x, F32, dt), want, x, f"{level}: f32 -> 16-bit")


def test_reference_helpers_on_hand_checked_cases():
    f16 = {0x3F801000: 0x3C00, 0x3F803000: 0x3C02, 0x3F801001: 0x3C01, 0x477FF000: 0x7C00, 0x477FEFFF: 0x7BFF,
           0x33000000: 0x0000, 0x33000001: 0x0001, 0x33800000: 0x0001, 0x33C00000: 0x0002, 0x387FC000: 0x03FF,
           0x387FDFFF: 0x03FF, 0x387FE000: 0x0400, 0x00000001: 0x0000,
           0xFFC00001: 0xFE00, 0x7F800001: 0x7E00, 0xFF800000: 0xFC00, 0x7F802000: 0x7E01, 0xFFBFE000: 0xFFFF,
           0x7FC01FFF: 0x7E00}
    x = np.array(list(f16), np.uint32)
    assert f32_bits_to_f16_bits(x).tolist() == list(f16.values())
    bf = {0x3F808000: 0x3F80, 0x3F818000: 0x3F82, 0x7F7F8000: 0x7F80, 0x007FFFFF: 0x0080, 0x7F800001: 0x7FC0,
          0xFF810000: 0xFFC1}
    x = np.array(list(bf), np.uint32)
    assert f32_bits_to_bf16_bits(x).tolist() == list(bf.values())
    assert f16_bits_to_f32_bits(np.array([0x7C01, 0x0001, 0xFC00], np.uint16)).tolist() == \
        [0x7FC02000, 0x33800000, 0xFF800000]


@pytest.mark.full
@pytest.mark.parametrize("dt", [F16, BF16], ids=["f16", "bf16"])
def test_every_float32_narrows_exactly(level, dt):
    step = 1 << 22
    ref = f32_bits_to_f16_bits if dt == F16 else f32_bits_to_bf16_bits
    for start in range(0, 1 << 32, step):
        x = np.arange(start, start + step, dtype=np.uint64).astype(np.uint32)
        assert_bits(convert(x, F32, dt), ref(x), x, f"{level}: f32 -> 16-bit")


# ---------------------------------------------------------------------------------------------------------------
# kernels at every level give the baseline's bits (scale_, copy_, axpy_, optimizer steps in fp16/bf16)
# ---------------------------------------------------------------------------------------------------------------
def special_f32(rng, n: int) -> np.ndarray:
    """Values across the whole range, with subnormal-range (fp16 and f32), overflow-range, inf and nan entries."""
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-9, 6, n)).astype(np.float32)
    picks = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 6.0e-8, 2.0 ** -24, 2.0 ** -25,
                      1.0e-40, -1.0e-42, 3.4e38, 1.1754944e-38], np.float32)
    idx = rng.choice(n, size=min(n, 4 * picks.size), replace=False)
    x[idx] = np.resize(picks, idx.size)
    return x


def run_at(lvl: str, fn):
    previous = apex_C.simd_level()
    apex_C.set_simd_level(lvl)
    try:
        return fn()
    finally:
        apex_C.set_simd_level(previous)


def as_storage(x32: np.ndarray, dt: int) -> np.ndarray:
    if dt == F32:
        return x32.copy()
    return convert(x32.view(np.uint32), F32, dt).view(STORAGE[dt]).copy()


N_ODD = 4099  # not a multiple of any vector width: exercises the remainder loops


@pytest.mark.parametrize("sdt", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("ddt", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_scale_copy_axpy_match_baseline(level, sdt, ddt):
    rng = np.random.default_rng(11)
    src = as_storage(special_f32(rng, N_ODD), sdt)
    acc0 = as_storage(special_f32(rng, N_ODD), ddt)

    def run():
        out = []
        for s in (1.0, 0.3, 1.0 / 65536.0, 3.0e4):
            dst = np.zeros(N_ODD, STORAGE[ddt])
            found = apex_C._raw_scale_(src.ctypes.data, sdt, dst.ctypes.data, ddt, N_ODD, s, True, 2)
            out += [dst.copy(), found]
            acc = acc0.copy()
            found = apex_C._raw_axpy_(src.ctypes.data, sdt, acc.ctypes.data, ddt, N_ODD, s, True, 2)
            out += [acc, found]
        dst = np.zeros(N_ODD, STORAGE[ddt])
        apex_C._raw_copy_(src.ctypes.data, sdt, dst.ctypes.data, ddt, N_ODD, 2)
        out.append(dst)
        if sdt == ddt:
            inplace = src.copy()
            apex_C._raw_scale_(inplace.ctypes.data, sdt, inplace.ctypes.data, sdt, N_ODD, 0.7, False, 2)
            out.append(inplace)
        return out

    got, want = run(), run_at("baseline", run)
    for i, (a, b) in enumerate(zip(got, want)):
        if isinstance(a, np.ndarray):
            assert a.tobytes() == b.tobytes(), f"{level} result {i} differs from baseline"
        else:
            assert a == b


def assert_bits_but_nans(x: np.ndarray, y: np.ndarray, what: str) -> None:
    """Float arrays x and y hold nans at the same places and every other value bit for bit. Which nan (sign,
    payload) an operation on two nans returns depends on its operand order, which compilers may swap (a + b == b + a
    for every other value), so a nan result's bits are not compared."""
    assert (np.isnan(x) == np.isnan(y)).all(), f"{what}: nans where the baseline has none, or none where it has"
    keep = ~np.isnan(x)
    assert x[keep].tobytes() == y[keep].tobytes(), f"{what} differs from baseline"


def _optimizer_case(kernel: str, dt: int, flags: int, hp, rng, subnormal_states: bool = False, nout: int = 0) -> list:
    """Runs three steps of one optimizer kernel over two segments; returns every buffer's bytes (and the
    kernel's per-segment outputs, nout per segment, for the reducing kernels).

    subnormal_states (bf16): the states start as positive bf16 subnormals (raw bits 0x0001..0x007f) and every
    third grad is zero."""
    n = N_ODD
    seg = np.array([0, 1000, n], np.int64)
    p = as_storage(np.clip(special_f32(rng, n), -6.0e4, 6.0e4), dt)
    if subnormal_states:
        assert dt == BF16, "subnormal_states builds raw bf16 bits"
        states = [rng.integers(1, 0x80, n).astype(np.uint16) for _ in range(3)]
    else:
        states = [as_storage(np.abs(rng.standard_normal(n).astype(np.float32)) * 1e-3, dt) for _ in range(3)]
    grads = [as_storage((rng.standard_normal(n) * 10.0 ** rng.uniform(-8, 1, n)).astype(np.float32), dt)
             for _ in range(3)]
    grads[1][17] = as_storage(np.array([np.nan], np.float32), dt)[0]
    grads[2][5] = as_storage(np.array([np.inf], np.float32), dt)[0]
    if subnormal_states:
        for g in grads:
            g[::3] = 0  # zero grads leave exp_avg_sq at (flushed) zero, so the max keeps the subnormal state

    def run():
        pp, ss, outs = p.copy(), [s.copy() for s in states], []
        for t, g in enumerate(grads, start=1):
            a = apex_C.OptArgs()
            a.pdt = a.gdt = a.sdt = dt
            a.p, a.g, a.seg, a.nseg = pp.ctypes.data, g.ctypes.data, seg.ctypes.data, 2
            a.s0, a.s1, a.s2 = (s.ctypes.data for s in ss)
            steps = np.full(2, float(t), np.float32)
            first = np.array([t == 1, 0], np.uint8)
            a.steps, a.first, a.flags, a.hp, a.threads = steps.ctypes.data, first.ctypes.data, flags, list(hp), 2
            out = np.zeros(2 * nout, np.float64)
            if nout:
                a.seg_out = out.ctypes.data
            getattr(apex_C, kernel)(a)
            outs.append(out.tobytes())
        return [pp.tobytes()] + [s.tobytes() for s in ss] + outs

    return [run(), run_at("baseline", run)]


OPT_CASES = {
    "adam": ("_raw_adam_step", 0, [1e-3, 0.9, 0.999, 1e-8, 0.01]),
    "adam-no-decay": ("_raw_adam_step", 0, [1e-3, 0.9, 0.999, 1e-8, 0.0]),
    "adamw": ("_raw_adam_step", apex_C.FLAG_DECOUPLED, [1e-3, 0.9, 0.999, 1e-8, 0.01]),
    "adam-amsgrad": ("_raw_adam_step", apex_C.FLAG_AMSGRAD, [1e-3, 0.9, 0.999, 1e-8, 0.0]),
    "sgd": ("_raw_sgd_step", 0, [0.1, 0.0, 0.0, 0.0]),
    "sgd-momentum": ("_raw_sgd_step", 0, [0.1, 0.9, 0.1, 1e-4]),
    "sgd-nesterov": ("_raw_sgd_step", apex_C.FLAG_NESTEROV, [0.1, 0.9, 0.0, 1e-4]),
    "sgd-decay-after": ("_raw_sgd_step", apex_C.FLAG_DECOUPLED, [0.1, 0.9, 0.1, 1e-4]),
    "sgd-decay-after-nesterov": ("_raw_sgd_step", apex_C.FLAG_DECOUPLED | apex_C.FLAG_NESTEROV, [0.1, 0.9, 0.0, 0.0]),
}


@pytest.mark.parametrize("dt", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("case", list(OPT_CASES))
def test_low_precision_optimizer_steps_match_baseline(level, dt, case):
    kernel, flags, hp = OPT_CASES[case]
    got, want = _optimizer_case(kernel, dt, flags, hp, np.random.default_rng(5))
    for name, a, b in zip(("param", "s0", "s1", "s2"), got, want):
        assert a == b, f"{level} {case} {name} differs from baseline"


# bf16 Adam at the avx2 level runs whole 16-element blocks outside the element loop and hands a block whose stores
# include a nan (and any tail) to the element loop: nans and infinities at block edges, in tails, in params and in
# states (a signalling nan's payload, a negative second moment), slots cut at odd offsets, flat and gathered grads.
# The same placements with float32 moments (FLAG_F32_STATES, NVIDIA FusedAdam's layout) check the element loop there.
# A nan computed from bf16 values has a zero low half, which the rounding add cannot carry out of, so the nan rule
# is only visible with a nan whose low half is set: one slot's grad multiplier is such a nan (f32 0x7fc1c000:
# rounded without the rule it would read 0x7fc2).
BF16_NAN = np.uint16(0x7FC0)


def _bf16(x: np.ndarray) -> np.ndarray:
    return as_storage(np.asarray(x, np.float32), BF16)


# the slots of the nan-anywhere tests: 64-element chunks, 16-element blocks, odd cuts, a one-element slot
NAN_TEST_SLOTS = np.array([0, 197, 350, 351, 1000, 1290], np.int64)


def _grads_with_nans(rng, n: int) -> list:
    """Three steps of bf16 grads over NAN_TEST_SLOTS with nans and infinities at block edges and in tails; none in
    slot 1, whose multiplier is a nan (which of two nan payloads a product keeps is not defined)."""
    grads = []
    for t in range(3):
        g = _bf16(rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 1, n))
        g[[0, 15, 16, 63, 64, 196, 350, 351, 366, 415, 999, 1000, 1288][t::3]] = BF16_NAN
        g[[5, 31, 260, 1100][t::2]] = _bf16([np.inf if t % 2 else -np.inf])
        grads.append(g)
    return grads


def _slot1_nan(values) -> np.ndarray:
    """Per-slot float32 multipliers with slot 1's the nan 0x7fc1c000: its low half is set, so only the nan rule
    stores it as 0x7fc1 (rounded without the rule it would read 0x7fc2)."""
    x = np.array(values, np.float32)
    x.view(np.uint32)[1] = 0x7FC1C000
    return x


@pytest.mark.parametrize("states", ["bf16", "f32"])  # f32: FLAG_F32_STATES, NVIDIA FusedAdam's layout
@pytest.mark.parametrize("gather", [False, True], ids=["flat", "gather"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("flags,wd", [(0, 0.0), (0, 0.01), (apex_C.FLAG_DECOUPLED, 0.01)],
                         ids=["none", "l2", "decoupled"])
def test_bf16_adam_blocks_match_baseline_with_nans_anywhere(level, flags, wd, threads, gather, states):
    rng = np.random.default_rng(17)
    seg = NAN_TEST_SLOTS
    n = int(seg[-1])
    p = _bf16(rng.standard_normal(n))
    m = _bf16(rng.standard_normal(n) * 1e-2)
    v = _bf16(np.abs(rng.standard_normal(n)) * 1e-3)
    p[[40, 420]] = BF16_NAN
    p[[77]] = _bf16([np.inf])
    m[[130]] = np.uint16(0x7F81)  # signalling nan, payload 1
    v[[600, 1289]] = _bf16([-1.0, -2.0])  # sqrt of a negative moment: a nan param
    if states == "f32":  # the same values, widened exactly
        m, v = [(x.astype(np.uint32) << np.uint32(16)).view(np.float32) for x in (m, v)]
        flags |= apex_C.FLAG_F32_STATES
    grads = _grads_with_nans(rng, n)
    gmul = _slot1_nan([1.0, 0.0, 1.0, 0.5, 1.0])

    def run():
        pp, mm, vv = p.copy(), m.copy(), v.copy()
        s2 = np.zeros(n, m.dtype)
        for t, g in enumerate(grads, start=1):
            a = apex_C.OptArgs()
            a.pdt = a.gdt = BF16
            a.sdt = F32 if states == "f32" else BF16
            a.p, a.seg, a.nseg = pp.ctypes.data, seg.ctypes.data, len(seg) - 1
            own = [g[seg[k]:seg[k + 1]].copy() for k in range(len(seg) - 1)]
            table = np.array([x.ctypes.data for x in own], np.uint64)
            if gather:
                a.gtab = table.ctypes.data
            a.g = g.ctypes.data  # the flat grads (read unless the table is set)
            a.s0, a.s1, a.s2 = mm.ctypes.data, vv.ctypes.data, s2.ctypes.data
            steps = np.full(len(seg) - 1, float(t), np.float32)
            a.steps, a.flags, a.hp, a.threads = steps.ctypes.data, flags, [1e-3, 0.9, 0.999, 1e-8, wd], threads
            a.seg_gmul = gmul.ctypes.data
            apex_C._raw_adam_step(a)
        return [pp.tobytes(), mm.tobytes(), vv.tobytes()]

    got, want = run(), run_at("baseline", run)
    assert got[0] == want[0], f"{level} bf16 Adam param differs from baseline"
    for name, x, y in zip(("exp_avg", "exp_avg_sq"), got[1:], want[1:]):
        if states == "f32":
            # float32 moments keep a sum's whole nan payload, and which of two nan operands' payload a sum keeps is
            # not defined (slot 1's nan multiplier meets its own nan params under L2): nans where the baseline
            # has them, every other value bit for bit
            assert_bits_but_nans(np.frombuffer(x, np.float32), np.frombuffer(y, np.float32),
                                 f"{level} bf16 Adam {name}")
        else:
            assert x == y, f"{level} bf16 Adam {name} differs from baseline"
    params = np.frombuffer(got[0], np.uint16)
    assert ((params & 0x7F80) == 0x7F80).sum() > 20, "the case must put nans/infs in many blocks"
    assert (params[197:350] == 0x7FC1).all(), "slot 1's params take its multiplier's nan, by the nan rule"


# bf16 SGD, Adadelta, RMSprop, BertAdam, Adagrad and LAMB at the avx2 level run the same 16-element blocks as Adam:
# the same nan and infinity placements, with nans in the states too (a signalling nan, a negative square average
# whose square root is a nan), for every loop variant of each kernel: momentum or not, Nesterov, decay before or
# after the momentum (SGD), weight decay on and off, centered, the momentum forms of RMSprop and its TensorFlow
# form, Adagrad's two decay forms, LAMB's stages alone and together.
BLOCK_CASES = {
    "sgd": ("_raw_sgd_step", 0, [0.1, 0.0, 0.0, 0.0]),
    "sgd-momentum-l2": ("_raw_sgd_step", 0, [0.1, 0.9, 0.1, 1e-4]),
    "sgd-nesterov": ("_raw_sgd_step", apex_C.FLAG_NESTEROV, [0.1, 0.9, 0.0, 1e-4]),
    "sgd-decay-after": ("_raw_sgd_step", apex_C.FLAG_DECOUPLED, [0.1, 0.9, 0.1, 1e-4]),
    "sgd-scaled-after-nesterov": ("_raw_sgd_step", apex_C.FLAG_DECOUPLED | apex_C.FLAG_NESTEROV, [0.1, 0.9, 0.0, 0.0]),
    "adadelta": ("_raw_adadelta_step", 0, [1.0, 0.9, 1e-6, 0.01]),
    "adadelta-no-decay": ("_raw_adadelta_step", 0, [1.0, 0.9, 1e-6, 0.0]),
    "rmsprop": ("_raw_rmsprop_step", 0, [1e-2, 0.99, 1e-8, 0.0, 0.0]),
    "rmsprop-l2-momentum": ("_raw_rmsprop_step", 0, [1e-2, 0.99, 1e-8, 0.01, 0.9]),
    "rmsprop-centered": ("_raw_rmsprop_step", apex_C.FLAG_CENTERED, [1e-2, 0.99, 1e-8, 0.0, 0.0]),
    "rmsprop-centered-momentum": ("_raw_rmsprop_step", apex_C.FLAG_CENTERED, [1e-2, 0.99, 1e-8, 0.01, 0.9]),
    "rmsprop-tf-decoupled-lr-in-momentum": ("_raw_rmsprop_tf_step", apex_C.FLAG_LR_IN_MOMENTUM | apex_C.FLAG_DECOUPLED,
                                            [1e-2, 0.9, 1e-10, 0.01, 0.9]),
    "rmsprop-tf-centered-l2": ("_raw_rmsprop_tf_step", apex_C.FLAG_CENTERED, [1e-2, 0.9, 1e-10, 0.01, 0.0]),
    "bert-adam": ("_raw_bert_adam_step", 0, [1e-3, 0.9, 0.999, 1e-6, 0.01]),
    "bert-adam-no-decay": ("_raw_bert_adam_step", 0, [1e-3, 0.9, 0.999, 1e-6, 0.0]),
    "adagrad-l2": ("_raw_adagrad_step", 0, [1e-2, 1e-10, 0.01, 0.1]),
    "adagrad-decoupled": ("_raw_adagrad_step", apex_C.FLAG_DECOUPLED, [1e-2, 1e-10, 0.01, 0.0]),
    # LAMB: stage 1 (moments, and the per-slot squares of p and u: nout 2), stage 2 (seg_mul: the trust ratios), and
    # both with the ratios between them
    "lamb-stage1": ("_raw_lamb_stage1", apex_C.FLAG_BIAS_CORRECTION | apex_C.FLAG_BETA3, [0.9, 0.999, 1e-6, 0.01, 0.1],
                    2),
    "lamb-stage1-nobc": ("_raw_lamb_stage1", 0, [0.9, 0.999, 1e-6, 0.0], 2),
    "lamb-stage2": ("_raw_lamb_stage2", apex_C.FLAG_BIAS_CORRECTION, [1e-2, 1e-6, 0.01, 0.9, 0.999]),
    "lamb-step": ("_raw_lamb_step", apex_C.FLAG_BIAS_CORRECTION | apex_C.FLAG_BETA3 | apex_C.FLAG_TRUST_RATIO,
                  [0.9, 0.999, 1e-6, 0.01, 0.1, 1e-2, 1e-6, 0.01, 0.9, 0.999], 2),
}


@pytest.mark.parametrize("gather", [False, True], ids=["flat", "gather"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_bf16_blocks_match_baseline_with_nans_anywhere(level, case, threads, gather):
    kernel, flags, hp, *nout = BLOCK_CASES[case]
    nout = nout[0] if nout else 0
    rng = np.random.default_rng(23)
    seg = NAN_TEST_SLOTS
    n, nseg = int(seg[-1]), len(seg) - 1
    p = _bf16(rng.standard_normal(n))
    states = [_bf16(np.abs(rng.standard_normal(n)) * 1e-3) for _ in range(3)]
    p[[40, 420]] = BF16_NAN
    p[[77]] = _bf16([np.inf])
    states[0][[600, 1289]] = _bf16([-1.0, -2.0])  # a negative square average (RMSprop, Adadelta: a nan param)
    states[1][[130]] = np.uint16(0x7F81)  # signalling nan, payload 1
    states[2][[903]] = _bf16([np.inf])
    for s in states[:2]:  # nans at block edges and in tails of every slot but slot 1 (see gmul)
        s[[16, 47, 64, 191, 196, 350, 367, 415, 640, 998, 1031, 1283]] = BF16_NAN
    grads = _grads_with_nans(rng, n)
    gmul = _slot1_nan([1.0, 0.0, 1.0, 0.5, 1.0])
    # SGD's multiplier after the momentum, LAMB's trust ratios (stage 2 reads no grad: slot 1's nan reaches it here)
    umul0 = _slot1_nan([1.0, 0.0, 2.0, 1.0, 0.25])

    def run():
        pp, ss, outs = p.copy(), [s.copy() for s in states], []
        for t, g in enumerate(grads, start=1):
            umul = umul0.copy()  # (an output of _raw_lamb_step)
            a = apex_C.OptArgs()
            a.pdt = a.gdt = a.sdt = BF16
            a.p, a.seg, a.nseg = pp.ctypes.data, seg.ctypes.data, nseg
            own = [g[seg[k]:seg[k + 1]].copy() for k in range(nseg)]
            table = np.array([x.ctypes.data for x in own], np.uint64)
            if gather:
                a.gtab = table.ctypes.data
            a.g = g.ctypes.data
            a.s0, a.s1, a.s2 = (s.ctypes.data for s in ss)
            steps = np.full(nseg, float(t), np.float32)
            first = np.full(nseg, t == 1, np.uint8)
            a.steps, a.first, a.flags, a.hp, a.threads = steps.ctypes.data, first.ctypes.data, flags, list(hp), threads
            a.seg_gmul, a.seg_mul = gmul.ctypes.data, umul.ctypes.data
            out = np.zeros(nseg * nout, np.float64)
            if nout:
                a.seg_out = out.ctypes.data
            getattr(apex_C, kernel)(a)
            outs.append(out)
        return [pp.tobytes()] + [s.tobytes() for s in ss], outs

    (got, got_out), (want, want_out) = run(), run_at("baseline", run)
    for name, x, y in zip(("param", "s0", "s1", "s2"), got, want):
        if kernel == "_raw_lamb_step" and name == "param":
            # a nan norm's sign is not defined (below), and its trust ratio carries it into the slot's params
            x, y = np.frombuffer(x, np.uint16), np.frombuffer(y, np.uint16)
            x, y = [np.where((b & 0x7FFF) > 0x7F80, 0x7FC0, b).tobytes() for b in (x, y)]
        assert x == y, f"{level} bf16 {case} {name} differs from baseline"
    # per-slot squares: a nan sum may carry either sign (test_lamb_stages_match_baseline says why)
    for t, (x, y) in enumerate(zip(got_out, want_out), start=1):
        assert_bits_but_nans(x, y, f"{level} {case} norms of step {t}")
    written = np.concatenate([np.frombuffer(b, np.uint16) for b in got[:3]])
    assert ((written & 0x7F80) == 0x7F80).sum() > 25, "the case must put nans/infs in many blocks"
    if kernel not in ("_raw_lamb_stage1", "_raw_lamb_step"):  # (stage 1 writes no param; the step's nan: above)
        params = np.frombuffer(got[0], np.uint16)
        assert (params[197:350] == 0x7FC1).all(), "slot 1's params take its multiplier's nan, by the nan rule"


# Every elementwise optimizer kernel, with options that take each loop variant.
ELEMENTWISE_CASES = {
    **OPT_CASES,
    "adam-f32-out": ("_raw_adam_step", apex_C.FLAG_DECOUPLED, [1e-3, 0.9, 0.999, 1e-8, 0.01]),
    "adadelta": ("_raw_adadelta_step", 0, [1.0, 0.9, 1e-6, 0.01]),
    "rmsprop-centered-momentum": ("_raw_rmsprop_step", apex_C.FLAG_CENTERED, [1e-2, 0.99, 1e-8, 0.01, 0.9]),
    "rmsprop-tf-lr-in-momentum": ("_raw_rmsprop_tf_step", apex_C.FLAG_LR_IN_MOMENTUM | apex_C.FLAG_DECOUPLED,
                                  [1e-2, 0.9, 1e-10, 0.01, 0.9]),
    "bert-adam": ("_raw_bert_adam_step", 0, [1e-3, 0.9, 0.999, 1e-6, 0.01]),
    "adagrad": ("_raw_adagrad_step", 0, [1e-2, 1e-10, 0.01, 0.1]),
    "lamb-stage2": ("_raw_lamb_stage2", apex_C.FLAG_BIAS_CORRECTION, [1e-3, 1e-6, 0.01, 0.9, 0.999]),
}


@pytest.mark.parametrize("dt", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("case", list(ELEMENTWISE_CASES))
def test_elementwise_kernels_ignore_how_slots_are_cut(level, dt, case):
    """The element loops run in prefetched chunks (optim_impl.h `streamed`): full chunks with a fixed trip count,
    then the rest. An element's bits must not depend on which of those paths computed it: one slot of n elements
    (full chunks and a tail) against the same elements as n one-element slots (tails only), two steps, every
    buffer compared bitwise. n spans several chunks and a thread split, odd so the tail is partial."""
    kernel, flags, hp = ELEMENTWISE_CASES[case]
    out_dt = F16 if dt == F32 and case == "adam-f32-out" else None
    rng = np.random.default_rng(11)
    n = 70001
    p = as_storage(np.clip(special_f32(rng, n), -6.0e4, 6.0e4), dt)
    states = [as_storage(np.abs(rng.standard_normal(n).astype(np.float32)) * 1e-3, dt) for _ in range(3)]
    grads = [as_storage((rng.standard_normal(n) * 10.0 ** rng.uniform(-8, 1, n)).astype(np.float32), dt)
             for _ in range(2)]

    def run(seg):
        nseg = len(seg) - 1
        pp, ss = p.copy(), [s.copy() for s in states]
        out = np.zeros(n, STORAGE[out_dt]) if out_dt is not None else None
        for t, g in enumerate(grads, start=1):
            a = apex_C.OptArgs()
            a.pdt = a.gdt = a.sdt = dt
            a.p, a.g, a.seg, a.nseg = pp.ctypes.data, g.ctypes.data, seg.ctypes.data, nseg
            a.s0, a.s1, a.s2 = (s.ctypes.data for s in ss)
            steps = np.full(nseg, float(t), np.float32)
            first = np.full(nseg, t == 1, np.uint8)
            seg_mul = np.full(nseg, 0.75, np.float32)
            a.steps, a.first, a.seg_mul = steps.ctypes.data, first.ctypes.data, seg_mul.ctypes.data
            a.flags, a.hp, a.threads = flags, list(hp), 2
            if out is not None:
                a.out, a.odt = out.ctypes.data, out_dt
            getattr(apex_C, kernel)(a)
        return [pp.tobytes()] + [s.tobytes() for s in ss] + ([out.tobytes()] if out is not None else [])

    whole = run(np.array([0, n], np.int64))
    pieces = run(np.arange(n + 1, dtype=np.int64))
    for name, a, b in zip(("param", "s0", "s1", "s2", "out"), whole, pieces):
        assert a == b, f"{level} {case}: {name} differs between one slot and one-element slots"


@pytest.mark.parametrize("case", ["adam", "adamw", "lamb-stage2", "adagrad"])
def test_slots_with_different_step_counts(level, case):
    """Per-slot scalars that depend on the step count (bias corrections, Adagrad's lr decay) are computed once for
    the first slot's count and reused for slots with the same count: every slot must still get its own count's
    values. One call over four slots with counts 3, 1, 3, 7 against each slot run alone."""
    kernel, flags, hp = ELEMENTWISE_CASES[case]
    rng = np.random.default_rng(12)
    sizes, counts = [300, 77, 130, 64], [3.0, 1.0, 3.0, 7.0]
    n = sum(sizes)
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    p = rng.standard_normal(n).astype(np.float32)
    states = [np.abs(rng.standard_normal(n).astype(np.float32)) * 1e-3 for _ in range(3)]
    g = (rng.standard_normal(n) * 1e-2).astype(np.float32)

    def run(lo, hi, steps):
        pp, ss = p[lo:hi].copy(), [s[lo:hi].copy() for s in states]
        seg = (bounds[(bounds >= lo) & (bounds <= hi)] - lo).astype(np.int64)
        nseg = len(seg) - 1
        gg = g[lo:hi].copy()
        a = apex_C.OptArgs()
        a.pdt = a.gdt = a.sdt = F32
        a.p, a.g, a.seg, a.nseg = pp.ctypes.data, gg.ctypes.data, seg.ctypes.data, nseg
        a.s0, a.s1, a.s2 = (s.ctypes.data for s in ss)
        st = np.array(steps, np.float32)
        first = np.zeros(nseg, np.uint8)
        seg_mul = np.full(nseg, 0.75, np.float32)
        a.steps, a.first, a.seg_mul = st.ctypes.data, first.ctypes.data, seg_mul.ctypes.data
        a.flags, a.hp, a.threads = flags, list(hp), 2
        getattr(apex_C, kernel)(a)
        return [pp, *ss]

    together = run(0, n, counts)
    for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        alone = run(int(lo), int(hi), [counts[k]])
        for name, a, b in zip(("param", "s0", "s1", "s2"), together, alone):
            assert a[lo:hi].tobytes() == b.tobytes(), f"{level} {case}: slot {k} {name} differs from the slot alone"


@pytest.mark.parametrize("wd", [0.0, 0.01])
@pytest.mark.parametrize("dt", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_sgd_decay_after_momentum_is_the_two_pass_form(level, dt, wd):
    """FLAG_DECOUPLED with seg_mul (NovoGrad's default update, one pass): m = b1*m + b3*g, p -= lr*(m*u_k + wd*p),
    bitwise the two SGD passes it replaces (the momentum with lr 0, then an SGD pass reading the stored m as its
    grad with seg_gmul = u_k and L2 decay), and bitwise the baseline level."""
    rng = np.random.default_rng(7)
    n = N_ODD
    seg = np.array([0, 1000, n], np.int64)
    p0 = as_storage(rng.standard_normal(n).astype(np.float32), dt)
    m0 = as_storage(rng.standard_normal(n).astype(np.float32) * 1e-2, dt)
    grads = [as_storage((rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 1, n)).astype(np.float32), dt)
             for _ in range(3)]
    umul = np.array([0.7, 1.9], np.float32)
    lr, b1, damp = 0.05, 0.9, 0.1

    def args(pp, g, s0, hp, flags=0, seg_mul=0, seg_gmul=0):
        a = apex_C.OptArgs()
        a.pdt = a.gdt = a.sdt = dt
        a.p, a.g, a.s0, a.seg, a.nseg = pp.ctypes.data, g.ctypes.data, s0, seg.ctypes.data, 2
        a.flags, a.hp, a.threads, a.seg_mul, a.seg_gmul = flags, hp, 2, seg_mul, seg_gmul
        return a

    def one_pass():
        pp, m = p0.copy(), m0.copy()
        for g in grads:
            apex_C._raw_sgd_step(args(pp, g, m.ctypes.data, [lr, b1, damp, wd], apex_C.FLAG_DECOUPLED,
                                      umul.ctypes.data))
        return pp.tobytes(), m.tobytes()

    def two_pass():
        pp, m = p0.copy(), m0.copy()
        for g in grads:
            apex_C._raw_sgd_step(args(pp, g, m.ctypes.data, [0.0, b1, damp, 0.0]))
            apex_C._raw_sgd_step(args(pp, m, 0, [lr, 0.0, 0.0, wd], seg_gmul=umul.ctypes.data))
        return pp.tobytes(), m.tobytes()

    got = one_pass()
    assert got == two_pass(), f"{level}: the one-pass update differs from the two-pass form"
    assert got == run_at("baseline", one_pass), f"{level}: differs from baseline"


LAMB_CASES = {
    # stage 1: m, v and the per-segment (||p||^2, ||u||^2), over segments of 1000 and 3099 elements (reduction
    # chunks and lane remainders of both); stage 2: the update with unit trust ratios
    "lamb-stage1": ("_raw_lamb_stage1", apex_C.FLAG_BIAS_CORRECTION | apex_C.FLAG_BETA3,
                    [0.9, 0.999, 1e-6, 0.01, 0.1], 2),
    "lamb-stage1-nobc": ("_raw_lamb_stage1", 0, [0.9, 0.999, 1e-6, 0.0], 2),
    "lamb-stage2": ("_raw_lamb_stage2", apex_C.FLAG_BIAS_CORRECTION, [1e-2, 1e-6, 0.01, 0.9, 0.999], 0),
}


@pytest.mark.parametrize("dt", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("case", list(LAMB_CASES))
def test_lamb_stages_match_baseline(level, dt, case):
    kernel, flags, hp, nout = LAMB_CASES[case]
    got, want = _optimizer_case(kernel, dt, flags, hp, np.random.default_rng(6), nout=nout)
    for name, a, b in zip(["param", "s0", "s1", "s2"], got, want):
        assert a == b, f"{level} {case} {name} differs from baseline"
    # The norms: same bits, except that a NaN sum (an inf/nan grad reached u) may carry either sign: which NaN an
    # add returns depends on its operand order, which compilers may swap (a + b == b + a for every other value).
    for t, (a, b) in enumerate(zip(got[4:], want[4:]), start=1):
        assert_bits_but_nans(np.frombuffer(a, np.float64), np.frombuffer(b, np.float64),
                             f"{level} {case} norms of step {t}")
    if nout:
        assert np.isnan(np.frombuffer(got[-1], np.float64)).any(), "step 3's inf grad reaches u: a NaN norm"
        assert np.isfinite(np.frombuffer(got[4], np.float64)).any(), "the kernel wrote no finite norms"


def _grad_sum_sq(g: np.ndarray, dt: int, seg: np.ndarray, skip=None) -> np.ndarray:
    """_raw_grad_sum_sq over the slots of `seg` (a params buffer that must stay untouched rides along)."""
    n = int(seg[-1])
    p = np.full(n, 7, STORAGE[dt])
    out = np.full(len(seg) - 1, np.nan, np.float64)
    a = apex_C.OptArgs()
    a.pdt = a.gdt = a.sdt = dt
    a.p, a.g, a.seg, a.nseg = p.ctypes.data, g.ctypes.data, seg.ctypes.data, len(seg) - 1
    a.seg_out, a.threads = out.ctypes.data, 2
    if skip is not None:
        a.skip = skip.ctypes.data
    apex_C._raw_grad_sum_sq(a)
    assert (p == 7).all(), "_raw_grad_sum_sq wrote to the params"
    return out


@pytest.mark.parametrize("dt", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_grad_sum_sq_matches_baseline_and_float64(level, dt):
    """Per-slot sums of squared grads (BertAdam's per-tensor clipping norm): the same bits as the baseline level
    (a NaN sum may differ in sign only, see above), and float64 sums of the stored values (rel 1e-12), over slots
    of 1000, 0, 3099 and 1 elements; a skipped slot reads 0."""
    rng = np.random.default_rng(8)
    seg = np.array([0, 1000, 1000, N_ODD, N_ODD + 1], np.int64)
    g = as_storage(special_f32(rng, N_ODD + 1), dt)
    got, want = _grad_sum_sq(g, dt, seg), run_at("baseline", lambda: _grad_sum_sq(g, dt, seg))
    assert_bits_but_nans(got, want, f"{level}: sums")
    clean = as_storage((rng.standard_normal(N_ODD + 1) * 10.0 ** rng.uniform(-3, 2, N_ODD + 1)).astype(np.float32), dt)
    wide = (clean.astype(np.uint32) << 16).view(np.float32) if dt == BF16 else clean
    wide = wide.astype(np.float64)
    exact = np.array([np.sum(wide[a:b] ** 2) for a, b in zip(seg[:-1], seg[1:])])
    np.testing.assert_allclose(_grad_sum_sq(clean, dt, seg), exact, rtol=1e-12, atol=0)
    skip = np.array([0, 0, 1, 0], np.uint8)
    sums = _grad_sum_sq(clean, dt, seg, skip)
    assert sums[2] == 0.0 and sums[1] == 0.0
    np.testing.assert_allclose(sums[[0, 3]], exact[[0, 3]], rtol=1e-12, atol=0)


def test_fp16_casts_match_torch(level):
    """fp16 storage gives the bits of torch's own CPU casts, nans included (payload bits, quiet bit); bf16 stores
    match torch's for every non-nan input (torch's bf16 cast gives every nan the canonical 0x7fc0)."""
    torch = pytest.importorskip("torch", reason="the reference is torch's cast")
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = torch.from_numpy(every.view(np.float16).copy()).float().numpy().view(np.uint32)
    assert_bits(convert(every, F16, F32), want, every, f"{level}: f16 -> f32 against torch")
    x = boundary_inputs()
    as_f32 = torch.from_numpy(x.view(np.float32).copy())
    want = as_f32.half().numpy().view(np.uint16)
    assert_bits(convert(x, F32, F16), want, x, f"{level}: f32 -> f16 against torch")
    not_nan = x[(x & 0x7FFFFFFF) <= 0x7F800000]  # infinities included
    want = torch.from_numpy(not_nan.view(np.float32).copy()).bfloat16().view(torch.int16).numpy().view(np.uint16)
    assert_bits(convert(not_nan, F32, BF16), want, not_nan, f"{level}: f32 -> bf16 against torch")


# ---------------------------------------------------------------------------------------------------------------
# flush-denormal mode (x86 MXCSR DAZ/FTZ, AArch64 FPCR.FZ; set by torch.set_flush_denormal): conversions must not
# change. Set by torch where it is installed, and by apex_C's private setter of the same bits, so that the
# torch-free cells (every Python, aarch64 under qemu) check it too.
# ---------------------------------------------------------------------------------------------------------------
def _flush_denormal_setter(name: str):
    if name == "torch":
        torch = pytest.importorskip("torch", reason="torch sets the flush-denormal mode for this check")
        return torch.set_flush_denormal
    return apex_C._set_flush_denormal


@pytest.mark.parametrize("setter", ["apex_C", "torch"])
def test_conversions_under_flush_denormal(level, setter):
    set_flush_denormal = _flush_denormal_setter(setter)
    x = boundary_inputs()
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    if not set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        h2f = convert(every, F16, F32)
        b2f = convert(every, BF16, F32)
        f2h = convert(x, F32, F16)
        f2b = convert(x, F32, BF16)
        opt = _optimizer_case("_raw_adam_step", F16, 0, [1e-3, 0.9, 0.999, 1e-8, 0.01], np.random.default_rng(3))
        # AMSGrad's max keeps the loaded bf16 subnormal max_exp_avg_sq (a compare under DAZ reads it as zero but
        # selects its bits): the bf16 store itself sees denormal inputs here, and must keep them under DAZ
        ams = _optimizer_case("_raw_adam_step", BF16, apex_C.FLAG_AMSGRAD, [1e-3, 0.9, 0.999, 1e-8, 0.0],
                              np.random.default_rng(4), subnormal_states=True)
        adam = _optimizer_case("_raw_adam_step", BF16, 0, [1e-3, 0.9, 0.999, 1e-8, 0.0], np.random.default_rng(4),
                               subnormal_states=True)
        # the other kernels with avx2 blocks (SGD, Adadelta, RMSprop, BertAdam), from subnormal states too
        blocks = {case: _optimizer_case(kernel, BF16, flags, hp, np.random.default_rng(4), subnormal_states=True,
                                        nout=nout[0] if nout else 0)
                  for case, (kernel, flags, hp, *nout) in BLOCK_CASES.items()
                  if kernel != "_raw_lamb_step"}  # (its trust ratios need seg_mul, which _optimizer_case leaves out)
    finally:
        set_flush_denormal(False)
    assert_bits(h2f, f16_bits_to_f32_bits(every), every, f"{level}: f16 -> f32 under DAZ/FTZ")
    # bf16 subnormals are float32 subnormals: the load is exact, copy_'s multiply by 1 then flushes them to a signed
    # zero under DAZ, as any float32 arithmetic (torch's included) does
    b2f_want = bf16_bits_to_f32_bits(every)
    b2f_want = np.where((b2f_want & 0x7F800000) == 0, b2f_want & 0x80000000, b2f_want).astype(np.uint32)
    assert_bits(b2f, b2f_want, every, f"{level}: bf16 -> f32 under DAZ/FTZ")
    # every float32 denormal rounds to a signed zero in fp16, so DAZ on the input changes nothing
    assert_bits(f2h, f32_bits_to_f16_bits(x), x, f"{level}: f32 -> f16 under DAZ/FTZ")
    # copy_ multiplies by 1 in fp32 first, and DAZ flushes a float32 denormal input to a signed zero there;
    # the bf16 narrowing itself is integer-only
    flushed = np.where((x & 0x7F800000) == 0, x & 0x80000000, x).astype(np.uint32)
    assert_bits(f2b, f32_bits_to_bf16_bits(flushed), x, f"{level}: f32 -> bf16 under DAZ/FTZ")
    assert opt[0] == opt[1], f"{level}: fp16 Adam under DAZ/FTZ differs from baseline"
    assert ams[0] == ams[1], f"{level}: bf16 AMSGrad with subnormal states under DAZ/FTZ differs from baseline"
    assert adam[0] == adam[1], f"{level}: bf16 Adam with subnormal states under DAZ/FTZ differs from baseline"
    for case, (got, want) in blocks.items():
        assert got[:4] == want[:4], f"{level}: bf16 {case} with subnormal states under DAZ/FTZ differs from baseline"
        for x, y in zip(got[4:], want[4:]):  # LAMB's squares: a nan sum's sign is not defined
            assert_bits_but_nans(np.frombuffer(x, np.float64), np.frombuffer(y, np.float64),
                                 f"{level}: bf16 {case} norms under DAZ/FTZ")
    vmax = np.frombuffer(ams[0][3], np.uint16)
    stored_subnormals = np.count_nonzero(((vmax & 0x7F80) == 0) & ((vmax & 0x7F) != 0))
    assert stored_subnormals > 0, "the case must store bf16 subnormals (else it checks nothing)"
