"""apex.fp16_utils: loss scalers, fp16 model helpers and FP16_Optimizer, against hand-computed references."""

import io
import re

import pytest
import torch
from torch import nn

import apex
from apex.fp16_utils import (
    BN_convert_float,
    DynamicLossScaler,
    FP16_Optimizer,
    FP16Model,
    LossScaler,
    clip_grad_norm,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)


# ---------------------------------------------------------------- scalers
def test_dynamic_scaler_schedule():
    s = DynamicLossScaler(init_scale=2**10, scale_factor=2.0, scale_window=3)
    assert s.loss_scale == 2**10 and s.cur_iter == 0 and s.last_overflow_iter == -1
    history = []
    for overflow in [False, False, False, True, False, False, False, True, True]:
        s.update_scale(overflow)
        history.append(s.loss_scale)
    # growth when (iter - last_overflow) % window == 0: iter 2 (2 - -1 = 3); backoff on overflow
    assert history == [2**10, 2**10, 2**11, 2**10, 2**10, 2**10, 2**11, 2**10, 2**9]
    assert s.cur_iter == 9 and s.last_overflow_iter == 8


def test_dynamic_scaler_never_goes_below_one():
    s = DynamicLossScaler(init_scale=2.0)
    for _ in range(4):
        s.update_scale(True)
    assert s.loss_scale == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_has_overflow(dtype, bad):
    s = DynamicLossScaler()
    ps = [nn.Parameter(torch.zeros(5, dtype=dtype)) for _ in range(3)]
    ps[0].grad = torch.ones(5, dtype=dtype)
    # ps[1] has no grad
    ps[2].grad = torch.ones(5, dtype=dtype)
    assert not s.has_overflow(ps)
    ps[2].grad[3] = bad
    assert s.has_overflow(ps) and s.has_overflow_serial(ps)
    assert DynamicLossScaler._has_inf_or_nan(ps[2].grad)
    assert not LossScaler(4).has_overflow(ps)


def test_static_scaler_backward_scales_grads():
    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    s = LossScaler(8)
    s.update_scale(True)  # static: no effect
    s.backward((w * w).sum())
    assert s.loss_scale == 8
    torch.testing.assert_close(w.grad, 8 * 2 * w.detach())


@pytest.mark.parametrize("kwargs", [dict(init_scale=0), dict(scale_factor=-2.0), dict(scale_window=0),
                                    dict(init_scale=float("inf")), dict(scale_factor=0.5), dict(scale_factor=1.0)])
def test_dynamic_scaler_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        DynamicLossScaler(**kwargs)


def test_to_python_float():
    assert to_python_float(torch.tensor(2.5)) == 2.5
    assert to_python_float(torch.tensor([3.0])) == 3.0
    assert to_python_float([4.0]) == 4.0


# ---------------------------------------------------------------- model helpers
def _convnet():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 5))


def test_network_to_half_keeps_batchnorm_fp32():
    net = network_to_half(_convnet())
    assert isinstance(net[0], tofp16)
    inner = net[1]
    assert inner[0].weight.dtype == torch.float16 and inner[4].weight.dtype == torch.float16
    assert inner[1].weight.dtype == torch.float32 and inner[1].running_mean.dtype == torch.float32
    out = net(torch.randn(2, 3, 6, 6))
    assert out.dtype == torch.float16 and out.shape == (2, 5)


def test_fp16_model_and_convert_network():
    model = FP16Model(_convnet())
    assert model.network[0].weight.dtype == torch.float16
    assert model.network[1].weight.dtype == torch.float32
    assert model(torch.randn(2, 3, 6, 6)).dtype == torch.float16
    net = convert_network(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in net.parameters())
    bn = BN_convert_float(nn.Sequential(nn.BatchNorm1d(3)).half())
    assert bn[0].weight.dtype == torch.float32
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        network_to_half("not a module")


def test_param_lists_roundtrip():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).half()
    model[1].bias.requires_grad_(False)
    model_params, masters = prep_param_lists(model)
    assert len(model_params) == 3 and all(m.dtype == torch.float32 and m.requires_grad for m in masters)
    for mp, m in zip(model_params, masters):
        assert torch.equal(m, mp.float()) and m.data_ptr() != mp.data_ptr()
    model(torch.randn(5, 3).half()).float().sum().backward()
    model_params[2].grad = None
    model_grads_to_master_grads(model_params, masters)
    assert torch.equal(masters[0].grad, model_params[0].grad.float()) and masters[2].grad is None
    with torch.no_grad():
        for m in masters:
            m.add_(1.0)
    master_params_to_model_params(model_params, masters)
    for mp, m in zip(model_params, masters):
        assert torch.equal(mp, m.half())


