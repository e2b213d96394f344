"""Environment of a benchmark run: which apex is loaded, machine facts, memory (RSS) probes."""

from __future__ import annotations

import datetime
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger("bench")

REPO = Path(__file__).resolve().parent.parent


def import_apex():
    """Imports apex (installed, or else this checkout's src/) and returns ``apex._core``."""
    try:
        from apex import _core
    except ImportError:
        src = REPO / "src"
        if not (src / "apex").is_dir():
            raise
        sys.path.insert(0, str(src))
        from apex import _core
        log.info("apex not installed: using the checkout at %s", src)
    return _core


def apex_executor(*tensors: torch.Tensor) -> str:
    """Label of the path apex takes for these tensors: the C++ core at its SIMD level, or torch ops."""
    core = import_apex()
    if core.uses_kernel(*tensors):
        return f"apex_C/{core.simd_level()}"
    return f"torch ops ({tensors[0].device.type})" if tensors else "torch ops"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "asimd", "sve")


def _cpu_simd_flags() -> list:
    """The SIMD extensions the CPU reports (/proc/cpuinfo flags / Features) among those kernels care about."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                have = set(line.split(":", 1)[1].split())
                return [f for f in SIMD_FLAGS if f in have]
    except OSError:
        pass
    return []


def _git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _mem_total_gib() -> Optional[float]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2 ** 20, 1)
    except (OSError, ValueError):
        pass
    return None


def machine_info(device: str) -> dict:
    core = import_apex()
    import apex

    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu_model": _cpu_model(),
        "cpu_simd_flags": _cpu_simd_flags(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_gib": _mem_total_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "apex": getattr(apex, "__version__", None),
        "apex_file": getattr(apex, "__file__", None),
        "apex_C": core.ext is not None,
        "simd_level": core.simd_level(),
        "simd_levels_supported": core.ext.supported_simd_levels() if core.ext is not None else [],
        # the compiler of the loaded apex_C (nox -s bench builds it as the release wheels are: zig's clang)
        "apex_C_compiler": str(getattr(core.ext, "compiler", "")).strip() or None if core.ext is not None else None,
        # whose threads run apex_C's threaded calls: torch's OpenMP team, or threads started per call
        "thread_pool": core.ext.thread_pool() if core.ext is not None else None,
        "device": device,
        "git_commit": _git_commit(),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name()
    return info


# --- memory ------------------------------------------------------------------------------------------------------
def _status_kib(field: str) -> Optional[int]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def rss_mib() -> Optional[float]:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib / 1024


def reset_peak_rss() -> bool:
    """Resets the kernel's peak-RSS mark to the current RSS (Linux: ``5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> Optional[float]:
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux; never reset
    return kib / 1024
