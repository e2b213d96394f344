"""apex._device: detection order, APEX_DEVICE / APEX_AMP_DTYPE overrides, torch_npu wrappers, test harness.

No machine here has an npu, so the npu paths run against TEST DOUBLES: a fake
``torch_npu`` module object put into ``sys.modules`` (or returned by the
module's import hook ``_device._import_module``) whose functions record their
calls. One test puts a fake ``torch_npu`` *package* on PYTHONPATH of a child
interpreter, to prove that ``import apex`` never imports torch_npu.
"""

import logging
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from apex import _device

SRC = Path(__file__).resolve().parents[1] / "src"


class FakeTorchNpu(types.ModuleType):
    """Test double for torch_npu: configurable device state, records every call it gets."""

    def __init__(self, available=True, count=1, inf_nan=True, flag=False, with_utils=True, fmt=2):
        super().__init__("torch_npu")
        self.calls = []
        record = self.calls.append

        def is_available():
            record("is_available")
            return available

        def device_count():
            record("device_count")
            return count

        def is_support_inf_nan():
            record("is_support_inf_nan")
            return inf_nan

        def get_npu_overflow_flag():
            record("get_npu_overflow_flag")
            return flag

        def clear_npu_overflow_flag():
            record("clear_npu_overflow_flag")

        def get_npu_format(tensor):
            record("get_npu_format")
            return fmt

        helpers = dict(
            is_support_inf_nan=is_support_inf_nan,
            get_npu_overflow_flag=get_npu_overflow_flag,
            clear_npu_overflow_flag=clear_npu_overflow_flag,
        )
        if with_utils:  # current layout: torch_npu.npu.utils.<name>
            self.npu = types.SimpleNamespace(
                is_available=is_available, device_count=device_count, utils=types.SimpleNamespace(**helpers)
            )
        else:  # re-exported names only: torch_npu.npu.<name>
            self.npu = types.SimpleNamespace(is_available=is_available, device_count=device_count, **helpers)
        self.get_npu_format = get_npu_format


@pytest.fixture
def clean_env(monkeypatch):
    """No overrides, no torch_npu, no cached import failure; restored afterwards."""
    monkeypatch.delenv("APEX_DEVICE", raising=False)
    monkeypatch.delenv("APEX_AMP_DTYPE", raising=False)
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(_device, "_find_spec", lambda name: None)
    _device._reset_npu_import_cache()
    yield monkeypatch
    _device._reset_npu_import_cache()


@pytest.fixture
def fake_npu(clean_env):
    """Install a FakeTorchNpu test double in sys.modules; returns a factory taking its settings."""

    def install(**kwargs):
        fake = FakeTorchNpu(**kwargs)
        clean_env.setitem(sys.modules, "torch_npu", fake)
        return fake

    return install


# ---------------------------------------------------------------- detection


def test_detect_without_torch_npu(clean_env):
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    assert _device.detect_device() == "cpu"
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    assert _device.detect_device() == "cuda"
    assert not _device.npu_available()
    assert "torch_npu" not in sys.modules


def test_detect_prefers_npu_from_test_double(fake_npu, clean_env):
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    fake = fake_npu()
    assert _device.detect_device() == "npu"
    assert fake.calls[:2] == ["is_available", "device_count"]


@pytest.mark.parametrize("settings", [dict(available=False), dict(count=0)], ids=["not_available", "no_devices"])
def test_torch_npu_without_a_device_falls_back(fake_npu, clean_env, settings):
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    fake_npu(**settings)
    assert _device.detect_device() == "cpu"
    assert not _device.device_available("npu")


def test_import_hook_is_used_only_when_find_spec_finds_torch_npu(clean_env):
    """Test double for the import machinery: find_spec / import_module record what they are asked."""
    asked = []
    clean_env.setattr(_device, "_import_module", lambda name: asked.append(name))
    assert _device.import_torch_npu() is None and asked == []  # find_spec said no: no import attempt

    _device._reset_npu_import_cache()
    fake = FakeTorchNpu()
    clean_env.setattr(_device, "_find_spec", lambda name: object())
    clean_env.setattr(_device, "_import_module", lambda name: asked.append(name) or fake)
    assert _device.import_torch_npu() is fake and asked == ["torch_npu"]


