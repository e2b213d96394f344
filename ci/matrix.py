"""The release matrix (ci/matrix.toml) as Python objects, plus a CLI for the CI pipeline and the docs.

    python -m ci.matrix              # one line per cell
    python -m ci.matrix --github     # JSON for a GitHub Actions `strategy.matrix`
    python -m ci.matrix --markdown   # the support table in README.md / docs/release.md

Runs on the host interpreter that drives nox (3.11+: tomllib); container-side scripts never import it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import tomllib

MATRIX_FILE = Path(__file__).with_name("matrix.toml")


@dataclass(frozen=True)
class Cell:
    """One wheel of the release: a CPython version on an architecture, and how its wheel is tested."""

    python: str  # "3.11"
    arch: str  # "x86_64" | "aarch64"
    suite: str  # "kernels" | "full"
    torch: str | None = None  # torch for the full suite (CI)
    torch_extra: tuple[str, ...] = ()  # further torch versions, `nox -s torch-versions` only
    arm64_userland: str | None = None  # Debian suite with this arm64 interpreter (offline path)

    @property
    def tag(self) -> str:
        """The CPython tag, e.g. cp311."""
        return "cp" + self.python.replace(".", "")

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
    def arches(self) -> list[str]:
        return list(self.raw["release"]["arches"])

    @property
    def manylinux_max(self) -> str:
        return self.raw["release"]["manylinux_max"]

    def arch(self, arch: str) -> dict:
        try:
            return self.raw["arch"][arch]
        except KeyError:
            raise ValueError(f"unknown arch {arch!r}: expected one of {self.arches}") from None

    @property
    def local(self) -> dict:
        return self.raw["local"]

    def variant(self, name: str) -> dict:
        try:
            return self.raw["variants"][name]
        except KeyError:
            raise ValueError(f"unknown variant {name!r}: expected one of {sorted(self.raw['variants'])}") from None

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
                        torch=o.get("torch"),
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
        rows.append(f"| {py} | " + " | ".join("not supported (no torch 2.x)" for _ in m.arches) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--github", action="store_true", help="JSON include-list for a GitHub Actions matrix")
    ap.add_argument("--markdown", action="store_true", help="the support table")
    args = ap.parse_args(argv)
    m = load()
    if args.github:
        cells = [{"python": c.python, "arch": c.arch, "cell": c.name} for c in m.cells()]
        print(json.dumps({"include": cells}))
    elif args.markdown:
        print(markdown_table(m))
    else:
        for c in m.cells():
            extra = f" torch={c.torch}" if c.torch else ""
            print(f"{c.name:16} suite={c.suite}{extra} userland={c.arm64_userland or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
