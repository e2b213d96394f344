"""``resize_`` on a tensor the optimizer hands out (a state entry, ``p.grad`` bound to its slot, ``state['step']``)
after a step.

Growing such a view reallocates the storage it shares with every other slot of its flat buffer, so the kernel
must not keep the old address: the next step re-combines the group, which validates the views first. A view
resized to a shape its param cannot have is refused with the param and the key named, nothing changed; one
brought back to its shape trains on as a twin that never resized it (bitwise). (A view shrunk in place, which
moves nothing, is not seen: the kernel keeps updating its slot, memory-safe.)
"""

from __future__ import annotations

import copy

import pytest
import torch

import apex.optimizers as O

N = 1000  # one param per set: a view grown to 2N cannot fit in the old storage

MAKERS = {
    "FusedAdam": lambda ps: O.FusedAdam(ps, lr=1e-2),
    "NpuFusedAdam": lambda ps: O.NpuFusedAdam(ps, lr=1e-2),
    "NpuFusedAdamW": lambda ps: O.NpuFusedAdamW(ps, lr=1e-2),
    "NpuFusedSGD": lambda ps: O.NpuFusedSGD(ps, lr=1e-2, momentum=0.9),
    "FusedSGD": lambda ps: O.FusedSGD(ps, lr=1e-2, momentum=0.9),
    "FusedLAMB": lambda ps: O.FusedLAMB(ps, lr=1e-2),
    "NpuFusedLamb": lambda ps: O.NpuFusedLamb(ps, lr=1e-2),
    "NpuFusedAdadelta": lambda ps: O.NpuFusedAdadelta(ps, lr=1.0),
    "NpuFusedAdamP": lambda ps: O.NpuFusedAdamP(ps, lr=1e-2),
    "NpuFusedBertAdam": lambda ps: O.NpuFusedBertAdam(ps, lr=1e-2),
    "NpuFusedRMSprop": lambda ps: O.NpuFusedRMSprop(ps, lr=1e-2),
    "FusedAdagrad": lambda ps: O.FusedAdagrad(ps, lr=1e-2),
    "FusedNovoGrad": lambda ps: O.FusedNovoGrad(ps, lr=1e-2),
    "FusedMixedPrecisionLamb": lambda ps: O.FusedMixedPrecisionLamb(ps, lr=1e-2),
}


def _grads(step):
    g = torch.Generator().manual_seed(step)
    return [torch.randn(N, generator=g), torch.randn(7, 5, generator=g)]


def _pair(name):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(N)), torch.nn.Parameter(torch.randn(7, 5))]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    return ps, MAKERS[name](ps), twin, MAKERS[name](twin)


def _step(ps, opt, step, keep=False):
    if keep and ps[0].grad is not None:
        for p, g in zip(ps, _grads(step)):
            p.grad.copy_(g)
    else:
        for p, g in zip(ps, _grads(step)):
            p.grad = g
    opt.step()


def _state_entries(opt, p):
    return [k for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and v.numel() == p.numel()]


@pytest.mark.parametrize("name", list(MAKERS))
def test_grown_state_entry_is_refused_then_trains_on_when_restored(name):
    ps, opt, twin, topt = _pair(name)
    for i in range(2):
        _step(ps, opt, i)
        _step(twin, topt, i)
    keys = _state_entries(opt, ps[0])
    assert keys, f"{name} keeps no param-shaped state"
    key = keys[0]
    view = opt.state[ps[0]][key]
    view.resize_(2 * N)
    before_p = [p.detach().clone() for p in ps]
    before_s = copy.deepcopy({k: v for k, v in opt.state[ps[1]].items()})
    for p, g in zip(ps, _grads(2)):
        p.grad = g
    with pytest.raises(ValueError, match=rf"state '{key}' of param 0 has {2 * N} elements; expected {N}"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ps, before_p))
    for k, v in before_s.items():
        assert torch.equal(torch.as_tensor(opt.state[ps[1]][k]), torch.as_tensor(v))
    view.resize_(N)  # back to its shape: the values resize_ kept are the state's
    opt.step()
    _step(twin, topt, 2)
    for i in range(3, 5):
        _step(ps, opt, i)
        _step(twin, topt, i)
    for a, b in zip(ps, twin):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["FusedAdam", "NpuFusedAdam", "NpuFusedSGD", "FusedLAMB"])
def test_grad_buffer_moved_by_resize_is_read_where_it_now_is(name):
    """Grads kept in their slots (``zero_grad(set_to_none=False)``), then ``p.grad.resize_`` grows and restores
    one: the whole flat grad buffer moved, and later steps read it there."""
    ps, opt, twin, topt = _pair(name)
    for i in range(2):
        _step(ps, opt, i, keep=True)
        _step(twin, topt, i, keep=True)
        opt.zero_grad(set_to_none=False)
        topt.zero_grad(set_to_none=False)
    ps[0].grad.resize_(2 * N)
    ps[0].grad.resize_(N)
    for i in range(2, 6):
        _step(ps, opt, i, keep=True)
        _step(twin, topt, i, keep=True)
    for a, b in zip(ps, twin):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["NpuFusedAdam", "FusedAdam", "NpuFusedAdadelta"])
def test_step_count_moved_by_resize(name):
    ps, opt, twin, topt = _pair(name)
    _step(ps, opt, 0)
    _step(twin, topt, 0)
    step = opt.state[ps[0]].get("step")
    if not isinstance(step, torch.Tensor):
        pytest.skip(f"{name} keeps its step count per group")
    step.resize_(1 << 16)  # the step table moves
    step.resize_(())
    for i in range(1, 4):
        _step(ps, opt, i)
        _step(twin, topt, i)
    for a, b in zip(ps, twin):
        assert torch.equal(a, b)
    opt.state[ps[0]]["step"].resize_(1 << 16)
    opt.state[ps[0]]["step"].resize_(0)  # moved, and left with no count
    before = [p.detach().clone() for p in ps]
    with pytest.raises(TypeError, match="state 'step' of param 0"):
        _step(ps, opt, 4)
    assert all(torch.equal(a, b) for a, b in zip(ps, before))
