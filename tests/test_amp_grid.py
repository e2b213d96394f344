"""amp training equals plain torch doing the same mixed-precision math by hand.

Grid: O0-O3 x {zero via model, via optimizer, set_to_none} x {1, 2 losses} x {1, 2 optimizers}
(O1/O2 also with combine_grad), and with dynamic loss scaling an inf injected in backward 0 or 1
at iteration 0 or 1: exactly the optimizers of that loss skip exactly that step, and only that
loss's scaler backs off.

Why exact equality: loss scales are powers of two, and multiplying by a power of two commutes with
rounding (no subnormals at these magnitudes), so a scaled backward followed by the unscale gives
the unscaled gradients bit for bit. The references below therefore run without any scaling and
must match to the last bit (torch optimizers). Models: two tiny MLPs with a BatchNorm (fp32 under
O2's keep_batchnorm_fp32), bf16 (the CPU default).

Loss layout: with two losses, loss0 = f(m0(x)) + f(m1(x)) and loss1 = f(m1(x')), so m1 accumulates
gradients from both backwards; loss0 feeds every optimizer, loss1 only the one owning m1.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from _amp_harness import bn_mlp

from apex import amp

pytestmark = pytest.mark.usefixtures("amp_env")

LOW = torch.bfloat16


class Env:
    """Where the grid runs: the CPU default (bf16, exact comparisons) or the --device of the matrix."""

    def __init__(self, device="cpu", low=LOW):
        self.device, self.low = device, low


CPU = Env()
ITERS = 3
SCALE0 = 2.0**16


def make_models(env=CPU):
    torch.manual_seed(1)
    out = []
    for _ in range(2):
        out.append(bn_mlp(6, 12, 3).to(env.device))
    return out


def make_data(env=CPU):
    g = torch.Generator().manual_seed(2)
    return [tuple(t.to(env.device) for t in (torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g),
                                             torch.randn(8, 3, generator=g)))
            for _ in range(ITERS)]


def crit(out, y):
    return (out.float() - y).pow(2).mean()


def param_split(models, n_opts):
    if n_opts == 1:
        return [list(models[0].parameters()) + list(models[1].parameters())]
    return [list(models[0].parameters()), list(models[1].parameters())]


def loss_plan(n_losses, n_opts):
    """For each loss: which optimizers (indices) its backward feeds."""
    if n_losses == 1:
        return [list(range(n_opts))]
    return [list(range(n_opts)), [n_opts - 1]]


def make_opt(params, kind):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adam_fused":
        return torch.optim.Adam(params, lr=0.01, fused=True)
    if kind == "apex_adam":
        from apex.optimizers import NpuFusedAdam

        return NpuFusedAdam(params, lr=0.01)
    if kind == "nvidia_fused_adam":  # apex.optimizers.FusedAdam, what HF Trainer's "adamw_apex_fused" builds
        from apex.optimizers import FusedAdam

        return FusedAdam(params, lr=0.01)
    raise ValueError(kind)


def ref_opt(params, kind):
    return make_opt(params, "adam_fused" if kind in ("apex_adam", "nvidia_fused_adam") else kind)


def forward_losses(models, data, n_losses, level, env=CPU):
    x, x2, y = data

    def run(m, inp):
        if level == "O1":
            with torch.autocast(env.device, dtype=env.low):
                return m(inp)
        if level in ("O2", "O3"):
            return m(inp.to(env.low)).float()
        return m(inp)

    if n_losses == 1:
        return [crit(run(models[0], x), y) + crit(run(models[1], x), y)]
    return [crit(run(models[0], x), y) + crit(run(models[1], x), y), crit(run(models[1], x2), y)]


def inject_into(models, loss_k, low_param=True):
    """The param whose grad gets an inf in backward ``loss_k`` (a model that loss touches)."""
    m = models[0] if loss_k == 0 else models[1]
    return m[0].weight if low_param else m[1].weight


# ---------------------------------------------------------------- the hand-written reference


def reference(level, n_losses, n_opts, opt_kind="sgd", inject=None, inject_low=True, env=CPU):
    models = make_models(env)
    if level in ("O2", "O3"):
        for m in models:
            for mod in m.modules():
                if level == "O2" and isinstance(mod, torch.nn.BatchNorm1d):
                    continue
                for p in mod.parameters(recurse=False):
                    p.data = p.data.to(env.low)
                for name, b in mod.named_buffers(recurse=False):
                    if b.is_floating_point():
                        mod._buffers[name] = b.to(env.low)
    groups = param_split(models, n_opts)
    pairs = []
    if level == "O2":
        opt_params = []
        for ps in groups:
            out = []
            for p in ps:
                if p.dtype == env.low:
                    master = p.detach().clone().float().requires_grad_()
                    pairs.append((master, p))
                    out.append(master)
                else:
                    out.append(p)
            opt_params.append(out)
    else:
        opt_params = groups
    opts = [ref_opt(ps, opt_kind) for ps in opt_params]
    plan = loss_plan(n_losses, n_opts)
    data = make_data(env)
    all_params = [p for m in models for p in m.parameters()] + [m for m, _ in pairs]
    for it in range(ITERS):
        for p in all_params:
            p.grad = None
        losses = forward_losses(models, data[it], n_losses, level, env)
        skip = set()
        for k, loss in enumerate(losses):
            for _, model_p in pairs:
                model_p.grad = None
            loss.backward()
            if inject == (it, k):
                skip.update(plan[k])
            for master, model_p in pairs:
                if model_p.grad is not None:
                    g = model_p.grad.float()
                    master.grad = g if master.grad is None else master.grad + g
        for j, opt in enumerate(opts):
            if j not in skip:
                opt.step()
        with torch.no_grad():
            for master, model_p in pairs:
                model_p.copy_(master)
    return models, opts


# ---------------------------------------------------------------- the amp run


def amp_run(level, zero, n_losses, n_opts, opt_kind="sgd", inject=None, inject_low=True, verbosity=0, env=CPU,
            **kw):
    models = make_models(env)
    opts = [make_opt(ps, opt_kind) for ps in param_split(models, n_opts)]
    if env is not CPU:
        kw.setdefault("amp_dtype", env.low)
    models, opts = amp.initialize(models, opts, opt_level=level, verbosity=verbosity, num_losses=n_losses, **kw)
    plan = loss_plan(n_losses, n_opts)
    data = make_data(env)
    for it in range(ITERS):
        if zero == "model":
            for m in models:
                m.zero_grad(set_to_none=False)
        elif zero == "optimizer":
            for o in opts:
                o.zero_grad(set_to_none=False)
        else:
            for o in opts:
                o.zero_grad(set_to_none=True)
        losses = forward_losses_amp(models, data[it], n_losses)
        for k, loss in enumerate(losses):
            with amp.scale_loss(loss, [opts[j] for j in plan[k]], loss_id=k) as scaled:
                scaled.backward()
                if inject == (it, k):
                    with torch.no_grad():
                        inject_into(models, k, inject_low).grad.view(-1)[0] = float("inf")
        for o in opts:
            o.step()
    return models, opts


def forward_losses_amp(models, data, n_losses):
    x, x2, y = data
    if n_losses == 1:
        return [crit(models[0](x), y) + crit(models[1](x), y)]
    return [crit(models[0](x), y) + crit(models[1](x), y), crit(models[1](x2), y)]


def assert_same(models_a, models_b, exact=True, rtol=1e-5, atol=1e-6):
    for ma, mb in zip(models_a, models_b):
        for (name, a), b in zip(ma.state_dict(keep_vars=True).items(), mb.state_dict(keep_vars=True).values()):
            assert a.dtype == b.dtype, name
            if exact:
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
            else:
                torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol,
                                           msg=lambda m, n=name: f"{n}: {m}")


VARIANTS = [("O0", {}), ("O1", {}), ("O1", {"combine_grad": True}), ("O2", {}), ("O2", {"combine_grad": True}),
            ("O3", {})]


@pytest.mark.parametrize("n_opts", [1, 2])
@pytest.mark.parametrize("n_losses", [1, 2])
@pytest.mark.parametrize("zero", ["model", "optimizer", "set_to_none"])
@pytest.mark.parametrize("level,kw", VARIANTS, ids=lambda v: "-".join(f"{k}" for k in v) if isinstance(v, dict) else v)
def test_matches_plain_torch(level, kw, zero, n_losses, n_opts):
    ref_models, _ = reference(level, n_losses, n_opts)
    amp_models, _ = amp_run(level, zero, n_losses, n_opts, **kw)
    assert_same(amp_models, ref_models)
    scales = [s["loss_scale"] for s in amp.state_dict().values()]
    assert scales == [SCALE0 if level in ("O1", "O2") else 1.0] * n_losses


INJECT_CASES = [(nl, no, k, it) for nl, no in itertools.product([1, 2], [1, 2]) for k in range(nl) for it in (0, 1)]
DYNAMIC = [("O0", {"loss_scale": "dynamic"}), ("O1", {}), ("O1", {"combine_grad": True}), ("O2", {}),
           ("O2", {"combine_grad": True}), ("O3", {"loss_scale": "dynamic"})]


@pytest.mark.parametrize("n_losses,n_opts,k,it", INJECT_CASES)
@pytest.mark.parametrize("level,kw", DYNAMIC, ids=lambda v: "-".join(f"{k}" for k in v) if isinstance(v, dict) else v)
def test_inf_skips_only_owning_optimizers(level, kw, n_losses, n_opts, k, it, caplog):
    ref_models, _ = reference(level, n_losses, n_opts, inject=(it, k))
    with caplog.at_level("INFO", logger="apex.amp"):
        amp_models, _ = amp_run(level, "optimizer", n_losses, n_opts, inject=(it, k), verbosity=1, **kw)
    assert_same(amp_models, ref_models)
    state = amp.state_dict()
    for j in range(n_losses):
        expected = SCALE0 / 2 if j == k else SCALE0
        assert state[f"loss_scaler{j}"] == {"loss_scale": expected, "unskipped": ITERS - 1 - it if j == k else ITERS}
    skipped = len(loss_plan(n_losses, n_opts)[k])
    msgs = [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()]
    assert msgs == [f"Gradient overflow. Skipping step, loss scaler {k} reducing loss scale to {SCALE0 / 2}"] * skipped


@pytest.mark.parametrize("combine", [False, True])
def test_o2_inf_in_fp32_batchnorm_grad(combine):
    """The fp32 (batchnorm) params are their own masters: an inf there is caught the same way."""
    ref_models, _ = reference("O2", 2, 2, inject=(1, 1), inject_low=False)
    amp_models, _ = amp_run("O2", "optimizer", 2, 2, inject=(1, 1), inject_low=False, combine_grad=combine or None)
    assert_same(amp_models, ref_models)
    assert amp.state_dict()["loss_scaler1"]["loss_scale"] == SCALE0 / 2


@pytest.mark.parametrize("zero", ["model", "optimizer", "set_to_none"])
@pytest.mark.parametrize("level,kw", [("O1", {}), ("O1", {"combine_grad": True}), ("O1", {"combine_grad": True,
                                      "fold_unscale": True}), ("O2", {}), ("O2", {"combine_grad": True})],
                         ids=str)
def test_fused_torch_optimizer(level, kw, zero):
    ref_models, _ = reference(level, 2, 2, opt_kind="adam_fused", inject=(1, 1))
    amp_models, _ = amp_run(level, zero, 2, 2, opt_kind="adam_fused", inject=(1, 1), **kw)
    assert_same(amp_models, ref_models, exact=False)


@pytest.mark.parametrize("zero", ["model", "optimizer", "set_to_none"])
@pytest.mark.parametrize("level,kw", [("O1", {}), ("O1", {"combine_grad": True}), ("O1", {"combine_grad": True,
                                      "fold_unscale": True}), ("O2", {}), ("O2", {"combine_grad": True})],
                         ids=str)
def test_apex_fused_optimizer(level, kw, zero):
    """Our fused Adam under amp: combined grads come from the optimizer (one owner per buffer)."""
    pytest.importorskip("apex.optimizers")
    ref_models, _ = reference(level, 2, 2, opt_kind="apex_adam", inject=(1, 1))
    amp_models, _ = amp_run(level, zero, 2, 2, opt_kind="apex_adam", inject=(1, 1), **kw)
    assert_same(amp_models, ref_models, exact=False)


@pytest.mark.parametrize("kw", [{}, {"combine_grad": True}], ids=["plain", "combined"])
def test_nvidia_fused_adam_under_o1(kw):
    optimizers = pytest.importorskip("apex.optimizers")
    if not hasattr(optimizers, "FusedAdam"):
        pytest.skip("apex.optimizers.FusedAdam not available")
    ref_models, _ = reference("O1", 2, 2, opt_kind="nvidia_fused_adam", inject=(1, 1))
    amp_models, _ = amp_run("O1", "set_to_none", 2, 2, opt_kind="nvidia_fused_adam", inject=(1, 1), **kw)
    assert_same(amp_models, ref_models, exact=False)


@pytest.mark.parametrize("level,kw", [("O1", {}), ("O1", {"combine_grad": True}), ("O2", {}),
                                      ("O2", {"combine_grad": True})], ids=str)
def test_on_matrix_device(device, level, kw):
    """The grid's two-loss, two-optimizer case with an overflow, on the device of the test matrix
    (--device cuda / npu) in its default low-precision dtype. Off CPU the reference runs the same ops
    unscaled, and fp16 rounding of tiny (subnormal) gradients may then differ: compared with a tolerance."""
    from apex import _device

    env = Env(device, _device.default_amp_dtype(device))
    ref_models, _ = reference(level, 2, 2, inject=(1, 1), env=env)
    # a modest initial scale: fp16 grads of this model times 2**8 cannot overflow on their own
    amp_models, _ = amp_run(level, "optimizer", 2, 2, inject=(1, 1), env=env, dynamic_init_scale=2.0**8, **kw)
    # off CPU: a few fp16 ulps (about 1e-3 relative) of rounding freedom
    assert_same(amp_models, ref_models, exact=device == "cpu", rtol=4e-3, atol=4e-3)
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 2.0**8, "unskipped": ITERS},
                                "loss_scaler1": {"loss_scale": 2.0**7, "unskipped": ITERS - 2}}
