"""Run by tests/test_deepspeed.py in a child process (DeepSpeed sets process-wide state: the accelerator, a
process group): DeepSpeed's ``"amp"`` config section over this package's amp, one rank on the CPU.

``python _deepspeed_amp.py O1|O2`` prints one JSON line per (optimizer, accumulation, clipping): the losses,
whether amp.initialize ran on the optimizer, the model's param dtypes, and the largest difference between a run
resumed from a DeepSpeed checkpoint and the same run without a stop.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

from apex.optimizers import FusedAdam, FusedSGD, NpuFusedAdamW

OPTIMIZERS = {
    "torch AdamW": lambda ps: torch.optim.AdamW(ps, lr=3e-3),
    "FusedAdam": lambda ps: FusedAdam(ps, lr=3e-3),
    "NpuFusedAdamW": lambda ps: NpuFusedAdamW(ps, lr=3e-3),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9),
}


def _engine(deepspeed, opt_level, name, accumulation, clip):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation,
              "amp": {"enabled": True, "opt_level": opt_level}, "steps_per_print": 10**9}
    if clip:
        config["gradient_clipping"] = clip  # DeepSpeed clips amp.master_params(optimizer)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=OPTIMIZERS[name](model.parameters()),
                                           config=config)
    return engine


def _train(engine, batches):
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
        engine.backward(loss)  # amp.scale_loss(..., delay_unscale=inside an accumulation window)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def main() -> None:
    opt_level = sys.argv[1]
    import deepspeed

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 4, generator=gen)
    batches = []
    for _ in range(48):
        x = torch.randn(4, 16, generator=gen)
        batches.append((x, (x @ w).argmax(1)))  # a learnable labelling
    for name in OPTIMIZERS:
        for accumulation, clip in ((1, 0.0), (2, 1.0)):
            engine = _engine(deepspeed, opt_level, name, accumulation, clip)
            losses = _train(engine, batches[:24])
            with tempfile.TemporaryDirectory() as d:
                engine.save_checkpoint(d, tag="t")
                losses += _train(engine, batches[24:])
                again = _engine(deepspeed, opt_level, name, accumulation, clip)
                again.load_checkpoint(d, tag="t")
                _train(again, batches[24:])
            diff = max(float((a.detach().float() - b.detach().float()).abs().max())
                       for a, b in zip(engine.module.parameters(), again.module.parameters()))
            print(json.dumps(dict(
                name=name, accumulation=accumulation, clip=clip, losses=losses, resume_diff=diff,
                amp_initialized=hasattr(engine.optimizer, "_amp_stash"),
                optimizer=type(engine.optimizer).__name__,
                dtypes=sorted({str(p.dtype) for p in engine.module.parameters()}),
            )), flush=True)


if __name__ == "__main__":
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(key, value)
    main()
