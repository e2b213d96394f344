"""Timing: interleaved rounds of ours vs torch, the bandwidth roofline, and a progress display."""

from __future__ import annotations

import gc
import logging
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from bench import env, phases
from bench.registry import Context, Entry

log = logging.getLogger("bench")


class Progress:
    """tqdm progress bar, or a log line per stage when tqdm is not installed."""

    def __init__(self, total: int, enabled: bool = True):
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="call", dynamic_ncols=True)
            except ImportError:
                log.warning("tqdm is not installed: progress is logged per entry instead")

    def stage(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description(text[:60])
        else:
            log.info("%s", text)

    def step(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def make_sync(device: str) -> Callable[[], None]:
    """Waits for queued device work (timings of asynchronous devices need it); a no-op on CPU."""
    if device.startswith("cuda"):
        return torch.cuda.synchronize
    if device.startswith("npu"):
        return torch.npu.synchronize  # only reached when torch_npu is loaded
    return lambda: None


class Call:
    """A timed callable, with untimed preparation before it; `self_timed`: it returns its own seconds."""

    def __init__(self, fn: Callable[[], object], prepare: Optional[Callable[[], None]] = None,
                 self_timed: bool = False):
        self.fn, self.prepare, self.self_timed = fn, prepare, self_timed


def _as_call(fn) -> Call:
    return fn if isinstance(fn, Call) else Call(fn)


def _timed(fn, sync: Callable[[], None]) -> float:
    call = _as_call(fn)
    if call.prepare is not None:
        call.prepare()
    sync()
    t0 = time.perf_counter_ns()
    out = call.fn()
    sync()
    wall = (time.perf_counter_ns() - t0) / 1e9
    if call.self_timed:
        if not isinstance(out, (int, float)) or out <= 0:
            raise TypeError(f"a self-timed benchmark callable must return its seconds (> 0), got {out!r}")
        return float(out)
    return wall


def stats(samples: List[float]) -> Dict[str, float]:
    a = np.asarray(samples, dtype=np.float64)
    return {
        "median_s": float(np.median(a)),
        "p10_s": float(np.percentile(a, 10)),
        "p90_s": float(np.percentile(a, 90)),
        "min_s": float(a.min()),
        "n": int(a.size),
    }


def interleave(fns: Dict[str, object], rounds: int, warmup: int, sync, progress: Progress,
               ) -> Dict[str, Dict[str, float]]:
    """Warmups, then `rounds` rounds in which every function (a callable or a `Call`) runs once; the order
    alternates every round so that slow drift (frequency, other load) falls on all sides alike. GC is paused
    while timing (preparations included, so a collection never lands in the next timed call)."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            call = _as_call(fns[name])
            if call.prepare is not None:
                call.prepare()
            call.fn()
            progress.step()
    samples: Dict[str, List[float]] = {name: [] for name in names}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                samples[name].append(_timed(fns[name], sync))
                progress.step()
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: stats(s) for name, s in samples.items()}


def roofline_steps(rounds: int, warmup: int) -> int:
    return 2 * (rounds + warmup)


class Roofline:
    """Best achievable streaming bandwidth here, with torch: copy (8 B/elem) and in-place axpy (12 B/elem).

    Both run on `numel` fp32 elements (far larger than any cache) with the threads the entries use; `calls()`
    are the two timed callables (to run alone, or interleaved with an entry's rounds), `summary()` turns their
    timings into GB/s.
    """

    NAMES = ("roofline copy", "roofline axpy")

    def __init__(self, numel: int, device: str):
        self.numel = numel
        self.x = torch.empty(numel, dtype=torch.float32, device=device).uniform_(-1.0, 1.0)
        self.y = torch.empty_like(self.x).uniform_(-1.0, 1.0)
        self.nbytes = 2 * 4 * numel
        self._alpha = 1e-3

    def _axpy(self) -> None:
        self.y.add_(self.x, alpha=self._alpha)
        self._alpha = -self._alpha  # keeps y bounded over any number of rounds

    def calls(self) -> Dict[str, Call]:
        return {self.NAMES[0]: Call(lambda: self.y.copy_(self.x)), self.NAMES[1]: Call(self._axpy)}

    def summary(self, timings: Dict[str, Dict[str, float]]) -> Dict[str, float]:
        copy, axpy = (timings[n]["median_s"] for n in self.NAMES)
        copy_gbs, axpy_gbs = 8 * self.numel / copy / 1e9, 12 * self.numel / axpy / 1e9
        return {"numel": self.numel, "copy_gbs": copy_gbs, "axpy_gbs": axpy_gbs,
                "best_gbs": max(copy_gbs, axpy_gbs), "copy_ms": copy * 1e3, "axpy_ms": axpy * 1e3}


def measure_roofline(numel: int, device: str, rounds: int, warmup: int, progress: Progress) -> Dict[str, float]:
    """The roofline on its own (before and after the entries of a run)."""
    roof = Roofline(numel, device)
    return roof.summary(interleave(roof.calls(), rounds, warmup, make_sync(device), progress))


def entry_steps(rounds: int, warmup: int, roofline: bool = False) -> int:
    return 2 + 2 * (rounds + warmup) + (roofline_steps(rounds, warmup) if roofline else 0)


def entry_rounds(entry: Entry, rounds: int, warmup: int) -> tuple:
    """The rounds and warmups an entry runs: the run's, capped by the entry's own."""
    r = rounds if entry.rounds is None else min(rounds, entry.rounds)
    w = warmup if entry.warmup is None else min(warmup, entry.warmup)
    return r, w


def _calls(entry: Entry, state: Dict[str, object]) -> Dict[str, Call]:
    def bind(hook):
        return None if hook is None else (lambda: hook(state))

    return {
        "ours": Call(lambda: entry.ours(state), bind(entry.before_ours), entry.self_timed),
        "ref": Call(lambda: entry.torch_ref(state), bind(entry.before_ref), entry.self_timed),
    }


def run_entry(entry: Entry, ctx: Context, rounds: int, warmup: int, progress: Progress,
              profile: str = "missed", roofline_numel: Optional[int] = None) -> Dict[str, object]:
    """Times one entry; returns its result record (times in seconds, GB/s, memory in MiB).

    An entry with a share-of-roofline target (and `roofline_numel`) runs the roofline's copy and axpy in the
    same interleaved rounds as ours and torch: this host's bandwidth drifts by a quarter and more over a run,
    so the share is read against the bandwidth of the same seconds (`roofline_near`). Its buffers exist before
    the RSS baseline is taken, and their bytes are taken off the recorded RSS.
    profile: "missed" profiles a few calls of ours when the entry misses a target (ratio, or its share of
    that roofline), "all" always, "none" never (bench/phases.py).
    """
    sync = make_sync(ctx.device)
    rounds, warmup = entry_rounds(entry, rounds, warmup)
    progress.stage(f"{entry.name} [{entry.regime}]")
    gc.collect()
    roof = Roofline(roofline_numel, ctx.device) if entry.target_roofline is not None and roofline_numel else None
    roof_mib = roof.nbytes / 2**20 if roof is not None and roof.x.device.type == "cpu" else 0.0  # host RSS only
    rss_before = env.rss_mib()
    peak_reset = env.reset_peak_rss()
    t0 = time.perf_counter()
    state = entry.setup(ctx)
    setup_s = time.perf_counter() - t0
    if "numel" not in state:
        raise KeyError(f"{entry.key}: setup() must return a dict with 'numel'")
    numel = int(state["numel"])
    tensors = state.get("tensors")
    try:
        verified: Optional[bool] = None
        if entry.verify is not None:
            entry.verify(state)
            verified = True
        executor = entry.executor(state) if callable(entry.executor) else entry.executor
        calls = _calls(entry, state)
        first_ours = _timed(calls["ours"], sync)
        progress.step()
        first_ref = _timed(calls["ref"], sync)
        progress.step()
        timings = interleave({**calls, **(roof.calls() if roof is not None else {})}, rounds, warmup, sync, progress)
        peak = env.peak_rss_mib()
        near = roof.summary(timings) if roof is not None else None
        ratio = timings["ours"]["median_s"] / timings["ref"]["median_s"]
        gbytes = entry.bytes_per_param * numel / 1e9
        missed = (entry.target_ratio is not None and ratio > entry.target_ratio) or (
            near is not None and gbytes / timings["ours"]["median_s"] < entry.target_roofline * near["best_gbs"])
        profiled = None
        if profile == "all" or (profile == "missed" and missed):
            progress.stage(f"profile: {entry.name} [{entry.regime}]")
            try:
                profiled = phases.profile_calls(calls["ours"], sync, calls=2 if ctx.quick else 3)
            except Exception as exc:  # a profile is diagnostics: its failure must not lose the timings
                log.warning("%s: the profile run failed (%s: %s)", entry.key, type(exc).__name__, exc)
        extra = dict(state.get("record") or {})
    finally:
        if entry.teardown is not None:
            entry.teardown(state)
        state.clear()  # drops the entry's buffers before the next entry allocates its own
        gc.collect()
    ours, ref = timings["ours"], timings["ref"]
    return {
        "name": entry.name,
        "regime": entry.regime,
        "group": entry.group,
        "dtype": entry.dtype,
        "executor": executor,
        "ref_label": entry.ref_label,
        "numel": numel,
        "tensors": tensors,
        "bytes_per_param": entry.bytes_per_param,
        "ours": ours,
        "ref": ref,
        "ratio": ratio,
        "speedup": 1.0 / ratio,
        "ours_gbs": gbytes / ours["median_s"],
        "ref_gbs": gbytes / ref["median_s"],
        "first_ours_s": first_ours,
        "first_ref_s": first_ref,
        "setup_s": setup_s,
        "target_ratio": entry.target_ratio,
        "target_met": None if entry.target_ratio is None else ratio <= entry.target_ratio,
        "target_roofline": entry.target_roofline,
        "roofline_near": near,
        "zero_grad": entry.zero_grad,
        "rounds": rounds,
        "warmup": warmup,
        "self_timed": entry.self_timed,
        "profile": profiled,
        "extra": extra,
        "verified": verified,
        "rss_before_mib": None if rss_before is None else rss_before - roof_mib,
        "peak_rss_mib": None if peak is None else peak - roof_mib,
        "peak_rss_exact": peak_reset,
        "notes": entry.notes,
    }
