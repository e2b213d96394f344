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


def test_amp_training_without_the_extension_warns_once(tmp_path):
    """Without apex_C an amp step unscales with torch's ops; the one RuntimeWarning says so (the unscale asked
    `kernel_many`, which warns as `uses_kernel` does)."""
    (tmp_path / "apex_C.py").write_text("raise ImportError('simulated missing build')\n")
    code = f"""import sys, warnings
sys.path.insert(0, {str(tmp_path)!r})
import torch, apex
from apex import amp
model = torch.nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    for _ in range(2):
        with amp.scale_loss(model(torch.randn(2, 8)).float().sum(), opt) as s:
            s.backward()
        opt.step()
        opt.zero_grad()
print(apex._core.ext is None, sum("apex_C) could not be loaded" in str(w.message) for w in caught))
"""
    r = _run({"APEX_REQUIRE_EXT": "0"}, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "1"]


# ---------------------------------------------------------------------------------------------------------------
# apex_C's public functions on torch tensors (DLPack), and the raw fast path _core uses
# ---------------------------------------------------------------------------------------------------------------
apex_C = _core.ext


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_public_api_on_torch_tensors_matches_torch(dtype):
    x = torch.randn(4097).to(dtype)
    out = torch.empty(4097, dtype=torch.float32)
    assert apex_C.scale_(x, out, 0.25) is False
    torch.testing.assert_close(out, x.float() * 0.25, rtol=0, atol=0)
    y = x.clone()
    apex_C.scale_(y, y, 0.25)
    torch.testing.assert_close(y, (x.float() * 0.25).to(dtype), rtol=0, atol=0)
    assert apex_C.sum_sq(x) == pytest.approx(float(x.double().pow(2).sum()), rel=1e-12)
    assert apex_C.max_abs(x) == float(x.abs().max())
    x[17] = float("nan")
    assert apex_C.has_nonfinite(x) is True


def test_readme_pattern_wrong_dtype_code_cannot_corrupt_the_neighbour():
    """The old README pattern passed a dtype code by hand: float32 (0) on a bf16 slice wrote twice its bytes.
    The same call with raw integers is now a TypeError, and the tensor form scales exactly the slice."""
    flat = torch.ones(64, dtype=torch.bfloat16)
    part = flat[16:32]
    with pytest.raises(TypeError):
        apex_C.scale_(part.data_ptr(), 0, part.data_ptr(), 0, part.numel(), 0.5)
    assert torch.equal(flat, torch.ones(64, dtype=torch.bfloat16))
    apex_C.scale_(part, part, 0.5)
    assert (flat[16:32] == 0.5).all()
    assert (flat[:16] == 1).all() and (flat[32:] == 1).all()


def test_public_api_torch_checks():
    x = torch.randn(64)
    with pytest.raises(ValueError, match="C-contiguous"):
        apex_C.fill_(x.view(8, 8).t(), 0.0)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        apex_C.sum_sq(torch.arange(8))
    with pytest.raises(ValueError, match="expected equal sizes"):
        apex_C.copy_(x, torch.empty(63))
    with pytest.raises(ValueError, match="overlap partially"):
        apex_C.scale_(x[:-1], x[1:], 2.0)
    p = torch.nn.Parameter(torch.ones(8))
    # torch's own __dlpack__ refuses a tensor that requires grad: RuntimeError before torch 2.9, BufferError after
    refusal = BufferError if torch.__version__ >= torch.torch_version.TorchVersion("2.9") else RuntimeError
    with pytest.raises(refusal, match="require gradient"):
        apex_C.fill_(p, 0.0)
    apex_C.fill_(p.detach(), 0.0)
    assert not p.any()


def test_lazily_negated_tensors_are_read_by_value():
    """``x.conj().imag`` keeps the negated values in memory behind torch's negation bit. apex_C's public functions
    refuse such a tensor (DLPack cannot carry the bit); the package's own calls (`_core`) give its values, as
    torch's ops do, in place or not."""
    z = torch.tensor([1 + 2j, 3 - 4j]).conj().imag  # values -2, 4
    assert z.is_neg()
    out = torch.zeros(2)
    with pytest.raises(ValueError, match="negation bit"):
        apex_C.copy_(z, out)
    with pytest.raises(ValueError, match="negation bit"):
        apex_C.scale_(z, out, 1.0)
    assert not out.any()
    _core.scale_(z, 2.0, out=out)
    assert out.tolist() == [-4.0, 8.0]
    _core.copy_(z, out)
    assert out.tolist() == [-2.0, 4.0]
    w = torch.tensor([1 + 2j, 3 - 4j]).conj().imag
    assert _core.scale_many_([w], 0.5) is False and w.tolist() == [-1.0, 2.0]


def test_core_uses_the_raw_fast_path(monkeypatch):
    called = []

    class Spy:
        def __getattr__(self, name):
            called.append(name)
            return getattr(apex_C, name)

    monkeypatch.setattr(_core, "ext", Spy())
    x = torch.randn(100)
    _core.scale_(x, 2.0)
    _core.has_nonfinite(x)
    _core.sum_sq(x)
    assert called == ["_raw_scale_", "_raw_has_nonfinite", "_raw_sum_sq"]


def test_security_doc_lists_every_entry_point():
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "security.md")
    if not os.path.exists(path):
        pytest.skip("docs/ is not beside the tests (a copy of tests/ run against an installed wheel)")
    text = open(path).read()
    public = ["scale_", "axpy_", "copy_", "fill_", "has_nonfinite", "sum_sq", "max_abs", "segment_sum_sq"]
    for name in public + ["_raw_" + n for n in public]:
        assert hasattr(apex_C, name), name
        assert f"`{name}`" in text, f"docs/security.md does not say what {name} checks"
    assert "2**48" in text


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8])
@pytest.mark.parametrize("n", [0, 1, 5000])
def test_int_table_is_torch_tensor_of_the_values(dtype, n):
    """The per-step address / flag tables: the values, dtype and writability torch.tensor(list) gives, and each
    table its own memory (the array it was built from stays alive with it)."""
    hi = 2**62 if dtype == torch.int64 else 2
    values = [(k * 7919 + 1) % hi for k in range(n)] if dtype == torch.int64 else [k % 2 == 0 for k in range(n)]
    tables = [_core.int_table(values, dtype) if dtype != torch.int64 else _core.int_table(values) for _ in range(3)]
    for t in tables:
        assert t.dtype == dtype and t.device.type == "cpu" and t.shape == (n,) and t.is_contiguous()
        assert torch.equal(t, torch.tensor(values, dtype=dtype))
    if n:
        tables[0][0] = 1
        tables[0][-1] = 0
        assert torch.equal(tables[1], torch.tensor(values, dtype=dtype))
    if dtype == torch.int64 and n:
        with pytest.raises(OverflowError):
            _core.int_table([2**63])


def test_scale_many_checks_the_whole_list_before_writing():
    a = torch.ones(4)
    for bad in ([a, torch.ones(2, dtype=torch.int32)], [a, torch.ones(2, device="meta")], [a, "x"]):
        with pytest.raises(TypeError, match="scale_many_: tensor 1 must be a floating-point tensor"):
            _core.scale_many_(bad, 2.0)
        assert torch.equal(a, torch.ones(4))
