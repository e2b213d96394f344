"""Training-loop entries: optimizer steps on grads from a real backward, and transformers' Trainer end to end.

Real backward: a small GPT-like model (token + position embedding, pre-norm blocks with causal attention and a
GELU MLP, an untied LM head) trained the way users write the loop: ``model.zero_grad()`` (grads set to None),
forward, ``loss.backward()`` (autograd allocates every grad), ``optimizer.step()``. Ours: NpuFusedAdamW;
reference: ``torch.optim.AdamW(fused=True)``; the same initial weights and tokens on both sides. Two rows: the
whole iteration timed, and the step alone within that loop (zero_grad, forward and backward run untimed before
every step).

Trainer: ``transformers.Trainer.train()`` on a GPT-2 (``GPT2LMHeadModel``) built from a config in code, random
tokens as inputs and labels, no tokenizer, no downloads (``HF_HUB_OFFLINE=1``), no checkpoints, no logging or
reporting, fixed seeds. Every timed call is one whole training run of ``TRAIN_STEPS`` steps on a fresh model and a
fresh Trainer (built untimed); the recorded time is the run's own ``train_runtime``. Rows:
  fused AdamW          ``optim="adamw_apex_fused"`` vs ``"adamw_torch_fused"``, fp32 and ``bf16=True``
  apex amp backend     ``fp16=True, half_precision_backend="apex"`` + ``adamw_apex_fused`` vs torch amp +
                       ``adamw_torch_fused``. On cuda/npu torch amp is ``fp16=True`` (autocast fp16 + GradScaler).
                       On CPU it is ``bf16=True``: accelerate (1.15) turns on native amp for ``fp16`` only on
                       non-CPU devices (``Accelerator.__init__``: ``mixed_precision == "fp16" and device.type !=
                       "cpu"``), so ``fp16=True`` on CPU with the auto backend trains in plain fp32; torch's CPU amp is
                       bf16 autocast, which is also the dtype our amp casts to on CPU (``apex._device.
                       default_amp_dtype``). transformers itself refuses CPU ``fp16`` only for torch < 2.3, and only
                       with the auto backend; with ``half_precision_backend="apex"`` it requires
                       ``is_apex_available()``: apex installed as a distribution (package metadata), which a
                       checkout on ``sys.path`` is not, so this row runs only against an installed apex (as ``nox
                       -s bench`` does) and is skipped otherwise. (On cuda, transformers also leaves
                       ``ACCELERATE_MIXED_PRECISION=fp16`` for the apex backend, so accelerate's autocast wraps the
                       forward as well: what users of that backend get.)
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import logging
import math
import os
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from bench.registry import Context, Entry, Registry

log = logging.getLogger("bench")

TRAIN_STEPS = 40
TRAIN_STEPS_QUICK = 6


# ---------------------------------------------------------------- a GPT-like module
class _Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln_2 = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.out = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(torch.nn.Module):
    """Decoder-only language model in the GPT-2 layout (pre-norm blocks, learned positions)."""

    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def _gpt_size(quick: bool) -> Dict[str, int]:
    if quick:
        return {"vocab": 1024, "seq": 32, "d": 64, "layers": 2, "heads": 2, "batch": 4}
    return {"vocab": 8192, "seq": 128, "d": 256, "layers": 4, "heads": 4, "batch": 8}


def _backward_setup(ctx: Context) -> Dict[str, Any]:
    from apex.optimizers import NpuFusedAdamW

    size = _gpt_size(ctx.quick)
    arch = {k: size[k] for k in ("vocab", "seq", "d", "layers", "heads")}
    g = torch.Generator().manual_seed(ctx.seed)
    tokens = torch.randint(0, size["vocab"], (size["batch"], size["seq"] + 1), generator=g).to(ctx.device)
    models = []
    for _ in range(2):
        torch.manual_seed(ctx.seed)  # the same initial weights on both sides
        models.append(TinyGPT(**arch).to(ctx.device))
    ours_m, ref_m = models
    return {
        "numel": sum(p.numel() for p in ours_m.parameters()),
        "tensors": len(list(ours_m.parameters())),
        "ours_m": ours_m,
        "ref_m": ref_m,
        "ours": NpuFusedAdamW(ours_m.parameters(), lr=1e-4, weight_decay=1e-2),
        "ref": torch.optim.AdamW(ref_m.parameters(), lr=1e-4, weight_decay=1e-2, fused=True),
        "x": tokens[:, :-1],
        "y": tokens[:, 1:],
    }


def _forward_backward(model, st) -> None:
    model.zero_grad()  # torch's default: grads set to None; backward allocates new ones
    logits = model(st["x"])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), st["y"].reshape(-1)).backward()


def _iteration(side: str):
    def run(st):
        _forward_backward(st[f"{side}_m"], st)
        st[side].step()

    return run


def _verify_backward(st) -> None:
    """One iteration on each side from the same weights: the same updated weights (rtol 1e-4)."""
    for side in ("ours", "ref"):
        _iteration(side)(st)
    for (name, p), q in zip(st["ours_m"].named_parameters(), st["ref_m"].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------- transformers' Trainer
def _offline_env() -> None:
    """No network, no telemetry, no progress bars: fixed before transformers is imported."""
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY",
                "DISABLE_MLFLOW_INTEGRATION", "HF_HUB_DISABLE_PROGRESS_BARS"):
        os.environ[key] = "1"
    os.environ["WANDB_DISABLED"] = "true"


class _Tokens(torch.utils.data.Dataset):
    """Random token sequences, used as inputs and labels (the model shifts labels itself)."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer_size(quick: bool) -> Dict[str, int]:
    if quick:
        return {"vocab": 1024, "seq": 32, "d": 64, "layers": 2, "heads": 2, "batch": 4, "steps": TRAIN_STEPS_QUICK}
    return {"vocab": 8192, "seq": 128, "d": 256, "layers": 4, "heads": 4, "batch": 8, "steps": TRAIN_STEPS}


