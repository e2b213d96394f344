"""apex.normalization: FusedLayerNorm / FusedRMSNorm families against torch and float64 references."""

import warnings

import pytest
import torch
from torch import nn

import apex.normalization.fused_layer_norm as fln
from apex.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm
from apex.normalization.fused_layer_norm import (
    fused_layer_norm,
    fused_layer_norm_affine,
    fused_rms_norm,
    fused_rms_norm_affine,
    mixed_dtype_fused_layer_norm_affine,
    mixed_dtype_fused_rms_norm_affine,
)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}
DTYPES = list(TOL)


def _rms_ref(x, shape, w, eps):
    dims = tuple(range(-len(shape), 0))
    x = x.double()
    y = x / torch.sqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    return y * w.double() if w is not None else y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5,), (3, 7), (1,)])
def test_fused_layer_norm_matches_torch_forward_backward(dtype, shape):
    torch.manual_seed(0)
    ours, ref = FusedLayerNorm(shape), nn.LayerNorm(shape)
    with torch.no_grad():
        for m in (ours, ref):
            m.weight.copy_(torch.linspace(0.5, 1.5, m.weight.numel()).reshape(shape))
            m.bias.copy_(torch.linspace(-0.2, 0.3, m.bias.numel()).reshape(shape))
    ours, ref = ours.to(dtype), ref.double()
    x = torch.randn(4, 2, *shape).to(dtype).requires_grad_(True)
    xr = x.detach().double().requires_grad_(True)
    y, yr = ours(x), ref(xr)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), yr, **TOL[dtype])
    dy = torch.randn_like(yr)
    y.backward(dy.to(dtype))
    yr.backward(dy)
    tol = dict(rtol=TOL[dtype]["rtol"] * 4, atol=TOL[dtype]["atol"] * 4)
    torch.testing.assert_close(x.grad.double(), xr.grad, **tol)
    torch.testing.assert_close(ours.weight.grad.double(), ref.weight.grad, **tol)
    torch.testing.assert_close(ours.bias.grad.double(), ref.bias.grad, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rms_norm_matches_float64(dtype):
    torch.manual_seed(1)
    m = FusedRMSNorm(6, eps=1e-6)
    with torch.no_grad():
        m.weight.copy_(torch.linspace(0.5, 1.5, 6))
    m = m.to(dtype)
    x = torch.randn(3, 5, 6).to(dtype).requires_grad_(True)
    xr = x.detach().double().requires_grad_(True)
    wr = m.weight.detach().double().requires_grad_(True)
    y, yr = m(x), _rms_ref(xr, (6,), wr, 1e-6)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), yr, **TOL[dtype])
    dy = torch.randn_like(yr)
    y.backward(dy.to(dtype))
    yr.backward(dy)
    tol = dict(rtol=TOL[dtype]["rtol"] * 4, atol=TOL[dtype]["atol"] * 4)
    torch.testing.assert_close(x.grad.double(), xr.grad, **tol)
    torch.testing.assert_close(m.weight.grad.double(), wr.grad, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_formula_fallback_matches_torch_kernel(monkeypatch, dtype):
    x = torch.randn(4, 2, 3).to(dtype)
    w = torch.rand(2, 3).to(dtype)
    with_kernel = fused_rms_norm_affine(x, w, (2, 3), 1e-5)
    monkeypatch.setattr(fln, "_HAS_RMS_NORM", False)  # torch < 2.4 has no rms_norm
    fallback = fused_rms_norm_affine(x, w, (2, 3), 1e-5)
    torch.testing.assert_close(fallback, with_kernel, **TOL[dtype])
    torch.testing.assert_close(fallback.double(), _rms_ref(x, (2, 3), w, 1e-5), **TOL[dtype])


def test_no_affine_and_functional_forms():
    x = torch.randn(3, 8)
    m = FusedLayerNorm(8, elementwise_affine=False)
    assert m.weight is None and m.bias is None and not list(m.parameters())
    torch.testing.assert_close(m(x), torch.nn.functional.layer_norm(x, (8,), eps=1e-5))
    torch.testing.assert_close(fused_layer_norm(x, 8), torch.nn.functional.layer_norm(x, (8,), eps=1e-6))
    w, b = torch.rand(8), torch.rand(8)
    torch.testing.assert_close(fused_layer_norm_affine(x, w, b, (8,)),
                               torch.nn.functional.layer_norm(x, (8,), w, b, eps=1e-6))
    r = FusedRMSNorm([8], elementwise_affine=False)
    assert r.weight is None
    torch.testing.assert_close(r(x).double(), _rms_ref(x, (8,), None, 1e-5), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_rms_norm(x, 8).double(), _rms_ref(x, (8,), None, 1e-6), rtol=1e-5, atol=1e-6)
    assert "elementwise_affine=True" in repr(FusedRMSNorm(4)) and FusedLayerNorm((2, 3)).normalized_shape == (2, 3)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mixed_forms_return_the_weight_dtype(wdtype):
    x = torch.randn(4, 6)  # e.g. an fp32 residual stream
    ln = MixedFusedLayerNorm(6).to(wdtype)
    y = ln(x)
    assert y.dtype == wdtype
    ref = torch.nn.functional.layer_norm(x.double(), (6,), ln.weight.double(), ln.bias.double(), 1e-5)
    torch.testing.assert_close(y.double(), ref, **TOL[wdtype])
    rms = MixedFusedRMSNorm(6).to(wdtype)
    assert rms(x).dtype == wdtype
    torch.testing.assert_close(rms(x).double(), _rms_ref(x, (6,), rms.weight, 1e-5), **TOL[wdtype])
    w = torch.ones(6, dtype=wdtype)
    assert mixed_dtype_fused_layer_norm_affine(x.half(), w, torch.zeros(6, dtype=wdtype), 6).dtype == wdtype
    assert mixed_dtype_fused_rms_norm_affine(x.half(), w, 6).dtype == wdtype


def test_plain_forms_keep_the_input_dtype_with_other_weight_dtypes():
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    y = fused_layer_norm_affine(x, torch.ones(4), torch.zeros(4), 4)
    assert y.dtype == torch.bfloat16
    assert fused_rms_norm_affine(x, torch.ones(4), 4).dtype == torch.bfloat16


def test_bad_arguments():
    with pytest.raises(ValueError, match="elementwise_affine"):
        MixedFusedLayerNorm(4, elementwise_affine=False)
    with pytest.raises(ValueError, match="elementwise_affine"):
        MixedFusedRMSNorm(4, elementwise_affine=True)
    with pytest.raises(TypeError, match="unexpected keyword"):
        MixedFusedRMSNorm(4, bogus=1)
    with pytest.raises(TypeError, match="normalized_shape"):
        FusedLayerNorm("8")
    with pytest.raises(ValueError, match="positive"):
        FusedRMSNorm(0)
    with pytest.raises(ValueError, match="eps"):
        FusedLayerNorm(4, eps=-1.0)
    with pytest.raises(ValueError, match="does not end with normalized_shape"):
        FusedLayerNorm(4)(torch.randn(3, 5))
    with pytest.raises(ValueError, match="weight has shape"):
        fused_rms_norm_affine(torch.randn(2, 4), torch.ones(3), 4)
    with pytest.raises(TypeError, match="floating-point"):
        fused_layer_norm(torch.ones(2, 4, dtype=torch.int64), 4)


def test_runs_on_the_test_device(device):
    x = torch.randn(3, 16, device=device)
    m = FusedLayerNorm(16).to(device)
    torch.testing.assert_close(m(x).cpu(), torch.nn.functional.layer_norm(x.cpu(), (16,), eps=1e-5),
                               rtol=1e-5, atol=1e-5)
    r = FusedRMSNorm(16).to(device)
    torch.testing.assert_close(r(x).cpu().double(), _rms_ref(x.cpu(), (16,), None, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.full
def test_transformers_t5_uses_fused_rms_norm():
    import sys

    sys.modules.pop("transformers.models.t5.modeling_t5", None)
    from transformers import T5Config
    from transformers.models.t5 import modeling_t5

    assert modeling_t5.T5LayerNorm is FusedRMSNorm
    cfg = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
                   decoder_start_token_id=0, pad_token_id=0)
    model = modeling_t5.T5ForConditionalGeneration(cfg)
    ids = torch.randint(0, 64, (2, 5))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)


def test_upstream_function_classes_apply_the_functional_forms():
    x = torch.randn(3, 5, requires_grad=True)
    w, b = torch.rand(5, requires_grad=True), torch.rand(5)
    y = fln.FusedLayerNormAffineFunction.apply(x, w, b, (5,), 1e-5, False)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (5,), w, b, 1e-5))
    y.sum().backward()
    assert x.grad is not None and w.grad is not None
    torch.testing.assert_close(fln.FusedRMSNormAffineFunction.apply(x, w, (5,), 1e-5),
                               fused_rms_norm_affine(x, w, (5,), 1e-5))
    torch.testing.assert_close(fln.FusedLayerNormFunction.apply(x, (5,), 1e-5), fused_layer_norm(x, (5,), 1e-5))
    torch.testing.assert_close(fln.FusedRMSNormFunction.apply(x, (5,), 1e-5), fused_rms_norm(x, (5,), 1e-5))
    wb = w.detach().bfloat16()
    assert fln.FusedLayerNormAffineMixedDtypesFunction.apply(x, wb, b.bfloat16(), (5,), 1e-5).dtype == torch.bfloat16
    assert fln.FusedRMSNormAffineMixedDtypesFunction.apply(x, wb, (5,), 1e-5).dtype == torch.bfloat16


