"""Per-wheel release audit: `nox -s audit` runs it on every wheel of a release directory.

Checks, each one fatal:
  policy    `auditwheel show --json` (auditwheel >= 6.8) names a manylinux policy no newer than tools/matrix.toml's
            manylinux_max (2_28), and every manylinux tag in the file name is no newer either (the wheel was
            repaired, not just built)
  elf       tools/check_so.py on every .so: ELF machine == platform tag == module suffix arch, module suffix matches
            the python tag, torch-free NEEDED, full RELRO + BIND_NOW, NX stack, no TEXTREL, stack canary, no
            RPATH/RUNPATH, stripped, PyInit_ exported
  import    the extension imports in an interpreter of the wheel's own Python and arch: natively for x86_64
            (this machine's interpreters), under qemu in the arm64 test userland for aarch64 where one exists;
            where none exists the check says so ("not possible here") and does not count as a pass or a failure

    python -m tools.audit dist/release/*.whl [--json audit.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Sequence

from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import Version

from tools import check_so, container, matrix
from tools.util import cpu_flags, expected_simd_levels

log = logging.getLogger("tools.audit")

# `auditwheel show --json` exists from auditwheel 6.8 (which needs Python >= 3.10).
AUDITWHEEL_JSON = Version("6.8")
MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_(\w+)$")
LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
IMPORT_PROBE = ("import json, sys; sys.path.insert(0, sys.argv[1]); import apex_C; "
                "print(json.dumps({'module': apex_C.__file__.rsplit('/', 1)[-1], 'level': apex_C.simd_level(), "
                "'levels': list(apex_C.supported_simd_levels())}))")


class AuditFailure(RuntimeError):
    pass


@dataclass
class WheelAudit:
    wheel: str
    size: int
    sha256: str
    python: str
    arch: str
    policy: str = ""
    checks: dict = field(default_factory=dict)  # name -> {"ok": bool|None, "detail": str}

    @property
    def ok(self) -> bool:
        return all(c["ok"] is not False for c in self.checks.values()) and bool(self.checks)

    def add(self, name: str, ok: bool | None, detail: str) -> None:
        self.checks[name] = {"ok": ok, "detail": detail}


def glibc_of(tag: str) -> tuple[int, int]:
    """(major, minor) glibc of a manylinux platform tag (PEP 600 or a legacy alias)."""
    m = MANYLINUX.match(tag)
    if m:
        return int(m.group(1)), int(m.group(2))
    for legacy, version in LEGACY.items():
        if tag.startswith(legacy + "_"):
            return version
    raise AuditFailure(f"{tag!r} is not a manylinux platform tag")


def wheel_tags(wheel: Path) -> tuple[list[str], list[str]]:
    """(python tags, platform tags) of a wheel's file name, sorted (packaging's parser)."""
    try:
        _, _, _, tags = parse_wheel_filename(wheel.name)
    except (InvalidWheelFilename, ValueError) as exc:
        raise AuditFailure(f"{wheel.name}: not a wheel file name ({exc})") from None
    return sorted({t.interpreter for t in tags}), sorted({t.platform for t in tags})


def auditwheel_show(wheel: Path, command: Sequence[str] = (sys.executable, "-m", "auditwheel"),
                    env: dict | None = None) -> dict:
    """`auditwheel show --json` of one wheel as a dict (overall_tag = the policy the wheel satisfies).

    The default command is the auditwheel of this interpreter, whose version is checked first: older releases
    have no --json, and their text output is not parsed here. AuditFailure says what to install.
    """
    if tuple(command) == (sys.executable, "-m", "auditwheel"):
        try:
            have = metadata.version("auditwheel")
        except metadata.PackageNotFoundError:
            raise AuditFailure(f"auditwheel is not installed for {sys.executable}: pip install "
                               f"'auditwheel>={AUDITWHEEL_JSON}'") from None
        if Version(have) < AUDITWHEEL_JSON:
            raise AuditFailure(f"auditwheel {have} has no `show --json` (added in {AUDITWHEEL_JSON}, Python >= "
                               f"3.10): pip install 'auditwheel>={AUDITWHEEL_JSON}'")
    out = subprocess.run([*command, "show", "--json", str(wheel)], capture_output=True, text=True, env=env)
    try:
        shown = json.loads(out.stdout)
    except json.JSONDecodeError:
        shown = None
    if not isinstance(shown, dict):
        tail = " ".join((out.stdout + out.stderr).split())[-300:]
        raise AuditFailure(f"auditwheel show --json {wheel.name} gave no JSON (rc {out.returncode}): {tail}")
    if out.returncode != 0 or "error" in shown or not shown.get("overall_tag"):
        raise AuditFailure(f"auditwheel show {wheel.name} (rc {out.returncode}): "
                           f"{shown.get('error') or 'no platform tag'}")
    return shown


def check_policy(a: WheelAudit, wheel: Path, limit: str) -> None:
    cap = glibc_of(limit + "_x")
    try:
        shown = auditwheel_show(wheel)
    except AuditFailure as exc:
        a.add("policy", False, str(exc))
        return
    a.policy = shown["overall_tag"]
    if not a.policy.startswith("manylinux"):
        why = [k for k in ("pyfpe", "ucs2", "unsupported_isa") if shown.get(k)] or ["external libraries or symbols"]
        a.add("policy", False, f"auditwheel: {a.policy}, no manylinux policy ({', '.join(why)}); limit {limit}")
        return
    tags = wheel_tags(wheel)[1]
    bad = [t for t in tags if not t.startswith("manylinux") or glibc_of(t) > cap]
    policy_ok = glibc_of(a.policy) <= cap
    a.add("policy", policy_ok and not bad,
          f"auditwheel: {a.policy}; file tags {'.'.join(tags)}; limit {limit}"
          + (f"; tags over the limit or not manylinux: {bad}" if bad else ""))


def check_elf(a: WheelAudit, wheel: Path) -> None:
    reports = check_so.check_wheel(str(wheel))
    fails = [f"{r.path.split('!')[-1]}: {f.check} ({f.detail})" for r in reports for f in r.failures]
    notes = [f"{f.check}: {f.detail}" for r in reports for f in r.findings if f.check in ("machine", "suffix")]
    a.add("elf", not fails, "; ".join(fails) if fails else f"{len(reports)} .so hardened; " + "; ".join(notes))


def _host_interpreter(version: str) -> str | None:
    try:
        return str(container.pyenv_interpreter(version) / "bin" / f"python{version}")
    except container.ContainerError:
        return shutil.which(f"python{version}")


def check_import(a: WheelAudit, wheel: Path, engine: container.Engine | None, userlands: dict,
                 base: str = "local") -> None:
    """Import apex_C from the unpacked wheel in an interpreter of the wheel's Python and arch."""
    with tempfile.TemporaryDirectory(prefix="audit-import-") as tmp:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp)
        Path(tmp).chmod(0o755)
        if a.arch == "x86_64":
            interp = _host_interpreter(a.python)
            if not interp:
                a.add("import", None, f"not possible here: no CPython {a.python} on this machine")
                return
            cmd = [interp, "-c", IMPORT_PROBE, tmp]
            where = f"native, {interp}"
        elif base == "public" and engine is not None:
            # the manylinux aarch64 image carries every CPython under /opt/python
            image = matrix.load().arch("aarch64")["manylinux_image"]
            tag = "cp" + a.python.replace(".", "")
            cmd = engine.run_cmd("--network=none", "--platform=linux/arm64", "-v", f"{tmp}:/w:ro", image,
                                 f"/opt/python/{tag}-{tag}/bin/python{a.python}", "-c", IMPORT_PROBE, "/w")
            where = "qemu-aarch64, manylinux_2_28_aarch64"
        else:
            suite = userlands.get(a.python)
            if not suite or engine is None:
                a.add("import", None, f"not possible here: no arm64 CPython {a.python} userland (qemu) on this machine")
                return
            image = container.arm64_userland(suite, engine)["image"]
            cmd = engine.run_cmd("--network=none", "-v", f"{tmp}:/w:ro", image, "python3", "-c", IMPORT_PROBE, "/w")
            where = f"qemu-aarch64, Debian {suite} python3"
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        if out.returncode != 0:
            a.add("import", False, f"{where}: {out.stderr.strip()[-400:]}")
            return
        probe = json.loads(out.stdout.strip().splitlines()[-1])
        a.add("import", True, f"{where}: {probe['module']} (SIMD {probe['level']} of {probe['levels']})")
        check_dispatch(a, probe["levels"])


