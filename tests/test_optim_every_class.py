"""Framework behaviour checked for every one of the ten optimizers.

The per-optimizer files (tests/test_optim_*.py) check each optimizer's math in depth;
most framework behaviour (sharing checks, add_param_group, closures, loaded torch
options, ...) is proven there through NpuFusedAdam only. Here the same behaviours
are checked for every optimizer, so a subclass that overrides
``step`` or the state layout cannot silently fall out of them:

* which executor ran: the apex_C kernel on CPU for fp32, bf16 and fp16 (spied at the
  extension, not only ``last_executor``), agreeing with the torch executor;
* complex / integer / sparse inputs: a clear error and nothing changed;
* closures: called once with grad enabled (also when step() runs under no_grad), the
  loss returned, the update uses the closure's grads;
* a torch state_dict that sets maximize / capturable / differentiable: rejected, state
  unchanged; foreach / fused (executor choices) are accepted;
* ``add_param_group`` after steps equals a group that was there from the start with no
  grads until then;
* the re-combine counter stays at 1 over 30 undisturbed steps (storage identity of params,
  grads and every state entry) and rises by exactly one per breaking action, with a
  result bit-identical to a twin that made the same change in place;
* under amp (O1 and O2 with combine_grad) every fused optimizer gives what it gives
  without amp on the same mixed-precision grads.

``Lamb`` is the non-fused per-tensor reference of the Ascend patch (a plain torch.optim.Optimizer):
it has no combined buffers and no executor; it is held to the error/closure/param-group
bullets only.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _optim_harness import assert_shared, assert_unchanged, check_sparse_grad_rejected, snapshot

from apex import _core, amp
from apex.optimizers import (
    CombinedOptimizer,
    Lamb,
    NpuFusedAdadelta,
    NpuFusedAdam,
    NpuFusedAdamP,
    NpuFusedAdamW,
    NpuFusedBertAdam,
    NpuFusedLamb,
    NpuFusedRMSprop,
    NpuFusedRMSpropTF,
    NpuFusedSGD,
)

# name -> (class, hyperparameters exercising the optional paths, torch.optim equivalent, kernel entry point)
SPECS = {
    "sgd": (NpuFusedSGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True), torch.optim.SGD,
            "_raw_sgd_step"),
    "adam": (NpuFusedAdam, dict(lr=0.01, weight_decay=0.01, amsgrad=True), torch.optim.Adam, "_raw_adam_step"),
    "adamw": (NpuFusedAdamW, dict(lr=0.01, weight_decay=0.05), torch.optim.AdamW, "_raw_adam_step"),
    "adamp": (NpuFusedAdamP, dict(lr=0.01, weight_decay=0.01, nesterov=True), None, "_raw_adamp_stage_b"),
    "bert_adam": (NpuFusedBertAdam, dict(lr=0.01, warmup=0.1, t_total=100, schedule="warmup_cosine"), None,
                  "_raw_bert_adam_step"),
    "adadelta": (NpuFusedAdadelta, dict(lr=1.0, weight_decay=0.01), torch.optim.Adadelta, "_raw_adadelta_step"),
    "lamb": (NpuFusedLamb, dict(lr=0.01, weight_decay=0.01), None, "_raw_lamb_step"),
    "rmsprop": (NpuFusedRMSprop, dict(lr=0.01, momentum=0.9, centered=True), torch.optim.RMSprop, "_raw_rmsprop_step"),
    "rmsprop_tf": (NpuFusedRMSpropTF, dict(lr=0.01, momentum=0.9), None, "_raw_rmsprop_tf_step"),
}
# fp16 states: eps=1e-8 is 0 in fp16 and tiny second moments flush to zero, so torch.optim itself diverges there;
# an fp16-sized eps (centered RMSprop in fp16: see test_centered_rmsprop_fp16_tiny_second_moment)
FP16_EPS = {"adam": dict(eps=1e-4), "adamw": dict(eps=1e-4), "adamp": dict(eps=1e-4),
            "rmsprop": dict(eps=1e-4, centered=False)}
FUSED = sorted(SPECS)
ALL = [*FUSED, "lamb_ref"]
TORCH_TWINS = sorted(n for n in FUSED if SPECS[n][2] is not None)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

def make_opt(name: str, params, **overrides):
    if name == "lamb_ref":
        return Lamb(params, **dict(dict(lr=0.01, weight_decay=0.01), **overrides))
    cls, hp, _, _ = SPECS[name]
    return cls(params, **dict(hp, **overrides))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(6, 8)
        self.l2 = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def twin_models(name: str, dtype=torch.float32, n: int = 2, **overrides):
    torch.manual_seed(0)
    model = Net().to(dtype)
    models = [model] + [copy.deepcopy(model) for _ in range(n - 1)]
    return models, [make_opt(name, m.parameters(), **overrides) for m in models]


def batch(i: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 + i)).to(dtype)


def backward(model, i: int, dtype=torch.float32):
    loss = model(batch(i, dtype)).float().pow(2).mean()
    loss.backward()
    return loss


def train(model, opt, steps: int, start: int = 0, dtype=torch.float32):
    for i in range(start, start + steps):
        opt.zero_grad(set_to_none=False)
        backward(model, i, dtype)
        opt.step()


def assert_models_equal(a, b, what=""):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.dtype == q.dtype, f"{what} {name}: dtype {p.dtype} != {q.dtype}"
        assert torch.equal(p, q), f"{what} {name}: max diff {(p.double() - q.double()).abs().max().item()}"


class KernelSpy:
    """Stands in for the apex_C module: forwards everything, records the names of the kernels called."""

    def __init__(self, real):
        self._real = real
        self.called = []

    def __getattr__(self, name):
        value = getattr(self._real, name)
        if not callable(value) or isinstance(value, type):
            return value

        def spy(*args, **kwargs):
            self.called.append(name)
            return value(*args, **kwargs)

        return spy


# ------------------------------------------------------------------ executors
@pytest.mark.devices("cpu")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", FUSED)
def test_cpu_runs_the_kernel_for_every_optimizer_and_dtype(name, dtype, monkeypatch):
    """The C++ kernel updates every fused optimizer in fp32/bf16/fp16 on CPU, and agrees with the torch executor.

    Tolerance against the torch executor (same start, 3 steps): fp32 rtol 1e-5 / atol 1e-6 * max|p|; bf16/fp16
    4 ulps of the dtype (both round the same fp32 math; the per-ulp proofs are in tests/test_optim_*.py).
    """
    spy = KernelSpy(_core.ext)
    overrides = FP16_EPS.get(name, {}) if dtype == torch.float16 else {}
    (m, mt), (o, ot) = twin_models(name, dtype, **overrides)
    ot.executor = "torch"
    monkeypatch.setattr(_core, "ext", spy)
    before = [p.detach().clone() for p in m.parameters()]
    for i in range(3):
        for model, opt in ((m, o), (mt, ot)):
            opt.zero_grad(set_to_none=False)
            backward(model, i, dtype)
            n = len(spy.called)
            opt.step()
            if opt is o:
                assert SPECS[name][3] in spy.called[n:], f"kernel {SPECS[name][3]} not called: {spy.called[n:]}"
                assert o.last_executor == "apex_C"
            else:
                assert ot.last_executor == "torch"
    assert all(not torch.equal(p, b) for p, b in zip(m.parameters(), before)), "some param was not updated"
    for (pn, p), q in zip(m.named_parameters(), mt.parameters()):
        assert p.dtype == dtype and torch.isfinite(p).all(), pn
        if dtype == torch.float32:
            atol = 1e-6 * float(q.detach().abs().max())
            torch.testing.assert_close(p, q, rtol=1e-5, atol=atol, msg=lambda s, pn=pn: f"{pn}: {s}")
        else:
            tol = 4 * torch.finfo(dtype).eps * (p.double().abs() + q.double().abs()) / 2
            err = (p.double() - q.double()).abs()
            assert (err <= tol + 1e-30).all(), f"{pn}: kernel vs torch executor beyond 4 ulps ({err.max().item()})"


@pytest.mark.parametrize("executor", ["auto", "torch"])
def test_centered_rmsprop_fp16_tiny_second_moment(executor):
    """fp16 param 1.0, grad 1e-3, centered, eps=1e-4: 0.01 * g**2 = 1e-8 flushes to 0 in fp16 while grad_avg = 1e-5
    does not. torch.optim.RMSprop gives 0.8999 (lr * g / (sqrt(0) + eps) = 0.1); we must stay finite too."""
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    q = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    o = NpuFusedRMSprop([p], lr=0.01, centered=True, eps=1e-4)
    o.executor = executor
    t = torch.optim.RMSprop([q], lr=0.01, centered=True, eps=1e-4, foreach=False)
    p.grad = torch.full((3,), 1e-3, dtype=torch.float16)
    q.grad = p.grad.clone()
    o.step()
    t.step()
    assert torch.isfinite(q).all()
    assert torch.isfinite(p).all(), f"ours {p.tolist()}, torch.optim {q.tolist()}"
    torch.testing.assert_close(p, q, rtol=2e-3, atol=0)


def test_lamb_reference_class_is_not_combined():
    """Lamb is the Ascend patch's non-fused reference: a plain torch.optim.Optimizer, one tensor at a time."""
    assert issubclass(Lamb, torch.optim.Optimizer) and not issubclass(Lamb, CombinedOptimizer)
    assert all(issubclass(SPECS[n][0], CombinedOptimizer) for n in FUSED)


