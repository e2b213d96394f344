"""Optimizer entries: one optimizer step, ours vs the best implementation of the same math we can run here.

Ours: ``apex.optimizers.NpuFused*`` (and NVIDIA's ``Fused*``) ``step()``, sharing checks included. Every optimizer
row exists in the two ``zero_grad`` modes:

  headline (``zero_grad="set_to_none"``)  what users run: torch's default ``zero_grad()`` sets grads to None and
      the next backward creates new grad tensors. Before every call, untimed and on both sides, fresh tensors are
      allocated (``empty_like`` the param, as autograd allocates them) and filled from a fixed grad set, then
      assigned to ``p.grad``; the timed call is ``step()`` then ``zero_grad()``.
  ", grads kept" (``zero_grad="kept"``)  the special case ``zero_grad(set_to_none=False)``: grads are set once
      in setup and stay in place (for ours, inside the combined grad buffer); only ``step()`` is timed.

References, per optimizer (every optimizer class present in ``apex.optimizers`` at run time):
  Adam, AdamW, SGD (momentum)  torch.optim with ``fused=True``; for bf16 params, ``foreach=True`` when a probe
                               finds that torch's fused kernel does not compute the update for them on the
                               run's device (torch 2.13's CPU fused SGD leaves 16-bit params unchanged); the
                               row keeps its targets: parity with torch's fastest executor of the same math,
                               and the roofline
  Adadelta, RMSprop            torch.optim with ``foreach=True`` (torch has no fused kernel for them)
  BertAdam, LAMB               the same math written with torch ``_foreach_*`` ops (nothing in torch or
                               timm computes them); LAMB also against ``timm.optim.Lamb`` (other semantics:
                               bias correction, no weight-norm clamp) when timm can be imported
  RMSpropTF, AdamP             ``timm.optim`` (foreach where timm has it); skipped without timm
  NVIDIA's FusedAdam, FusedSGD, FusedAdagrad (their defaults): torch.optim AdamW / SGD / Adagrad with ``fused=True``;
  FusedLAMB, FusedNovoGrad: the same math in torch ``_foreach_*`` ops
Regimes: the GPT-like 145-tensor model (fp32, and bf16 params), 5000 x 200 and 2000 x 2000 (LAMB vs timm and the
NVIDIA classes: the model and 5000 x 200, fp32).

AdamW also runs with one param group per param (mmengine's optimizer constructor makes such groups whenever
``paramwise_cfg`` is set), on the model and on 5000 x 200, with torch's default ``zero_grad()``: target parity
(<= 1.02x) with torch fused, which also pays per group.

Targets: Adam, AdamW, SGD (and the NVIDIA classes with a torch fused peer) on the model: ours <= 1.02x torch
fused with fresh grads (fp32) and in both modes for bf16 params, <= 1.05x with grads kept (fp32); the others
<= 0.5x their torch peer. 5000 x 200, both modes: <= 0.05x the peer (20x faster). Headline rows on the model:
ours >= 90% of the run's bandwidth roofline.

timm is imported without ``timm/__init__`` (which needs torchvision): only its optimizer modules, which need
torch alone. Install it with ``pip install --no-deps timm``; without it the timm entries are skipped.

bytes/param is the traffic the math needs at minimum, in elements of the param dtype: Adam(W), Adadelta,
BertAdam read p, g and two states and write three tensors (7); SGD with momentum, RMSprop read three and write
two (5); RMSpropTF with momentum 7; LAMB needs a norm pass before the update (read p, g, m, v, write m, v; then
read p, m, v, write p: 10); AdamP a grad/param dot-product pass before an Adam update (2 + 7 = 9); Adagrad reads
p, g, the sum of squares and writes two (5); NovoGrad a grad-norm pass before an SGD-momentum update (1 + 5 = 6).
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.machinery
import importlib.util
import logging
import sys
import types
from typing import Any, Callable, Dict, List, Optional

import torch

from bench import env, shapes
from bench.registry import Context, Entry, Registry

log = logging.getLogger("bench")

MODEL_REGIMES = ("model-145", "small-5000x200", "small-2000x2000")


# ---------------------------------------------------------------- timm (optional peer)
def _timm_optim(module: str):
    """``timm.optim.<module>`` without running timm/__init__ (torchvision); None when timm is absent."""
    name = f"timm.optim.{module}"
    if name in sys.modules:
        return sys.modules[name]
    if "timm" not in sys.modules:
        spec = importlib.util.find_spec("timm")
        if spec is None or not spec.submodule_search_locations:
            return None
        root = next(iter(spec.submodule_search_locations))
        for pkg_name, path in (("timm", root), ("timm.optim", f"{root}/optim")):
            pkg = types.ModuleType(pkg_name)
            pkg.__path__ = [path]  # a namespace-like stub: submodules load, __init__ does not run
            # a spec, so importlib.util.find_spec("timm") (transformers asks it) still answers
            pkg.__spec__ = importlib.machinery.ModuleSpec(pkg_name, None, is_package=True)
            pkg.__spec__.submodule_search_locations = [path]
            sys.modules[pkg_name] = pkg
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        log.warning("%s cannot be imported (%s): entries needing it are skipped", name, exc)
        return None


# ---------------------------------------------------------------- foreach references of math torch lacks
class ForeachBertAdam:
    """BertAdam (no bias correction, decoupled decay inside the update, per-tensor clipping) in torch foreach ops."""

    def __init__(self, params, lr, b1=0.9, b2=0.999, e=1e-6, weight_decay=0.01, max_grad_norm=1.0):
        self.params = list(params)
        self.lr, self.b1, self.b2, self.e, self.wd, self.clip = lr, b1, b2, e, weight_decay, max_grad_norm
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self):
        grads = [p.grad for p in self.params]
        if self.clip > 0:
            norms = torch.stack(torch._foreach_norm(grads))
            coefs = torch.clamp(self.clip / (norms + 1e-6), max=1.0)
            grads = torch._foreach_mul(grads, list(coefs.unbind()))
        torch._foreach_lerp_(self.m, grads, 1 - self.b1)
        torch._foreach_mul_(self.v, self.b2)
        torch._foreach_addcmul_(self.v, grads, grads, value=1 - self.b2)
        denom = torch._foreach_sqrt(self.v)
        torch._foreach_add_(denom, self.e)
        upd = torch._foreach_div(self.m, denom)
        if self.wd:
            torch._foreach_add_(upd, self.params, alpha=self.wd)
        torch._foreach_add_(self.params, upd, alpha=-self.lr)


class ForeachLamb:
    """The NPU patch's LAMB (see apex.optimizers.lamb) in torch foreach ops."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        self.params = list(params)
        self.lr, (self.b1, self.b2), self.eps, self.wd = lr, betas, eps, weight_decay
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self):
        grads = [p.grad for p in self.params]
        torch._foreach_lerp_(self.m, grads, 1 - self.b1)
        torch._foreach_mul_(self.v, self.b2)
        torch._foreach_addcmul_(self.v, grads, grads, value=1 - self.b2)
        denom = torch._foreach_sqrt(self.v)
        torch._foreach_add_(denom, self.eps)
        upd = torch._foreach_div(self.m, denom)
        if self.wd:
            torch._foreach_add_(upd, self.params, alpha=self.wd)
        w = torch.stack(torch._foreach_norm(self.params)).clamp_(max=10.0)
        u = torch.stack(torch._foreach_norm(upd))
        ratio = torch.where((w > 0) & (u > 0), w / u, torch.ones_like(w))
        torch._foreach_mul_(upd, list((ratio * -self.lr).unbind()))
        torch._foreach_add_(self.params, upd)