def test_flat_master_roundtrip():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).half()
    model_params, masters = prep_param_lists(model, flat_master=True)
    assert len(masters) == 1 and masters[0].numel() == sum(p.numel() for p in model_params)
    assert masters[0].grad is not None
    model(torch.randn(5, 3).half()).float().sum().backward()
    model_grads_to_master_grads(model_params, masters, flat_master=True)
    torch.testing.assert_close(masters[0].grad, torch.cat([p.grad.float().reshape(-1) for p in model_params]))
    with torch.no_grad():
        masters[0].mul_(2)
    master_params_to_model_params(model_params, masters, flat_master=True)
    assert torch.equal(model_params[0], (masters[0][:12].reshape(4, 3)).half())


def test_param_list_mismatch_raises():
    model = nn.Linear(3, 4)
    model_params, masters = prep_param_lists(model)
    with pytest.raises(ValueError, match="2 model params but 1 master params"):
        master_params_to_model_params(model_params, masters[:1])
    with pytest.raises(ValueError, match="flat master"):
        model_grads_to_master_grads(model_params, [torch.zeros(3)], flat_master=True)
    mixed = nn.Linear(2, 2)
    mixed.bias.data = mixed.bias.data.half()
    with pytest.raises(TypeError, match="one dtype"):
        prep_param_lists(mixed, flat_master=True)


def test_clip_grad_norm_matches_torch():
    a = [nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(3))]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    torch.testing.assert_close(clip_grad_norm(a, 0.5), torch.nn.utils.clip_grad_norm_(b, 0.5))
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad)


# ---------------------------------------------------------------- FP16_Optimizer
def _half_model(dtype=torch.float16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_step_updates_fp32_masters_with_unscaled_grads(dtype):
    model = _half_model(dtype)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), static_loss_scale=128.0,
                         verbose=False)
    masters = [m.detach().clone() for m in opt.fp32_from_fp16_groups[0]]
    assert all(m.dtype == torch.float32 for m in masters)
    x = torch.randn(4, 6).to(dtype)
    loss = model(x).float().pow(2).mean()
    opt.zero_grad()
    opt.backward(loss)
    model_grads = [p.grad.float() / 128.0 for p in model.parameters()]
    for m, g in zip(opt.fp32_from_fp16_groups[0], model_grads):
        torch.testing.assert_close(m.grad, g)
    opt.step()
    for p, m0, g, m in zip(model.parameters(), masters, model_grads, opt.fp32_from_fp16_groups[0]):
        torch.testing.assert_close(m.detach(), m0 - 0.1 * g)  # first momentum step = the grad itself
        assert torch.equal(p.detach(), m.detach().to(dtype))
    assert opt.loss_scale == 128.0


def test_dynamic_scale_skips_overflowing_step():
    model = _half_model()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 2.0**8, "scale_window": 2}, verbose=False)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    opt.backward(model(torch.randn(4, 6).half()).float().sum())
    next(model.parameters()).grad[0, 0] = float("inf")
    opt.update_master_grads()
    assert opt.overflow
    assert opt.inspect_master_grad_data() is None
    assert opt.clip_master_grads(1.0) == -1
    opt.step()
    assert opt.loss_scale == 2.0**7
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    # clean steps: updates, and after scale_window of them the scale grows
    for _ in range(2):
        opt.zero_grad()
        opt.backward(model(torch.randn(4, 6).half()).float().sum())
        assert not opt.overflow
        opt.step()
    assert opt.loss_scale == 2.0**8
    assert any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


def test_fp32_params_pass_through_and_params_without_grad():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2).half())
    frozen = model[1].bias
    frozen.requires_grad_(False)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.5), static_loss_scale=4.0, verbose=False)
    assert opt.fp32_from_fp32_groups[0] == [model[0].weight, model[0].bias]
    assert len(opt.fp16_groups[0]) == 1
    x = torch.randn(2, 3)
    w0 = model[0].weight.detach().clone()
    model[1](model[0](x).half()).float().sum().backward()
    unscaled = model[0].weight.grad.clone()
    model[0].weight.grad = None
    opt.backward(model[1](model[0](x).half()).float().sum())
    g = model[0].weight.grad.clone()  # fp32 params are their own masters: unscaled in place
    torch.testing.assert_close(g, unscaled)
    opt.step()
    torch.testing.assert_close(model[0].weight.detach(), w0 - 0.5 * g)
    assert frozen.grad is None
    grads = opt.inspect_master_grad_data()
    assert len(grads) == 1 and len(grads[0]) == len(opt.optimizer.param_groups[0]["params"])