UPSTREAM_FORWARD_ARGS = {  # NVIDIA Apex's torch.autograd.Function.forward signatures
    "FusedLayerNormAffineFunction": ["ctx", "input", "weight", "bias", "normalized_shape", "eps", "memory_efficient"],
    "FusedLayerNormAffineMixedDtypesFunction": ["ctx", "input", "weight", "bias", "normalized_shape", "eps",
                                                "memory_efficient"],
    "FusedLayerNormFunction": ["ctx", "input", "normalized_shape", "eps", "memory_efficient"],
    "FusedRMSNormAffineFunction": ["ctx", "input", "weight", "normalized_shape", "eps", "memory_efficient"],
    "FusedRMSNormAffineMixedDtypesFunction": ["ctx", "input", "weight", "normalized_shape", "eps", "memory_efficient"],
    "FusedRMSNormFunction": ["ctx", "input", "normalized_shape", "eps", "memory_efficient"],
}


def test_function_classes_have_upstreams_forward_arguments():
    import inspect

    for name, args in UPSTREAM_FORWARD_ARGS.items():
        assert inspect.getfullargspec(getattr(fln, name).forward).args == args, name


class _MegatronStyleLayerNorm(nn.Module):
    """Megatron-core's documented call pattern: pass memory_efficient only when forward's arguments name it."""

    def __init__(self, hidden, fn):
        super().__init__()
        self.weight, self.bias, self.hidden, self.fn = nn.Parameter(torch.ones(hidden)), nn.Parameter(
            torch.zeros(hidden)), hidden, fn

    def forward(self, x):
        import inspect

        assert "memory_efficient" in inspect.getfullargspec(self.fn.forward).args
        return self.fn.apply(x, self.weight, self.bias, self.hidden, 1e-5, False)