class ForeachNvidiaLamb:
    """NVIDIA FusedLAMB's math (global grad-norm clipping, bias correction, decoupled decay, unclamped trust
    ratio) in torch foreach ops."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0):
        self.params = list(params)
        self.lr, (self.b1, self.b2), self.eps, self.wd, self.max_norm = lr, betas, eps, weight_decay, max_grad_norm
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        grads = [p.grad for p in self.params]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        clip = torch.where(norm > self.max_norm, norm / self.max_norm, torch.ones_like(norm))
        grads = torch._foreach_div(grads, clip)
        torch._foreach_lerp_(self.m, grads, 1 - self.b1)
        torch._foreach_mul_(self.v, self.b2)
        torch._foreach_addcmul_(self.v, grads, grads, value=1 - self.b2)
        bc1, bc2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        denom = torch._foreach_div(self.v, bc2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, self.eps)
        upd = torch._foreach_div(self.m, denom)
        torch._foreach_div_(upd, bc1)
        if self.wd:
            torch._foreach_add_(upd, self.params, alpha=self.wd)
        w = torch.stack(torch._foreach_norm(self.params))
        u = torch.stack(torch._foreach_norm(upd))
        ratio = torch.where((w > 0) & (u > 0), w / u, torch.ones_like(w))
        torch._foreach_mul_(upd, list((ratio * -self.lr).unbind()))
        torch._foreach_add_(self.params, upd)


class ForeachNovoGrad:
    """NVIDIA FusedNovoGrad's default math (per-tensor L2 grad-norm moment started at the first norm, bias
    correction, averaged grads, decay outside the moment) in torch foreach ops."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        self.params = list(params)
        self.lr, (self.b1, self.b2), self.eps, self.wd = lr, betas, eps, weight_decay
        self.m = [torch.zeros_like(p) for p in self.params]
        self.gn: Optional[torch.Tensor] = None
        self.t = 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        grads = [p.grad for p in self.params]
        n = torch.stack(torch._foreach_norm(grads))
        start = n if self.gn is None else self.gn
        self.gn = (self.b2 * start.square() + (1 - self.b2) * n.square()).sqrt()
        bc1, bc2 = 1 - self.b1 ** self.t, (1 - self.b2 ** self.t) ** 0.5
        torch._foreach_mul_(self.m, self.b1)
        torch._foreach_add_(self.m, grads, alpha=1 - self.b1)
        scale = -self.lr / bc1 / (self.gn / bc2 + self.eps)
        upd = torch._foreach_mul(self.m, list(scale.unbind()))
        if self.wd:
            torch._foreach_add_(upd, self.params, alpha=-self.lr * self.wd)
        torch._foreach_add_(self.params, upd)


