#!/usr/bin/env python3
"""Hardening and consistency audit of extension modules (.so), loose or inside wheels.

Usage:  python tools/check_so.py dist/*.whl [more.whl | module.so ...] [--json]

Every ELF shared object found is read with pyelftools (any architecture, no binutils) and checked:
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
Needs pyelftools (ELF) and packaging (wheel file names); runs on Python >= 3.9 (the build sessions of every cell).
Exit status of the CLI: 0 all passed, 1 a check failed, 2 bad input (no .so in a wheel, file missing, not an ELF
file, pyelftools or packaging missing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["AuditError", "Finding", "SoReport", "check_paths", "check_so", "check_wheel", "main"]

# ELF e_machine (pyelftools' name) -> wheel/multiarch architecture name
MACHINES = {
    "EM_X86_64": "x86_64",
    "EM_AARCH64": "aarch64",
    "EM_386": "i686",
    "EM_PPC64": "ppc64le",
    "EM_S390": "s390x",
    "EM_ARM": "armv7l",
}
# Bit values of the ELF gABI: program header flags, section flags, DT_FLAGS and DT_FLAGS_1 (names as readelf prints).
PF_X, PF_W, PF_R = 0x1, 0x2, 0x4
SHF_EXECINSTR = 0x4
DF_TEXTREL, DF_BIND_NOW = 0x4, 0x8
DF_NAMES = ((0x1, "ORIGIN"), (0x2, "SYMBOLIC"), (DF_TEXTREL, "TEXTREL"), (DF_BIND_NOW, "BIND_NOW"),
            (0x10, "STATIC_TLS"))
DF_1_NOW = 0x1
DF_1_NAMES = tuple((1 << i, n) for i, n in enumerate(
    "NOW GLOBAL GROUP NODELETE LOADFLTR INITFIRST NOOPEN ORIGIN DIRECT TRANS INTERPOSE NODEFLIB NODUMP CONFALT "
    "ENDFILTEE DISPRELDNE DISPRELPND NODIRECT IGNMULDEF NOKSYMS NOHDR EDITED NORELOC SYMINTPOSE GLOBAUDIT SINGLETON "
    "STUB PIE".split()))
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
    """Input that cannot be audited (missing file, not ELF, no pyelftools, a wheel without extension modules)."""


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


def _open_elf(path: str):
    """An ELFFile over `path` (the caller closes the stream); AuditError for a non-ELF file or a missing pyelftools."""
    try:
        from elftools.common.exceptions import ELFError
        from elftools.elf.elffile import ELFFile
    except ImportError:
        raise AuditError("pyelftools is not installed: pip install 'pyelftools>=0.29' (the audit reads ELF files "
                         "with it)") from None
    stream = open(path, "rb")  # check_so closes it
    try:
        return ELFFile(stream)
    except ELFError as exc:
        stream.close()
        raise AuditError(f"{path}: not an ELF file ({exc})") from None


def _bit_names(value: int, names: Sequence[Tuple[int, str]]) -> List[str]:
    out = [name for bit, name in names if value & bit]
    rest = value & ~sum(bit for bit, _ in names)
    return out + ([hex(rest)] if rest else [])


def _segments(elf) -> Dict[str, str]:
    """Program header type (readelf's spelling: GNU_STACK, LOAD, ...) -> flags ('RW', 'R E', 'RWE')."""
    segs: Dict[str, str] = {}
    for seg in elf.iter_segments():
        kind = seg["p_type"]
        kind = kind[3:] if isinstance(kind, str) and kind.startswith("PT_") else str(kind)
        f = seg["p_flags"]
        text = ("R" if f & PF_R else " ") + ("W" if f & PF_W else " ") + ("E" if f & PF_X else " ")
        segs.setdefault(kind, text.strip())
    return segs


def _dynamic(elf) -> List[Tuple[str, object]]:
    """(tag without DT_, value) pairs of the dynamic section: library names for NEEDED/RPATH/RUNPATH, else ints."""
    out: List[Tuple[str, object]] = []
    for section in elf.iter_sections():
        if section["sh_type"] != "SHT_DYNAMIC":
            continue
        for tag in section.iter_tags():
            name = str(tag.entry.d_tag)
            name = name[3:] if name.startswith("DT_") else name
            value = {"NEEDED": "needed", "RPATH": "rpath", "RUNPATH": "runpath"}.get(name)
            out.append((name, getattr(tag, value) if value else tag.entry.d_val))
    return out


def _sections(elf) -> List[Tuple[str, int, int, bool]]:
    """(name, file offset, size, executable) of every section with file contents."""
    return [(s.name, s["sh_offset"], s["sh_size"], bool(s["sh_flags"] & SHF_EXECINSTR))
            for s in elf.iter_sections() if s["sh_type"] not in ("SHT_NULL", "SHT_NOBITS")]


def _symbols(elf, section_type: str) -> List[Tuple[str, str, str]]:
    """(name, binding GLOBAL/WEAK/LOCAL, 'UND' or the section index) of every symbol of one table type."""
    out = []
    for section in elf.iter_sections():
        if section["sh_type"] != section_type:
            continue
        for sym in section.iter_symbols():
            bind = sym["st_info"]["bind"]
            ndx = sym["st_shndx"]
            out.append((sym.name, bind[4:] if bind.startswith("STB_") else bind,
                        "UND" if ndx == "SHN_UNDEF" else str(ndx)))
    return out


def _glibc_versions(elf) -> List[str]:
    """GLIBC_x.y versions the module requires (its version-needs section), oldest first."""
    found = set()
    for section in elf.iter_sections():
        if section["sh_type"] != "SHT_GNU_verneed":
            continue
        for _, auxiliaries in section.iter_versions():
            for aux in auxiliaries:
                m = re.fullmatch(r"GLIBC_([0-9]+(?:\.[0-9]+)*)", aux.name)
                if m:
                    found.add(m.group(1))
    return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))


