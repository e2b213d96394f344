#!/usr/bin/env python3
"""Hardening and consistency audit of extension modules (.so), loose or inside wheels.

Usage:  python tools/check_so.py dist/*.whl [more.whl | module.so ...] [--json]

Every ELF shared object found is checked with `readelf` (binutils; it reads any architecture):
  torch-free   no libtorch / libc10 / libtorch_python / libtorch_cpu / libshm in NEEDED
  no-rpath     neither RPATH nor RUNPATH
  relro        a GNU_RELRO segment                       full RELRO = relro + bind-now
  bind-now     FLAGS BIND_NOW or FLAGS_1 NOW
  nx-stack     a GNU_STACK segment without the execute flag
  no-textrel   no TEXTREL (text relocations defeat W^X)
  canary       stack-protector code: __stack_chk_fail / __stack_chk_guard referenced or defined, or (x86_64,
               stripped, handler linked statically as zig does) the %fs:0x28 guard loads counted in the code
  stripped     no .symtab and no .debug_* sections
  init         PyInit_<module> exported (the module name matches the file name)
  machine      ELF machine == the architecture in the module suffix and in the wheel's platform tag(s)
  suffix       module suffix matches the wheel's python tag (cp311 -> .cpython-311-<arch>-linux-gnu.so, abi3)
Reported, never fatal: FORTIFY (how many __*_chk calls are imported and which fortifiable calls are not; the
compiler only fortifies calls whose buffer size it can see, and zig resolves them statically), the newest GLIBC
symbol version required, and the number of exported symbols.

API for other tools (the release toolchain uses it):
  check_paths(paths) -> list[SoReport]   wheels and/or .so files; SoReport.ok, .failures, .findings
  check_wheel(path)  -> list[SoReport]   every .so inside one wheel, checked against the wheel's tags
  check_so(path, expect_arch=None, expect_python=None) -> SoReport
Exit status of the CLI: 0 all passed, 1 a check failed, 2 bad input (no .so in a wheel, file missing, no readelf).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["AuditError", "Finding", "SoReport", "check_paths", "check_so", "check_wheel", "main"]

# readelf "Machine:" text -> wheel/multiarch architecture name
MACHINES = {
    "Advanced Micro Devices X86-64": "x86_64",
    "AArch64": "aarch64",
    "Intel 80386": "i686",
    "PowerPC64": "ppc64le",
    "IBM S/390": "s390x",
    "ARM": "armv7l",
}
KNOWN_ARCHES = ("x86_64", "aarch64", "i686", "ppc64le", "s390x", "armv7l")
TORCH_LIBS = re.compile(r"^lib(torch|torch_cpu|torch_cuda|torch_python|torch_global_deps|c10|c10_cuda|shm)\b")
CANARY_SYMBOLS = ("__stack_chk_fail", "__stack_chk_guard", "__stack_chk_fail_local")
# glibc functions with a __*_chk twin: imported plainly, they are calls the compiler could not fortify.
FORTIFIABLE = frozenset(
    "memcpy memmove mempcpy memset stpcpy stpncpy strcpy strncpy strcat strncat sprintf snprintf vsprintf "
    "vsnprintf printf fprintf vprintf vfprintf dprintf vdprintf fgets fread read pread pread64 recv recvfrom "
    "readlink getcwd realpath gets wcscpy wcsncpy wmemcpy wmemmove wmemset poll ppoll".split()
)
# x86_64 `mov %fs:0x28, %reg` (the TLS stack guard load): 64 REX.W(48|4c) 8b modrm(reg,rm=100) sib=25 disp32=0x28
X86_CANARY_LOAD = re.compile(rb"\x64[\x48\x4c]\x8b[\x04\x0c\x14\x1c\x24\x2c\x34\x3c]\x25\x28\x00\x00\x00")
SUFFIX = re.compile(
    r"^(?P<mod>[A-Za-z_][A-Za-z0-9_]*)\.(?:cpython-(?P<ver>\d+t?)-(?P<arch>[a-z0-9_]+)-linux-gnu|abi3)\.so$"
)


class AuditError(Exception):
    """Input that cannot be audited (missing file, no readelf, a wheel without extension modules)."""


@dataclass
class Finding:
    check: str
    ok: bool
    detail: str
    fatal: bool = True  # False: informational, reported but never fails the audit


@dataclass
class SoReport:
    path: str  # display name: "wheel.whl!pkg/mod.so" or the .so path
    findings: List[Finding] = field(default_factory=list)

    @property
    def failures(self) -> List[Finding]:
        return [f for f in self.findings if f.fatal and not f.ok]

    @property
    def ok(self) -> bool:
        return not self.failures

    def add(self, check: str, ok: bool, detail: str, fatal: bool = True) -> None:
        self.findings.append(Finding(check, ok, detail, fatal))


def _readelf(args: Sequence[str], path: str) -> str:
    exe = shutil.which("readelf")
    if exe is None:
        raise AuditError("readelf not found on PATH: install binutils (apt-get install binutils)")
    proc = subprocess.run(
        [exe, "-W", *args, path], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}, check=False
    )
    if proc.returncode != 0:
        raise AuditError(f"readelf {' '.join(args)} {path} failed: {proc.stderr.strip()}")
    return proc.stdout


def _segments(text: str) -> Dict[str, str]:
    """Program header type -> flags ('RW', 'R E', ...) from `readelf -lW`."""
    segs = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0].startswith(("GNU_", "LOAD", "DYNAMIC")) and len(parts) >= 8:
            segs.setdefault(parts[0], " ".join(parts[6:-1]))
    return segs


def _dynamic(text: str) -> List[Tuple[str, str]]:
    """(tag, value) pairs from `readelf -dW`."""
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*0x[0-9a-f]+\s+\((\w+)\)\s+(.*)$", line)
        if m:
            out.append((m.group(1), m.group(2).strip()))
    return out


def _sections(text: str) -> List[Tuple[str, int, int, str]]:
    """(name, file offset, size, flags) from `readelf -SW`."""
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*\[\s*\d+\]\s+(\S+)\s+\S+\s+[0-9a-f]+\s+([0-9a-f]+)\s+([0-9a-f]+)\s+[0-9a-f]+\s+(\S*)", line)
        if m and m.group(1) != "NULL":
            flags = m.group(4) if not m.group(4).isdigit() else ""
            out.append((m.group(1), int(m.group(2), 16), int(m.group(3), 16), flags))
    return out


def _symbols(text: str) -> List[Tuple[str, str, str]]:
    """(name without version, binding, section index or UND) from `readelf -sW` / `--dyn-syms`."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 8 and parts[0].endswith(":") and parts[0][:-1].isdigit():
            name = parts[7].split("@")[0]
            out.append((name, parts[4], parts[6]))
    return out


