"""Data-parallel entries: one data-parallel training step on 2 ranks (CPU, gloo), ours vs torch DDP.

The bench process is rank 0; setup spawns rank 1, which runs the same step
whenever rank 0 runs one (a pipe carries "ours" / "ref" and the "done" answer),
so a timed step covers both ranks' forward, backward, all-reduce and optimizer
step. Each rank uses one intra-op thread (two ranks fill the two cores here, so
communication cannot overlap computation on this machine; the entries measure
the per-step overhead of our bucketing and hooks against torch's C++ reducer).

Model: 6 x Linear(2048, 2048) with ReLU between (25.2M fp32 params), 32 rows per
rank (quick: 4 x Linear(512, 512), 8 rows). Both sides use the same bucket size:
ours numel / ddp_replica_count (combine_ddp's rule, 6.3M elements) or
``message_size`` set to it (apex DDP); torch DDP ``bucket_cap_mb`` set to the same
bytes, ``gradient_as_bucket_view=True``. Both sides zero grads the same way: torch's default
``zero_grad()`` (set to None) in ``DDP step``, in place (``set_to_none=False``) in the others.

* ``combine_ddp step``: amp O1 (bf16 autocast, dynamic loss scale) with
  ``combine_grad=True, combine_ddp=True`` and ``NpuFusedAdam`` vs
  torch DDP + ``torch.autocast(bf16)`` + ``torch.amp.GradScaler`` +
  ``torch.optim.Adam(fused=True)``: the same math (scaled backward, unscale and
  non-finite check, Adam).
* ``DDP step``: fp32 ``apex.parallel.DistributedDataParallel`` + ``NpuFusedAdam``
  vs torch DDP + ``torch.optim.Adam(fused=True)``, torch's default ``zero_grad()``: each
  backward's grads are copied into DDP's buffer, which the optimizer reads in place.
* ``DDP step, grads kept``: the same with ``zero_grad(set_to_none=False)``: DDP reduces in
  the optimizer's grad buffer (one buffer shared after the second step).

bytes/param (for the GB/s column only): the optimizer's 28 (fp32 Adam) plus the
gradient's read and write by the all-reduce (8).
"""

from __future__ import annotations

import datetime
import os
import tempfile
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.registry import Context, Entry, Registry

REGIME = "mlp-25M-2ranks"
WORLD = 2
PG_TIMEOUT = datetime.timedelta(seconds=300)


def _model(quick: bool) -> torch.nn.Module:
    width, depth = (512, 4) if quick else (2048, 6)
    torch.manual_seed(0)
    layers = []
    for i in range(depth):
        layers.append(torch.nn.Linear(width, width))
        if i < depth - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _data(rank: int, quick: bool):
    width, rows = (512, 8) if quick else (2048, 32)
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)


