"""Build (or find cached) the emulated-npu shared library against the installed torch.

The library is plain C++ over libtorch (no Python headers): it is loaded with ``torch.ops.load_library``. It is
compiled once per (torch version, C++ ABI, source hash, compiler flags) into a cache folder, so a rebuild happens
only when torch or the emulator source changes:

    <cache>/npu_emulator-<torch version>-<key>.so

The cache folder is ``APEX_NPU_EMULATOR_CACHE`` when set, else ``<repo>/.cache/npu-emulator``. The compile uses
the compiler and flags ``torch.utils.cpp_extension`` would use for a CPU extension (its include and library
paths, C++20, the ABI flag of this torch), at -O1, the two translation units side by side: the emulator's cost is
dispatch, not arithmetic, and a lower optimisation level compiles the torch headers faster.

Run as a script to build now and print the library path: ``python tests/npu_emulator/build.py``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "csrc" / "npu_emulator.cpp", HERE / "csrc" / "autocast.cpp")
REPO = HERE.parent.parent
FLAGS = ["-O1", "-std=c++20", "-fPIC", "-w"]


def cache_dir() -> Path:
    return Path(os.environ.get("APEX_NPU_EMULATOR_CACHE") or REPO / ".cache" / "npu-emulator")


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("npu emulator: no C++ compiler (g++ / c++ / $CXX) on PATH")
    return compiler


def _compile_commands(torch, objdir: Path) -> list[tuple[list[str], Path]]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    base = [_compiler(), *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    base += [f"-I{p}" for p in cpp_extension.include_paths()]
    return [([*base, "-c", str(src), "-o", str(objdir / (src.stem + ".o"))], objdir / (src.stem + ".o"))
            for src in SOURCES]


def _link_command(torch, objects: list[Path], out: Path) -> list[str]:
    from torch.utils import cpp_extension

    libs = cpp_extension.library_paths()
    cmd = [_compiler(), "-shared", *map(str, objects), "-o", str(out)]
    cmd += [f"-L{p}" for p in libs] + [f"-Wl,-rpath,{p}" for p in libs]
    return [*cmd, "-lc10", "-ltorch_cpu", "-ltorch"]


def _run_all(commands: list[list[str]]) -> None:
    """Run the compile commands side by side (one per translation unit); raise with the first failure's log."""
    procs = [(cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
             for cmd in commands]
    failures = []
    for cmd, proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            failures.append(f"{' '.join(cmd)}\n{out[-6000:]}")
    if failures:
        raise RuntimeError("npu emulator: compile failed:\n" + "\n".join(failures))


def library_path(torch) -> Path:
    """Where the library for this torch and this source lives (whether built yet or not)."""
    digest = hashlib.sha256()
    for src in SOURCES:
        digest.update(src.name.encode())
        digest.update(src.read_bytes())
    digest.update(" ".join(FLAGS).encode())
    digest.update(str(int(torch._C._GLIBCXX_USE_CXX11_ABI)).encode())
    return cache_dir() / f"npu_emulator-{torch.__version__}-{digest.hexdigest()[:16]}.so"


def build(verbose: bool = True) -> Path:
    """The emulator library for the installed torch: the cached one, or a fresh build (atomic rename)."""
    import torch

    target = library_path(torch)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        start = time.monotonic()
        if verbose:
            print(f"npu emulator: compiling for torch {torch.__version__} -> {target}", file=sys.stderr)
        compiles = _compile_commands(torch, Path(tmp))
        _run_all([cmd for cmd, _ in compiles])
        _run_all([_link_command(torch, [obj for _, obj in compiles], partial)])
        os.replace(partial, target)  # concurrent builders: the last complete file wins, never a partial one
        if verbose:
            print(f"npu emulator: built in {time.monotonic() - start:.0f} s", file=sys.stderr)
    return target


if __name__ == "__main__":
    print(build())
