"""Generate docs/api.md from the code: every public name, its signature (via inspect) and its docstring.

    PYTHONPATH=src python docs/_gen_api.py          # rewrite docs/api.md
    PYTHONPATH=src python docs/_gen_api.py --check  # exit 1 if docs/api.md is out of date (tests/test_docs.py)

Signatures and summaries come from the code, so they cannot drift; the hand-written parts are the module intros and
the notes on how each name differs from the original NPU patch and from NVIDIA Apex (NOTES below).
"""

from __future__ import annotations

import argparse
import enum
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
    ("apex.contrib.clip_grad", "NVIDIA Apex's `clip_grad_norm_` (`from apex.contrib.clip_grad import "
     "clip_grad_norm_`), on every device.", None),
    ("apex.contrib.layer_norm", "NVIDIA Apex's `FastLayerNorm` and `FastLayerNormFN` (its persistent-kernel layer "
     "norm, which Megatron-core and ColossalAI pick up), on torch's `layer_norm` on every device.", None),
    ("apex.contrib.group_norm", "NVIDIA Apex's `GroupNorm` with an optional fused SiLU (Stable Diffusion UNets in "
     "NeMo and diffusers-based trainers swap it in for `nn.GroupNorm`), on every device, dtype and layout.", None),
    ("apex.contrib.xentropy", "NVIDIA Apex's `SoftmaxCrossEntropyLoss` (softmax cross entropy with label "
     "smoothing and a padding index, per-row float32 losses), which fairseq, OpenNMT and MLPerf-style translation "
     "and BERT scripts call, on every device.", None),
    ("apex.contrib.conv_bias_relu", "NVIDIA Apex's fused 2-D convolution + bias (+ mask) (+ ReLU) functions "
     "(`ConvBiasReLU`, `ConvBias`, `ConvBiasMaskReLU`, `ConvFrozenScaleBiasReLU`), on torch's convolution on every "
     "device.", None),
    ("apex.contrib.fmha", "NVIDIA Apex's attention over sequences packed end to end (`FMHAFun`, `FMHA`: MLPerf "
     "BERT), on torch's ops on every device.", None),
    ("apex.contrib.focal_loss", "NVIDIA Apex's fused sigmoid focal loss (`FocalLoss.apply`, `focal_loss`) for "
     "RetinaNet / EfficientDet-style detectors, with label smoothing, padded classes and ignored anchors, on every "
     "device.", ["FocalLoss"]),
    ("apex.contrib.focal_loss.focal_loss", "The functional form (the package's `focal_loss` attribute is this "
     "module, as upstream's).", ["focal_loss"]),
    ("apex.contrib.index_mul_2d", "NVIDIA Apex's `index_mul_2d(in1, in2, idx1)` = `in1[idx1] * in2`, "
     "differentiable twice (force-field models), on every device.", None),
    ("apex.contrib.multihead_attn", "NVIDIA Apex's sequence-first multi-head attention modules (`SelfMultiheadAttn`, "
     "`EncdecMultiheadAttn`, with upstream's parameter names and stacked per-head projections) and its masked "
     "softmax with dropout, on torch's ops on every device.", None),
    ("apex.contrib.sparsity", "NVIDIA Apex's automatic sparsity (`ASP`): 2:4 structured pruning of a model's "
     "weights, masked training afterwards, checkpoints that carry the masks; and its mask library "
     "(`create_mask`), on every device.", None),
    ("apex.contrib.transducer", "NVIDIA Apex's RNN-T (transducer) joint and loss (MLPerf RNN-T and ASR "
     "trainers), with packed layouts, on torch's ops on every device.", None),
    ("apex.contrib.optimizers", "NVIDIA Apex's older contrib optimizers: `FP16_Optimizer` driving `FusedAdam` (the "
     "pair old BERT fine-tuning scripts import) and `FusedLAMB`, on every device (see "
     "[upstream-compat.md](upstream-compat.md)).", None),
    ("apex.parallel", "Distributed data parallel on torch.distributed (gloo / nccl / hccl), LARC and SyncBatchNorm"
     + (" (see [distributed.md](distributed.md))." if (Path(__file__).resolve().parent / "distributed.md").exists()
        else "."), None),
    ("apex.fp16_utils", "Manual mixed precision, NVIDIA Apex's API from before amp: fp16 models with fp32 "
     "batchnorm, fp32 master weights and loss scaling around any optimizer (see "
     "[upstream-compat.md](upstream-compat.md)).", None),
    ("apex.multi_tensor_apply", "NVIDIA Apex's `multi_tensor_applier`, which calls the multi-tensor ops of "
     "`apex.multi_tensor_apply.amp_C` (or NVIDIA's compiled `amp_C`) with a fixed chunk size.", None),
    ("apex.multi_tensor_apply.amp_C", "NVIDIA's `amp_C` multi-tensor ops with upstream's signatures "
     "`(chunk_size, noop_flag, tensor_lists, *args)`, on CPU (through the C++ core and the optimizers' math), "
     "CUDA and NPU (torch ops). Not a top-level module: where NVIDIA's compiled `amp_C` is not installed, "
     "`import amp_C` finds these ops, before or after `import apex` (see `register_amp_C`).", None),
    ("apex.mlp", "NVIDIA Apex's `MLP`: linear layers each followed by one activation, on torch's ops on every "
     "device.", None),
    ("apex.fused_dense", "NVIDIA Apex's `FusedDense` (`x W^T + b`) and `FusedDenseGeluDense` (`GELU(x W1^T + b1) "
     "W2^T + b2`, GELU's tanh form) with upstream's `*Func.apply` forms, on torch's ops on every device.", None),
    ("apex.transformer", "NVIDIA Apex's Megatron-style enums (`apex.transformer.enums`); its model-parallel parts "
     "(`parallel_state`, `tensor_parallel`, `pipeline_parallel`) are not part of this package (see "
     "[upstream-compat.md](upstream-compat.md)).", ["AttnMaskType", "AttnType", "LayerType", "ModelType"]),
    ("apex.transformer.functional", "Upstream's fused scale-mask softmax (Megatron's attention softmax, NeMo) and "
     "rotary position embeddings (Megatron-core's `apply_rope_fusion`), on torch's ops on every device.", None),
    ("apex.transformer.layers", "Megatron's layer norms under upstream's names, marking their parameters with "
     "`sequence_parallel_enabled`.", None),
    ("apex.transformer.log_util", "Upstream's transformer logging helpers.", None),
    ("apex.normalization", "NVIDIA Apex's fused layer norm and RMS norm modules, on torch's own kernels on every "
     "device.", None),
    ("apex.normalization.fused_layer_norm", "The functional forms and upstream's `*Function.apply` names (the "
     "modules are listed under `apex.normalization`).",
     ["fused_layer_norm", "fused_layer_norm_affine", "fused_rms_norm", "fused_rms_norm_affine",
      "mixed_dtype_fused_layer_norm_affine", "mixed_dtype_fused_rms_norm_affine", "FusedLayerNormAffineFunction",
      "FusedLayerNormFunction", "FusedLayerNormAffineMixedDtypesFunction", "FusedRMSNormAffineFunction",
      "FusedRMSNormFunction", "FusedRMSNormAffineMixedDtypesFunction"]),
    ("apex", "NVIDIA Apex's top-level helpers, loaded on first use (`import apex` does not import torch).",
     ["check_cudnn_version_and_warn", "DeprecatedFeatureWarning", "deprecated_warning"]),
    ("apex.dump", "The Ascend patch's per-module dump tool: forward inputs/outputs and backward grads of a model's "
     "children for one step, written into an HDF5 file in the patch's layout (needs `h5py`; see "
     "[upstream-compat.md](upstream-compat.md)).", None),
    ("apex._device", "The device layer (private module, stable for examples and tests): one place that decides "
     "npu > cuda > cpu and never imports torch_npu when it is absent.",
     ["detect_device", "device_available", "default_amp_dtype"]),
]

