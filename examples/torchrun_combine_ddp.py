"""Data-parallel training with amp's combine_ddp: no model wrapper, gradients all-reduced from the combined buffers.

    torchrun --nproc_per_node 2 examples/torchrun_combine_ddp.py --steps 100
    python examples/torchrun_combine_ddp.py --nproc 2 --steps 100     # the same without torchrun

Each rank trains an MLP (with SyncBatchNorm, so normalisation uses the statistics of the whole distributed batch)
on its own shard of a synthetic regression task. The process-group backend comes from the device:
``apex.parallel.default_backend()`` (gloo on cpu, nccl on cuda, hccl on npu). At the end every rank checks that
it holds exactly the same parameters as rank 0, and rank 0 prints the loss before and after.

What combine_ddp does (docs/distributed.md): params and buffers are broadcast from rank 0 in ``amp.initialize``;
after the first backward the flat gradient buffers are compared across ranks; from then on each bucket
(numel / ddp_replica_count elements) is all-reduced, pre-divided by the world size, as soon as its gradients are
complete, and all ranks agree on gradient overflow so they skip the same steps.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from apex import _device, amp
from apex.optimizers import NpuFusedAdam
from apex.parallel import convert_syncbn_model, default_backend


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32, help="rows per rank and step")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--opt-level", default="O2", choices=("O1", "O2"))
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--nproc", type=int, default=None,
                   help="spawn this many ranks here instead of being started by torchrun")
    p.add_argument("--timeout", type=float, default=120.0, help="process-group timeout in seconds")
    return p.parse_args(argv)


def make_model(dim: int) -> torch.nn.Module:
    torch.manual_seed(0)  # only rank 0's init matters: amp.initialize broadcasts it
    return torch.nn.Sequential(
        torch.nn.Linear(dim, 2 * dim, bias=False), torch.nn.BatchNorm1d(2 * dim), torch.nn.GELU(),
        torch.nn.Linear(2 * dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, 1))


def shard(step: int, rank: int, world: int, rows: int, dim: int, device: torch.device):
    """This rank's rows of the step's global batch: y = sum(sin(x)) + noise."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(rows * world, dim, generator=g)
    y = torch.sin(x).sum(dim=1, keepdim=True) / dim**0.5 + 0.01 * torch.randn(rows * world, 1, generator=g)
    lo = rank * rows
    return x[lo:lo + rows].to(device), y[lo:lo + rows].to(device)


def pick_device(local_rank: int) -> torch.device:
    kind = _device.detect_device()
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if kind == "npu":
        torch.npu.set_device(local_rank)  # torch_npu is loaded by detect_device
        return torch.device("npu", local_rank)
    return torch.device("cpu")


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = pick_device(int(os.environ.get("LOCAL_RANK", rank)))
    model = convert_syncbn_model(make_model(args.dim)).to(device)
    optimizer = NpuFusedAdam(model.parameters(), lr=args.lr)
    # combine_ddp needs combine_grad; the model is NOT wrapped in any DistributedDataParallel
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, combine_grad=True,
                                      combine_ddp=True, ddp_replica_count=4, verbosity=0)
    losses = []
    for step in range(args.steps):
        x, y = shard(step, rank, world, args.batch_size, args.dim, device)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    # every rank must hold exactly rank 0's parameters
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, 0)
    if not torch.equal(flat, reference):
        raise RuntimeError(f"rank {rank}: parameters differ from rank 0's after training")
    mean = torch.stack(losses).float()
    dist.all_reduce(mean)
    mean /= world
    if rank == 0:
        k = max(1, args.steps // 10)
        first, last = mean[:k].mean().item(), mean[-k:].mean().item()
        print(f"{world} ranks, {args.opt_level}, {args.steps} steps: loss {first:.4f} -> {last:.4f}; "
              f"params identical on every rank")
        if not last < first:
            raise RuntimeError("the loss did not decrease")


def run_rank(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    if world > 1 and _device.detect_device() == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(default_backend(), init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        train(args)
    finally:
        amp.deinitialize()
        dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.nproc is None:  # started by torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are set
        if "RANK" not in os.environ:
            sys.stderr.write("run under torchrun, or pass --nproc N to spawn N ranks here\n")
            return 2
        dist.init_process_group(default_backend(), timeout=datetime.timedelta(seconds=args.timeout))
        try:
            train(args)
        finally:
            amp.deinitialize()
            dist.destroy_process_group()
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(run_rank, args=(args.nproc, os.path.join(tmp, "store"), args),
                                    nprocs=args.nproc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
