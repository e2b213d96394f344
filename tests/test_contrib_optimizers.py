"""apex.contrib.optimizers: NVIDIA's older FusedAdam (against a float64 reference of its kernel's math),
FP16_Optimizer around it (loss scaling, skips, masters, checkpoints) and FusedLAMB (apex.optimizers.FusedLAMB's
math)."""

from __future__ import annotations

import io
import math

import pytest
import torch

import apex.optimizers as O
from apex.contrib.optimizers import FP16_Optimizer, FusedAdam, FusedLAMB


def _reference(params, grads_per_step, *, lr, betas, eps, weight_decay, bias_correction, eps_inside_sqrt,
               max_grad_norm=0.0, scale=1.0):
    """float64: the per-element math of NVIDIA's fused_adam kernel with its combined scale (one group)."""
    b1, b2 = betas
    p = [x.double().clone() for x in params]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    for t, grads in enumerate(grads_per_step, start=1):
        combined = scale
        if max_grad_norm > 0:
            norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
            clip = (norm / scale + 1e-6) / max_grad_norm
            if clip > 1:
                combined = clip * scale
        step_size = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) if bias_correction else lr
        for i, g in enumerate(grads):
            g = g.double() / combined
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            denom = (v[i] + eps).sqrt() if eps_inside_sqrt else v[i].sqrt() + eps
            p[i] = p[i] - step_size * (m[i] / denom + weight_decay * p[i])
    return p


def _grads(shapes, steps, seed=0, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(s, generator=g) * scale).to(dtype) for s in shapes] for _ in range(steps)]


SHAPES = [(7, 5), (33,), (1,), (0,), (64, 3)]


@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_fused_adam_matches_its_kernel_math(eps_inside_sqrt, bias_correction, weight_decay, max_grad_norm):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=weight_decay, bias_correction=bias_correction)
    ref = _reference(params, _grads(SHAPES, 4), eps_inside_sqrt=eps_inside_sqrt, max_grad_norm=max_grad_norm, **kw)
    opt = FusedAdam(params, eps_inside_sqrt=eps_inside_sqrt, max_grad_norm=max_grad_norm, **kw)
    assert opt.eps_mode == (0 if eps_inside_sqrt else 1)
    for grads in _grads(SHAPES, 4):
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.double(), r, rtol=2e-6, atol=2e-7)
    assert opt.state[params[0]]["step"] == 4


def test_fused_adam_flat_grads_scale_norms_and_output_params():
    """FP16_Optimizer's call: fp16 grads carrying a scale, the scaled norm given, fp16 copies written out."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    scale = 1024.0
    steps = _grads(SHAPES, 3, scale=scale, dtype=torch.float16)
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, bias_correction=False)
    ref = _reference(params, steps, eps_inside_sqrt=False, max_grad_norm=1.0, scale=scale, **kw)
    opt = FusedAdam(params, max_grad_norm=1.0, **kw)
    outs = [torch.empty(s, dtype=torch.float16) for s in SHAPES]
    for grads in steps:
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))  # of the scaled grads
        opt.step(grads=grads, output_params=outs, scale=scale, grad_norms=[norm])
    for p, r, out in zip(params, ref, outs):
        torch.testing.assert_close(p.double(), r, rtol=2e-6, atol=2e-7)
        assert torch.equal(out, p.detach().half())
        assert p.grad is None


def test_fused_adam_refuses_bad_input_before_changing_anything():
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))]
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(params, amsgrad=True)
    with pytest.raises(ValueError, match="learning rate"):
        FusedAdam(params, lr=-1.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        FusedAdam(params, max_grad_norm=-1.0)
    opt = FusedAdam(params)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="group 0 has 2 params, got 1 grads"):
        opt.step(grads=[torch.randn(3)])
    with pytest.raises(ValueError, match="param 1 of group 0 has shape"):
        opt.step(grads=[torch.randn(3), torch.randn(5)])
    with pytest.raises(ValueError, match="scale"):
        opt.step(grads=[torch.randn(3), torch.randn(4)], scale=0.0)
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step(grads=[torch.randn(3), torch.randn(4).to_sparse()])
    assert all(torch.equal(a, b) for a, b in zip(params, before)) and not opt.state


def _fp16_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).half()


def _bert_style(model, **fp16_kw):
    """The old BERT fine-tuning scripts' construction: two groups, no decay for biases."""
    groups = [{"params": [p for n, p in model.named_parameters() if "bias" not in n], "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if "bias" in n], "weight_decay": 0.0}]
    opt = FusedAdam(groups, lr=1e-2, bias_correction=False, max_grad_norm=1.0)
    return FP16_Optimizer(opt, verbose=False, **fp16_kw)


def _train(model, opt, start, stop, poison=()):
    for i in range(start, stop):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 8, generator=g).half(), torch.randn(16, 2, generator=g)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if i in poison:
            loss = loss * float("inf")
        opt.backward(loss)
        for group in opt.param_groups:  # the scripts set the learning rate this way
            group["lr"] = 1e-2 * (1 - i / 100)
        opt.step()
        opt.zero_grad()


def test_fp16_optimizer_steps_masters_and_writes_the_model():
    model = _fp16_model()
    opt = _bert_style(model, dynamic_loss_scale=True)
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    before = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, 0, 3)
    for group, fp16 in zip(opt.fp32_groups, opt.fp16_groups):
        for master, model_param in zip(group, fp16):
            assert model_param.dtype == torch.float16 and torch.equal(master.half(), model_param)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.cur_scale == 2.0 ** 16 and opt.cur_iter == 3