def _decorator_note(cast: str) -> str:
    return ("NVIDIA: same decorator. The wrapped function casts its tensor arguments (also inside "
            f"lists, tuples and dicts) {cast} whenever an O1 session is active, inside or outside the model's "
            "forward, except inside `disable_casts()`; otherwise it runs unchanged. Inside the forward autocast "
            "still governs the ops it runs, unless the session has `user_cast_preferred=True` (the NPU patch's "
            "option), which runs it with autocast disabled so its cast holds.")


def _register_note(decorator: str) -> str:
    return ("NVIDIA: same names and arguments; applies while an O1 session is active and wraps only the named "
            "module attribute (no global patching; tensor methods and references taken earlier are not "
            f"intercepted), casting as `{decorator}` does; teardown restores the attribute. Registering during a "
            "session takes effect at once, and registrations carry over to later sessions (and apply under an "
            "active `amp.init` handle too). A missing or "
            "non-callable attribute raises ValueError. NPU patch: `user_cast_preferred=True` makes the registered "
            "cast win over autocast (in the patch, over its built-in cast lists).")


_ON_EVERY_DEVICE = ("Runs on cpu (apex_C kernels), cuda and npu (torch ops on the flat buffers), where NVIDIA's "
                    "needs CUDA; bf16 params work.")

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
        "and `fold_unscale` (opt-in: the fused optimizer unscales inside its update). As NVIDIA's, O2/O3 models "
        "return fp32 values from `state_dict()` (`fp32_state_dict=False` keeps the model dtype) and existing "
        "optimizer state follows the params' new dtype; under O2 an apex optimizer that loaded an O2 checkpoint "
        "before `initialize` keeps its masters, a torch optimizer gets a warning (docs/amp.md, Checkpointing)."),
    "apex.amp.scale_loss": (
        "Same contract as NVIDIA's: yields `loss.float() * scale`; on exit unscales, checks for inf/nan and "
        "updates the scale; an overflow skips the owning optimizers' next `step()`. With `combine_grad` the "
        "unscale + check is one pass over each combined grad buffer."),
    "apex.amp.state_dict": "Upstream's format, so checkpoints move between NVIDIA amp and this package.",
    "apex.amp.deinitialize": "Not in NVIDIA Apex or the NPU patch: undoes `initialize` (for tests and notebooks).",
    "apex.amp.LossScaler": (
        "Dynamic scaler with the NPU patch's tunables (init, growth, backoff, window, min, max). Every value is "
        "checked at construction and at `load` (non-finite or non-positive scales rejected); growth fires when the "
        "clean-step count reaches or exceeds the window, so a loaded count above it resumes growth. Upstream's "
        "`_overflow_buf` flag works as scripts use it (swap in the flag of your own `amp_C.multi_tensor_scale`, "
        "then `update_scale()` counts a nonzero flag as an overflow); amp's own unscale does not need it, so the "
        "flag is only made on first access."),
    "apex.optimizers.CombinedOptimizer": (
        "Base class of every fused optimizer here. Params and per-param states are combined lazily at the "
        "first step, per dtype and param group; `state[p]` entries stay views, so `state_dict()` has "
        "torch.optim's layout. Grads are read where autograd left them; a flat grad buffer is made only when "
        "grads are kept between steps (`zero_grad(set_to_none=False)`: adopted at the second step) or amp or "
        "clipping need one, so with torch's default `zero_grad()` the optimizer holds no copy of the grads. "
        "Sharing broken by user code (`p.data = ...`, a new `p.grad`, `model.to(...)`) is "
        "detected before the update and healed by re-combining. Stricter than torch: a param listed twice (in one "
        "group or two), infinite hyperparameters, and checkpoint states a step could not use (non-tensors, wrong "
        "shapes or dtypes, steps that are not finite counts >= 0, incomplete entries) raise TypeError/ValueError "
        "naming the group, param index and key, at construction, `add_param_group` or `load_state_dict`, with "
        "nothing changed. Options may be numpy scalars (`lrs[t]` of a numpy schedule): a step that passes its "
        "checks rewrites them in the group as the Python numbers they hold, so the update computes as with those "
        "numbers (torch.optim's own host arithmetic would run in the numpy dtype, e.g. float32); numpy arrays "
        "are refused, as torch's ops refuse them."),
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
        "(NVIDIA's needs CUDA). `amsgrad=True` raises as NVIDIA's does. torch.optim.Adam/AdamW checkpoints load; "
        "one asking for AMSGrad, or for the other weight-decay rule than `adam_w_mode` with a non-zero decay, "
        "raises ValueError (at load, `add_param_group` or the step) instead of running plain Adam or the wrong "
        "decay."),
    "apex.contrib.optimizers.FusedAdam": (
        "NVIDIA's contrib FusedAdam: same signature, `step(closure, grads, output_params, scale, grad_norms)` and "
        "kernel math (eps inside or outside the root, decay added to the update, combined scale with "
        "`max_grad_norm`); torch ops on every device instead of the `fused_adam_cuda` extension. New here: the "
        "group norm is computed when `max_grad_norm > 0` and no `grad_norms` are given (NVIDIA failed); bad "
        "lengths, shapes and hyperparameters, complex or integer params and grads, unwritable output params, "
        "non-numeric `grad_norms` and states a step cannot read raise before anything changes, and "
        "`load_state_dict` checks groups and states first (all or nothing); the amp-stash path is not taken "
        "(amp unscales before `step()`). Not the same math as `apex.optimizers.FusedAdam`."),
    "apex.contrib.optimizers.FP16_Optimizer": (
        "NVIDIA's contrib FP16_Optimizer: fp32 master groups, loss scale (static, or dynamic from 2**16, halved on "
        "overflow to at least 1, doubled every 1000 clean steps), `state_dict` keys. New here: "
        "`dynamic_loss_args` may give `init_scale`, `scale_factor`, `scale_window` (NVIDIA refused any); an "
        "optimizer whose step cannot take flat grads, a closure or a non-tensor loss raise instead of failing "
        "later; groups without grads get norm 0 (NVIDIA misaligned the norms); banners print only with `verbose`; "
        "`load_state_dict` checks every field as the constructor does before loading anything."),
    "apex.contrib.optimizers.FusedLAMB": (
        "NVIDIA's contrib FusedLAMB signature over `apex.optimizers.FusedLAMB`'s math with `use_nvlamb=False`, on "
        "every device (NVIDIA's needed `fused_lamb_cuda`)."),
    "apex.dump.HookerAndDumper": (
        "The NPU patch's: same names, file name and layout (groups `NNNN_<Module>`, datasets `feat_input*`, "
        "`feat_output*`, `grad_output*`, `grad_input*`), same kind of backward hook. New here: quiet unless "
        "`is_screen_display=True`; `full_backward=True`; bf16 stored as float32 with a `torch_dtype` attribute; "
        "nested tuples and numbers written; registering again replaces the earlier hooks; bad arguments, a "
        "missing h5py or a child refusing the hook raise before anything is registered. Not in NVIDIA Apex."),
    "apex.contrib.clip_grad.clip_grad_norm_": (
        "NVIDIA: same signature and result; upstream is torch's `clip_grad_norm_` too, except that it sends the "
        "2-norm of float32/float16 CUDA grads through its multi-tensor kernels (torch's foreach kernels do that "
        "work here). New here: a negative or nan `max_norm` and a non-positive `norm_type` raise ValueError, "
        "non-tensor entries and sparse, nested or meta grads TypeError, before any grad is scaled."),
    "apex.contrib.layer_norm.FastLayerNorm": (
        "NVIDIA: same arguments, parameters (`weight` ones, `bias` zeros), output dtype (the weights') and autocast "
        "rule. Upstream's kernel exists for a list of hidden sizes on CUDA only; here any size on any device, on "
        "torch's `layer_norm` computed in float32. `memory_efficient` is recorded only."),
    "apex.contrib.layer_norm.FastLayerNormFN": (
        "NVIDIA: a `torch.autograd.Function` over its CUDA kernel; here `forward(ctx, x, gamma, beta, epsilon, "
        "memory_efficient=False)` with upstream's argument names (Megatron-core inspects them) and `apply(...)` = "
        "`forward(None, ...)`, autograd by torch. An input whose last dimension is not `gamma.numel()` raises "
        "ValueError (upstream reshaped it to rows of the hidden size)."),
    "apex.mlp.MLP": (
        "NVIDIA: same arguments, attributes (`weights`, `biases`, `weight_<i>` / `bias_<i>`, `num_layers`, "
        "`mlp_sizes`, integer `bias` / `activation` codes), initialisation, activation after every layer and "
        "autocast rule; upstream runs one CUDA extension call, here `F.linear` per layer on any device and dtype. "
        "Input feature counts are checked (ValueError); `.to()` keeps `weights` / `biases` pointing at the "
        "registered parameters."),
    "apex.mlp.MlpFunction": (
        "NVIDIA: a `torch.autograd.Function` over its CUDA extension; here `forward(ctx, bias, activation, *args)` "
        "with upstream's arguments and `apply(...)` = `forward(None, ...)`, autograd by torch."),
    "apex.mlp.mlp_function": "NVIDIA: same arguments; arguments checked (shapes, codes) before anything runs.",
    "apex.contrib.group_norm.GroupNorm": (
        "NVIDIA: same arguments (`act` None / '' / 'silu' / 'swish'), parameters (ones / zeros), output dtype and "
        "layout (the input's) and float32 statistics; upstream ran NHWC CUDA kernels for listed channel and group "
        "counts and `F.group_norm` (in the weight's dtype) otherwise, here one float32 path for every shape, "
        "layout, dtype pairing and device; the backward keeps the input in its own dtype and per-group statistics "
        "as upstream's kernel. An unknown `act` raises ValueError (upstream's fallback ignored it); sizes, eps and "
        "the input's channels are checked. Upstream's functional names (`torch_group_norm`, "
        "`cuda_group_norm_nhwc_one_pass` / `_two_pass`, `cuda_group_norm_v2_nhwc`) run the same math; the "
        "kernel-selection internals (`_check_legality`, `SUPPORTED_CHANNELS`, ...) are not provided."),
    "apex.contrib.xentropy.SoftmaxCrossEntropyLoss": (
        "NVIDIA: same `apply(logits, labels, smoothing=0.0, padding_idx=0, half_to_float=False)`, loss (smoothing "
        "over all C classes), float32 losses, padding rows at 0 with no gradient, and saved tensors (logits, "
        "log-sum-exp, labels); upstream's CUDA kernel, here float32 torch ops over blocks of rows on any device "
        "(2.2x faster than the unfused torch reference of upstream's own test on a CPU). Logits may be float32, "
        "float16 or bfloat16 in any layout; `half_to_float` is accepted for any dtype and changes nothing "
        "(upstream refused it for non-fp16 logits); arguments checked, CPU labels range-checked."),
    "apex.check_cudnn_version_and_warn": (
        "NVIDIA: same arguments, answer and warning; arguments' types checked. Nothing in this package needs "
        "cuDNN, so it answers for the caller's own code."),
    "apex.DeprecatedFeatureWarning": "NVIDIA: the same FutureWarning subclass.",
    "apex.deprecated_warning": "NVIDIA: same argument; warns on rank 0 of an initialised process group or without one.",
    "apex.contrib.conv_bias_relu.ConvBiasReLU": (
        "NVIDIA: same arguments `(x, weight, bias, padding, stride)` and result; upstream's cuDNN fusion (CUDA, "
        "channels-last), here `F.conv2d` with the bias then ReLU on any device and memory format. Under autocast "
        "the inputs take the device's autocast dtype (upstream: float16 under CUDA's); shapes, dtypes, padding and "
        "stride checked; a bias of shape (K,) works too."),
    "apex.contrib.conv_bias_relu.ConvBias": "NVIDIA: as `ConvBiasReLU`, without the ReLU.",
    "apex.contrib.conv_bias_relu.ConvBiasMaskReLU": (
        "NVIDIA: as `ConvBiasReLU`, the biased output multiplied by `mask` (the output's shape, any dtype) before "
        "the ReLU; the mask's shape is checked."),
    "apex.contrib.conv_bias_relu.ConvFrozenScaleBiasReLU": (
        "NVIDIA: as `ConvBiasReLU` with `relu(conv * scale + bias)` (one rounding, as upstream's epilogue), "
        "`scale` and `bias` frozen (no gradient)."),
    "apex.contrib.fmha.FMHAFun": (
        "NVIDIA: same `apply(qkv, cu_seqlens, p_dropout, max_s, is_training, zero_tensors)` and result (float32 "
        "scores and softmax, probabilities rounded to the inputs' dtype before the values' product); upstream's "
        "CUDA kernels (fp16, head size 64, sequences up to 512), here one padded batched product on any device, "
        "length, head size and floating dtype. `max_s` must cover the longest sequence; `cu_seqlens` is checked "
        "(read on the host)."),
    "apex.contrib.fmha.FMHA": (
        "NVIDIA: same constructor (a config with `attention_probs_dropout_prob`, `num_attention_heads`, "
        "`hidden_size`) and `forward(qkv, cu_seqlens, max_s, is_training=True, zero_tensors=False)`; the config and "
        "`qkv`'s width are checked."),
    "apex.contrib.focal_loss.FocalLoss": (
        "NVIDIA: same `apply(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma, "
        "label_smoothing=0.0)`, loss (modulating factor from the unsmoothed targets, targets smoothed towards 1/2), "
        "labels (-1 negative, -2 ignored), padded classes, float32 loss and saved gradient (computed in the "
        "forward, kept in the logits' dtype, scaled in the backward); upstream's CUDA kernel, here torch ops over "
        "blocks of anchors on any device. No padding or alignment of the class dimension is needed; float64 and "
        "bfloat16 logits work; a repeated backward (`retain_graph=True`) gives the same gradient (upstream's "
        "scaled the saved one in place); arguments checked, CPU labels range-checked."),
    "apex.contrib.focal_loss.focal_loss.focal_loss": (
        "NVIDIA: same arguments (`num_positive_sum` so named), `FocalLoss.apply` of them."),
    "apex.contrib.index_mul_2d.index_mul_2d": (
        "NVIDIA: same arguments, result and first and second derivatives; upstream's CUDA kernels for float32 and "
        "float16, here `index_select` and a product (autograd supplies every order) on any device, bfloat16 and "
        "float64 too, int32 indices too. Shapes, dtypes and devices checked before anything runs (upstream "
        "asserted some)."),
    "apex.contrib.multihead_attn.SelfMultiheadAttn": (
        "NVIDIA: same arguments, parameters (names, per-head stacked `in_proj_weight`, `q/k/v_weight` with "
        "`separate_qkv_params`, initialisation), forward signature, masks (bool / uint8 nonzero masked, additive "
        "with `mask_additive`), `is_training` switching dropout, `(output, None)` result. Both `impl` values run "
        "one torch implementation on any device; `impl` only chooses where the layer norm's parameters live "
        "(`lyr_nrm_*_weights` or `lyr_nrm`), as upstream's checkpoints hold them. Beyond upstream: "
        "`mask_additive` with the layer norm or a time mask, both masks at once; `key` / `value` other than "
        "`query` (which upstream ignored) raise ValueError; shapes, dtypes and masks checked."),
    "apex.contrib.multihead_attn.EncdecMultiheadAttn": (
        "NVIDIA: same arguments, parameters (`in_proj_weight_q`, per-head stacked `in_proj_weight_kv`, "
        "initialisation), forward, masks and result; keys and values are projected from `key` (a `value` other "
        "than `key`, which upstream ignored, raises ValueError). Biases work with `impl=\"fast\"` too (upstream "
        "refused them); one torch implementation for both `impl` values on any device."),
    "apex.contrib.multihead_attn.fast_mask_softmax_dropout_func": (
        "NVIDIA: same arguments `(is_training, heads, inputs, pad_mask, mask_additive, dropout_prob)` and result; "
        "upstream's CUDA kernel, here masked `softmax` and `dropout` on any device; arguments and mask shape "
        "checked."),
    "apex.contrib.sparsity.ASP": (
        "NVIDIA: same class methods and arguments (`init_model_for_pruning`, `init_optimizer_for_pruning`, "
        "`compute_sparse_masks`, `restore_pruned_weights`, `is_sparsity_enabled`, `prune_trained_model`, "
        "`already_init_asp_model`, `set_permutation_saving_params`), eligible weights and size rule, mask buffers "
        "under upstream's names (so checkpoints carry over), masked `step`, printed messages by `verbosity`. No "
        "input-channel permutation search (`allow_permutation` is accepted; masks use the channels in their "
        "order). Beyond upstream: any device; subclasses of listed layer types; `Conv3d` weights (upstream's mask "
        "library had no 5-D case); the size rule for every dtype; entries follow the model when it is moved after "
        "initialisation; arguments checked before anything changes, RuntimeError (not assert) for calls out of "
        "order; `already_init_asp_model` returns a bool at every verbosity."),
    "apex.contrib.sparsity.create_mask": (
        "NVIDIA: same arguments, patterns (`m4n2_1d`, `m4n2_2d_best`, `m4n2_2d_greedy`), layouts (groups along "
        "input channels; upstream's row order for 3-D and 4-D weights) and result dtype; on any device (upstream's "
        "needed CUDA), with ties broken towards the lower position, 5-D weights, rows whose length is not a "
        "multiple of 4 (upstream failed on them), an unknown pattern a ValueError."),
    "apex.contrib.transducer.TransducerJoint": (
        "NVIDIA: same arguments, forward, output (padded with -1 outside the lengths, or packed rows), ReLU, "
        "dropout in training, `mask_probe`; upstream's CUDA kernels, here the packed rows written sequence by "
        "sequence and reduced per sequence in the backward (float32 accumulation), on any device. ReLU and "
        "dropout work with `opt=0` too (upstream refused them); lengths, shapes, `packed_batch` and `batch_offset` "
        "(against the lengths, on any device) checked."),
    "apex.contrib.transducer.TransducerLoss": (
        "NVIDIA: same arguments, forward, per-sequence loss in the logits' dtype, packed input, `debug_list` "
        "(alpha, beta); upstream's CUDA kernels, here the lattices an anti-diagonal at a time over the batch in "
        "float32 (float64 for float64) and the logits' gradient from them, on any device. Both "
        "`fuse_softmax_backward` values give the float32 form (upstream's unfused one went through an fp16 "
        "log-softmax); the padding of the input, whatever it holds, gets zero gradient; the lattices end at the "
        "longest sequence whatever `max_f_len` says (upstream sized them by it); arguments, shapes and CPU "
        "lengths / labels checked, and with packed input `batch_offset` against the lengths and `max_f_len` "
        "against `f_len.max()` on any device."),
    "apex.transformer.layers.FusedLayerNorm": (
        "NVIDIA: same arguments (`sequence_parallel_enabled` keyword only) and marks on the module, weight and "
        "bias; the norm is `apex.normalization.FusedLayerNorm`'s. A non-bool flag raises TypeError."),
    "apex.transformer.layers.MixedFusedLayerNorm": (
        "NVIDIA: same arguments and marks; the norm is `apex.normalization.MixedFusedLayerNorm`'s (output in the "
        "weights' dtype). Upstream marked the parameters only when the flag was True; here always, with its value."),
    "apex.transformer.layers.FastLayerNorm": (
        "NVIDIA: same arguments and marks; always `apex.contrib.layer_norm.FastLayerNorm` (upstream fell back to "
        "`FusedLayerNorm` with a warning where its CUDA extension was missing)."),
    "apex.transformer.log_util.get_transformer_logger": "NVIDIA: same; a non-str name raises TypeError.",
    "apex.transformer.log_util.set_logging_level": (
        "NVIDIA: same argument, sets the `apex` logger's level (upstream's had a handler with the model-parallel "
        "rank; this package adds none)."),
    "apex.transformer.AttnMaskType": "NVIDIA: same members and values (`padding` 1, `causal` 2).",
    "apex.transformer.AttnType": "NVIDIA: same members and values (`self_attn` 1, `cross_attn` 2).",
    "apex.transformer.LayerType": "NVIDIA: same members and values (`encoder` 1, `decoder` 2).",
    "apex.transformer.ModelType": (
        "NVIDIA: same members and values (`encoder_or_decoder` 1, `encoder_and_decoder` 2); upstream defined it in "
        "`apex.transformer.enums` without exporting it from the package, here both."),
    "apex.transformer.functional.FusedScaleMaskSoftmax": (
        "NVIDIA: same arguments, checks (RuntimeError for both dtype flags or a scale without `softmax_in_fp32`) "
        "and choice of path (`is_kernel_available`: upstream's CUDA kernel limits, `get_batch_per_block` from its "
        "launch shape); the fused path is upstream's kernel math (float32 softmax, masked score -10000, fully "
        "masked rows zero, causal keys above the diagonal zero) on torch's ops on every device, the torch path "
        "upstream's sequence. Inputs and masks are checked (ValueError / TypeError)."),
    "apex.transformer.functional.GenericFusedScaleMaskSoftmax": (
        "NVIDIA: same arguments; with fusion on, the fused padding-mask math for every key length (upstream "
        "assigned its generic function to the fusion flag, so its kernel limits still applied on CUDA)."),
    "apex.transformer.functional.fused_apply_rotary_pos_emb": (
        "NVIDIA: same arguments and bits (the rotation computed in the input's dtype, as upstream's kernel and "
        "Megatron's unfused reference: cos / sin rounded to it, products and sum rounded); "
        "`transpose_output_memory` lays the output out as (b, s, h, d). `freqs` may be longer than s and of any "
        "floating dtype; shapes checked before anything runs."),
    "apex.transformer.functional.fused_apply_rotary_pos_emb_cached": (
        "NVIDIA: same arguments and bits, with `cos_` / `sin_` given (float32 or the input's dtype)."),
    "apex.transformer.functional.fused_apply_rotary_pos_emb_thd": (
        "NVIDIA: same arguments and bits for packed sequences; `cu_seqlens` (int32 or int64) is checked to rise "
        "from 0 to the token count (one host read of the b + 1 offsets)."),
    "apex.transformer.functional.fused_apply_rotary_pos_emb_2d": (
        "NVIDIA: same arguments and bits (rows rotate the first half of each head, columns the second); the head "
        "dimension must be a multiple of 4 and the tables at least `img_h` / `img_w` long (checked)."),
    "apex.fused_dense.FusedDense": (
        "NVIDIA: same arguments, parameters (`weight` out x in, `bias` or None) and autocast rule; upstream runs a "
        "cuBLASLt GEMM with the bias in its epilogue on CUDA, here `F.linear` on any device and dtype (the bias is "
        "also added inside the GEMM call: one rounding). Parameters start as `nn.Linear`'s (upstream left them "
        "uninitialised); `device=` / `dtype=` keywords as `nn.Linear`; input of any rank (upstream: 2-D); shapes "
        "and dtypes checked before anything runs."),
    "apex.fused_dense.FusedDenseGeluDense": (
        "NVIDIA: same arguments, parameters (`weight1`, `bias1`, `weight2`, `bias2`, registered in that order) and "
        "math (GELU's tanh approximation, cuBLASLt's epilogue); here `F.linear`, `F.gelu(approximate='tanh')`, "
        "`F.linear` on any device and dtype. `bias=False` gives a form without biases (upstream refused it); "
        "initialisation as two `nn.Linear`s; input of any rank."),
    "apex.fused_dense.FusedDenseFunc": (
        "NVIDIA: a `torch.autograd.Function` over its CUDA extension; here `forward(ctx, input, weight, bias)` with "
        "upstream's argument names and `apply(...)` = `forward(None, ...)`, autograd by torch. Runs in the dtypes "
        "given, never casting (as upstream's extension), whatever autocast says."),
    "apex.fused_dense.DenseNoBiasFunc": (
        "NVIDIA: `apply(input, weight)` = `input @ weight.T`; here `F.linear` without bias, any input rank, in the "
        "dtypes given."),
    "apex.fused_dense.FusedDenseGeluDenseFunc": (
        "NVIDIA: `apply(input, weight1, bias1, weight2, bias2)` over its CUDA extension; here torch's ops (biases "
        "may be None), in the dtypes given; autograd keeps what upstream's backward kept (input, weights, GELU "
        "input and output)."),
    "apex.contrib.combine_tensors": (
        "The NPU patch's `combine_npu`, with this package's layout (also exported as torch_npu's "
        "`npu_combine_tensors`; `combine_npu` itself keeps the patch's layout). "
        "Slots are aligned to `ALIGN_ELEMENTS` elements; the buffer is zero-filled so padding stays zero. Works on "
        "cpu and cuda through torch APIs; on npu, tensors in a private storage format go to torch_npu's op. "
        "`apex.contrib.combine_tensors` is the submodule, as in the NPU patch's layout (`import "
        "apex.contrib.combine_tensors as ct; ct.combine_npu(...)`), and calling it calls this function."),
    "apex.contrib.compact_state_dict": (
        "Not in the NPU patch: saving a model or optimizer whose tensors are combined views would otherwise "
        "write the whole flat buffer once per view. Modules holding combined params need no call: combining "
        "hooks them, so their `state_dict()` is compact (and safetensors-compatible) by default, without a copy."),
    "apex.parallel.DistributedDataParallel": (
        "NVIDIA's arguments and bucket semantics (`message_size` is the minimum bucket size, whole params; "
        "`allreduce_trigger_params` set the bucket boundaries); built on torch.distributed (no home-made "
        "transport), gloo on CPU included; CUDA streams become process groups (a no-op difference on CPU)."),
    "apex.parallel.SyncBatchNorm": (
        "Works on CPU with gloo too (torch.nn.SyncBatchNorm refuses CPU tensors). Like NVIDIA's, it is a "
        "`_BatchNorm`, not a `torch.nn.SyncBatchNorm`, so torch's DistributedDataParallel accepts it on CPU."),
    "apex.amp.init": (
        "NVIDIA: same arguments (`enabled, loss_scale, enable_caching, verbose, allow_banned, patch_type`) and "
        "the same process-wide casts of its function lists; differences per function are listed in "
        "[amp.md](amp.md#the-older-api-ampinit). Bad arguments raise before anything is patched; a second "
        "`init` deactivates the first handle instead of stacking patches; `amp.deinitialize()` deactivates it too."),
    "apex.amp.AmpHandle": (
        "NVIDIA: same methods (`scale_loss`, `wrap_optimizer`, `is_active`, `_deactivate`, `_clear_cache`, "
        "`has_cache`, `verbose`). `scale_loss` unscales only the grads its backward added (earlier grads are "
        "set aside and added back), so accumulation is exact; the weight-cast cache also drops an entry whose "
        "weight changed in place or that was made under `no_grad`."),
    "apex.amp.NoOpHandle": "NVIDIA: same; what `amp.init(enabled=False)` returns, passing everything through.",
    "apex.amp.OptimWrapper": (
        "NVIDIA: same (`handle.wrap_optimizer(optimizer, num_loss)`): one loss scaler per loss, a step skipped "
        "when any loss overflowed; a `closure` raises NotImplementedError as there. More `scale_loss` calls "
        "than `num_loss` between steps raise RuntimeError."),
    # ---- apex.amp (the NPU patch's amp is NVIDIA's with the extras listed under initialize)
    "apex.amp.disable_casts": (
        "NVIDIA: same name, a context manager. Here it switches off both parts of O1's casting for the block: "
        "the autocast around the forward and the registered-function / decorator casts. It nests, holds per "
        "thread, and changes nothing outside an O1 session."),
    "apex.amp.half_function": _decorator_note("that are float32 to the session's low-precision dtype (fp16, or "
                                              "bf16 by default on cpu; float64 stays, as upstream)"),
    "apex.amp.float_function": _decorator_note("that are fp16/bf16 to float32 (float64 stays, as upstream)"),
    "apex.amp.promote_function": _decorator_note("that are floating point to the widest floating dtype among them"),
    "apex.amp.register_half_function": _register_note("half_function"),
    "apex.amp.register_float_function": _register_note("float_function"),
    "apex.amp.register_promote_function": _register_note("promote_function"),
    "apex.amp.load_state_dict": (
        "NVIDIA: same format, so its amp checkpoints load; as there, unexpected keys raise RuntimeError and "
        "entries beyond `num_losses` are skipped. Here every entry is validated first (a dict with a finite "
        "positive `loss_scale`, a 1-element tensor accepted, and an int `unskipped` >= 0; TypeError/ValueError "
        "naming the key) and nothing is set when one is bad; the warnings go to the `apex.amp` logger."),
    "apex.amp.master_params": (
        "NVIDIA: same generator over the optimizer's param groups: the fp32 masters under O2, the model params "
        "otherwise. Their grads are unscaled when `scale_loss` exits, with or without `combine_grad`, so clip "
        "them between the exit and `step()`; not with `fold_unscale=True`, where the grads stay scaled."),
    # ---- apex.optimizers: the NPU patch's classes
    "apex.optimizers.Lamb": (
        "NPU patch: its non-fused LAMB, with NpuFusedLamb's semantics (no bias correction, weight norm clamped "
        "to 10, `adam=True` forces trust ratio 1) and its per-param logging entries (`weight_norm`, `adam_norm`, "
        "`trust_ratio`); added here: `use_global_grad_norm`, for parity with NpuFusedLamb. A plain "
        "`torch.optim.Optimizer` (one tensor at a time, nothing combined); the math runs in fp32 for every "
        "param dtype, states are stored in the param dtype. Checked as the combined classes check: torch's "
        "maximize/capturable/differentiable raise, a loaded group without an option takes the default, a state "
        "entry that is not a dict raises at the step. NVIDIA: no `Lamb` (its LAMB is `FusedLAMB`, with "
        "bias correction)."),
    "apex.optimizers.NpuFusedAdadelta": (
        "As NpuFusedAdam (standalone, bf16, either zero_grad), with torch.optim.Adadelta's semantics and "
        "defaults; state dicts load to and from torch.optim.Adadelta (one asking for `maximize` or other options "
        "we lack raises ValueError and changes nothing). NVIDIA: no such class."),
    "apex.optimizers.NpuFusedAdamP": (
        "NPU patch: same signature and defaults. AdamP as timm computes it (Adam with bias correction, optional "
        "Nesterov; for params with more than one dimension the radial part is projected out and the decoupled "
        "decay scaled by `wd_ratio` when the largest |cosine| of grad and param, per channel then per layer, is "
        "below `delta / sqrt(row length)`). Works standalone, with bf16 and with either zero_grad (see "
        "NpuFusedAdam). NVIDIA: no such class."),
    "apex.optimizers.NpuFusedRMSprop": (
        "As NpuFusedAdam (standalone, bf16, either zero_grad), with torch.optim.RMSprop's semantics (momentum, "
        "centered) and state layout; state dicts load to and from torch.optim.RMSprop. NVIDIA: no such class. "
        "For the TensorFlow formulation see `NpuFusedRMSpropTF`."),
    # ---- apex.optimizers: NVIDIA's classes
    "apex.optimizers.FusedAdagrad": (
        "NVIDIA: same signature, defaults and math (no learning-rate decay, accumulator from 0, "
        "`adagrad_w_mode=True` decouples the decay; `state[p]` holds `sum` only). " + _ON_EVERY_DEVICE
        + " torch.optim.Adagrad checkpoints load, except one with `lr_decay != 0`, which raises ValueError "
        "rather than train without the decay. NPU patch: no NpuFused counterpart."),
    "apex.optimizers.FusedLAMB": (
        "NVIDIA: same signature, defaults and math (global grad-norm clipping by the constructor's "
        "`max_grad_norm`, bias correction, per-group step, trust ratio where `weight_decay != 0` or `use_nvlamb`; "
        "`amsgrad=True` raises, also from a loaded or added group). " + _ON_EVERY_DEVICE + " The grads are left as "
        "they are (NVIDIA writes the update "
        "into `p.grad`); `max_grad_norm=None` turns clipping off. NPU patch: its LAMB is `NpuFusedLamb`, a "
        "different algorithm (no bias correction, weight norm clamped to 10, no clipping)."),
    "apex.optimizers.FusedMixedPrecisionLamb": (
        "NVIDIA: same signature and semantics: fp32 masters and moments for `reduced_precision_dtype` params, "
        "made at the first step, the rounded result written back to the model; `group['lr']` and "
        "`group['step']` are tensors; torch's GradScaler folds its unscale into the update and skips inf/nan "
        "steps. " + _ON_EVERY_DEVICE + " A param rebound after the first step (`p.data = ...`, `model.to(...)`) "
        "gets a new master instead of being overwritten from the old one. NPU patch: no counterpart."),
    "apex.optimizers.FusedNovoGrad": (
        "NVIDIA: same signature, defaults and math (per-tensor second moment, `norm_type` 2 or 0, `init_zero`, "
        "`reg_inside_moment`; `amsgrad=True` raises, also from a loaded or added group). " + _ON_EVERY_DEVICE
        + " The per-tensor norm is kept in "
        "`state[p]['exp_avg_sq']` (0-d) rather than per group and dtype in `group['exp_avg_sq']`, so skipped or "
        "added params work; a bad `norm_type` raises when the group is added, not at the first step. NPU patch: "
        "no counterpart."),
    "apex.optimizers.FusedSGD": (
        "NVIDIA: same signature; torch.optim.SGD's math, plus `wd_after_momentum=True` (decay added after the "
        "momentum). " + _ON_EVERY_DEVICE + " `materialize_master_grads` is accepted but changes nothing (our amp "
        "hands grads over through combined buffers); `zero_grad()` is torch's. A subclass of `NpuFusedSGD` "
        "(the NPU patch's SGD): with `wd_after_momentum=False` the update is the same."),
    # ---- apex.contrib
    "apex.contrib.ALIGN_ELEMENTS": (
        "New here. Slot alignment of the combined layout: each slot starts a multiple of 32 elements (64 bytes "
        "for half types, 128 for fp32) after the buffer start and holds exactly its tensor (`combine_tensors`, "
        "the optimizers, amp). The NPU patch rounded each slot up to 16 elements and added 32 more; `combine_npu` "
        "keeps that layout (`plan_ascend_layout`). NVIDIA: none."),
    "apex.contrib.change_data_ptr": (
        "NPU patch: a C++ function with the same arguments `(dst, src, offset)`. Here Python over torch APIs: "
        "`dst` keeps its identity, shape and strides and becomes a view into "
        "`src`; bad arguments raise TypeError / ValueError / IndexError with `dst` unchanged, and `dst` is "
        "returned. NVIDIA: none."),
    "apex.contrib.combine_npu": (
        "The NPU patch's name, arguments `(tensors, require_copy_value=True)` and layout: slot i holds "
        "`get_aligned_storage_size(t_i)` elements, one after the other, and the buffer is their sum "
        "(`plan_ascend_layout`). Checks, errors and the npu private-format hand-off are `combine_tensors`'. An "
        "empty list returns None, as the patch's did. NVIDIA: none."),
    "apex.contrib.npu_combine_tensors": (
        "torch_npu's later name for the NPU patch's `combine_npu`; the same function as `combine_tensors`. On "
        "npu, tensors with a private storage format are handed to torch_npu's own op. NVIDIA: none."),
    "apex.contrib.get_part_combined_tensor": (
        "NPU patch: same name and arguments `(combined, index, size)`; returns a view sharing the buffer's "
        "memory. Here non-int arguments raise TypeError, negative ones ValueError and a range past the buffer "
        "IndexError. NVIDIA: none."),
    "apex.contrib.is_combined_tensor_valid": (
        "NPU patch: same name and arguments, but stricter: the patch only checked that each data pointer lay "
        "inside the buffer; here each tensor must start exactly at its slot (of `plan_layout`, or of "
        "`plan_ascend_layout` for `combine_npu` buffers), with the buffer's dtype, "
        "dense, so a tensor rebound elsewhere or a list in another order is invalid. npu tensors in a private "
        "format are judged by torch_npu's own check. NVIDIA: none."),
    "apex.contrib.plan_layout": (
        "New here: the slot offsets and buffer length `combine_tensors` uses, also the layout of amp's "
        "`combine_grad` buffers and of DistributedDataParallel's flat grad buffers. Accepts tensors or element "
        "counts. NVIDIA and the NPU patch: none."),
    "apex.contrib.plan_ascend_layout": (
        "New here: the NPU patch's layout as `combine_npu` applies it, `ceil(n / 16) * 16 + 32` elements per "
        "slot, slots back to back, the buffer their sum. Accepts tensors or element counts. NVIDIA and the NPU "
        "patch: none (the patch computed it inside its combine)."),
    "apex.contrib.register_compact_state_dict_hook": (
        "New here (companion of `compact_state_dict`): makes an `nn.Module`'s or an optimizer's `state_dict()` "
        "return compact clones of tensors that view a larger storage (such as a combined buffer); returns a "
        "handle whose `remove()` undoes it. "
        "NVIDIA and the NPU patch: none."),
    # ---- apex.parallel
    "apex.parallel.CollectiveError": (
        "New here. A RuntimeError subclass (so existing `except RuntimeError` still catches it) raised by "
        "DistributedDataParallel, Reducer, `flat_dist_call`, SyncBatchNorm's CPU path and amp's `combine_ddp` "
        "when a collective fails or times out; the message names the operation, the original error is the "
        "`__cause__`."),
    "apex.parallel.convert_syncbn_model": (
        "NVIDIA: same arguments `(module, process_group=None, channel_last=False)`. Here every `BatchNorm*d` "
        "becomes our SyncBatchNorm keeping the same parameter and buffer objects (optimizers built earlier keep "
        "working), their dtype and device, training mode and `qconfig`."),
    "apex.parallel.create_syncbn_process_group": (
        "NVIDIA: same name and argument. 0 returns None (the default group); every rank must call it (creating "
        "groups is collective); a size that is not a non-negative int dividing the world size raises "
        "ValueError."),
    "apex.parallel.default_backend": (
        "New here: the torch.distributed backend for a device, gloo (cpu), nccl (cuda) or hccl (npu), for "
        "`init_process_group`; None means the device apex detects."),
    "apex.parallel.flat_dist_call": (
        "NVIDIA: same first arguments `(tensors, call, extra_args=None)` and the same averaging of an all-reduce "
        "over the ranks. Here tensors are grouped by dtype and device into flat chunks of at most 96 MiB, empty "
        "tensors are skipped, `call` is invoked with `group=` (the new `group` argument, default the world "
        "group), and failures raise `CollectiveError`."),
    "apex.parallel.LARC": (
        "NVIDIA: same arguments, defaults and math; the grads are rescaled in place and `param_groups`, `state`, "
        "`state_dict` ... are the wrapped optimizer's. Here LARC is a `torch.optim.Optimizer` subclass, so "
        "`amp.initialize` and LR schedulers accept it; norms are accumulated in fp32 for fp16/bf16 params; "
        "`step(closure)` evaluates the closure; the weight decay is restored even if the wrapped step raises; "
        "it pickles and deep-copies."),
    "apex.parallel.Reducer": (
        "NVIDIA: same `Reducer(module_or_grads_list)` and `reduce()`: a module's params are broadcast from rank 0 "
        "at construction and `reduce()` averages the grads over the ranks. New here: `process_group`; a clear "
        "RuntimeError without an initialized process group and TypeError for an argument that is neither a "
        "module nor a list of tensors."),
    # ---- apex.contrib (Ascend API additions)
    "apex.contrib.get_aligned_storage_size": (
        "NPU patch: same name, arguments `(tensor, align=16, pad=32)` and rule `ceil(n / align) * align + pad`, "
        "n being torch_npu's storage size on npu and the elements the tensor spans elsewhere. It describes the "
        "patch's layout, which `combine_npu` follows (`combine_tensors` uses `plan_layout`); bf16 is accepted "
        "too, other dtypes raise RuntimeError as "
        "in the patch. NVIDIA: none."),
    # ---- apex.fp16_utils
    "apex.fp16_utils.FP16_Optimizer": (
        "NVIDIA: same constructor, `backward`, `step` (closures too), `zero_grad(set_grads_to_None)`, "
        "`update_master_grads`, `clip_master_grads`, `inspect_master_grad_data`, `loss_scale`, "
        "`state_dict`/`load_state_dict`. Here it needs no CUDA, accepts bf16 params like fp16 ones, checks a "
        "loaded state before changing anything, and saves the scaler as a plain dict (loads with "
        "`torch.load(weights_only=True)`; a saved scaler object is accepted too). Messages print only with "
        "`verbose=True`. NPU patch: none."),
    "apex.fp16_utils.DynamicLossScaler": (
        "NVIDIA: same arguments, defaults (2**32, 2, 1000), attributes and update rule (backoff floored at 1, "
        "growth when the iterations since the last overflow are a multiple of the window). Here the overflow "
        "check is one core pass per grad on CPU, arguments are checked, and `state_dict()` exists."),
    "apex.fp16_utils.LossScaler": (
        "NVIDIA: same static scaler; `backward(loss, retain_graph=False)`. Here the scale must be a positive "
        "finite number."),
    "apex.fp16_utils.BN_convert_float": "NVIDIA: same; affine batchnorm layers go back to fp32, in place.",
    "apex.fp16_utils.FP16Model": (
        "NVIDIA: same; only floating-point tensor inputs are cast to fp16 (other arguments pass through)."),
    "apex.fp16_utils.clip_grad_norm": "NVIDIA: the same alias of torch's `clip_grad_norm_`.",
    "apex.fp16_utils.convert_module": "NVIDIA: same; a non-floating dtype raises TypeError.",
    "apex.fp16_utils.convert_network": "NVIDIA: same (affine batchnorm skipped, RNN weights re-flattened).",
    "apex.fp16_utils.master_params_to_model_params": (
        "NVIDIA: same, flat masters included; mismatched lists raise ValueError before any copy."),
    "apex.fp16_utils.model_grads_to_master_grads": (
        "NVIDIA: same; a model param without a grad leaves its master without one; mismatched lists raise."),
    "apex.fp16_utils.network_to_half": "NVIDIA: same `Sequential(tofp16(), BN_convert_float(network.half()))`.",
    "apex.fp16_utils.prep_param_lists": (
        "NVIDIA: same, including `flat_master=True` (one flat fp32 master with an allocated grad); mixed dtypes "
        "with `flat_master` raise TypeError."),
    "apex.fp16_utils.to_python_float": "NVIDIA: same.",
    "apex.fp16_utils.tofp16": "NVIDIA: same.",
    # ---- apex.multi_tensor_apply
    "apex.multi_tensor_apply.MultiTensorApply": (
        "NVIDIA: same class, `chunk_size`, `available`, `check_avail()`; `available` is always True here "
        "(no compiled extension is needed). A non-callable op raises TypeError."),
    "apex.multi_tensor_apply.multi_tensor_applier": "NVIDIA: same object, chunk size 2048 * 32.",
    "apex.multi_tensor_apply.register_amp_C": (
        "New here: this package ships no top-level `amp_C` (it would clash with NVIDIA's compiled one); a "
        "last-resort finder, installed at interpreter start-up by the wheel's `apex-amp_C.pth` and by `import "
        "apex`, makes `import amp_C` yield ours where NVIDIA's is absent. This returns the `amp_C` in use, "
        "replaces a broken one, and binds ours over any with `force=True`."),
    "apex.multi_tensor_apply.amp_C.available": "Always True (upstream's applier tests whether `amp_C` imports).",
    "apex.multi_tensor_apply.amp_C.multi_tensor_scale": (
        "NVIDIA: same signature and flag rule (set on inf/nan in the inputs; runs even when set). Here on every "
        "device; on CPU one core pass per tensor."),
    "apex.multi_tensor_apply.amp_C.multi_tensor_axpby": (
        "NVIDIA: same signature, `arg_to_check` (-1 both, 0 x, 1 y) and flag rule; `out` may alias `x` or `y`."),
    "apex.multi_tensor_apply.amp_C.multi_tensor_l2norm": (
        "NVIDIA: same signature and return `(norm[1], per_tensor[n] or [0])`, float32 on the tensors' device; "
        "sets the flag on a non-finite norm. Here sums of squares accumulate in float64 per tensor (upstream: "
        "fp32 per chunk); an empty list gives 0 (upstream indexes the first tensor)."),
    "apex.multi_tensor_apply.amp_C.multi_tensor_l2norm_mp": (
        "NVIDIA: same signature; the same result as `multi_tensor_l2norm` here."),
    "apex.multi_tensor_apply.amp_C.multi_tensor_unscale_l2norm": (
        "NVIDIA: same signature: the norms of `tensors * inv_scale`, tensors only read."),
    "apex.multi_tensor_apply.amp_C.multi_tensor_adam": (
        "NVIDIA: same signature, modes and bias correction; updates even when the flag is set, as upstream. "
        "Also takes upstream's capturable form (tensor `lr`/`step`, trailing `inv_scale`); any float dtypes."),
    "apex.multi_tensor_apply.amp_C.multi_tensor_sgd": (
        "NVIDIA: same signature (trailing `scale` optional), 3 or 4 lists, `first_run`, `wd_after_momentum`; "
        "skips when the flag is set. Here every dtype combination works (upstream: three)."),
    "apex.multi_tensor_apply.amp_C.multi_tensor_lamb": (
        "NVIDIA: same signature and math; as upstream the grads hold the update afterwards and the flag is set "
        "on a non-finite param or update norm."),
    "apex.multi_tensor_apply.amp_C.multi_tensor_novograd": (
        "NVIDIA: same signature and math (`grad_norms` already blended by the caller)."),
    "apex.multi_tensor_apply.amp_C.multi_tensor_adagrad": "NVIDIA: same signature, modes and math.",
    "apex.multi_tensor_apply.amp_C.update_scale_hysteresis": (
        "NVIDIA: same signature, rules and in-place state, on every device (NVIDIA: CUDA tensors only); also "
        "accepts int64 trackers and any floating `found_inf`, and checks its arguments. NPU patch: none."),
    # ---- apex.normalization
    "apex.normalization.FusedLayerNorm": (
        "NVIDIA: same signature, parameters and `extra_repr`; torch's `layer_norm` on every device (NVIDIA also "
        "falls back to it off CUDA). `memory_efficient` is recorded, not used. NPU patch: none."),
    "apex.normalization.FusedRMSNorm": (
        "NVIDIA: same signature and parameter; torch's `rms_norm` (torch >= 2.4) or the formula. The output has "
        "the input's dtype on every device (NVIDIA's CPU path returned the weight's dtype for half weights)."),
    "apex.normalization.MixedFusedLayerNorm": (
        "NVIDIA: same signature; the output has the weights' dtype; `elementwise_affine` raises ValueError."),
    "apex.normalization.MixedFusedRMSNorm": (
        "NVIDIA: same signature; the output has the weight's dtype; `elementwise_affine` raises ValueError."),
    # ---- apex._device
    "apex._device.default_amp_dtype": (
        "New here: float16 on cuda and npu, bfloat16 on cpu; `APEX_AMP_DTYPE` overrides it on every device. "
        "NVIDIA amp's half is always fp16."),
    "apex._device.detect_device": (
        "New here: npu (torch_npu importable and reporting a device) > cuda > cpu; `APEX_DEVICE` overrides it, "
        "an unknown name raises ValueError and an unusable device RuntimeError. torch_npu is imported lazily, at "
        "the first question about npu, never by `import apex`."),
    "apex._device.device_available": (
        "New here: whether \"cpu\", \"cuda\" or \"npu\" is usable on this machine (a torch_npu that fails to "
        "import counts as no npu); other names raise ValueError."),
}

