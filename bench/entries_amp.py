"""AMP entries: the AMP optimizer step, O2's master update + model copy, end-to-end training.

AMP step: what runs between ``scaled_loss.backward()`` and the next iteration. Ours: the ``scale_loss`` exit
(one unscale + non-finite pass per combined grad buffer, the scale update) and ``step()`` of NpuFusedAdamW under
``amp.initialize(opt_level="O1", combine_grad=True)``; with ``fold_unscale=True`` the exit only checks and the
optimizer's update divides by the scale. Reference: ``torch.amp.GradScaler`` ``step`` + ``update`` with
``torch.optim.AdamW(fused=True)`` (its non-finite check, then the fused kernel unscales and skips in-kernel).
Both sides alternate the loss scale between 2**16 and 2**-16 (powers of two: exact), so the gradients stay
bounded over any number of rounds without being refilled.

O2 master update: NpuFusedAdamW on fp32 masters writing the bf16 model copy in the same pass
(``attach_model_params``), against the same math in torch ops: AdamW (foreach, torch's default) on the masters,
then one ``torch._foreach_copy_`` into the bf16 model params; and, without a target, against torch's fused AdamW.

End-to-end: one training iteration (forward, backward, amp exit, step) of a small transformer on CPU, apex O1/O2
+ NpuFusedAdam (combine_grad) against torch.autocast + GradScaler + AdamW(fused=True).
"""

from __future__ import annotations

import torch

from bench import env, shapes
from bench.registry import Context, Entry, Registry

SCALES = (2.0**16, 2.0**-16)


def _grads_like(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.device).mul_(SCALES[0])


class _Holder(torch.nn.Module):
    def __init__(self, params):
        super().__init__()
        self.ps = torch.nn.ParameterList(params)


def _amp_step_setup(ctx: Context, regime: str, fold: bool):
    from apex import amp
    from apex.optimizers import NpuFusedAdamW

    shp = shapes.regime_shapes(regime, ctx.quick)
    ours = shapes.make_params(shp, seed=0, device=ctx.device)
    ref = shapes.make_params(shp, seed=0, device=ctx.device)
    _grads_like(ours, 1)
    _grads_like(ref, 1)
    opt = NpuFusedAdamW(ours, lr=1e-4)
    amp.deinitialize()
    amp.initialize(_Holder(ours), opt, opt_level="O1", combine_grad=True, fold_unscale=fold or None, verbosity=0)
    stash = opt._amp_stash
    scaler = amp._amp_state.loss_scalers[0]
    stash.post_backward(SCALES[0], check=True, fold=True)  # the first exit reads the grads where they are
    values = [p.grad.clone() for p in ours]
    opt.zero_grad(set_to_none=False)  # kept grads are combined before the next backward ...
    stash.prepare_backward(SCALES[0])
    with torch.no_grad():
        for p, v in zip(ours, values):  # ... and these rounds reuse them: one pass over the buffer per exit
            p.grad.copy_(v)
    ref_opt = torch.optim.AdamW(ref, lr=1e-4, fused=True)
    gs = torch.amp.GradScaler(ctx.device, init_scale=SCALES[0])
    gs.scale(torch.ones((), device=ctx.device))  # creates its scale tensor
    return {"numel": shapes.numel_of(ours), "tensors": len(ours), "opt": opt, "stash": stash, "scaler": scaler,
            "ref_opt": ref_opt, "gs": gs, "i": 0, "j": 0, "amp": amp}


def _amp_step_ours(st):
    # One scale_loss exit + step, as handle.scale_loss runs it, at the alternating scale.
    st["i"] ^= 1
    scale = SCALES[st["i"] ^ 1]
    stash, scaler = st["stash"], st["scaler"]
    # What a fresh backward leaves behind: grads carrying `scale` (no pre-scale pass, as after zero_grad).
    stash.combined.pending = scale
    scaler.clear_overflow_state()
    scaler.record_overflow(stash.post_backward(scale, check=True, fold=True))
    if scaler.update_scale():
        stash.skip_pending = (0, scaler)
    st["opt"].step()


def _amp_step_ref(st):
    st["j"] ^= 1
    gs = st["gs"]
    gs._scale.fill_(SCALES[st["j"] ^ 1])
    gs.step(st["ref_opt"])
    gs.update()


def _amp_step_teardown(st):
    st["amp"].deinitialize()


def _o2_setup(ctx: Context, regime: str, fused: bool):
    from apex.optimizers import NpuFusedAdamW

    shp = shapes.regime_shapes(regime, ctx.quick)
    masters = shapes.make_params(shp, seed=0, device=ctx.device)
    ref_masters = shapes.make_params(shp, seed=0, device=ctx.device)
    models = [m.detach().to(torch.bfloat16) for m in masters]
    ref_models = [m.detach().to(torch.bfloat16) for m in ref_masters]
    _grads_like(masters, 1)
    _grads_like(ref_masters, 1)
    for ps in (masters, ref_masters):
        for p in ps:
            p.grad.mul_(SCALES[1])  # plain magnitudes: no loss scale in this entry
    opt = NpuFusedAdamW(masters, lr=1e-4)
    opt.attach_model_params(list(zip(masters, models)))
    return {"numel": shapes.numel_of(masters), "tensors": len(masters), "opt": opt, "models": models,
            "ref_opt": torch.optim.AdamW(ref_masters, lr=1e-4, **({"fused": True} if fused else {"foreach": True})),
            "ref_models": ref_models,
            "ref_masters": ref_masters}