def test_clip_master_grads_and_zero_grad():
    model = _half_model()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    opt.backward(model(torch.randn(4, 6).half()).float().sum())
    masters = opt.fp32_from_fp16_groups[0]
    ref = torch.linalg.vector_norm(torch.cat([m.grad.reshape(-1) for m in masters]))
    norm = opt.clip_master_grads(0.5)
    torch.testing.assert_close(norm, ref)
    clipped = torch.linalg.vector_norm(torch.cat([m.grad.reshape(-1) for m in masters]))
    assert clipped.item() == pytest.approx(0.5, rel=1e-4)
    opt.zero_grad()
    assert all(float(m.grad.abs().sum()) == 0 for m in masters)
    assert all(float(p.grad.abs().sum()) == 0 for p in model.parameters())
    opt.zero_grad(set_grads_to_None=True)
    assert all(m.grad is None for m in masters) and all(p.grad is None for p in model.parameters())


def test_accumulate_then_update_master_grads():
    model = _half_model()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=2.0, verbose=False)
    x1, x2 = torch.randn(4, 6).half(), torch.randn(4, 6).half()
    opt.backward(model(x1).float().sum(), update_master_grads=False)
    opt.backward(model(x2).float().sum(), update_master_grads=False)
    assert all(m.grad is None for m in opt.fp32_from_fp16_groups[0])
    opt.update_master_grads()
    for p, m in zip(model.parameters(), opt.fp32_from_fp16_groups[0]):
        torch.testing.assert_close(m.grad, p.grad.float() / 2.0)


def test_optimizer_state_moves_to_masters():
    model = _half_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = FP16_Optimizer(inner, verbose=False)
    for _ in range(2):
        opt.zero_grad()
        opt.backward(model(torch.randn(4, 6).half()).float().sum())
        opt.step()
    assert set(inner.state) == set(opt.fp32_from_fp16_groups[0])
    assert all(s["momentum_buffer"].dtype == torch.float32 for s in inner.state.values())
    assert opt.state is inner.state and opt.param_groups is inner.param_groups


def test_step_with_closure():
    model = _half_model()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 2.0**4}, verbose=False)
    x = torch.randn(4, 6).half()
    calls = []

    def closure():
        opt.zero_grad()
        loss = model(x).float().sum()
        opt.backward(loss)
        if not calls:  # the first evaluation overflows: the closure is re-run at a lower scale
            next(model.parameters()).grad[0, 0] = float("nan")
            opt.update_master_grads()
        calls.append(opt.loss_scale)
        return loss

    opt.step(closure)
    assert calls == [2.0**4, 2.0**3] and opt.first_closure_call_this_step


def test_state_dict_roundtrip_through_weights_only_load():
    model = _half_model()
    args = {"init_scale": 2.0**8}
    opt = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), dynamic_loss_scale=True,
                         dynamic_loss_args=args, verbose=False)
    for _ in range(2):
        opt.zero_grad()
        opt.backward(model(torch.randn(4, 6).half()).float().sum())
        opt.step()
    assert opt.optimizer.state
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2 = _half_model()
    opt2 = FP16_Optimizer(torch.optim.Adam(model2.parameters(), lr=1e-2), dynamic_loss_scale=True, verbose=False)
    opt2.load_state_dict(saved)
    assert opt2.loss_scale == opt.loss_scale and opt2.loss_scaler.cur_iter == opt.loss_scaler.cur_iter
    for a, b in zip(opt.fp32_from_fp16_groups[0], opt2.fp32_from_fp16_groups[0]):
        assert torch.equal(a, b)
    st1, st2 = opt.optimizer.state_dict()["state"], opt2.optimizer.state_dict()["state"]
    assert torch.equal(st1[0]["exp_avg"], st2[0]["exp_avg"])


