"""apex._core: the tensor-facing bridge to apex_C, its torch fallback and its guards."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from apex import _core

pytestmark = pytest.mark.skipif(_core.ext is None, reason="apex_C not built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 7, 4097])
def test_scale_matches_torch_and_reports_nonfinite(dtype, n):
    x = torch.randn(n).to(dtype)
    ref = (x.float() * 0.25).to(dtype)
    assert _core.scale_(x, 0.25) is False
    torch.testing.assert_close(x, ref, rtol=0, atol=0)
    if n:
        x[n // 2] = float("inf")
        assert _core.scale_(x, 1.0) is True


def test_fallback_path_equals_kernel(monkeypatch):
    x = torch.randn(1000)
    y = x.clone()
    out_k = torch.empty(1000, dtype=torch.bfloat16)
    out_f = torch.empty(1000, dtype=torch.bfloat16)
    _core.scale_(x, 3.0, out=out_k)
    monkeypatch.setattr(_core, "ext", None)
    monkeypatch.setattr(_core, "_warned", True)
    assert not _core.uses_kernel(y)
    _core.scale_(y, 3.0, out=out_f)
    torch.testing.assert_close(out_k, out_f, rtol=0, atol=0)
    assert _core.sum_sq(y) == pytest.approx(float((y.double() ** 2).sum()), rel=1e-12)
    assert _core.max_abs(y) == pytest.approx(float(y.abs().max()))


def test_fp16_subnormals_survive_flush_denormal():
    """half->float must not multiply denormal floats: DAZ/FTZ would turn small fp16 grads into 0."""
    bits = np.array([0x0001, 0x03FF, 0x8001, 0x0200], dtype=np.uint16)
    h = torch.from_numpy(bits.view(np.float16).copy())
    out = torch.empty(4, dtype=torch.float32)
    old = torch.set_flush_denormal(True)
    try:
        _core.copy_(h, out)
    finally:
        torch.set_flush_denormal(False)
    assert old in (True, False)
    np.testing.assert_array_equal(out.numpy(), bits.view(np.float16).astype(np.float32))


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        _core.scale_(torch.arange(4), 2.0)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        _core.sum_sq([1.0, 2.0])
    with pytest.raises(ValueError, match=r"elements"):
        _core.scale_(torch.ones(4), 1.0, out=torch.ones(3))


def _run(env_extra, code):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_unsupported_simd_env_is_an_error_not_a_fallback():
    r = _run({"APEX_SIMD": "no-such-level"}, "import apex._core")
    assert r.returncode != 0
    assert "SIMD level" in r.stderr


def test_require_ext_turns_missing_extension_into_an_error(tmp_path):
    # a directory whose apex_C cannot load, first on sys.path
    (tmp_path / "apex_C.py").write_text("raise ImportError('simulated broken build')\n")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import apex._core"
    r = _run({"APEX_REQUIRE_EXT": "1"}, code)
    assert r.returncode != 0 and "APEX_REQUIRE_EXT=1" in r.stderr
    r = _run({"APEX_REQUIRE_EXT": "0"}, code + "; print(apex._core.ext is None)")
    assert r.returncode == 0 and r.stdout.strip() == "True"
