"""The fused-optimizer framework (CombinedOptimizer / FlatSet), exercised through NpuFusedAdam(W).

Covers what every fused optimizer inherits: param groups, add_param_group,
frozen params, torch's missing-grad rule and per-param step counts, zero_grad,
hyperparameter changes, state_dict interchange and compact checkpoints,
detection and healing of sharing broken by user code (one test per way, with
storage identity of params, grads and states and the re-combine counter),
clear errors that change nothing, closures, copies.
"""

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
from _optim_harness import (
    assert_close_rel,
    assert_shared,
    assert_unchanged,
    check_sparse_grad_rejected,
    lr_schedule_hook,
    make_params,
    run_side_by_side,
    snapshot,
)
from test_optim_adam import ADAM, ADAMW, HP

from apex.optimizers import NpuFusedAdadelta, NpuFusedAdam, NpuFusedAdamW

HP_NO_AMS = dict(HP, amsgrad=False)


class Net(torch.nn.Module):
    def __init__(self, conv: bool = False):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3) if conv else None
        self.l1 = torch.nn.Linear(6 if not conv else 4 * 3 * 3, 8)
        self.l2 = torch.nn.Linear(8, 3)

    def forward(self, x):
        if self.conv is not None:
            x = self.conv(x).flatten(1)
        return self.l2(torch.tanh(self.l1(x)))


def twins(conv: bool = False, ours_cls=NpuFusedAdam, hp=HP_NO_AMS, device="cpu"):
    """(our model, our optimizer, torch model, torch optimizer, input) with identical initial values."""
    torch.manual_seed(0)
    model = Net(conv).to(device)
    ref_model = copy.deepcopy(model)
    torch_cls = torch.optim.AdamW if ours_cls is NpuFusedAdamW else torch.optim.Adam
    x = torch.randn(5, 3, 5, 5, device=device) if conv else torch.randn(5, 6, device=device)
    return model, ours_cls(model.parameters(), **hp), ref_model, torch_cls(ref_model.parameters(), **hp), x


def train(model, opt, x, steps=1, set_to_none=False, scale=1.0):
    for i in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        model(x * (scale + 0.1 * i)).pow(2).mean().backward()
        opt.step()


def assert_models_close(a, b, what="param"):
    pa, pb = list(a.parameters()), list(b.parameters())
    p0max = max(float(p.detach().abs().max()) for p in pb)
    for k, (p, q) in enumerate(zip(pa, pb)):
        assert_close_rel(p, q, p0max, f"{what} {k}")


# ------------------------------------------------------------------ undisturbed training
def test_thirty_undisturbed_steps_combine_once():
    model, ours, ref_model, ref, x = twins()
    for step in range(30):
        train(model, ours, x, scale=1.0 + 0.05 * step)
        train(ref_model, ref, x, scale=1.0 + 0.05 * step)
        assert ours.recombine_count == 1, f"step {step}"
        assert ours.last_executor == "apex_C"
    assert assert_shared(ours) == 4
    assert_models_close(model, ref_model)


def test_set_to_none_reads_fresh_grads_in_place():
    """zero_grad() (set_to_none=True, torch's default): backward makes new grad tensors; after the first step
    (which combines) each step reads them where they are (no adoption event, p.grad untouched), and the
    result is torch's."""
    model, ours, ref_model, ref, x = twins()
    for step in range(5):
        train(model, ours, x, set_to_none=True)
        train(ref_model, ref, x, set_to_none=True)
        assert ours.recombine_count == 1, f"step {step}"
        assert_shared(ours)
    ours.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert_models_close(model, ref_model)