def _build(kind: str, rank: int, quick: bool) -> Dict[str, Any]:
    """Both sides of one entry on this rank: {"ours": step, "ref": step, ...}."""
    from apex import amp
    from apex.optimizers import NpuFusedAdam
    from apex.parallel import DistributedDataParallel
    from apex.parallel.reducer import combine_ddp_bucket_elems

    x, y = _data(rank, quick)
    ours_model, ref_model = _model(quick), _model(quick)
    numel = sum(p.numel() for p in ours_model.parameters())
    bucket = combine_ddp_bucket_elems(numel, 4, 4)
    cap_mb = bucket * 4 / 2**20
    lr = 1e-5  # tiny steps on a fixed batch: values stay bounded over any number of rounds
    ours_opt = NpuFusedAdam(ours_model.parameters(), lr=lr)
    ref_ddp = torch.nn.parallel.DistributedDataParallel(ref_model, bucket_cap_mb=cap_mb,
                                                        gradient_as_bucket_view=True)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=lr, fused=True)
    mse = torch.nn.functional.mse_loss
    st: Dict[str, Any] = {"numel": numel, "tensors": len(list(ours_model.parameters())), "bucket": bucket,
                          "ours_model": ours_model, "ref_model": ref_model}

    if kind == "combine_ddp":
        ours_model, ours_opt = amp.initialize(ours_model, ours_opt, opt_level="O1", combine_grad=True,
                                              combine_ddp=True, ddp_replica_count=4, verbosity=0,
                                              amp_dtype=torch.bfloat16)
        scaler = torch.amp.GradScaler("cpu")

        def ours():
            loss = mse(ours_model(x).float(), y)
            with amp.scale_loss(loss, ours_opt) as scaled:
                scaled.backward()
            ours_opt.step()
            ours_opt.zero_grad(set_to_none=False)

        def ref():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = ref_ddp(x)
            scaler.scale(mse(out.float(), y)).backward()
            scaler.step(ref_opt)
            scaler.update()
            ref_opt.zero_grad(set_to_none=False)

        st["teardown"] = amp.deinitialize
    else:
        ours_ddp = DistributedDataParallel(ours_model, message_size=bucket)
        keep = kind == "ddp_kept"

        def ours():
            mse(ours_ddp(x), y).backward()
            ours_opt.step()
            ours_opt.zero_grad(set_to_none=not keep)

        def ref():
            mse(ref_ddp(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=not keep)

        st["teardown"] = lambda: None
    st["ours"], st["ref"] = ours, ref
    return st


def _init(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=PG_TIMEOUT)


def _rank1(kind: str, quick: bool, store: str, conn) -> None:
    torch.set_num_threads(1)
    _init(1, store)
    st = _build(kind, 1, quick)
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            break
        st[cmd]()
        conn.send("done")
    st["teardown"]()
    dist.destroy_process_group()


def _setup(ctx: Context, kind: str) -> Dict[str, Any]:
    if dist.is_initialized():
        raise RuntimeError("entries_ddp needs to create the default process group; one is already initialized")
    tmp = tempfile.TemporaryDirectory(prefix="apex-bench-ddp-")
    store = os.path.join(tmp.name, "store")
    mpctx = mp.get_context("spawn")
    parent, child = mpctx.Pipe()
    proc = mpctx.Process(target=_rank1, args=(kind, ctx.quick, store, child), daemon=True)
    proc.start()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _init(0, store)
    st = _build(kind, 0, ctx.quick)
    if parent.recv() != "ready":
        raise RuntimeError("rank 1 did not start")
    st.update(conn=parent, proc=proc, tmp=tmp, threads=threads)
    return st


def _step(st: Dict[str, Any], which: str) -> None:
    st["conn"].send(which)
    st[which]()
    if st["conn"].recv() != "done":
        raise RuntimeError("rank 1 lost step")


def _teardown(st: Dict[str, Any]) -> None:
    try:
        st["conn"].send("stop")
        st["proc"].join(timeout=60)
    finally:
        if st["proc"].is_alive():
            st["proc"].kill()
        st["teardown"]()
        dist.destroy_process_group()
        torch.set_num_threads(st["threads"])
        st["tmp"].cleanup()


def _verify(st: Dict[str, Any], tol: dict) -> None:
    """From the same initial params, one step of each side gives the same params (rank 0's copy)."""
    _step(st, "ours")
    _step(st, "ref")
    ours = torch.cat([p.detach().reshape(-1) for p in st["ours_model"].parameters()])
    ref = torch.cat([p.detach().reshape(-1) for p in st["ref_model"].parameters()])
    torch.testing.assert_close(ours, ref, **tol)


def register(reg: Registry) -> None:
    common = dict(regime=REGIME, ours=lambda st: _step(st, "ours"), torch_ref=lambda st: _step(st, "ref"),
                  bytes_per_param=36, teardown=_teardown, target_ratio=1.05, group="distributed",
                  devices=("cpu",))
    reg.add(Entry(
        name="combine_ddp step",
        setup=lambda ctx: _setup(ctx, "combine_ddp"),
        executor="amp O1 combine_ddp + NpuFusedAdam (gloo)",
        ref_label="torch DDP + autocast bf16 + GradScaler + Adam(fused=True)",
        verify=lambda st: _verify(st, dict(rtol=1e-4, atol=1e-6)),
        dtype="bf16 autocast",
        notes="2 ranks x 1 thread; same bucket size both sides",
        **common,
    ))
    for kind, name, zero in (("ddp", "DDP step", "zero_grad()"),
                             ("ddp_kept", "DDP step, grads kept", "zero_grad(set_to_none=False)")):
        reg.add(Entry(
            name=name,
            setup=lambda ctx, kind=kind: _setup(ctx, kind),
            executor="apex.parallel.DistributedDataParallel + NpuFusedAdam (gloo)",
            ref_label=f"torch DDP + Adam(fused=True) + {zero}",
            verify=lambda st: _verify(st, dict(rtol=1e-5, atol=1e-7)),
            notes="2 ranks x 1 thread; same bucket size both sides",
            zero_grad="set_to_none" if kind == "ddp" else "kept",
            **common,
        ))