# ---------------------------------------------------------------- optimizer table
class Optim:
    """One optimizer's rows. `fused_peer`: the reference is torch's own fused kernel (targets 1.02x / 1.05x on
    the model); `regimes`: None for every regime and the bf16 model, else the fp32 regimes to run.
    `bf16_note`: with `regimes`, also the bf16 model, without a target: the note says why the two sides do
    different work there (e.g. fp32 moments against torch's bf16 ones). `elems`: values of the param dtype the
    math must read and write per param at least, over every pass it needs (Adam: p, g, m, v read, p, m, v
    written = 7; a grad-norm clip that must finish before the update reads every grad once more)."""

    def __init__(self, name: str, ours: str, ours_kw: dict, ref: Callable[[List[torch.Tensor]], Any],
                 ref_label: str, elems: int, same_math: bool, timm: Optional[str] = None, fused_peer: bool = False,
                 regimes: Optional[tuple] = None, bf16_note: Optional[str] = None,
                 unfused: Optional[Callable[[List[torch.Tensor]], Any]] = None, unfused_label: str = ""):
        self.name, self.ours, self.ours_kw, self.ref, self.ref_label = name, ours, ours_kw, ref, ref_label
        self.elems, self.same_math, self.timm = elems, same_math, timm
        self.fused_peer, self.regimes, self.bf16_note = fused_peer, regimes, bf16_note
        # a fused peer's torch optimizer without the fused kernel: the reference where that kernel is unsound
        self.unfused, self.unfused_label = unfused, unfused_label


def _torch_peer(cls: type, label: str, **kw) -> Dict[str, Any]:
    """Optim arguments for a torch.optim peer: its fused kernel, and its foreach form as the fallback."""
    return dict(ref=lambda ps: cls(ps, **kw, fused=True), ref_label=f"{label}(fused=True)",
                unfused=lambda ps: cls(ps, **kw, foreach=True), unfused_label=f"{label}(foreach=True)",
                fused_peer=True)


_FAULTS: Dict[tuple, Optional[str]] = {}