def test_user_grads_are_not_retained():
    """A grad tensor bound by the user is read where it is and stays ``p.grad``; the optimizer keeps no
    reference of its own, so dropping ``p.grad`` frees it (no lasting second copy)."""
    model, ours, _, _, x = twins()
    train(model, ours, x)
    params = list(model.parameters())
    grads = [torch.randn_like(p) for p in params]
    refs = [weakref.ref(g) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    del grads, g
    ours.step()
    assert_shared(ours)
    assert all(p.grad is r() for p, r in zip(params, refs))
    ours.zero_grad(set_to_none=True)
    gc.collect()
    assert all(r() is None for r in refs)


def test_zero_grad_keeps_views_and_zeroes_them():
    model, ours, _, _, x = twins()
    # before the first step nothing is combined: torch's per-tensor zeroing
    model(x).sum().backward()
    ours.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    train(model, ours, x)
    views = [p.grad for p in model.parameters()]
    ours.zero_grad(set_to_none=False)
    assert all(p.grad is v and not v.any() for p, v in zip(model.parameters(), views))
    assert all(not s.flat_g[: s.total].any() for c in ours._groups.values() for s in c.sets)
    # a grad replaced by the user is zeroed too (and adopted at the next step)
    p0 = next(model.parameters())
    p0.grad = torch.ones_like(p0)
    ours.zero_grad(set_to_none=False)
    assert not p0.grad.any()


# ------------------------------------------------------------------ groups and params
def test_param_groups_with_different_hyperparameters(device):
    layout = [
        (2, dict(lr=0.02, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, amsgrad=True)),
        (3, dict(lr=0.001, betas=(0.95, 0.99), eps=1e-8, weight_decay=0.0, amsgrad=False)),
        (1, dict(lr=0.05, betas=(0.5, 0.999), eps=1e-3, weight_decay=0.01, amsgrad=False)),
    ]
    ours, *_ = run_side_by_side(ADAM, layout, device=device, seed=12, ref_kind="torch", steps=15)
    assert len(ours._groups) == 3 and ours.recombine_count == 1


def test_add_param_group_after_steps(device):
    gen = torch.Generator().manual_seed(1)
    base = make_params([(4, 3), (5,), (2, 2)], torch.float32, device, gen)
    ours_p = [torch.nn.Parameter(t.detach().clone()) for t in base]
    ref_p = [torch.nn.Parameter(t.detach().clone()) for t in base]
    ours = NpuFusedAdam(ours_p[:2], **HP)
    ref = torch.optim.Adam(ref_p[:2], **HP)
    for step in range(8):
        if step == 4:
            ours.add_param_group(dict(params=ours_p[2:], lr=0.03, amsgrad=False))
            ref.add_param_group(dict(params=ref_p[2:], lr=0.03, amsgrad=False))
        for p, q in zip(ours_p, ref_p):
            q.grad = torch.randn(q.shape, generator=gen).to(device)
            if p.grad is None:
                p.grad = q.grad.clone()
            else:
                p.grad.copy_(q.grad)  # in place: a new grad object would be an adoption event
        ours.step()
        ref.step()
        assert ours.recombine_count == (1 if step < 4 else 2)
    for k, (p, q) in enumerate(zip(ours_p, ref_p)):
        assert_close_rel(p, q, 3.0, f"param {k}")
        assert float(ours.state[p]["step"]) == float(ref.state[q]["step"]) == (8 if k < 2 else 4)
    assert assert_shared(ours) == 3


def test_frozen_params_are_never_touched(device):
    ours, params, _, _ = run_side_by_side(ADAMW, [(4, HP)], device=device, seed=3, ref_kind="torch", steps=8,
                                          frozen=(1, 2))
    for k in (1, 2):
        assert params[k].grad is None and params[k] not in ours.state
    assert "state" in ours.state_dict() and sorted(ours.state_dict()["state"]) == [0, 3]


def test_missing_grads_skip_and_keep_per_param_step_counts(device):
    """torch's rule: grad None at step() = skipped, step count not advanced; bias correction per param."""
    ours, params, ref, ref_params = run_side_by_side(
        ADAM, [(4, HP)], device=device, seed=8, ref_kind="torch", steps=12,
        skip=lambda step, k: (k == 0 and step < 5) or (k == 2 and step % 3 == 1),
    )
    steps = [float(ours.state[p]["step"]) for p in params]
    assert steps == [float(ref.state[q]["step"]) for q in ref_params] == [7.0, 12.0, 8.0, 12.0]


def test_zero_grad_without_set_to_none_is_a_normal_update(device):
    """A zero grad (not None) is an update: the moments decay and the step count advances."""
    p = torch.nn.Parameter(torch.randn(4, 3, device=device))
    q = torch.nn.Parameter(p.detach().clone())
    ours, ref = NpuFusedAdam([p], **HP), torch.optim.Adam([q], **HP)
    for step in range(4):
        g = torch.randn(p.shape, device=device) if step < 2 else torch.zeros(p.shape, device=device)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert float(ours.state[p]["step"]) == 4.0
    assert_close_rel(p, q, 2.0, "param")
    assert_close_rel(ours.state[p]["exp_avg"], ref.state[q]["exp_avg"], 1.0, "exp_avg")


def test_mixed_dtypes_in_one_group():
    """One group with fp32 and bf16 params: one flat set per dtype, each as if optimized alone."""
    gen = torch.Generator().manual_seed(6)
    f32 = make_params([(3, 4), (7,)], torch.float32, "cpu", gen)
    b16 = make_params([(5,), (2, 3)], torch.bfloat16, "cpu", gen)
    mixed = [f32[0], b16[0], f32[1], b16[1]]
    alone = [torch.nn.Parameter(t.detach().clone()) for t in mixed]
    ours = NpuFusedAdam(mixed, **HP)
    refs = [NpuFusedAdam([alone[0], alone[2]], **HP), NpuFusedAdam([alone[1], alone[3]], **HP)]
    for _ in range(5):
        for p, q in zip(mixed, alone):
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            q.grad = p.grad.clone()
        ours.step()
        for r in refs:
            r.step()
    assert sorted(str(s.dtype) for s in ours._groups[0].sets) == ["torch.bfloat16", "torch.float32"]
    for p, q in zip(mixed, alone):
        assert torch.equal(p, q)
    assert assert_shared(ours) == 4


@pytest.mark.parametrize("executor", ["auto", "torch", "torch_ops"])
def test_padding_between_slots_stays_zero(executor, device):
    """eps=0 makes 0/0 = NaN out of the zero padding between slots: no executor may leave it there
    (norms and non-finite checks run over whole flat buffers)."""
    gen = torch.Generator().manual_seed(0)
    params = make_params([(5, 3), (7,), (33,)], torch.float32, device, gen)
    opt = NpuFusedAdam(params, lr=0.01, eps=0.0)
    opt.executor = executor
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        opt.step()
    (s,) = opt._groups[0].sets
    mask = torch.ones(s.total, dtype=torch.bool)
    for off, p in zip(s.offsets, s.params):
        mask[off:off + p.numel()] = False
    assert mask.any()
    for name, flat in [("param", s.flat_p), *s.flat_s.items()]:
        assert torch.equal(flat.cpu()[mask], torch.zeros(int(mask.sum()))), f"{executor}: {name} padding"
        assert torch.isfinite(flat).all(), name


def test_no_grads_at_all_changes_nothing():
    p = torch.nn.Parameter(torch.randn(3))
    before = p.detach().clone()
    opt = NpuFusedAdam([p])
    opt.step()
    assert torch.equal(p, before) and not opt.state and opt.state_dict()["state"] == {}


# ------------------------------------------------------------------ hyperparameter changes
@pytest.mark.parametrize("kind", ["step", "lambda"])
def test_lr_scheduler_takes_effect_next_step(kind, device):
    run_side_by_side(ADAM, [(3, HP)], device=device, seed=4, ref_kind="torch", steps=12,
                     between=lr_schedule_hook(kind))


def test_group_hyperparameter_changes_take_effect_next_step(device):
    def between(step, ours, ref):
        for opt in (ours, ref):
            g = opt.param_groups[0]
            if step == 4:
                g["betas"], g["eps"] = (0.7, 0.95), 1e-4
            if step == 8:
                g["weight_decay"], g["lr"] = 0.2, 0.005

    run_side_by_side(ADAMW, [(3, HP_NO_AMS)], device=device, seed=5, ref_kind="torch", steps=12, between=between)


def test_tensor_lr_equals_float_lr():
    gen = torch.Generator().manual_seed(2)
    a = make_params([(4, 4)], torch.float32, "cpu", gen)
    b = [torch.nn.Parameter(t.detach().clone()) for t in a]
    oa, ob = NpuFusedAdam(a, lr=torch.tensor(0.01)), NpuFusedAdam(b, lr=0.01)
    for _ in range(3):
        a[0].grad = torch.randn(4, 4, generator=gen)
        b[0].grad = a[0].grad.clone()
        oa.step()
        ob.step()
    assert torch.equal(a[0], b[0])


# ------------------------------------------------------------------ checkpoints
def test_checkpoint_is_compact():
    """torch.save of our state_dict is as small as torch's: views are saved, not whole flat buffers."""
    model, ours, ref_model, ref, x = twins(hp=HP)
    train(model, ours, x, steps=2)
    train(ref_model, ref, x, steps=2)
    sizes = []
    for opt in (ours, ref):
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        sizes.append(buf.tell())
    state_bytes = sum(v.numel() * v.element_size() for st in ref.state.values() for v in st.values())
    assert sizes[0] <= sizes[1] * 1.05 + 1024, sizes
    assert sizes[0] < 2 * state_bytes + 16384, (sizes, state_bytes)


def test_full_checkpoint_roundtrip_resumes_bitwise(tmp_path):
    """model + optimizer through torch.save/torch.load files: the resumed run equals the uninterrupted one."""
    model, ours, _, _, x = twins(hp=HP)
    train(model, ours, x, steps=3)
    torch.save({"model": model.state_dict(), "opt": ours.state_dict()}, tmp_path / "ckpt.pt")
    train(model, ours, x, steps=4, scale=2.0)
    ck = torch.load(tmp_path / "ckpt.pt")
    torch.manual_seed(1)
    model2 = Net()
    model2.load_state_dict(ck["model"])
    ours2 = NpuFusedAdam(model2.parameters(), **HP)
    ours2.load_state_dict(ck["opt"])
    train(model2, ours2, x, steps=4, scale=2.0)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        for n, v in ours.state[p].items():
            assert torch.equal(v, ours2.state[q][n]), n
    assert_shared(ours2)


def test_load_state_dict_into_running_optimizer_recombines_once():
    model, ours, _, _, x = twins()
    train(model, ours, x, steps=2)
    sd = ours.state_dict()
    ours.load_state_dict(sd)
    train(model, ours, x, steps=3)
    assert ours.recombine_count == 2
    assert_shared(ours)


def test_deepcopy_and_pickle_give_working_optimizers():
    model, ours, _, _, x = twins()
    train(model, ours, x, steps=2)
    for clone in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        ps = [p for g in clone.param_groups for p in g["params"]]
        before = [p.detach().clone() for p in model.parameters()]
        for p in ps:
            p.grad = torch.ones_like(p)
        clone.step()
        assert clone.recombine_count == 1 and clone.last_executor == "apex_C"
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "the copy shares nothing"
        assert_shared(clone)


# ------------------------------------------------------------------ sharing broken by user code
def _break_and_check(mutate, conv=False, compare_torch=True, events=1):
    """3 clean steps, `mutate(model)` on both twins, 3 more steps: healed once (`events` re-combines: 0 where
    a replaced grad is read where it is), torch's result."""
    model, ours, ref_model, ref, x = twins(conv=conv)
    train(model, ours, x, steps=3)
    train(ref_model, ref, x, steps=3)
    assert ours.recombine_count == 1
    mutate(model, ours, x)
    mutate(ref_model, ref, x)
    ours.step()
    ref.step()
    assert ours.recombine_count == 1 + events, "the break must be healed by exactly one re-combine"
    assert_shared(ours)
    train(model, ours, x, steps=3)
    train(ref_model, ref, x, steps=3)
    assert ours.recombine_count == 1 + events
    assert_shared(ours)
    if compare_torch:
        assert_models_close(model, ref_model)
    return model, ours


def test_break_by_assigning_param_data():
    def mutate(model, opt, x):
        with torch.no_grad():
            model.l1.weight.data = model.l1.weight.detach() * 0.5 + 0.1  # a new tensor with new values

    _break_and_check(mutate)


def test_break_by_assigning_a_new_grad():
    def mutate(model, opt, x):
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        model.l2.bias.grad = model.l2.bias.grad.clone() * 3.0

    _break_and_check(mutate, events=0)  # read in place


def test_break_by_grad_none_then_backward():
    def mutate(model, opt, x):
        opt.zero_grad(set_to_none=False)
        model.l1.weight.grad = None  # backward creates a fresh grad tensor for this param only
        model(x).pow(2).mean().backward()

    _break_and_check(mutate, events=0)  # read in place


def test_break_by_swapping_grad_storage():
    """``p.grad.data = other`` keeps the grad object but moves its memory out of the flat buffer."""

    def mutate(model, opt, x):
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        model.l1.bias.grad.data = model.l1.bias.grad.detach() * 2.0

    _break_and_check(mutate, events=0)  # read in place


def test_break_by_model_to_memory_format():
    """model.to(memory_format=channels_last) rebinds the conv weight to a new (channels_last) tensor."""

    def mutate(model, opt, x):
        opt.zero_grad(set_to_none=False)
        model.to(memory_format=torch.channels_last)
        model(x).pow(2).mean().backward()

    model, _ = _break_and_check(mutate, conv=True)
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)