def _x86_canary_loads(path: str, sections: List[Tuple[str, int, int, str]]) -> int:
    count = 0
    with open(path, "rb") as fh:
        for name, offset, size, flags in sections:
            if "X" in flags and name != ".plt":
                fh.seek(offset)
                count += len(X86_CANARY_LOAD.findall(fh.read(size)))
    return count


def _wheel_tags(wheel_name: str) -> Tuple[List[str], List[str]]:
    """(python tags, platform tags) from a wheel file name (PEP 427: name-ver(-build)?-py-abi-plat.whl)."""
    parts = os.path.basename(wheel_name)[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        raise AuditError(f"{wheel_name}: not a wheel file name (expected name-version-python-abi-platform.whl)")
    return parts[-3].split("."), parts[-1].split(".")


def _platform_arch(plat: str) -> Optional[str]:
    for arch in KNOWN_ARCHES:
        if plat.endswith("_" + arch):
            return arch
    return None


def check_so(path: str, expect_arch: Optional[str] = None, expect_python: Optional[List[str]] = None,
             display: Optional[str] = None) -> SoReport:
    """Audit one shared object. expect_arch: the wheel's platform arch; expect_python: the wheel's python tags."""
    if not os.path.isfile(path):
        raise AuditError(f"{path}: no such file")
    rep = SoReport(display or path)
    header = _readelf(["-h"], path)
    if "ELF" not in header:
        raise AuditError(f"{path}: not an ELF file")
    machine_text = re.search(r"Machine:\s+(.*)", header)
    machine = MACHINES.get(machine_text.group(1).strip(), machine_text.group(1).strip()) if machine_text else "?"
    segs = _segments(_readelf(["-l"], path))
    dyn = _dynamic(_readelf(["-d"], path))
    sections = _sections(_readelf(["-S"], path))
    dynsyms = _symbols(_readelf(["--dyn-syms"], path))
    section_names = {s[0] for s in sections}
    symtab = _symbols(_readelf(["-s"], path)) if ".symtab" in section_names else []

    needed = [v.strip("[]").split("[")[-1].rstrip("]") for t, v in dyn if t == "NEEDED"]
    torch = [n for n in needed if TORCH_LIBS.match(n)]
    rep.add("torch-free", not torch, f"NEEDED: {', '.join(needed) or 'none'}" + (f"; links {torch}" if torch else ""))

    paths = [f"{t}={v}" for t, v in dyn if t in ("RPATH", "RUNPATH")]
    rep.add("no-rpath", not paths, "; ".join(paths) or "no RPATH/RUNPATH")

    rep.add("relro", "GNU_RELRO" in segs, "GNU_RELRO segment present" if "GNU_RELRO" in segs else "no GNU_RELRO")
    flags = " ".join(v for t, v in dyn if t in ("FLAGS", "FLAGS_1", "BIND_NOW"))
    bind_now = any(t == "BIND_NOW" for t, _ in dyn) or bool(re.search(r"\bBIND_NOW\b|\bNOW\b", flags))
    rep.add("bind-now", bind_now, f"dynamic flags: {flags or 'none'}")

    stack = segs.get("GNU_STACK")
    rep.add("nx-stack", stack is not None and "E" not in stack,
            f"GNU_STACK flags {stack!r}" if stack is not None else "no GNU_STACK segment (the loader assumes exec)")
    rep.add("no-textrel", not any(t == "TEXTREL" for t, _ in dyn) and "TEXTREL" not in flags,
            "text relocations present" if "TEXTREL" in flags else "no TEXTREL")

    imported = {n for n, _, ndx in dynsyms if ndx == "UND" and n}
    all_names = {n for n, _, _ in dynsyms} | {n for n, _, _ in symtab}
    canary_syms = sorted(set(CANARY_SYMBOLS) & all_names)
    if canary_syms:
        rep.add("canary", True, f"references {', '.join(canary_syms)}")
    elif machine == "x86_64":
        loads = _x86_canary_loads(path, sections)
        rep.add("canary", loads > 0, f"{loads} %fs:0x28 stack-guard loads in the code (handler linked statically)"
                if loads else "no __stack_chk_* symbol and no %fs:0x28 guard load: built without -fstack-protector")
    else:
        rep.add("canary", False, f"no __stack_chk_* symbol ({machine}, stripped): cannot see a stack protector")

    debug = sorted(n for n in section_names if n.startswith((".debug_", ".zdebug_")))
    not_stripped = [".symtab"] * (".symtab" in section_names) + debug
    rep.add("stripped", not not_stripped, f"has {', '.join(not_stripped)}" if not_stripped else "no .symtab/.debug_*")

    base = os.path.basename(display.split("!")[-1] if display else path)
    m = SUFFIX.match(base)
    module = m.group("mod") if m else base.split(".")[0]
    exported = {n for n, bind, ndx in dynsyms if ndx != "UND" and bind in ("GLOBAL", "WEAK") and n}
    rep.add("init", f"PyInit_{module}" in exported, f"PyInit_{module} " + ("exported" if f"PyInit_{module}" in
                                                                              exported else "missing"))

    arches = {"ELF": machine}
    if m and m.group("arch"):
        arches["suffix"] = m.group("arch")
    if expect_arch:
        arches["platform tag"] = expect_arch
    rep.add("machine", len(set(arches.values())) == 1, ", ".join(f"{k} {v}" for k, v in arches.items()))

    if expect_python is not None:
        if not m:
            rep.add("suffix", False, f"{base}: not an extension module name (expected <mod>.cpython-XY-<arch>-linux-"
                                     "gnu.so or <mod>.abi3.so)")
        elif m.group("ver") is None:
            ok = any(t.startswith("cp3") for t in expect_python)
            rep.add("suffix", ok, f"abi3 module, python tags {'.'.join(expect_python)}")
        else:
            want = [t[2:] for t in expect_python if t.startswith("cp")]
            rep.add("suffix", m.group("ver") in want,
                    f"module for cpython-{m.group('ver')}, wheel python tags {'.'.join(expect_python)}")

    fortified = sorted(n for n in imported if n.startswith("__") and n.endswith("_chk") and n != "__stack_chk_fail")
    plain = sorted(imported & FORTIFIABLE)
    names = f" ({', '.join(fortified)})" if fortified else ""
    rep.add("fortify", True, f"{len(fortified)} fortified imports{names}; fortifiable calls imported plainly: "
            f"{', '.join(plain) or 'none'}", fatal=False)
    glibc = sorted({v for v in re.findall(r"@+GLIBC_([0-9.]+)", _readelf(["--dyn-syms"], path))},
                   key=lambda v: tuple(int(x) for x in v.split(".")))
    rep.add("glibc", True, f"newest GLIBC symbol version: {glibc[-1] if glibc else 'none'}", fatal=False)
    rep.add("exports", True, f"{len(exported)} exported symbols", fatal=False)
    return rep


def check_wheel(path: str) -> List[SoReport]:
    """Audit every .so in a wheel against the wheel's python and platform tags."""
    if not os.path.isfile(path):
        raise AuditError(f"{path}: no such file")
    py_tags, plat_tags = _wheel_tags(path)
    arches = {_platform_arch(p) for p in plat_tags} - {None}
    if len(arches) > 1:
        raise AuditError(f"{path}: platform tags name several architectures: {plat_tags}")
    arch = arches.pop() if arches else None
    reports = []
    with zipfile.ZipFile(path) as zf, tempfile.TemporaryDirectory(prefix="check_so-") as tmp:
        members = [n for n in zf.namelist() if n.endswith(".so") or ".so." in os.path.basename(n)]
        if not members:
            raise AuditError(f"{path}: contains no .so file (expected the compiled extension)")
        for i, name in enumerate(members):
            target = os.path.join(tmp, str(i), os.path.basename(name))
            os.makedirs(os.path.dirname(target))
            with zf.open(name) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            rep = check_so(target, arch, py_tags, display=f"{os.path.basename(path)}!{name}")
            if arch is None:
                rep.add("machine", False, f"wheel platform tags {plat_tags} name no Linux architecture")
            reports.append(rep)
    return reports


def check_paths(paths: Sequence[str]) -> List[SoReport]:
    reports = []
    for p in paths:
        reports += check_wheel(p) if p.endswith(".whl") else [check_so(p)]
    return reports


def format_report(rep: SoReport) -> str:
    lines = [f"{'PASS' if rep.ok else 'FAIL'}  {rep.path}"]
    for f in rep.findings:
        mark = "ok  " if f.ok else ("FAIL" if f.fatal else "note")
        lines.append(f"  {mark} {f.check:<11} {f.detail}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="wheels (.whl) and/or shared objects (.so)")
    ap.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = ap.parse_args(argv)
    try:
        reports = check_paths(args.paths)
    except (AuditError, zipfile.BadZipFile) as exc:
        print(f"check_so: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{"path": r.path, "ok": r.ok, "findings": [asdict(f) for f in r.findings]}
                          for r in reports], indent=2))
    else:
        print("\n".join(format_report(r) for r in reports))
    failed = [r for r in reports if not r.ok]
    sys.stdout.flush()
    if failed:
        print(f"check_so: {len(failed)} of {len(reports)} shared objects failed: "
              + "; ".join(f"{r.path}: {', '.join(f.check for f in r.failures)}" for r in failed), file=sys.stderr)
        return 1
    print(f"check_so: all {len(reports)} shared objects passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