def test_megatron_style_introspection_and_training_step():
    torch.manual_seed(0)
    ours = _MegatronStyleLayerNorm(8, fln.FusedLayerNormAffineFunction)
    ref = nn.LayerNorm(8, eps=1e-5)
    x = torch.randn(4, 3, 8)
    (ours(x) * x).sum().backward()
    (ref(x) * x).sum().backward()
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, rtol=0, atol=0)


def _autocast_dtype(device):
    return torch.float16 if torch.device(device).type == "cuda" else torch.bfloat16


@pytest.mark.parametrize("form", ["layer", "rms"])
def test_under_autocast_the_norm_runs_in_the_autocast_dtype(form, device):
    """Upstream's fused forms cast input and weights to the autocast dtype and run with autocast off:
    the output has that dtype and equals the norm of the cast tensors (F.layer_norm alone would give
    float32 there, autocast's rule for it)."""
    device = torch.device(device)
    torch.manual_seed(0)
    low = _autocast_dtype(device)
    x = torch.randn(4, 3, 16, device=device)
    if form == "layer":
        m = FusedLayerNorm(16).to(device)
        with torch.no_grad():
            m.weight.uniform_(0.5, 1.5)
            m.bias.uniform_(-0.5, 0.5)
        expect = torch.nn.functional.layer_norm(x.to(low), (16,), m.weight.to(low), m.bias.to(low), 1e-5)
        calls = [lambda: m(x), lambda: fused_layer_norm_affine(x, m.weight, m.bias, (16,), 1e-5)]
        plain = [lambda: fused_layer_norm(x, (16,), 1e-5)]
        plain_expect = torch.nn.functional.layer_norm(x.to(low), (16,), eps=1e-5)
        mixed = lambda: mixed_dtype_fused_layer_norm_affine(x, m.weight, m.bias, (16,), 1e-5)  # noqa: E731
    else:
        m = FusedRMSNorm(16).to(device)
        with torch.no_grad():
            m.weight.uniform_(0.5, 1.5)
        expect = fused_rms_norm_affine(x.to(low), m.weight.to(low), (16,), 1e-5)
        calls = [lambda: m(x), lambda: fused_rms_norm_affine(x, m.weight, (16,), 1e-5)]
        plain = [lambda: fused_rms_norm(x, (16,), 1e-5)]
        plain_expect = fused_rms_norm(x.to(low), (16,), 1e-5)
        mixed = lambda: mixed_dtype_fused_rms_norm_affine(x, m.weight, (16,), 1e-5)  # noqa: E731
    with torch.autocast(device.type, dtype=low):
        outs = [c() for c in calls] + [mixed()]
        plain_outs = [c() for c in plain]
    for out in outs:
        assert out.dtype == low
        torch.testing.assert_close(out, expect, rtol=0, atol=0)
    for out in plain_outs:
        assert out.dtype == low
        torch.testing.assert_close(out, plain_expect, rtol=0, atol=0)
    # the cast is differentiable: the fp32 weight gets its grad in fp32
    with torch.autocast(device.type, dtype=low):
        m(x).float().sum().backward()
    assert m.weight.grad is not None and m.weight.grad.dtype == torch.float32


