"""What every nox session shares (noxfile.py's development sessions and tools/release.py's container sessions).

Pins come from tools/matrix.toml (Pythons, torch, tool pins) and pyproject's [dependency-groups] (what a session
installs into its environment); paths from the repository root. Sessions that take options after `--` parse them
with `Options`, an argparse parser: `nox -s NAME -- --help` prints them, a wrong one stops the session with the
usage; sessions that hand posargs on to a tool (pytest, ruff, bench/run.py, the npu matrix) leave them alone.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nox

from tools import matrix
from tools.util import ROOT, WheelNotFound, find_wheel, host_arch

MATRIX = matrix.load()
DIST = ROOT / "dist"
PACKAGE_VERSION = matrix.pyproject()["project"]["version"]
PYTHONS = MATRIX.pythons
MAIN_PYTHON = MATRIX.main_python
TORCH = os.environ.get("APEX_TORCH_SPEC") or f"torch=={MATRIX.torch['version']}"
if not re.fullmatch(r"torch==[0-9][0-9A-Za-z.+]*", TORCH):
    raise SystemExit(f"noxfile: APEX_TORCH_SPEC must pin one torch version (torch==X.Y.Z), got {TORCH!r}")


class Options(argparse.ArgumentParser):
    """argparse over a session's posargs: `--help` prints the options and skips the session (exit status 0), a bad
    option ends the session with the usage and the reason."""

    def __init__(self, session: nox.Session, description: str, **kw) -> None:
        super().__init__(prog=f"nox -s {session.name} --", description=description, **kw)
        self.session = session

    def parse(self, args: list[str] | None = None) -> argparse.Namespace:
        return self.parse_args(list(self.session.posargs if args is None else args))

    def exit(self, status: int = 0, message: str | None = None):
        if status:
            self.session.error((message or "").strip())
        if message:
            print(message, file=sys.stderr)
        self.session.skip("options shown")

    def error(self, message: str):
        self.session.error(f"{self.format_usage().strip()}\n{self.prog}: error: {message}")

    def add_base(self) -> None:
        """--base auto|public|local (default APEX_BASE, else auto) for the container sessions."""
        default = os.environ.get("APEX_BASE", "auto")
        self.add_argument("--base", choices=("auto", "public", "local"), default=default,
                          help=f"base images: public manylinux, local Debian, auto = public when quay.io answers "
                               f"(default: APEX_BASE or auto; now {default})")

    def add_cell(self) -> None:
        """--python X.Y --arch A: one release cell (default: the main Python on this machine's arch)."""
        self.add_argument("--python", choices=MATRIX.pythons, default=MAIN_PYTHON,
                          help=f"the cell's Python (default {MAIN_PYTHON})")
        self.add_argument("--arch", choices=MATRIX.arches, default=host_arch(),
                          help=f"the cell's architecture (default: this machine's, {host_arch()})")


def group(name: str) -> list[str]:
    """A pyproject dependency group (what a session installs)."""
    return matrix.dependency_group(name)


def pick(group_name: str, *names: str) -> list[str]:
    """The requirements of a dependency group whose project names are given, in the group's order."""
    found = [r for r in group(group_name) if re.match(r"[A-Za-z0-9_.-]+", r).group(0) in names]
    if len(found) != len(names):
        raise ValueError(f"pyproject.toml: dependency group {group_name!r} lacks one of {names}")
    return found


def install_torch(session: nox.Session) -> None:
    """The pinned torch first, so nothing later can resolve `torch>=2.7` to a different (CUDA) build."""
    session.install("--only-binary=torch", TORCH)


def session_python_tag(session: nox.Session) -> str:
    out = session.run("python", "-c", "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')",
                      silent=True)
    return out.strip().splitlines()[-1]


def session_wheel(session: nox.Session, folder: Path = DIST, arch: str | None = None, hint: str = "nox -s build",
                  tag: str | None = None) -> Path:
    """The one built wheel of this session's Python (or tag) and arch (default: this machine) in folder."""
    try:
        return find_wheel(folder, tag or session_python_tag(session), arch or host_arch(),
                          PACKAGE_VERSION if folder == DIST else "*")
    except WheelNotFound as e:
        session.error(f"{e}: run `{hint}` first")


def show_install(session: nox.Session, *extra: str) -> None:
    """Log which apex/apex_C this environment imports (never the source tree) and check its SIMD levels."""
    session.run("python", str(ROOT / "tools" / "check_install.py"), str(ROOT / "src"), *extra)


def expose_pyenv_versions() -> None:
    """pyenv's shims only run the versions `pyenv global` (or PYENV_VERSION) names; name every one we test."""
    if os.environ.get("PYENV_VERSION") or not shutil.which("pyenv"):
        return
    try:
        bare = subprocess.run(["pyenv", "versions", "--bare", "--skip-aliases"], capture_output=True, text=True,
                              check=True).stdout.split()
        current = subprocess.run(["pyenv", "version-name"], capture_output=True, text=True,
                                 check=True).stdout.strip().split(":")
    except (OSError, subprocess.CalledProcessError):
        return

    def key(v: str) -> tuple:
        return tuple(int(x) for x in re.findall(r"\d+", v))

    picks = [max((v for v in bare if re.fullmatch(rf"{re.escape(want)}\.\d+", v)), key=key, default=None)
             for want in PYTHONS]
    os.environ["PYENV_VERSION"] = ":".join(dict.fromkeys(current + [p for p in picks if p]))
