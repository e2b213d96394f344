"""Benchmark runner: ``python bench/run.py [--quick] [--only PATTERN] [--out DIR]`` (also ``nox -s bench``).

Runs every registered entry (modules ``bench/entries_*.py``, see ``bench/registry.py``), each as interleaved
rounds of ours vs torch in this one process, plus the copy/axpy bandwidth roofline before and after. Writes
``benchmarks.json``, ``benchmarks.md`` and ``benchmarks.png`` to --out (default ``docs/`` for a full run;
``build/bench/`` for --quick or --only, so a smoke or partial run never overwrites the published numbers).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the checkout root
    _root = str(Path(__file__).resolve().parent.parent)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.path.insert(0, _root)

import torch

from bench import env, report, timing
from bench.registry import Context, Registry

log = logging.getLogger("bench")


def load_registry() -> Registry:
    """Imports every bench/entries_*.py (sorted) and calls its register(reg)."""
    reg = Registry()
    folder = Path(__file__).resolve().parent
    for mod in sorted(m.name for m in pkgutil.iter_modules([str(folder)]) if m.name.startswith("entries_")):
        module = importlib.import_module(f"bench.{mod}")
        hook = getattr(module, "register", None)
        if hook is None:
            raise AttributeError(f"bench/{mod}.py has no register(reg) function")
        hook(reg)
    return reg


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, few rounds (CI smoke; not a measurement)")
    p.add_argument("--only", action="append", metavar="PATTERN",
                   help="run entries whose 'name [regime]' matches (glob or substring); repeatable")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: docs/, or build/bench/ with "
                   "--quick or --only)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per entry (default 15; quick: 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 3; quick: 1)")
    p.add_argument("--device", default="cpu", help="torch device the entries run on (default: cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--roofline-numel", type=int, default=None, help="fp32 elements of the roofline buffers "
                   "(default 100M; quick: 10M)")
    p.add_argument("--list", action="store_true", help="list the entries and exit")
    p.add_argument("--no-png", action="store_true", help="skip the chart")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--check-targets", action="store_true", help="exit 1 if an entry misses a target (ratio "
                   "or share of the roofline)")
    p.add_argument("--profile", choices=("missed", "all", "none"), default="missed",
                   help="cProfile a few calls of ours and record where the time goes: for entries that miss a "
                   "target (default), for all, or none")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 5 if args.quick else 15
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.rounds < 1 or args.warmup < 0:
        p.error(f"--rounds must be >= 1 and --warmup >= 0, got {args.rounds} and {args.warmup}")
    if args.roofline_numel is None:
        args.roofline_numel = 10_000_000 if args.quick else 100_000_000
    if args.out is None:
        args.out = env.REPO / ("build/bench" if args.quick or args.only else "docs")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    env.import_apex()
    reg = load_registry()
    entries = reg.select(args.only, device=args.device.split(":")[0])
    if args.list:
        for e in reg.entries:
            sys.stdout.write(f"{e.key}\n")
        return 0
    if not entries:
        log.error("no entry matches %s (use --list)", args.only)
        return 2
    if not args.quick and args.rounds < 11:
        log.warning("%d rounds: medians of fewer than 11 rounds are not accepted as measurements", args.rounds)
    ctx = Context(quick=args.quick, device=args.device, threads=torch.get_num_threads())
    machine = env.machine_info(args.device)
    log.info("%d entries, %d rounds, %d warmups, device %s, %d threads; CPU %s, apex_C SIMD level %s",
             len(entries), args.rounds, args.warmup, args.device, ctx.threads, machine["cpu_model"],
             machine["simd_level"])

    total = 2 * timing.roofline_steps(args.rounds, args.warmup) + sum(
        timing.entry_steps(*timing.entry_rounds(e, args.rounds, args.warmup), e.target_roofline is not None)
        for e in entries)
    progress = timing.Progress(total, enabled=not args.no_progress)
    try:
        progress.stage("roofline (start)")
        roof_start = timing.measure_roofline(args.roofline_numel, args.device, args.rounds, args.warmup, progress)
        results, failed = [], []
        for e in entries:
            # one entry that cannot run here (a library version without an option it uses, a device without an
            # op) costs its own row, not the whole run's results
            try:
                results.append(timing.run_entry(e, ctx, args.rounds, args.warmup, progress, args.profile,
                                                args.roofline_numel))
            except Exception as exc:
                log.error("%s failed, left out of the results: %s: %s", e.key, type(exc).__name__, exc,
                          exc_info=args.verbose)
                failed.append(f"{e.key}: {type(exc).__name__}: {exc}")
        progress.stage("roofline (end)")
        roof_end = timing.measure_roofline(args.roofline_numel, args.device, args.rounds, args.warmup, progress)
    finally:
        progress.close()
    roof = dict(max(roof_start, roof_end, key=lambda r: r["best_gbs"]))
    roof["start_best_gbs"], roof["end_best_gbs"] = roof_start["best_gbs"], roof_end["best_gbs"]
    for e in results:
        # the share of a roofline target is read against the bandwidth measured in the entry's own rounds
        e["roofline_fraction_run"] = e["ours_gbs"] / roof["best_gbs"]
        near = e.get("roofline_near")
        e["roofline_fraction"] = e["ours_gbs"] / near["best_gbs"] if near else e["roofline_fraction_run"]
        e["target_roofline_met"] = (None if e["target_roofline"] is None
                                    else e["roofline_fraction"] >= e["target_roofline"])
    result = {
        "schema": 3,
        "machine": machine,
        "config": {"quick": args.quick, "rounds": args.rounds, "warmup": args.warmup, "only": args.only,
                   "threads": ctx.threads, "device": args.device},
        "roofline": roof,
        "roofline_runs": {"start": roof_start, "end": roof_end},
        "entries": results,
        "failed": failed,
        "loadavg_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    png = None if args.no_png else report.write_png(result, out)
    paths = [report.write_json(result, out), report.write_markdown(result, out, png.name if png else None)]
    if png:
        paths.append(png)
    sys.stdout.write(report.markdown(result, None))
    log.info("wrote %s", ", ".join(str(p) for p in paths))
    missed = [e for e in results if e["target_met"] is False or e["target_roofline_met"] is False]
    for e in missed:
        if e["target_met"] is False:
            log.warning("target missed: %s [%s]: ratio %.3f > %g", e["name"], e["regime"], e["ratio"],
                        e["target_ratio"])
        if e["target_roofline_met"] is False:
            log.warning("target missed: %s [%s]: %.0f%% of the roofline < %.0f%%", e["name"], e["regime"],
                        100 * e["roofline_fraction"], 100 * e["target_roofline"])
    for line in failed:
        log.error("entry failed: %s", line)
    if failed:
        return 1
    return 1 if (missed and args.check_targets) else 0


if __name__ == "__main__":
    sys.exit(main())
