"""Shared checks for the fused optimizers' tests (imported by tests/test_optim_*.py).

An optimizer under test is described by a `Spec`: our class, its torch.optim
equivalent (if torch has one) and a float64 reference step written from the
formulas in the test file. The checks drive our optimizer and a reference
side by side; the reference always receives copies of *our* grads, so both
see exactly the same inputs whatever the grads came from (random draws,
backward through a model, None for skipped params).

Reference step signature: ``ref(p, g, st, t, hp, new) -> dict`` with float64
tensors: ``p``/``g`` the param and grad before the update, ``st`` the states
before it (``{}`` at a param's first update), ``t`` the number of updates the
param had before this one, ``hp`` the param group. It returns ``"param"`` and
every state. ``new`` (or None) holds the states our optimizer stored in this
step: the fused kernels read a state back *as stored* after writing it, so in
low precision the reference uses those values for the terms computed after
the state update. Every stored value is then checked to be the correctly
rounded result of its stored inputs (within 1 ulp).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import os
import random
import sys
import types
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch

from apex import _core, _device
from apex import optimizers as _optimizers
from apex.contrib import is_combined_tensor_valid
from apex.optimizers import CombinedOptimizer

LOW = (torch.bfloat16, torch.float16)
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
RTOL = 1e-5


@dataclass
class Spec:
    ours: type
    ref: Callable[..., Dict[str, torch.Tensor]]
    draw: Callable[[random.Random], dict]  # random hyperparameters (our keyword names)
    torch_cls: Optional[type] = None
    has_step: bool = True
    state_fill: Dict[str, float] = field(default_factory=dict)
    #: kwargs every constructor needs (e.g. a required lr)
    base: Dict[str, float] = field(default_factory=dict)


#: every optimizer class apex.optimizers exports, with options that exercise its paths (for framework behaviour
#: checked across all of them)
EVERY_OPTIMIZER = {
    getattr(_optimizers, name): options for name, options in (
        ("NpuFusedSGD", dict(lr=0.05, momentum=0.9, weight_decay=0.01, dampening=0.1)),
        ("NpuFusedAdam", dict(lr=0.01, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-6)),
        ("NpuFusedAdamW", dict(lr=0.01, weight_decay=0.05, betas=(0.9, 0.99), eps=1e-6)),
        ("NpuFusedAdamP", dict(lr=0.01, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-6, delta=0.1, wd_ratio=0.1)),
        ("NpuFusedBertAdam", dict(lr=0.01, warmup=0.1, t_total=100, b1=0.9, b2=0.99, e=1e-6, weight_decay=0.01,
                                  max_grad_norm=1.0)),
        ("NpuFusedAdadelta", dict(lr=1.0, rho=0.8, eps=1e-6, weight_decay=0.01)),
        ("NpuFusedLamb", dict(lr=0.01, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-6)),
        ("NpuFusedRMSprop", dict(lr=0.01, alpha=0.9, eps=1e-6, momentum=0.9, weight_decay=0.01)),
        ("NpuFusedRMSpropTF", dict(lr=0.01, alpha=0.9, eps=1e-6, momentum=0.9, weight_decay=0.01)),
        ("Lamb", dict(lr=0.01, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-6)),
        ("FusedAdam", dict(lr=0.01, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-6)),
        ("FusedSGD", dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
        ("FusedAdagrad", dict(lr=0.05, eps=1e-6, weight_decay=0.01)),
        ("FusedLAMB", dict(lr=0.01, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-6, max_grad_norm=1.0)),
        ("FusedNovoGrad", dict(lr=0.01, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-6)),
        ("FusedMixedPrecisionLamb", dict(lr=0.01, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-6,
                                         max_grad_norm=1.0)),
    )
}


# ------------------------------------------------------------------ helpers
def expected_executor(device: str) -> str:
    return "apex_C" if device == "cpu" else "torch"


#: torch.optim classes whose math our torch executor runs with torch's own fused kernel, where the device has
#: one, for fp32 params. There torch's ``fused=True`` is the reference: the fused kernels round differently from
#: torch's foreach and for-loop paths in the last bits (fused multiply-add; over 30 Adam steps exp_avg_sq drifts
#: by ~1.3e-5 relative on CUDA), and CUDA's AdamW decay turns an inf param into NaN (p - lr*wd*p), where the
#: other paths multiply by 1 - lr*wd and keep it inf.
#: (SGD is left out: torch's fused SGD fails on a group whose params get their first grad at different steps.)
FUSED_TWINS = (torch.optim.Adam, torch.optim.AdamW)
_TORCH_FUSED_OK = CombinedOptimizer.__dict__["_torch_fused_ok"]


def runs_torch_fused(torch_cls, device, dtype: torch.dtype = torch.float32, executor: str = "auto") -> bool:
    """Whether our optimizer mirroring ``torch_cls`` updates params of ``dtype`` on ``device`` with torch's fused
    kernel: the torch executor (every device but a CPU with apex_C, or forced by `use_executor`), not the
    plain-ops one (`use_executor`'s "torch_ops" patches `_torch_fused_ok`)."""
    dev = torch.device(device).type
    if torch_cls not in FUSED_TWINS or dtype != torch.float32 or executor == "torch_ops":
        return False
    if CombinedOptimizer.__dict__["_torch_fused_ok"] is not _TORCH_FUSED_OK:
        return False
    if executor == "auto" and dev == "cpu" and _core.uses_kernel(torch.empty(0)):
        return False
    return dev in _device.fused_optimizer_devices()


def use_executor(monkeypatch, executor: str, device: str) -> str:
    """Select the executor as if the extension were unusable; returns the expected `last_executor`.

    "apex_C": the C++ kernels (CPU only). "torch": torch on the flat buffers, as non-CPU devices
    and a missing extension run it (torch's own fused op where it has one). "torch_ops": the same
    without torch's fused ops (plain torch ops only).
    """
    if executor == "apex_C" and device != "cpu":
        pytest.skip("the C++ kernels run on CPU buffers")
    if executor in ("torch", "torch_ops"):
        monkeypatch.setattr(_core, "uses_kernel", lambda *tensors: False)
    if executor == "torch_ops":
        monkeypatch.setattr(CombinedOptimizer, "_torch_fused_ok", lambda self, s: False)
    return "apex_C" if executor == "apex_C" else "torch"


def assert_nonfinite_alike(ours: torch.Tensor, ref: torch.Tensor, what: str = "") -> Tuple[torch.Tensor, torch.Tensor]:
    """NaN and inf at the same places, infs of the same sign; returns (as fp32 on the CPU) the finite values of
    ours and of ref, for the caller's own comparison of those."""
    a, b = ours.float().cpu(), ref.float().cpu()
    for kind, ma, mb in (("NaN", a.isnan(), b.isnan()), ("inf", a.isinf(), b.isinf())):
        assert torch.equal(ma, mb), f"{what}: {kind} at {ma.nonzero().flatten()} vs {mb.nonzero().flatten()}"
    inf = a.isinf()
    assert torch.equal(a[inf], b[inf]), f"{what}: infs of another sign"
    fin = a.isfinite()
    return a[fin], b[fin]


def step_twins(make_ours: Callable[[list], torch.optim.Optimizer], make_ref: Callable[[list], torch.optim.Optimizer],
               values: torch.Tensor, grads: torch.Tensor, device: str, dtype: torch.dtype, steps: int = 3):
    """One param per side holding ``values`` repeated 40 times (long enough for the vector loops), stepped
    ``steps`` times with ``grads`` (repeated alike) as a fresh grad tensor each step; returns
    (ours, ours_p, ref, ref_p)."""
    ours_p = torch.nn.Parameter(values.to(device, dtype).repeat(40))
    ref_p = torch.nn.Parameter(values.to(device, dtype).repeat(40))
    ours, ref = make_ours([ours_p]), make_ref([ref_p])
    for _ in range(steps):
        ours_p.grad = grads.to(device, dtype).repeat(40)
        ref_p.grad = grads.to(device, dtype).repeat(40)
        ours.step()
        ref.step()
    return ours, ours_p, ref, ref_p


def random_shapes(rng: random.Random, n: Optional[int] = None) -> List[Tuple[int, ...]]:
    n = rng.randint(3, 6) if n is None else n
    shapes = []
    for _ in range(n):
        rank = rng.choice([0, 1, 1, 2, 2, 3])
        shapes.append(tuple(rng.randint(1, 9) for _ in range(rank)))
    return shapes


def make_params(shapes, dtype, device, gen: torch.Generator, scale: float = 1.0) -> List[torch.Tensor]:
    out = []
    for s in shapes:
        t = (torch.randn(s, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)
        out.append(torch.nn.Parameter(t))
    return out


def set_grad(p: torch.Tensor, g: Optional[torch.Tensor]) -> None:
    """Writes into the existing grad when there is one (keeps our combined views), else binds a new tensor."""
    if g is None:
        p.grad = None
    elif p.grad is None:
        p.grad = g.detach().clone().to(dtype=p.dtype)
    else:
        p.grad.copy_(g)


def mirror_grads(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
    for p, q in zip(src, dst):
        q.grad = None if p.grad is None else p.grad.detach().to(dtype=q.dtype).clone()


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` values at |x| (float64), subnormal spacing below the smallest normal."""
    tiny = torch.finfo(dtype).tiny
    _, e = torch.frexp(x.double().abs().clamp(min=tiny))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - 1 - MANTISSA[dtype])


def assert_ulp(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor, what: str) -> None:
    """|ours - ref| <= 1 ulp of `dtype`, plus fp32 evaluation slack relative to the operands' size `scale`.

    The kernels compute in fp32 (torch's opmath), so the exact result is known to them only up
    to a few fp32 roundings of the operands; that matters only under cancellation.
    """
    ours64 = ours.detach().double().reshape(-1)
    ref64 = ref.detach().double().reshape(-1)
    assert torch.isfinite(ours64).all(), f"{what}: non-finite values"
    tol = torch.maximum(ulp(ref64, dtype), ulp(ours64, dtype)) + 2.0**-21 * scale.double().reshape(-1)
    err = (ours64 - ref64).abs()
    bad = err > tol
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} elements beyond 1 ulp ({dtype}); first at {i}: "
            f"ours {ours64[i].item()!r}, reference {ref64[i].item()!r}, tolerance {tol[i].item()!r}"
        )


def assert_close_rel(ours: torch.Tensor, ref: torch.Tensor, atol_scale: float, what: str) -> None:
    """The fp32 criterion: rtol 1e-5, atol 1e-6 * (size of the initial values)."""
    torch.testing.assert_close(
        ours.detach().double().cpu(), ref.detach().double().cpu(), rtol=RTOL, atol=1e-6 * atol_scale,
        msg=lambda m: f"{what}: {m}",
    )


# ------------------------------------------------------- combined storage
def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage a tensor views."""
    return t.untyped_storage()._cdata


def assert_shared(opt) -> int:
    """Every param, grad and state entry of `opt` is a view of its flat buffer at its slot (a grad that the last
    step read where it is: listed in the set's gather table); returns #params."""
    n = 0
    for gi, group in enumerate(opt.param_groups):
        cache = opt._groups[gi]
        assert cache.params is group["params"]
        assert sum(len(s.params) for s in cache.sets) == len(group["params"])
        for s in cache.sets:
            assert is_combined_tensor_valid(s.flat_p, s.params), f"group {gi}: params left their flat buffer"
            for k, p in enumerate(s.params):
                where = f"group {gi} param {k}"
                if p.grad is not None and s.gathered:
                    # read where it is (fresh grad after set_to_none): the kernel's table holds its address
                    assert int(s.gtab[k]) == p.grad.data_ptr(), f"{where}: grad not in the gather table"
                elif p.grad is not None:
                    assert p.grad is s.grad_views[k], f"{where}: grad is not the bound view"
                    assert storage_key(p.grad) == storage_key(s.flat_g), f"{where}: grad outside the flat grad buffer"
                    assert p.grad.storage_offset() == s.flat_g.storage_offset() + s.offsets[k]
                st = opt.state.get(p)
                if not st:
                    continue
                for name in s.state_names:
                    v, flat = st[name], s.flat_s[name]
                    assert storage_key(v) == storage_key(flat), f"{where}: state {name!r} outside its flat buffer"
                    assert v.storage_offset() == flat.storage_offset() + s.offsets[k], f"{where}: {name!r} slot"
                    assert v.shape == p.shape and v.dtype == p.dtype and v.device == p.device
                if s.has_step:
                    assert storage_key(st["step"]) == storage_key(s.steps) and st["step"].storage_offset() == k
                n += 1
    return n


# -------------------------------------------------------- errors that change nothing
def snapshot(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> tuple:
    """What a rejected step / load / add_param_group must leave as it was (see `assert_unchanged`)."""
    return (copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params], [p.data_ptr() for p in params],
            getattr(opt, "recombine_count", None), len(opt.param_groups))


def assert_unchanged(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], snap: tuple) -> None:
    """Params (values and storage), groups, every state entry and the re-combine counter as in `snap`."""
    sd, values, ptrs, count, n_groups = snap
    assert len(opt.param_groups) == n_groups, "a param group was added"
    assert [p.data_ptr() for p in params] == ptrs, "params were rebound"
    for k, (p, v) in enumerate(zip(params, values)):
        assert torch.equal(p, v), f"param {k} changed"
    now = opt.state_dict()
    assert now["param_groups"] == sd["param_groups"]
    assert list(now["state"]) == list(sd["state"])
    for k, st in sd["state"].items():
        assert list(now["state"][k]) == list(st), f"state {k}: entries changed"
        for n, v in st.items():
            same = torch.equal(now["state"][k][n], v) if isinstance(v, torch.Tensor) else now["state"][k][n] == v
            assert same, f"state {k} entry {n!r} changed"
    assert getattr(opt, "recombine_count", None) == count


def check_sparse_grad_rejected(make_opt: Callable[[list], torch.optim.Optimizer], stepped: bool = False,
                               match: str = "sparse") -> None:
    """A sparse grad (an Embedding(sparse=True)) among dense ones: RuntimeError matching `match`, nothing changed.

    ``make_opt(params)``: an optimizer class or factory. ``stepped``: one dense step first (the params are
    combined and have state when the sparse grad arrives).
    """
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 2)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    params = [*lin.parameters(), emb.weight]
    opt = make_opt(params)
    if stepped:
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    opt.zero_grad(set_to_none=True)
    lin(emb(torch.tensor([1, 2, 3]))).sum().backward()
    assert emb.weight.grad.is_sparse
    snap = snapshot(opt, params)
    with pytest.raises(RuntimeError, match=match):
        opt.step()
    assert_unchanged(opt, params, snap)


# -------------------------------------------------------- float64 reference
class RefOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer running a Spec's float64 reference step per param (torch's skip rule)."""

    def __init__(self, params, spec: Spec, defaults: dict):
        self._spec = spec
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                t = int(st["step"]) if "step" in st else int(st.get("_count", 0))
                prev = {k: v for k, v in st.items() if k not in ("step", "_count")}
                out = self._spec.ref(p.double(), p.grad.double(), prev, t, group, None)
                p.copy_(out.pop("param"))
                if self._spec.has_step:
                    st["step"] = torch.tensor(float(t + 1))
                else:
                    st["_count"] = t + 1
                st.update(out)


def reference_for(spec: Spec, groups, kind: str, executor: str = "auto"):
    """'torch': spec.torch_cls (its fused kernel where ours, on ``executor``, runs that: `runs_torch_fused`);
    'f64': the float64 reference optimizer."""
    if kind == "torch":
        first = next((p for g in groups for p in g["params"]), None)
        fused = first is not None and runs_torch_fused(spec.torch_cls, first.device, first.dtype, executor)
        return spec.torch_cls(groups, **spec.base, **({"fused": True} if fused else {}))
    # the same defaults as our class's signature
    sig = inspect.signature(spec.ours).parameters.values()
    defaults = {a.name: a.default for a in sig if a.default is not inspect.Parameter.empty}
    return RefOptimizer(groups, spec, dict(defaults, **spec.base))


def group_dicts(params: Sequence[torch.Tensor], layout: Sequence[Tuple[int, dict]]) -> List[dict]:
    """Splits params into consecutive groups: layout = [(count, hyperparameters), ...]."""
    groups, i = [], 0
    for n, hp in layout:
        groups.append(dict(hp, params=list(params[i:i + n])))
        i += n
    return groups


def assert_states(ours, ours_params, ref, ref_params, what: str, exact_keys: bool = True) -> None:
    for k, (p, q) in enumerate(zip(ours_params, ref_params)):
        sa = {n: v for n, v in ours.state.get(p, {}).items()}
        sb = {n: v for n, v in ref.state.get(q, {}).items() if n != "_count"}
        keys_a, keys_b = (list(sa), list(sb)) if exact_keys else (sorted(sa), sorted(sb))
        assert keys_a == keys_b, f"{what}: param {k} state keys {keys_a} != reference {keys_b}"
        for n, v in sb.items():
            if n == "step":
                assert float(sa[n]) == float(v), f"{what}: param {k} step {float(sa[n])} != {float(v)}"
                continue
            scale = max(float(v.detach().double().abs().max()), 1e-30) if v.numel() else 1.0
            assert sa[n].dtype == p.dtype and sa[n].shape == p.shape, f"{what}: param {k} state {n} layout"
            assert_close_rel(sa[n], v, scale, f"{what}: param {k} state {n!r}")


# ------------------------------------------------------------------ checks
def run_side_by_side(
    spec: Spec,
    layout: Sequence[Tuple[int, dict]],
    *,
    device: str,
    seed: int,
    ref_kind: str,
    steps: int = 30,
    shapes=None,
    skip: Callable[[int, int], bool] = lambda step, k: False,
    frozen: Sequence[int] = (),
    between: Optional[Callable[[int, object, object], None]] = None,
    gscale: Optional[Callable[[int], float]] = None,
):
    """Runs ours and a reference for `steps` steps on the same random grads; asserts params/states match.

    ``skip(step, k)``: param k has grad None at that step. ``frozen``: params with requires_grad=False.
    ``between(step, ours, ref)``: called before each step (LR schedulers, hyperparameter changes).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n = sum(c for c, _ in layout)
    shapes = shapes or random_shapes(rng, n)
    ref_dtype = torch.float32 if ref_kind == "torch" else torch.float64
    p0 = make_params(shapes, torch.float32, "cpu", gen)
    ours_params = [torch.nn.Parameter(t.detach().clone().to(device)) for t in p0]
    ref_params = [torch.nn.Parameter(t.detach().clone().to(device=device, dtype=ref_dtype)) for t in p0]
    for k in frozen:
        ours_params[k].requires_grad_(False)
        ref_params[k].requires_grad_(False)
    ours = spec.ours(group_dicts(ours_params, layout), **spec.base)
    ref = reference_for(spec, group_dicts(ref_params, layout), ref_kind, getattr(ours, "executor", "auto"))
    p0max = max(float(t.detach().abs().max()) for t in p0 if t.numel())
    gscale = gscale or (lambda k: 1.0)
    for step in range(steps):
        if between is not None:
            between(step, ours, ref)
        for k, p in enumerate(ours_params):
            g = torch.randn(p.shape, generator=gen, dtype=torch.float64) * gscale(k)
            set_grad(p, None if (k in frozen or skip(step, k)) else g.to(device=device, dtype=torch.float32))
        mirror_grads(ours_params, ref_params)
        ours.step()
        ref.step()
        assert ours.last_executor in ("apex_C", "torch")
    for k, (p, q) in enumerate(zip(ours_params, ref_params)):
        assert_close_rel(p, q, p0max, f"param {k}")
    # torch's key order too; the float64 reference's dicts are compared as sets
    assert_states(ours, ours_params, ref, ref_params, "states", exact_keys=ref_kind == "torch")
    return ours, ours_params, ref, ref_params


def check_low_precision(spec: Spec, hp: dict, dtype: torch.dtype, *, device: str, seed: int, steps: int = 30,
                        gscale: float = 1.0, skip: Callable[[int, int], bool] = lambda step, k: False):
    """Per step, every stored value within 1 ulp of the float64 update from our previous values."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    params = make_params(random_shapes(rng), dtype, device, gen)
    opt = spec.ours(params, **dict(spec.base, **hp))
    group = opt.param_groups[0]
    for step in range(steps):
        prev = []
        for k, p in enumerate(params):
            st = opt.state.get(p, {})
            t = int(st["step"]) if "step" in st else 0
            prev.append((p.detach().double().clone(), {n: v.double().clone() for n, v in st.items() if n != "step"}, t))
            g = None if skip(step, k) else (torch.randn(p.shape, generator=gen) * gscale).to(device=device, dtype=dtype)
            set_grad(p, g)
        opt.step()
        for k, p in enumerate(params):
            p_prev, st_prev, t = prev[k]
            if p.grad is None:
                assert torch.equal(p.detach().double(), p_prev), f"step {step}: param {k} without grad changed"
                continue
            st_new = {n: v.double() for n, v in opt.state[p].items() if n != "step"}
            exp = spec.ref(p_prev, p.grad.double(), st_prev, t, group, st_new)
            assert_ulp(p, exp["param"], dtype, p_prev.abs() + exp["param"].abs(), f"step {step} param {k}")
            for n, v in st_new.items():
                scale = exp[n].abs() + (st_prev[n].abs() if n in st_prev else spec.state_fill.get(n, 0.0))
                assert_ulp(v, exp[n], dtype, scale, f"step {step} param {k} state {n!r}")
            assert sorted(st_new) == sorted(n for n in exp if n != "param")
    return opt


def check_zero_grad(spec: Spec, hp: dict, set_to_none: bool, *, device: str, ref_kind: str, steps: int = 6):
    """Grads from backward through a model, zeroed either way between steps; ours vs the reference."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(device)
    ref_dtype = torch.float32 if ref_kind == "torch" else torch.float64
    ref_model = copy.deepcopy(model).to(ref_dtype)
    ours = spec.ours(model.parameters(), **dict(spec.base, **hp))
    ref = reference_for(spec, [dict(hp, params=list(ref_model.parameters()))], ref_kind,
                        getattr(ours, "executor", "auto"))
    x = torch.randn(11, 5, device=device)
    p0max = max(float(p.detach().abs().max()) for p in model.parameters())
    for step in range(steps):
        ours.zero_grad(set_to_none=set_to_none)
        if set_to_none:
            assert all(p.grad is None for p in model.parameters())
        elif step:
            assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        model(x * (1 + step)).pow(2).mean().backward()
        mirror_grads(list(model.parameters()), list(ref_model.parameters()))
        ours.step()
        ref.step()
        assert ours.last_executor == expected_executor(device)
    for k, (p, q) in enumerate(zip(model.parameters(), ref_model.parameters())):
        assert_close_rel(p, q, p0max, f"param {k}")


def check_grad_scale_folded(spec: Spec, hp: dict, *, device: str, steps: int = 5):
    """apex_grad_scale (amp's folded unscale) = the same step on unscaled grads; p.grad is left scaled."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(4, 3), (5,), ()]
    a = make_params(shapes, torch.float32, device, gen)
    b = [torch.nn.Parameter(t.detach().clone()) for t in a]
    oa = spec.ours(a, **dict(spec.base, **hp))
    ob = spec.ours(b, **dict(spec.base, **hp))
    for _ in range(steps):
        for p, q in zip(a, b):
            g = torch.randn(p.shape, generator=gen).to(device)
            set_grad(p, g * 1024.0)
            set_grad(q, g)
        oa.apex_grad_scale = 1.0 / 1024.0
        oa.step()
        ob.step()
        for p, q in zip(a, b):
            assert torch.equal(p.grad, q.grad * 1024.0), "the scaled grads must be left as they were"
    for k, (p, q) in enumerate(zip(a, b)):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"param {k}: {m}")


def check_invalid(spec: Spec, bad: Sequence[Tuple[dict, str]], *, device: str) -> None:
    """Each bad hyperparameter: ValueError naming what was expected and received; nothing changes."""
    p = torch.nn.Parameter(torch.randn(3, device=device))
    q = torch.nn.Parameter(torch.randn(2, device=device))
    for kwargs, pattern in bad:
        with pytest.raises(ValueError, match=pattern) as info:
            spec.ours([p], **dict(spec.base, **kwargs))
        msg = str(info.value)
        assert "expected" in msg and "got" in msg, f"error lacks expected/received: {msg}"
    opt = spec.ours([p], **spec.base)
    p.grad = torch.randn_like(p)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    p_before = p.detach().clone()
    for kwargs, pattern in bad:
        with pytest.raises(ValueError, match=pattern):
            opt.add_param_group(dict(kwargs, params=[q]))
        assert len(opt.param_groups) == 1
        sd = copy.deepcopy(before)
        sd["param_groups"][0].update(kwargs)
        with pytest.raises(ValueError, match=pattern):
            opt.load_state_dict(sd)
        assert_same_state_dict(opt.state_dict(), before)
    opt.step()  # still usable, and the failed calls changed nothing it uses
    assert not torch.equal(p.detach(), p_before)


def paired_state_entries(a: dict, b: dict):
    """Asserts two state_dicts hold the same params and state names in the same order; yields
    (param index, state name, a's value, b's value)."""
    assert list(a["state"]) == list(b["state"])
    for k in a["state"]:
        assert list(a["state"][k]) == list(b["state"][k])
        for n, v in a["state"][k].items():
            yield k, n, v, b["state"][k][n]


def assert_same_state_dict(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    for k, n, v, w in paired_state_entries(a, b):
        assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, f"state {k} {n}"


def check_resume_bitwise(spec: Spec, hp: dict, *, device: str, executor: str, steps: int = 8) -> None:
    """state_dict mid-run, load into a fresh optimizer: the rest of the run is bit-for-bit the same."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(6, 4), (3,), (2, 2, 2)]
    p0 = make_params(shapes, torch.float32, device, gen)
    grads = [[torch.randn(s, generator=gen).to(device) for s in shapes] for _ in range(steps)]
    a = [torch.nn.Parameter(t.detach().clone()) for t in p0]
    oa = spec.ours(a, **dict(spec.base, **hp))
    b = [torch.nn.Parameter(t.detach().clone()) for t in p0]
    ob = spec.ours(b, **dict(spec.base, **hp))
    for i in range(steps):
        for p, q, g in zip(a, b, grads[i]):
            set_grad(p, g)
            set_grad(q, g)
        oa.step()
        ob.step()
        if i == steps // 2:
            saved = copy.deepcopy(ob.state_dict())
            b = [torch.nn.Parameter(q.detach().clone()) for q in b]
            ob = spec.ours(b, **dict(spec.base, **hp))
            ob.load_state_dict(saved)
    assert ob.last_executor == executor
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    for p, q in zip(a, b):
        for n, v in oa.state[p].items():
            assert torch.equal(v, ob.state[q][n]), n


def check_torch_state_dict(spec: Spec, hp: dict, *, device: str, steps: int = 5) -> None:
    """Same state_dict layout as torch.optim; torch -> ours and ours -> torch continue as torch would."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(5, 3), (4,), ()]
    p0 = make_params(shapes, torch.float32, device, gen)
    grads = [[torch.randn(s, generator=gen).to(device) for s in shapes] for _ in range(2 * steps)]

    def run(opt, params, span):
        for i in span:
            for p, g in zip(params, grads[i]):
                set_grad(p, g)
            opt.step()

    def fresh(cls, **kw):
        params = [torch.nn.Parameter(t.detach().clone()) for t in p0]
        return cls(params, **dict(spec.base, **hp, **kw)), params

    ours, po = fresh(spec.ours)
    ref, pr = fresh(spec.torch_cls)
    run(ours, po, range(steps))
    run(ref, pr, range(steps))
    so, sr = ours.state_dict(), ref.state_dict()
    assert [list(g) for g in so["param_groups"]] == [list(g) for g in sr["param_groups"]]
    assert so["param_groups"] == sr["param_groups"]
    for k, n, v, w in paired_state_entries(sr, so):
        assert type(w) is type(v) and w.dtype == v.dtype and w.shape == v.shape, (k, n)
        # compact: a saved entry holds only its own elements, not the combined buffer
        assert w.untyped_storage().nbytes() == w.numel() * w.element_size(), (k, n)
    p_mid = [p.detach().clone() for p in pr]

    # torch -> ours
    ours2, po2 = fresh(spec.ours)
    with torch.no_grad():
        for p, t in zip(po2, p_mid):
            p.copy_(t)
    ours2.load_state_dict(copy.deepcopy(sr))
    # ours -> torch
    ref2, pr2 = fresh(spec.torch_cls)
    with torch.no_grad():
        for p, t in zip(pr2, po):
            p.copy_(t)
    ref2.load_state_dict(copy.deepcopy(so))
    run(ref, pr, range(steps, 2 * steps))
    run(ours2, po2, range(steps, 2 * steps))
    run(ref2, pr2, range(steps, 2 * steps))
    p0max = max(float(t.detach().abs().max()) for t in p0)
    for k in range(len(p0)):
        assert_close_rel(po2[k], pr[k], p0max, f"torch -> ours: param {k}")
        assert_close_rel(pr2[k], pr[k], p0max, f"ours -> torch: param {k}")
    assert_states(ours2, po2, ref, pr, "torch -> ours")


def lr_schedule_hook(kind: str):
    """`between` hook attaching the same LR scheduler to both optimizers and stepping it each step."""
    made = {}

    def between(step, ours, ref):
        if not made:
            for name, opt in (("ours", ours), ("ref", ref)):
                if kind == "step":
                    made[name] = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.3)
                else:
                    made[name] = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
        elif step:
            made["ours"].step()
            made["ref"].step()
            assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]

    return between


# ------------------------------------------------------------ shared tests
PATTERNS = {"lr": "learning rate", "eps": "epsilon", "e": "epsilon"}


def invalid_values(**values) -> List[Tuple[dict, str]]:
    """Bad single hyperparameters for `check_invalid`: name=value or name=[values]; the error must name the
    option (lr as "learning rate", eps / e as "epsilon", the rest by their keyword)."""
    out = []
    for name, vs in values.items():
        for v in vs if isinstance(vs, list) else [vs]:
            out.append(({name: v}, PATTERNS.get(name, name)))
    return out


def _no_skip(step: int, k: int) -> bool:
    return False


@dataclass
class Suite:
    """The tests every Spec-described optimizer shares, configured per optimizer.

    A test module installs them under their usual names with ``globals().update(SUITE.tests())``.
    ``ref_kind`` "torch" compares with ``spec.torch_cls``, "f64" with the float64 reference.
    """

    spec: Spec
    ref_kind: str
    #: the hyperparameters of the LR scheduler, zero_grad, folded grad scale and resume tests
    hp: dict
    #: drawn hyperparameters: random.Random(random_seed + seed) for seed in range(4)
    random_seed: int
    #: run_side_by_side kwargs of the param-groups test: layout, seed, frozen, skip
    groups: dict
    #: (first hyperparameters, {step: group changes made before that step}) of the changes test
    changes: Tuple[dict, Dict[int, dict]]
    #: check_low_precision kwargs of the low-precision test (seed, skip, gscale)
    low: dict
    #: bad hyperparameters, as `invalid_values` gives them
    invalid: Sequence[Tuple[dict, str]]
    #: when given, the low-precision test runs each of these hyperparameter sets
    low_variants: Optional[Dict[str, dict]] = None
    #: the torch state_dict test's hyperparameter sets (None: `hp` alone); only with spec.torch_cls
    state_dict_variants: Optional[Dict[str, dict]] = None
    executors: Tuple[str, ...] = ("apex_C", "torch")
    #: grad size per param index for the random, param-groups and changes runs
    gscale: Optional[Callable[[int], float]] = None
    #: params without a grad on some steps in the odd-seeded random runs
    random_skip: Callable[[int, int], bool] = _no_skip
    zero_grad_hp: Optional[dict] = None
    grad_scale_hp: Optional[dict] = None
    resume_hp: Optional[dict] = None
    low_hp: Optional[dict] = None

    def tests(self) -> Dict[str, Callable]:
        s = self
        run = dict(ref_kind=s.ref_kind, gscale=s.gscale)
        out = {}

        @pytest.mark.parametrize("executor", s.executors)
        @pytest.mark.parametrize("seed", range(4))
        def random_hyperparameters(seed, executor, device, monkeypatch):
            """Drawn hyperparameters and shapes (seeded): params and every state vs the reference."""
            expected = use_executor(monkeypatch, executor, device)
            hp = s.spec.draw(random.Random(s.random_seed + seed))
            skip = s.random_skip if seed % 2 else _no_skip
            ours, *_ = run_side_by_side(s.spec, [(4, hp)], device=device, seed=seed, skip=skip, **run)
            assert ours.last_executor == expected

        which = "torch" if s.ref_kind == "torch" else "reference"
        out[f"test_matches_{which}_random_hyperparameters"] = random_hyperparameters

        def test_param_groups_frozen_and_skipped_params(device):
            """Groups with different options; a frozen param; params whose grad is None on some steps."""
            ours, *_ = run_side_by_side(s.spec, device=device, **s.groups, **run)
            assert ours.last_executor == expected_executor(device)

        def test_hyperparameter_changes_take_effect(device):
            first, changes = s.changes

            def between(step, ours, ref):
                for opt in (ours, ref):
                    opt.param_groups[0].update(changes.get(step, {}))

            run_side_by_side(s.spec, [(4, first)], device=device, seed=3, between=between, **run)

        @pytest.mark.parametrize("kind", ["step", "lambda"])
        def test_lr_scheduler(kind, device):
            run_side_by_side(s.spec, [(3, s.hp)], device=device, seed=4, ref_kind=s.ref_kind, steps=12,
                             between=lr_schedule_hook(kind))

        @pytest.mark.parametrize("set_to_none", [True, False])
        def test_zero_grad(set_to_none, device):
            check_zero_grad(s.spec, s.zero_grad_hp or s.hp, set_to_none, device=device, ref_kind=s.ref_kind)

        def low_precision(hp, dtype, executor, device, monkeypatch):
            use_executor(monkeypatch, executor, device)
            opt = check_low_precision(s.spec, hp, dtype, device=device, **s.low)
            assert opt.last_executor == executor

        def low_precision_one(dtype, executor, device, monkeypatch):
            low_precision(s.low_hp or s.hp, dtype, executor, device, monkeypatch)

        @pytest.mark.parametrize("variant", list(s.low_variants or ()))
        def low_precision_variants(variant, dtype, executor, device, monkeypatch):
            low_precision(s.low_variants[variant], dtype, executor, device, monkeypatch)

        low_test = low_precision_one if s.low_variants is None else low_precision_variants
        low_test = pytest.mark.parametrize("dtype", LOW, ids=str)(low_test)
        out["test_low_precision_within_one_ulp"] = pytest.mark.parametrize("executor", ["apex_C", "torch"])(low_test)

        def test_grad_scale_folded(device):
            check_grad_scale_folded(s.spec, s.grad_scale_hp or s.hp, device=device)

        def test_invalid_hyperparameters(device):
            check_invalid(s.spec, s.invalid, device=device)

        @pytest.mark.parametrize("executor", ["apex_C", "torch"])
        def test_resume_is_bitwise(executor, device, monkeypatch):
            use_executor(monkeypatch, executor, device)
            check_resume_bitwise(s.spec, s.resume_hp or s.hp, device=device, executor=executor)

        for f in (test_param_groups_frozen_and_skipped_params, test_hyperparameter_changes_take_effect,
                  test_lr_scheduler, test_zero_grad, test_grad_scale_folded, test_invalid_hyperparameters,
                  test_resume_is_bitwise):
            out[f.__name__] = f
        if s.spec.torch_cls is not None:
            out["test_state_dict_matches_torch"] = self._state_dict_test()
        return out

    def _state_dict_test(self) -> Callable:
        s = self
        if s.state_dict_variants is None:

            def test_state_dict_matches_torch(device):
                check_torch_state_dict(s.spec, s.hp, device=device)

            return test_state_dict_matches_torch

        @pytest.mark.parametrize("variant", list(s.state_dict_variants))
        def test_state_dict_variant_matches_torch(variant, device):
            check_torch_state_dict(s.spec, s.state_dict_variants[variant], device=device)

        return test_state_dict_variant_matches_torch


# ------------------------------------- grouped params (AdamP, LAMB): [[params of group 0], [group 1], ...]
def flat(groups):
    return [p for ps in groups for p in ps]


def assert_within_ulp(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """|ours - ref| <= 1 ulp of `dtype` at the larger magnitude (no evaluation slack, unlike assert_ulp)."""
    ours64 = ours.double().cpu()
    fi = torch.finfo(dtype)
    mag = torch.maximum(ours64.abs(), ref.abs()).clamp_min(fi.smallest_normal)
    tol = torch.exp2(torch.floor(torch.log2(mag))) * fi.eps
    err = (ours64 - ref).abs()
    bad = err > tol
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} elements off by more than 1 ulp of {dtype}; worst error "
        f"{float((err / tol).max()):.3f} ulp"
    )


def select_executor(opt, executor: str, device: str) -> str:
    """executor "apex_C" (CPU kernels, the default there) or "torch" (torch ops on the flat buffers, as on
    other devices); returns the expected `last_executor`."""
    if executor == "apex_C" and device != "cpu":
        pytest.skip("the C++ kernels run on CPU buffers")
    opt.executor = "auto" if executor == "apex_C" else "torch"
    return executor


def set_grads(params, grads, scale: float = 1.0) -> None:
    for ps, gs in zip(params, grads):
        for p, g in zip(ps, gs):
            if g is None:
                p.grad = None
            elif p.grad is None:
                p.grad = g * scale
            else:
                p.grad.copy_(g * scale)  # in place: the combined grad views stay bound


def stored_moments(opt, params):
    """(exp_avg, exp_avg_sq) as the optimizer stored them, grouped like `params` (None before a first step)."""
    return tuple([[opt.state[p][k] if p in opt.state else None for p in ps] for ps in params]
                 for k in ("exp_avg", "exp_avg_sq"))


class MomentsRef:
    """float64 params and Adam moments per grouped param, for the references of AdamP and LAMB."""

    def __init__(self, params):
        self.p = [[p.detach().double().cpu() for p in ps] for ps in params]
        self.m = [[torch.zeros_like(p) for p in ps] for ps in self.p]
        self.v = [[torch.zeros_like(p) for p in ps] for ps in self.p]
        self.steps = [[0 for _ in ps] for ps in self.p]

    def moments(self, gi: int, pi: int, g: torch.Tensor, betas, low=None, stored=None):
        """Updates m, v (rounded to `low` when given); returns the pair the update uses: ours as stored when
        `stored` (exp_avg, exp_avg_sq lists) is given (those are checked against ours separately)."""
        b1, b2 = betas
        m = b1 * self.m[gi][pi] + (1 - b1) * g
        v = b2 * self.v[gi][pi] + (1 - b2) * g * g
        if low is not None:
            m, v = m.to(low).double(), v.to(low).double()
        self.m[gi][pi], self.v[gi][pi] = m, v
        if stored is not None:
            m, v = stored[0][gi][pi].double().cpu(), stored[1][gi][pi].double().cpu()
        return m, v

    def load_from(self, opt, params):
        """Restart from the optimizer's current values (per-step low-precision checks)."""
        for gi, ps in enumerate(params):
            for pi, p in enumerate(ps):
                self.p[gi][pi] = p.detach().double().cpu()
                st = opt.state.get(p)
                if st:
                    self.m[gi][pi] = st["exp_avg"].double().cpu()
                    self.v[gi][pi] = st["exp_avg_sq"].double().cpu()


def step_with_ref(opt, ref, params, grads_at, steps: int, executor: Optional[str] = None, after=None) -> None:
    """`steps` steps of ours and the reference on grads_at(step); `after(grads)` checks each step."""
    for step in range(steps):
        grads = grads_at(step)
        set_grads(params, grads)
        opt.step()
        ref.step(grads)
        if executor is not None:
            assert opt.last_executor == executor
        if after is not None:
            after(grads)


def assert_grouped_fp32(opt, params, ref, *, scaled_atol: bool = False, states: bool = True) -> None:
    """Params (atol 1e-6, times max(1, max|p|) when scaled_atol), moments and step counts vs the reference."""
    for gi, ps in enumerate(params):
        for pi, p in enumerate(ps):
            atol = 1e-6 * (max(1.0, float(ref.p[gi][pi].abs().max())) if scaled_atol else 1.0)
            torch.testing.assert_close(p.detach().double().cpu(), ref.p[gi][pi], rtol=1e-5, atol=atol)
            if not states:
                continue
            st = opt.state[p]
            torch.testing.assert_close(st["exp_avg"].double().cpu(), ref.m[gi][pi], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(st["exp_avg_sq"].double().cpu(), ref.v[gi][pi], rtol=1e-5, atol=1e-9)
            assert int(st["step"]) == ref.steps[gi][pi]  # params without a grad do not advance


def check_low_precision_grouped(opt, params, ref, grads_at, dtype, executor: str, steps: int = 6) -> None:
    """Per step, from our previous values: stored m, v within 1 ulp of their float64 values, the param within
    1 ulp of the float64 update formed from the m, v we stored."""
    for step in range(steps):
        ref.load_from(opt, params)
        grads = grads_at(step)
        set_grads(params, grads)
        opt.step()
        assert opt.last_executor == executor
        ref.step(grads, low=dtype, stored=stored_moments(opt, params))
        for gi, ps in enumerate(params):
            for pi, p in enumerate(ps):
                if grads[gi][pi] is None:
                    continue
                st = opt.state[p]
                assert p.dtype == st["exp_avg"].dtype == dtype
                assert_within_ulp(st["exp_avg"], ref.m[gi][pi], dtype, f"exp_avg {gi}.{pi} step {step}")
                assert_within_ulp(st["exp_avg_sq"], ref.v[gi][pi], dtype, f"exp_avg_sq {gi}.{pi} step {step}")
                assert_within_ulp(p.detach(), ref.p[gi][pi], dtype, f"param {gi}.{pi} step {step}")


def lockstep(pa, oa, pb, ob, grads_at, steps: int, scale_b: float = 1.0) -> None:
    """Both optimizers get the same grads, grads_at(step) (the second ones times scale_b)."""
    for step in range(steps):
        grads = grads_at(step)
        set_grads(pa, grads)
        set_grads(pb, grads, scale_b)
        oa.step()
        ob.step()


def assert_executors_agree(ok, pk, ot, pt) -> None:
    """Params and moments of two runs (kernel, torch executor) within rtol 1e-5."""
    for a, b in zip(flat(pk), flat(pt)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
        for name, atol in (("exp_avg", 1e-7), ("exp_avg_sq", 1e-9)):  # m may cancel to ~0: absolute floor
            torch.testing.assert_close(ok.state[a][name], ot.state[b][name], rtol=1e-5, atol=atol)


def check_resume_grouped(new_opt, new_params, grads_at, check_saved, state_name: str) -> None:
    """A run saved after 3 of 6 steps and resumed in a fresh optimizer ends bit for bit like an unbroken run.

    ``grads_at(params, step)`` draws the grads; ``check_saved(state_dict)`` looks at the checkpoint.
    """
    full, half = new_params(), new_params()
    o_full, o_half = new_opt(full), new_opt(half)
    for step in range(3):
        for ps, o in ((full, o_full), (half, o_half)):
            set_grads(ps, grads_at(ps, step))
            o.step()
    sd = copy.deepcopy(o_half.state_dict())
    check_saved(sd)
    resumed = [[p.detach().clone().requires_grad_() for p in ps] for ps in half]
    o_res = new_opt(resumed)
    o_res.load_state_dict(sd)
    for step in range(3, 6):
        for ps, o in ((full, o_full), (resumed, o_res)):
            set_grads(ps, grads_at(ps, step))
            o.step()
    for a, b in zip(flat(full), flat(resumed)):
        assert torch.equal(a, b)
        assert torch.equal(o_full.state[a][state_name], o_res.state[b][state_name])


def check_rejected_option(cls, kw: dict, exc: type, p: torch.Tensor) -> None:
    """A bad option fails in the constructor and in add_param_group, which then adds nothing."""
    with pytest.raises(exc):
        cls([p], **kw)
    opt = cls([p])
    with pytest.raises(exc):
        opt.add_param_group(dict(params=[torch.zeros(2, requires_grad=True)], **kw))
    assert len(opt.param_groups) == 1


def import_timm_module(name: str):
    """timm's optimizer files need only torch; `import timm` itself pulls torchvision, so it is bypassed."""
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("timm is not installed (optional outside peer)")
    root = next(iter(spec.submodule_search_locations))
    saved = {k: sys.modules.get(k) for k in ("timm", "timm.optim")}
    try:
        for pkg, path in (("timm", root), ("timm.optim", os.path.join(root, "optim"))):
            if pkg not in sys.modules:
                mod = types.ModuleType(pkg)
                mod.__path__ = [path]
                sys.modules[pkg] = mod
        return importlib.import_module(f"timm.optim.{name}")
    except Exception as exc:  # pragma: no cover - depends on the installed timm
        pytest.skip(f"timm.optim.{name} cannot be imported here: {exc}")
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
