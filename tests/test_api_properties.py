"""Property-based checks of the public API (hypothesis): random shapes, dtypes, hyperparameters and
corrupted checkpoints.

Each call either succeeds, with the result torch gives (optimizers: the torch.optim class of the same math
on copies of the same params and grads), or raises one of the documented exception types (TypeError /
ValueError; RuntimeError only for amp's unexpected keys) with params, optimizer state and loss scalers
unchanged. Examples are small and few, so the file stays in the fast tier.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from _state_cases import IDS, OPTIMIZERS, make_params, run, same_state, snapshot
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import apex.optimizers as O
from apex import amp
from apex.amp import LossScaler
from apex.contrib.combine_tensors import combine_tensors, is_combined_tensor_valid

# no shrinking and no example database: bounded time, nothing written into the checkout
SETTINGS = settings(max_examples=15, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
DOCUMENTED = (TypeError, ValueError)

shapes = st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=4)
odd_numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.integers(-5, 10**6),
    st.sampled_from(["1", None, True, [1.0], torch.tensor(2.0), torch.tensor([1.0, 2.0])]),
)


# ---------------------------------------------------------------- optimizers against torch

TWINS = {
    "adam": (O.NpuFusedAdam, torch.optim.Adam, lambda h: dict(lr=h["lr"], betas=h["betas"], eps=h["eps"],
                                                              weight_decay=h["wd"])),
    "adamw": (O.NpuFusedAdamW, torch.optim.AdamW, lambda h: dict(lr=h["lr"], betas=h["betas"], eps=h["eps"],
                                                                 weight_decay=h["wd"])),
    "sgd": (O.NpuFusedSGD, torch.optim.SGD, lambda h: dict(lr=h["lr"], momentum=h["momentum"],
                                                           weight_decay=h["wd"])),
    "rmsprop": (O.NpuFusedRMSprop, torch.optim.RMSprop, lambda h: dict(lr=h["lr"], momentum=h["momentum"],
                                                                       eps=h["eps"], weight_decay=h["wd"])),
    "adadelta": (O.NpuFusedAdadelta, torch.optim.Adadelta, lambda h: dict(lr=h["lr"] * 10, eps=h["eps"],
                                                                          weight_decay=h["wd"])),
}
hyper = st.fixed_dictionaries({
    "lr": st.floats(1e-4, 0.5),
    "betas": st.tuples(st.floats(0.0, 0.99), st.floats(0.0, 0.999)),
    "eps": st.floats(1e-8, 1e-3),
    "wd": st.floats(0.0, 0.1),
    "momentum": st.floats(0.0, 0.95),
})


@settings(SETTINGS, max_examples=10)
@given(kind=st.sampled_from(sorted(TWINS)), shape_list=shapes, h=hyper, dtype=st.sampled_from(["float32", "bfloat16"]),
       steps=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_optimizers_match_torch(kind, shape_list, h, dtype, steps, seed):
    ours_cls, torch_cls, args = TWINS[kind]
    dt = getattr(torch, dtype)
    params = make_params(shape_list, dtype=dt, seed=seed)
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    start = [p.detach().float().clone() for p in params]
    ours, ref = ours_cls(params, **args(h)), torch_cls(ref_params, **args(h))
    for i in range(steps):
        g = torch.Generator().manual_seed(seed + i)
        for p, q in zip(params, ref_params):
            p.grad = torch.randn(p.shape, generator=g).to(dt)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
    for p, q, p0 in zip(params, ref_params, start):
        assert p.dtype == q.dtype and p.shape == q.shape
        if dt == torch.float32:
            tol = dict(rtol=1e-5, atol=1e-6)
        else:
            # torch rounds every bf16 op to 8 bits, ours rounds once per stored value: the difference scales with
            # the distance the update moved the param (one that lands near 0 has no relative bound)
            moved = float((q.detach().float() - p0).abs().max()) if q.numel() else 0.0
            tol = dict(rtol=2e-2, atol=2e-2 * max(1.0, 2.0 * moved))
        torch.testing.assert_close(p.float(), q.float(), **tol)


@SETTINGS
@given(index=st.integers(0, len(OPTIMIZERS) - 1), key=st.sampled_from(["lr", "weight_decay", "eps", "momentum"]),
       value=odd_numbers)
def test_constructor_accepts_only_usable_hyperparameters(index, key, value):
    cls, kw = OPTIMIZERS[index]
    probe = cls(make_params(), **kw)
    if key not in probe.defaults:
        return
    try:
        opt = cls(make_params(), **{**kw, key: value})
    except DOCUMENTED:
        return
    v = opt.defaults[key]
    v = v.item() if isinstance(v, torch.Tensor) else v
    assert isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
    params = opt.param_groups[0]["params"]
    run(opt, params, 1)  # whatever was accepted steps


# ---------------------------------------------------------------- corrupted optimizer checkpoints


def _corrupt(sd, data):
    """One random change to a deep copy of ``sd``: a state value, a step, a group option or the id map."""
    sd = copy.deepcopy(sd)
    keys = list(sd["state"])
    key = data.draw(st.sampled_from(keys))
    entry = sd["state"][key]
    op = data.draw(st.sampled_from(["value", "step", "drop", "group", "id"]))
    if op == "value" and entry:
        name = data.draw(st.sampled_from(sorted(entry)))
        entry[name] = data.draw(st.one_of(
            odd_numbers,
            shapes.flatmap(lambda ss: st.just(torch.zeros(ss[0]))),
            st.sampled_from([torch.int32, torch.bool, torch.float16, torch.complex64]).map(
                lambda dt, ref=entry[name]: torch.zeros(ref.shape if isinstance(ref, torch.Tensor) else (), dtype=dt)),
        ))
    elif op == "step":
        where = entry if "step" in entry else sd["param_groups"][0]
        where["step"] = data.draw(odd_numbers)
    elif op == "drop" and entry:
        entry.pop(data.draw(st.sampled_from(sorted(entry))))
    elif op == "group":
        sd["param_groups"][0][data.draw(st.sampled_from(["lr", "eps", "weight_decay"]))] = data.draw(odd_numbers)
    else:
        sd["state"][data.draw(st.integers(-3, 10))] = copy.deepcopy(entry)
    return sd


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=IDS)
@settings(SETTINGS, max_examples=8)
@given(data=st.data())
def test_corrupted_checkpoint_is_rejected_or_usable(cls, kw, data):
    params = make_params()
    opt = cls(params, **kw)
    run(opt, params, 2)
    good = snapshot(opt)
    values = [p.detach().clone() for p in params]
    bad = _corrupt(good, data)
    try:
        opt.load_state_dict(bad)
    except DOCUMENTED:
        assert same_state(opt.state_dict(), good)
        assert all(torch.equal(p, v) for p, v in zip(params, values))
    run(opt, params, 1, start=2)  # loaded or not, the next step runs


# ---------------------------------------------------------------- loss scaler and amp checkpoints


@SETTINGS
@given(scale=odd_numbers, count=odd_numbers, updates=st.lists(st.booleans(), max_size=12),
       window=st.integers(1, 4))
def test_loss_scaler_load_is_all_or_nothing(scale, count, updates, window):
    s = LossScaler("dynamic", init_scale=64.0, scale_window=window, min_loss_scale=1.0)
    before = s.state()
    try:
        s.load(scale, count)
    except DOCUMENTED:
        assert s.state() == before
    for overflow in updates:
        s.clear_overflow_state()
        s.record_overflow(overflow)
        assert s.update_scale() is overflow
        assert math.isfinite(s.loss_scale()) and s.loss_scale() > 0
        assert 0 <= s.state()["unskipped"] < window


@pytest.mark.usefixtures("amp_env")
@SETTINGS
@given(entries=st.dictionaries(st.sampled_from(["loss_scaler0", "loss_scaler1", "scaler", "loss_scaler7"]),
                               st.one_of(st.fixed_dictionaries({"loss_scale": odd_numbers, "unskipped": odd_numbers}),
                                         odd_numbers), max_size=3))
def test_amp_load_state_dict_is_all_or_nothing(entries):
    amp.initialize(torch.nn.Linear(2, 2), opt_level="O1", num_losses=2, verbosity=0)
    before = amp.state_dict()
    try:
        amp.load_state_dict(entries)
    except (*DOCUMENTED, RuntimeError):
        assert amp.state_dict() == before
        return
    for v in amp.state_dict().values():
        assert math.isfinite(v["loss_scale"]) and v["loss_scale"] > 0 and v["unskipped"] >= 0


# ---------------------------------------------------------------- combined modules: compact, loadable


class _Bag(torch.nn.Module):
    def __init__(self, shape_list, dtype):
        super().__init__()
        self.parts = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shape_list])


@SETTINGS
@given(shape_list=shapes, dtype=st.sampled_from(["float32", "float16", "bfloat16"]))
def test_combined_module_checkpoints_are_compact_and_load_in_place(shape_list, dtype):
    m = _Bag(shape_list, getattr(torch, dtype))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    params = list(m.parameters())
    flat = combine_tensors(params)
    sd = m.state_dict()
    for k, v in sd.items():
        assert torch.equal(v, before[k])
        assert v.untyped_storage().nbytes() == v.numel() * v.element_size()
    buf = io.BytesIO()
    torch.save(sd, buf)
    assert len(buf.getvalue()) < sum(v.numel() * v.element_size() for v in sd.values()) + 1500 + 600 * len(sd)
    m.load_state_dict({k: torch.ones_like(v) for k, v in sd.items()})
    assert is_combined_tensor_valid(flat, params)
    assert all(bool((p == 1).all()) for p in params)


# ---------------------------------------------------------------- upstream helpers scripts call directly


@SETTINGS
@given(shape_list=shapes, max_norm=odd_numbers, norm_type=odd_numbers, seed=st.integers(0, 2**16))
def test_clip_grad_norm_matches_torch_or_raises_unchanged(shape_list, max_norm, norm_type, seed):
    from apex.contrib.clip_grad import clip_grad_norm_

    torch.manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in shape_list]
    for p in ps:
        p.grad = torch.randn(p.shape) * 5
    before = [p.grad.clone() for p in ps]
    try:
        total = clip_grad_norm_(ps, max_norm, norm_type=norm_type)
    except DOCUMENTED:
        assert all(torch.equal(p.grad, b) for p, b in zip(ps, before))
        return
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for r, b in zip(ref, before):
        r.grad = b.clone()
    max_norm = float(max_norm.item() if isinstance(max_norm, torch.Tensor) else max_norm)
    norm_type = float(norm_type.item() if isinstance(norm_type, torch.Tensor) else norm_type)
    # torch's reference over the grads with elements: an empty one changes no p-norm, and torch's infinity norm
    # raises on it where ours leaves it out
    live = [r for r in ref if r.grad.numel()]
    want = torch.nn.utils.clip_grad_norm_(live, max_norm, norm_type=norm_type) if live else torch.tensor(0.0)
    torch.testing.assert_close(total, want, rtol=0, atol=0, equal_nan=True)
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=0, equal_nan=True)


@SETTINGS
@given(shape_list=shapes, extra=st.integers(-3, 3), flat_dim=st.integers(0, 2),
       dtype=st.sampled_from(["float32", "float16", "bfloat16"]))
def test_unflatten_views_or_raises(shape_list, extra, flat_dim, dtype):
    import apex_C

    ts = [torch.randn(s) for s in shape_list]
    need = sum(t.numel() for t in ts)
    n = max(need + extra, 0)
    flat = torch.arange(n, dtype=getattr(torch, dtype))
    if flat_dim == 2:
        flat = flat.reshape(1, n)
    elif flat_dim == 0 and n == 1:
        flat = flat.reshape(())
    before = flat.clone()
    try:
        views = apex_C.unflatten(flat, ts)
    except DOCUMENTED:
        assert flat.dim() != 1 or n < need
        assert torch.equal(flat, before)
        return
    assert flat.dim() == 1 and n >= need
    assert torch.equal(torch.cat([v.reshape(-1) for v in views] + [flat[need:]]), flat)
    assert [v.shape for v in views] == [t.shape for t in ts]


# ---------------------------------------------------------------- amp_C's argument checks
def _amp_c_tensor(kind: str, shape: tuple, dtype: torch.dtype) -> object:
    if kind == "number":
        return 1.0
    t = torch.ones(shape, dtype=dtype)
    if kind == "transposed" and t.dim() >= 2:
        return t.transpose(0, 1)
    if kind == "meta":
        return t.to("meta")
    if kind == "sparse":
        return t.to_sparse()
    return t


amp_c_tensors = st.tuples(
    st.sampled_from(["plain", "plain", "plain", "transposed", "meta", "sparse", "number"]),
    st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32]),
).map(lambda a: _amp_c_tensor(*a))
amp_c_lists = st.lists(st.lists(amp_c_tensors, min_size=0, max_size=3), min_size=1, max_size=4)


@SETTINGS
@given(lists=amp_c_lists, shared=st.booleans())
def test_amp_c_list_checks_agree_with_the_per_tensor_loop(lists, shared, monkeypatch):
    """Lists the whole-list test accepts are the ones the per-tensor loop accepts as they are: whatever the lists
    hold, `_check_call` raises the same error either way, or returns tensors covering the same memory in the same
    element order."""
    from apex.multi_tensor_apply import amp_C

    if shared:
        lists = [lists[0]] * len(lists)  # one list object passed several times ([grads, grads])

    def check():
        try:
            return amp_C._check_call("op", 2048, torch.zeros(1, dtype=torch.int), lists, (len(lists),))
        except (TypeError, ValueError) as exc:
            return type(exc), str(exc)

    fast = check()
    with monkeypatch.context() as m:
        m.setattr(amp_C, "_plain_lists", lambda ls: False)
        slow = check()
    if isinstance(slow, tuple):
        assert fast == slow
        return
    for fl, sl in zip(fast, slow):
        for f, s in zip(fl, sl):
            assert (f.device, f.dtype, f.numel()) == (s.device, s.dtype, s.numel())
            if f.device.type != "meta":
                assert f.data_ptr() == s.data_ptr() and f.is_contiguous() and s.is_contiguous()
