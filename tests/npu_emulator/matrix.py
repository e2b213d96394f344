"""The NPU training matrix on the emulated npu device: every amp configuration x every optimizer, checked for loss.

For each cell of  opt level {O1, O2} x loss scale {dynamic, static 128} x combine_grad {off, on} x optimizer
{torch SGD, torch Adam, every apex.optimizers NpuFused*, every NVIDIA-named Fused*}  and for two models (a small
CNN and a small transformer encoder, on generated data), train on the emulated npu and check:

* every training loss is finite;
* the final loss (mean of the last ``--tail`` steps) is within ``--tolerance`` (5 %) of the fp32 (O0) run of the
  same model, optimizer and combine_grad setting, trained from the same initial weights on the same batches;
* that fp32 run learned (its final loss is below 90 % of its first), so the comparison is not between two
  untrained models.

One more cell: two processes (gloo over the emulated device's host memory) train with combine_ddp; the check is
finite losses, a lower loss at the end than at the start, and identical parameters on both ranks.

Writes ``matrix.md`` and ``matrix.json`` to ``--out`` and exits non-zero when any cell fails.

    python tests/npu_emulator/matrix.py --out .cache/npu-matrix          # the whole matrix
    python tests/npu_emulator/matrix.py --models cnn --optimizers NpuFusedAdam --opt-levels O2
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SITE = HERE / "site"


def _use_emulator() -> None:
    """``import torch_npu`` -> the emulator's stand-in, here and in spawned children."""
    if str(SITE) not in sys.path:
        sys.path.insert(0, str(SITE))
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(SITE) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SITE), *parts])
    os.environ["APEX_NPU_EMULATOR"] = "1"


_use_emulator()

import torch  # noqa: E402
import torch_npu  # noqa: E402,F401  (the emulator's stand-in: loads the emulated npu backend)

from apex import _device, amp, optimizers  # noqa: E402

OPT_LEVELS = ("O1", "O2")
LOSS_SCALES = ("dynamic", 128.0)
COMBINE = (False, True)
MODELS = ("cnn", "transformer")
# The fp32 reference must end below this fraction of its first loss, or the comparison would prove nothing.
LEARNED = 0.9


def optimizer_factories() -> dict:
    """Name -> (params -> optimizer). Learning rates suit each update rule on these small models."""
    o = optimizers
    return {
        "torch.SGD": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        "torch.Adam": lambda p: torch.optim.Adam(p, lr=3e-3),
        "NpuFusedSGD": lambda p: o.NpuFusedSGD(p, lr=0.05, momentum=0.9),
        "NpuFusedAdam": lambda p: o.NpuFusedAdam(p, lr=3e-3),
        "NpuFusedAdamW": lambda p: o.NpuFusedAdamW(p, lr=3e-3, weight_decay=0.01),
        "NpuFusedAdamP": lambda p: o.NpuFusedAdamP(p, lr=3e-3),
        "NpuFusedAdadelta": lambda p: o.NpuFusedAdadelta(p, lr=1.0),
        "NpuFusedRMSprop": lambda p: o.NpuFusedRMSprop(p, lr=1e-3),
        "NpuFusedRMSpropTF": lambda p: o.NpuFusedRMSpropTF(p, lr=2e-2),
        "NpuFusedBertAdam": lambda p: o.NpuFusedBertAdam(p, lr=1e-3),
        "NpuFusedLamb": lambda p: o.NpuFusedLamb(p, lr=2e-2),
        "FusedSGD": lambda p: o.FusedSGD(p, lr=0.05, momentum=0.9),
        "FusedAdam": lambda p: o.FusedAdam(p, lr=3e-3),
        "FusedLAMB": lambda p: o.FusedLAMB(p, lr=2e-2),
        "FusedNovoGrad": lambda p: o.FusedNovoGrad(p, lr=0.2),
        "FusedAdagrad": lambda p: o.FusedAdagrad(p, lr=1e-2),
        "FusedMixedPrecisionLamb": lambda p: o.FusedMixedPrecisionLamb(p, lr=2e-2),
    }


# ---------------------------------------------------------------------------------------------------- models, data


def make_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "cnn":
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 4))
    return TinyTransformer()


class TinyTransformer(torch.nn.Module):
    """Token embedding + one pre-norm encoder layer + mean pooling + classifier."""

    def __init__(self, vocab: int = 16, dim: int = 32, classes: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(12, dim) * 0.1)
        self.layer = torch.nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=64, dropout=0.0,
                                                      batch_first=True, norm_first=True)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.layer(h).mean(dim=1))


