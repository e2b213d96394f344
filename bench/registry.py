"""Benchmark entries and the registry the runner reads them from.

An *entry* compares one operation of ours with the best torch implementation of the same math, on the same
data, in the same process. The runner (``bench/timing.py``) calls ``setup`` once, then ``ours`` and
``torch_ref`` alternately, and reports medians, achieved GB/s and the ratio ours / torch.

Adding entries
--------------
Any module ``bench/entries_<topic>.py`` that defines ``register(reg)`` is picked up by ``bench/run.py``
(sorted by file name). ``register`` receives a :class:`Registry` and calls ``reg.add(Entry(...))``. Shapes of
the standard regimes come from ``bench.shapes``. Example, an optimizer entry for ``bench/entries_optim.py``::

    import torch
    from bench import env, shapes
    from bench.registry import Entry

    def _setup(ctx, regime):
        ours = shapes.make_params(shapes.regime_shapes(regime, ctx.quick), seed=0, device=ctx.device)
        ref = shapes.make_params(shapes.regime_shapes(regime, ctx.quick), seed=0, device=ctx.device)
        from apex.optimizers import NpuFusedAdam
        return {
            "numel": shapes.numel_of(ours),
            "tensors": len(ours),
            "ours": NpuFusedAdam(ours, lr=1e-3),
            "ref": torch.optim.Adam(ref, lr=1e-3, fused=True),
        }

    def register(reg):
        for regime in shapes.REGIMES:
            reg.add(Entry(
                name="Adam step",
                regime=regime,
                setup=lambda ctx, regime=regime: _setup(ctx, regime),
                ours=lambda st: st["ours"].step(),
                torch_ref=lambda st: st["ref"].step(),
                bytes_per_param=28,  # read p, g, m, v; write p, m, v (fp32)
                executor=lambda st: env.apex_executor(st["ours"].param_groups[0]["params"][0]),
                ref_label="torch.optim.Adam(fused=True)",
                target_ratio=1.05 if regime == "model-145" else 0.1,  # <= 1.05x torch; 10x faster
            ))

``ours`` / ``torch_ref`` are called many times on the same state: they must keep values bounded (alternate a
scale and its inverse, or use tiny learning rates) so that no run drifts into denormals, which are slow on
x86 and would distort the timings. The first call of each is timed separately (``first_ms``: combining,
lazy state allocation).

Work that belongs to the round but not to the measurement (fresh gradient tensors as autograd would create them,
a forward/backward before a step, building a Trainer) goes into ``before_ours`` / ``before_ref``: called on the
state right before every call of ``ours`` / ``torch_ref`` (first call, warmups and timed rounds), never timed.
An entry whose callables measure themselves (a Trainer's ``train_runtime``) sets ``self_timed``: they return
seconds, which replace the wall time around the call.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Union

__all__ = ["Context", "Entry", "Registry"]


@dataclass
class Context:
    """What an entry's setup may depend on."""

    quick: bool = False  # smaller sizes (CI smoke): numbers are not measurements
    device: str = "cpu"
    threads: int = 1  # torch intra-op threads (apex follows torch.get_num_threads())
    seed: int = 0


@dataclass
class Entry:
    """One comparison.

    setup(ctx) returns a dict with at least ``numel`` (parameters/elements the operation covers) and, where it
    applies, ``tensors`` (how many tensors the reference sees); the same dict is passed to ours, torch_ref,
    verify and teardown.
    bytes_per_param: bytes the math must move per element at minimum (in-place unscale of fp32: read 4 +
    write 4 = 8); achieved GB/s = bytes_per_param * numel / median time, for both sides, so the numbers compare
    directly with the copy/axpy roofline measured in the same run.
    executor: label of the code path ours ran on (a string, or a callable on the state, e.g. "apex_C/avx512").
    target_ratio: pass when median(ours) / median(torch_ref) <= target_ratio (0.1 means "10x faster").
    target_roofline: pass when ours' GB/s >= target_roofline x the run's roofline (0.9 means "90% of it").
    verify(state): optional; raises AssertionError when ours and torch_ref disagree (run once, before timing).
    before_ours / before_ref(state): untimed preparation before every call of ours / torch_ref.
    self_timed: ours / torch_ref return the seconds to record (instead of the wall time around the call).
    rounds / warmup: caps on the run's rounds / warmups for entries whose one call is itself long (a whole
    training run); None = the run's values.
    zero_grad: the gradient pattern the entry reproduces: "set_to_none" (fresh grad tensors every step, torch's
    default) or "kept" (grads stay in place, zero_grad(set_to_none=False)); "" where it does not apply.
    """

    name: str
    regime: str
    setup: Callable[[Context], Dict[str, Any]]
    ours: Callable[[Dict[str, Any]], Any]
    torch_ref: Callable[[Dict[str, Any]], Any]
    bytes_per_param: float
    executor: Union[str, Callable[[Dict[str, Any]], str]]
    ref_label: str
    target_ratio: Optional[float] = None
    verify: Optional[Callable[[Dict[str, Any]], None]] = None
    teardown: Optional[Callable[[Dict[str, Any]], None]] = None
    dtype: str = "fp32"
    group: str = ""
    notes: str = ""
    devices: tuple = ("cpu", "cuda", "npu")
    target_roofline: Optional[float] = None
    before_ours: Optional[Callable[[Dict[str, Any]], None]] = None
    before_ref: Optional[Callable[[Dict[str, Any]], None]] = None
    self_timed: bool = False
    rounds: Optional[int] = None
    warmup: Optional[int] = None
    zero_grad: str = ""

    @property
    def key(self) -> str:
        return f"{self.name} [{self.regime}]"


@dataclass
class Registry:
    entries: List[Entry] = field(default_factory=list)

    def add(self, entry: Entry) -> Entry:
        if not isinstance(entry, Entry):
            raise TypeError(f"Registry.add: expected a bench.registry.Entry, got {type(entry).__name__}")
        if any(e.key == entry.key for e in self.entries):
            raise ValueError(f"Registry.add: duplicate entry {entry.key!r}")
        if entry.zero_grad not in ("", "set_to_none", "kept"):
            raise ValueError(f"Registry.add: {entry.key}: zero_grad must be '', 'set_to_none' or 'kept', got "
                             f"{entry.zero_grad!r}")
        if entry.bytes_per_param <= 0:
            raise ValueError(f"Registry.add: {entry.key}: bytes_per_param must be > 0, got {entry.bytes_per_param}")
        self.entries.append(entry)
        return entry

    def select(self, patterns: Optional[List[str]] = None, device: str = "cpu") -> List[Entry]:
        """Entries for `device` whose key matches any pattern (glob, or case-insensitive substring)."""
        chosen = [e for e in self.entries if device in e.devices]
        if not patterns:
            return chosen

        def hit(e: Entry, p: str) -> bool:
            return fnmatch.fnmatchcase(e.key, p) or fnmatch.fnmatchcase(e.name, p) or p.lower() in e.key.lower()

        return [e for e in chosen if any(hit(e, p) for p in patterns)]
