"""Torch-free tests of the grad gather path of apex_C (numpy + the extension).

`OptArgs.gtab` lets an optimizer kernel read slot k's grad from its own buffer (address table)
instead of the flat grad buffer; the arithmetic is the same, so every kernel must give bitwise the
same params, states and per-slot outputs either way, at every SIMD level and in every dtype.
`_raw_scale_gather_` is amp's in-place unscale + non-finite check over separate buffers.
`_raw_lamb_step` (LAMB's two stages and the trust ratios in one call) is checked here against the two stage calls
with the ratios formed in numpy, over the same slot layouts.
"""

from __future__ import annotations

import numpy as np
import pytest
from _apex_c_env import BF16, DTYPES, F16, F32, LEVELS, STORAGE, apex_C

pytestmark = pytest.mark.kernels


@pytest.fixture(params=LEVELS)
def level(request):
    apex_C.set_simd_level(request.param)
    yield request.param
    apex_C.set_simd_level("auto")


def stored(rng: np.random.Generator, n: int, dt: int, lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    """Random values in the storage dtype (bf16 as its upper 16 bits of a float32)."""
    x = rng.uniform(lo, hi, n).astype(np.float32)
    if dt == BF16:
        return (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    return x.astype(STORAGE[dt])


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.tobytes() == b.tobytes()


# slot sizes: empty, tiny, odd, one spanning several threads' ranges and reduction chunks
SIZES = (5, 0, 1, 33, 70001, 17)


class Case:
    """Flat param/state buffers with gaps between slots, grads both flat and as separate arrays."""

    def __init__(self, rng, pdt: int, gdt: int, nstates: int = 3, sizes=SIZES, skip=None):
        self.sizes = list(sizes)
        off, starts = 0, []
        for n in self.sizes:
            starts.append(off)
            off += -(-max(n, 1) // 32) * 32  # slots at multiples of 32, gaps stay zero
        self.total = off
        self.seg = np.array([*starts, off], dtype=np.int64)
        self.seg_end = np.array([s + n for s, n in zip(starts, self.sizes)], dtype=np.int64)
        self.pdt, self.gdt = pdt, gdt
        self.p = np.zeros(off, dtype=STORAGE[pdt])
        self.s = [np.zeros(off, dtype=STORAGE[pdt]) for _ in range(nstates)]
        self.g = np.zeros(off, dtype=STORAGE[gdt])
        for s0, n in zip(starts, self.sizes):
            self.p[s0:s0 + n] = stored(rng, n, pdt)
            self.g[s0:s0 + n] = stored(rng, n, gdt)
            for j, st in enumerate(self.s):  # positive values: second moments / accumulators stay valid
                st[s0:s0 + n] = stored(rng, n, pdt, 0.01 if j else -1.0, 1.0)
        # each slot's grad as its own array (separate allocation), as autograd leaves them
        self.own = [self.g[s0:s0 + n].copy() for s0, n in zip(starts, self.sizes)]
        nseg = len(self.sizes)
        self.skip = np.zeros(nseg, dtype=np.uint8) if skip is None else np.array(skip, dtype=np.uint8)
        # skipped slots may have no grad at all: a null address
        self.table = np.array([0 if self.skip[k] else (a.ctypes.data if a.size else 0) for k, a in enumerate(self.own)],
                              dtype=np.uint64)
        self.steps = np.array([1.0 + (k % 4) for k in range(nseg)], dtype=np.float32)
        self.first = np.array([k % 2 for k in range(nseg)], dtype=np.uint8)
        self.seg_mul = np.array([0.0 if k % 3 == 0 else 0.5 + 0.1 * k for k in range(nseg)], dtype=np.float32)
        self.seg_gmul = np.array([0.25 + 0.5 * (k % 3) for k in range(nseg)], dtype=np.float32)
        self.seg_aux = np.array([1.0 if k % 2 else 0.1 for k in range(nseg)], dtype=np.float32)

    def copy(self):
        c = object.__new__(Case)
        c.__dict__.update(self.__dict__)
        c.p = self.p.copy()
        c.s = [st.copy() for st in self.s]
        return c

    def args(self, gather: bool, hp, flags: int = 0, threads: int = 2, nout: int = 0):
        a = apex_C.OptArgs()
        a.p = self.p.ctypes.data
        a.pdt, a.gdt, a.sdt = self.pdt, self.gdt, self.pdt
        if gather:
            a.gtab = self.table.ctypes.data
        else:
            a.g = self.g.ctypes.data
        for j, st in enumerate(self.s):
            setattr(a, f"s{j}", st.ctypes.data)
        a.seg, a.seg_end, a.nseg = self.seg.ctypes.data, self.seg_end.ctypes.data, len(self.sizes)
        a.steps, a.first = self.steps.ctypes.data, self.first.ctypes.data
        a.skip = self.skip.ctypes.data if self.skip.any() else 0
        a.seg_mul, a.seg_gmul, a.seg_aux = self.seg_mul.ctypes.data, self.seg_gmul.ctypes.data, self.seg_aux.ctypes.data
        a.hp = list(hp)
        a.flags = flags
        a.grad_scale = 0.5
        a.threads = threads
        self.seg_out = np.full(max(nout, 1) * len(self.sizes), np.nan, dtype=np.float64)
        a.seg_out = self.seg_out.ctypes.data
        return a


F = apex_C
# (kernel, hyperparameters, flags, seg_out values per slot)
KERNELS = [
    ("_raw_sgd_step", [0.1, 0.9, 0.1, 0.01], 0, 0),
    ("_raw_sgd_step", [0.1, 0.9, 0.0, 0.01], F.FLAG_NESTEROV, 0),
    ("_raw_sgd_step", [0.1, 0.0, 0.0, 0.01], 0, 0),
    ("_raw_sgd_step", [0.1, 0.9, 0.1, 0.01], F.FLAG_DECOUPLED, 0),
    ("_raw_adam_step", [1e-3, 0.9, 0.999, 1e-8, 0.01], 0, 0),
    ("_raw_adam_step", [1e-3, 0.9, 0.999, 1e-8, 0.01], F.FLAG_DECOUPLED | F.FLAG_AMSGRAD, 0),
    ("_raw_adam_step", [1e-3, 0.9, 0.999, 1e-8, 0.0], F.FLAG_NO_BIAS_CORRECTION, 0),
    ("_raw_adadelta_step", [1.0, 0.9, 1e-6, 0.01], 0, 0),
    ("_raw_rmsprop_step", [1e-2, 0.99, 1e-8, 0.01, 0.9], F.FLAG_CENTERED, 0),
    ("_raw_rmsprop_step", [1e-2, 0.99, 1e-8, 0.0, 0.0], 0, 0),
    ("_raw_rmsprop_tf_step", [1e-2, 0.9, 1e-10, 0.01, 0.9], F.FLAG_LR_IN_MOMENTUM | F.FLAG_DECOUPLED, 0),
    ("_raw_bert_adam_step", [1e-3, 0.9, 0.999, 1e-6, 0.01], 0, 0),
    ("_raw_lamb_stage1", [0.9, 0.999, 1e-6, 0.01, 0.1], F.FLAG_BIAS_CORRECTION | F.FLAG_BETA3, 2),
    ("_raw_lamb_step", [0.9, 0.999, 1e-6, 0.01, 0.1, 1e-2, 1e-6, 0.01, 0.9, 0.999, 0.5],
     F.FLAG_BIAS_CORRECTION | F.FLAG_BETA3 | F.FLAG_TRUST_RATIO | F.FLAG_CLAMP_WEIGHT_NORM, 2),
    ("_raw_row_dots", [], 0, 3),
    ("_raw_grad_sum_sq", [], 0, 1),
    ("_raw_adamp_stage_a", [1e-3, 0.9, 0.999, 1e-8, 0.01], F.FLAG_NESTEROV, 1),
    ("_raw_adamp_stage_b", [1e-3, 0.9, 0.999, 1e-8, 0.01], 0, 0),
    ("_raw_adagrad_step", [1e-2, 1e-10, 0.01, 0.1], 0, 0),
    ("_raw_adagrad_step", [1e-2, 1e-10, 0.01, 0.0], F.FLAG_DECOUPLED, 0),
]


def _run_both(case: Case, name: str, hp, flags: int, nout: int, threads: int = 2):
    flat, gath = case.copy(), case.copy()
    for c, gather in ((flat, False), (gath, True)):
        a = c.args(gather, hp, flags, threads, nout)
        if name == "_raw_adamp_stage_b":  # stage B reads stage A's per-row projections: none here
            a.seg_out = 0
        getattr(apex_C, name)(a)
    return flat, gath


@pytest.mark.parametrize("kernel,hp,flags,nout", KERNELS, ids=[f"{k[0]}-{i}" for i, k in enumerate(KERNELS)])
@pytest.mark.parametrize("dt", DTYPES.values(), ids=DTYPES.keys())
def test_gather_matches_flat_bitwise(level, kernel, hp, flags, nout, dt):
    rng = np.random.default_rng(7)
    case = Case(rng, dt, dt)
    flat, gath = _run_both(case, kernel, hp, flags, nout)
    assert same_bits(flat.p, gath.p), f"{kernel}: params differ"
    for j, (a, b) in enumerate(zip(flat.s, gath.s)):
        assert same_bits(a, b), f"{kernel}: state s{j} differs"
    if nout:
        assert same_bits(flat.seg_out, gath.seg_out), f"{kernel}: seg_out differs"
    assert not same_bits(flat.p, case.p) or kernel in ("_raw_row_dots", "_raw_grad_sum_sq", "_raw_adamp_stage_a",
                                                       "_raw_lamb_stage1")


@pytest.mark.parametrize("gdt", [F16, BF16], ids=["f16", "bf16"])
def test_gather_fp32_params_low_precision_grads(level, gdt):
    rng = np.random.default_rng(3)
    case = Case(rng, F32, gdt)
    flat, gath = _run_both(case, "_raw_adam_step", [1e-3, 0.9, 0.999, 1e-8, 0.01], F.FLAG_DECOUPLED, 0)
    assert same_bits(flat.p, gath.p) and all(same_bits(a, b) for a, b in zip(flat.s, gath.s))


def test_gather_skipped_slots_untouched_and_null_address(level):
    rng = np.random.default_rng(11)
    skip = [1, 0, 0, 1, 0, 1]
    case = Case(rng, F32, F32, skip=skip)
    assert case.table[0] == 0 and case.table[3] == 0
    flat, gath = _run_both(case, "_raw_adam_step", [1e-3, 0.9, 0.999, 1e-8, 0.0], 0, 0)
    assert same_bits(flat.p, gath.p)
    for k, sk in enumerate(skip):
        lo, hi = case.seg[k], case.seg_end[k]
        if sk:
            assert same_bits(gath.p[lo:hi], case.p[lo:hi])
    # gaps between slots are never written
    mask = np.ones(case.total, dtype=bool)
    for lo, hi in zip(case.seg[:-1], case.seg_end):
        mask[lo:hi] = False
    assert not gath.p[mask].any()


def test_gather_thread_counts_agree(level):
    rng = np.random.default_rng(5)
    case = Case(rng, F32, F32)
    one = case.copy()
    apex_C._raw_lamb_stage1(one.args(True, [0.9, 0.999, 1e-6, 0.01], 0, threads=1, nout=2))
    two = case.copy()
    apex_C._raw_lamb_stage1(two.args(True, [0.9, 0.999, 1e-6, 0.01], 0, threads=2, nout=2))
    assert same_bits(one.seg_out, two.seg_out) and same_bits(one.s[0], two.s[0])


def test_gather_table_errors():
    rng = np.random.default_rng(1)
    case = Case(rng, F32, F32)
    a = case.args(True, [0.1, 0.0, 0.0, 0.0])
    bad = case.table.copy()
    bad[1] = 0  # an empty slot may have no address
    bad[2] = 0  # a slot with elements and no skip flag needs one
    a.gtab = bad.ctypes.data
    with pytest.raises(ValueError, match="slot 2 has a null grad address"):
        apex_C._raw_sgd_step(a)
    bad = case.table.copy()
    bad[3] += 2  # misaligned for float32
    a.gtab = bad.ctypes.data
    with pytest.raises(ValueError, match="slot 3 is not aligned"):
        apex_C._raw_sgd_step(a)
    a.gtab = 0
    a.g = 0
    with pytest.raises(ValueError, match="gtab"):
        apex_C._raw_sgd_step(a)


# ------------------------------------------------------------------ _raw_scale_gather_
def _tables(arrays):
    addr = np.array([a.ctypes.data if a.size else 0 for a in arrays], dtype=np.uint64)
    numel = np.array([a.size for a in arrays], dtype=np.int64)
    return addr, numel


def _as_f32(a: np.ndarray, dt: int) -> np.ndarray:
    if dt == BF16:
        return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return a.astype(np.float32)


@pytest.mark.parametrize("dt", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("threads", [1, 2])
def test_scale_gather_matches_one_scale_per_buffer(level, dt, threads):
    """Same bits as scaling each buffer alone with scale_ (the elementwise kernel already tested)."""
    rng = np.random.default_rng(2)
    sizes = [0, 1, 7, 70001, 64, 3, 100003]
    arrays = [stored(rng, n, dt, -100.0, 100.0) for n in sizes]
    want = [a.copy() for a in arrays]
    for w in want:
        apex_C._raw_scale_(w.ctypes.data, dt, w.ctypes.data, dt, w.size, 0.125, True, 1)
    addr, numel = _tables(arrays)
    found = apex_C._raw_scale_gather_(addr.ctypes.data, numel.ctypes.data, len(arrays), dt, 0.125, True, threads)
    assert found is False
    for k, (a, w) in enumerate(zip(arrays, want)):
        assert same_bits(a, w), f"buffer {k}"


@pytest.mark.parametrize("dt", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_scale_gather_finds_nonfinite_in_any_buffer(level, dt, scale):
    rng = np.random.default_rng(4)
    sizes = [3, 70001, 0, 9, 100003]
    for target in (0, 1, 3, 4):
        for pos in (0, sizes[target] - 1, sizes[target] // 2):
            for bad in (np.inf, -np.inf, np.nan):
                arrays = [stored(rng, n, dt) for n in sizes]
                v = np.array([bad], dtype=np.float32)
                arrays[target][pos] = (v.view(np.uint32) >> np.uint32(16)).astype(np.uint16)[0] if dt == BF16 \
                    else v.astype(STORAGE[dt])[0]
                before = [a.copy() for a in arrays]
                addr, numel = _tables(arrays)
                got = apex_C._raw_scale_gather_(addr.ctypes.data, numel.ctypes.data, len(arrays), dt, scale, True, 2)
                assert got is True, (target, pos, bad)
                if scale == 1.0:  # a check-only call writes nothing
                    assert all(same_bits(a, b) for a, b in zip(arrays, before))
                else:
                    k = (target + 1) % len(sizes)
                    exp = _as_f32(before[k], dt) * np.float32(scale)
                    if dt == F16:  # halving can land in the subnormal range: rounded once, to nearest even
                        exp = exp.astype(np.float16).astype(np.float32)
                    assert np.array_equal(_as_f32(arrays[k], dt), exp)


def test_scale_gather_no_check_and_empty():
    arrays = [np.array([np.inf, 2.0], dtype=np.float32)]
    addr, numel = _tables(arrays)
    assert apex_C._raw_scale_gather_(addr.ctypes.data, numel.ctypes.data, 1, F32, 2.0, False, 1) is False
    assert arrays[0][1] == 4.0
    assert apex_C._raw_scale_gather_(0, 0, 0, F32, 2.0) is False


def test_scale_gather_bad_arguments():
    a = np.ones(4, dtype=np.float32)
    addr, numel = _tables([a])
    with pytest.raises(ValueError, match="dtype code"):
        apex_C._raw_scale_gather_(addr.ctypes.data, numel.ctypes.data, 1, 7, 1.0)
    with pytest.raises(ValueError, match="n must be >= 0"):
        apex_C._raw_scale_gather_(addr.ctypes.data, numel.ctypes.data, -1, F32, 1.0)
    with pytest.raises(ValueError, match="tables are required"):
        apex_C._raw_scale_gather_(0, numel.ctypes.data, 1, F32, 1.0)
    bad = np.array([0], dtype=np.uint64)
    with pytest.raises(ValueError, match="buffer 0"):
        apex_C._raw_scale_gather_(bad.ctypes.data, numel.ctypes.data, 1, F32, 1.0)
    neg = np.array([-1], dtype=np.int64)
    with pytest.raises(ValueError, match="buffer 0"):
        apex_C._raw_scale_gather_(addr.ctypes.data, neg.ctypes.data, 1, F32, 1.0)
    mis = np.array([a.ctypes.data + 2], dtype=np.uint64)
    with pytest.raises(ValueError, match="aligned"):
        apex_C._raw_scale_gather_(mis.ctypes.data, numel.ctypes.data, 1, F32, 1.0)


def _widen(x: np.ndarray, dt: int) -> np.ndarray:
    """fp16 / bf16 storage to float32 (exact)."""
    if dt == BF16:
        return (x.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return x.astype(np.float32)


@pytest.mark.parametrize("dt", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("flags", [F.FLAG_DECOUPLED, 0, F.FLAG_NO_BIAS_CORRECTION], ids=["adamw", "adam_l2", "no_bc"])
@pytest.mark.parametrize("gather", [False, True], ids=["flat", "gather"])
def test_adam_f32_states_of_low_precision_params(level, dt, flags, gather):
    """FLAG_F32_STATES: fp16/bf16 params and grads with float32 moments, updated in place. Bitwise what the fp32
    form gives (an exact fp32 copy of the params updated, the result rounded into an fp16/bf16 `out`)."""
    rng = np.random.default_rng(7)
    case = Case(rng, dt, dt, nstates=0)
    n = case.total
    s32 = [np.abs(rng.standard_normal(n)).astype(np.float32) * (0.1 if j else 1.0) for j in range(2)]
    s32[0] *= np.sign(rng.standard_normal(n)).astype(np.float32)
    hp = [1e-2, 0.9, 0.999, 1e-8, 0.05]

    low = case.copy()
    s_low = [s.copy() for s in s32]
    a = low.args(gather, hp, flags | F.FLAG_F32_STATES)
    a.s0, a.s1 = s_low[0].ctypes.data, s_low[1].ctypes.data
    apex_C._raw_adam_step(a)

    wide = case.copy()
    wide.p, wide.pdt = _widen(case.p, dt), F32
    s_wide = [s.copy() for s in s32]
    out = np.zeros(n, dtype=STORAGE[dt])
    b = wide.args(gather, hp, flags)
    b.pdt, b.sdt = F32, F32
    b.s0, b.s1 = s_wide[0].ctypes.data, s_wide[1].ctypes.data
    b.out, b.odt = out.ctypes.data, dt
    apex_C._raw_adam_step(b)

    written = np.zeros(n, dtype=bool)
    for s0, e in zip(case.seg[:-1], case.seg_end):
        written[s0:e] = True
    assert same_bits(low.p[written], out[written]), "params"
    assert same_bits(low.p[~written], case.p[~written]), "the gaps between slots are untouched"
    for j in range(2):
        assert same_bits(s_low[j], s_wide[j]), f"state {j}"
    assert not same_bits(low.p, case.p), "the update changed something"


def test_f32_states_flag_is_checked():
    rng = np.random.default_rng(8)
    case = Case(rng, BF16, BF16, nstates=2, sizes=(5, 3))
    hp = [1e-2, 0.9, 0.999, 1e-8, 0.0]
    with pytest.raises(ValueError, match="_raw_adam_step only"):
        apex_C._raw_sgd_step(case.args(False, [0.1, 0.9, 0.0, 0.0], F.FLAG_F32_STATES))
    wide = Case(rng, F32, F32, nstates=2, sizes=(5, 3))
    with pytest.raises(ValueError, match="FLAG_F32_STATES needs float16/bfloat16 params"):
        apex_C._raw_adam_step(wide.args(False, hp, F.FLAG_F32_STATES))
    a = case.args(False, hp, F.FLAG_F32_STATES)
    out = np.zeros(case.total, dtype=np.uint16)
    a.out, a.odt = out.ctypes.data, BF16
    with pytest.raises(ValueError, match="FLAG_F32_STATES needs"):
        apex_C._raw_adam_step(a)


# ------------------------------------------------------------------ _raw_lamb_step
def _ratios(norms: np.ndarray, clamp) -> np.ndarray:
    """The trust ratios as the optimizers formed them with torch ops: float64 square roots of the summed
    squares, ||p|| clamped, 1 where either norm is 0, then rounded to float32."""
    sq = np.sqrt(norms.reshape(-1, 2))
    w, u = sq[:, 0], sq[:, 1]
    if clamp is not None:
        w = np.where(w > clamp, clamp, w)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((w == 0) | (u == 0), 1.0, w / u).astype(np.float32)


LAMB_MODES = {  # flags on top of the stage flags, the weight-norm clamp (hp[10]) and whether ratios are formed
    "ratio": (F.FLAG_TRUST_RATIO, None),
    "ratio-clamped": (F.FLAG_TRUST_RATIO | F.FLAG_CLAMP_WEIGHT_NORM, 0.3),
    "no-ratio": (0, None),
}


@pytest.mark.parametrize("mode", LAMB_MODES)
@pytest.mark.parametrize("bias_correction", [True, False], ids=["bc", "nobc"])
@pytest.mark.parametrize("dt", DTYPES.values(), ids=DTYPES.keys())
def test_lamb_step_equals_the_two_stages(level, mode, bias_correction, dt):
    rng = np.random.default_rng(13)
    skip = [0, 0, 0, 1, 0, 0]  # a skipped slot keeps everything, its ratio included
    case = Case(rng, dt, dt, nstates=2, skip=skip)
    case.p[case.seg[2]:case.seg_end[2]] = 0  # a zero param: ratio 1
    extra, clamp = LAMB_MODES[mode]
    flags = F.FLAG_BETA3 | (F.FLAG_BIAS_CORRECTION if bias_correction else 0)
    hp1, hp2 = [0.9, 0.999, 1e-6, 0.01, 0.1], [1e-2, 1e-6, 0.01, 0.9, 0.999]

    ref = case.copy()
    a = ref.args(True, hp1, flags, nout=2)
    apex_C._raw_lamb_stage1(a)
    ratio = _ratios(ref.seg_out, clamp)
    a.hp, a.seg_out = hp2, 0
    if extra:
        a.seg_mul = ratio.ctypes.data
    else:
        a.seg_mul = 0
    apex_C._raw_lamb_stage2(a)

    one = case.copy()
    one.seg_mul = np.full(len(case.sizes), -7.0, dtype=np.float32)  # written only with FLAG_TRUST_RATIO
    a = one.args(True, hp1 + hp2 + [clamp or 0.0], flags | extra, nout=2)
    apex_C._raw_lamb_step(a)
    assert same_bits(one.p, ref.p) and all(same_bits(x, y) for x, y in zip(one.s, ref.s))
    assert same_bits(one.seg_out, ref.seg_out)
    if extra:
        assert same_bits(one.seg_mul, ratio)
        assert one.seg_mul[2] == 1.0
        if clamp is not None:
            assert (np.sqrt(one.seg_out.reshape(-1, 2)[:, 0]) > clamp).any()  # the clamp mattered somewhere
    else:
        assert (one.seg_mul == -7.0).all()
    assert not same_bits(one.p, case.p)
    for k, sk in enumerate(skip):
        if sk:
            assert same_bits(one.p[case.seg[k]:case.seg_end[k]], case.p[case.seg[k]:case.seg_end[k]])


def test_lamb_step_nan_norm_gives_nan_ratio():
    # a NaN grad makes ||u|| NaN: the ratio is NaN (torch.where picks w / u), as the torch executor computes it
    rng = np.random.default_rng(2)
    case = Case(rng, F32, F32, nstates=2, sizes=(8, 8))
    case.own[1][3] = np.nan
    a = case.args(True, [0.9, 0.999, 1e-6, 0.01, 0.1, 1e-2, 1e-6, 0.01, 0.9, 0.999, 10.0],
                  F.FLAG_TRUST_RATIO | F.FLAG_CLAMP_WEIGHT_NORM, nout=2)
    apex_C._raw_lamb_step(a)
    assert np.isfinite(case.seg_mul[0]) and np.isnan(case.seg_mul[1])


def test_lamb_step_argument_errors():
    rng = np.random.default_rng(4)
    case = Case(rng, F32, F32, nstates=2)
    a = case.args(True, [0.9, 0.999, 1e-6, 0.01, 0.1, 1e-2, 1e-6, 0.01], F.FLAG_TRUST_RATIO, nout=2)
    before = case.p.copy()
    a.seg_mul = 0
    with pytest.raises(ValueError, match="FLAG_TRUST_RATIO needs seg_mul"):
        apex_C._raw_lamb_step(a)
    a = case.args(True, [0.9, 0.999, 1e-6, 0.01, 0.1, 1e-2, 1e-6, 0.01], 0, nout=2)
    a.seg_out = 0
    with pytest.raises(ValueError, match="seg_out"):
        apex_C._raw_lamb_step(a)
    a = case.args(True, [0.9, 0.999, 1e-6, 0.01, 0.1, 1e-2, 1e-6, 0.01], 0, nout=2)
    a.s1 = 0
    with pytest.raises(ValueError, match="state slot s1"):
        apex_C._raw_lamb_step(a)
    assert same_bits(case.p, before)