def test_under_autocast_function_apply_forms_keep_the_given_dtypes(device):
    """Upstream's ``*Function.apply`` does not cast: float32 in, float32 out, also under autocast."""
    device = torch.device(device)
    low = _autocast_dtype(device)
    x, w, b = torch.randn(3, 8, device=device), torch.rand(8, device=device), torch.rand(8, device=device)
    with torch.autocast(device.type, dtype=low):
        y = fln.FusedLayerNormAffineFunction.apply(x, w, b, (8,), 1e-5)
        r = fln.FusedRMSNormFunction.apply(x, (8,), 1e-5)
    assert y.dtype == r.dtype == torch.float32
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (8,), w, b, 1e-5))
    torch.testing.assert_close(r, fused_rms_norm(x, (8,), 1e-5))


def test_under_autocast_float64_is_not_cast(device):
    device = torch.device(device)
    if device.type == "npu":
        pytest.skip("float64 tensors are not used on npu")
    x = torch.randn(2, 8, dtype=torch.float64, device=device)
    with torch.autocast(device.type, dtype=_autocast_dtype(device)):
        assert fused_layer_norm(x, (8,), 1e-5).dtype == torch.float64


# ---------------------------------------------------------------- export
@pytest.mark.parametrize("cls", [FusedRMSNorm, MixedFusedRMSNorm])
def test_rms_norm_exports_as_plain_ops(cls, device, monkeypatch):
    """torch.export sees the formula's plain ops (never F.rms_norm, which becomes a fused aten op on CUDA that
    ONNX cannot translate); the exported program computes what the eager module does."""
    def refused(*args, **kwargs):
        raise AssertionError("F.rms_norm was called while exporting")

    module = cls([8, 4]).to(device)
    x = torch.randn(3, 8, 4, device=device)
    eager = module(x)
    monkeypatch.setattr(fln.F, "rms_norm", refused)
    program = torch.export.export(module, (x,))
    ops = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert not any("rms_norm" in op for op in ops), ops
    torch.testing.assert_close(program.module()(x), eager, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dynamo", [False, True])
def test_rms_norm_exports_to_onnx_opset_18(dynamo, device):
    """ONNX has no RMS norm below opset 23: the graph holds the formula's ReduceMean."""
    onnx = pytest.importorskip("onnx")
    if dynamo:
        pytest.importorskip("onnxscript")
    import io
    import warnings

    for module in (FusedRMSNorm([8, 4]), MixedFusedRMSNorm([8, 4]), FusedLayerNorm([8, 4])):
        buf = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation, the dynamo exporter's notes
            torch.onnx.export(module.to(device), (torch.randn(3, 8, 4, device=device),), buf, input_names=["x_in"],
                              opset_version=18, dynamo=dynamo)
        graph = onnx.load_from_string(buf.getvalue()).graph
        ops = {node.op_type for node in graph.node}
        assert [i.name for i in graph.input][:1] == ["x_in"]
        assert "ReduceMean" in ops or "LayerNormalization" in ops, ops


def test_bad_eps_and_inputs_are_named():
    from apex.normalization import FusedLayerNorm, FusedRMSNorm
    from apex.normalization.fused_layer_norm import fused_layer_norm, fused_layer_norm_affine

    for cls in (FusedLayerNorm, FusedRMSNorm):
        for eps in (float("nan"), float("inf"), 10**400, -1.0):
            with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
                cls(4, eps=eps)
        for eps in (True, "1e-5", iter([1e-5]), {"state": None}):  # not a number: a TypeError, named by type
            with pytest.raises(TypeError, match=r"eps must be a finite number >= 0, got [a-z_]+$"):
                cls(4, eps=eps)
    x = torch.randn(2, 4)
    with pytest.raises(TypeError, match="input must be a dense"):
        fused_layer_norm(x.to_sparse(), (4,))
    with warnings.catch_warnings():  # torch's "prototype stage" notice for the strided nested layout
        warnings.simplefilter("ignore", UserWarning)
        nested = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)])
    with pytest.raises(TypeError, match="a nested tensor"):
        FusedLayerNorm(4)(nested)
    with pytest.raises(TypeError, match=r"weight must be a floating-point tensor or None, got a torch\.int64 tensor"):
        fused_layer_norm_affine(x, torch.ones(4, dtype=torch.long), torch.zeros(4), (4,))


