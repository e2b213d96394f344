"""Scenarios run on every rank of a spawned gloo group (see _dist_harness.py).

Each function takes ``(rank, world, **kwargs)`` and returns picklable results.
Data: every step draws one global batch from a generator seeded by the step
(identical on all ranks); rank r trains on rows [r*b, (r+1)*b) with a mean loss,
so the all-reduced average gradient equals the single-process gradient of the
mean loss over the whole batch.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from apex import amp
from apex.optimizers import NpuFusedAdam, NpuFusedSGD
from apex.parallel import CollectiveError, DistributedDataParallel, SyncBatchNorm, convert_syncbn_model, reducer

IN, HID, OUT = 8, 24, 4
LOCAL = 4  # rows per rank and step


def make_model(seed: int, extra: bool = False, kind: str = "mlp") -> torch.nn.Module:
    """A small MLP; kind "bn" puts a BatchNorm1d after the first layer (converted to SyncBatchNorm when distributed)."""
    g = torch.Generator().manual_seed(seed)
    norm = [torch.nn.BatchNorm1d(HID)] if kind == "bn" else []
    # (no bias before a batch norm: its gradient is zero up to rounding, which Adam would amplify)
    layers = [torch.nn.Linear(IN, HID, bias=not norm), *norm, torch.nn.Tanh(), torch.nn.Linear(HID, HID, bias=False),
              torch.nn.Tanh(), torch.nn.Linear(HID, OUT)]
    if extra:
        layers += [torch.nn.Linear(OUT, OUT)]
    model = torch.nn.Sequential(*layers)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    # Adam's eps is raised from 1e-8 so that parameters whose gradient is near zero do not turn rounding noise into
    # full +-lr steps: the comparison with single-process training is then at the low dtype's tolerance.
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2, eps=1e-3)
    if kind == "fused_sgd":
        return NpuFusedSGD(params, lr=0.05, momentum=0.9)
    if kind == "fused_adam":
        return NpuFusedAdam(params, lr=1e-2, eps=1e-3)
    raise ValueError(kind)


def batch(step: int, rows: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(rows, IN, generator=g)
    y = torch.randn(rows, OUT, generator=g)
    return x, y


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).clone()


def _poison(out: torch.Tensor) -> torch.Tensor:
    """Make every gradient flowing back through ``out`` inf/nan."""
    out.register_hook(lambda g: g * float("inf"))
    return out


def _train(model, opt, steps, world, rank, rows, accumulate=1, inject=None, delay_unscale=False, ddp=None,
           set_to_none=True):
    """The amp training loop; returns per-step "params changed" flags and loss scales."""
    changed, scales = [], []
    net = ddp if ddp is not None else model
    opts = opt if isinstance(opt, list) else [opt]
    for step in range(steps):
        before = flat_params(model)
        for micro in range(accumulate):
            x, y = batch(step * accumulate + micro, rows * world)
            x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
            out = net(x)
            if inject is not None and inject == (step, rank):
                _poison(out)
            loss = torch.nn.functional.mse_loss(out.float(), y) / accumulate
            last = micro == accumulate - 1
            with amp.scale_loss(loss, opt, delay_unscale=delay_unscale and not last) as scaled:
                scaled.backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=set_to_none)
        changed.append(not torch.equal(before, flat_params(model)))
        scales.append(amp._amp_state.loss_scalers[0].loss_scale())
    return changed, scales


def _optimizers(model, optimizer, split):
    params = list(model.parameters())
    if split:  # two optimizers: the first layer's params, and the rest
        return [make_optimizer(optimizer, params[:2]), make_optimizer(optimizer, params[2:])]
    return make_optimizer(optimizer, params)


def train(rank, world, opt_level="O1", optimizer="sgd", steps=20, amp_dtype=None, inject_step=None, inject_rank=0,
          accumulate=1, delay_unscale=False, min_bucket=None, use_ddp=None, message_size=10000000,
          reference=True, init_scale=2.0**10, model_kind="mlp", split=False, amp_extra=None, set_to_none=True):
    """Distributed amp training vs single-process training of the same steps on the whole batch (rank 0)."""
    try:
        if min_bucket is not None:
            reducer._MIN_BUCKET = min_bucket
        return _train_and_reference(rank, world, opt_level, optimizer, steps, amp_dtype, inject_step, inject_rank,
                                    accumulate, delay_unscale, use_ddp, message_size, reference, init_scale,
                                    model_kind, split, amp_extra or {}, set_to_none)
    finally:
        reducer._MIN_BUCKET = 2**20


def _train_and_reference(rank, world, opt_level, optimizer, steps, amp_dtype, inject_step, inject_rank, accumulate,
                         delay_unscale, use_ddp, message_size, reference, init_scale, model_kind, split, amp_extra,
                         set_to_none):
    use_ddp = opt_level in ("O0", "O3") if use_ddp is None else use_ddp
    model = make_model(seed=1 if rank == 0 else 100 + rank, kind=model_kind)  # the broadcast must fix the others
    model = convert_syncbn_model(model)
    opt = _optimizers(model, optimizer, split)
    # init_scale: fp16 grads of a 1/world share of the batch are world times larger than the single-process ones;
    # a scale far from fp16's range keeps natural overflows out of the comparison (injected ones are tested)
    kwargs = dict(opt_level=opt_level, verbosity=0, amp_dtype=amp_dtype, dynamic_init_scale=init_scale, **amp_extra)
    if not use_ddp:
        kwargs.update(combine_grad=True, combine_ddp=True)
    model, opt = amp.initialize(model, opt, **kwargs)
    ddp = DistributedDataParallel(model, message_size=message_size) if use_ddp else None
    inject = None if inject_step is None else (inject_step, inject_rank)
    changed, scales = _train(model, opt, steps, world, rank, LOCAL, accumulate, inject, delay_unscale, ddp,
                             set_to_none)
    result = {"params": flat_params(model), "changed": changed, "scales": scales,
              "buffers": torch.cat([b.detach().float().reshape(-1) for b in model.buffers()]) if model_kind == "bn"
              else None}
    amp.deinitialize()
    if rank == 0 and reference:
        ref = make_model(seed=1, kind=model_kind)
        ref_opt = _optimizers(ref, optimizer, split)
        ref_kwargs = dict(opt_level=opt_level, verbosity=0, amp_dtype=amp_dtype, dynamic_init_scale=init_scale,
                          **amp_extra)
        if opt_level in ("O1", "O2"):
            ref_kwargs["combine_grad"] = True
        ref, ref_opt = amp.initialize(ref, ref_opt, **ref_kwargs)
        ref_inject = None if inject_step is None else (inject_step, 0)
        r_changed, r_scales = _train(ref, ref_opt, steps, 1, 0, LOCAL * world, accumulate, ref_inject, delay_unscale,
                                     None, set_to_none)
        result["reference"] = {"params": flat_params(ref), "changed": r_changed, "scales": r_scales,
                               "buffers": torch.cat([b.detach().float().reshape(-1) for b in ref.buffers()])
                               if model_kind == "bn" else None}
    return result


def bucket_counts(rank, world, min_bucket=64):
    """How many buckets combine_ddp made for the test model with a small floor (several, launched in order)."""
    reducer._MIN_BUCKET = min_bucket
    try:
        model = make_model(1)
        opt = make_optimizer("fused_sgd", model.parameters())
        model, opt = amp.initialize(model, opt, opt_level="O1", combine_grad=True, combine_ddp=True,
                                    ddp_replica_count=4, verbosity=0)
        ddp = amp._amp_state.session.ddp
        launched = []
        for step in range(3):
            x, y = batch(step, LOCAL * world)
            loss = torch.nn.functional.mse_loss(model(x[:LOCAL]).float(), y[:LOCAL])
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
                plan = next(iter(ddp._plans.values()), None)
                launched.append(plan is not None and plan.reduced)
            opt.step()
            opt.zero_grad()
        plan = next(iter(ddp._plans.values()))
        return {"buckets": plan.engine.num_buckets, "reduced_in_backward": launched,
                "order": list(plan.engine.order)}
    finally:
        reducer._MIN_BUCKET = 2**20


def overflow_flag(rank, world):
    """agree_overflow: a flag raised on one rank is seen on all."""
    from apex.parallel.combine_ddp import CombineDDP

    agree = CombineDDP.agree_overflow
    return [agree(None, rank == world - 1), agree(None, False), agree(None, True)]


def uneven_model(rank, world):
    """Rank 1 has an extra layer: amp.initialize(combine_ddp=True) must raise on every rank."""
    model = make_model(1, extra=rank == 1)
    opt = make_optimizer("sgd", model.parameters())
    try:
        amp.initialize(model, opt, opt_level="O1", combine_grad=True, combine_ddp=True, verbosity=0)
    except RuntimeError as exc:
        return str(exc)
    return None


def uneven_ddp(rank, world):
    """Rank 1 has an extra layer: DistributedDataParallel(...) must raise on every rank."""
    model = make_model(1, extra=rank == 1)
    try:
        DistributedDataParallel(model)
    except RuntimeError as exc:
        return str(exc)
    return None


def uneven_buffers(rank, world):
    """Same model, but rank 1's optimizer leaves out a parameter: the first backward raises on every rank."""
    model = make_model(1)
    params = list(model.parameters())
    if rank == 1:
        params = params[:-1]
    opt = make_optimizer("sgd", params)
    model, opt = amp.initialize(model, opt, opt_level="O1", combine_grad=True, combine_ddp=True, verbosity=0)
    x, y = batch(0, LOCAL)
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    try:
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    except RuntimeError as exc:
        return str(exc)
    return None