def make_batches(kind: str, steps: int, device: torch.device) -> list:
    """Generated, learnable data: a noisy class template per image (cnn) or a token-count rule (transformer)."""
    g = torch.Generator().manual_seed(1)
    batches = []
    if kind == "cnn":
        # one colour and pattern per class, under noise
        templates = torch.randn(4, 3, 1, 1, generator=g) + 0.5 * torch.randn(4, 3, 8, 8, generator=g)
        for _ in range(steps):
            y = torch.randint(0, 4, (16,), generator=g)
            x = templates[y] + torch.randn(16, 3, 8, 8, generator=g)
            batches.append((x.to(device), y.to(device)))
    else:
        for _ in range(steps):
            t = torch.randint(0, 16, (16, 12), generator=g)
            y = (t < 4).sum(dim=1).clamp(max=3)  # how many "small" tokens, capped at 3
            batches.append((t.to(device), y.to(device)))
    return batches


# ---------------------------------------------------------------------------------------------------- one cell


def train(kind: str, opt_name: str, opt_level: str, loss_scale, combine_grad: bool, steps: int,
          device: torch.device) -> list:
    """Training losses of one configuration (fresh model from the same seed, same batches)."""
    model = make_model(kind).to(device)
    optimizer = optimizer_factories()[opt_name](model.parameters())
    kwargs = dict(opt_level=opt_level, verbosity=0)
    if opt_level != "O0":
        kwargs.update(loss_scale=loss_scale, combine_grad=combine_grad)
    model, optimizer = amp.initialize(model, optimizer, **kwargs)
    losses = []
    try:
        for x, y in make_batches(kind, steps, device):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    finally:
        amp.deinitialize()
    return losses


def final(losses: list, tail: int) -> float:
    return sum(losses[-tail:]) / len(losses[-tail:])


def run_matrix(args) -> list:
    device = torch.device("npu", 0)
    rows = []
    names = args.optimizers or list(optimizer_factories())
    for kind in args.models:
        for opt_name in names:
            for combine in COMBINE:
                start = time.monotonic()
                try:
                    ref = train(kind, opt_name, "O0", None, combine, args.steps, device)
                    ref_final, ref_error = final(ref, args.tail), None
                    if not ref_final < LEARNED * ref[0]:  # a reference that does not learn would make the check empty
                        ref_error = f"fp32 run did not learn: loss {ref[0]:.4f} -> {ref_final:.4f}"
                except Exception as exc:  # no reference: every cell of this row fails with the reason
                    ref_final, ref_error = None, f"fp32 run: {type(exc).__name__}: {exc}"[:300]
                for opt_level in args.opt_levels:
                    for scale in LOSS_SCALES:
                        row = dict(model=kind, optimizer=opt_name, opt_level=opt_level,
                                   loss_scale=scale, combine_grad=combine, fp32_final=ref_final)
                        if ref_error is not None:
                            row.update(ok=False, error=ref_error)
                            rows.append(row)
                            continue
                        try:
                            losses = train(kind, opt_name, opt_level, scale, combine, args.steps, device)
                        except Exception as exc:  # a failing cell is reported, not fatal to the matrix
                            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
                            rows.append(row)
                            continue
                        fin = final(losses, args.tail)
                        finite = all(math.isfinite(v) for v in losses)
                        rel = abs(fin - ref_final) / max(abs(ref_final), 1e-12)
                        row.update(final=fin, rel_diff=rel, finite=finite, first=losses[0],
                                   ok=finite and math.isfinite(ref_final) and rel <= args.tolerance)
                        rows.append(row)
                print(f"  {kind:11s} {opt_name:24s} combine_grad={combine!s:5s} "
                      f"{sum(r['ok'] for r in rows[-len(args.opt_levels) * len(LOSS_SCALES):])}/"
                      f"{len(args.opt_levels) * len(LOSS_SCALES)} ok  ({time.monotonic() - start:.1f} s)",
                      flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------- ddp cell


def _ddp_rank(rank: int, world: int, store: str, steps: int, result_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        torch.npu.set_device(rank)
        device = torch.device("npu", rank)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)).to(device)
        optimizer = optimizers.NpuFusedAdam(model.parameters(), lr=1e-2)
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2", combine_grad=True, combine_ddp=True,
                                          ddp_replica_count=2, verbosity=0)
        losses = []
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(2 * 16, 16, generator=g)
            y = torch.sin(x).sum(dim=1, keepdim=True) / 4
            x, y = x[rank * 16:(rank + 1) * 16].to(device), y[rank * 16:(rank + 1) * 16].to(device)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
        reference = flat.clone()
        dist.broadcast(reference, 0)
        same = bool(torch.equal(flat, reference))
        on_npu = all(p.device.type == "npu" for p in model.parameters())
        Path(result_dir, f"rank{rank}.json").write_text(json.dumps(dict(losses=losses, same=same, on_npu=on_npu)))
    finally:
        amp.deinitialize()
        dist.destroy_process_group()