VARIANTS = {
    # name: (ours' TrainingArguments, the reference's on CPU, the reference's on cuda/npu)
    "fp32": ({"optim": "adamw_apex_fused"}, {"optim": "adamw_torch_fused"}, {"optim": "adamw_torch_fused"}),
    "bf16": ({"optim": "adamw_apex_fused", "bf16": True}, {"optim": "adamw_torch_fused", "bf16": True},
             {"optim": "adamw_torch_fused", "bf16": True}),
    "amp": ({"optim": "adamw_apex_fused", "fp16": True, "half_precision_backend": "apex"},
            {"optim": "adamw_torch_fused", "bf16": True}, {"optim": "adamw_torch_fused", "fp16": True}),
}


PHASES = ("forward+backward", "clip", "optimizer.step", "scheduler+zero_grad")


def _phase_timer(tf):
    """A TrainerCallback that stamps each step's phases (perf_counter at the Trainer's own callback points, plus
    the training_step wrapped by `_build_trainer`): a few function calls per step on both sides alike."""

    class PhaseTimer(tf.TrainerCallback):
        def __init__(self):
            self.marks: List[Tuple[str, float]] = []

        def mark(self, name: str) -> None:
            self.marks.append((name, time.perf_counter()))

        def on_pre_optimizer_step(self, args, state, control, **kw):
            self.mark("pre_opt")

        def on_optimizer_step(self, args, state, control, **kw):
            self.mark("post_opt")

        def on_step_end(self, args, state, control, **kw):
            self.mark("step_end")

        def per_step(self) -> Dict[str, List[float]]:
            """Seconds per phase, one value per optimizer step (a step is ts_begin .. step_end)."""
            out: Dict[str, List[float]] = {k: [] for k in PHASES}
            t: Dict[str, float] = {}
            for name, at in self.marks:
                t[name] = at
                if name == "step_end" and len(t) == 5:
                    out["forward+backward"].append(t["ts_end"] - t["ts_begin"])
                    out["clip"].append(t["pre_opt"] - t["ts_end"])
                    out["optimizer.step"].append(t["post_opt"] - t["pre_opt"])
                    out["scheduler+zero_grad"].append(t["step_end"] - t["post_opt"])
                    t = {}
            return out

    return PhaseTimer()


def _phase_note(st: Dict[str, Any]) -> str:
    """Per-step phase medians of both sides over all timed runs, and what the optimizer step allows: the whole
    run's ratio cannot go below 1 - (the reference's step share), whatever our step costs."""
    runs = st["phases"]
    if not runs["ours"] or not runs["ref"]:
        return ""
    med = {}
    for side in ("ours", "ref"):
        per = {k: [v for run in runs[side] for v in run[k][1:]] for k in PHASES}  # steps after the first
        med[side] = {k: statistics.median(v) * 1e3 for k, v in per.items() if v}
        med[side]["first"] = statistics.median(run["optimizer.step"][0] for run in runs[side]) * 1e3
    if set(PHASES) - set(med["ref"]) or set(PHASES) - set(med["ours"]):
        return ""
    parts = [f"{k} {med['ours'][k]:.2f} / {med['ref'][k]:.2f}" for k in PHASES]
    whole = sum(med["ref"][k] for k in PHASES)
    share = med["ref"]["optimizer.step"] / whole
    return (f"per-step medians, ms ours / ref: {', '.join(parts)}; first optimizer.step {med['ours']['first']:.1f} / "
            f"{med['ref']['first']:.1f}; the reference's optimizer.step is {100 * share:.1f}% of its step, so a "
            f"free optimizer step would give {1 - share:.3f}")


