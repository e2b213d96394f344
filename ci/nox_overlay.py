"""nox session ``overlay`` (registered by the import at the end of noxfile.py).

    nox -s overlay -- PATH_TO_UPSTREAM_APEX [--out DIR] [--ext apex_C*.so] [--upstream-ext]

Builds one wheel from a checkout of upstream NVIDIA Apex plus ours with patch/overlay.py (which
compiles our apex_C unless --ext is given), then installs it with the pinned torch in the
session's environment and smoke-tests it from outside the source tree: ``python -m apex`` and
the imports of our packages and of every upstream subpackage (an upstream subpackage that needs
a CUDA extension not built here is reported, not fatal). Default output: dist/overlay/.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent.parent
# the same pins as noxfile.py (its MAIN_PYTHON and APEX_TORCH_SPEC handling)
MAIN_PYTHON = "3.11"
TORCH = os.environ.get("APEX_TORCH_SPEC", "torch==2.13.0")

_SMOKE = """
import importlib, importlib.resources, json, sys
import apex, apex_C
from apex import _overlay
manifest = json.loads(importlib.resources.files("apex").joinpath("_overlay_manifest.json").read_text())
ours = ["apex.amp", "apex.optimizers", "apex.parallel", "apex.contrib.combine_tensors"]
for name in ours:
    importlib.import_module(name)
upstream = sorted({rel.split("/")[1] for rel, f in manifest["files"].items()
                   if f["origin"] == "upstream" and rel.count("/") == 2 and rel.endswith("/__init__.py")})
unavailable = {}
for name in upstream:
    try:
        importlib.import_module("apex." + name)
    except Exception as exc:  # CUDA-only upstream code on a machine without its extensions
        unavailable[name] = f"{type(exc).__name__}: {exc}"
print("apex", apex.__version__, "from", apex.__file__, "| apex_C", apex_C.simd_level())
print("our packages import:", ", ".join(ours))
print("upstream subpackages importable:", ", ".join(n for n in upstream if n not in unavailable) or "none")
for name, err in unavailable.items():
    print(f"upstream subpackage apex.{name} not importable here: {err}")
failed = [r for r in _overlay.REPORT if r["status"] == "failed"]
for r in failed:
    print(f"upstream init statement skipped: {r['package']} line {r['line']}: {r['error']}")
"""


@nox.session(python=MAIN_PYTHON, default=False)
def overlay(session: nox.Session) -> None:
    """One wheel from an upstream NVIDIA Apex checkout plus ours (ours win on conflicts); see patch/overlay.py."""
    args = list(session.posargs)
    if not args or args[0].startswith("-"):
        session.error("usage: nox -s overlay -- PATH_TO_UPSTREAM_APEX [--out DIR] [--ext FILE] [--upstream-ext]")
    if "--out" not in args and not any(a.startswith("--out=") for a in args):
        args += ["--out", str(ROOT / "dist" / "overlay")]
    if not re.fullmatch(r"torch==[0-9][0-9A-Za-z.+]*", TORCH):
        session.error(f"APEX_TORCH_SPEC must pin one torch version (torch==X.Y.Z), got {TORCH!r}")
    session.install("pybind11>=2.10", "setuptools>=64", "numpy")  # apex_C build; numpy keeps torch quiet
    out = session.run("python", str(ROOT / "patch" / "overlay.py"), *args, silent=True)
    session.log(out.strip())
    wheel = out.strip().splitlines()[-1]
    if not wheel.endswith(".whl") or not Path(wheel).is_file():
        session.error(f"patch/overlay.py did not report a wheel (last line: {wheel!r})")
    session.install("--only-binary=torch", TORCH)  # pinned first: nothing may resolve torch to a CUDA build
    session.install("--force-reinstall", "--no-deps", wheel)
    with session.chdir(session.create_tmp()):  # outside the source tree: the installed wheel is what runs
        session.run("python", "-m", "apex")
        session.run("python", "-c", _SMOKE)
    session.log(f"overlay wheel: {wheel}")