def check_dispatch(a: WheelAudit, levels: list[str]) -> None:
    """The run-time dispatch must offer every SIMD level the CPU it runs on supports (a build whose CPU detection
    does not work silently runs the baseline kernels only)."""
    expected = expected_simd_levels(a.arch, cpu_flags() if a.arch == "x86_64" else set())
    missing = [lvl for lvl in expected if lvl not in levels]
    a.add("dispatch", not missing,
          f"offers {levels}; this CPU supports {expected}" + (f"; MISSING {missing}: the extension's CPU feature "
                                                               "detection does not see them" if missing else ""))


def audit_wheel(wheel: Path, m: matrix.Matrix, engine: container.Engine | None, imports: bool = True,
                base: str = "local") -> WheelAudit:
    pythons, plats = wheel_tags(wheel)
    py = next((t for t in pythons if re.fullmatch(r"cp3\d+", t)), None)
    if py is None:
        raise AuditFailure(f"{wheel.name}: python tags {pythons} name no CPython 3 version (cp3XY)")
    arch = next((x for x in m.arches if all(p.endswith("_" + x) for p in plats)), "?")
    data = wheel.read_bytes()
    a = WheelAudit(wheel.name, len(data), hashlib.sha256(data).hexdigest(), f"{py[2]}.{py[3:]}", arch)
    check_policy(a, wheel, m.manylinux_max)
    check_elf(a, wheel)
    if imports:
        check_import(a, wheel, engine, m.local.get("arm64_userlands", {}), base)
    return a