def test_fp16_optimizer_matches_fused_adam_driven_by_hand():
    model, hand_model = _fp16_model(), _fp16_model()
    opt = _bert_style(model, static_loss_scale=128.0)
    groups = [{"params": [p.detach().clone().float() for n, p in hand_model.named_parameters() if "bias" not in n],
               "weight_decay": 0.01},
              {"params": [p.detach().clone().float() for n, p in hand_model.named_parameters() if "bias" in n],
               "weight_decay": 0.0}]
    hand = FusedAdam(groups, lr=1e-2, bias_correction=False, max_grad_norm=1.0)
    fp16_groups = [[p for n, p in hand_model.named_parameters() if "bias" not in n],
                   [p for n, p in hand_model.named_parameters() if "bias" in n]]
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 8, generator=g).half(), torch.randn(16, 2, generator=g)
        for m in (model, hand_model):
            (torch.nn.functional.mse_loss(m(x).float(), y) * 128.0).backward()
        grads = [[p.grad for p in group] for group in fp16_groups]
        norms = [float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g_, dtype=torch.float32)
                                                            for g_ in gs]))) for gs in grads]
        hand.step(grads=grads, output_params=fp16_groups, scale=128.0, grad_norms=norms)
        opt.step()
        for m in (model, hand_model):
            m.zero_grad()
    for a, b in zip(model.parameters(), hand_model.parameters()):
        assert torch.equal(a, b)


def test_fp16_optimizer_skips_overflow_and_moves_the_scale():
    model = _fp16_model()
    opt = _bert_style(model, dynamic_loss_scale=True, dynamic_loss_args={"scale_window": 2})
    _train(model, opt, 0, 1)
    masters = [p.detach().clone() for g in opt.fp32_groups for p in g]
    _train(model, opt, 1, 2, poison={1})
    assert all(torch.equal(a, b) for a, b in zip(masters, [p for g in opt.fp32_groups for p in g]))
    assert opt.cur_scale == 2.0 ** 15  # halved at the overflow ((0 + 1) % 2: no growth at iteration 0)
    assert opt.last_overflow_iter == 1 and opt.cur_iter == 2
    _train(model, opt, 2, 4)
    assert opt.cur_scale == 2.0 ** 16  # (cur_iter - last_overflow) % 2 == 0 at iteration 3


def test_fp16_optimizer_checkpoint_resumes_bit_for_bit():
    model = _fp16_model()
    opt = _bert_style(model, dynamic_loss_scale=True)
    _train(model, opt, 0, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    _train(model, opt, 3, 6)
    expected = [p.detach().clone() for p in model.parameters()]
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    model2 = _fp16_model(seed=5)
    model2.load_state_dict(ck["model"])
    opt2 = _bert_style(model2, dynamic_loss_scale=True)
    opt2.load_state_dict(ck["optimizer"])
    _train(model2, opt2, 3, 6)
    for a, b in zip(model2.parameters(), expected):
        assert torch.equal(a, b)


def test_fp16_optimizer_refuses_what_it_cannot_drive():
    model = _fp16_model()
    with pytest.raises(TypeError, match="grads, output_params"):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="dynamic_loss_args"):
        _bert_style(model, dynamic_loss_scale=True, dynamic_loss_args={"growth": 2})
    with pytest.raises(ValueError, match="static_loss_scale"):
        _bert_style(model, static_loss_scale=0)
    opt = _bert_style(model)
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(TypeError, match="loss must be a tensor"):
        opt.backward(1.0)
    sd = opt.state_dict()
    sd["fp32_groups"] = [g[:-1] for g in sd["fp32_groups"]]
    scale = opt.cur_scale
    with pytest.raises(ValueError, match="fp32_groups"):
        opt.load_state_dict(sd)
    assert opt.cur_scale == scale