def wrapped_model(rank, world):
    """amp.initialize refuses a model already wrapped by apex's or torch's DDP."""
    out = []
    for wrap in (lambda m: DistributedDataParallel(m), lambda m: torch.nn.parallel.DistributedDataParallel(m)):
        model = wrap(make_model(1))
        try:
            amp.initialize(model, opt_level="O1", combine_grad=True, combine_ddp=True, verbosity=0)
            out.append(None)
        except RuntimeError as exc:
            out.append(str(exc))
    return out


class _Checkpointed(torch.nn.Module):
    """Runs the wrapped layer under non-re-entrant activation checkpointing."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def ddp_semantics(rank, world, message_size=20, predivide=1.0, average=True, always_fp32=False, delay=False,
                  dtype="float32", set_to_none=True, trigger=False, streams=1, prof=False, freeze_at=None,
                  checkpoint=False):
    """Plain DDP (no amp): backward passes, grads compared with the all-reduced reference computed by hand."""
    dt = getattr(torch, dtype)
    model = make_model(1 if rank == 0 else 7).to(dt)
    if checkpoint:
        model[2] = _Checkpointed(model[2])
        model[4] = _Checkpointed(model[4])  # the last layer too: the pass's first grads come from a recomputation
    triggers = list(model[0].parameters()) if trigger else None  # the first layer's grads arrive last
    ddp = DistributedDataParallel(model, message_size=message_size, delay_allreduce=delay,
                                  gradient_average=average, gradient_predivide_factor=predivide,
                                  allreduce_always_fp32=always_fp32, allreduce_trigger_params=triggers,
                                  num_allreduce_streams=streams, prof=prof)
    # reference: the same (broadcast) model in the same dtype, run on each rank's rows here; only the sum is float64
    ref = make_model(1).to(dt)
    if checkpoint:
        ref[2], ref[4] = _Checkpointed(ref[2]), _Checkpointed(ref[4])
    ref.load_state_dict(model.state_dict())
    outs = []
    for step in range(2):
        if step == freeze_at:  # the param set changes after wrapping: buckets are rebuilt at the next forward
            model[0].weight.requires_grad_(False)
            ref[0].weight.requires_grad_(False)
            model[0].weight.grad = None
        model.zero_grad(set_to_none=set_to_none)
        x, y = batch(step, LOCAL * world)
        xs, ys = x[rank * LOCAL:(rank + 1) * LOCAL], y[rank * LOCAL:(rank + 1) * LOCAL]
        loss = torch.nn.functional.mse_loss(ddp(xs.to(dt)).float(), ys)
        loss.backward()
        grads = [p.grad.double().clone() for p in model.parameters() if p.requires_grad]
        # reference: per-rank grads, summed in float64, then averaged (or not) as DDP promises
        per_rank = []
        for r in range(world):
            ref.zero_grad()
            torch.nn.functional.mse_loss(ref(x[r * LOCAL:(r + 1) * LOCAL].to(dt)).float(),
                                         y[r * LOCAL:(r + 1) * LOCAL]).backward()
            per_rank.append([p.grad.double() for p in ref.parameters() if p.requires_grad])
        expect = [sum(gs) / (world if average else predivide) for gs in zip(*per_rank)]
        outs.append((grads, expect))
    return {"steps": outs, "buckets": ddp._engine.num_buckets, "frozen_grad": model[0].weight.grad,
            "views": all(p.grad is v for s in ddp._sets for p, v in zip(s.params, s.views))}


def ddp_accumulate(rank, world, mode="no_sync"):
    """Gradient accumulation with DDP: 3 micro-batches, reduced once (no_sync / disable_allreduce) or each time."""
    model = make_model(1)
    ddp = DistributedDataParallel(model, message_size=50)
    ref = make_model(1).double()
    total = [torch.zeros_like(p, dtype=torch.float64) for p in ref.parameters()]
    for micro in range(3):
        x, y = batch(micro, LOCAL * world)
        xs, ys = x[rank * LOCAL:(rank + 1) * LOCAL], y[rank * LOCAL:(rank + 1) * LOCAL]
        last = micro == 2
        if mode == "no_sync" and not last:
            with ddp.no_sync():
                torch.nn.functional.mse_loss(ddp(xs), ys).backward()
        elif mode == "disable" and not last:
            ddp.disable_allreduce()
            torch.nn.functional.mse_loss(ddp(xs), ys).backward()
            ddp.enable_allreduce()
        else:
            torch.nn.functional.mse_loss(ddp(xs), ys).backward()
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x.double()), y.double()).backward()
        for t, p in zip(total, ref.parameters()):
            t += p.grad
    return {"grads": [p.grad.double().clone() for p in model.parameters()], "expect": total}


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(IN, OUT)
        self.side = torch.nn.Linear(IN, OUT)
        self.never = torch.nn.Linear(IN, OUT)

    def forward(self, x, use_side):
        out = self.lin(x).sum()
        return out + self.side(x).sum() if use_side else out


def ddp_unused(rank, world):
    """A param used on rank 0 only gets the averaged grad on every rank; one unused everywhere keeps None."""
    model = _Branchy()
    ddp = DistributedDataParallel(model, message_size=16)
    x, _ = batch(0, LOCAL * world)
    xs = x[rank * LOCAL:(rank + 1) * LOCAL]
    ddp(xs, rank == 0).backward()
    side0 = None
    if rank == 0:
        ref = _Branchy()
        ref.load_state_dict(model.state_dict())
        ref(xs, True).backward()
        side0 = ref.side.weight.grad / world
    return {"side": None if model.side.weight.grad is None else model.side.weight.grad.clone(), "side0": side0,
            "never": model.never.weight.grad is None}


def ddp_adopt(rank, world):
    """DDP reduces directly in an apex fused optimizer's grad buffer once grads live there (set_to_none=False)."""
    model = make_model(1)
    ddp = DistributedDataParallel(model, message_size=100)
    opt = NpuFusedAdam(model.parameters(), lr=1e-2)
    ref = make_model(1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(4):
        x, y = batch(step, LOCAL * world)
        xs, ys = x[rank * LOCAL:(rank + 1) * LOCAL], y[rank * LOCAL:(rank + 1) * LOCAL]
        torch.nn.functional.mse_loss(ddp(xs), ys).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    shared = ddp.allreduce_buffers[0].data_ptr() == opt.combined_grad_buffers()[0].data_ptr()
    return {"shared": shared, "params": flat_params(model), "ref": flat_params(ref),
            "recombines": opt.recombine_count}


def ddp_fresh_grads(rank, world, zero="optimizer"):
    """torch's default zero_grad (the optimizer's or the module's) under apex DDP: each backward's grads are
    copied into DDP's buffer and bound as its views; the fused optimizer reads them there at every step (no
    adoption: no flat grad buffer of its own, no copy) and matches torch."""
    model = make_model(1)
    ddp = DistributedDataParallel(model, message_size=100)
    opt = NpuFusedAdam(model.parameters(), lr=1e-2)
    ref = make_model(1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    views = True
    for step in range(4):
        x, y = batch(step, LOCAL * world)
        xs, ys = x[rank * LOCAL:(rank + 1) * LOCAL], y[rank * LOCAL:(rank + 1) * LOCAL]
        torch.nn.functional.mse_loss(ddp(xs), ys).backward()
        bufs = ddp.allreduce_buffers
        views &= all(any(p.grad._base is b for b in bufs) for p in model.parameters())
        opt.step()
        (opt if zero == "optimizer" else model).zero_grad()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    own = any(s.has_grad_buffer for c in opt._groups.values() for s in c.sets)
    return {"views": views, "own_buffer": own, "params": flat_params(model), "ref": flat_params(ref),
            "recombines": opt.recombine_count}


def reducer_manual(rank, world):
    """apex.parallel.Reducer: broadcast at construction, average on reduce()."""
    from apex.parallel import Reducer

    model = make_model(1 if rank == 0 else 5)
    red = Reducer(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    red.reduce()
    grads = torch.tensor([float(r + 1) for r in range(world)]).mean()
    t = torch.full((3,), float(rank))
    Reducer([t]).reduce()
    return {"params": flat_params(model), "grad_ok": all(torch.all(p.grad == grads) for p in model.parameters()),
            "list": t.clone()}


def dead_rank(rank, world, where="initialize"):
    """Rank 1 dies (exits) where rank 0 needs it: rank 0 must get CollectiveError, not hang."""
    model = make_model(1)
    opt = make_optimizer("sgd", model.parameters())
    if rank == 1:
        if where == "initialize":
            os._exit(0)
        if where == "absent":
            time.sleep(5.0)  # alive but never arrives (rank 0's timeout is 4 s)
            return {"done": True}
    t0 = time.monotonic()
    try:
        model, opt = amp.initialize(model, opt, opt_level="O1", combine_grad=True, combine_ddp=True, verbosity=0)
        if where == "backward":
            for step in range(3):
                if rank == 1 and step == 1:
                    os._exit(0)
                x, y = batch(step, LOCAL * world)
                loss = torch.nn.functional.mse_loss(model(x[:LOCAL]).float(), y[:LOCAL])
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
    except CollectiveError as exc:
        return {"error": None, "collective": str(exc), "seconds": time.monotonic() - t0}
    return {"error": "no error", "seconds": time.monotonic() - t0}


def syncbn_inplace_relu(rank, world, channel_last=False):
    """SyncBatchNorm followed by ReLU(inplace=True), as in ResNets: forward and backward work, and equal the
    out-of-place ReLU (the synchronized output must not be a view, which autograd forbids modifying in place)."""
    g = torch.Generator().manual_seed(11 + rank)
    bn = SyncBatchNorm(3, channel_last=channel_last)
    x = torch.randn(2, 3, 4, 5, generator=g)
    if channel_last:
        x = x.movedim(1, -1).contiguous()
    a = x.clone().requires_grad_(True)
    b = x.clone().requires_grad_(True)
    ya = torch.nn.functional.relu(bn(a), inplace=True)
    ya.sum().backward()
    yb = torch.relu(bn(b))
    yb.sum().backward()
    return {"same_y": bool(torch.equal(ya, yb)), "same_grad": bool(torch.equal(a.grad, b.grad)),
            "positive": bool((ya >= 0).all()), "grad_nonzero": bool(a.grad.abs().sum() > 0)}


def syncbn(rank, world, dtype="float64", channel_last=False, affine=True, momentum=0.1, dims=4, steps=2, sizes=None,
           offset=3.0):
    """SyncBatchNorm over ranks vs BatchNorm over the whole batch in float64: outputs, grads, running stats.
    ``sizes``: the local batch of each rank (an empty one included); ``offset``: the inputs' mean."""
    dt = getattr(torch, dtype)
    c = 3
    g = torch.Generator().manual_seed(7)
    shape_per_rank = list(sizes) if sizes else [2 + r for r in range(world)]  # uneven local batches
    n = sum(shape_per_rank)
    spatial = (5, 4) if dims == 4 else (() if dims == 2 else (6,))
    bn = SyncBatchNorm(c, momentum=momentum, affine=affine, channel_last=channel_last).to(dt)
    ref = torch.nn.BatchNorm2d(c, momentum=momentum, affine=affine).double() if dims == 4 else \
        torch.nn.BatchNorm1d(c, momentum=momentum, affine=affine).double()
    if affine:
        with torch.no_grad():
            w = torch.rand(c, generator=g) + 0.5
            b = torch.randn(c, generator=g)
            bn.weight.copy_(w)
            bn.bias.copy_(b)
            ref.weight.copy_(w)
            ref.bias.copy_(b)
    lo = sum(shape_per_rank[:rank])
    out = {}
    for step in range(steps):
        x = torch.randn(n, c, *spatial, generator=g, dtype=torch.float64) * 2 + offset
        dy = torch.randn(n, c, *spatial, generator=g, dtype=torch.float64)
        xr = ref_in = x.clone().requires_grad_(True)
        y_ref = ref(ref_in)
        y_ref.backward(dy)
        mine = x[lo:lo + shape_per_rank[rank]]
        if channel_last:
            mine = mine.movedim(1, -1)
        mine = mine.to(dt).clone().requires_grad_(True)
        y = bn(mine)
        d = dy[lo:lo + shape_per_rank[rank]]
        y.backward((d.movedim(1, -1) if channel_last else d).to(dt))
        y_d, gx = y.detach().double(), mine.grad.double()
        if channel_last:
            y_d, gx = y_d.movedim(-1, 1), gx.movedim(-1, 1)
        out[step] = {"y": y_d, "y_ref": y_ref.detach()[lo:lo + shape_per_rank[rank]],
                     "gx": gx, "gx_ref": xr.grad[lo:lo + shape_per_rank[rank]]}
        if affine:
            gw, gb = bn.weight.grad.double().clone(), bn.bias.grad.double().clone()
            dist.all_reduce(gw)
            dist.all_reduce(gb)
            out[step].update(gw=gw, gw_ref=ref.weight.grad.clone(), gb=gb, gb_ref=ref.bias.grad.clone())
            bn.weight.grad = bn.bias.grad = None
            ref.weight.grad = ref.bias.grad = None
    out["running"] = (bn.running_mean.double(), bn.running_var.double(), ref.running_mean, ref.running_var,
                      int(bn.num_batches_tracked), int(ref.num_batches_tracked))
    bn.eval()
    ref.eval()
    x = torch.randn(2, c, *spatial, generator=g, dtype=torch.float64)
    xe = x.movedim(1, -1) if channel_last else x
    ye = bn(xe.to(dt)).detach().double()
    out["eval"] = (ye.movedim(-1, 1) if channel_last else ye, ref(x).detach())
    return out


class _Wide(torch.nn.Module):
    """Params of the given sizes (in registration order), each used once: out = sum_i w_i * x_i."""

    def __init__(self, sizes, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes])

    def forward(self, xs):
        return sum((w * x).sum() for w, x in zip(self.ws, xs)) ** 2


def ddp_buckets(rank, world, sizes=(4096, 4096, 4096), message_size=1, trigger=None, steps=2):
    """Bucket plan of our DDP (element ranges, params per bucket) and its averaged grads next to torch DDP's."""
    model = _Wide(sizes, 1 if rank == 0 else 5)  # rank 0's values win the broadcast, in both wrappers
    twin = _Wide(sizes, 1 if rank == 0 else 9)
    triggers = [model.ws[i] for i in trigger] if trigger is not None else None
    ddp = DistributedDataParallel(model, message_size=message_size, allreduce_trigger_params=triggers)
    tddp = torch.nn.parallel.DistributedDataParallel(twin)
    g = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    grads = []
    for _ in range(steps):
        xs = [torch.randn(n, generator=g) for n in sizes]
        model.zero_grad()
        twin.zero_grad()
        ddp(xs).backward()
        tddp(xs).backward()
        grads.append(([p.grad.clone() for p in model.parameters()], [p.grad.clone() for p in twin.parameters()]))
    engine = ddp._engine
    buckets = [(int(parts[0].storage_offset()), int(parts[0].numel())) for parts in engine.buckets]
    members = [[i for i, bs in enumerate(engine.slot_buckets) if b in bs] for b in range(engine.num_buckets)]
    flat_bytes = sum(s.flat.numel() * s.flat.element_size() for s in ddp._sets)
    return {"buckets": buckets, "order": list(engine.order), "members": members, "grads": grads,
            "flat_bytes": flat_bytes, "offsets": list(ddp._sets[0].offsets)}


def syncbn_torch_ddp(rank, world, steps=3, channel_last=False):
    """torch DDP over a convert_syncbn_model'ed net on gloo/CPU, against one process with BatchNorm over the
    concatenated batch (float64): outputs, trained params and running stats after a few SGD steps."""
    c = 3

    def net(seed):
        g = torch.Generator().manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Conv2d(2, c, 3, padding=1), torch.nn.BatchNorm2d(c), torch.nn.ReLU(),
                                torch.nn.Conv2d(c, 1, 1))
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        return m.double()

    ref = net(3)
    model = convert_syncbn_model(net(3))
    assert isinstance(model[1], SyncBatchNorm)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rows = [2 + r % 2 for r in range(world)]  # uneven local batches
    lo, n = sum(rows[:rank]), sum(rows)
    outs = []
    for step in range(steps):
        g = torch.Generator().manual_seed(500 + step)
        x = torch.randn(n, 2, 5, 4, generator=g, dtype=torch.float64)
        y = torch.randn(n, 1, 5, 4, generator=g, dtype=torch.float64)
        opt.zero_grad()
        out = ddp(x[lo:lo + rows[rank]])
        # sum of squared errors over the local rows, times world / n: torch DDP averages the grads over ranks,
        # so the step is that of the full-batch mean loss
        ((out - y[lo:lo + rows[rank]]) ** 2).sum().mul(world / n).backward()
        opt.step()
        ref_opt.zero_grad()
        ref_out = ref(x)
        ((ref_out - y) ** 2).sum().div(n).backward()
        ref_opt.step()
        outs.append((out.detach(), ref_out.detach()[lo:lo + rows[rank]]))
    params = [(p.detach().clone(), q.detach().clone()) for p, q in zip(model.parameters(), ref.parameters())]
    running = (model[1].running_mean.clone(), model[1].running_var.clone(), ref[1].running_mean.clone(),
               ref[1].running_var.clone())
    return {"outs": outs, "params": params, "running": running}


def amp_unused_on_one_rank(rank, world, opt_level="O2", optimizer="sgd"):
    """combine_ddp: a param used on rank 0 only, at the first step (when the buffers are built): every rank
    steps it with the reduced grad, so the ranks stay equal."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 1), "b": torch.nn.Linear(4, 1)})
    opt = (torch.optim.SGD(model.parameters(), lr=1.0) if optimizer == "sgd"
           else NpuFusedSGD(model.parameters(), lr=1.0))
    model, opt = amp.initialize(model, opt, opt_level=opt_level, combine_grad=True, combine_ddp=True, verbosity=0)
    x = torch.ones(2, 4, dtype=next(model.parameters()).dtype)
    before = [p.detach().float().clone() for p in amp.master_params(opt)]
    try:
        for step in range(2):
            loss = model["a"](x).sum() + (model["b"](x).sum() if rank == 0 or step else 0)
            with amp.scale_loss(loss.float(), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
        return {"moved": [(p.detach().float() - b).clone() for p, b in zip(amp.master_params(opt), before)]}
    finally:
        amp.deinitialize()