def _trainer_setup(ctx: Context, variant: str) -> Dict[str, Any]:
    _offline_env()
    import transformers

    transformers.logging.set_verbosity_error()
    size = _trainer_size(ctx.quick)
    config = transformers.GPT2Config(
        vocab_size=size["vocab"], n_positions=size["seq"], n_embd=size["d"], n_layer=size["layers"],
        n_head=size["heads"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ours_kw, ref_cpu, ref_dev = VARIANTS[variant]
    ref_kw = ref_cpu if ctx.device == "cpu" else ref_dev
    torch.manual_seed(ctx.seed)
    probe = transformers.GPT2LMHeadModel(config)
    st: Dict[str, Any] = {
        "numel": sum(p.numel() for p in probe.parameters()),
        "tensors": len(list(probe.parameters())),
        "tf": transformers,
        "config": config,
        "data": _Tokens(size["batch"] * size["steps"], size["seq"], size["vocab"], ctx.seed),
        "size": size,
        "ctx": ctx,
        "kw": {"ours": ours_kw, "ref": ref_kw},
        "out_dir": tempfile.mkdtemp(prefix="apex-bench-trainer-"),
        "trainer": {},
        "record": {"steps": size["steps"], "ours_args": _args_label(ours_kw), "ref_args": _args_label(ref_kw)},
        "apex_amp": ours_kw.get("half_precision_backend") == "apex",
        "phases": {"ours": [], "ref": []},
        "timers": {},
    }
    del probe
    return st


def _args_label(kw: Dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kw.items())


def _deinit_amp(st) -> None:
    if st["apex_amp"]:
        from apex import amp

        amp.deinitialize()


def _build_trainer(st: Dict[str, Any], side: str) -> None:
    """A fresh model (same seed: same weights every time) and a fresh Trainer, as a new training run makes."""
    tf, ctx, size = st["tf"], st["ctx"], st["size"]
    _deinit_amp(st)
    torch.manual_seed(ctx.seed)
    model = tf.GPT2LMHeadModel(st["config"])
    # TrainingArguments starts from this variable and leaves its choice in it; accelerate reads it. Reset, so that
    # each run's precision comes from its own arguments, not from the run before it.
    os.environ["ACCELERATE_MIXED_PRECISION"] = "no"
    args = tf.TrainingArguments(
        output_dir=st["out_dir"], max_steps=size["steps"], per_device_train_batch_size=size["batch"],
        learning_rate=1e-4, weight_decay=1e-2, lr_scheduler_type="constant", seed=ctx.seed, data_seed=ctx.seed,
        use_cpu=ctx.device == "cpu", report_to=[], save_strategy="no", eval_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, **st["kw"][side])
    timer = _phase_timer(tf)
    trainer = tf.Trainer(model=model, args=args, train_dataset=st["data"], callbacks=[timer])
    training_step = trainer.training_step

    def timed_training_step(*a, **kw):
        timer.mark("ts_begin")
        out = training_step(*a, **kw)
        timer.mark("ts_end")
        return out

    trainer.training_step = timed_training_step
    st["trainer"][side] = trainer
    st["timers"][side] = timer


def _train(side: str):
    def run(st):
        trainer = st["trainer"].pop(side)
        try:
            # quiet runs: amp.initialize (called by the Trainer with its default verbosity) logs its options,
            # and transformers warns about the scheduler order once amp has wrapped optimizer.step
            amp_log = logging.getLogger("apex.amp")
            level = amp_log.level
            amp_log.setLevel(logging.WARNING)
            try:
                with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    out = trainer.train()
            finally:
                amp_log.setLevel(level)
        finally:
            if side == "ours":
                _deinit_amp(st)  # amp patches torch globally: never leave it on for the reference's run
        st["record"][f"{side}_training_loss"] = float(out.training_loss)
        st["phases"][side].append(st["timers"].pop(side).per_step())
        if not math.isfinite(out.training_loss):
            raise AssertionError(f"Trainer ({side}): training loss is {out.training_loss}")
        return float(out.metrics["train_runtime"])

    return run


def _trainer_teardown(st) -> None:
    _deinit_amp(st)
    shutil.rmtree(st["out_dir"], ignore_errors=True)
    note = _phase_note(st)
    if note:
        st["entry"].notes = f"{st['entry'].notes}; {note}"


def _apex_distribution() -> bool:
    try:
        importlib.metadata.version("apex")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _trainer_lacks_apex(amp: bool) -> Optional[str]:
    """Why this transformers' Trainer cannot run an apex row (None: it can): later releases dropped
    ``half_precision_backend="apex"`` (the amp row; 5.0 has no such argument), then
    ``optim="adamw_apex_fused"`` (every row)."""
    try:
        import transformers
        from transformers.training_args import OptimizerNames, TrainingArguments
    except Exception as exc:  # a broken install: report it, run the other entries
        return f"transformers does not import ({type(exc).__name__}: {exc})"
    if "adamw_apex_fused" not in {o.value for o in OptimizerNames}:
        return f"transformers {transformers.__version__} has no optim='adamw_apex_fused'"
    if amp:
        field = TrainingArguments.__dataclass_fields__.get("half_precision_backend")
        choices = None if field is None else field.metadata.get("choices")
        if field is None or (choices is not None and "apex" not in choices):
            return f"transformers {transformers.__version__} has no half_precision_backend='apex'"
    return None


def register(reg: Registry) -> None:
    for whole in (True, False):
        reg.add(Entry(
            name=("GPT-like training iteration, AdamW" if whole else "AdamW step after model.zero_grad() + "
                  "backward"),
            regime="gpt-4x256" + ("" if whole else ", step only"),
            setup=_backward_setup,
            ours=_iteration("ours") if whole else (lambda st: st["ours"].step()),
            torch_ref=_iteration("ref") if whole else (lambda st: st["ref"].step()),
            before_ours=None if whole else (lambda st: _forward_backward(st["ours_m"], st)),
            before_ref=None if whole else (lambda st: _forward_backward(st["ref_m"], st)),
            verify=_verify_backward if whole else None,
            bytes_per_param=28,  # the AdamW update; forward/backward dominate the whole iteration
            executor="NpuFusedAdamW, grads from loss.backward()",
            ref_label="torch.optim.AdamW(fused=True)",
            target_ratio=1.0 if whole else 1.02,
            group="training",
            zero_grad="set_to_none",
            devices=("cpu", "cuda", "npu"),
        ))
    if importlib.util.find_spec("transformers") is None:
        log.info("transformers is not installed (dependency group 'hf'): no Trainer entries")
        return
    for variant, label, target in (("fp32", "Trainer, fused AdamW", 0.98), ("bf16", "Trainer, fused AdamW", 0.98),
                                   ("amp", "Trainer, apex amp backend", 1.0)):
        missing = _trainer_lacks_apex(variant == "amp")
        if missing is not None:
            log.info("no %s [%s] entry: %s", label, variant, missing)
            continue
        if variant == "amp" and not _apex_distribution():
            log.info("apex is not installed as a distribution (transformers' is_apex_available() reads its "
                     "package metadata): no %s entry; `pip install .` or `nox -s bench` runs it", label)
            continue
        holder: Dict[str, Entry] = {}

        def setup(ctx, variant=variant, holder=holder):
            st = _trainer_setup(ctx, variant)
            st["entry"] = holder["entry"]  # the teardown adds the phase split to its notes
            return st

        holder["entry"] = entry = Entry(
            name=label,
            regime=f"gpt2-4x256 {variant}",
            setup=setup,
            ours=_train("ours"),
            torch_ref=_train("ref"),
            before_ours=lambda st: _build_trainer(st, "ours"),
            before_ref=lambda st: _build_trainer(st, "ref"),
            teardown=_trainer_teardown,
            self_timed=True,
            rounds=5,
            warmup=1,
            bytes_per_param=28,  # nominal: one AdamW update per step; the whole training run is timed
            executor=("Trainer: fp16=True, half_precision_backend='apex', adamw_apex_fused" if variant == "amp"
                      else f"Trainer: adamw_apex_fused{', bf16=True' if variant == 'bf16' else ''}"),
            ref_label=("Trainer: torch amp, adamw_torch_fused" if variant == "amp"
                       else f"Trainer: adamw_torch_fused{', bf16=True' if variant == 'bf16' else ''}"),
            target_ratio=target,
            dtype={"fp32": "fp32", "bf16": "bf16 autocast", "amp": "amp"}[variant],
            group="training",
            zero_grad="set_to_none",
            notes="train_runtime of Trainer.train(), medians over whole training runs",
            devices=("cpu", "cuda", "npu"),
        )
        reg.add(entry)
