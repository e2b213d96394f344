"""tools/check_so.py (the wheel hardening audit) on small shared objects built here with the host C compiler.

Each defect is introduced alone into an otherwise hardened module, and the audit must name exactly that check.
Runs from the source tree only (the audit is a build tool, not part of the wheel); needs cc, pyelftools and
packaging (the audit reads the ELF files with pyelftools; no binutils).
"""

from __future__ import annotations

import importlib.util
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "check_so.py"
CC = shutil.which("cc") or shutil.which("gcc")
ARCH = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine())

pytestmark = [
    pytest.mark.skipif(not SCRIPT.is_file(), reason="tools/check_so.py is not here (run from the source tree)"),
    pytest.mark.skipif(CC is None, reason="needs a C compiler"),
    pytest.mark.skipif(importlib.util.find_spec("elftools") is None or importlib.util.find_spec("packaging") is None,
                       reason="needs pyelftools and packaging (the audit's readers)"),
    pytest.mark.skipif(sys.platform != "linux" or ARCH not in ("x86_64", "aarch64"), reason="Linux x86_64/aarch64"),
]

SOURCE = r"""
#include <string.h>
int PyInit_mod(void) { return 0; }
int copy_first(const char *s) { char buf[64]; strcpy(buf, s); return buf[0]; }
"""
HARDENED = ["-O2", "-fstack-protector-strong", "-Wl,-z,relro", "-Wl,-z,now", "-Wl,-z,noexecstack", "-Wl,-s"]
SUFFIX = f".cpython-311-{ARCH}-linux-gnu.so"
# An absolute code address stored in .text: the linker can only resolve it with a text relocation (-z notext allows
# it), so the module gets TEXTREL and nothing else changes.
TEXTREL_SOURCE = SOURCE + "int (*const entry_in_text)(void) __attribute__((section(\".text\"))) = PyInit_mod;\n"


@pytest.fixture(scope="module")
def audit():
    spec = importlib.util.spec_from_file_location("check_so_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    root = tmp_path_factory.mktemp("so")
    (root / "mod.c").write_text(SOURCE)
    (root / "textrel.c").write_text(TEXTREL_SOURCE)
    (root / "empty.c").write_text("int torch_placeholder(void) { return 1; }\n")
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(root / "libtorch.so"), str(root / "empty.c")], check=True)

    def _build(name: str, flags, drop=(), source: str = "mod.c") -> Path:
        out = root / name / ("mod" + SUFFIX)
        out.parent.mkdir()
        args = [f for f in HARDENED if f not in drop] + list(flags)
        subprocess.run([CC, "-shared", "-fPIC", "-o", str(out), str(root / source), *args], check=True,
                       capture_output=True)
        return out

    _build.root = root  # holds libtorch.so, a stand-in to link against
    return _build


def failed_checks(report):
    return sorted(f.check for f in report.failures)


def test_hardened_module_passes(audit, build):
    rep = audit.check_so(str(build("good", [])))
    assert rep.ok, audit.format_report(rep)
    assert {f.check for f in rep.findings} >= {"torch-free", "no-rpath", "relro", "bind-now", "nx-stack", "canary",
                                               "stripped", "init", "machine"}


@pytest.mark.parametrize(
    "name, flags, drop, expected",
    [
        ("rpath", ["-Wl,-rpath,/opt/somewhere"], (), ["no-rpath"]),
        ("norelro", ["-Wl,-z,norelro"], ("-Wl,-z,relro",), ["relro"]),
        ("lazy", ["-Wl,-z,lazy"], ("-Wl,-z,now",), ["bind-now"]),
        ("execstack", ["-Wl,-z,execstack"], ("-Wl,-z,noexecstack",), ["nx-stack"]),
        ("nocanary", ["-fno-stack-protector"], ("-fstack-protector-strong",), ["canary"]),
        ("symbols", [], ("-Wl,-s",), ["stripped"]),
    ],
)
def test_each_defect_is_named(audit, build, name, flags, drop, expected):
    rep = audit.check_so(str(build(name, flags, drop)))
    assert failed_checks(rep) == expected, audit.format_report(rep)


def test_text_relocations_fail(audit, build):
    rep = audit.check_so(str(build("textrel", ["-Wl,-z,notext"], source="textrel.c")))
    assert failed_checks(rep) == ["no-textrel"], audit.format_report(rep)
    assert "TEXTREL" in next(f.detail for f in rep.findings if f.check == "bind-now")


