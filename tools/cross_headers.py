"""Python headers for cross-compiling an extension to aarch64 from an x86_64 interpreter of the same version.

Why this is sound (checked, not assumed): Debian ships libpython3.X-dev for both amd64 and arm64. For 3.9 (bullseye),
3.11 (bookworm) and 3.13 (trixie) the two packages' include trees are identical except pyconfig.h, and the two
pyconfig.h files differ in exactly these macros:

    HAVE_GCC_ASM_FOR_X64   defined on x86_64 only (inline asm inside the interpreter)
    HAVE_GCC_ASM_FOR_X87   defined on x86_64 only (x87 control word helpers, declarations only in the headers)
    HAVE_USABLE_WCHAR_T    defined on aarch64 only (wchar_t is unsigned there; only gates an #include <wchar.h>)
    PY_SUPPORT_TIER        1 on x86_64, 2 on aarch64 (3.11+; informational)

None of them changes a struct layout, a type size or an exported symbol (both are LP64 little-endian glibc targets),
but the derived header sets all four to the aarch64 values anyway, so it matches what an arm64 build would see. The
other headers are copied unchanged from the x86_64 interpreter (pyenv here, /opt/python in a manylinux image).
This is how the aarch64 cells without an arm64 interpreter on this machine (3.10, 3.12) get their headers;
PyPI has no CPython headers and python-build-standalone is not reachable from here.

    python tools/cross_headers.py --python /opt/python/cp310-cp310/bin/python --arch aarch64 --out /tmp/xh
    # -> prints the include directory to put first on the compiler's -I path

Runs under any Python >= 3.9 (it is called inside the build containers).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

# macro -> value on aarch64 (None = undefined). `required` macros must be present in the x86_64 header: if a future
# CPython renames them, the derivation stops instead of silently producing a header that is still x86-flavoured.
AARCH64_MACROS = {
    "HAVE_GCC_ASM_FOR_X64": (None, True),
    "HAVE_GCC_ASM_FOR_X87": (None, True),
    "HAVE_USABLE_WCHAR_T": ("1", True),
    "PY_SUPPORT_TIER": ("2", False),
}


class CrossHeaderError(RuntimeError):
    pass


def _set_macro(text: str, name: str, value: str | None, required: bool) -> str:
    pattern = re.compile(rf"^(#define {name}\b.*|/\* #undef {name} \*/)$", re.M)
    if not pattern.search(text):
        if required:
            raise CrossHeaderError(f"pyconfig.h has no line for {name}: expected '#define {name} ...' or "
                                   f"'/* #undef {name} */'; refusing to derive an aarch64 header")
        return text
    line = f"#define {name} {value}" if value is not None else f"/* #undef {name} */"
    return pattern.sub(line, text, count=1)


def derive_pyconfig(x86_text: str, arch: str) -> str:
    if arch != "aarch64":
        raise CrossHeaderError(f"only x86_64 -> aarch64 is derived; got target arch {arch!r}")
    out = x86_text
    for name, (value, required) in AARCH64_MACROS.items():
        out = _set_macro(out, name, value, required)
    note = ("/* Derived for aarch64 from the x86_64 pyconfig.h of the same CPython by tools/cross_headers.py "
            "(see its docstring). */\n")
    return note + out


def derive(python: str, arch: str, out: Path) -> Path:
    """Copy the interpreter's include dir to out/pythonX.Y with an aarch64 pyconfig.h; return that directory."""
    include = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    src = Path(include)
    if not (src / "Python.h").exists():
        raise CrossHeaderError(f"{python}: no Python.h in its include dir {src} (expected a full CPython install)")
    dest = out / src.name
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    cfg = dest / "pyconfig.h"
    cfg.write_text(derive_pyconfig(cfg.read_text(), arch))
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable, help="x86_64 interpreter of the target version")
    ap.add_argument("--arch", default="aarch64")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        print(derive(args.python, args.arch, args.out))
    except CrossHeaderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