for _name, _what in (("fused_layer_norm", "layer norm without weights"),
                     ("fused_layer_norm_affine", "layer norm with weight and bias"),
                     ("fused_rms_norm", "RMS norm without a weight"),
                     ("fused_rms_norm_affine", "RMS norm with a weight"),
                     ("mixed_dtype_fused_layer_norm_affine", "layer norm returning the weights' dtype"),
                     ("mixed_dtype_fused_rms_norm_affine", "RMS norm returning the weight's dtype")):
    NOTES["apex.normalization.fused_layer_norm." + _name] = (
        f"NVIDIA: same name, arguments and eps default (1e-6) for {_what}; torch's kernels on every device, "
        "autograd is torch's, `memory_efficient` is recorded only. Bad shapes raise ValueError.")
for _name in ("FusedLayerNormAffineFunction", "FusedLayerNormFunction", "FusedLayerNormAffineMixedDtypesFunction",
              "FusedRMSNormAffineFunction", "FusedRMSNormFunction", "FusedRMSNormAffineMixedDtypesFunction"):
    NOTES["apex.normalization.fused_layer_norm." + _name] = (
        "NVIDIA: a `torch.autograd.Function` over its CUDA kernels; here `forward(ctx, ...)` with upstream's "
        "argument names (Megatron-core inspects them to decide whether to pass `memory_efficient`) and "
        "`apply(...)` = `forward(None, ...)`, running the functional form; autograd is torch's.")


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
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        # the members, not Enum's constructor (whose signature changes between Python versions)
        members = ", ".join(f"{m.name} = {m.value!r}" for m in obj)
        return f"class {name}(enum.Enum): {members}"
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
            if inspect.ismodule(obj) and callable(obj):  # a callable module (apex.contrib.combine_tensors)
                obj = getattr(obj, obj.__call_target__)
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
