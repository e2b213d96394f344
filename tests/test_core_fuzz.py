"""Fuzzing apex_C in a child interpreter: no argument may kill the process.

The child calls every public function with random objects (numpy arrays of every dtype, shape, stride and
writability, DLPack-only wrappers, torch tensors when torch is importable, and non-arrays) and random scalars, and
every private ``_raw_*`` function and optimizer kernel with random integers. Raw addresses cannot be checked
against the memory behind them, so the raw calls are drawn from two families: in-bounds calls on real buffers
(which may run or be rejected), and hostile calls the checks must reject (negative or huge counts, null,
misaligned or wrapping addresses, bad dtype codes, malformed segment tables); a hostile call that returns normally
fails the run. The parent asserts that the child exits normally, never from a signal; the child logs each call
before making it, so a crash names the call.

The budget is a few seconds in the fast tier and longer under ``--full``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

apex_C = pytest.importorskip("apex_C")

FAST_SECONDS = 3.0
FULL_SECONDS = 40.0
HERE = os.path.dirname(os.path.abspath(__file__))


# "public-torch" adds torch tensors to the public objects; importing torch takes longer than the fast budget
@pytest.mark.parametrize("part", ["public", "raw", "optim", pytest.param("public-torch", marks=pytest.mark.full)])
def test_fuzz_child_never_dies_from_a_signal(part, request, tmp_path):
    seconds = FULL_SECONDS if request.config.getoption("--full") else FAST_SECONDS
    seed = int(os.environ.get("APEX_FUZZ_SEED", str(random.SystemRandom().randrange(2 ** 32))))
    log = tmp_path / "calls.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(apex_C.__file__), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, part, str(seed), str(seconds), str(log)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds + 120)
    last = log.read_text().splitlines()[-1:] if log.exists() else []
    where = f"seed {seed} (APEX_FUZZ_SEED={seed} reproduces), last call {last}, stderr tail {r.stderr[-2000:]}"
    if r.returncode < 0:
        pytest.fail(f"fuzz child killed by {signal.Signals(-r.returncode).name}: {where}")
    assert r.returncode == 0, f"fuzz child failed (exit {r.returncode}): {where}"
    assert "calls:" in r.stdout, r.stdout


# ---------------------------------------------------------------------------------------------------------------
# the child
# ---------------------------------------------------------------------------------------------------------------
# what a rejected call may raise (RuntimeError: a producer's own __dlpack__ failure, passed through)
EXPECTED = (ValueError, TypeError, OverflowError, BufferError, MemoryError, RuntimeError)


class _Child:
    def __init__(self, seed: int, log_path: str, with_torch: bool):
        import ctypes

        import numpy as np

        self.np, self.ctypes = np, ctypes
        self.rng = random.Random(seed)
        self.log = open(log_path, "w", buffering=1)
        self.calls = 0
        self.accepted = 0  # calls that passed every check and ran
        n = 1 << 14
        self.arena_elems = n
        # raw-path buffers: every in-bounds raw call stays inside one of these
        self.arenas = [np.zeros(n, np.float32) for _ in range(8)]
        self.maxseg = 64
        self.per_seg = {name: np.zeros(self.maxseg, np.float32) for name in ("steps", "seg_mul", "seg_gmul", "seg_aux")}
        self.flags = {name: np.zeros(self.maxseg, np.uint8) for name in ("skip", "first")}
        self.seg_out = np.zeros(3 * self.maxseg, np.float64)
        self.tables = [np.zeros(self.maxseg + 1, np.int64) for _ in range(2)]
        try:
            if not with_torch:
                raise ImportError
            import torch

            self.torch = torch
        except ImportError:
            self.torch = None

    def note(self, text: str) -> None:
        self.log.write(text + "\n")
        self.calls += 1

    # ---- random values -----------------------------------------------------------------------------------
    def big_int(self) -> int:
        r = self.rng
        return r.choice([0, 1, -1, 2 ** 31, -(2 ** 31), 2 ** 48, 2 ** 48 + 1, 2 ** 62, 2 ** 63 - 1, -(2 ** 63),
                         2 ** 63, 2 ** 64 - 1, 2 ** 64, r.randrange(-(2 ** 70), 2 ** 70), r.randrange(-5, 300)])

    def scalar(self):
        r = self.rng
        return r.choice([0.0, 1.0, -2.5, float("inf"), float("nan"), 1e300, r.uniform(-10, 10), 3, "x", None,
                         2 ** 70])

    def threads(self):
        return self.rng.choice([0, 1, 2, 3, -1, 300, 2 ** 40, None])

    def array(self):
        np, r = self.np, self.rng
        dtype = r.choice([np.float32] * 4 + [np.float16] * 2 + [np.uint16, np.float64, np.int64, np.int32,
                                                                  np.uint8, np.bool_, np.complex64])
        shape = tuple(r.randrange(0, 40) for _ in range(r.randrange(0, 3)))
        a = np.asarray(np.random.default_rng(r.randrange(2 ** 32)).standard_normal(shape) * 100).astype(dtype)
        if a.ndim and r.random() < 0.3:
            a = a[:: r.choice([1, 2, -1])]
        if a.ndim == 2 and r.random() < 0.2:
            a = a.T
        if r.random() < 0.2:
            a.flags.writeable = False
        if a.size and r.random() < 0.15:  # a view shifted inside a bigger buffer (overlap candidates)
            base = np.zeros(a.size + 8, a.dtype)
            k = r.randrange(0, 8)
            a = base[k:k + a.size]
        if r.random() < 0.05 and a.size:
            raw = np.zeros(a.nbytes + 1, np.uint8)
            a = raw[1:].view(a.dtype) if a.dtype != np.bool_ else a  # misaligned
        return a

    def dl_wrapper(self, arr):
        np, r = self.np, self.rng
        versioned = r.random() < 0.5
        relabel = None
        if arr.dtype == np.uint16 and r.random() < 0.7:
            relabel = (4, 16)
        elif r.random() < 0.1:
            # any type code, but never a wider element than the memory holds: a producer that overstates its
            # extent makes every consumer read and write past the allocation (no check can see that)
            relabel = (r.randrange(0, 8), r.choice([b for b in (8, 16, 32, 64, 3) if b <= 8 * arr.itemsize]))
        device = (1, 0) if r.random() < 0.9 else (r.choice([2, 4, 13, "cpu"]), 0)
        return _DLOnly(self.ctypes, arr, versioned, relabel, device)

    def tensor(self):
        torch, r = self.torch, self.rng
        dtype = r.choice([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32])
        t = torch.randn(r.randrange(0, 30), r.randrange(1, 4)).to(dtype)
        if r.random() < 0.3:
            t = t.t()
        if r.random() < 0.2 and t.is_floating_point():
            t.requires_grad_(True)
        if r.random() < 0.2 and t.numel() > 2:
            t = t.reshape(-1)[1:]
        return t

    def obj(self, pool):
        r = self.rng
        k = r.random()
        if k < 0.35 and pool:
            return r.choice(pool)
        if k < 0.6:
            return self.array()
        if k < 0.75:
            return self.dl_wrapper(self.array())
        if k < 0.85 and self.torch is not None:
            return self.tensor()
        return r.choice([None, 3, 2 ** 70, -1, 1.5, "s", b"abcd", bytearray(8), [1.0], object(), self.big_int(),
                         memoryview(bytearray(16)).cast("f"), _BadDL(r.randrange(6))])

    # ---- the three parts -----------------------------------------------------------------------------------
    def public(self):
        r = self.rng
        pool = [self.array() for _ in range(3)]
        names = ["scale_", "axpy_", "copy_", "fill_", "has_nonfinite", "sum_sq", "max_abs", "segment_sum_sq"]
        name = r.choice(names)
        fn = getattr(apex_C, name)
        nargs = {"scale_": 5, "axpy_": 5, "copy_": 3, "fill_": 3, "segment_sum_sq": 4}.get(name, 2)
        args = []
        count = nargs - r.randrange(0, 3) if r.random() < 0.8 else r.randrange(0, nargs + 2)  # mostly valid arity
        for i in range(count):
            if (name in ("scale_", "axpy_") and i == 2) or (name == "fill_" and i == 1):
                args.append(self.scalar())
            elif (i == nargs - 1 and name != "segment_sum_sq") or (name == "segment_sum_sq" and i == 3):
                args.append(self.threads())
            elif name in ("scale_", "axpy_") and i == 3:
                args.append(r.choice([True, False, 1, None]))
            elif name == "segment_sum_sq" and i == 1 and r.random() < 0.5:
                args.append(self.np.array(sorted(r.randrange(-2, 60) for _ in range(r.randrange(0, 6))),
                                          self.np.int64))
            elif name == "segment_sum_sq" and i == 2 and r.random() < 0.5:
                args.append(self.np.zeros(r.randrange(0, 6), self.np.float64))
            else:
                args.append(self.obj(pool))
        self.note(f"{name}{tuple(type(a).__name__ for a in args)}")
        try:
            fn(*args)
            self.accepted += 1
        except EXPECTED:
            pass

    def span(self, dt_size=4):
        """An in-bounds (address, count) in one arena, for any dtype of <= 4 bytes."""
        r = self.rng
        arena = r.choice(self.arenas)
        off = r.randrange(0, self.arena_elems)
        n = r.randrange(0, self.arena_elems - off + 1)
        return arena.ctypes.data + 4 * off, n

    def hostile_span(self):
        """(address, count, dtype) that the raw checks must reject."""
        r = self.rng
        addr, n = self.span()
        kind = r.randrange(6)
        dt = r.randrange(3)
        if kind == 0:
            return addr, -r.randrange(1, 2 ** 63), dt
        if kind == 1:
            return addr, r.randrange(2 ** 48 + 1, 2 ** 63), dt
        if kind == 2:
            return 0, r.randrange(1, 2 ** 48), dt
        if kind == 3:
            return addr + 1, max(n, 1), dt
        if kind == 4:
            room = 8 * r.randrange(1, 1000)
            size = 4 if dt == 0 else 2
            return 2 ** 64 - room, r.randrange(room // size + 1, 2 ** 48 + 1), dt
        return addr, n, r.choice([3, -1, 7, 2 ** 31 - 1])

    def raw(self):
        r = self.rng
        name = r.choice(["scale_", "axpy_", "copy_", "fill_", "has_nonfinite", "sum_sq", "max_abs",
                         "segment_sum_sq", "scale_gather_", "split"])
        hostile = r.random() < 0.5
        if name == "scale_gather_":
            self.raw_gather(hostile)
            return
        if name == "split":
            args = (self.big_int(), r.choice([r.randrange(-5, 5000), 2 ** 40]), self.big_int(), self.big_int())
            self.note(f"_split_range{args}")
            try:
                apex_C._split_range(*args)
            except EXPECTED:
                pass
            return
        if name == "segment_sum_sq":
            self.raw_segments(hostile)
            return
        th = r.choice([0, 1, 2, 3])
        if hostile:
            a_addr, a_n, a_dt = self.hostile_span()
        else:
            (a_addr, a_n), a_dt = self.span(), r.randrange(3)
        b_addr, b_n = self.span()
        b_dt = r.randrange(3)
        n = a_n if hostile else min(a_n, b_n)
        if r.random() < 0.2 and not hostile:
            b_addr, b_dt = a_addr, a_dt  # in place
        fn = getattr(apex_C, "_raw_" + name)
        if name in ("scale_", "axpy_"):
            args = (a_addr, a_dt, b_addr, b_dt, n, r.uniform(-4, 4), r.random() < 0.5, th)
            if r.random() < 0.5:  # the hostile side may be the destination
                args = (b_addr, b_dt, a_addr, a_dt, n, args[5], args[6], th)
        elif name == "copy_":
            args = (a_addr, a_dt, b_addr, b_dt, n, th)
        else:
            args = (a_addr, a_dt, n, 1.5, th) if name == "fill_" else (a_addr, a_dt, n, th)
        self.note(f"_raw_{name}{args} hostile={hostile}")
        try:
            fn(*args)
            self.accepted += 1
        except EXPECTED:
            return
        if hostile:
            raise AssertionError(f"hostile call returned normally: _raw_{name}{args}")

    def raw_gather(self, hostile):
        """_raw_scale_gather_ over a table of buffers: one hostile entry (or a hostile table) must be rejected."""
        r = self.rng
        n = r.randrange(0, 9)
        if not hasattr(self, "gather_addrs"):
            self.gather_addrs = self.np.zeros(self.maxseg + 1, self.np.uint64)
        addrs, counts = self.gather_addrs, self.tables[1]
        spans = [self.span() for _ in range(n)]  # may overlap: values change, memory stays inside the arenas
        dt = r.randrange(3)
        for j, (a, c) in enumerate(spans):
            addrs[j], counts[j] = a, c
        addr, numel = addrs.ctypes.data, counts.ctypes.data
        if hostile:
            kind = r.randrange(4)
            if kind == 0 or n == 0:
                n = r.choice([-1, 2 ** 48 + 1, 2 ** 63 - 1])
            elif kind == 1:
                addr, numel = r.choice([(0, numel), (addr, 0), (addr + 4, numel)])
            elif kind == 2:
                j = r.randrange(n)
                a, c, hdt = self.hostile_span()
                addrs[j], counts[j] = a, c
                if hdt not in (0, 1, 2):
                    dt = hdt
            else:
                dt = r.choice([3, -1])
        args = (addr, numel, n, dt, r.uniform(-4, 4), r.random() < 0.5, r.choice([0, 1, 2]))
        self.note(f"_raw_scale_gather_{args} hostile={hostile} table={list(zip(addrs[:4], counts[:4]))}")
        try:
            apex_C._raw_scale_gather_(*args)
            self.accepted += 1
        except EXPECTED:
            return
        if hostile:
            raise AssertionError(f"hostile call returned normally: _raw_scale_gather_{args}")

    def table(self, nseg, limit):
        r = self.rng
        t = self.tables[0]
        vals = sorted(r.randrange(0, limit + 1) for _ in range(nseg + 1))
        t[: nseg + 1] = vals
        return t

    def raw_segments(self, hostile):
        r = self.rng
        src = r.choice(self.arenas)
        nseg = r.randrange(0, self.maxseg + 1)
        table = self.table(nseg, self.arena_elems)
        seg, out, dt = table.ctypes.data, self.seg_out.ctypes.data, r.randrange(3)
        if hostile:
            kind = r.randrange(8)
            nseg = max(nseg, 1)
            if kind == 0:
                nseg = r.choice([-1, 2 ** 48 + 1, 2 ** 63 - 1])
            elif kind == 1:
                seg = 0
            elif kind == 2:
                seg += r.choice([1, 4])
            elif kind == 3:
                out = r.choice([0, out + 4])
            elif kind == 4:
                table[0] = -r.randrange(1, 2 ** 40)
            elif kind == 5:
                table[: nseg + 1] = list(range(nseg + 1))[::-1] if nseg else [0]
                table[0] = max(int(table[0]), 1) if nseg else -1
            elif kind == 6:
                table[nseg] = r.randrange(2 ** 48 + 1, 2 ** 63)
            else:
                dt = r.choice([3, -1])
        args = (src.ctypes.data, dt, seg, nseg, out, r.choice([0, 1, 2]))
        self.note(f"_raw_segment_sum_sq{args} hostile={hostile} table={table[:8].tolist()}")
        try:
            apex_C._raw_segment_sum_sq(*args)
            self.accepted += 1
        except EXPECTED:
            return
        if hostile:
            raise AssertionError(f"hostile call returned normally: _raw_segment_sum_sq{args}")

    def optim(self):
        r = self.rng
        kernels = sorted(n for n in dir(apex_C)
                         if n.endswith("_step") or "_stage" in n or n in ("_raw_row_dots", "_raw_grad_sum_sq"))
        name = r.choice(kernels)
        a = apex_C.OptArgs()
        a.pdt, a.gdt = r.choice([0, 0, 1, 2]), r.choice([0, 0, 1, 2])
        nseg = r.randrange(0, self.maxseg + 1)
        limit = self.arena_elems
        table = self.table(nseg, limit)
        a.nseg, a.seg = nseg, table.ctypes.data
        bufs = iter(self.arenas)
        for field in ("p", "g", "s0", "s1", "s2"):
            setattr(a, field, next(bufs).ctypes.data if r.random() < 0.92 else 0)
        if r.random() < 0.3:
            a.out, a.odt = next(bufs).ctypes.data, r.choice([0, 1, 2])
        if r.random() < 0.3 and nseg:
            ends = self.tables[1]
            for k in range(nseg):
                ends[k] = r.randrange(int(table[k]), int(table[k + 1]) + 1)
            a.seg_end = ends.ctypes.data
        for field, arr in self.per_seg.items():
            if r.random() < 0.7:
                arr[:] = [r.choice([1.0, 2.0, 0.0, 0.5, 1e9]) for _ in range(self.maxseg)]
                setattr(a, field, arr.ctypes.data)
        for field, arr in self.flags.items():
            if r.random() < 0.3:
                arr[:] = [r.randrange(2) for _ in range(self.maxseg)]
                setattr(a, field, arr.ctypes.data)
        if r.random() < 0.7:
            a.seg_out = self.seg_out.ctypes.data
        a.hp = [r.choice([0.0, 0.9, 0.999, 1e-8, 1e-3, -1.0, float("nan")]) for _ in range(r.randrange(0, 14))]
        a.flags = r.randrange(0, 512)
        a.threads = r.choice([0, 1, 2, 3])
        a.grad_scale = r.choice([1.0, 0.5, float("inf")])
        hostile = r.random() < 0.4
        if hostile:
            kind = r.randrange(9)
            a.nseg = max(nseg, 1)
            table[a.nseg] = max(int(table[a.nseg]), 1)  # a non-empty extent, so a wrapping address is caught
            a.p, a.g, a.seg = a.p or self.arenas[0].ctypes.data, a.g or self.arenas[1].ctypes.data, table.ctypes.data
            if kind == 0:
                a.nseg = r.choice([2 ** 48 + 1, 2 ** 62, 2 ** 63 - 1])
            elif kind == 1:
                table[0] = -1
            elif kind == 2:
                table[1] = table[0] - 1 if table[0] > 0 else -1
            elif kind == 3:
                table[a.nseg] = 2 ** 48 + r.randrange(1, 100)
            elif kind == 4:
                a.seg += 4
            elif kind == 5:
                a.p += 1
            elif kind == 6:
                a.g = 2 ** 64 - 4
            elif kind == 7:
                a.pdt = r.choice([3, -1, 99])
            else:
                ends = self.tables[1]
                ends[: a.nseg] = table[1: a.nseg + 1] + 1
                a.seg_end = ends.ctypes.data
        self.note(f"{name} hostile={hostile} nseg={a.nseg} pdt={a.pdt} gdt={a.gdt} flags={a.flags} hp={a.hp}")
        try:
            getattr(apex_C, name)(a)
            self.accepted += 1
        except EXPECTED:
            return
        if hostile:
            raise AssertionError(f"hostile OptArgs accepted by {name}")

    def run(self, part: str, seconds: float) -> None:
        step = {"public": self.public, "raw": self.raw, "optim": self.optim}[part]
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            step()
        print(f"calls: {self.calls} ran: {self.accepted}")


class _DLOnly:
    """DLPack-only view of a numpy array; may relabel the exported dtype or claim another device."""

    def __init__(self, ctypes, arr, versioned, relabel, device):
        self.ctypes, self.arr, self.versioned, self.relabel, self.device = ctypes, arr, versioned, relabel, device

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, max_version=None, **kwargs):
        if not self.versioned and max_version is not None:
            raise TypeError("no max_version")
        cap = self.arr.__dlpack__(max_version=max_version) if max_version else self.arr.__dlpack__()
        if self.relabel is not None:
            ct = self.ctypes
            get = ct.pythonapi.PyCapsule_GetPointer
            get.restype, get.argtypes = ct.c_void_p, [ct.py_object, ct.c_char_p]
            name = ct.pythonapi.PyCapsule_GetName
            name.restype, name.argtypes = ct.c_char_p, [ct.py_object]
            nm = name(cap)
            ptr = get(cap, nm)
            # DLDataType sits after data (8), device (8), ndim (4): at byte 20 of DLTensor; the versioned
            # struct puts DLTensor after version (8), manager_ctx (8), deleter (8), flags (8)
            at = ptr + (32 if nm == b"dltensor_versioned" else 0) + 20
            ct.c_uint8.from_address(at).value, ct.c_uint8.from_address(at + 1).value = self.relabel
        return cap


class _BadDL:
    """Producers that break the protocol in different ways."""

    def __init__(self, kind):
        self.kind = kind

    def __dlpack_device__(self):
        return [(1, 0), "cpu", (1,), (2 ** 70, 0), None, (1, 0)][self.kind]

    def __dlpack__(self, **kwargs):
        if self.kind == 5:
            raise RuntimeError("producer failure")
        return [None, 5, "capsule", b"x", object()][self.kind % 5]


if __name__ == "__main__":
    part, seed, seconds, log = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    import warnings

    warnings.simplefilter("ignore")  # casts of random floats to ints warn; irrelevant here

    child = _Child(seed, log, with_torch=part == "public-torch")
    part = part.replace("-torch", "")
    try:
        child.run(part, seconds)
    except AssertionError as exc:
        print(exc, file=sys.stderr)
        sys.exit(3)