def run_ddp(steps: int) -> dict:
    row = dict(model="mlp", optimizer="NpuFusedAdam", opt_level="O2", loss_scale="dynamic", combine_grad=True,
               cell="combine_ddp, 2 processes, gloo")
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            torch.multiprocessing.spawn(_ddp_rank, args=(2, os.path.join(tmp, "store"), steps, tmp), nprocs=2)
            ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    except Exception as exc:
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
        return row
    losses = ranks[0]["losses"]
    finite = all(math.isfinite(v) for r in ranks for v in r["losses"])
    k = max(1, steps // 5)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    row.update(first=first, final=last, finite=finite, params_identical=all(r["same"] for r in ranks),
               on_npu=all(r["on_npu"] for r in ranks), seconds=round(time.monotonic() - start, 1))
    row["ok"] = finite and row["params_identical"] and row["on_npu"] and last < first
    return row


# ---------------------------------------------------------------------------------------------------- report


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


def write_report(out: Path, rows: list, ddp: dict | None, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.json").write_text(json.dumps(dict(meta=meta, cells=rows, ddp=ddp), indent=1))
    lines = [
        "# NPU matrix on the emulated npu device",
        "",
        f"torch {meta['torch']}, {meta['steps']} steps per run, final loss = mean of the last {meta['tail']} "
        f"steps, tolerance {meta['tolerance']:.0%} of the fp32 (O0) run of the same model / optimizer / "
        f"combine_grad; {meta['passed']}/{meta['cells']} cells passed in {meta['seconds']:.0f} s "
        f"({meta['cpu']}).",
        "",
        "Emulated device: device-generic logic, dtypes and control flow on a non-CPU device type; not Ascend "
        "numerics or speed (docs/npu-emulator.md).",
        "",
        "| model | optimizer | opt | loss scale | combine_grad | fp32 final | final | rel. diff | finite | ok |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['optimizer']} | {r['opt_level']} | {r['loss_scale']} | "
            f"{'on' if r['combine_grad'] else 'off'} | {_fmt(r.get('fp32_final'))} | {_fmt(r.get('final'))} | "
            f"{_fmt(r.get('rel_diff'))} | {_fmt(r.get('finite'))} | "
            f"{'yes' if r['ok'] else 'NO: ' + r.get('error', 'outside tolerance')} |")
    if ddp is not None:
        lines += ["", "## combine_ddp, 2 processes (gloo over the emulated device)", "",
                  "| first loss | final loss | finite | params identical on both ranks | on npu | ok |",
                  "|---|---|---|---|---|---|",
                  f"| {_fmt(ddp.get('first'))} | {_fmt(ddp.get('final'))} | {_fmt(ddp.get('finite'))} | "
                  f"{_fmt(ddp.get('params_identical'))} | {_fmt(ddp.get('on_npu'))} | "
                  f"{'yes' if ddp['ok'] else 'NO: ' + ddp.get('error', 'check failed')} |"]
    (out / "matrix.md").write_text("\n".join(lines) + "\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(".cache") / "npu-matrix")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tail", type=int, default=5, help="final loss = mean of the last TAIL training losses")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--optimizers", nargs="+", choices=list(optimizer_factories()), default=None)
    p.add_argument("--opt-levels", nargs="+", choices=OPT_LEVELS, default=list(OPT_LEVELS))
    p.add_argument("--ddp-steps", type=int, default=20)
    p.add_argument("--no-ddp", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if _device.detect_device() != "npu":
        raise SystemExit("npu matrix: apex does not detect the emulated npu")
    torch.set_num_threads(1)  # tiny models: threads only add overhead, and the runner has 2 shared cores
    start = time.monotonic()
    rows = run_matrix(args)
    ddp = None if args.no_ddp else run_ddp(args.ddp_steps)
    cells = len(rows) + (ddp is not None)
    passed = sum(r["ok"] for r in rows) + bool(ddp and ddp["ok"])
    meta = dict(torch=torch.__version__, steps=args.steps, tail=args.tail, tolerance=args.tolerance,
                cells=cells, passed=passed, seconds=time.monotonic() - start, cpu=platform.processor() or
                platform.machine())
    write_report(args.out, rows, ddp, meta)
    print(f"npu matrix: {passed}/{cells} cells passed in {meta['seconds']:.0f} s; report: {args.out}/matrix.md")
    return 0 if passed == cells else 1


if __name__ == "__main__":
    sys.exit(main())
