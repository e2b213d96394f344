"""tools/audit.py on small wheels built here: each wheel violates exactly one check of the release audit (policy, elf,
import), and a hardened one passes them. The .so files come from the host C compiler; auditwheel (>= 6.8, for
`show --json`) and pyelftools are the audit's own tools. x86_64 only: the import check runs the wheel natively."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import platform
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools import audit, matrix  # noqa: E402

CC = shutil.which("cc") or shutil.which("gcc")


def _auditwheel_json() -> bool:
    try:
        return audit.Version(metadata.version("auditwheel")) >= audit.AUDITWHEEL_JSON
    except metadata.PackageNotFoundError:
        return False


pytestmark = [
    pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux", reason="Linux x86_64 only"),
    pytest.mark.skipif(CC is None, reason="needs a C compiler"),
    pytest.mark.skipif(importlib.util.find_spec("elftools") is None, reason="needs pyelftools"),
    pytest.mark.skipif(not _auditwheel_json(), reason=f"needs auditwheel >= {audit.AUDITWHEEL_JSON} (show --json)"),
]

HARDENED = ["-O2", "-fstack-protector-strong", "-Wl,-z,relro", "-Wl,-z,now", "-Wl,-z,noexecstack", "-Wl,-s"]
MODULE = "apex_C.cpython-311-x86_64-linux-gnu.so"
# A module whose init symbol exists (the ELF check is satisfied) but returns NULL without an exception: the import
# fails, and only the import check can see it.
FAILING_INIT = r"""
#include <string.h>
void *PyInit_apex_C(void) { return 0; }
int copy_first(const char *s) { char buf[64]; strcpy(buf, s); return buf[0]; }
"""
# The same module calling close_range (glibc 2.34): auditwheel's policy becomes manylinux_2_34, over the 2_28 limit.
NEW_GLIBC = ("#define _GNU_SOURCE\n#include <unistd.h>\n" + FAILING_INIT
             + "int closer(void) { return close_range(3, 3, 0); }\n")


def _so(tmp: Path, name: str, source: str, flags=HARDENED) -> Path:
    src = tmp / f"{name}.c"
    src.write_text(source)
    out = tmp / name / MODULE
    out.parent.mkdir()
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(out), str(src), *flags], check=True, capture_output=True)
    return out


def _wheel(directory: Path, so: Path, plat: str = "manylinux_2_17_x86_64") -> Path:
    """A wheel holding one module, with a RECORD (auditwheel reads the files through it)."""
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"apex-0.1.0-cp311-cp311-{plat}.whl"
    files = {MODULE: so.read_bytes(), "apex-0.1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"}
    record = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}"
              for n, d in files.items()]
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("apex-0.1.0.dist-info/RECORD", "\n".join([*record, "apex-0.1.0.dist-info/RECORD,,"]) + "\n")
    return wheel


def _audit(wheel: Path, imports: bool = False) -> audit.WheelAudit:
    return audit.audit_wheel(wheel, matrix.load(), None, imports=imports, base="local")


def _failed(a: audit.WheelAudit) -> list[str]:
    return sorted(name for name, c in a.checks.items() if c["ok"] is False)


def test_hardened_wheel_passes_policy_and_elf(tmp_path):
    a = _audit(_wheel(tmp_path / "w", _so(tmp_path, "good", FAILING_INIT)))
    assert _failed(a) == [], a.checks
    assert a.policy.startswith("manylinux_2_") and audit.glibc_of(a.policy) <= (2, 28)
    assert (a.python, a.arch) == ("3.11", "x86_64")


def test_policy_fails_a_module_needing_a_newer_glibc(tmp_path):
    a = _audit(_wheel(tmp_path / "w", _so(tmp_path, "glibc", NEW_GLIBC)))
    assert _failed(a) == ["policy"], a.checks
    assert a.policy == "manylinux_2_34_x86_64" and "limit manylinux_2_28" in a.checks["policy"]["detail"]


def test_policy_fails_a_file_tag_over_the_limit(tmp_path):
    a = _audit(_wheel(tmp_path / "w", _so(tmp_path, "tag", FAILING_INIT), plat="manylinux_2_34_x86_64"))
    assert _failed(a) == ["policy"], a.checks
    assert "tags over the limit or not manylinux: ['manylinux_2_34_x86_64']" in a.checks["policy"]["detail"]


def test_policy_fails_an_unrepaired_linux_tag(tmp_path):
    a = _audit(_wheel(tmp_path / "w", _so(tmp_path, "linux", FAILING_INIT), plat="linux_x86_64"))
    assert _failed(a) == ["policy"], a.checks
    assert "['linux_x86_64']" in a.checks["policy"]["detail"]


def test_elf_fails_an_unhardened_module(tmp_path):
    lazy = [f for f in HARDENED if f != "-Wl,-z,now"] + ["-Wl,-z,lazy"]
    a = _audit(_wheel(tmp_path / "w", _so(tmp_path, "lazy", FAILING_INIT, lazy)))
    assert _failed(a) == ["elf"], a.checks
    assert "bind-now" in a.checks["elf"]["detail"]


def test_import_fails_a_module_that_does_not_initialise(tmp_path):
    if audit._host_interpreter("3.11") is None:
        pytest.skip("no CPython 3.11 here to import the module with")
    a = _audit(_wheel(tmp_path / "w", _so(tmp_path, "noinit", FAILING_INIT)), imports=True)
    assert _failed(a) == ["import"], a.checks
    assert "apex_C" in a.checks["import"]["detail"]


def test_not_a_wheel_name_is_bad_input(tmp_path):
    bogus = tmp_path / "apex.whl"
    bogus.write_bytes(b"")
    with pytest.raises(audit.AuditFailure, match="not a wheel file name"):
        _audit(bogus)