def test_fused_lamb_is_the_main_fused_lamb_without_nvlamb():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    oa, ob = FusedLAMB(a, lr=1e-2, weight_decay=0.01), O.FusedLAMB(b, lr=1e-2, weight_decay=0.01, use_nvlamb=False)
    for grads in _grads(SHAPES, 3):
        for ps, opt in ((a, oa), (b, ob)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ---------------------------------------------------------------- bad input: clear errors, nothing changed


def _snapshot(opt, params):
    """Everything a rejected call must leave as it was: params, per-param state, param groups (copies)."""
    import copy

    return copy.deepcopy(([p.detach() for p in params], {id(p): st for p, st in opt.state.items()},
                          [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _unchanged(opt, params, snap):
    return _same(_snapshot(opt, params), snap)


def _two_groups(**kw):
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))
    opt = FusedAdam([{"params": [a]}, {"params": [b]}], lr=1e-2, max_grad_norm=1.0, **kw)
    a.grad, b.grad = torch.randn(3), torch.randn(4)
    opt.step()
    a.grad, b.grad = torch.randn(3), torch.randn(4)
    return opt, [a, b]


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64, torch.bool])
def test_fused_adam_refuses_params_it_cannot_update(dtype):
    bad = torch.zeros(3, dtype=dtype)
    with pytest.raises(TypeError, match="complex" if dtype.is_complex else "floating point"):
        FusedAdam([bad])
    opt, params = _two_groups()
    snap = _snapshot(opt, params)
    with pytest.raises(TypeError, match="param 0"):
        opt.add_param_group({"params": [bad]})
    assert len(opt.param_groups) == 2 and _unchanged(opt, params, snap)


@pytest.mark.parametrize("grad,exc,fragment", [
    (torch.zeros(4, dtype=torch.complex64), TypeError, "grad of param 0 of group 1 has dtype torch.complex64"),
    (torch.zeros(4, dtype=torch.int32), TypeError, "grad of param 0 of group 1 has dtype torch.int32"),
    (torch.zeros(4, device="meta"), ValueError, "meta tensor"),
    ("x", TypeError, "grad of param 0 of group 1 is str"),
])
def test_fused_adam_refuses_bad_flat_grads_before_any_update(grad, exc, fragment):
    opt, params = _two_groups()
    snap = _snapshot(opt, params)
    with pytest.raises(exc, match=fragment):
        opt.step(grads=[[torch.randn(3)], [grad]])
    assert _unchanged(opt, params, snap)


def _set_state(key, value):
    def mutate(opt, params):
        opt.state[params[1]][key] = value
    return mutate


def _set_group(key, value):
    def mutate(opt, params):
        opt.param_groups[1][key] = value
    return mutate