# ------------------------------------------------------------------ clear errors, nothing changed
@pytest.mark.parametrize("name", ALL)
def test_complex_and_integer_params_are_rejected(name):
    """Complex params: torch.optim.Adam/AdamW/SGD/RMSprop optimize them as real pairs; we raise instead (a clear
    TypeError naming view_as_real), at construction, at add_param_group, and at a step after ``p.data = complex``."""
    with pytest.raises(TypeError, match=r"complex.*view_as_real"):
        make_opt(name, [torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])
    with pytest.raises(TypeError, match=r"floating point params; param 0 has dtype torch.int64"):
        make_opt(name, [torch.zeros(3, dtype=torch.int64)])
    (m,), (o,) = twin_models(name, n=1)
    train(m, o, 2)
    params = list(m.parameters())
    snap = snapshot(o, params)
    with pytest.raises(TypeError, match=r"complex.*view_as_real"):
        o.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))]})
    assert_unchanged(o, params, snap)
    # a param turned complex by user code after combining
    o.zero_grad(set_to_none=True)
    backward(m, 5)
    old = m.l2.bias.data
    m.l2.bias.data = torch.complex(old, torch.zeros_like(old))
    m.l2.bias.grad = None
    params_now = list(m.parameters())
    snap = snapshot(o, params_now)
    with pytest.raises(TypeError, match=r"complex.*view_as_real"):
        o.step()
    assert_unchanged(o, params_now, snap)