def test_load_state_dict_mismatch_changes_nothing():
    model = _half_model()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    sd = opt.state_dict()
    sd["fp32_from_fp16"][0] = sd["fp32_from_fp16"][0][:-1]
    scale = opt.loss_scale
    with pytest.raises(ValueError, match="group 0"):
        opt.load_state_dict(sd)
    with pytest.raises(KeyError, match="loss_scaler"):
        opt.load_state_dict({"overflow": False})
    assert opt.loss_scale == scale


def test_loss_scale_setter_and_bad_arguments():
    model = _half_model()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=8.0, verbose=False)
    opt.loss_scale = 16.0
    assert opt.loss_scaler.loss_scale == 16.0
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        FP16_Optimizer(model)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        FP16_Optimizer(torch.optim.SGD([nn.Parameter(torch.zeros(2, dtype=torch.float64))], lr=0.1))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    before = list(inner.param_groups[0]["params"])
    with pytest.raises(TypeError):
        FP16_Optimizer(inner, dynamic_loss_scale=True, dynamic_loss_args={"bogus": 1})
    assert inner.param_groups[0]["params"] == before  # nothing replaced


def test_lazy_submodule_access():
    for name in apex._SUBMODULES:
        assert hasattr(apex, name), name
    assert not hasattr(apex, "no_such_module")
    assert apex.fp16_utils.FP16_Optimizer is FP16_Optimizer
    # dir() after some submodules were imported (they are module globals then too): each name once, and the
    # public names are the submodules and NVIDIA's top-level helpers
    names = dir(apex)
    assert len(names) == len(set(names))
    assert [n for n in names if not n.startswith("_")] == sorted(apex._SUBMODULES + apex._HELPERS)


def test_wraps_apex_fused_optimizers_like_torch_ones():
    # Our combined-buffer optimizers keep grads as views of one buffer: zero_grad and the master swap must cope.
    from apex.optimizers import FusedAdam

    results = []
    for make in (lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
                 lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)):
        model = _half_model()
        opt = FP16_Optimizer(make(model.parameters()), dynamic_loss_scale=True,
                             dynamic_loss_args={"init_scale": 2.0**8}, verbose=False)
        torch.manual_seed(3)
        for _ in range(3):
            opt.zero_grad()
            opt.backward(model(torch.randn(4, 6).half()).float().pow(2).mean())
            opt.step()
        opt.load_state_dict(opt.state_dict())
        results.append([m.detach().clone() for m in opt.fp32_from_fp16_groups[0]])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- bad input leaves nothing changed
@pytest.mark.parametrize("bad, error", [
    ({"cur_scale": 8.0, "cur_iter": "x", "last_overflow_iter": 0}, TypeError),
    ({"cur_scale": 8.0, "cur_iter": 1, "last_overflow_iter": None}, TypeError),
    ({"cur_scale": 8.0, "cur_iter": -1, "last_overflow_iter": 0}, ValueError),
    ({"cur_scale": 8.0, "cur_iter": 1, "last_overflow_iter": 0, "scale_window": 0}, ValueError),
    ({"cur_scale": 8.0, "cur_iter": 1, "last_overflow_iter": 0, "scale_factor": "x"}, TypeError),
    ({"cur_scale": 8.0, "cur_iter": 1, "last_overflow_iter": 0, "scale_factor": 1.0}, ValueError),
    ({"cur_scale": 8.0}, KeyError),
    ([8.0], TypeError),
])
def test_dynamic_scaler_load_state_dict_checks_every_field_first(bad, error):
    s = DynamicLossScaler(init_scale=4.0)
    before = s.state_dict()
    with pytest.raises(error, match=r"DynamicLossScaler\.load_state_dict"):
        s.load_state_dict(bad)
    assert s.state_dict() == before
    s.load_state_dict({"cur_scale": 8.0, "cur_iter": 3, "last_overflow_iter": 1, "scale_window": 2})
    assert (s.cur_scale, s.cur_iter, s.last_overflow_iter, s.scale_window) == (8.0, 3, 1, 2)


def test_static_scaler_load_state_dict_names_the_missing_key():
    with pytest.raises(KeyError, match=r"LossScaler.load_state_dict: the state lacks \['cur_scale'\]"):
        LossScaler().load_state_dict({})
    with pytest.raises(TypeError, match="one-element tensor or a non-empty sequence"):
        to_python_float([])


