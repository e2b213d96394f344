"""The examples run as users run them (fresh interpreter, CPU) and their training actually learns.

Each script is a subprocess so a broken import, argument parser or `__main__` block fails here exactly as it would
for a user. Every script in examples/ has a fast-tier run, and every training run must lower its loss. The step
budgets are small and the runs overlap (measured: 85 s for the file on 2 cores at load average 14).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if not ((ROOT / "examples").is_dir()):
    # `nox -s test-wheel` runs a copy of tests/ alone, away from the checkout; the `tests` session covers these
    pytest.skip(f"examples/ not found beside tests/ (under {ROOT})", allow_module_level=True)
EXAMPLES = ROOT / "examples"
QUICKSTARTS = sorted(p.name for p in EXAMPLES.glob("quickstart*.py"))
# One interpreter per script pays torch's import; 300 s only guards against a hang, the scripts take seconds.
TIMEOUT_S = 300


def _env() -> dict:
    # one thread each: the runs overlap, and on a small machine 2-thread runs side by side only contend
    env = dict(os.environ, APEX_DEVICE="cpu", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    src = str(ROOT / "src")
    if (ROOT / "src" / "apex").is_dir() and src not in env.get("PYTHONPATH", "").split(os.pathsep):
        # the in-tree package when run from a checkout; with an installed apex (test-wheel) there is no src/apex
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), src]))
    return env


TINY = ("--steps", "20", "--batch-size", "8", "--seq-len", "32", "--dim", "32", "--layers", "1", "--heads", "2",
        "--no-progress")
# Every fast-tier run, started together on first use: most of each run is torch's import and waiting on a loaded
# machine, so overlapping them keeps the file's wall time well under a minute.
FAST_RUNS = {name: (name,) for name in QUICKSTARTS}
FAST_RUNS.update({f"lm-{lvl}": ("train_tiny_lm.py", "--opt-level", lvl, *TINY) for lvl in ("O1", "O2")})
# 2 spawned gloo ranks, a small MLP with SyncBatchNorm: the script itself checks identical params on every rank
# and raises unless the loss decreased; the test parses its summary line too
DDP_TINY = ("--nproc", "2", "--steps", "30", "--batch-size", "16", "--dim", "16", "--timeout", "60")
FAST_RUNS["ddp"] = ("torchrun_combine_ddp.py", *DDP_TINY)
# every script in examples/ must be run by a test here (a new example without a test fails test_every_example_runs)
RUN_HERE = {cmd[0] for cmd in FAST_RUNS.values()}
LOSS = re.compile(r"loss (-?\d+\.\d+) -> (-?\d+\.\d+)")


def _start(name: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(EXAMPLES / name), *args], cwd=str(ROOT), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, label: str) -> str:
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{label} still running after {TIMEOUT_S} s\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{label} exited with {proc.returncode}\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}")
    return out


@pytest.fixture(scope="module")
def fast_runs():
    procs = {key: _start(*cmd) for key, cmd in FAST_RUNS.items()}
    yield {key: (proc, " ".join(FAST_RUNS[key])) for key, proc in procs.items()}
    for proc in procs.values():  # a failed test must not leave a script running
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def run_example(name: str, *args: str) -> str:
    return _finish(_start(name, *args), " ".join((name, *args)))


def test_every_example_runs_in_the_fast_tier():
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == RUN_HERE, f"examples without a fast-tier run: {sorted(scripts - RUN_HERE)}"


def loss_pair(out: str):
    """(first, last) from the script's "loss A -> B" summary line."""
    found = LOSS.findall(out)
    assert len(found) == 1, f"expected one 'loss A -> B' summary, got:\n{out}"
    return float(found[0][0]), float(found[0][1])


def test_the_three_seed_quickstarts_exist():
    for name in ("quickstart_amp_o1.py", "quickstart_combine_grad.py", "quickstart_fused_optimizer.py"):
        assert name in QUICKSTARTS, f"examples/{name} missing; found {QUICKSTARTS}"


@pytest.mark.parametrize("name", QUICKSTARTS)
def test_quickstart_runs(name, fast_runs):
    # each quickstart asserts its own outcome (loss decreased, one grad buffer, ...) and prints a summary line;
    # the training ones print "device cpu, ...: loss A -> B", and the loss must have gone down
    out = _finish(*fast_runs[name])
    if name == "quickstart_combine.py":  # no training: combine_tensors and the core
        assert "quickstart OK" in out, out
        return
    # the summary is the script's last line; amp's banner ("Selected optimization level ...") may precede it
    assert out.strip().splitlines()[-1].startswith("device cpu,"), out
    first, last = loss_pair(out)
    assert last < first, out


def test_torchrun_example_loss_decreases_and_ranks_agree(fast_runs):
    out = _finish(*fast_runs["ddp"])
    assert "2 ranks, O2, 30 steps" in out and "params identical on every rank" in out, out
    first, last = loss_pair(out)
    assert last < first, out


@pytest.mark.full
def test_torchrun_example_under_torchrun():
    # the launch its docstring shows first: torchrun (here `python -m torch.distributed.run`) on a free local port
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(EXAMPLES / "torchrun_combine_ddp.py"), *DDP_TINY[2:]], cwd=str(ROOT), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = _finish(proc, "torchrun torchrun_combine_ddp.py")
    assert "params identical on every rank" in out, out
    first, last = loss_pair(out)
    assert last < first, out


def test_torchrun_example_needs_a_launcher(capsys, monkeypatch):
    # run without torchrun and without --nproc: a clear message and exit code 2, no process group
    spec = importlib.util.spec_from_file_location("torchrun_combine_ddp", EXAMPLES / "torchrun_combine_ddp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.delenv("RANK", raising=False)
    assert mod.main(["--steps", "1"]) == 2
    assert "run under torchrun, or pass --nproc N" in capsys.readouterr().err


def parse_result(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, f"expected one RESULT line, got:\n{out}"
    fields = dict(kv.split("=", 1) for kv in lines[0].split()[1:])
    return {k: (v if k == "opt_level" else float(v)) for k, v in fields.items()}


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_train_tiny_lm_loss_decreases(opt_level, fast_runs):
    res = parse_result(_finish(*fast_runs[f"lm-{opt_level}"]))
    assert res["opt_level"] == opt_level and res["steps"] == 20
    # a 25-symbol vocabulary starts near ln(25) = 3.2; 20 Adam steps at lr 3e-3 reliably remove a tenth of that
    assert res["last_loss"] < 0.9 * res["first_loss"], res
    assert res["tokens_per_s"] > 0


def test_train_tiny_lm_rejects_bad_steps(capsys):
    # argument checking needs no subprocess: load the script as a module and call its main()
    spec = importlib.util.spec_from_file_location("train_tiny_lm", EXAMPLES / "train_tiny_lm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--steps", "0"])
    assert exc.value.code == 2
    assert "--steps must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.full
@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2"])
def test_train_tiny_lm_default_size_learns(opt_level):
    # the default model for 100 steps: well below the uniform-guess loss, i.e. it learned the grammar's words
    res = parse_result(run_example("train_tiny_lm.py", "--opt-level", opt_level, "--steps", "100", "--no-progress"))
    assert res["last_loss"] < 0.6 * res["first_loss"], res
    assert re.fullmatch(r"O[0-3]", res["opt_level"])