@pytest.mark.parametrize("name", ALL)
def test_sparse_grad_is_rejected_and_changes_nothing(name):
    """A sparse grad among dense ones: RuntimeError naming the problem, before any param or state is touched."""
    check_sparse_grad_rejected(lambda params: make_opt(name, params), stepped=True, match="sparse")


# ------------------------------------------------------------------ closure
@pytest.mark.parametrize("no_grad", [False, True], ids=["plain", "under-no_grad"])
@pytest.mark.parametrize("name", ALL)
def test_closure_semantics(name, no_grad):
    """As torch.optim: the closure runs once, with grad enabled, before the update; step() returns its loss."""
    (m, mt), (o, ot) = twin_models(name)
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        o.zero_grad(set_to_none=False)
        return backward(m, 0)

    with torch.set_grad_enabled(not no_grad):
        loss = o.step(closure)
    ot.zero_grad(set_to_none=False)
    expected = backward(mt, 0)
    ot.step()
    assert calls == [True]
    assert isinstance(loss, torch.Tensor) and torch.equal(loss, expected)
    assert_models_equal(m, mt, "after closure step")
    assert o.step() is None  # no closure: None, and a second update with the grads left by the closure
    ot.step()
    assert_models_equal(m, mt, "after plain step")


@pytest.mark.parametrize("name", TORCH_TWINS)
def test_closure_loss_matches_torch(name):
    torch.manual_seed(0)
    m = Net()
    mt = copy.deepcopy(m)
    o, ot = make_opt(name, m.parameters()), SPECS[name][2](mt.parameters(), **SPECS[name][1])
    for i in range(3):
        def closure(model=m, opt=o, i=i):
            opt.zero_grad()
            return backward(model, i)

        la = o.step(closure)
        lb = ot.step(lambda i=i: (ot.zero_grad(), backward(mt, i))[1])
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=0)
    for p, q in zip(m.parameters(), mt.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ torch state_dicts with options we lack
@pytest.mark.parametrize("option", ["maximize", "capturable", "differentiable"])
@pytest.mark.parametrize("name", TORCH_TWINS)
def test_torch_state_dict_with_unsupported_option(name, option):
    """A torch.optim checkpoint that turns on an option we do not implement: ValueError, nothing changed, and the
    optimizer keeps training on its intact buffers."""
    torch.manual_seed(0)
    m = Net()
    mt = copy.deepcopy(m)
    o = make_opt(name, m.parameters())
    ot = SPECS[name][2](mt.parameters(), **SPECS[name][1])
    train(m, o, 2)
    train(mt, ot, 2)
    sd = ot.state_dict()
    sd["param_groups"][0][option] = True
    params = list(m.parameters())
    snap = snapshot(o, params)
    with pytest.raises(ValueError, match=f"does not implement {option}=True; expected {option}=False"):
        o.load_state_dict(sd)
    assert_unchanged(o, params, snap)
    train(m, o, 1, start=2)
    assert o.recombine_count == 1 and o.last_executor == "apex_C"


@pytest.mark.parametrize("name", TORCH_TWINS)
def test_torch_state_dict_with_executor_choices_loads(name):
    """foreach / fused pick torch's executor: a checkpoint saved with them on loads, and training continues as torch."""
    torch.manual_seed(0)
    m = Net()
    mt = copy.deepcopy(m)
    cls = SPECS[name][2]
    ot = cls(mt.parameters(), foreach=True, **SPECS[name][1])
    train(mt, ot, 2)
    sd = ot.state_dict()
    sd["param_groups"][0]["fused"] = True
    with torch.no_grad():
        for p, q in zip(m.parameters(), mt.parameters()):
            p.copy_(q)
    o = make_opt(name, m.parameters())
    o.load_state_dict(copy.deepcopy(sd))
    train(m, o, 3, start=2)
    train(mt, ot, 3, start=2)
    for p, q in zip(m.parameters(), mt.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


NVIDIA_CLASSES = ["FusedAdam", "FusedLAMB", "FusedSGD", "FusedNovoGrad", "FusedAdagrad", "FusedMixedPrecisionLamb"]


@pytest.mark.parametrize("name", ALL + NVIDIA_CLASSES)
def test_state_dict_round_trip_keeps_the_group_keys(name):
    """Loading an optimizer's own checkpoint gives back exactly its group keys and defaults: torch's load adds
    "differentiable" to ``defaults``, which NVIDIA's classes do not have, and that must not reach the groups."""
    import apex.optimizers

    m = Net()
    if name in NVIDIA_CLASSES:
        o = getattr(apex.optimizers, name)(m.parameters(), lr=0.01)
    else:
        o = make_opt(name, m.parameters())
    train(m, o, 1)
    keys, defaults = [sorted(g) for g in o.param_groups], sorted(o.defaults)
    for _ in range(2):  # resume code loads twice (NVIDIA's BERT recipe)
        o.load_state_dict(copy.deepcopy(o.state_dict()))
        assert [sorted(g) for g in o.param_groups] == keys
        assert [sorted(g) for g in o.state_dict()["param_groups"]] == keys
        if name != "lamb_ref":  # (a plain torch.optim.Optimizer: torch's own load adds the default there)
            assert sorted(o.defaults) == defaults
    train(m, o, 1)


# ------------------------------------------------------------------ add_param_group after steps
@pytest.mark.parametrize("name", ALL)
def test_add_param_group_after_steps(name):
    """A group added after 4 steps (own lr) trains exactly like a group present from the start whose params had
    no grads for those 4 steps (torch's skip rule); for torch's optimizers also as torch.optim does."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(4, 3), (5,), (3, 2), (2,)]
    p0 = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(8)]

    def fresh():
        return [torch.nn.Parameter(t.clone()) for t in p0]

    late, early = fresh(), fresh()
    o_late = make_opt(name, late[:2])
    o_early = make_opt(name, [{"params": early[:2]}, {"params": early[2:], "lr": 0.03}])
    torch_cls = SPECS[name][2] if name in SPECS else None
    ref = fresh() if torch_cls else None
    o_ref = torch_cls(ref[:2], **SPECS[name][1]) if torch_cls else None
    for step in range(8):
        if step == 4:
            o_late.add_param_group({"params": late[2:], "lr": 0.03})
            if o_ref is not None:
                o_ref.add_param_group({"params": ref[2:], "lr": 0.03})
        for k in range(4):
            g = grads[step][k] if (k < 2 or step >= 4) else None  # the late params get grads once added
            for ps in (late, early, ref):
                if ps is not None:
                    ps[k].grad = None if g is None else g.clone()
        for opt in (o_late, o_early, o_ref):
            if opt is not None:
                opt.step()
        if isinstance(o_late, CombinedOptimizer):
            # fresh grad tensors every step: read where they are (no event) by optimizers that can, else one
            # adoption event each; the group added at step 4 is combined once
            expected = (1 if step < 4 else 2) if o_late._gather_grads else step + 1
            assert o_late.recombine_count == expected
    for k, (a, b) in enumerate(zip(late, early)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda s, k=k: f"param {k}: {s}")
    assert o_late.param_groups[1]["lr"] == 0.03
    if o_ref is not None:
        for k, (a, b) in enumerate(zip(late, ref)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * 3.0, msg=lambda s, k=k: f"vs torch {k}: {s}")
    if isinstance(o_late, CombinedOptimizer):
        assert assert_shared(o_late) == 4 and len(o_late._groups) == 2


# ------------------------------------------------------------------ sharing: counter and healing
@pytest.mark.parametrize("name", FUSED)
def test_thirty_undisturbed_steps_combine_once(name):
    (m,), (o,) = twin_models(name, n=1)
    for step in range(30):
        train(m, o, 1, start=step)
        assert o.recombine_count == 1, f"step {step}: re-combined without a breaking action"
        assert o.last_executor == "apex_C"
    assert assert_shared(o) == 4
    flat_ptrs = [s.flat_p.data_ptr() for c in o._groups.values() for s in c.sets]
    train(m, o, 1, start=30)
    assert [s.flat_p.data_ptr() for c in o._groups.values() for s in c.sets] == flat_ptrs


@pytest.mark.parametrize("name", FUSED)
def test_deepcopy_after_steps_trains_on(name):
    """copy.deepcopy((model, optimizer)) after steps (torch keeps only its own fields in a copy): the copy
    re-combines once and trains bit-identically to the original."""
    (m,), (o,) = twin_models(name, n=1)
    train(m, o, 3)
    m2, o2 = copy.deepcopy((m, o))
    train(m, o, 3, start=3)
    train(m2, o2, 3, start=3)
    assert o2.recombine_count == 1 and o2.last_executor == "apex_C"
    assert_models_equal(m, m2, "deepcopy")


def _break_param_data(model, opt, twin, twin_opt):
    for m, in_place in ((model, False), (twin, True)):
        w = m.l1.weight
        new = w.detach() * 0.5 + 0.1
        if in_place:
            with torch.no_grad():
                w.copy_(new)
        else:
            w.data = new
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad(set_to_none=False)
        backward(m, 7)


def _break_new_grad(model, opt, twin, twin_opt):
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad(set_to_none=False)
        backward(m, 7)
    model.l2.bias.grad = model.l2.bias.grad.clone() * 3.0
    twin.l2.bias.grad.mul_(3.0)


def _break_grad_none_backward(model, opt, twin, twin_opt):
    for o in (opt, twin_opt):
        o.zero_grad(set_to_none=False)
    model.l1.weight.grad = None  # backward creates a fresh tensor for this grad only
    for m in (model, twin):
        backward(m, 7)


BREAKS = {"p.data=new": _break_param_data, "p.grad=new": _break_new_grad,
          "p.grad=None+backward": _break_grad_none_backward}


@pytest.mark.parametrize("how", sorted(BREAKS))
@pytest.mark.parametrize("name", FUSED)
def test_each_breaking_action_recombines_once_and_is_exact(name, how):
    """Healed by exactly one re-combine event (a replaced grad: read where it is, no event, by optimizers that
    can); the result equals, bit for bit, a twin that made the same change in place (sharing intact) — so the
    healed step is neither stale nor different."""
    (m, mt), (o, ot) = twin_models(name)
    train(m, o, 3)
    train(mt, ot, 3)
    BREAKS[how](m, o, mt, ot)
    o.step()
    ot.step()
    events = 1 if how == "p.data=new" or not o._gather_grads else 0
    assert o.recombine_count == 1 + events, "the break must be healed by exactly one re-combine"
    assert ot.recombine_count == 1, "the in-place twin must not re-combine"
    assert_models_equal(m, mt, f"{how}: healed step")
    assert assert_shared(o) == 4
    train(m, o, 3, start=8)
    train(mt, ot, 3, start=8)
    assert o.recombine_count == 1 + events
    assert_models_equal(m, mt, f"{how}: after healing")
    for p, q in zip(m.parameters(), mt.parameters()):
        for n, v in ot.state[q].items():
            assert torch.equal(o.state[p][n], v), n


@pytest.mark.parametrize("name", FUSED)
def test_model_to_dtype_recombines_once(name):
    """model.to(bf16) after steps: one re-combine; the step equals a fresh optimizer loading the state_dict."""
    (m,), (o,) = twin_models(name, n=1)
    train(m, o, 3)
    saved = copy.deepcopy(o.state_dict())
    params = list(m.parameters())
    m.to(torch.bfloat16)
    assert list(m.parameters()) == params
    twin = copy.deepcopy(m)
    twin_opt = make_opt(name, twin.parameters())
    twin_opt.load_state_dict(saved)
    for model, opt in ((m, o), (twin, twin_opt)):
        train(model, opt, 1, start=3, dtype=torch.bfloat16)
    assert o.recombine_count == 2 and o.last_executor == "apex_C"
    assert all(s.dtype == torch.bfloat16 for s in o._groups[0].sets)
    assert assert_shared(o) == 4
    assert_models_equal(m, twin, "model.to(bf16)")
    train(m, o, 2, start=4, dtype=torch.bfloat16)
    assert o.recombine_count == 2


@pytest.fixture
def swap_on_conversion():
    """nn.Module.to(other device) keeps the Parameter objects only with swap_tensors (see test_optim_common)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.parametrize("name", FUSED)
def test_model_to_device_recombines_once(name, swap_on_conversion):
    """model.to(meta) (the other device of a CPU-only machine) after steps: one re-combine, buffers and every
    state entry on the new device; meta tensors have no values, so only the healing is checked."""
    (m,), (o,) = twin_models(name, n=1)
    train(m, o, 3)
    m.to("meta")
    o.zero_grad(set_to_none=False)
    m(batch(3).to("meta")).pow(2).mean().backward()
    o.step()
    assert o.recombine_count == 2
    assert all(s.device.type == "meta" for s in o._groups[0].sets)
    assert assert_shared(o) == 4
    assert all(v.device.type == "meta" for st in o.state.values() for v in st.values() if v.dim())


# ------------------------------------------------------------------ under amp
@pytest.fixture
def amp_session():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    amp.deinitialize()
    torch.set_num_threads(threads)


def _by_hand(name, level, steps, low=torch.bfloat16):
    """What amp must give: the same mixed-precision grads, unscaled, and the optimizer without amp."""
    torch.manual_seed(0)
    model = Net()
    if level == "O1":
        opt = make_opt(name, model.parameters())
        for i in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=low):
                out = model(batch(i))
            out.float().pow(2).mean().backward()
            opt.step()
        return model
    model.to(low)
    masters = [torch.nn.Parameter(p.detach().float()) for p in model.parameters()]
    opt = make_opt(name, masters)
    for i in range(steps):
        for p in model.parameters():
            p.grad = None
        model(batch(i).to(low)).float().pow(2).mean().backward()
        for mp, p in zip(masters, model.parameters()):
            mp.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for mp, p in zip(masters, model.parameters()):
                p.copy_(mp)
    return model


@pytest.mark.parametrize("set_to_none", [False, True], ids=["zero", "set_to_none"])
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("name", FUSED)
def test_every_fused_optimizer_under_amp(name, level, set_to_none, amp_session):
    """combine_grad: the optimizer owns the flat grad buffers amp unscales; the result is the optimizer's own
    result on the same (power-of-two unscaled, hence exact) grads. With zero_grad(set_to_none=False) amp never
    causes a re-combine (under O1 set_to_none=True drops the grads, so each backward's new grads are adopted)."""
    steps = 4
    ref = _by_hand(name, level, steps)
    torch.manual_seed(0)
    m = Net()
    o = make_opt(name, m.parameters())
    m, o = amp.initialize(m, o, opt_level=level, combine_grad=True, verbosity=0)
    for i in range(steps):
        o.zero_grad(set_to_none=set_to_none)
        loss = m(batch(i)).float().pow(2).mean()
        with amp.scale_loss(loss, o) as scaled:
            scaled.backward()
        o.step()
    assert o.last_executor == "apex_C"
    if not set_to_none:
        assert o.recombine_count == 1
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**16, "unskipped": steps}
    assert_models_equal(m, ref, f"{name} under {level}")