def _nested(*shapes):
    with warnings.catch_warnings():  # torch's "prototype stage" notice for the strided nested layout
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.ones(s) for s in shapes])


@pytest.mark.parametrize("call,match", [
    (lambda x: fused_layer_norm_affine(x, torch.ones(4).to_sparse(), torch.zeros(4), 4),
     r"fused_layer_norm_affine: weight must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    (lambda x: fused_layer_norm_affine(x, torch.ones(4), torch.zeros(4).to_sparse(), 4),
     "fused_layer_norm_affine: bias must be a dense"),
    (lambda x: fused_layer_norm_affine(x, _nested((4,)), torch.zeros(4), 4), "weight must be a dense .* nested"),
    (lambda x: fused_rms_norm_affine(x, torch.ones(4).to_sparse(), 4),
     "fused_rms_norm_affine: weight must be a dense"),
    (lambda x: fln.FusedLayerNormAffineFunction.apply(x, torch.ones(4).to_sparse(), torch.zeros(4), (4,), 1e-5),
     "FusedLayerNormAffineFunction: weight must be a dense"),
])
def test_sparse_or_nested_weights_are_refused_by_name(call, match):
    x = torch.randn(2, 4)
    before = x.clone()
    with pytest.raises(TypeError, match=match):
        call(x)
    assert torch.equal(x, before)


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm])
@pytest.mark.parametrize("shape,match", [
    (2**63, r"normalized_shape is 9223372036854775808: 9223372036854775808 elements, more than a tensor holds"),
    ([2**62, 4], r"normalized_shape is \(4611686018427387904, 4\): 18446744073709551616 elements"),
    (2**62, r"normalized_shape is 4611686018427387904: 18446744073709551616 bytes of torch.float32"),
])
def test_shapes_no_tensor_can_have_are_refused_by_name(cls, shape, match):
    with pytest.raises(ValueError, match=f"{cls.__name__}: {match}"):
        cls(shape)