def audit(wheels: list[Path], imports: bool = True, base: str = "auto") -> list[WheelAudit]:
    m = matrix.load()
    engine = None
    if base == "auto":
        base = "public" if container.registry_reachable() else "local"
    if imports and any(w.name.endswith("_aarch64.whl") for w in wheels):
        container.ensure_binfmt("aarch64")
        engine = container.detect_engine()
    return [audit_wheel(w, m, engine, imports, base) for w in wheels]


def format_table(results: list[WheelAudit]) -> str:
    lines = []
    for a in results:
        lines.append(f"{'PASS' if a.ok else 'FAIL'}  {a.wheel}  ({a.size / 1e6:.2f} MB, policy {a.policy or '?'})")
        for name, c in a.checks.items():
            mark = {True: "ok  ", False: "FAIL", None: "n/a "}[c["ok"]]
            lines.append(f"   {mark} {name:7} {c['detail']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheels", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--no-import", action="store_true", help="skip the import check")
    ap.add_argument("--base", choices=("auto", "public", "local"), default="auto",
                    help="where aarch64 interpreters come from: the manylinux image or the local Debian userlands")
    args = ap.parse_args(argv)
    try:
        results = audit(args.wheels, imports=not args.no_import, base=args.base)
    except (AuditFailure, check_so.AuditError, container.ContainerError) as e:
        log.error("audit: error: %s", e)
        return 2
    print(format_table(results), flush=True)
    if args.json:
        args.json.write_text(json.dumps([{**asdict(a), "ok": a.ok} for a in results], indent=1))
    failed = [a.wheel for a in results if not a.ok]
    if failed:
        log.error("audit: %d of %d wheels failed: %s", len(failed), len(results), ", ".join(failed))
        return 1
    log.info("audit: %d wheels passed", len(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
