"""Generate docs/api.md from the code: every public name, its signature (via inspect) and its docstring.

    PYTHONPATH=src python docs/_gen_api.py          # rewrite docs/api.md
    PYTHONPATH=src python docs/_gen_api.py --check  # exit 1 if docs/api.md is out of date (tests/test_docs.py)

Signatures and summaries come from the code, so they cannot drift; the hand-written parts are the module intros and
the notes on how each name differs from the original NPU patch and from NVIDIA Apex (NOTES below).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "api.md"

# (module, intro, names): names=None means the module's __all__.
MODULES = [
    ("apex.amp", "Automatic mixed precision with upstream NVIDIA amp's API (details and opt-level table: "
     "[amp.md](amp.md)).", None),
    ("apex.optimizers", "Fused optimizers over combined (flat) buffers. `NpuFused*` and `Lamb` have the NPU patch's "
     "names and signatures; `Fused*` have NVIDIA Apex's (see [upstream-compat.md](upstream-compat.md)). All "
     "subclass `torch.optim.Optimizer`, work with or without `amp.initialize`, with fp32/bf16/fp16 params and "
     "with `zero_grad(set_to_none=True)`.", None),
    ("apex.contrib", "Combined tensors: many tensors rebound as views into one flat buffer, so one elementwise pass "
     "touches them all.", None),
    ("apex.parallel", "Distributed data parallel on torch.distributed (gloo / nccl / hccl), LARC and SyncBatchNorm"
     + (" (see [distributed.md](distributed.md))." if (Path(__file__).resolve().parent / "distributed.md").exists()
        else "."), None),
    ("apex._device", "The device layer (private module, stable for examples and tests): one place that decides "
     "npu > cuda > cpu and never imports torch_npu when it is absent.",
     ["detect_device", "device_available", "default_amp_dtype"]),
]

# How a name differs from the original Ascend "Apex Patch" (NPU) and from NVIDIA Apex. Facts only; each one is
# exercised by the test suite named in parentheses where that is not obvious.
NOTES = {
    "apex.amp.initialize": (
        "NVIDIA: same arguments and opt-level rules; O1 is built on `torch.autocast` around the model's forward "
        "instead of monkey-patching torch functions (tensor methods are not intercepted; code outside the forward, "
        "such as the loss, runs in its own dtype). NPU patch: the same extra arguments (`dynamic_init_scale`, "
        "`scale_growth_factor`, `scale_backoff_factor`, `scale_window`, `min_loss_scale`, `max_loss_scale`, "
        "`combine_grad`, `combine_ddp`, `ddp_replica_count`, `user_cast_preferred`, `check_combined_tensors`). "
        "New here: keyword-only `amp_dtype` (default bf16 on cpu, fp16 on cuda/npu; `APEX_AMP_DTYPE` overrides) "
        "and `fold_unscale` (opt-in: the fused optimizer unscales inside its update)."),
    "apex.amp.scale_loss": (
        "Same contract as NVIDIA's: yields `loss.float() * scale`; on exit unscales, checks for inf/nan and "
        "updates the scale; an overflow skips the owning optimizers' next `step()`. With `combine_grad` the "
        "unscale + check is one pass over each combined grad buffer."),
    "apex.amp.state_dict": "Upstream's format, so checkpoints move between NVIDIA amp and this package.",
    "apex.amp.deinitialize": "Not in NVIDIA Apex or the NPU patch: undoes `initialize` (for tests and notebooks).",
    "apex.amp.LossScaler": "Dynamic scaler with the NPU patch's tunables (init, growth, backoff, window, min, max).",
    "apex.optimizers.CombinedOptimizer": (
        "Base class of every fused optimizer here. Params, grads and per-param states are combined lazily at the "
        "first step, per dtype and param group; `state[p]` entries stay views, so `state_dict()` has "
        "torch.optim's layout. Sharing broken by user code (`p.data = ...`, a new `p.grad`, `model.to(...)`) is "
        "detected before the update and healed by re-combining."),
    "apex.optimizers.NpuFusedAdam": (
        "NPU patch: required `amp.initialize`, fp16/fp32 only and raised on `zero_grad(set_to_none=True)`; this one "
        "works standalone, with bf16, and with either zero_grad. State dicts load to and from torch.optim.Adam."),
    "apex.optimizers.NpuFusedAdamW": "As NpuFusedAdam, with torch.optim.AdamW's semantics and default weight decay.",
    "apex.optimizers.NpuFusedSGD": "torch.optim.SGD's semantics (momentum, dampening, nesterov, weight_decay).",
    "apex.optimizers.NpuFusedBertAdam": (
        "No bias correction, decoupled decay, lr scaled by the warmup schedule. Fixes against the NPU patch: "
        "`warmup_cosine` works, the step count is saved in `state_dict()`, and `max_grad_norm` clips to its value "
        "(the original clipped to 1 whatever the value)."),
    "apex.optimizers.NpuFusedRMSpropTF": (
        "TensorFlow/timm formulation (eps inside the sqrt, lr folded into momentum when `lr_in_momentum`). "
        "`square_avg` starts at ones as in TensorFlow and timm; the NPU patch started it at zeros."),
    "apex.optimizers.NpuFusedLamb": (
        "The NPU patch's LAMB: no bias correction; trust ratio clamp(||p||, 0, 10) / ||update|| (1 when either "
        "norm is 0); `adam=True` forces ratio 1. Not NVIDIA's FusedLAMB (which has bias correction and grad "
        "clipping): use `FusedLAMB` for that."),
    "apex.optimizers.clip_optimizer_grad_norm_fused": (
        "Also a method of every fused optimizer (`optimizer.clip_optimizer_grad_norm_fused(max_norm)`), as in the "
        "NPU patch: one norm pass over the combined grad buffers, then one scale pass."),
    "apex.optimizers.FusedAdam": (
        "NVIDIA's signature and defaults (`adam_w_mode=True`, `set_grad_none=True`); runs on every device "
        "(NVIDIA's needs CUDA). `amsgrad=True` raises as NVIDIA's does."),
    "apex.contrib.combine_tensors": (
        "The NPU patch's `combine_npu` (also exported under that name and torch_npu's `npu_combine_tensors`). "
        "Slots are aligned to `ALIGN_ELEMENTS` elements; the buffer is zero-filled so padding stays zero. Works on "
        "cpu and cuda through torch APIs; on npu, tensors in a private storage format go to torch_npu's op."),
    "apex.contrib.compact_state_dict": (
        "Not in the NPU patch: saving a model or optimizer whose tensors are combined views would otherwise "
        "write the whole flat buffer once per view."),
    "apex.parallel.DistributedDataParallel": (
        "NVIDIA's arguments; built on torch.distributed (no home-made transport), gloo on CPU included."),
    "apex.parallel.SyncBatchNorm": "Works on CPU with gloo too (torch.nn.SyncBatchNorm refuses CPU tensors).",
}


def _first_paragraph(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    para = doc.split("\n\n")[0]
    return " ".join(line.strip() for line in para.splitlines()).strip()


def _rest_of_doc(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    parts = doc.split("\n\n", 1)
    return parts[1].strip() if len(parts) == 2 else ""


def _module_doc(obj) -> str:
    """The defining module's docstring, when the object's own docstring defers to it."""
    if "module docstring" not in (inspect.getdoc(obj) or ""):
        return ""
    mod = sys.modules.get(getattr(obj, "__module__", ""), None)
    return inspect.cleandoc(mod.__doc__) if mod is not None and mod.__doc__ else ""


def _signature(qual: str, obj) -> str:
    name = qual.rsplit(".", 1)[1]
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        return f"class {name}({obj.__bases__[0].__name__})"
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return f"{name} = {obj!r}"
    return f"class {name}{sig}" if inspect.isclass(obj) else f"{name}{sig}"


def generate() -> str:
    lines = ["# API reference", "",
             "<!-- generated by docs/_gen_api.py from the code; edit NOTES there, then rerun it -->", "",
             "Signatures and summaries are read from the code with `inspect`; the notes say how a name differs "
             "from the original Ascend NPU patch and from NVIDIA Apex. `import apex` loads the subpackages lazily.",
             ""]
    for modname, _, _ in MODULES:
        lines.append(f"- [`{modname}`](#{modname.replace('.', '').replace('_', '')})")
    lines.append("")
    for modname, intro, names in MODULES:
        mod = importlib.import_module(modname)
        lines += [f"## {modname}", "", intro, ""]
        for name in sorted(names if names is not None else mod.__all__, key=str.lower):
            obj = getattr(mod, name)
            qual = f"{modname}.{name}"
            lines += [f"### `{qual}`", "", "```python", _signature(qual, obj), "```", ""]
            summary = _first_paragraph(obj) if callable(obj) else ""
            if summary:
                lines += [summary, ""]
            rest = _rest_of_doc(obj) if callable(obj) else ""
            if rest:  # docstrings are plain text with indented formulas: keep their layout verbatim
                lines += ["```text", rest, "```", ""]
            moddoc = _module_doc(obj)
            if moddoc:
                lines += ["<details><summary>Semantics: module <code>" + obj.__module__ + "</code></summary>", "",
                          "```text", moddoc, "```", "", "</details>", ""]
            if qual in NOTES:
                lines += [f"*Differences:* {NOTES[qual]}", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Generate docs/api.md from the code.")
    p.add_argument("--check", action="store_true", help="fail if docs/api.md differs from what the code gives")
    args = p.parse_args(argv)
    text = generate()
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if current != text:
            sys.stderr.write("docs/api.md is out of date: run `PYTHONPATH=src python docs/_gen_api.py`\n")
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