def _o2_ref(st):
    st["ref_opt"].step()
    torch._foreach_copy_(st["ref_models"], st["ref_masters"])


def _o2_verify(st):
    st["opt"].step()
    _o2_ref(st)
    for a, b in zip(st["models"], st["ref_models"]):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-4)


class _Tiny(torch.nn.Module):
    def __init__(self, vocab=512, d=128, seq=64, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


def _e2e_setup(ctx: Context, level: str):
    from apex import amp
    from apex.optimizers import NpuFusedAdam

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (16, 64), generator=g).to(ctx.device)
    target = torch.randint(0, 512, (16, 64), generator=g).to(ctx.device)
    torch.manual_seed(0)
    model = _Tiny().to(ctx.device)
    torch.manual_seed(0)
    ref_model = _Tiny().to(ctx.device)
    opt = NpuFusedAdam(model.parameters(), lr=1e-4)
    amp.deinitialize()
    model, opt = amp.initialize(model, opt, opt_level=level, combine_grad=True, verbosity=0)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    return {"numel": sum(p.numel() for p in ref_model.parameters()), "tensors": len(list(ref_model.parameters())),
            "model": model, "opt": opt, "ref_model": ref_model, "ref_opt": ref_opt,
            "gs": torch.amp.GradScaler(ctx.device), "tokens": tokens, "target": target, "amp": amp,
            "dtype": __import__("apex._device", fromlist=["x"]).default_amp_dtype(ctx.device), "device": ctx.device}


def _loss(out, target):
    return torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))


def _e2e_ours(st):
    amp, opt = st["amp"], st["opt"]
    opt.zero_grad(set_to_none=False)
    loss = _loss(st["model"](st["tokens"]), st["target"])
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


def _e2e_ref(st):
    opt, gs = st["ref_opt"], st["gs"]
    opt.zero_grad(set_to_none=False)
    with torch.autocast(st["device"], dtype=st["dtype"]):
        out = st["ref_model"](st["tokens"])
    gs.scale(_loss(out, st["target"])).backward()
    gs.step(opt)
    gs.update()


def register(reg: Registry) -> None:
    for fold in (False, True):
        label = "AMP step, folded unscale" if fold else "AMP step"
        for regime in shapes.REGIMES:
            target = (1.05 if fold else 1.15) if regime == "model-145" else (0.2 if regime == "small-5000x200"
                                                                             else None)
            reg.add(Entry(
                name=label,
                regime=regime,
                setup=lambda ctx, regime=regime, fold=fold: _amp_step_setup(ctx, regime, fold),
                ours=_amp_step_ours,
                torch_ref=_amp_step_ref,
                teardown=_amp_step_teardown,
                # unscale pass (read+write g, 8; folded: read g, 4) + AdamW update (28)
                bytes_per_param=32 if fold else 36,
                executor=lambda st: env.apex_executor(st["opt"].param_groups[0]["params"][0]),
                ref_label="torch.amp.GradScaler step+update, AdamW(fused=True)",
                target_ratio=target,
                group="amp",
            ))
    # The reference is "the same math in torch ops": torch's AdamW as torch runs it by default (foreach
    # ops) plus the copy. Against torch's fused AdamW kernel the bound is bandwidth (30 vs 34 B/param, so at best
    # ~0.88), hence that comparison is reported without a target.
    for fused in (False, True):
        for regime in shapes.REGIMES:
            reg.add(Entry(
                name="O2 master AdamW + bf16 model copy" + (", vs torch fused" if fused else ""),
                regime=regime,
                setup=lambda ctx, regime=regime, fused=fused: _o2_setup(ctx, regime, fused),
                ours=lambda st: st["opt"].step(),
                torch_ref=_o2_ref,
                verify=_o2_verify,
                bytes_per_param=30,  # AdamW on fp32 masters (28) + bf16 model write (2)
                executor=lambda st: env.apex_executor(st["opt"].param_groups[0]["params"][0]),
                ref_label=("AdamW(fused=True)" if fused else "AdamW(foreach=True)")
                + " on masters + torch._foreach_copy_ to bf16",
                target_ratio=None if fused else 0.5,
                dtype="fp32+bf16",
                group="amp",
            ))
    for level in ("O1", "O2"):
        reg.add(Entry(
            name=f"small transformer training iteration, {level}",
            regime="transformer-2x128",
            setup=lambda ctx, level=level: _e2e_setup(ctx, level),
            ours=_e2e_ours,
            torch_ref=_e2e_ref,
            teardown=lambda st: st["amp"].deinitialize(),
            bytes_per_param=28,  # nominal (the optimizer's share); forward/backward dominate
            executor=f"apex amp {level} + NpuFusedAdam (combine_grad)",
            ref_label="torch.autocast + GradScaler + AdamW(fused=True)",
            target_ratio=1.0,
            group="amp",
            devices=("cpu",),
        ))
