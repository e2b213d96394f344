#!/usr/bin/env python3
"""Checks what an environment imports as apex / apex_C before its tests run (nox tests, test-wheel, demo, bench).

    python tools/check_install.py SOURCE_DIR [--no-torch]

- apex, apex_C and _apex_amp_c must come from the installed copy, never from SOURCE_DIR (the tree's src/), so a
  test run can not pass against files the wheel does not ship;
- the wheel's apex-amp_C.pth must have installed the `import amp_C` fallback finder when this interpreter started
  (before anything imported apex, which installs it too);
- the extension must offer every SIMD level this CPU has (x86_64: /proc/cpuinfo flags avx2+fma+f16c -> avx2,
  + avx512f/bw/vl/dq -> avx512; aarch64: neon): a build whose runtime dispatch cannot see the CPU's features
  would pass every test at baseline speed.
--no-torch skips importing apex (which imports torch): for the torch-free kernel environments.
Exit status 0 when all holds; 1 with the reason otherwise.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ != "tools":  # run as a file: the tools package is the folder above this one
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.util import cpu_flags, expected_simd_levels, host_arch


def main(argv: list) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    source = os.path.realpath(argv[0])
    problems = []
    if not any(type(f).__name__ == "AmpCFallbackFinder" for f in sys.meta_path):
        problems.append("the `import amp_C` fallback finder is not on sys.meta_path at start-up: apex-amp_C.pth is "
                        "missing from site-packages or failed")
    import apex_C

    modules = [apex_C]
    try:
        import _apex_amp_c

        modules.insert(0, _apex_amp_c)
    except ImportError as err:
        problems.append(f"_apex_amp_c does not import ({err}): the installed apex is older than the source tree or "
                        "incomplete; reinstall it")
    if "--no-torch" not in argv:
        import apex

        modules.insert(0, apex)
    for mod in modules:
        path = os.path.realpath(mod.__file__)
        print(f"{mod.__name__:11} from {path}")
        if path.startswith(source + os.sep):
            problems.append(f"{mod.__name__} is imported from the source tree ({path}), not the installed copy")
    have, want = apex_C.supported_simd_levels(), expected_simd_levels(host_arch(), cpu_flags())
    print(f"apex_C      simd level {apex_C.simd_level()}; supported {have}; this CPU offers {want}")
    missing = [level for level in want if level not in have]
    if missing:
        problems.append(f"apex_C does not offer {missing}, which this CPU supports: the build's runtime CPU "
                        "feature detection is broken")
    for p in problems:
        print(f"check_install: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
