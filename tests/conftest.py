"""Shared pytest setup: device selection, test tiers, seeding.

Options:
  --device {cpu,cuda,npu}  device the device-aware tests run on (default: what
                           ``apex._device.detect_device()`` picks, which honours
                           APEX_DEVICE). The same suite is the GPU/NPU matrix:
                           ``nox -s tests -- --device npu``.
  --full                   also run tests marked ``full`` (slow tier).

Emulated npu: with ``APEX_NPU_EMULATOR=1`` (``nox -s tests -- --device npu`` sets it) the ``torch_npu`` stand-in
of tests/npu_emulator/site is put first on sys.path and on PYTHONPATH (child processes too), so ``--device npu``
runs on the emulated npu device (PrivateUse1 renamed to "npu"; see docs/npu-emulator.md).

Markers:
  full                     slow; skipped without --full.
  devices("cpu", "cuda")   applies only to the listed devices; skipped elsewhere.
  kernels                  torch-free tests of the apex_C core.

torch is imported only when a collected test needs the device, so the
torch-free kernel tests still run in an interpreter without torch.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

DEVICES = ("cpu", "cuda", "npu")
SEED = 0
NPU_EMULATOR_SITE = Path(__file__).resolve().parent / "npu_emulator" / "site"


def npu_emulated() -> bool:
    """Whether this run uses the emulated npu (``APEX_NPU_EMULATOR=1``)."""
    return os.environ.get("APEX_NPU_EMULATOR", "").strip() == "1"


def _use_npu_emulator() -> None:
    """``import torch_npu`` finds the emulator's stand-in, here and in every child process."""
    site = str(NPU_EMULATOR_SITE)
    if site not in sys.path:
        sys.path.insert(0, site)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if site not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([site, *parts])


def pytest_addoption(parser):
    group = parser.getgroup("apex")
    group.addoption(
        "--device",
        choices=DEVICES,
        default=None,
        help="device for device-aware tests (default: detected; npu > cuda > cpu, APEX_DEVICE overrides)",
    )
    group.addoption("--full", action="store_true", default=False, help="also run the slow tests marked 'full'")


def pytest_configure(config):
    config.addinivalue_line("markers", "full: slow tests, run with --full")
    config.addinivalue_line("markers", "devices(*names): run only when --device is one of names")
    config.addinivalue_line("markers", "kernels: torch-free tests of the apex_C core")
    if npu_emulated():
        _use_npu_emulator()


def _resolve_device(config) -> str:
    """The requested device, checked to be usable here (a UsageError, never a silent fallback)."""
    cached = getattr(config, "_apex_device", None)
    if cached is not None:
        return cached
    from apex import _device  # imports torch: only when some test needs a device

    requested = config.getoption("--device")
    if requested is None:
        try:
            requested = _device.detect_device()
        except (ValueError, RuntimeError) as exc:  # a bad APEX_DEVICE
            raise pytest.UsageError(str(exc)) from exc
    elif not _device.device_available(requested):
        raise pytest.UsageError(f"--device {requested} was requested, but no {requested} device is available here")
    config._apex_device = requested
    return requested


def _needs_device(item) -> bool:
    return "device" in getattr(item, "fixturenames", ()) or item.get_closest_marker("devices") is not None


def pytest_collection_modifyitems(config, items):
    full = config.getoption("--full")
    skip_full = pytest.mark.skip(reason="slow test: run with --full")
    device = _resolve_device(config) if any(_needs_device(item) for item in items) else None
    for item in items:
        if not full and item.get_closest_marker("full") is not None:
            item.add_marker(skip_full)
        marker = item.get_closest_marker("devices")
        if marker is not None:
            unknown = [d for d in marker.args if d not in DEVICES]
            if unknown:
                raise pytest.UsageError(f"{item.nodeid}: devices marker names unknown devices {unknown}")
            if device not in marker.args:
                item.add_marker(pytest.mark.skip(reason=f"applies to {', '.join(marker.args)}, not {device}"))


@pytest.fixture(scope="session")
def device(pytestconfig) -> str:
    """Device type string ("cpu", "cuda" or "npu") the device-aware tests use."""
    return _resolve_device(pytestconfig)


@pytest.fixture(autouse=True)
def _seed():
    """Reseed before every test, so a test sees the same numbers alone or in the full run.

    torch / numpy are seeded only if a test module already imported them.
    """
    random.seed(SEED)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(SEED)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(SEED)


@pytest.fixture
def amp_env():
    """For the amp tests: one intra-op thread while the test runs (tiny models stall when oversubscribed on a
    shared 2-core runner), and every amp session torn down and the user cast registry
    (``amp.register_*_function``) restored after it (amp's state is process-wide)."""
    import torch

    from apex import amp
    from apex.amp import _casts

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    registry = dict(_casts._USER_CAST_REGISTRY)
    yield
    _casts._USER_CAST_REGISTRY.clear()
    _casts._USER_CAST_REGISTRY.update(registry)
    amp.deinitialize()
    torch.set_num_threads(threads)
