"""Unit tests of tools/cibw.py's settings for cibuildwheel (what it would run with; nothing is built here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools import cibw, container  # noqa: E402

PODMAN = container.Engine("podman", "/usr/bin/podman", "runc", ("nofile=4096:4096", "nproc=4096:4096"))


def test_selected_pythons_reads_explicit_cpython_selectors():
    assert cibw.selected_pythons("cp311-*") == {"3.11"}
    assert cibw.selected_pythons("cp39-* cp314-manylinux_x86_64") == {"3.9", "3.14"}
    for bad in ("*", "pp310-*", "cp3*"):
        with pytest.raises(cibw.CibwError, match="explicit CPython selectors"):
            cibw.selected_pythons(bad)


def test_containers_conf_carries_runtime_and_ulimits(tmp_path):
    conf = cibw.containers_conf(PODMAN, tmp_path / "containers.conf")
    parsed = tomllib.loads(conf.read_text())
    assert parsed == {"containers": {"default_ulimits": ["nofile=4096:4096", "nproc=4096:4096"]},
                      "engine": {"runtime": "runc"}}
    assert cibw.containers_conf(container.Engine("docker", "/usr/bin/docker", None, ()), tmp_path / "x") is None


def test_local_overrides_compile_with_zig_for_glibc_2_17(monkeypatch):
    monkeypatch.setattr(cibw, "host_ca_bundle", lambda: "/etc/ssl/certs/ca.pem")
    env = cibw.local_overrides("localhost/img:key", "x86_64")
    assert env["CIBW_MANYLINUX_X86_64_IMAGE"] == "localhost/img:key"
    settings = env["CIBW_ENVIRONMENT"]
    for expected in ("CC=/project/tools/zigcxx", "CXX=/project/tools/zigcxx",
                     "LDSHARED='/project/tools/zigcxx -shared -O3'",
                     "APEX_ZIG_TARGET=x86_64-linux-gnu.2.17", "PATH=$PATH:/opt/apex-tools/bin",
                     "PIP_CERT=/host/etc/ssl/certs/ca.pem"):
        assert expected in settings.split(" ") or expected in settings
    # the tools venv installs what pyproject's build group pins
    assert "'ziglang>=0.11'" in env["CIBW_BEFORE_ALL"] and "'auditwheel>=6.8" in env["CIBW_BEFORE_ALL"]
    assert env["CIBW_BEFORE_ALL"].startswith(cibw.TOOLS_PYTHON + " -m venv ")


def test_local_overrides_refuse_aarch64():
    with pytest.raises(cibw.CibwError, match="amd64 only"):
        cibw.local_overrides("localhost/img:key", "aarch64")


def test_debian_pythons_come_from_the_matrix():
    table = cibw.debian_pythons()
    assert table.get("3.14") == "forky"
    with open(ROOT / "tools" / "matrix.toml", "rb") as f:
        assert set(table).isdisjoint(tomllib.load(f)["release"]["pythons"])


def test_one_debian_python_per_run(monkeypatch):
    monkeypatch.setattr(cibw, "containers_conf", lambda engine, dest: None)
    with pytest.raises(cibw.CibwError, match="separately"):
        cibw.environment("local", "cp311-* cp314-*", "x86_64", PODMAN)


def test_pyproject_test_step_installs_the_wheel_without_torch():
    with open(ROOT / "pyproject.toml", "rb") as f:
        cfg = tomllib.load(f)["tool"]["cibuildwheel"]
    assert cfg["test-environment"]["PIP_NO_DEPS"] == "1"
    assert cfg["test-environment"]["APEX_REQUIRE_EXT"] == "1"
    assert "PIP_NO_DEPS=0" in cfg["before-test"] and "numpy" in cfg["before-test"]
    assert "test-requires" not in cfg  # it would be installed with PIP_NO_DEPS=1, i.e. without pytest's dependencies