@pytest.mark.parametrize("kwargs,mutate,exc,fragment", [
    (dict(output_params=[[torch.empty(3)], [torch.zeros(1).expand(4)]]), None, ValueError,
     "output param 0 of group 1 repeats memory"),
    (dict(output_params=[[torch.empty(3)], [torch.empty(5)]]), None, ValueError,
     r"output param 0 of group 1 has shape \(5,\)"),
    (dict(output_params=[[torch.empty(3)], [torch.empty(4, dtype=torch.int64)]]), None, TypeError,
     "output param 0 of group 1 must be a real floating point tensor"),
    (dict(output_params=[[torch.empty(3)], ["out"]]), None, TypeError, "output param 0 of group 1 must be a tensor"),
    (dict(output_params=[[torch.empty(3)], 5]), None, TypeError, "output_params for group 1 must be a list"),
    (dict(grad_norms=[1.0, "x"]), None, TypeError, r"grad_norms\[1\]"),
    (dict(grad_norms=[1.0, -2.0]), None, ValueError, r"grad_norms\[1\]"),
    (dict(grad_norms=[1.0, float("nan")]), None, ValueError, r"grad_norms\[1\]"),
    (dict(grad_norms=1.0), None, TypeError, "grad_norms must be a list of one norm per param group"),
    (dict(grad_norms=[1.0]), None, ValueError, "grad_norms has 1 entries, the optimizer has 2 groups"),
    ({}, _set_state("exp_avg", torch.zeros(7)), ValueError, "state of param 0 in group 1: 'exp_avg'"),
    ({}, _set_state("exp_avg_sq", torch.zeros(4, dtype=torch.int64)), ValueError, "'exp_avg_sq'"),
    ({}, _set_state("step", "three"), TypeError, "'step'"),
    ({}, _set_state("step", -1), ValueError, "'step'"),
    ({}, lambda o, ps: o.state.__setitem__(ps[1], 5), TypeError, "expected a dict of state entries"),
    ({}, lambda o, ps: o.state[ps[1]].pop("exp_avg"), ValueError, "'exp_avg'"),
    ({}, _set_group("bias_correction", torch.tensor([1, 0])), TypeError, "param group 1: Invalid bias_correction"),
    ({}, _set_group("lr", -1.0), ValueError, "param group 1: Invalid learning rate"),
    ({}, _set_group("max_grad_norm", "big"), TypeError, "param group 1: Invalid max_grad_norm"),
    ({}, _set_group("amsgrad", True), ValueError, "param group 1: FusedAdam does not support the AMSGrad"),
    ({}, _set_group("maximize", True), ValueError, "param group 1: FusedAdam does not implement maximize"),
    ({}, lambda o, ps: o.param_groups[1].pop("eps"), KeyError, "FusedAdam: param group 1 has no 'eps'"),
    ({}, lambda o, ps: o.param_groups[1]["params"].append(torch.zeros(2, dtype=torch.complex64)), TypeError,
     "complex"),
])
def test_fused_adam_step_checks_everything_before_the_first_update(kwargs, mutate, exc, fragment):
    opt, params = _two_groups()
    if mutate is not None:
        mutate(opt, params)
    snap = _snapshot(opt, params)
    with pytest.raises(exc, match=fragment):
        opt.step(**kwargs)
    assert _unchanged(opt, params, snap)


def test_fused_adam_takes_one_element_tensor_options_and_norms():
    opt, params = _two_groups()
    twin, twin_params = _two_groups()
    opt.param_groups[0]["lr"] = torch.tensor(1e-2)
    opt.step(grad_norms=torch.tensor([2.0, 3.0]))
    twin.step(grad_norms=[2.0, 3.0])
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)


def _corrupt(key, value, where="state"):
    def mutate(sd):
        if where == "state":
            sd["state"][1][key] = value
        else:
            sd["param_groups"][1][key] = value
    return mutate


@pytest.mark.parametrize("mutate,exc,fragment", [
    (_corrupt("exp_avg", torch.zeros(7)), ValueError, r"state of param 0 in param group 1, key 'exp_avg': expected "
                                                      r"shape \(4,\)"),
    (_corrupt("exp_avg", 3.0), TypeError, "'exp_avg'"),
    (_corrupt("step", -2), ValueError, "'step'"),
    (lambda sd: sd["state"][1].pop("exp_avg_sq"), ValueError, "lacks"),
    (lambda sd: sd["state"].__setitem__(1, 5), TypeError, "dict"),
    (_corrupt("lr", -1.0, "group"), ValueError, "param group 1: Invalid learning rate"),
    (_corrupt("max_grad_norm", -1.0, "group"), ValueError, "param group 1: Invalid max_grad_norm"),
    (_corrupt("amsgrad", True, "group"), ValueError, "AMSGrad"),
    (_corrupt("maximize", True, "group"), ValueError, "maximize"),
    (_corrupt("bias_correction", torch.tensor([1, 0]), "group"), TypeError, "bias_correction"),
    (lambda sd: sd["param_groups"].pop(), ValueError, "number of parameter groups"),
])
def test_fused_adam_load_state_dict_is_all_or_nothing(mutate, exc, fragment):
    import copy

    opt, params = _two_groups()
    good = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(good)
    mutate(bad)
    snap = _snapshot(opt, params)
    with pytest.raises(exc, match=fragment):
        opt.load_state_dict(bad)
    assert _unchanged(opt, params, snap)
    opt.step()  # still steps


