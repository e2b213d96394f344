"""nox support for the emulated npu device; run by noxfile.py with runpy (its globals: ROOT and the helpers
``install_torch`` and ``group``).

* ``prepare_npu_run(session, posargs)``: for ``nox -s tests -- --device npu``: build (or reuse the cached) emulator
  in the session's environment and set ``APEX_NPU_EMULATOR=1``, which makes tests/conftest.py route ``import
  torch_npu`` to the emulator's stand-in. ``APEX_NPU_EMULATOR=0`` in the caller's environment keeps a real
  torch_npu instead (on a machine with Ascend hardware).
* ``run_matrix(session)``: the body of ``nox -s npu-matrix``, the training matrix of tests/npu_emulator/matrix.py;
  posargs go to it. Its report lands in ``.cache/npu-matrix/`` (``matrix.md``, ``matrix.json``).
"""

from __future__ import annotations

import os
import time

import nox

EMULATOR = ROOT / "tests" / "npu_emulator"  # noqa: F821 (ROOT comes from the noxfile)


def npu_requested(posargs) -> bool:
    args = list(posargs)
    return any(a == "--device=npu" or (a == "--device" and args[i + 1:i + 2] == ["npu"]) for i, a in enumerate(args))


def build_emulator(session: nox.Session) -> None:
    start = time.monotonic()
    session.run("python", str(EMULATOR / "build.py"), silent=True)
    session.log(f"npu emulator ready in {time.monotonic() - start:.0f} s (cached per torch version + source hash "
                f"in {os.environ.get('APEX_NPU_EMULATOR_CACHE') or ROOT / '.cache' / 'npu-emulator'})")  # noqa: F821


def prepare_npu_run(session: nox.Session, posargs) -> None:
    if not npu_requested(posargs) or os.environ.get("APEX_NPU_EMULATOR", "").strip() == "0":
        return
    build_emulator(session)
    session.env["APEX_NPU_EMULATOR"] = "1"


def run_matrix(session: nox.Session) -> None:
    """The body of ``nox -s npu-matrix`` (declared in noxfile.py): install, build the emulator, run the matrix."""
    session.env["APEX_REQUIRE_EXT"] = "1"
    install_torch(session)  # noqa: F821
    session.install(*group("test"))  # noqa: F821
    session.install(".")
    build_emulator(session)
    session.env["APEX_NPU_EMULATOR"] = "1"
    out = ROOT / ".cache" / "npu-matrix"  # noqa: F821
    with session.chdir(session.create_tmp()):  # outside the source tree: the installed apex is what runs
        session.run("python", str(EMULATOR / "matrix.py"), "--out", str(out), *session.posargs)
