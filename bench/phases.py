"""Where our time goes: a cProfile run of a few calls of an entry's ``ours``, summarised per phase.

Used by the runner when an entry misses a target (``--profile missed``, the default) or always (``--profile
all``). The preparation before each call (fresh grads, a backward) runs outside the profiler, exactly as it runs
outside the timer. The summary, per call (``ms`` values are per call of ``ours``: one optimizer step, one
training iteration, or one whole Trainer run, as the entry times it):

- ``categories``: self time split into apex_C kernels (``apex_C.*`` functions: the SIMD loops), torch ops (torch's
  C functions and tensor methods: copies, allocations, views), apex Python (everything under the apex package:
  checks, grad adoption, bookkeeping) and other (Python outside apex, other builtins).
- ``phases``: apex's Python functions by cumulative time (a function's own time plus everything it calls),
  largest first: the step's phases as the code names them (the checks, the grad gather/adoption, the kernel
  call site).
- ``top_self``: the functions with the most self time, whatever their origin.

cProfile adds a fixed cost to every Python call, so Python-heavy phases read larger here than in the timed
median; compare phases with each other, and the profiled total with the median, not the absolute numbers.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import time
from typing import Callable, Dict, List, Optional

__all__ = ["format_profile", "profile_calls"]

TOP = 12


def _apex_dir() -> str:
    import apex

    return os.path.dirname(os.path.abspath(apex.__file__)) + os.sep


def _category(key, apex_dir: str) -> str:
    filename, _, func = key
    if filename == "~":
        if "apex_C." in func:
            return "apex_C kernels"
        if "torch" in func:
            return "torch ops"
        return "other"
    if os.path.abspath(filename).startswith(apex_dir):
        return "apex Python"
    return "other"


def _label(key, apex_dir: str) -> str:
    filename, line, func = key
    if filename == "~":
        return func
    path = os.path.abspath(filename)
    if path.startswith(apex_dir):
        path = "apex/" + path[len(apex_dir):]
    else:
        parts = path.split(os.sep)
        path = os.sep.join(parts[-2:])
    return f"{path}:{line}({func})"


def profile_calls(call, sync: Callable[[], None], calls: int = 3) -> Optional[Dict[str, object]]:
    """Runs `call` (a bench.timing.Call) `calls` times under cProfile; returns the per-call summary.

    None when a profiler is already active in this process (cProfile cannot nest): the run goes on without.
    """
    apex_dir = _apex_dir()
    prof = cProfile.Profile()
    wall = 0.0
    for _ in range(calls):
        if call.prepare is not None:
            call.prepare()
        sync()
        t0 = time.perf_counter()
        try:
            prof.enable()
        except ValueError:
            return None
        try:
            call.fn()
            sync()
        finally:
            prof.disable()
        wall += time.perf_counter() - t0
    stats = pstats.Stats(prof).stats
    per = 1e3 / calls
    cats: Dict[str, float] = {"apex_C kernels": 0.0, "torch ops": 0.0, "apex Python": 0.0, "other": 0.0}
    rows = []
    for key, (_cc, ncalls, tottime, cumtime, _callers) in stats.items():
        cat = _category(key, apex_dir)
        cats[cat] += tottime * per
        rows.append({"function": _label(key, apex_dir), "category": cat, "calls_per_call": ncalls / calls,
                     "self_ms": tottime * per, "cum_ms": cumtime * per})
    phases = sorted((r for r in rows if r["category"] == "apex Python"), key=lambda r: -r["cum_ms"])[:TOP]
    top_self = sorted(rows, key=lambda r: -r["self_ms"])[:TOP]
    return {
        "tool": "cProfile",
        "calls": calls,
        "profiled_ms_per_call": wall * per,
        "categories_ms": {k: round(v, 4) for k, v in cats.items()},
        "phases": [_rounded(r) for r in phases],
        "top_self": [_rounded(r) for r in top_self],
    }


def _rounded(row: Dict[str, object]) -> Dict[str, object]:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}


def format_profile(prof: Dict[str, object]) -> List[str]:
    """Markdown lines of one profile summary."""
    cats = ", ".join(f"{k} {v:.3g}" for k, v in prof["categories_ms"].items())
    lines = [f"  - {prof['tool']}, {prof['calls']} calls, {prof['profiled_ms_per_call']:.3g} ms/call under the "
             f"profiler; self time ms/call: {cats}"]
    if prof["phases"]:
        lines.append("  - apex phases (cumulative ms/call, times called): " + "; ".join(
            f"`{r['function']}` {r['cum_ms']:.3g} ({r['calls_per_call']:g})" for r in prof["phases"][:8]))
    lines.append("  - most self time (ms/call): " + "; ".join(
        f"`{r['function']}` {r['self_ms']:.3g}" for r in prof["top_self"][:6]))
    return lines