@pytest.mark.parametrize("name", FUSED)
def test_generator_in_a_group_dict_keeps_its_params(name):
    """{"params": model.parameters()} (a generator) is read once: the group holds every param, as in torch."""
    cls, hp, _, _ = SPECS[name]
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    o = cls([{"params": m.parameters()}], **hp)
    assert [id(p) for p in o.param_groups[0]["params"]] == [id(p) for p in m.parameters()]
    o.add_param_group({"params": (p for p in torch.nn.Linear(2, 2).parameters())})
    assert len(o.param_groups[1]["params"]) == 2


@pytest.mark.parametrize("name", [*ALL, "FusedAdam", "FusedSGD", "FusedLAMB", "FusedNovoGrad", "FusedAdagrad"])
def test_another_default_device_leaves_the_host_bookkeeping_on_cpu(name):
    """A caller's default device (``torch.set_default_device``, or NVIDIA Apex's old
    ``set_default_tensor_type(torch.cuda.FloatTensor)``) does not reach the optimizers' host tables: with "meta"
    as the default, steps, both zero_grad modes and a state_dict round trip give what they give without it."""
    import apex.optimizers as ao

    def make(params):
        if name.startswith("Fused"):
            return getattr(ao, name)(params, lr=0.01)
        return make_opt(name, params)

    (plain, other), _ = twin_models("sgd")
    opts = [make(m.parameters()) for m in (plain, other)]
    for i in range(3):
        for model, opt, default in ((plain, opts[0], "cpu"), (other, opts[1], "meta")):
            model(batch(i)).square().sum().backward()
            torch.set_default_device(default)
            try:
                opt.step()
                opt.zero_grad(set_to_none=i != 1)
                if i == 2:
                    opt.load_state_dict(opt.state_dict())
            finally:
                torch.set_default_device("cpu")
    for p, q in zip(plain.parameters(), other.parameters()):
        assert torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("name", [*ALL, "FusedAdam", "FusedSGD", "FusedLAMB", "FusedNovoGrad", "FusedAdagrad",
                                  "FusedMixedPrecisionLamb"])