def test_broken_torch_npu_counts_as_absent_and_is_tried_once(clean_env, caplog):
    """Test double: an installed torch_npu whose import fails like it does without the CANN runtime."""
    attempts = []

    def failing_import(name):
        attempts.append(name)
        raise ImportError("libhccl.so: cannot open shared object file")

    clean_env.setattr(_device, "_find_spec", lambda name: object())
    clean_env.setattr(_device, "_import_module", failing_import)
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="apex._device"):
        assert _device.detect_device() == "cpu"
        assert _device.detect_device() == "cpu"
    assert attempts == ["torch_npu"]
    assert "libhccl.so" in caplog.text
    clean_env.setenv("APEX_DEVICE", "npu")
    with pytest.raises(RuntimeError, match=r"torch_npu failed to import: libhccl\.so"):
        _device.detect_device()


# ---------------------------------------------------------------- APEX_DEVICE


@pytest.mark.parametrize("value", ["cpu", "CPU", " cpu "])
def test_apex_device_override_cpu(clean_env, value):
    clean_env.setenv("APEX_DEVICE", value)
    assert _device.detect_device() == "cpu"


def test_apex_device_override_beats_detection(fake_npu, clean_env):
    fake_npu()
    clean_env.setenv("APEX_DEVICE", "cpu")
    assert _device.detect_device() == "cpu"
    clean_env.setenv("APEX_DEVICE", "npu")
    assert _device.detect_device() == "npu"


def test_apex_device_empty_means_detect(clean_env):
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    clean_env.setenv("APEX_DEVICE", "")
    assert _device.detect_device() == "cpu"


@pytest.mark.parametrize("value", ["tpu", "cuda:0", "gpu"])
def test_apex_device_unknown_value(clean_env, value):
    clean_env.setenv("APEX_DEVICE", value)
    with pytest.raises(ValueError, match=rf"APEX_DEVICE: expected one of cpu, cuda, npu, got '{value}'"):
        _device.detect_device()


