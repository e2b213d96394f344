"""Install one built wheel into a fresh environment and run its tests there (inside a test container, or on the host).

    python tools/test_cell.py --cell cp311-x86_64 --wheel-dir dist --wheelhouse W --tests tests \
        [--suite kernels|full] [--torch 2.13.0] [--python /opt/python/cp311-cp311/bin/python] [--report r.json]
    python tools/test_cell.py --cell cp311-x86_64 --installed --python /opt/apex/bin/python --tests tests --suite full

Steps: check that the interpreter is the cell's Python on the cell's architecture (a wrong interpreter is an error,
never a silent substitute); create a venv; install numpy + pytest from the offline wheelhouse, then the wheel with
--no-deps (and torch==X for the full suite, from PIP_FIND_LINKS' torch folder: never the network); copy the tests
out of the source tree and run them against the installed copy with APEX_REQUIRE_EXT=1, so a wheel whose extension
does not load fails instead of passing on the torch fallback; check that apex_C was imported from the venv.

--installed tests the apex already installed in that interpreter's environment instead (a runtime image).
Suites: "kernels" = tests/kernels (numpy + apex_C only, no torch); "full" = the whole suite with --device cpu.
Standard library only, Python >= 3.9: it runs under each cell's own interpreter, arm64 ones under qemu, as a file
of the mounted tools/ folder (tools/util.py beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

if __package__ != "tools":  # run as a file: the tools package is the folder above this one
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.util import FULL_TEST_TOOLS, WheelNotFound, find_wheel, run, sha256, test_worker_args


class CellTestError(RuntimeError):
    pass


def interpreter_identity(python: str) -> dict:
    out = subprocess.run(
        [python, "-c", "import json, platform, sys; print(json.dumps({'version': platform.python_version(), "
         "'tag': 'cp%d%d' % sys.version_info[:2], 'machine': platform.machine(), 'executable': sys.executable}))"],
        capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout)


def where_am_i() -> dict:
    """Whether this runs in a container (podman writes /run/.containerenv, docker /.dockerenv) and on what OS."""
    marker = next((p for p in ("/run/.containerenv", "/.dockerenv") if os.path.exists(p)), None)
    osname = ""
    if os.path.exists("/etc/os-release"):
        with open("/etc/os-release") as f:
            osname = dict(ln.rstrip("\n").split("=", 1) for ln in f if "=" in ln).get("PRETTY_NAME", "").strip('"')
    return {"container": marker is not None, "container_marker": marker, "os": osname}


def junit_counts(path: Path) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    keys = ("tests", "failures", "errors", "skipped")
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}


def test_cell(args) -> dict:
    ident = interpreter_identity(args.python)
    if args.cell == "auto":
        args.cell = f"{ident['tag']}-{ident['machine']}"
    tag, _, arch = args.cell.partition("-")
    if ident["tag"] != tag or ident["machine"] != arch:
        raise CellTestError(f"cell {args.cell} needs a {tag} interpreter on {arch}; {args.python} is "
                            f"{ident['tag']} on {ident['machine']}")
    t0 = time.monotonic()
    report = {"cell": args.cell, "interpreter": ident, "suite": args.suite, "torch": args.torch, "passed": False,
              **where_am_i()}
    with tempfile.TemporaryDirectory(prefix="apex-cell-") as tmp:
        tmp = Path(tmp)
        pip_opts = ["--disable-pip-version-check", "--no-input"] + ([] if args.index else ["--no-index"])
        for wh in args.wheelhouse:
            pip_opts += ["--find-links", wh]
        if args.installed:
            # an environment that already holds apex (a runtime image): add the test tools, test what is there
            venv = Path(subprocess.run([args.python, "-c", "import sys; print(sys.prefix)"], capture_output=True,
                                       text=True, check=True).stdout.strip())
            py = Path(args.python)
            # the test tools go to a private folder on PYTHONPATH: the environment under test stays as shipped
            # (and may belong to another user than the one running the tests)
            tools = tmp / "test-tools"
            run([py, "-m", "pip", "install", *pip_opts, "--target", tools, "pytest",
                  *(FULL_TEST_TOOLS if args.suite == "full" else ())])
            report["wheel"] = "preinstalled"
        else:
            wheel = find_wheel(args.wheel_dir, tag, arch)
            report.update(wheel=wheel.name, wheel_sha256=sha256(wheel))
            venv = tmp / "venv"
            run([args.python, "-m", "venv", venv])
            py = venv / "bin" / "python"
            pip = [py, "-m", "pip", "install", *pip_opts]
            run([*pip, "numpy", "pytest", *(FULL_TEST_TOOLS if args.suite == "full" else ())])
            run([*pip, "--no-deps", wheel])
            if args.torch:
                # --no-index keeps pip off the network; torch itself comes from the folder PIP_FIND_LINKS names
                # (the host's torch wheel folder, bind-mounted), its pure-Python dependencies from the wheelhouse.
                run([*pip, f"torch=={args.torch}"])
        where = subprocess.run([py, "-c", "import apex_C, numpy; print(apex_C.__file__); print(numpy.__version__)"],
                               capture_output=True, text=True, check=True, cwd=tmp).stdout.split()
        report["apex_C"], report["numpy"] = where[0], where[1]
        venv_real = os.path.realpath(venv)
        if os.path.commonpath([venv_real, os.path.realpath(where[0])]) != venv_real:
            raise CellTestError(f"apex_C was imported from {where[0]}, expected the fresh venv {venv}")
        tests = tmp / "tests"
        shutil.copytree(args.tests, tests, ignore=shutil.ignore_patterns("__pycache__"))
        target = [tests / "kernels"] if args.suite == "kernels" else [tests, "--device", "cpu"]
        junit = tmp / "junit.xml"
        env = dict(os.environ, APEX_REQUIRE_EXT="1", PYTHONDONTWRITEBYTECODE="1")
        env.pop("PYTHONPATH", None)
        if args.installed:
            env["PYTHONPATH"] = str(tools)
        # workers where the suite's tools include pytest-xdist (the full suite), else one process
        workers = test_worker_args(args.pytest_args) if args.suite == "full" else []
        rc = subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", tmp, *workers,
                             f"--junitxml={junit}", *target, *args.pytest_args], cwd=tmp, env=env).returncode
        report["pytest_rc"] = rc
        report["counts"] = junit_counts(junit) if junit.exists() else {}
    report["seconds"] = round(time.monotonic() - t0, 1)
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)  # venv, pip and pytest: load-independent cost
    report["cpu_seconds"] = round(ru.ru_utime + ru.ru_stime, 1)
    c = report["counts"]
    report["passed"] = rc == 0 and c.get("tests", 0) > 0 and c.get("tests", 0) > c.get("skipped", 0)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cell", default="auto", help="e.g. cp311-x86_64 (default: the interpreter's own)")
    ap.add_argument("--wheel-dir", type=Path)
    ap.add_argument("--installed", action="store_true",
                    help="test the apex already installed in --python's environment (no venv, no wheel install)")
    ap.add_argument("--wheelhouse", action="append", default=[], help="offline wheels (numpy, pytest, torch deps)")
    ap.add_argument("--tests", type=Path, required=True, help="the repository's tests/ directory")
    ap.add_argument("--suite", choices=("kernels", "full"), default="kernels")
    ap.add_argument("--torch", help="torch version for the full suite")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--index", action="store_true",
                    help="let pip use its configured indexes (default: --no-index, find-links only)")
    ap.add_argument("--report", type=Path)
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args(argv)
    if args.suite == "full" and not (args.torch or args.installed):
        ap.error("--suite full needs --torch VERSION")
    if not (args.installed or args.wheel_dir):
        ap.error("give --wheel-dir (install a built wheel) or --installed")
    try:
        report = test_cell(args)
    except (CellTestError, WheelNotFound, subprocess.CalledProcessError) as e:
        report = {"cell": args.cell, "passed": False, "error": str(e)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.report:
        args.report.write_text(text)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