def test_param_copies_check_every_pair_before_copying():
    a, b = torch.zeros(3, dtype=torch.half), torch.zeros(2, dtype=torch.half)
    with pytest.raises(ValueError, match="param 1: the source is a meta tensor"):
        master_params_to_model_params([a, b], [torch.ones(3), torch.ones(2, device="meta")])
    assert not a.any()  # the first pair was not copied
    with torch.inference_mode():
        frozen = torch.zeros(2, dtype=torch.half)
    with pytest.raises(RuntimeError, match="param 1: the destination is an inference tensor"):
        master_params_to_model_params([a, frozen], [torch.ones(3), torch.ones(2)])
    assert not a.any()
    with pytest.raises(TypeError, match="model param 0 must be a tensor, got NoneType"):
        master_params_to_model_params([None], [torch.ones(3)])
    with pytest.raises(TypeError, match="model param 0 must be a tensor, got NoneType"):
        model_grads_to_master_grads([None], [torch.ones(3)], flat_master=True)
    model = [nn.Parameter(torch.zeros(3, dtype=torch.half)),
             nn.Parameter(torch.zeros(2, dtype=torch.half, device="meta"))]
    model[0].grad, model[1].grad = torch.ones(3, dtype=torch.half), torch.ones(2, dtype=torch.half, device="meta")
    masters = [torch.zeros(3), torch.zeros(2)]
    with pytest.raises(ValueError, match="param 1: the source is a meta tensor"):
        model_grads_to_master_grads(model, masters)
    assert masters[0].grad is None


def test_load_state_dict_with_bad_masters_or_flags_changes_nothing():
    model = _half_model()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 2.0**4}, verbose=False)
    opt.backward(model(torch.randn(4, 6).half()).float().sum())
    opt.step()
    before = opt.state_dict()
    other = FP16_Optimizer(torch.optim.SGD(_half_model().parameters(), lr=0.1, momentum=0.9),
                           dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 4.0}, verbose=False)
    good = other.state_dict()
    cases = []
    meta = dict(good, fp32_from_fp16=[[m.to("meta") for m in g] for g in good["fp32_from_fp16"]])
    cases.append((meta, TypeError, "meta tensor"))
    cases.append((dict(good, fp32_from_fp16=[[m.numpy() for m in g] for g in good["fp32_from_fp16"]]), TypeError,
                   "ndarray"))
    cases.append((dict(good, first_closure_call_this_step=torch.ones(2)), TypeError, "with 2 elements"))
    cases.append((dict(good, overflow="no"), TypeError, "overflow must be a bool"))
    for bad, error, match in cases:
        with pytest.raises(error, match=match):
            opt.load_state_dict(bad)
        now = opt.state_dict()
        assert now["loss_scaler"] == before["loss_scaler"] and now["overflow"] == before["overflow"]
        st_now, st_before = now["optimizer_state_dict"]["state"], before["optimizer_state_dict"]["state"]
        assert st_now.keys() == st_before.keys() and st_before
        assert all(torch.equal(st_now[k]["momentum_buffer"], st_before[k]["momentum_buffer"]) for k in st_now)
        for g_now, g_before in zip(now["fp32_from_fp16"], before["fp32_from_fp16"]):
            assert all(torch.equal(x, y) for x, y in zip(g_now, g_before))


def test_step_whose_closure_raises_leaves_the_scaler_as_it_was():
    model = _half_model()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    before = opt.loss_scaler.state_dict()

    def closure():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        opt.step(closure)
    assert opt.loss_scaler.state_dict() == before
    with pytest.raises(ValueError, match="loss_scale must be a finite number > 0"):
        opt.loss_scale = 0
    assert opt.loss_scaler.state_dict() == before


@pytest.mark.parametrize("loss", ["x", [1.0, 2.0], 3.0, None])
@pytest.mark.parametrize("make", [lambda: apex.fp16_utils.LossScaler(4), lambda: apex.fp16_utils.DynamicLossScaler()])
def test_loss_scaler_backward_needs_a_tensor(make, loss):
    """A str or list times the scale would be repeated (a 4 GiB string for 2**32), not scaled: refused first."""
    scaler = make()
    with pytest.raises(TypeError, match="loss must be a tensor"):
        scaler.backward(loss)


