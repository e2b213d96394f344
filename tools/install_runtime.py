"""Create the runtime environment of docker/Dockerfile.runtime (CPU) and docker/Dockerfile.npu: a venv holding
torch (and torch_npu for NPU), numpy and the released apex wheel that matches the interpreter.

    python tools/install_runtime.py --venv /opt/apex --dist dist/release --torch 2.13.0 \
        [--torch-npu 2.14.0] [--find-links DIR ...] [--index-url URL] [--extra-index-url URL]

torch is installed first and pinned, so the wheel's `torch>=2.7` can never pull a different (CUDA) build. Where
the sources are local (--find-links, no index) pip runs with --no-index: nothing comes from the network.
Runs on a workstation the same way as in the image (as a file of the mounted tools/ folder). Standard library
only, Python >= 3.9.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import sysconfig
from pathlib import Path

if __package__ != "tools":  # run as a file: the tools package is the folder above this one
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.util import WheelNotFound, find_wheel, run


def matching_wheel(dist: Path, python: Path) -> Path:
    probe = ("import platform, sys; print('cp%d%d' % sys.version_info[:2], platform.machine())")
    tag, arch = subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                               check=True).stdout.split()
    try:
        return find_wheel(dist, tag, arch)
    except WheelNotFound as e:
        raise SystemExit(f"install_runtime: {e}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", type=Path, required=True)
    ap.add_argument("--dist", type=Path, required=True, help="directory with the released wheels")
    ap.add_argument("--torch", required=True, help="torch version (pinned)")
    ap.add_argument("--torch-npu", help="torch_npu version (NPU images only; needs the CANN runtime to import)")
    ap.add_argument("--find-links", action="append", default=[])
    ap.add_argument("--index-url")
    ap.add_argument("--extra-index-url", action="append", default=[])
    args = ap.parse_args(argv)

    run([sys.executable, "-m", "venv", args.venv])
    py = args.venv / "bin" / "python"
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--no-cache-dir"]
    for d in args.find_links:
        pip += ["--find-links", d]
    if args.index_url:
        pip += ["--index-url", args.index_url]
    elif args.find_links:
        pip.append("--no-index")
    for u in args.extra_index_url:
        pip += ["--extra-index-url", u]
    run([*pip, "--only-binary=torch", f"torch=={args.torch}"])
    if args.torch_npu:
        run([*pip, f"torch_npu=={args.torch_npu}", f"torch=={args.torch}"])
    wheel = matching_wheel(args.dist, py)
    run([*pip, "numpy", str(wheel), f"torch=={args.torch}"])
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    print(f"installed {wheel.name} into {args.venv} (site-packages {site}; builder {sysconfig.get_platform()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