@pytest.fixture(params=[False, True], ids=["set-data", "swap-tensors"])
def module_conversion(request):
    """How nn.Module.to() rebinds params: ``p.data = new`` (torch's default) or torch.utils.swap_tensors
    (``torch.__future__.set_swap_module_params_on_conversion(True)``); both keep the Parameter objects."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(request.param)
    yield request.param
    torch.__future__.set_swap_module_params_on_conversion(before)


def test_break_by_model_to_dtype(module_conversion):
    """model.to(bf16) after steps: the next step runs on bf16 buffers with the states cast to bf16,
    exactly as a fresh optimizer loading the state_dict (torch casts states to the param dtype)."""
    model, ours, _, _, x = twins(hp=HP)
    train(model, ours, x, steps=3)
    params = list(model.parameters())
    saved = copy.deepcopy(ours.state_dict())
    model.to(torch.bfloat16)
    assert list(model.parameters()) == params  # same Parameter objects, new data
    twin = copy.deepcopy(model)
    twin_opt = NpuFusedAdam(twin.parameters(), **HP)
    twin_opt.load_state_dict(saved)
    xb = x.to(torch.bfloat16)
    for m, o in ((model, ours), (twin, twin_opt)):
        o.zero_grad(set_to_none=False)
        m(xb).pow(2).mean().backward()
        o.step()
    assert ours.recombine_count == 2 and ours.last_executor == "apex_C"
    assert all(s.dtype == torch.bfloat16 for s in ours._groups[0].sets)
    assert assert_shared(ours) == 4
    for p, q in zip(model.parameters(), twin.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q)
        for n, v in ours.state[p].items():
            assert torch.equal(v, twin_opt.state[q][n]), n
    train(model, ours, xb, steps=2)
    assert ours.recombine_count == 2


def test_break_by_model_to_device(device):
    """model.to(another device) after steps: the next step runs there, with the states moved along.

    Across device types nn.Module.to() rebinds params in place only with swap_tensors
    (``torch.__future__.set_swap_module_params_on_conversion(True)``); by default it creates new
    Parameter objects, which no optimizer holding the old ones can follow (torch.optim neither:
    build the optimizer after moving the model). With a GPU/NPU the model goes to the CPU; on a
    CPU-only machine the other device is ``meta`` (no values: only the healing is checked).
    """
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model, ours, _, _, x = twins(hp=HP, device=device)
        train(model, ours, x, steps=3)
        params = list(model.parameters())
        other = "meta" if device == "cpu" else "cpu"
        saved = copy.deepcopy(ours.state_dict())
        model.to(other)
        assert list(model.parameters()) == params
        twin = copy.deepcopy(model)
        twin_opt = NpuFusedAdam(twin.parameters(), **HP)
        twin_opt.load_state_dict(saved)
        for m, o in ((model, ours), (twin, twin_opt)):
            o.zero_grad(set_to_none=False)
            m(x.to(other)).pow(2).mean().backward()
            o.step()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert ours.recombine_count == 2
    assert all(s.device.type == other for s in ours._groups[0].sets)
    assert assert_shared(ours) == 4
    assert all(v.device.type == other for st in ours.state.values() for v in st.values() if v.dim())
    if other == "meta":
        assert ours.last_executor == "torch"
    else:
        assert ours.last_executor == "apex_C"
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)


def test_break_two_ways_before_one_step_counts_once():
    def mutate(model, opt, x):
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        model.l1.bias.data = model.l1.bias.detach().clone()
        model.l2.weight.grad = model.l2.weight.grad.clone()

    _break_and_check(mutate)


def test_replacing_the_group_param_list_recombines():
    model, ours, _, _, x = twins()
    train(model, ours, x, steps=2)
    ours.param_groups[0]["params"] = list(ours.param_groups[0]["params"])
    train(model, ours, x, steps=2)
    assert ours.recombine_count == 2
    assert_shared(ours)


# ------------------------------------------------------------------ errors change nothing
@pytest.mark.parametrize("combined", [False, True], ids=["before-combine", "after-combine"])
def test_sparse_grad_is_rejected_and_changes_nothing(combined):
    check_sparse_grad_rejected(NpuFusedAdam, stepped=combined, match=r"sparse gradients.*expected a dense")


@pytest.mark.parametrize(
    "make, error, pattern",
    [
        (lambda: torch.zeros(3, dtype=torch.int64), TypeError, "floating point params; param 0 has dtype torch.int64"),
        (lambda: torch.zeros(3, dtype=torch.float64), TypeError, "float32, float16 and bfloat16"),
        (lambda: torch.zeros(3, dtype=torch.complex64), TypeError, "complex params.*view_as_real"),
        (lambda: torch.zeros(3).to_sparse(), TypeError, "sparse params"),
        (lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged), TypeError,
         "nested tensors as params"),
    ],
    ids=["int64", "float64", "complex64", "sparse", "nested"],
)
def test_unsupported_params_are_rejected(make, error, pattern):
    with pytest.raises(error, match=pattern):
        NpuFusedAdam([make()])
    opt = NpuFusedAdam([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(error, match=pattern):
        opt.add_param_group({"params": [make()]})
    assert len(opt.param_groups) == 1


def test_params_on_different_devices_are_rejected():
    with pytest.raises(ValueError, match=r"one device, got \['cpu', 'meta'\]"):
        NpuFusedAdam([torch.zeros(2, requires_grad=True), torch.zeros(2, device="meta", requires_grad=True)])


def test_param_cast_to_unsupported_dtype_is_rejected_at_step():
    model, ours, _, _, x = twins()
    train(model, ours, x, steps=2)
    params = list(model.parameters())
    model.l2.bias.data = model.l2.bias.detach().double()
    model.l2.bias.grad = None
    snap = snapshot(ours, params)
    with pytest.raises(TypeError, match=r"param 3 has torch\.float64"):
        ours.step()
    assert_unchanged(ours, params, snap)


@pytest.mark.parametrize("option", ["maximize", "capturable", "differentiable"])
def test_torch_state_dict_with_unsupported_option_is_rejected(option):
    model, ours, _, ref, x = twins()
    train(model, ours, x, steps=2)
    params = list(model.parameters())
    sd = ref.state_dict()
    sd["param_groups"][0][option] = True
    snap = snapshot(ours, params)
    with pytest.raises(ValueError, match=f"does not implement {option}=True; expected {option}=False"):
        ours.load_state_dict(sd)
    assert_unchanged(ours, params, snap)
    train(model, ours, x)
    assert ours.recombine_count == 1


def test_state_dict_with_wrong_state_shape_is_rejected_at_load():
    model, ours, _, _, x = twins()
    train(model, ours, x, steps=2)
    sd = ours.state_dict()
    before = ours.state_dict()
    sd["state"][0]["exp_avg"] = torch.zeros(3)
    params = list(model.parameters())
    values = [p.detach().clone() for p in params]
    ptrs = [p.data_ptr() for p in params]
    with pytest.raises(ValueError, match=r"state of param 0 in param group 0, key 'exp_avg': expected shape \(8, 6\)"):
        ours.load_state_dict(sd)
    assert [p.data_ptr() for p in params] == ptrs and all(torch.equal(p, v) for p, v in zip(params, values))
    after = ours.state_dict()
    assert all(torch.equal(after["state"][k][n], v) for k, e in before["state"].items() for n, v in e.items())


def test_not_a_state_dict_is_rejected():
    opt = NpuFusedAdam([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(TypeError, match="'state' and 'param_groups'"):
        opt.load_state_dict({"param_groups": []})


def test_old_checkpoint_without_newer_options_gets_defaults():
    """A torch checkpoint from before decoupled_weight_decay/foreach/... existed still loads."""
    model, ours, _, ref, x = twins()
    train(model, ours, x)
    sd = ref.state_dict()
    for key in ("decoupled_weight_decay", "foreach", "capturable", "differentiable", "fused", "maximize"):
        sd["param_groups"][0].pop(key)
    ours.load_state_dict(sd)
    assert ours.param_groups[0]["decoupled_weight_decay"] is False and ours.param_groups[0]["maximize"] is False
    train(model, ours, x)


# ------------------------------------------------------------------ closure
def test_closure_semantics_match_torch():
    model, ours, ref_model, ref, x = twins()
    calls = []

    def closure_for(m, opt):
        def closure():
            calls.append(torch.is_grad_enabled())
            opt.zero_grad(set_to_none=False)
            loss = m(x).pow(2).mean()
            loss.backward()
            return loss

        return closure

    for _ in range(3):
        la = ours.step(closure_for(model, ours))
        lb = ref.step(closure_for(ref_model, ref))
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=0)  # the loss before each update
    assert calls == [True] * 6
    assert ours.step() is None and ref.step() is None
    assert_models_close(model, ref_model)


@pytest.mark.parametrize("make, pattern", [
    (lambda p: NpuFusedAdam(p, 0.1, (1e70, 0.5)), r"beta parameter at index 0: expected a value in \[0.0, 1.0\)"),
    (lambda p: NpuFusedAdamW(p, 0.1, weight_decay=-1e52), r"weight_decay value: expected a value in \[0.0, inf\)"),
    (lambda p: NpuFusedAdadelta(p, 0.1, rho=1e60), r"rho value: expected a value in \[0.0, 1.0\]"),
    (lambda p: NpuFusedAdam(p, 1e60), r"learning rate: expected a finite value \(at most 3.403e\+38\)"),
    (lambda p: NpuFusedAdam(p, float("inf")), r"learning rate: expected a finite value"),
    (lambda p: NpuFusedAdam(p, torch.tensor(0.1, device="meta")), r"learning rate: expected a value, got a meta"),
])
def test_an_out_of_range_option_is_told_its_own_range(make, pattern):
    """A value beyond float32 that is also outside the option's interval gets the interval in the message (a
    beta of 1e70 is not in [0, 1)); only a value inside it but beyond float32 is told the float32 limit."""
    with pytest.raises(ValueError, match=pattern):
        make([torch.zeros(3, requires_grad=True)])