def test_apex_device_unavailable(clean_env):
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    clean_env.setenv("APEX_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match=r"APEX_DEVICE=cuda.*not available here: .*is_available\(\) is False"):
        _device.detect_device()
    clean_env.setenv("APEX_DEVICE", "npu")
    with pytest.raises(RuntimeError, match=r"APEX_DEVICE=npu.*torch_npu is not installed"):
        _device.detect_device()


def test_device_available_validates_name(clean_env):
    assert _device.device_available("cpu")
    with pytest.raises(ValueError, match="got 'xpu'"):
        _device.device_available("xpu")


def test_import_apex_never_imports_torch_npu(tmp_path):
    """A fake torch_npu *package* (test double on PYTHONPATH) proves the import is lazy: it must be
    absent after importing apex and its subpackages, and imported only by detect_device()."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        import types
        npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1)
    """))
    script = textwrap.dedent("""
        import sys
        import apex, apex.contrib, apex._device
        assert "torch_npu" not in sys.modules, "torch_npu imported by import apex"
        print(apex._device.detect_device(), "torch_npu" in sys.modules)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("APEX_DEVICE", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(SRC)])
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # a real torch_npu would otherwise be loaded by import torch
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["npu", "True"]


# ---------------------------------------------------------------- amp dtype, autocast device type


@pytest.mark.parametrize(
    ("device", "expected"),
    [("cpu", torch.bfloat16), ("cuda", torch.float16), ("npu", torch.float16), ("cuda:1", torch.float16),
     (torch.device("cpu"), torch.bfloat16), ("npu:0", torch.float16)],
)
def test_default_amp_dtype(clean_env, device, expected):
    assert _device.default_amp_dtype(device) == expected


def test_default_amp_dtype_of_detected_device(clean_env):
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    assert _device.default_amp_dtype() == torch.bfloat16


@pytest.mark.parametrize(
    ("value", "expected"),
    [("float16", torch.float16), ("fp16", torch.float16), ("HALF", torch.float16),
     ("bfloat16", torch.bfloat16), (" bf16 ", torch.bfloat16)],
)
def test_apex_amp_dtype_override(clean_env, value, expected):
    clean_env.setenv("APEX_AMP_DTYPE", value)
    assert _device.default_amp_dtype("cpu") == expected
    assert _device.default_amp_dtype("cuda") == expected


def test_amp_dtype_errors(clean_env):
    clean_env.setenv("APEX_AMP_DTYPE", "float32")
    with pytest.raises(ValueError, match=r"APEX_AMP_DTYPE: expected one of .*got 'float32'"):
        _device.default_amp_dtype("cpu")
    clean_env.delenv("APEX_AMP_DTYPE")
    with pytest.raises(ValueError, match="got 'tpu'"):
        _device.default_amp_dtype("tpu")
    with pytest.raises(TypeError, match="got int"):
        _device.default_amp_dtype(0)


def test_bf16_supported(fake_npu, clean_env):
    assert _device.bf16_supported("cpu") is True
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    assert _device.bf16_supported("cuda") is False  # no CUDA here: nothing computes in bfloat16
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert _device.bf16_supported(torch.device("cuda", 1)) is False
    clean_env.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert _device.bf16_supported("cuda:0") is True
    assert _device.bf16_supported("npu") is False  # no torch_npu
    fake = fake_npu()
    assert _device.bf16_supported("npu") is True  # a runtime without the query: torch_npu's autocast assumes it
    fake.npu.is_bf16_supported = lambda: False
    assert _device.bf16_supported("npu") is False
    fake.npu.is_bf16_supported = lambda: 1 / 0  # a driver error is no bfloat16, not an exception
    assert _device.bf16_supported("npu") is False
    assert _device.bf16_supported() is False  # the detected device (npu)
    with pytest.raises(ValueError, match="bf16_supported: expected one of cpu, cuda, npu, got 'xpu'"):
        _device.bf16_supported("xpu")


def test_autocast_device_type(clean_env):
    assert _device.autocast_device_type("cuda:3") == "cuda"
    assert _device.autocast_device_type(torch.device("cpu")) == "cpu"
    assert _device.autocast_device_type("npu") == "npu"
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    assert _device.autocast_device_type() == "cpu"
    with pytest.raises(ValueError, match="autocast_device_type: expected one of cpu, cuda, npu, got 'mps'"):
        _device.autocast_device_type("mps")


# ---------------------------------------------------------------- overflow flag wrappers (test double)


@pytest.mark.parametrize("with_utils", [True, False], ids=["npu.utils", "npu"])
def test_overflow_wrappers_call_torch_npu(fake_npu, with_utils):
    """Test double: FakeTorchNpu records that each wrapper reaches the right torch_npu function."""
    fake = fake_npu(inf_nan=False, flag=True, with_utils=with_utils)
    assert _device.npu_overflow_supported() is False
    assert _device.npu_needs_overflow_flag("npu") is True
    assert _device.npu_get_overflow_flag() is True
    assert _device.npu_clear_overflow_flag() is None
    assert fake.calls == ["is_support_inf_nan", "is_support_inf_nan", "get_npu_overflow_flag",
                          "clear_npu_overflow_flag"]


def test_overflow_flag_as_status_tensor(fake_npu):
    """Test double returning the raw float-status tensor instead of a bool."""
    fake_npu(flag=torch.tensor([0.0, 0.0, 1.0]))
    assert _device.npu_get_overflow_flag() is True
    fake_npu(flag=torch.zeros(8))
    assert _device.npu_get_overflow_flag() is False


def test_inf_nan_mode_and_other_devices(fake_npu):
    fake = fake_npu(inf_nan=True)
    assert _device.npu_overflow_supported() is True
    assert _device.npu_needs_overflow_flag("npu") is False
    fake.calls.clear()
    assert _device.npu_needs_overflow_flag("cpu") is False and _device.npu_needs_overflow_flag("cuda:0") is False
    assert fake.calls == []  # never asks torch_npu about other devices


def test_old_torch_npu_without_inf_nan_query(fake_npu):
    """Test double of a torch_npu that predates is_support_inf_nan: saturation mode assumed."""
    fake = fake_npu()
    del fake.npu.utils.is_support_inf_nan
    assert _device.npu_overflow_supported() is False
    del fake.npu.utils.get_npu_overflow_flag
    with pytest.raises(RuntimeError, match="has no get_npu_overflow_flag"):
        _device.npu_get_overflow_flag()


def test_overflow_wrappers_without_torch_npu(clean_env):
    for fn in (_device.npu_overflow_supported, _device.npu_get_overflow_flag, _device.npu_clear_overflow_flag):
        with pytest.raises(RuntimeError, match=r"needs torch_npu, which is unavailable \(torch_npu is not installed\)"):
            fn()
    assert _device.npu_needs_overflow_flag("cpu") is False


# ---------------------------------------------------------------- storage formats and native combine op


def _npu_tensor_stand_in():
    # Only .device.type is read before the format query; real npu tensors cannot exist here.
    return types.SimpleNamespace(device=types.SimpleNamespace(type="npu"))


@pytest.mark.parametrize(("fmt", "private"), [(2, False), (0, False), (1, False), (30, False), (29, True), (3, True)])
def test_private_format_detection(fake_npu, fmt, private):
    """Test double reports ACL format codes: ND/NCHW/NHWC/NCDHW are plain, FRACTAL_NZ/NC1HWC0 private."""
    fake = fake_npu(fmt=fmt)
    assert _device.npu_storage_format(_npu_tensor_stand_in()) == fmt
    assert _device.npu_has_private_format(_npu_tensor_stand_in()) is private
    fake.calls.clear()
    assert _device.npu_storage_format(torch.zeros(2)) is None and fake.calls == []  # cpu: never asked


def test_private_format_without_torch_npu(clean_env):
    assert _device.npu_has_private_format(_npu_tensor_stand_in()) is False
    # without torch_npu loaded the tensors are not even looked at (objects without .device would fail)
    assert _device.any_npu_private_format([object(), object()]) is False
    assert "torch_npu" not in sys.modules


def test_any_private_format(fake_npu):
    """Test double: one FRACTAL_NZ-like tensor among cpu tensors is enough."""
    fake_npu(fmt=29)
    assert _device.any_npu_private_format([torch.zeros(1), _npu_tensor_stand_in()]) is True
    assert _device.any_npu_private_format([torch.zeros(1)]) is False


def test_private_format_query_ignores_non_tensors(fake_npu):
    """With torch_npu loaded, entries that are not tensors are no npu tensors (the caller reports them itself):
    is_combined_tensor_valid(buf, [t, None]) must answer False, not raise AttributeError."""
    fake_npu(fmt=29)
    assert _device.npu_storage_format(None) is None
    assert _device.any_npu_private_format([None, 2.0, torch.zeros(1)]) is False


def test_native_combine_op_lookup(fake_npu, clean_env):
    """Test double: the op is found under its current name, then the older one; None when missing."""
    fake = fake_npu()
    assert _device.npu_combine_op() is None and _device.npu_combined_valid_op() is None

    def legacy(tensors, require_copy_value=True):
        return "legacy"

    fake.combine_npu = legacy
    assert _device.npu_combine_op() is legacy

    def current(tensors, require_copy_value=True):
        return "current"

    def valid(combined, tensors):
        return True

    fake.utils = types.SimpleNamespace(npu_combine_tensors=current, is_combined_tensor_valid=valid)
    assert _device.npu_combine_op() is current and _device.npu_combined_valid_op() is valid


def test_native_combine_op_absent_without_torch_npu(clean_env):
    assert _device.npu_combine_op() is None


# ---------------------------------------------------------------- test harness (conftest)


def test_device_fixture_is_usable(device):
    assert device in _device.DEVICES
    assert torch.zeros(2, device=device).device.type == device


pytest_plugins = ["pytester"]


def _harness(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(
        test_sample="""
        import pytest

        def test_plain():
            pass

        @pytest.mark.full
        def test_slow():
            pass

        @pytest.mark.devices("cuda", "npu")
        def test_accelerator_only(device):
            assert device in ("cuda", "npu")

        def test_reports_device(device):
            print("DEVICE=" + device)
        """
    )
    pytester.syspathinsert(str(SRC))


def test_harness_tiers_and_device_markers(pytester, clean_env):
    _harness(pytester)
    result = pytester.runpytest_inprocess("--device", "cpu", "-rs", "-s")
    result.assert_outcomes(passed=2, skipped=2)
    result.stdout.fnmatch_lines(["*DEVICE=cpu*", "*slow test: run with --full*", "*applies to cuda, npu, not cpu*"])
    result = pytester.runpytest_inprocess("--device", "cpu", "--full")
    result.assert_outcomes(passed=3, skipped=1)


def test_harness_default_device_follows_apex_device(pytester, clean_env):
    _harness(pytester)
    clean_env.setenv("APEX_DEVICE", "cpu")
    result = pytester.runpytest_inprocess("-s", "-k", "reports_device")
    result.stdout.fnmatch_lines(["*DEVICE=cpu*"])
    clean_env.setenv("APEX_DEVICE", "tpu")
    result = pytester.runpytest_inprocess("-k", "reports_device")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*APEX_DEVICE: expected one of cpu, cuda, npu, got 'tpu'*"])


def test_harness_rejects_an_unavailable_device(pytester, clean_env):
    _harness(pytester)
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    result = pytester.runpytest_inprocess("--device", "cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--device cuda was requested, but no cuda device is available here*"])


def test_block_elements_per_device():
    # blockwise layer functions: cache-sized blocks on the CPU, larger ones where every pass is a kernel launch
    assert _device.block_elements(torch.device("cpu")) == 1 << 18
    for name in ("cuda", "meta"):
        assert _device.block_elements(torch.device(name)) == 1 << 22
