"""Unit tests of the release tooling's pure parts (run by `nox -s container` before it builds, and on their own with
`python -m pytest tools/tests`). The container paths themselves are exercised by the sessions, not mocked here."""

from __future__ import annotations

import datetime
import json
import resource
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools import audit, container, cross_headers, matrix, sbom, util  # noqa: E402

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


def test_matrix_has_the_ten_cells_x86_64_first():
    m = matrix.load()
    cells = m.cells()
    assert [c.name for c in cells[:5]] == ["cp39-x86_64", "cp310-x86_64", "cp311-x86_64", "cp312-x86_64",
                                           "cp313-x86_64"]
    assert len({c.name for c in cells}) == 10
    full = [c for c in cells if c.suite == "full"]
    assert [(c.name, c.torch, c.torch_extra) for c in full] == [("cp311-x86_64", "2.13.0", ("2.14.1", "2.15.0"))]
    assert {c.python: c.arm64_userland for c in cells if c.arch == "aarch64" and c.arm64_userland} == {
        "3.9": "bullseye", "3.11": "bookworm", "3.13": "trixie"}
    assert m.cell("3.9", "aarch64").ext_suffix == ".cpython-39-aarch64-linux-gnu.so"
    for dropped in ("3.7", "3.8"):
        with pytest.raises(ValueError, match="no release cell"):
            m.cell(dropped, "x86_64")


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
    with pytest.raises(util.WheelNotFound, match="found 0"):
        util.find_wheel(tmp_path, "cp311", "x86_64")
    (tmp_path / "apex-0.1.0-cp311-cp311-manylinux_2_17_x86_64.whl").write_bytes(b"")
    (tmp_path / "apex-0.1.0-cp311-cp311-manylinux_2_17_aarch64.whl").write_bytes(b"")
    assert util.find_wheel(tmp_path, "cp311", "x86_64").name.endswith("_x86_64.whl")


def test_ulimits_stay_below_the_hard_limits():
    for spec, res in zip(container._ulimits(), (resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC)):
        soft, hard = (int(v) for v in spec.split("=")[1].split(":"))
        limit = resource.getrlimit(res)[1]
        assert soft == hard <= 4096 and (limit == resource.RLIM_INFINITY or hard <= limit)


def test_foreign_userland_without_arch_test_says_what_to_install(monkeypatch):
    """mmdebstrap stops on a foreign architecture without arch-test; the bootstrap names the package first."""
    foreign = "aarch64" if util.host_arch() == "x86_64" else "x86_64"
    present = {"mmdebstrap", "dpkg-query", "tar"}
    monkeypatch.setattr(container.shutil, "which", lambda tool: f"/usr/bin/{tool}" if tool in present else None)
    u = container.Userland("test", "bookworm", foreign, ("python3",))
    with pytest.raises(container.ContainerError, match=r"arch-test not found: .*apt-get install -y arch-test"):
        container.build_userland(u, engine=None, key="k")


def _torch_folder(path: Path, *names: str) -> Path:
    path.mkdir(parents=True)
    for name in names:
        (path / name).write_bytes(b"")
    return path


def test_torch_folder_is_an_explicit_input(tmp_path, monkeypatch):
    folder = _torch_folder(tmp_path / "wheels", "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
                           "torch_npu-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl")
    monkeypatch.setenv(container.TORCH_WHEELS_ENV, str(folder))
    assert container.torch_wheel_folder("2.13.0") == folder.resolve()  # 2.13.0 matches the +cpu local build
    mounts, env = container.pip_config_mounts("2.13.0")
    assert mounts == ["-v", f"{folder.resolve()}:{folder.resolve()}:ro"]
    assert env == {"PIP_FIND_LINKS": str(folder.resolve())}
    with pytest.raises(container.ContainerError, match=r"holds no wheel for torch==2\.14\.1 .*torch-2\.13\.0\+cpu"):
        container.torch_wheel_folder("2.14.1")
    monkeypatch.setenv(container.TORCH_WHEELS_ENV, str(tmp_path / "missing"))
    with pytest.raises(container.ContainerError, match="not a directory"):
        container.torch_wheel_folder("2.13.0")


def test_torch_folder_falls_back_to_pip_find_links(tmp_path, monkeypatch):
    monkeypatch.delenv(container.TORCH_WHEELS_ENV, raising=False)
    empty = _torch_folder(tmp_path / "empty")
    full = _torch_folder(tmp_path / "full", "torch-2.13.0-cp311-cp311-linux_x86_64.whl")
    listing = (f"global.find-links='{tmp_path / 'absent'} file://{empty}'\n"
               f"global.extra-index-url='file:///somewhere/simple'\n"
               f":env:.find-links='{full}'\n")
    assert container.pip_find_links(listing) == [empty, full]
    assert container.torch_wheel_folder("2.13.0", listing) == full.resolve()
    with pytest.raises(container.ContainerError, match=f"set {container.TORCH_WHEELS_ENV}="):
        container.torch_wheel_folder("2.14.1", listing)
    with pytest.raises(container.ContainerError, match="none configured"):
        container.torch_wheel_folder("2.13.0", "global.cert='/etc/ssl/certs/ca-certificates.crt'\n")