def test_fused_adam_loads_a_torch_adam_checkpoint_and_fills_missing_options():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4))
    ref = torch.optim.Adam([p], lr=1e-2)
    p.grad = torch.randn(4)
    ref.step()
    sd = ref.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    opt = FusedAdam([q], lr=1e-2, max_grad_norm=1.0)
    del sd["param_groups"][0]["lr"]  # an older checkpoint: the default fills in
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["max_grad_norm"] == 1.0
    assert "differentiable" not in opt.defaults
    q.grad = torch.randn(4)
    opt.step()
    assert int(opt.state[q]["step"]) == 2
    amsgrad = torch.optim.Adam([torch.nn.Parameter(torch.randn(4))], amsgrad=True)
    with pytest.raises(ValueError, match="AMSGrad"):
        opt.load_state_dict(amsgrad.state_dict())


def _dynamic(seed=0):
    model = _fp16_model(seed)
    return model, _bert_style(model, dynamic_loss_scale=True)


@pytest.mark.parametrize("key,value,exc,fragment", [
    ("scale_window", 0, ValueError, "scale_window must be >= 1"),
    ("scale_window", 2.5, TypeError, "scale_window must be an int"),
    ("scale_factor", 0.5, ValueError, "scale_factor must be > 1"),
    ("scale_factor", "x", TypeError, "scale_factor must be a number"),
    ("cur_scale", 0.0, ValueError, "cur_scale must be a finite number > 0"),
    ("cur_iter", "abc", TypeError, "'cur_iter' must be an int"),
    ("cur_iter", -1, ValueError, "'cur_iter' must be >= 0"),
    ("last_overflow_iter", None, TypeError, "'last_overflow_iter' must be an int"),
    ("last_overflow_iter", -2, ValueError, "'last_overflow_iter' must be >= -1"),
    ("dynamic_loss_scale", "yes", TypeError, "'dynamic_loss_scale' must be True or False"),
    ("fp32_groups", None, ValueError, "fp32_groups"),
])
def test_fp16_optimizer_load_checks_every_field_before_loading(key, value, exc, fragment):
    import copy

    trained_model, trained = _dynamic()
    _train(trained_model, trained, 0, 3)
    sd = copy.deepcopy(trained.state_dict())
    sd[key] = value
    _, opt = _dynamic(seed=1)
    fields = {k: getattr(opt, k) for k in ("dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter",
                                            "scale_factor", "scale_window")}
    masters = [p.detach().clone() for g in opt.fp32_groups for p in g]
    with pytest.raises(exc, match=fragment) as info:
        opt.load_state_dict(sd)
    assert "FP16_Optimizer.load_state_dict" in str(info.value)
    assert {k: getattr(opt, k) for k in fields} == fields
    assert len(opt.optimizer.state) == 0  # the wrapped optimizer's state was not loaded
    assert all(torch.equal(a, b) for a, b in zip(masters, [p for g in opt.fp32_groups for p in g]))


def test_fp16_optimizer_load_rejects_a_bad_inner_state_with_nothing_changed():
    import copy

    trained_model, trained = _dynamic()
    _train(trained_model, trained, 0, 3)
    sd = copy.deepcopy(trained.state_dict())
    inner = sd["optimizer_state_dict"]
    inner["state"][0]["exp_avg"] = torch.zeros(7)
    _, opt = _dynamic(seed=1)
    with pytest.raises(ValueError, match="'exp_avg': expected shape"):
        opt.load_state_dict(sd)
    assert opt.cur_iter == 0 and len(opt.optimizer.state) == 0


def test_fp16_optimizer_loads_integral_float_counters():
    import copy

    trained_model, trained = _dynamic()
    _train(trained_model, trained, 0, 3)
    sd = copy.deepcopy(trained.state_dict())
    sd.update(cur_iter=3.0, scale_window=1000.0, last_overflow_iter=-1.0)
    _, opt = _dynamic(seed=1)
    opt.load_state_dict(sd)
    assert (opt.cur_iter, opt.scale_window, opt.last_overflow_iter) == (3, 1000, -1)
    assert all(type(v) is int for v in (opt.cur_iter, opt.scale_window, opt.last_overflow_iter))


def test_fused_adam_copies_keep_the_eps_rule():
    import copy
    import pickle

    for eps_inside_sqrt in (False, True):
        opt, params = _two_groups(eps_inside_sqrt=eps_inside_sqrt)
        for other in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
            assert other.eps_mode == opt.eps_mode
            other_params = [p for g in other.param_groups for p in g["params"]]
            for p, q in zip(params, other_params):
                q.grad = p.grad.clone()
            other.step()
        opt.step()
        for p, q in zip(params, other_params):
            assert torch.equal(p, q)
