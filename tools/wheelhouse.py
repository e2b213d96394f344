"""The offline wheelhouse the containers install from (builds and tests run with --network=none).

Filled on the host with `pip download` for each cell's Python and architecture (pip's own configuration applies:
on this machine that includes a local find-links folder and a constraints file), cached in
.cache/release/wheelhouse/ and bind-mounted read-only into the containers. Contents per cell:
  build:  the pyproject `build` dependency group for the cell's Python, on the build image's arch (x86_64: aarch64
          wheels are cross-compiled there), since the containers run the same `nox -s build` as a workstation
  runner: nox itself (and auditwheel for cp39 repairs), for the interpreter that runs nox inside the build image
  test:  numpy + pytest for the cell's Python and arch; for full-suite cells also torch's dependencies, but never
         torch itself: that comes from the torch wheel folder (tools/container.py torch_wheel_folder), mounted.

    python -m tools.wheelhouse [--cell cp311-x86_64 ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from tools import matrix
from tools.util import FULL_TEST_TOOLS, sha256

log = logging.getLogger("tools.wheelhouse")

ROOT = Path(__file__).resolve().parent.parent
WHEELHOUSE = ROOT / ".cache" / "release" / "wheelhouse"
TEST_TOOLS = ("numpy", "pytest")
RECIPE = 4  # bump when the download rules change (stamps of older runs are then redone)


def _platforms(arch: str) -> list[str]:
    # newest first is irrelevant to pip; list every tag a wheel for glibc <= 2.28 may carry
    return [f"manylinux_2_28_{arch}", f"manylinux_2_27_{arch}", f"manylinux_2_17_{arch}",
            f"manylinux2014_{arch}", f"linux_{arch}"]


def _pip_of(python: str) -> str:
    """An interpreter of `python`'s version to run pip with: `pip download --python-version` evaluates environment
    markers (tomli; python_version < "3.11", ...) for the interpreter running pip, not for the target version."""
    from tools import container

    try:
        return str(container.pyenv_interpreter(python) / "bin" / f"python{python}")
    except container.ContainerError:
        found = shutil.which(f"python{python}")
        if not found:
            raise SystemExit(f"wheelhouse: no CPython {python} here to resolve its dependencies with") from None
        return found


def download(python: str, arch: str, requirements: list[str], dest: Path) -> None:
    tag = "cp" + python.replace(".", "")
    cmd = [_pip_of(python), "-m", "pip", "download", "--disable-pip-version-check", "--no-input", "--quiet",
           "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
           "--abi", tag, "--abi", "abi3", "--abi", "none", "--dest", str(dest)]
    for p in _platforms(arch):
        cmd += ["--platform", p]
    cmd += requirements
    log.info("+ %s", " ".join(cmd))
    subprocess.run(cmd, check=True)


def wheels_of(folder: Path, project: str) -> list[Path]:
    """The wheels of one project in a folder (names compared in normal form: Torch, torch; never torch_npu)."""
    out = []
    for whl in sorted(folder.glob("*.whl")):
        try:
            name = parse_wheel_filename(whl.name)[0]
        except (InvalidWheelFilename, ValueError):
            continue
        if name == canonicalize_name(project):
            out.append(whl)
    return out


def ensure(cells: list[matrix.Cell], torch: bool = True, build_arch: str = "x86_64") -> Path:
    """Download what `cells` need (skipped per job when already done for the same requirement set)."""
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    stamps = WHEELHOUSE / ".stamps.json"
    done = json.loads(stamps.read_text()) if stamps.exists() else {}
    m = matrix.load()
    # the runner: nox and the auditwheel beside it, for the interpreter that runs nox in the build image
    runner = m.build_args("wheel", m.main_cell)["RUNNER_REQUIREMENTS"].split()
    jobs = {(m.main_python, build_arch, "runner"): runner}
    for cell in cells:
        jobs[(cell.python, build_arch, "build")] = matrix.dependency_group("build")
        extra = list(FULL_TEST_TOOLS) if cell.suite == "full" else []
        jobs[(cell.python, cell.arch, "test")] = list(TEST_TOOLS) + extra
        if torch and cell.torch:
            jobs[(cell.python, cell.arch, "torch-deps")] = [f"torch=={cell.torch}"]
    for (python, arch, what), reqs in jobs.items():
        key = f"{python}-{arch}:{what}"
        digest = hashlib.sha256(json.dumps([RECIPE, reqs]).encode()).hexdigest()[:12]
        if done.get(key) == digest:
            continue
        download(python, arch, reqs, WHEELHOUSE)
        if what == "torch-deps":
            # torch itself must come from the mounted torch wheel folder at test time, not from here
            for whl in wheels_of(WHEELHOUSE, "torch"):
                whl.unlink()
        done[key] = digest
        stamps.write_text(json.dumps(done, indent=1, sort_keys=True))
    return WHEELHOUSE


def listing() -> list[dict]:
    """name + sha256 of every wheel in the wheelhouse (recorded in the SBOM as build/test tooling)."""
    return [{"file": whl.name, "sha256": sha256(whl)} for whl in sorted(WHEELHOUSE.glob("*.whl"))]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cell", action="append", help="e.g. cp311-x86_64 (default: every cell)")
    args = ap.parse_args(argv)
    cells = matrix.load().cells()
    if args.cell:
        unknown = set(args.cell) - {c.name for c in cells}
        if unknown:
            ap.error(f"unknown cells {sorted(unknown)}; known: {[c.name for c in cells]}")
        cells = [c for c in cells if c.name in args.cell]
    print(ensure(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