def _x86_canary_loads(path: str, sections: List[Tuple[str, int, int, bool]]) -> int:
    count = 0
    with open(path, "rb") as fh:
        for name, offset, size, executable in sections:
            if executable and name != ".plt":
                fh.seek(offset)
                count += len(X86_CANARY_LOAD.findall(fh.read(size)))
    return count


def _wheel_tags(wheel_name: str) -> Tuple[List[str], List[str]]:
    """(python tags, platform tags) of a wheel file name, each sorted (packaging's PEP 427 parser)."""
    try:
        from packaging.utils import InvalidWheelFilename, parse_wheel_filename
    except ImportError:
        raise AuditError("packaging is not installed: pip install 'packaging>=22'") from None
    try:
        _, _, _, tags = parse_wheel_filename(os.path.basename(wheel_name))
    except (InvalidWheelFilename, ValueError) as exc:
        raise AuditError(f"{wheel_name}: not a wheel file name ({exc})") from None
    return sorted({t.interpreter for t in tags}), sorted({t.platform for t in tags})


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
    elf = _open_elf(path)
    try:
        machine = MACHINES.get(elf["e_machine"], str(elf["e_machine"]))
        segs = _segments(elf)
        dyn = _dynamic(elf)
        sections = _sections(elf)
        dynsyms = _symbols(elf, "SHT_DYNSYM")
        symtab = _symbols(elf, "SHT_SYMTAB")
        glibc = _glibc_versions(elf)
    except Exception as exc:  # pyelftools raises plain errors (struct, ELFError) on truncated or corrupt files
        raise AuditError(f"{path}: unreadable ELF file ({type(exc).__name__}: {exc})") from None
    finally:
        elf.stream.close()
    section_names = {s[0] for s in sections} | ({".symtab"} if symtab else set())

    needed = [str(v) for t, v in dyn if t == "NEEDED"]
    torch = [n for n in needed if TORCH_LIBS.match(n)]
    rep.add("torch-free", not torch, f"NEEDED: {', '.join(needed) or 'none'}" + (f"; links {torch}" if torch else ""))

    paths = [f"{t}={v}" for t, v in dyn if t in ("RPATH", "RUNPATH")]
    rep.add("no-rpath", not paths, "; ".join(paths) or "no RPATH/RUNPATH")

    rep.add("relro", "GNU_RELRO" in segs, "GNU_RELRO segment present" if "GNU_RELRO" in segs else "no GNU_RELRO")
    df = 0
    df_1 = 0
    for t, v in dyn:
        df |= int(v) if t == "FLAGS" else 0
        df_1 |= int(v) if t == "FLAGS_1" else 0
    # the spelling of `readelf -d`: DT_FLAGS bit names, then "Flags:" and the DT_FLAGS_1 bit names
    words = [*(["BIND_NOW"] if any(t == "BIND_NOW" for t, _ in dyn) else []), *_bit_names(df, DF_NAMES),
             *(["Flags:", *_bit_names(df_1, DF_1_NAMES)] if any(t == "FLAGS_1" for t, _ in dyn) else [])]
    flags = " ".join(words)
    bind_now = any(t == "BIND_NOW" for t, _ in dyn) or bool(df & DF_BIND_NOW) or bool(df_1 & DF_1_NOW)
    rep.add("bind-now", bind_now, f"dynamic flags: {flags or 'none'}")

    stack = segs.get("GNU_STACK")
    rep.add("nx-stack", stack is not None and "E" not in stack,
            f"GNU_STACK flags {stack!r}" if stack is not None else "no GNU_STACK segment (the loader assumes exec)")
    textrel = any(t == "TEXTREL" for t, _ in dyn) or bool(df & DF_TEXTREL)
    rep.add("no-textrel", not textrel, "text relocations present" if textrel else "no TEXTREL")

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
