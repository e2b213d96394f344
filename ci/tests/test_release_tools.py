"""Unit tests of the release tooling's pure parts (run by `nox -s docker` before it builds, and on their own with
`python -m pytest ci/tests`). The container paths themselves are exercised by the sessions, not mocked here."""

from __future__ import annotations

import json
import os
import resource
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ci import audit, container, cross_headers, matrix, sbom, test_cell  # noqa: E402

X86_PYCONFIG = """\
#define HAVE_FOO 1
#define HAVE_GCC_ASM_FOR_X64 1
#define HAVE_GCC_ASM_FOR_X87 1
/* #undef HAVE_USABLE_WCHAR_T */
#define PY_SUPPORT_TIER 1
#define SIZEOF_WCHAR_T 4
"""


def test_cross_pyconfig_sets_the_four_arch_macros_and_nothing_else():
    out = cross_headers.derive_pyconfig(X86_PYCONFIG, "aarch64").splitlines()
    assert out[0].startswith("/* Derived for aarch64")
    assert out[1:] == [
        "#define HAVE_FOO 1",
        "/* #undef HAVE_GCC_ASM_FOR_X64 */",
        "/* #undef HAVE_GCC_ASM_FOR_X87 */",
        "#define HAVE_USABLE_WCHAR_T 1",
        "#define PY_SUPPORT_TIER 2",
        "#define SIZEOF_WCHAR_T 4",
    ]


def test_cross_pyconfig_without_support_tier_is_fine_before_3_11():
    text = X86_PYCONFIG.replace("#define PY_SUPPORT_TIER 1\n", "")
    assert "PY_SUPPORT_TIER" not in cross_headers.derive_pyconfig(text, "aarch64")


def test_cross_pyconfig_refuses_an_unknown_layout():
    with pytest.raises(cross_headers.CrossHeaderError, match="HAVE_GCC_ASM_FOR_X87"):
        cross_headers.derive_pyconfig(X86_PYCONFIG.replace("HAVE_GCC_ASM_FOR_X87", "SOMETHING_ELSE"), "aarch64")
    with pytest.raises(cross_headers.CrossHeaderError, match="x86_64 -> aarch64"):
        cross_headers.derive_pyconfig(X86_PYCONFIG, "riscv64")


def test_matrix_has_the_twelve_cells_x86_64_first():
    m = matrix.load()
    cells = m.cells()
    assert [c.name for c in cells[:6]] == ["cp38-x86_64", "cp39-x86_64", "cp310-x86_64", "cp311-x86_64",
                                           "cp312-x86_64", "cp313-x86_64"]
    assert len({c.name for c in cells}) == 12
    full = [c for c in cells if c.suite == "full"]
    assert [(c.name, c.torch, c.torch_extra) for c in full] == [("cp311-x86_64", "2.13.0", ("2.14.1", "2.15.0"))]
    assert {c.python: c.arm64_userland for c in cells if c.arch == "aarch64" and c.arm64_userland} == {
        "3.9": "bullseye", "3.11": "bookworm", "3.13": "trixie"}
    assert m.cell("3.8", "aarch64").ext_suffix == ".cpython-38-aarch64-linux-gnu.so"
    with pytest.raises(ValueError, match="no release cell"):
        m.cell("3.7", "x86_64")


def test_matrix_pins_public_images_by_digest():
    m = matrix.load()
    for arch in m.arches:
        ref = m.arch(arch)["manylinux_image"]
        assert f"manylinux_2_28_{arch}@sha256:" in ref and len(ref.split("@sha256:")[1]) == 64


def test_manylinux_tag_glibc_versions():
    assert audit.glibc_of("manylinux_2_17_x86_64") == (2, 17)
    assert audit.glibc_of("manylinux2014_aarch64") == (2, 17)
    assert audit.glibc_of("manylinux_2_28_aarch64") == (2, 28)
    with pytest.raises(audit.AuditFailure, match="not a manylinux"):
        audit.glibc_of("linux_x86_64")


