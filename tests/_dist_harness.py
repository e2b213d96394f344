"""Persistent pools of spawned ranks for the distributed tests (gloo on CPU).

Starting a rank costs an interpreter plus ``import torch`` (seconds on a loaded
2-core machine), so each world size gets one pool of ranks per pytest process,
shared by every test module: ``get_pool(2).run("_dist_scenarios", "name", **kw)``
runs ``_dist_scenarios.name(rank, world, **kw)`` on every rank and returns the
per-rank results, or raises AssertionError with every rank's traceback.

Each rank has an initialized default gloo group (file store, a temporary
directory) and one intra-op thread, so ranks do not oversubscribe the cores.
After every scenario a rank undoes amp (``amp.deinitialize``). A pool whose
scenario timed out or whose rank died is discarded; the next ``get_pool`` starts
a fresh one.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import importlib
import os
import queue
import tempfile
import traceback
from multiprocessing.reduction import ForkingPickler  # torch.multiprocessing registers its tensor reductions here
from typing import Any, Dict, List, Optional

import torch.multiprocessing as mp

PG_TIMEOUT_S = 60.0  # collectives of a healthy scenario finish in far less; a stuck one fails within this


def _worker(rank: int, world: int, store: str, inq, outq) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    except BaseException:
        outq.put((rank, "error", traceback.format_exc()))
        return
    outq.put((rank, "ready", None))
    while True:
        msg = inq.get()
        if msg is None:
            break
        module, name, kwargs = msg
        try:
            torch.manual_seed(0)
            fn = getattr(importlib.import_module(module), name)
            result = fn(rank, world, **kwargs)
            ForkingPickler.dumps(result)  # fail here, not silently in the queue's feeder thread
            outq.put((rank, "ok", result))
        except BaseException:
            outq.put((rank, "error", traceback.format_exc()))
        finally:
            import sys

            amp = sys.modules.get("apex.amp")
            if amp is not None:
                amp.deinitialize()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


class Pool:
    def __init__(self, world: int, start_timeout: float = 240.0) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self._dir = tempfile.TemporaryDirectory(prefix="apex-dist-")
        store = os.path.join(self._dir.name, "store")
        self._inq = [ctx.Queue() for _ in range(world)]
        self._outq = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, args=(r, world, store, self._inq[r], self._outq), daemon=True)
                       for r in range(world)]
        for p in self._procs:
            p.start()
        self.broken = False
        self._collect("ready", start_timeout, what="starting the ranks")

    def _collect(self, expect: str, timeout: float, what: str) -> List[Any]:
        results: Dict[int, Any] = {}
        errors: Dict[int, str] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(results) + len(errors) < self.world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            try:
                rank, status, payload = self._outq.get(timeout=max(0.1, min(left, 1.0)))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if left <= 0 or dead:
                    self.close(kill=True)
                    raise AssertionError(f"{what}: ranks {sorted(set(range(self.world)) - set(results) - set(errors))}"
                                         f" gave no answer within {timeout:.0f}s (dead ranks: {dead})") from None
                continue
            if status == "error":
                errors[rank] = payload
            else:
                results[rank] = payload
        if errors:
            text = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
            raise AssertionError(f"{what} failed on ranks {sorted(errors)}:\n{text}")
        return [results[r] for r in range(self.world)]

    def run(self, module: str, name: str, timeout: float = 120.0, **kwargs: Any) -> List[Any]:
        if self.broken:
            raise RuntimeError("this pool was discarded")
        for q in self._inq:
            q.put((module, name, kwargs))
        return self._collect("ok", timeout, what=f"{module}.{name}({kwargs})")

    def close(self, kill: bool = False) -> None:
        if self.broken:
            return
        self.broken = True
        if not kill:
            for q in self._inq:
                q.put(None)
            for p in self._procs:
                p.join(timeout=20)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._dir.cleanup()


_pools: Dict[int, Pool] = {}


def get_pool(world: int) -> Pool:
    pool: Optional[Pool] = _pools.get(world)
    if pool is None or pool.broken:
        pool = _pools[world] = Pool(world)
    return pool


def run(world: int, name: str, timeout: float = 120.0, **kwargs: Any) -> List[Any]:
    """``_dist_scenarios.name(rank, world, **kwargs)`` on a pool of ``world`` ranks."""
    return get_pool(world).run("_dist_scenarios", name, timeout=timeout, **kwargs)


def spawn_once(world: int, name: str, timeout: float, pg_timeout_s: float, **kwargs: Any) -> List[Any]:
    """A throw-away group (for scenarios that kill a rank): each rank runs ``name`` right after init."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="apex-dist-") as d:
        outq = ctx.Queue()
        procs = [ctx.Process(target=_one_shot, args=(r, world, os.path.join(d, "store"), pg_timeout_s, name, kwargs,
                                                     outq), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        results: Dict[int, Any] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        try:
            while len(results) < world:
                left = (deadline - datetime.datetime.now()).total_seconds()
                if left <= 0:
                    break
                with contextlib.suppress(queue.Empty):
                    rank, payload = outq.get(timeout=min(left, 1.0))
                    results[rank] = payload
                    continue
                if all(not p.is_alive() for p in procs) and outq.empty():
                    break
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
        return [results.get(r) for r in range(world)]


def _one_shot(rank: int, world: int, store: str, pg_timeout_s: float, name: str, kwargs: dict, outq) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    fn = getattr(importlib.import_module("_dist_scenarios"), name)
    try:
        result = fn(rank, world, **kwargs)
    except BaseException:
        result = {"error": traceback.format_exc()}
    if result is not None:
        outq.put((rank, result))


@atexit.register
def _close_all() -> None:
    for pool in _pools.values():
        pool.close()
