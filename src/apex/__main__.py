"""``python -m apex``: what is installed and what it can use.

Prints the version, the build variant, whether the C++ core loaded (and at
which SIMD level, with how many threads), the torch version, the devices
seen, and which ``amp_C`` an ``import amp_C`` gives (and whether the start-up
hook lets it come before ``import apex``). ``--json`` gives the same as one JSON object (for bug reports and CI).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys


def collect() -> dict:
    import apex

    info = {
        "apex": apex.__version__,
        "build_variant": getattr(apex, "__build_variant__", "standalone"),
        "python": platform.python_version(),
        "platform": f"{platform.system()}-{platform.machine()}",
    }
    try:
        import apex_C

        info["core"] = {
            "loaded": True,
            "path": getattr(apex_C, "__file__", None),
            "simd_level": apex_C.simd_level(),
            "supported_simd_levels": apex_C.supported_simd_levels(),
            "threads": apex_C.get_num_threads(),
        }
    except ImportError as exc:
        info["core"] = {"loaded": False, "error": str(exc)}
    try:
        import torch

        from apex import _device

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["device"] = _device.detect_device()
        info["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        info["npu"] = _device.npu_status() if hasattr(_device, "npu_status") else None
    except Exception as exc:  # report, never crash an info command
        info["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import amp_C

        import _apex_amp_c

        info["amp_C"] = {
            "ours": bool(getattr(amp_C, "__apex_fallback__", False)),
            "path": getattr(amp_C, "__file__", None),
            "start_up_hook": _apex_amp_c.installed_at_start_up,
        }
    except Exception as exc:  # e.g. NVIDIA's amp_C installed without its CUDA libraries
        info["amp_C"] = {"error": f"{type(exc).__name__}: {exc}"}
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m apex", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    info = collect()
    if args.json:
        sys.stdout.write(json.dumps(info, indent=2, sort_keys=True) + "\n")
        return 0
    core = info["core"]
    lines = [
        f"apex {info['apex']} ({info['build_variant']}), Python {info['python']} on {info['platform']}",
        (
            f"C++ core: loaded, SIMD {core['simd_level']} (supported: {', '.join(core['supported_simd_levels'])}), "
            f"{core['threads']} threads"
            if core["loaded"]
            else f"C++ core: NOT loaded ({core['error']}); torch fallback in use"
        ),
    ]
    if "torch" in info:
        lines.append(f"torch {info['torch']} ({info['torch_threads']} threads), device: {info['device']}, "
                     f"CUDA devices: {info['cuda_devices']}")
        if info.get("npu"):
            lines.append(f"NPU: {info['npu']}")
    else:
        lines.append(f"torch: unavailable ({info.get('torch_error')})")
    amp_c = info["amp_C"]
    if "error" in amp_c:
        lines.append(f"import amp_C: fails ({amp_c['error']})")
    else:
        lines.append(("import amp_C: apex's multi-tensor ops" if amp_c["ours"] else f"import amp_C: {amp_c['path']}")
                     + ("; start-up hook active (amp_C may be imported before apex)" if amp_c["start_up_hook"]
                        else "; start-up hook inactive (import apex before amp_C)"))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