def test_dispatch_check_flags_missing_levels(monkeypatch):
    monkeypatch.setattr(audit, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    a = audit.WheelAudit("w.whl", 1, "0" * 64, "3.11", "x86_64")
    audit.check_dispatch(a, ["baseline"])
    assert a.checks["dispatch"]["ok"] is False and "MISSING ['avx2']" in a.checks["dispatch"]["detail"]
    b = audit.WheelAudit("w.whl", 1, "0" * 64, "3.11", "x86_64")
    audit.check_dispatch(b, ["baseline", "avx2"])
    assert b.checks["dispatch"]["ok"] is True
    c = audit.WheelAudit("w.whl", 1, "0" * 64, "3.9", "aarch64")
    audit.check_dispatch(c, ["baseline"])
    assert c.checks["dispatch"]["ok"] is False


def test_find_wheel_wants_exactly_one(tmp_path):
    with pytest.raises(test_cell.CellTestError, match="found 0"):
        test_cell.find_wheel(tmp_path, "cp311", "x86_64")
    (tmp_path / "apex-0.1.0-cp311-cp311-manylinux_2_17_x86_64.whl").write_bytes(b"")
    (tmp_path / "apex-0.1.0-cp311-cp311-manylinux_2_17_aarch64.whl").write_bytes(b"")
    assert test_cell.find_wheel(tmp_path, "cp311", "x86_64").name.endswith("_x86_64.whl")


def test_ulimits_stay_below_the_hard_limits():
    for spec, res in zip(container._ulimits(), (resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC)):
        soft, hard = (int(v) for v in spec.split("=")[1].split(":"))
        limit = resource.getrlimit(res)[1]
        assert soft == hard <= 4096 and (limit == resource.RLIM_INFINITY or hard <= limit)


def test_pip_config_mounts_are_read_only_existing_paths():
    mounts, env = container.pip_config_mounts()
    assert mounts[0::2] == ["-v"] * (len(mounts) // 2)
    for spec in mounts[1::2]:
        src, dst, mode = spec.split(":")
        assert src == dst and mode == "ro" and os.path.exists(src)
    assert all(k.startswith("PIP_") for k in env)


def _fake_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("apex_C.cpython-311-x86_64-linux-gnu.so", b"\x7fELF")
    return path


def test_sbom_lists_artifacts_images_and_tools(tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    _fake_wheel(tmp_path / "apex-0.1.0-cp311-cp311-manylinux_2_17_x86_64.whl")
    (tmp_path / "apex-0.1.0.tar.gz").write_bytes(b"sdist")
    manifest = {"image": "localhost/apex-build-bookworm-amd64:abc", "key": "abc", "mirror": "http://deb.debian.org",
                "created": "2026-01-01T00:00:00Z", "note": "n", "debian_arch": "amd64", "image_id": "sha256:1",
                "spec": {"role": "build", "suite": "bookworm"},
                "packages": [{"name": "libc6", "version": "2.36-9", "arch": "amd64"}],
                "pythons": {"3.11": {"full_version": "3.11.7", "sha256": "a" * 64, "path": "/opt/python/cp311-cp311",
                                     "source": "/root/.pyenv/versions/3.11.7"}}}
    tools = [{"file": "ziglang-0.17.1-py3-none-manylinux_2_12_x86_64.whl", "sha256": "b" * 64}]
    doc = sbom.make_sbom(tmp_path, [manifest], ["quay.io/pypa/manylinux_2_28_x86_64@sha256:" + "c" * 64], tools)
    assert doc["bomFormat"] == "CycloneDX" and doc["specVersion"] == "1.5"
    assert doc["metadata"]["timestamp"] == "2023-11-14T22:13:20Z"
    names = [c["name"] for c in doc["components"]]
    assert names[:3] == ["apex-0.1.0-cp311-cp311-manylinux_2_17_x86_64.whl", "apex-0.1.0.tar.gz", "torch"]
    image = next(c for c in doc["components"] if c["bom-ref"] == "image:localhost/apex-build-bookworm-amd64:abc")
    assert [c["purl"] for c in image["components"] if "purl" in c] == [
        "pkg:deb/debian/libc6@2.36-9?arch=amd64&distro=bookworm"]
    assert any(c.get("purl") == "pkg:pypi/ziglang@0.17.1" and c["scope"] == "excluded" for c in doc["components"])
    wheel_dep = doc["dependencies"][0]
    assert wheel_dep["dependsOn"] == ["pkg:pypi/torch"]
    # same inputs, same document (serial number and timestamp derive from them)
    again = sbom.make_sbom(tmp_path, [manifest], [], tools)
    assert again["serialNumber"] == doc["serialNumber"]
    json.dumps(doc)  # serialisable
    status = sbom.validate(doc)
    assert "valid" in status or "not validated" in status