def fused_reference_fault(opt: Optim, dtype: torch.dtype, device="cpu") -> Optional[str]:
    """None when ``opt``'s torch fused reference computes what its foreach form computes for params of `dtype`,
    else what is wrong (cached per optimizer, dtype and device).

    A reference that skips part of the work would make any ratio against it meaningless (torch 2.13's CPU fused
    SGD, for one, leaves 16-bit params unchanged in every whole SIMD block). The probe: params of 1000 and 37
    elements (whole SIMD blocks and a tail) at |p| ~ 1e-3, so an update of lr ~ 1e-3 shows at 16-bit precision;
    three steps of unit-scale grads; each side's total update against the other's, 25% of the largest update
    allowed (rounding differences between one fused rounding and foreach's per-op roundings stay far below)."""
    key = (opt.name, dtype, str(device))
    if key not in _FAULTS:
        shp = [(1000,), (37,)]
        sides = []
        for make in (opt.ref, opt.unfused):
            ps = [p.detach().mul(1e-3).requires_grad_()
                  for p in shapes.make_params(shp, dtype=dtype, device=device, seed=5)]
            start = [p.detach().clone() for p in ps]
            o = make(ps)
            for k in range(3):
                for p, g in zip(ps, shapes.make_tensors(shp, dtype=dtype, device=device, seed=20 + k)):
                    p.grad = g
                o.step()
            sides.append(torch.cat([(p.detach() - q).float().flatten() for p, q in zip(ps, start)]))
        fused, unfused = sides
        worst = (fused - unfused).abs().max().item()
        scale = unfused.abs().max().item()
        moved = (fused != 0).float().mean().item()
        _FAULTS[key] = None if worst <= 0.25 * scale else (
            f"{opt.ref_label} on this torch does not compute the update for {str(dtype)[6:]} params (probe: "
            f"{moved:.0%} of the params moved; largest difference from {opt.unfused_label} {worst:.2g}, updates "
            f"up to {scale:.2g})")
    return _FAULTS[key]


def _timm_ref(module: str, cls: str, **kw):
    def make(params):
        mod = _timm_optim(module)
        return getattr(mod, cls)(params, **kw)

    return make


NVIDIA_REGIMES = ("model-145", "small-5000x200")