def test_step_called_from_compiled_code_runs_eagerly(name):
    """``torch.compile`` over a function that calls ``opt.step()`` / ``opt.zero_grad()`` (torch's compiled
    optimizer recipe), and over a whole training step: the graph breaks at them and they run as they are, so
    the result has the bits of the eager twin, in both zero_grad modes."""
    import apex.optimizers as ao

    dynamo = pytest.importorskip("torch._dynamo")

    def make(params):
        if name.startswith("Fused"):
            return getattr(ao, name)(params, lr=0.01)
        return make_opt(name, params)

    dynamo.reset()
    try:
        torch.manual_seed(0)
        models = [Net() for _ in range(3)]
        for m in models[1:]:
            m.load_state_dict(models[0].state_dict())
        eager, stepped, whole = [(m, make(m.parameters())) for m in models]

        @torch.compile(backend="eager")
        def compiled_step(opt, set_to_none):
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)

        @torch.compile(backend="eager")
        def compiled_train(model, opt, x, set_to_none):
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)

        for i in range(4):
            set_to_none = i % 2 == 0
            for model, opt in (eager, stepped):
                backward(model, i)
                if opt is eager[1]:
                    opt.step()
                    opt.zero_grad(set_to_none=set_to_none)
                else:
                    compiled_step(opt, set_to_none)
            compiled_train(*whole, batch(i), set_to_none)
        for p, q, r in zip(*(m.parameters() for m, _ in (eager, stepped, whole))):
            assert torch.equal(p, q) and torch.equal(p, r)
    finally:
        dynamo.reset()
