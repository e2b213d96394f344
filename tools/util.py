"""Helpers shared by the nox sessions and the scripts that run inside the build and test containers.

Standard library only, Python >= 3.9: test_cell.py, build_cell.py, check_install.py and install_runtime.py import
this under every cell's own interpreter (arm64 ones under qemu). Run as plain files
(``python tools/test_cell.py``, the whole ``tools/`` folder mounted), they put the folder above it on ``sys.path``.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The earliest time a zip entry can hold (1980-01-01): SOURCE_DATE_EPOCH where neither the caller nor git gives one.
EPOCH_FALLBACK = "315532800"
# x86_64 SIMD levels of apex_C and the /proc/cpuinfo flags each needs; aarch64: NEON is part of the architecture.
X86_LEVELS = {"avx2": {"avx2", "fma", "f16c"},
              "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}}
# What the full suite needs beyond numpy and pytest (property tests, safetensors checkpoints, apex.dump's HDF5
# files, workers on every usable CPU): the wheelhouse downloads them for full-suite cells, test_cell.py installs
# them there.
FULL_TEST_TOOLS = ("hypothesis", "safetensors", "h5py", "pytest-xdist")
# pytest-xdist workers of a suite run: one per usable CPU, up to this many (each imports torch: ~0.5 GB)
MAX_TEST_WORKERS = 4


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, as in a container with --cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def test_worker_args(pytest_args) -> list[str]:
    """``-n N`` (pytest-xdist) for a suite run on N = min(usable CPUs, MAX_TEST_WORKERS) workers, or nothing where
    the arguments choose already (``-n``, ``--numprocesses``, ``-p no:xdist``) or one CPU is usable. The suite
    runs as much in parallel as the machine has: on 2 cores one run takes 0.65 of its serial time."""
    args = [str(a) for a in pytest_args]
    chosen = any(a.startswith("-n") or a.startswith("--numprocesses") or a == "no:xdist" or a == "-pno:xdist"
                 for a in args)
    workers = min(usable_cpus(), MAX_TEST_WORKERS)
    return [] if chosen or workers < 2 else ["-n", str(workers)]


class WheelNotFound(LookupError):
    """Not exactly one wheel of the wanted Python tag and architecture in a folder."""


def run(cmd, **kw) -> subprocess.CompletedProcess:
    """Print the command (``+ cmd``), run it, raise CalledProcessError on a non-zero exit."""
    print("+ " + " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def sha256(path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def source_date_epoch(root: Path = ROOT) -> str:
    """SOURCE_DATE_EPOCH for reproducible archives: the caller's, else the last commit's time, else 1980-01-01."""
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return os.environ["SOURCE_DATE_EPOCH"]
    try:
        out = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%ct"], capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return EPOCH_FALLBACK
    return out if out.isdigit() else EPOCH_FALLBACK


def cp_tag(version: str) -> str:
    """The CPython tag of a version: "3.11" -> "cp311"."""
    return "cp" + version.replace(".", "")


def host_arch() -> str:
    """This machine's architecture in wheel-tag spelling (x86_64, aarch64)."""
    arch = platform.machine()
    return {"amd64": "x86_64", "AMD64": "x86_64", "arm64": "aarch64"}.get(arch, arch)


def wheels_for(folder: Path, tag: str, arch: str, version: str = "*") -> list:
    """apex wheels of one Python tag (cp311) and architecture in folder, sorted by name."""
    return sorted(Path(folder).glob(f"apex-{version}-{tag}-{tag}-*_{arch}.whl"))


def find_wheel(folder: Path, tag: str, arch: str, version: str = "*") -> Path:
    """The one apex wheel of tag and arch in folder; WheelNotFound (naming what is there) otherwise."""
    found = wheels_for(folder, tag, arch, version)
    if len(found) != 1:
        have = sorted(p.name for p in Path(folder).glob("*.whl"))
        raise WheelNotFound(f"expected exactly one apex {version if version != '*' else ''} wheel for {tag}/{arch} "
                            f"in {folder}, found {len(found)}: {[p.name for p in found] or have}")
    return found[0]


def cpu_flags() -> set:
    """The feature flags of /proc/cpuinfo's first `flags` line (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def expected_simd_levels(arch: str, flags: set) -> list:
    """The apex_C SIMD levels a CPU of this arch with these flags supports (what the dispatch must offer)."""
    if arch in ("aarch64", "arm64"):
        return ["baseline", "neon"]
    if arch not in ("x86_64", "amd64"):
        return ["baseline"]
    return ["baseline"] + [level for level, need in X86_LEVELS.items() if need <= flags]