OPTIMS = [
    Optim("Adam", "NpuFusedAdam", dict(lr=1e-3), elems=7, same_math=True,
          **_torch_peer(torch.optim.Adam, "torch.optim.Adam", lr=1e-3)),
    Optim("AdamW", "NpuFusedAdamW", dict(lr=1e-3, weight_decay=1e-2), elems=7, same_math=True,
          **_torch_peer(torch.optim.AdamW, "torch.optim.AdamW", lr=1e-3, weight_decay=1e-2)),
    Optim("SGD momentum", "NpuFusedSGD", dict(lr=1e-3, momentum=0.9), elems=5, same_math=True,
          **_torch_peer(torch.optim.SGD, "torch.optim.SGD", lr=1e-3, momentum=0.9)),
    Optim("Adadelta", "NpuFusedAdadelta", dict(lr=1.0),
          lambda ps: torch.optim.Adadelta(ps, lr=1.0, foreach=True), "torch.optim.Adadelta(foreach=True)", 7, True),
    Optim("RMSprop", "NpuFusedRMSprop", dict(lr=1e-3),
          lambda ps: torch.optim.RMSprop(ps, lr=1e-3, foreach=True), "torch.optim.RMSprop(foreach=True)", 5, True),
    Optim("RMSpropTF momentum", "NpuFusedRMSpropTF", dict(lr=1e-3, momentum=0.9),
          _timm_ref("rmsprop_tf", "RMSpropTF", lr=1e-3, momentum=0.9, foreach=True),
          "timm.optim.RMSpropTF(foreach=True)", 7, True, timm="rmsprop_tf"),
    # BertAdam clips each grad by its own norm (max_grad_norm=1.0) before the update: 7 + 1
    Optim("BertAdam", "NpuFusedBertAdam", dict(lr=1e-3, b2=0.999, max_grad_norm=1.0),
          lambda ps: ForeachBertAdam(ps, lr=1e-3, b2=0.999, max_grad_norm=1.0),
          "same math in torch _foreach ops", 8, True),
    Optim("LAMB", "NpuFusedLamb", dict(lr=1e-3), lambda ps: ForeachLamb(ps, lr=1e-3),
          "same math in torch _foreach ops", 10, True),
    Optim("LAMB vs timm", "NpuFusedLamb", dict(lr=1e-3),
          _timm_ref("lamb", "Lamb", lr=1e-3, weight_decay=0.0, max_grad_norm=None),
          "timm.optim.Lamb(max_grad_norm=None) (bias-corrected LAMB)", 10, False, timm="lamb",
          regimes=("model-145", "small-5000x200")),
    Optim("AdamP", "NpuFusedAdamP", dict(lr=1e-3, weight_decay=1e-2),
          _timm_ref("adamp", "AdamP", lr=1e-3, weight_decay=1e-2), "timm.optim.AdamP", 9, True, timm="adamp"),
    # NVIDIA Apex's classes (their own defaults and options) on the model and the many-small-tensors regime
    Optim("FusedAdam", "FusedAdam", dict(lr=1e-3, weight_decay=1e-2), elems=7, same_math=True,
          regimes=NVIDIA_REGIMES, **_torch_peer(torch.optim.AdamW, "torch.optim.AdamW", lr=1e-3, weight_decay=1e-2),
          bf16_note="NVIDIA's layout: fp32 moments, each bf16 param updated in fp32 and rounded once; torch keeps "
                    "bf16 moments: ours moves 22 bytes per param against torch's 14"),
    Optim("FusedSGD", "FusedSGD", dict(lr=1e-3, momentum=0.9), elems=5, same_math=True, regimes=NVIDIA_REGIMES,
          **_torch_peer(torch.optim.SGD, "torch.optim.SGD", lr=1e-3, momentum=0.9)),
    Optim("FusedAdagrad", "FusedAdagrad", dict(lr=1e-2), elems=5, same_math=True, regimes=NVIDIA_REGIMES,
          **_torch_peer(torch.optim.Adagrad, "torch.optim.Adagrad", lr=1e-2)),
    # NVIDIA's LAMB clips by the global grad norm (max_grad_norm=1.0) before its two passes: 10 + 1
    Optim("FusedLAMB", "FusedLAMB", dict(lr=1e-3), lambda ps: ForeachNvidiaLamb(ps, lr=1e-3),
          "same math in torch _foreach ops", 11, True, regimes=NVIDIA_REGIMES),
    Optim("FusedNovoGrad", "FusedNovoGrad", dict(lr=1e-3), lambda ps: ForeachNovoGrad(ps, lr=1e-3),
          "same math in torch _foreach ops", 6, True, regimes=NVIDIA_REGIMES),
]


