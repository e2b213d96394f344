"""Build one release cell (a CPython version x an architecture) with the project's own `nox -s build`.

    python tools/build_cell.py --python 3.9 --arch aarch64 --out wheels/ [--wheelhouse DIR] [--source DIR] \
        [--runner-requirements "nox>=... auditwheel>=..."]

This is the one step docker/Dockerfile.wheel runs, and it runs the same way on a workstation: it finds the cell's
interpreter (/opt/python/cpXY-cpXY in a manylinux or local build image, else pythonX.Y on PATH), puts it first on
PATH, and runs `nox -s build --force-python X.Y -- --arch ARCH` from the source tree; nox builds with zig against
glibc 2.17, strips, audits and repairs to the lowest manylinux tag. For a cross build (ARCH differs from this
machine) the compiler gets aarch64 Python headers derived by tools/cross_headers.py. With --wheelhouse, pip only
installs from that directory (the build containers have no network). Where the interpreter lacks nox, a throwaway
venv gets --runner-requirements (docker/Dockerfile.wheel passes tools/matrix.toml's pins). The cell's wheel is
copied to --out.

Standard library only, Python >= 3.9 (it runs under whatever interpreter the build image offers).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __package__ != "tools":  # run as a file: the tools package is the folder above this one
    sys.path.insert(0, str(HERE.parent))
from tools.util import WheelNotFound, cp_tag, find_wheel, run  # noqa: E402


class BuildCellError(RuntimeError):
    pass


def cell_interpreter(version: str) -> Path:
    tag = cp_tag(version)
    manylinux = Path(f"/opt/python/{tag}-{tag}/bin/python{version}")
    if manylinux.exists():
        return manylinux
    found = shutil.which(f"python{version}")
    if found:
        # pyenv shims answer `which` even for versions they will not run; ask the interpreter itself
        ok = subprocess.run([found, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True)
        if ok.returncode == 0:
            return Path(ok.stdout.strip())
    raise BuildCellError(f"no CPython {version}: expected /opt/python/{tag}-{tag}/bin/python{version} "
                         f"(manylinux layout) or python{version} on PATH")


def nox_command(tmp: Path, wheelhouse: Path | None, runner: list[str]) -> list[str]:
    """nox from this interpreter if it has it, else a throwaway venv with the runner requirements (nox and the
    auditwheel beside it: the cp39 build session repairs with it), offline from the wheelhouse when given."""
    if subprocess.run([sys.executable, "-c", "import nox"], capture_output=True).returncode == 0:
        return [sys.executable, "-m", "nox"]
    if not runner:
        raise BuildCellError(f"{sys.executable} has no nox and no --runner-requirements were given to install it")
    venv = tmp / "nox-venv"
    run([sys.executable, "-m", "venv", venv])
    pip = [venv / "bin" / "python", "-m", "pip", "install", "--disable-pip-version-check", "--no-input", *runner]
    if wheelhouse:
        pip += ["--no-index", "--find-links", wheelhouse]
    run(pip)
    return [str(venv / "bin" / "python"), "-m", "nox"]


def build_cell(python: str, arch: str, out: Path, source: Path, wheelhouse: Path | None,
               runner: list[str] = ()) -> Path:
    interp = cell_interpreter(python)
    tag = cp_tag(python)
    env = dict(os.environ)
    env["PATH"] = f"{interp.parent}{os.pathsep}{env.get('PATH', '')}"
    if wheelhouse:
        env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheelhouse), PIP_NO_CACHE_DIR="1")
    with tempfile.TemporaryDirectory(prefix="apex-build-cell-") as tmp:
        tmp = Path(tmp)
        if arch != platform.machine():
            headers = subprocess.run(
                [sys.executable, str(HERE / "cross_headers.py"), "--python", str(interp), "--arch", arch,
                 "--out", str(tmp / "xheaders")], capture_output=True, text=True, check=True).stdout.strip()
            # -I from CPPFLAGS precedes setuptools' own include dirs: the derived pyconfig.h wins
            env["CPPFLAGS"] = f"-I{headers} {env.get('CPPFLAGS', '')}".strip()
            print(f"cross build {tag} -> {arch}: Python headers from {headers}", flush=True)
        nox = nox_command(tmp, wheelhouse, list(runner))
        run([*nox, "-f", source / "noxfile.py", "-s", "build", "--force-python", python, "--", "--arch", arch],
             env=env, cwd=source)
    try:
        wheel = find_wheel(source / "dist", tag, arch)
    except WheelNotFound as e:
        raise BuildCellError(f"after nox -s build: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    target = out / wheel.name
    shutil.copy2(wheel, target)
    # CPU seconds of everything this build ran (compilers included): a load-independent cost measure
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"build_cell: {tag}-{arch} used {ru.ru_utime + ru.ru_stime:.0f} CPU s (user+sys of all child processes)",
          flush=True)
    return target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", required=True, help="e.g. 3.11")
    ap.add_argument("--arch", required=True, help="x86_64 or aarch64 (tools/matrix.toml [release] arches)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--source", type=Path, default=HERE.parent)
    ap.add_argument("--wheelhouse", type=Path, help="install build tools only from here (offline)")
    ap.add_argument("--runner-requirements", default="",
                    help="space-separated pins of nox and what runs beside it, installed when this Python lacks nox")
    args = ap.parse_args(argv)
    try:
        wheel = build_cell(args.python, args.arch, args.out, args.source.resolve(), args.wheelhouse,
                           args.runner_requirements.split())
    except (BuildCellError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