def _fake_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("apex_C.cpython-311-x86_64-linux-gnu.so", b"\x7fELF")
    return path


def test_sbom_lists_artifacts_images_and_tools(tmp_path, monkeypatch):
    pytest.importorskip("cyclonedx", reason="the SBOM is made with cyclonedx-python-lib")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    _fake_wheel(tmp_path / "apex-0.1.0-cp311-cp311-manylinux_2_17_x86_64.whl")
    (tmp_path / "apex-0.1.0.tar.gz").write_bytes(b"sdist")
    manifest = {"image": "localhost/apex-build-bookworm-amd64:abc", "key": "abc", "mirror": "http://deb.debian.org",
                "created": "2026-01-01T00:00:00Z", "note": "n", "debian_arch": "amd64", "image_id": "sha256:1",
                "spec": {"role": "build", "suite": "bookworm"},
                "packages": [{"name": "libc6", "version": "2.36-9", "arch": "amd64"},
                             {"name": "libssl3", "version": "3.0.17-1~deb12u2+b1", "arch": "amd64"},
                             {"name": "zlib1g", "version": "1:1.2.13.dfsg-1", "arch": "amd64"}],
                "pythons": {"3.11": {"full_version": "3.11.7", "sha256": "a" * 64, "path": "/opt/python/cp311-cp311",
                                     "source": "/root/.pyenv/versions/3.11.7"}}}
    tools = [{"file": "ziglang-0.17.1-py3-none-manylinux_2_12_x86_64.whl", "sha256": "b" * 64}]
    doc = sbom.make_sbom(tmp_path, [manifest], ["quay.io/pypa/manylinux_2_28_x86_64@sha256:" + "c" * 64], tools)
    assert doc["bomFormat"] == "CycloneDX" and doc["specVersion"] == "1.5"
    stamp = datetime.datetime.fromisoformat(doc["metadata"]["timestamp"].replace("Z", "+00:00"))
    assert stamp == datetime.datetime(2023, 11, 14, 22, 13, 20, tzinfo=datetime.timezone.utc)
    names = [c["name"] for c in doc["components"]]
    assert {"apex-0.1.0-cp311-cp311-manylinux_2_17_x86_64.whl", "apex-0.1.0.tar.gz", "torch"} <= set(names)
    image = next(c for c in doc["components"] if c["bom-ref"] == "image:localhost/apex-build-bookworm-amd64:abc")
    # purls from packageurl-python: a Debian version's '+' is percent-encoded, qualifiers sorted
    assert sorted(c["purl"] for c in image["components"] if "purl" in c) == [
        "pkg:deb/debian/libc6@2.36-9?arch=amd64&distro=bookworm",
        "pkg:deb/debian/libssl3@3.0.17-1~deb12u2%2Bb1?arch=amd64&distro=bookworm",
        "pkg:deb/debian/zlib1g@1:1.2.13.dfsg-1?arch=amd64&distro=bookworm"]
    assert {c["name"]: c.get("hashes") for c in image["components"] if c["name"] == "cpython"} == {
        "cpython": [{"alg": "SHA-256", "content": "a" * 64}]}
    assert any(c.get("purl") == "pkg:pypi/ziglang@0.17.1" and c["scope"] == "excluded" for c in doc["components"])
    deps = {d["ref"]: d.get("dependsOn", []) for d in doc["dependencies"]}
    assert deps["artifact:apex-0.1.0-cp311-cp311-manylinux_2_17_x86_64.whl"] == ["pkg:pypi/torch"]
    assert deps["pkg:pypi/apex@0.1.0"] == ["pkg:pypi/torch"] and deps["pkg:pypi/torch"] == []
    # same inputs, same document (serial number and timestamp derive from them)
    again = sbom.make_sbom(tmp_path, [manifest], [], tools)
    assert again["serialNumber"] == doc["serialNumber"]
    json.dumps(doc)  # serialisable
    assert sbom.validate(doc).startswith("valid against the CycloneDX 1.5 JSON schema")
    broken = json.loads(json.dumps(doc))
    broken["components"][0]["hashes"] = [{"alg": "SHA-256", "content": "not hex"}]
    with pytest.raises(sbom.SbomError, match="does not validate"):
        sbom.validate(broken)


def test_wheelhouse_finds_one_projects_wheels_by_normal_name(tmp_path):
    from tools import wheelhouse

    for name in ("torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", "Torch-2.14.1-cp311-cp311-linux_x86_64.whl",
                 "torch_npu-2.14.0-cp311-cp311-manylinux_2_28_x86_64.whl", "torchvision-0.1-py3-none-any.whl",
                 "torch-notawheel.whl"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in wheelhouse.wheels_of(tmp_path, "torch")] == [
        "Torch-2.14.1-cp311-cp311-linux_x86_64.whl", "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl"]
    assert [p.name for p in wheelhouse.wheels_of(tmp_path, "torch-npu")] == [
        "torch_npu-2.14.0-cp311-cp311-manylinux_2_28_x86_64.whl"]