# ---------------------------------------------------------------- setup / run
def _trimmed_rss() -> Optional[float]:
    """RSS after returning freed heap memory to the OS (glibc malloc_trim), so freed buffers do not count."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return env.rss_mib()


def _rss_note(st: Dict[str, Any]) -> str:
    d = st.get("rss_first_delta")
    if d is None:
        return ""
    return (f"first step (combine): RSS {d:+.0f} MiB for {st['state_mib']:.0f} MiB of new optimizer states "
            "(equal = no lasting copy of params or grads)")


def _grad_buffer_note(st: Dict[str, Any]) -> str:
    """How much flat grad buffer our optimizer holds after the timed steps. With fresh grads every step it makes
    none (the grads are read where autograd left them); with kept grads the buffer is where the grads live."""
    opt = st.get("ours")
    groups = getattr(opt, "_groups", None)
    if not groups or not st.get("first_done"):
        return ""
    held = sum(s.flat_g.numel() * s.flat_g.element_size() for c in groups.values() for s in c.sets
               if s.has_grad_buffer)
    params = sum(p.numel() * p.element_size() for p in st["ours_p"])
    return f"flat grad buffers held after the run: {held / 2 ** 20:.0f} MiB (params: {params / 2 ** 20:.0f} MiB)"


def per_param_groups(params: List[torch.Tensor]) -> List[Dict[str, Any]]:
    """One param group per param, as mmengine's optimizer constructor makes them whenever ``paramwise_cfg`` is
    set (here its ``norm_decay_mult=0``/``bias_decay_mult=0`` pattern: no weight decay on 1-d params)."""
    return [{"params": [p], **({"weight_decay": 0.0} if p.dim() == 1 else {})} for p in params]


def _setup(ctx: Context, opt: Optim, regime: str, dtype: torch.dtype, fresh: bool,
           ref: Callable[[List[torch.Tensor]], Any], per_param: bool = False) -> Dict[str, Any]:
    import apex.optimizers as ao

    shp = shapes.regime_shapes(regime, ctx.quick)
    ours_p = shapes.make_params(shp, dtype=dtype, device=ctx.device, seed=ctx.seed)
    ref_p = shapes.make_params(shp, dtype=dtype, device=ctx.device, seed=ctx.seed)
    arrange = per_param_groups if per_param else (lambda ps: ps)
    st: Dict[str, Any] = {
        "numel": shapes.numel_of(ours_p),
        "tensors": len(ours_p),
        "ours": getattr(ao, opt.ours)(arrange(ours_p), **opt.ours_kw),
        "ref": ref(arrange(ref_p)),
        "ours_p": ours_p,
        "ref_p": ref_p,
        "first_done": False,
    }
    if fresh:  # the values every fresh grad is filled from (the same numbers as the kept grads)
        st["grad_src"] = [p.grad for p in ref_p]
        for ps in (ours_p, ref_p):
            for p in ps:
                p.grad = None
    return st


def fresh_grads(params, source) -> None:
    """What a backward after ``zero_grad()`` leaves: a newly allocated grad tensor per param, then filled."""
    for p, g in zip(params, source):
        fresh = torch.empty_like(p)
        fresh.copy_(g)
        p.grad = fresh


def _before_ours(st: Dict[str, Any]) -> None:
    fresh_grads(st["ours_p"], st["grad_src"])


def _before_ref(st: Dict[str, Any]) -> None:
    fresh_grads(st["ref_p"], st["grad_src"])


def _ours(st: Dict[str, Any]):
    opt = st["ours"]
    if not st["first_done"]:
        before = _trimmed_rss()
        opt.step()
        after = _trimmed_rss()
        st["first_done"] = True
        if before is not None and after is not None:
            st["rss_first_delta"] = after - before
            st["state_mib"] = sum(v.numel() * v.element_size() for s in opt.state.values()
                                  for v in s.values() if v.dim()) / 2 ** 20
    else:
        opt.step()
    if "grad_src" in st:
        opt.zero_grad()


def _ref(st: Dict[str, Any]):
    st["ref"].step()
    if "grad_src" in st:
        _zero_grad(st["ref"])


def _zero_grad(opt) -> None:
    if hasattr(opt, "zero_grad"):
        opt.zero_grad()
    else:  # the foreach references of math torch lacks are not torch optimizers
        for p in opt.params:
            p.grad = None


def _verify_factory(opt: Optim, fresh: bool):
    """Three steps of ours and the reference from the same values on small shapes, in the entry's zero_grad
    mode: same params (rtol 1e-5)."""

    def verify(_st):
        import apex.optimizers as ao

        shp = [(33, 7), (64,), (5, 4, 3)]
        a = shapes.make_params(shp, dtype=torch.float32, seed=3)
        b = shapes.make_params(shp, dtype=torch.float32, seed=3)
        oa, ob = getattr(ao, opt.ours)(a, **opt.ours_kw), opt.ref(b)
        for k in range(3):
            if fresh:
                src = shapes.make_tensors(shp, seed=10 + k, scale=1e-3)
                fresh_grads(a, src)
                fresh_grads(b, src)
            oa.step()
            ob.step()
            if fresh:
                oa.zero_grad()
                _zero_grad(ob)
                if any(p.grad is not None for p in a):
                    raise AssertionError(f"{opt.name}: zero_grad() left grads that are not None")
        for k, (p, q) in enumerate(zip(a, b)):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{opt.name}: param {k}: {m}")

    return verify


def _make_entry(opt: Optim, regime: str, dtype: torch.dtype, fresh: bool, per_param: bool = False) -> Entry:
    esize = torch.empty((), dtype=dtype).element_size()
    label = regime if dtype == torch.float32 else f"{regime} bf16"
    name = opt.name if fresh else f"{opt.name}, grads kept"
    if per_param:
        name += ", one group per param"
    holder: Dict[str, Entry] = {}

    why = opt.bf16_note if dtype != torch.float32 else None
    suffix = " + zero_grad()" if fresh else ""

    def setup(ctx):
        # a fused peer whose kernel does not compute the update for this dtype on this device is replaced by its
        # foreach form, the fastest torch executor left that does; the row keeps its target (parity with torch's
        # fastest) and its roofline target, and the note says why
        e, ref, fault = holder["entry"], opt.ref, None
        if opt.fused_peer and opt.unfused and dtype != torch.float32:
            fault = fused_reference_fault(opt, dtype, ctx.device)
        if fault:
            ref = opt.unfused
            e.ref_label = opt.unfused_label + suffix
        st = _setup(ctx, opt, regime, dtype, fresh, ref, per_param)
        st["fault"] = fault and f"{fault}; the reference is {opt.unfused_label}"
        return st

    def teardown(st):
        note = "; ".join(n for n in (why, st.get("fault"), _rss_note(st), _grad_buffer_note(st)) if n)
        if note:
            holder["entry"].notes = note

    entry = Entry(
        name=name,
        regime=label,
        setup=setup,
        ours=_ours,
        torch_ref=_ref,
        bytes_per_param=opt.elems * esize,
        executor=lambda st: env.apex_executor(st["ours_p"][0]),
        ref_label=opt.ref_label + suffix,
        # one group per param: parity with torch fused, whose per-group cost is the same kind of work
        target_ratio=1.02 if per_param else _target(opt, regime, dtype, fresh),
        target_roofline=0.9 if fresh and regime == "model-145" and not why and not per_param else None,
        verify=_verify_factory(opt, fresh) if opt.same_math and regime == "small-5000x200" and not per_param else None,
        teardown=teardown,
        dtype="bf16" if dtype == torch.bfloat16 else "fp32",
        group="optimizers",
        devices=("cpu", "cuda"),
        before_ours=_before_ours if fresh else None,
        before_ref=_before_ref if fresh else None,
        zero_grad="set_to_none" if fresh else "kept",
    )
    holder["entry"] = entry
    return entry


def _target(opt: Optim, regime: str, dtype: torch.dtype, fresh: bool) -> Optional[float]:
    """Large tensors: <= 1.02x torch fused (1.05x with grads kept in fp32), >= 2x faster than the foreach/timm
    peer where torch has no fused kernel; 5000 x 200: >= 20x faster."""
    if regime == "small-5000x200":
        return 0.05
    if dtype != torch.float32 and opt.bf16_note:
        return None
    if regime == "model-145":
        if not opt.fused_peer:
            return 0.5
        return 1.02 if (fresh or dtype != torch.float32) else 1.05
    return None


def register(reg: Registry) -> None:
    try:
        env.import_apex()
        import apex.optimizers as ao
    except ImportError as exc:
        log.warning("apex.optimizers cannot be imported (%s): no optimizer entries", exc)
        return
    for opt in OPTIMS:
        if not hasattr(ao, opt.ours):
            log.info("apex.optimizers.%s does not exist (yet): no %s entries", opt.ours, opt.name)
            continue
        if opt.timm is not None and _timm_optim(opt.timm) is None:
            log.info("timm is not importable: no %s entries", opt.name)
            continue
        if opt.regimes is None:
            cases = [(r, torch.float32) for r in MODEL_REGIMES] + [("model-145", torch.bfloat16)]
        else:
            cases = [(r, torch.float32) for r in opt.regimes]
            if opt.bf16_note:
                cases.append(("model-145", torch.bfloat16))
        for fresh in (True, False):
            for regime, dtype in cases:
                reg.add(_make_entry(opt, regime, dtype, fresh))
        if opt.name == "AdamW":  # mmengine's paramwise groups, under torch's default zero_grad()
            for regime in ("model-145", "small-5000x200"):
                reg.add(_make_entry(opt, regime, torch.float32, True, per_param=True))