def test_module_suffix_arch_must_match_the_elf_machine(audit, build, tmp_path):
    other = "aarch64" if ARCH == "x86_64" else "x86_64"
    renamed = tmp_path / f"mod.cpython-311-{other}-linux-gnu.so"
    shutil.copy(build("suffixarch", []), renamed)
    rep = audit.check_so(str(renamed))
    assert failed_checks(rep) == ["machine"]
    assert next(f.detail for f in rep.findings if f.check == "machine") == f"ELF {ARCH}, suffix {other}"


def test_findings_read_from_the_elf(audit, build):
    rep = audit.check_so(str(build("details", [])))
    detail = {f.check: f.detail for f in rep.findings}
    assert "libc.so.6" in detail["torch-free"].split("NEEDED: ")[1]
    assert detail["machine"] == f"ELF {ARCH}, suffix {ARCH}"
    assert detail["nx-stack"] == "GNU_STACK flags 'RW'"
    assert "Flags: NOW" in detail["bind-now"]
    assert detail["glibc"].startswith("newest GLIBC symbol version: 2.")
    assert "strcpy" in detail["fortify"] or "__strcpy_chk" in detail["fortify"]


def test_not_an_elf_file_is_bad_input(audit, tmp_path):
    fake = tmp_path / ("mod" + SUFFIX)
    fake.write_bytes(b"#!/bin/sh\necho not a shared object\n")
    with pytest.raises(audit.AuditError, match="not an ELF file"):
        audit.check_so(str(fake))
    truncated = tmp_path / "trunc" / ("mod" + SUFFIX)
    truncated.parent.mkdir()
    truncated.write_bytes(b"\x7fELF\x02\x01\x01" + b"\x00" * 9)
    with pytest.raises(audit.AuditError):
        audit.check_so(str(truncated))


def test_libtorch_dependency_fails(audit, build):
    so = build("torchlinked", ["-L" + str(build.root), "-Wl,--no-as-needed", "-ltorch"])
    rep = audit.check_so(str(so))
    assert failed_checks(rep) == ["torch-free"]
    assert "libtorch.so" in next(f.detail for f in rep.findings if f.check == "torch-free")


def test_module_name_must_match_init(audit, build, tmp_path):
    renamed = tmp_path / ("other" + SUFFIX)
    shutil.copy(build("renamed", []), renamed)
    assert failed_checks(audit.check_so(str(renamed))) == ["init"]


def _wheel(directory: Path, so: Path, python: str, plat: str) -> Path:
    wheel = directory / f"mod-1.0-{python}-{python}-{plat}.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(so, so.name)
        zf.writestr("mod-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\n")
    return wheel


def test_wheel_tags_are_checked(audit, build, tmp_path):
    so = build("wheeled", [])
    other = "aarch64" if ARCH == "x86_64" else "x86_64"
    good = _wheel(tmp_path, so, "cp311", f"manylinux_2_17_{ARCH}.manylinux2014_{ARCH}")
    assert all(r.ok for r in audit.check_wheel(str(good)))
    (tmp_path / "py").mkdir()
    wrong_python = _wheel(tmp_path / "py", so, "cp312", f"manylinux_2_17_{ARCH}")
    assert [failed_checks(r) for r in audit.check_wheel(str(wrong_python))] == [["suffix"]]
    (tmp_path / "arch").mkdir()
    wrong_arch = _wheel(tmp_path / "arch", so, "cp311", f"manylinux_2_17_{other}")
    assert [failed_checks(r) for r in audit.check_wheel(str(wrong_arch))] == [["machine"]]


def test_cli_exit_codes(build, tmp_path):
    good = build("cli_good", [])
    bad = build("cli_bad", ["-fno-stack-protector"], ("-fstack-protector-strong",))
    run = lambda *paths: subprocess.run([sys.executable, str(SCRIPT), *map(str, paths)],  # noqa: E731
                                        capture_output=True, text=True)
    assert run(good).returncode == 0
    failed = run(good, bad)
    assert failed.returncode == 1 and "canary" in failed.stderr
    empty = tmp_path / "empty-1.0-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("empty/__init__.py", "")
    missing = run(empty)
    assert missing.returncode == 2 and "contains no .so" in missing.stderr
    badname = tmp_path / "not-a-wheel.whl"
    shutil.copy(empty, badname)
    named = run(badname)
    assert named.returncode == 2 and "not a wheel file name" in named.stderr