def test_loss_scaler_takes_integers_beyond_int64_as_floats():
    scaler = apex.fp16_utils.LossScaler(2**64 + 5)
    assert scaler.loss_scale == float(2**64)
    x = torch.ones(2, requires_grad=True)
    scaler.backward(x.sum())
    assert torch.equal(x.grad, torch.full((2,), float(2**64)))
    with pytest.raises(ValueError, match="finite number > 0"):
        apex.fp16_utils.LossScaler(10**400)


def test_clip_master_grads_names_a_bad_max_norm():
    model = nn.Linear(2, 2).half()
    opt = apex.fp16_utils.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=1.0), verbose=False)
    for value in ("x", None, [1.0]):
        with pytest.raises(TypeError, match="max_norm must be a number"):
            opt.clip_master_grads(value)
    with pytest.raises(TypeError, match="norm_type must be a number"):
        opt.clip_master_grads(1.0, norm_type="2")


# ---------------------------------------------------------------- sparse tensors, flat masters: refused before any copy
class _SparseEmbeddingModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.emb = nn.Embedding(5, 3, sparse=True)

    def forward(self, i):
        return self.lin(self.emb(i)).sum()


@pytest.mark.parametrize("flat_master", [False, True])
@pytest.mark.parametrize("grads_before", [False, True])
def test_a_sparse_model_grad_is_refused_before_any_master_grad_changes(flat_master, grads_before):
    model = _SparseEmbeddingModel()
    model_params, masters = prep_param_lists(model, flat_master=flat_master)
    model(torch.tensor([1, 2])).backward()
    if not grads_before:
        for m in masters:
            m.grad = None
    before = [None if m.grad is None else m.grad.clone() for m in masters]
    with pytest.raises(TypeError, match=r"model_grads_to_master_grads: param 2: the model grad must be a dense "
                                        r"\(strided\) tensor, got layout torch.sparse_coo \(a sparse grad"):
        model_grads_to_master_grads(model_params, masters, flat_master=flat_master)
    for m, b in zip(masters, before):
        assert (m.grad is None) if b is None else torch.equal(m.grad, b)


@pytest.mark.parametrize("which", ["master", "model"])
def test_a_sparse_param_is_refused_before_any_model_param_is_written(which):
    models, masters = [torch.zeros(3), torch.zeros(3)], [torch.ones(3), torch.ones(3)]
    (masters if which == "master" else models)[1] = torch.ones(3).to_sparse()
    with pytest.raises(TypeError, match=rf"master_params_to_model_params: {which} param 1 must be a dense "
                                        r"\(strided\) tensor, got layout torch.sparse_coo"):
        master_params_to_model_params(models, masters)
    assert not models[0].any()
    with pytest.raises(TypeError, match=rf"model_grads_to_master_grads: {which} param 1 must be a dense"):
        model_grads_to_master_grads(models, masters)
    assert masters[0].grad is None


@pytest.mark.parametrize("shape", [(5, 1), (1, 5), (4,)])
def test_a_flat_master_must_be_one_dimensional_with_every_element(shape):
    ps = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    for p in ps:
        p.grad = torch.ones_like(p)
    master = torch.ones(shape, requires_grad=True)
    match = "the flat master must be 1-D with the model params' 5 elements, got shape " + re.escape(str(shape))
    with pytest.raises(ValueError, match="model_grads_to_master_grads: " + match):
        model_grads_to_master_grads(ps, [master], flat_master=True)
    assert master.grad is None
    with pytest.raises(ValueError, match="master_params_to_model_params: " + match):
        master_params_to_model_params(ps, [master], flat_master=True)
    assert not any(p.any() for p in ps)


def test_fp16_optimizer_checks_every_group_before_copying_any_grad():
    first, second = nn.Linear(3, 3).half(), nn.Embedding(5, 3, sparse=True).half()
    opt = FP16_Optimizer(torch.optim.SGD([{"params": first.parameters()}, {"params": second.parameters()}], lr=0.1),
                         static_loss_scale=1.0, verbose=False)
    for p in first.parameters():
        p.grad = torch.ones_like(p)
    second.weight.grad = torch.ones(5, 3, dtype=torch.half).to_sparse()
    masters = opt.fp32_from_fp16_groups[0]
    before = [None if m.grad is None else m.grad.clone() for m in masters]
    with pytest.raises(TypeError, match=r"FP16_Optimizer: model_grads_to_master_grads: param 0: the model grad must "
                                        r"be a dense"):
        opt.update_master_grads()
    for m, b in zip(masters, before):
        assert (m.grad is None) if b is None else torch.equal(m.grad, b)
