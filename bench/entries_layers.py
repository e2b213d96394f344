"""Layer entries: upstream's fused layers that run on torch's ops here, forward + backward against the torch code a
model would otherwise run for the same math.

Each timed call is one forward and one backward (grads of the input, and of the parameters where there are some,
dropped after the call), ours against torch in the same round:

* softmax cross entropy with label smoothing 0.1 and padding rows (``apex.contrib.xentropy``) against
  ``F.cross_entropy(..., label_smoothing=0.1, ignore_index=pad, reduction="none")``, the same loss per row;
* group norm + SiLU, bf16 channels-last activations with fp32 parameters (``apex.contrib.group_norm``) against
  ``F.group_norm`` on the input cast to fp32 (torch's mixed-dtype path in a UNet) then ``F.silu``, cast back;
* fused scale-mask softmax (``apex.transformer.functional``, its fused path) against the module's own torch path
  with fp32 softmax;
* RoPE (``fused_apply_rotary_pos_emb``) against Megatron's unfused rotate-half code;
* ``FusedDenseGeluDense`` against ``nn.Linear`` -> tanh GELU -> ``nn.Linear``;
* focal loss with label smoothing over padded classes (``apex.contrib.focal_loss``) against EfficientDet's unfused
  smoothed focal loss on one-hot targets, ignored anchors masked out;
* self attention with a key padding mask (``apex.contrib.multihead_attn.SelfMultiheadAttn``) against
  ``nn.MultiheadAttention`` holding the same weights;
* the packed transducer joint (``apex.contrib.transducer.TransducerJoint(pack_output=True)``) against the
  broadcast sum then a boolean selection of the rows inside each sequence's lengths.

``bytes_per_param`` counts the tensor traffic both sides cannot avoid (read the input in the forward; read the
saved tensor(s) and the incoming grad, write the input's grad in the backward), so GB/s compare with the roofline;
the dense row is compute-bound and its GB/s say little.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from bench.registry import Context, Entry, Registry


def _fwd_bwd(fn, x, grad, params=()):
    out = fn(x)
    out.backward(grad)
    x.grad = None
    for p in params:
        p.grad = None
    return out


# ---------------------------------------------------------------- cross entropy


def _xent_setup(ctx: Context, dtype: torch.dtype):
    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    rows, classes = (256, 8000) if ctx.quick else (1024, 32000)
    g = torch.Generator().manual_seed(ctx.seed)
    logits = torch.randn(rows, classes, generator=g).mul_(2).to(dtype).to(ctx.device).requires_grad_()
    labels = torch.randint(1, classes, (rows,), generator=g)
    labels[::7] = 0  # padding rows
    labels = labels.to(ctx.device)
    grad = torch.ones(rows, device=ctx.device)
    return {
        "numel": logits.numel(),
        "tensors": 1,
        "x": logits,
        "grad": grad,
        "ours_fn": lambda x: SoftmaxCrossEntropyLoss.apply(x, labels, 0.1, 0),
        "ref_fn": lambda x: F.cross_entropy(x.float() if x.dtype != torch.float32 else x, labels, ignore_index=0,
                                            label_smoothing=0.1, reduction="none"),
    }


def _xent_verify(st):
    a = st["ours_fn"](st["x"].detach())
    b = st["ref_fn"](st["x"].detach())
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- group norm + SiLU


def _gn_setup(ctx: Context):
    from apex.contrib.group_norm import GroupNorm

    n, c, hw = (2, 320, 16) if ctx.quick else (8, 320, 32)
    g = torch.Generator().manual_seed(ctx.seed)
    x = torch.randn(n, c, hw, hw, generator=g).to(torch.bfloat16).to(ctx.device)
    x = x.to(memory_format=torch.channels_last).requires_grad_()
    ours = GroupNorm(32, c, act="silu").to(ctx.device)
    w, b = ours.weight, ours.bias

    def ref(t):
        return F.silu(F.group_norm(t.float(), 32, w, b, 1e-5)).to(t.dtype)

    return {
        "numel": x.numel(),
        "tensors": 1,
        "x": x,
        "grad": torch.ones_like(x),
        "params": (w, b),
        "ours_fn": ours,
        "ref_fn": ref,
    }


def _gn_verify(st):
    torch.testing.assert_close(st["ours_fn"](st["x"].detach()), st["ref_fn"](st["x"].detach()), rtol=1.6e-2,
                               atol=1.6e-2)


# ---------------------------------------------------------------- attention softmax


def _softmax_setup(ctx: Context):
    from apex.transformer import AttnMaskType
    from apex.transformer.functional import FusedScaleMaskSoftmax

    b, heads, s = (2, 8, 128) if ctx.quick else (4, 16, 256)
    g = torch.Generator().manual_seed(ctx.seed)
    x = torch.randn(b, heads, s, s, generator=g).to(torch.bfloat16).to(ctx.device).requires_grad_()
    mask = (torch.rand(b, 1, s, s, generator=g) < 0.2).to(ctx.device)

    def fill(scores, m):
        return scores.masked_fill(m, -10000.0)

    fused = FusedScaleMaskSoftmax(False, True, AttnMaskType.padding, True, fill, True, 0.125)
    plain = FusedScaleMaskSoftmax(False, True, AttnMaskType.padding, False, fill, True, 0.125)
    assert fused.is_kernel_available(mask, *x.shape)
    return {
        "numel": x.numel(),
        "tensors": 1,
        "x": x,
        "grad": torch.ones_like(x),
        "ours_fn": lambda t: fused(t, mask),
        "ref_fn": lambda t: plain(t, mask),
    }


def _softmax_verify(st):
    torch.testing.assert_close(st["ours_fn"](st["x"].detach()), st["ref_fn"](st["x"].detach()), rtol=8e-3,
                               atol=4e-3)


# ---------------------------------------------------------------- RoPE


def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_setup(ctx: Context):
    from apex.transformer.functional import fused_apply_rotary_pos_emb

    s, b, h, d = (256, 2, 8, 64) if ctx.quick else (1024, 2, 16, 128)
    g = torch.Generator().manual_seed(ctx.seed)
    x = torch.randn(s, b, h, d, generator=g).to(torch.bfloat16).to(ctx.device).requires_grad_()
    freqs = torch.rand(s, 1, 1, d, generator=g).to(ctx.device)

    def unfused(t):
        cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
        return t * cos + _rotate_half(t) * sin

    return {
        "numel": x.numel(),
        "tensors": 1,
        "x": x,
        "grad": torch.ones_like(x),
        "ours_fn": lambda t: fused_apply_rotary_pos_emb(t, freqs),
        "ref_fn": unfused,
    }


def _rope_verify(st):
    torch.testing.assert_close(st["ours_fn"](st["x"].detach()), st["ref_fn"](st["x"].detach()), rtol=0, atol=0)


# ---------------------------------------------------------------- dense -> GELU -> dense


def _dense_setup(ctx: Context):
    from apex.fused_dense import FusedDenseGeluDense

    rows, hidden = (256, 256) if ctx.quick else (2048, 768)
    torch.manual_seed(ctx.seed)
    ours = FusedDenseGeluDense(hidden, 4 * hidden, hidden).to(ctx.device)
    first = torch.nn.Linear(hidden, 4 * hidden).to(ctx.device)
    second = torch.nn.Linear(4 * hidden, hidden).to(ctx.device)
    with torch.no_grad():
        first.weight.copy_(ours.weight1)
        first.bias.copy_(ours.bias1)
        second.weight.copy_(ours.weight2)
        second.bias.copy_(ours.bias2)
    x = torch.randn(rows, hidden, device=ctx.device).requires_grad_()
    return {
        "numel": x.numel(),
        "tensors": 1,
        "x": x,
        "grad": torch.ones(rows, hidden, device=ctx.device),
        "params": (*ours.parameters(), *first.parameters(), *second.parameters()),
        "ours_fn": ours,
        "ref_fn": lambda t: second(F.gelu(first(t), approximate="tanh")),
    }


def _dense_verify(st):
    torch.testing.assert_close(st["ours_fn"](st["x"].detach()), st["ref_fn"](st["x"].detach()), rtol=0, atol=0)


# ---------------------------------------------------------------- focal loss


def _focal_setup(ctx: Context):
    from apex.contrib.focal_loss import focal_loss

    anchors, classes, real = ((2, 16, 16, 9), 96, 90) if ctx.quick else ((4, 32, 32, 9), 96, 90)
    g = torch.Generator().manual_seed(ctx.seed)
    x = torch.randn(*anchors, classes, generator=g).to(ctx.device).requires_grad_()
    labels = torch.randint(-2, real, anchors, generator=g).to(ctx.device)
    npos = torch.tensor(float((labels >= 0).sum()) + 1.0, device=ctx.device)
    keep = (labels != -2).unsqueeze(-1)
    onehot = (labels.unsqueeze(-1) == torch.arange(real, device=ctx.device)).float()
    alpha, gamma, smoothing = 0.25, 1.5, 0.1

    def unfused(t):
        t = t[..., :real]
        p = t.sigmoid()
        p_t = onehot * p + (1 - onehot) * (1 - p)
        alpha_t = onehot * alpha + (1 - onehot) * (1 - alpha)
        target = onehot * (1 - smoothing) + 0.5 * smoothing
        ce = F.binary_cross_entropy_with_logits(t, target, reduction="none")
        return (alpha_t * (1 - p_t) ** gamma * ce * keep).sum() / npos

    return {
        "numel": x.numel(),
        "tensors": 1,
        "x": x,
        "grad": torch.ones((), device=ctx.device),
        "ours_fn": lambda t: focal_loss.FocalLoss.apply(t, labels, npos, real, alpha, gamma, smoothing),
        "ref_fn": unfused,
    }


def _focal_verify(st):
    x = st["x"].detach()
    torch.testing.assert_close(st["ours_fn"](x), st["ref_fn"](x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- self attention


def _mha_setup(ctx: Context):
    from apex.contrib.multihead_attn import SelfMultiheadAttn

    t, b, e, h = (32, 4, 128, 4) if ctx.quick else (128, 16, 512, 8)
    d = e // h
    torch.manual_seed(ctx.seed)
    ours = SelfMultiheadAttn(e, h, bias=True).to(ctx.device)
    ref = torch.nn.MultiheadAttention(e, h).to(ctx.device)
    with torch.no_grad():  # upstream's per-head q/k/v rows into torch's q, k, v blocks
        ref.in_proj_weight.copy_(ours.in_proj_weight.view(h, 3, d, e).transpose(0, 1).reshape(3 * e, e))
        ref.in_proj_bias.copy_(ours.in_proj_bias.view(h, 3, d).transpose(0, 1).reshape(3 * e))
        ref.out_proj.weight.copy_(ours.out_proj_weight)
        ref.out_proj.bias.copy_(ours.out_proj_bias)
    x = torch.randn(t, b, e, device=ctx.device).requires_grad_()
    pad = torch.zeros(b, t, dtype=torch.bool, device=ctx.device)
    pad[:, -t // 8:] = True
    return {
        "numel": x.numel(),
        "tensors": 1,
        "x": x,
        "grad": torch.ones(t, b, e, device=ctx.device),
        "params": (*ours.parameters(), *ref.parameters()),
        "ours_fn": lambda q: ours(q, q, q, key_padding_mask=pad)[0],
        "ref_fn": lambda q: ref(q, q, q, key_padding_mask=pad, need_weights=False)[0],
    }


def _mha_verify(st):
    x = st["x"].detach()
    torch.testing.assert_close(st["ours_fn"](x), st["ref_fn"](x), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- transducer joint


def _joint_setup(ctx: Context):
    from apex.contrib.transducer import TransducerJoint

    b, t, u, h = (4, 50, 20, 128) if ctx.quick else (8, 200, 60, 512)
    g_ = torch.Generator().manual_seed(ctx.seed)
    f = torch.randn(b, t, h, generator=g_).to(ctx.device).requires_grad_()
    g = torch.randn(b, u, h, generator=g_).to(ctx.device).requires_grad_()
    f_len = torch.randint(t // 2, t + 1, (b,), generator=g_).to(ctx.device)
    g_len = torch.randint(u // 2, u + 1, (b,), generator=g_).to(ctx.device)
    offset = torch.cumsum(f_len * g_len, 0)
    rows = int(offset[-1])
    valid = ((torch.arange(t, device=ctx.device) < f_len[:, None])[:, :, None]
             & (torch.arange(u, device=ctx.device) < g_len[:, None])[:, None, :])
    joint = TransducerJoint(pack_output=True)
    return {
        "numel": rows * h,
        "tensors": 1,
        "x": f,
        "grad": torch.ones(rows, h, device=ctx.device),
        "params": (g,),
        "ours_fn": lambda x: joint(x, g, f_len, g_len, batch_offset=offset, packed_batch=rows),
        "ref_fn": lambda x: (x[:, :, None, :] + g[:, None, :, :])[valid],
    }


def _joint_verify(st):
    x = st["x"].detach()
    torch.testing.assert_close(st["ours_fn"](x), st["ref_fn"](x), rtol=0, atol=0)


def _entry(name, regime, setup, verify, bytes_per_param, ref_label, dtype, notes=""):
    return Entry(
        name=name,
        regime=regime,
        setup=setup,
        ours=lambda st: _fwd_bwd(st["ours_fn"], st["x"], st["grad"], st.get("params", ())),
        torch_ref=lambda st: _fwd_bwd(st["ref_fn"], st["x"], st["grad"], st.get("params", ())),
        bytes_per_param=bytes_per_param,
        executor="torch ops",
        ref_label=ref_label,
        target_ratio=1.05,
        verify=verify,
        dtype=dtype,
        group="layers",
        notes=notes,
    )


def register(reg: Registry) -> None:
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        label = "fp32" if dtype == torch.float32 else "bf16"
        reg.add(_entry(
            "softmax cross entropy, label smoothing (fwd+bwd)", f"1024 x 32000 {label}",
            lambda ctx, dtype=dtype: _xent_setup(ctx, dtype), _xent_verify,
            3 * size,  # read the logits (forward and backward), write their grad
            "F.cross_entropy(label_smoothing=0.1, ignore_index, reduction='none')", label,
            notes="bf16 reference upcasts the logits to fp32, as apex's math does"))
    reg.add(_entry(
        "GroupNorm + SiLU (fwd+bwd)", "8 x 320 x 32 x 32 bf16 NHWC", _gn_setup, _gn_verify,
        2 * 4, "F.group_norm on fp32 + F.silu, cast back", "bf16",
        notes="read x (fwd, bwd), grad in, grad out: 4 bf16 passes"))
    reg.add(_entry(
        "scale-mask softmax (fwd+bwd)", "4 x 16 x 256 x 256 bf16", _softmax_setup, _softmax_verify,
        2 * 4, "FusedScaleMaskSoftmax's torch path (fp32 softmax)", "bf16",
        notes="read x, write y; read y and grad, write grad"))
    reg.add(_entry(
        "RoPE (fwd+bwd)", "1024 x 2 x 16 x 128 bf16", _rope_setup, _rope_verify,
        2 * 4, "Megatron's unfused rotate-half code", "bf16"))
    reg.add(_entry(
        "FusedDenseGeluDense (fwd+bwd)", "2048 x 768 -> 3072 -> 768 fp32", _dense_setup, _dense_verify,
        4 * 4, "nn.Linear -> F.gelu(tanh) -> nn.Linear", "fp32",
        notes=f"compute-bound: {2 * 3 * 2 * 2048 * 768 * 3072 / 1e9:.0f} GFLOP per call"))
    reg.add(_entry(
        "focal loss, label smoothing (fwd+bwd)", "4 x 32 x 32 x 9 anchors x 96 (90 real) fp32", _focal_setup,
        _focal_verify, 3 * 4, "EfficientDet's unfused smoothed focal loss on one-hot targets", "fp32",
        notes="read the logits (fwd), the saved gradient (bwd), write the logits' grad"))
    reg.add(_entry(
        "SelfMultiheadAttn, key padding mask (fwd+bwd)", "128 x 16 x 512, 8 heads fp32", _mha_setup, _mha_verify,
        4 * 4, "nn.MultiheadAttention, same weights", "fp32",
        notes="compute-bound (projections and attention products); GB/s say little"))
    reg.add(_entry(
        "TransducerJoint, packed (fwd+bwd)", "8 x 200 x 60 x 512 fp32, lengths >= half", _joint_setup,
        _joint_verify, 2 * 4, "broadcast f + g, boolean selection of the packed rows", "fp32",
        notes="write the packed rows, read their grad; the inputs are small beside them"))

