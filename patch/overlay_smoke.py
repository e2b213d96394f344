"""Smoke test of an installed overlay wheel (patch/overlay.py), run by `nox -s overlay` from outside the source tree.

Imports apex and apex_C from the environment, our packages, and every upstream subpackage the wheel's manifest
lists (an upstream subpackage that needs a CUDA extension not built here is reported, not fatal); prints the
upstream `__init__` statements the overlay skipped. Exits non-zero when one of our packages does not import.
"""
import importlib
import importlib.resources
import json

import apex_C

import apex
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
