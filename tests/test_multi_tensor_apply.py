"""apex.multi_tensor_apply: the applier and the amp_C-compatible multi-tensor ops.

References are torch.optim optimizers or the formulas in float64; the noop flag semantics are
upstream's (set on inf/nan by scale / axpby / l2norm / lamb; only sgd skips when it is set).
"""

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from apex.multi_tensor_apply import MultiTensorApply, amp_C, multi_tensor_applier, register_amp_C

SHAPES = [(7,), (3, 5), (1,), (0,), (33, 2)]


def _flag(device="cpu"):
    return torch.zeros(1, dtype=torch.int, device=device)


def _tensors(dtype=torch.float32, device="cpu", shapes=SHAPES):
    return [torch.randn(s, dtype=torch.float32, device=device).to(dtype) for s in shapes]


# ---------------------------------------------------------------- the applier
def test_applier_passes_its_chunk_size():
    seen = []
    applier = MultiTensorApply(1234)
    assert applier(lambda *a: seen.append(a) or "ret", "flag", [[1]], 5) == "ret"
    assert seen == [(1234, "flag", [[1]], 5)]
    assert multi_tensor_applier.chunk_size == 2048 * 32
    assert MultiTensorApply.available and amp_C.available
    multi_tensor_applier.check_avail()


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError),
                                     ("2048", TypeError)])
def test_applier_rejects_bad_chunk_size(bad, exc):
    with pytest.raises(exc, match="MultiTensorApply: chunk_size must be"):
        MultiTensorApply(bad)


def test_applier_takes_numpy_chunk_size():
    assert MultiTensorApply(np.int64(4096)).chunk_size == 4096
    assert type(MultiTensorApply(np.int32(64)).chunk_size) is int


def test_applier_rejects_non_callable_op():
    with pytest.raises(TypeError, match="callable"):
        multi_tensor_applier("multi_tensor_scale", _flag(), [[], []], 1.0)


def test_register_amp_c(monkeypatch):
    monkeypatch.delitem(sys.modules, "amp_C", raising=False)
    bound = register_amp_C()  # no NVIDIA amp_C here: the fallback finder supplies ours
    assert bound.multi_tensor_scale is amp_C.multi_tensor_scale and bound.__apex_fallback__
    other = type(sys)("amp_C")
    monkeypatch.setitem(sys.modules, "amp_C", other)
    assert register_amp_C() is other  # an amp_C already in use is kept
    assert register_amp_C(force=True) is amp_C and sys.modules["amp_C"] is amp_C


def test_broken_amp_c_is_replaced_with_a_warning(monkeypatch):
    monkeypatch.delitem(sys.modules, "amp_C", raising=False)

    def broken(name, *a, **k):
        raise ImportError("libcudart.so: cannot open shared object file")

    monkeypatch.setattr("importlib.import_module", broken)
    with pytest.warns(RuntimeWarning, match="does not import"):
        assert register_amp_C() is amp_C


def _python(script, env_path, *flags):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    if env_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(env_path)
    done = subprocess.run([sys.executable, *flags, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"


def test_import_amp_c_falls_back_only_without_nvidias(tmp_path):
    # A fresh interpreter without .pth processing (-S): `import apex` installs the finder, then `import amp_C` gives
    # our ops; a real amp_C on sys.path wins.
    (tmp_path / "amp_C.py").write_text("NVIDIA_BUILD = True\n")
    script = (
        "import sys, apex\n"
        "assert 'torch' not in sys.modules  # installing the finder keeps import apex cheap\n"
        "import amp_C\n"
        "from apex.multi_tensor_apply import amp_C as ours\n"
        "assert amp_C.multi_tensor_l2norm is ours.multi_tensor_l2norm and amp_C.__apex_fallback__\n"
        "del sys.modules['amp_C']\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import amp_C\n"
        "assert amp_C.NVIDIA_BUILD and not hasattr(amp_C, '__apex_fallback__')\n"
    )
    _python(script, [p for p in sys.path if p], "-S")


def test_start_up_hook_lets_amp_c_come_first(tmp_path):
    # The .pth line as site runs it: the finder is installed at start-up without importing apex or torch, so
    # `try: import amp_C; from apex.multi_tensor_apply import multi_tensor_applier` (Megatron-style) finds ours;
    # an amp_C on sys.path still wins.
    import _apex_amp_c

    pth = Path(_apex_amp_c.__file__).with_name(_apex_amp_c.PTH_NAME)
    assert pth.read_text() == _apex_amp_c.PTH_LINE
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copy(pth, site_dir / pth.name)
    nvidia = tmp_path / "nvidia"
    nvidia.mkdir()
    (nvidia / "amp_C.py").write_text("NVIDIA_BUILD = True\n")
    script = (
        "import site, sys\n"
        f"site.addsitedir({str(site_dir)!r})\n"
        "assert type(sys.meta_path[-1]).__name__ == 'AmpCFallbackFinder'\n"
        "assert 'apex' not in sys.modules and 'torch' not in sys.modules\n"
        f"site.addsitedir({str(site_dir)!r})  # a second run adds no second finder\n"
        "assert sum(type(f).__name__ == 'AmpCFallbackFinder' for f in sys.meta_path) == 1\n"
        "import amp_C\n"
        "from apex.multi_tensor_apply import amp_C as ours, multi_tensor_applier\n"
        "assert amp_C.multi_tensor_scale is ours.multi_tensor_scale and amp_C.__apex_fallback__\n"
        "import apex\n"
        "assert sum(type(f).__name__ == 'AmpCFallbackFinder' for f in sys.meta_path) == 1\n"
        "del sys.modules['amp_C']\n"
        f"sys.path.insert(0, {str(nvidia)!r})\n"
        "import amp_C\n"
        "assert amp_C.NVIDIA_BUILD\n"
    )
    _python(script, [p for p in sys.path if p], "-S")


def test_installed_hook_runs_at_start_up():
    # Where apex is installed (a wheel in site-packages), a fresh interpreter can `import amp_C` first.
    import site

    import _apex_amp_c

    here = Path(_apex_amp_c.__file__).resolve().parent
    site_dirs = {Path(d).resolve() for d in [*site.getsitepackages(), site.getusersitepackages()]}
    if here not in site_dirs:
        pytest.skip(f"_apex_amp_c is imported from {here}, not from a site-packages directory (a source tree on "
                    "PYTHONPATH), where .pth files are not processed")
    script = (
        "import sys\n"
        "assert 'apex' not in sys.modules and 'torch' not in sys.modules\n"
        "import amp_C\n"
        "assert amp_C.__apex_fallback__ and amp_C.multi_tensor_l2norm.__module__.startswith('apex.')\n"
    )
    _python(script, None)


# ---------------------------------------------------------------- scale / axpby
@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                                 (torch.bfloat16, torch.float32), (torch.float32, torch.float16)])
def test_scale_matches_torch(src_dtype, dst_dtype):
    src = _tensors(src_dtype)
    dst = [torch.empty(t.shape, dtype=dst_dtype) for t in src]
    flag = _flag()
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [src, dst], 0.25)
    for s, d in zip(src, dst):
        torch.testing.assert_close(d, (s.double() * 0.25).to(dst_dtype), rtol=0, atol=0)
    assert flag.item() == 0


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_scale_sets_flag_on_nonfinite_input_and_still_writes(bad):
    src = _tensors()
    src[1][0, 2] = bad
    dst = [torch.zeros_like(t) for t in src]
    flag = _flag()
    amp_C.multi_tensor_scale(65536, flag, [src, dst], 2.0)
    assert flag.item() == 1
    torch.testing.assert_close(dst[0], src[0] * 2)
    # the flag is never cleared by a clean call
    amp_C.multi_tensor_scale(65536, flag, [[torch.ones(3)], [torch.zeros(3)]], 1.0)
    assert flag.item() == 1


def test_scale_in_place():
    xs = _tensors()
    ref = [x * 3 for x in xs]
    amp_C.multi_tensor_scale(2048, _flag(), [xs, xs], 3.0)
    for x, r in zip(xs, ref):
        torch.testing.assert_close(x, r)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_axpby_matches_float64(out_dtype):
    xs, ys = _tensors(), _tensors(torch.float16)
    outs = [torch.empty(x.shape, dtype=out_dtype) for x in xs]
    flag = _flag()
    amp_C.multi_tensor_axpby(2048, flag, [xs, ys, outs], 0.5, -1.5, -1)
    for x, y, o in zip(xs, ys, outs):
        ref = (0.5 * x.double() - 1.5 * y.double()).to(out_dtype)
        torch.testing.assert_close(o, ref, rtol=2e-7 if out_dtype == torch.float32 else 0, atol=1e-6 if
                                   out_dtype == torch.float32 else 0)
    assert flag.item() == 0


def test_axpby_output_may_alias_an_input():
    xs, ys = _tensors(), _tensors()
    ref = [2 * x + 3 * y for x, y in zip(xs, ys)]
    amp_C.multi_tensor_axpby(2048, _flag(), [xs, ys, ys], 2.0, 3.0, -1)
    for y, r in zip(ys, ref):
        torch.testing.assert_close(y, r)


@pytest.mark.parametrize("arg_to_check,bad_in,expect", [(-1, 0, 1), (-1, 1, 1), (0, 0, 1), (0, 1, 0), (1, 0, 0),
                                                         (1, 1, 1)])
def test_axpby_arg_to_check(arg_to_check, bad_in, expect):
    xs, ys = _tensors(), _tensors()
    [xs, ys][bad_in][0][3] = float("nan")
    outs = [torch.empty_like(x) for x in xs]
    flag = _flag()
    amp_C.multi_tensor_axpby(2048, flag, [xs, ys, outs], 1.0, 1.0, arg_to_check)
    assert flag.item() == expect


# ---------------------------------------------------------------- norms
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_l2norm_matches_torch(dtype):
    xs = _tensors(dtype)
    flag = _flag()
    total, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [xs], True)
    assert total.shape == (1,) and total.dtype == torch.float32
    assert per.shape == (len(xs),) and per.dtype == torch.float32
    ref_total = torch.linalg.vector_norm(torch.cat([x.double().reshape(-1) for x in xs]))
    torch.testing.assert_close(total.double(), ref_total.reshape(1), rtol=1e-6, atol=0)
    for n, x in zip(per.tolist(), xs):
        assert n == pytest.approx(float(torch.linalg.vector_norm(x.double())), rel=1e-6)
    assert flag.item() == 0


def test_l2norm_without_per_tensor_returns_an_empty_second_tensor():
    xs = _tensors()
    for per_tensor in (False, None):
        total, per = amp_C.multi_tensor_l2norm(2048, _flag(), [xs], per_tensor)
        assert per.shape == (0,) and total.shape == (1,)
    total, per = amp_C.multi_tensor_l2norm(2048, _flag(), [xs])
    assert per.numel() == 0
    torch.testing.assert_close(amp_C.multi_tensor_l2norm_mp(2048, _flag(), [xs])[0], total)


def test_l2norm_of_nothing_is_zero():
    total, per = amp_C.multi_tensor_l2norm(2048, _flag(), [[]], True)
    assert total.tolist() == [0.0] and per.numel() == 0


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_l2norm_sets_flag(bad):
    xs = _tensors()
    xs[2][0] = bad
    flag = _flag()
    total, _ = amp_C.multi_tensor_l2norm(2048, flag, [xs], False)
    assert flag.item() == 1 and not math.isfinite(total.item())


def test_l2norm_flags_an_fp32_overflowing_sum():
    flag = _flag()
    amp_C.multi_tensor_l2norm(2048, flag, [[torch.full((4,), 3e19)]], False)
    assert flag.item() == 1


def test_unscale_l2norm():
    xs = _tensors(torch.float16)
    inv = torch.tensor([1 / 64.0])
    before = [x.clone() for x in xs]
    total, per = amp_C.multi_tensor_unscale_l2norm(2048, _flag(), [xs], inv, True)
    ref = [float(torch.linalg.vector_norm(x.double() / 64)) for x in xs]
    assert per.tolist() == pytest.approx(ref, rel=1e-6)
    assert total.item() == pytest.approx(math.sqrt(sum(r * r for r in ref)), rel=1e-6)
    for x, b in zip(xs, before):
        assert torch.equal(x, b)  # read only


# ---------------------------------------------------------------- optimizer ops
def _params(n_steps_shapes=((5, 3), (4,), (1,), (17,))):
    return [torch.randn(s) for s in n_steps_shapes]


@pytest.mark.parametrize("mode,wd", [(0, 0.0), (0, 0.1), (1, 0.0), (1, 0.1)])
def test_adam_matches_torch(mode, wd):
    params = _params()
    ref = [p.clone().requires_grad_(True) for p in params]
    cls = torch.optim.AdamW if mode == 1 else torch.optim.Adam
    opt = cls(ref, lr=1e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=wd)
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    for step in range(1, 4):
        grads = [torch.randn_like(p) for p in params]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        amp_C.multi_tensor_adam(2048, _flag(), [grads, params, ms, vs], 1e-2, 0.8, 0.95, 1e-7, step, mode, 1, wd)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-6)
    for m, r in zip(ms, ref):
        torch.testing.assert_close(m, opt.state[r]["exp_avg"], rtol=1e-6, atol=1e-7)


def test_adam_without_bias_correction_and_low_precision():
    p64 = torch.randn(9, dtype=torch.float64)
    g64 = torch.randn(9, dtype=torch.float64)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
        p, g = p64.to(dtype), g64.to(dtype)
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        amp_C.multi_tensor_adam(2048, _flag(), [[g], [p], [m], [v]], 0.1, 0.9, 0.99, 1e-8, 1, 0, 0, 0.0)
        pr, gr = p64.to(dtype).double(), g64.to(dtype).double()
        mr, vr = 0.1 * gr, 0.01 * gr * gr
        expect = pr - 0.1 * mr / (vr.sqrt() + 1e-8)
        torch.testing.assert_close(p.double(), expect, rtol=tol, atol=tol)
        assert p.dtype == dtype


def test_adam_accepts_tensor_lr_step_and_inv_scale():
    p1, p2 = torch.randn(6), None
    p2 = p1.clone()
    g = torch.randn(6)
    m1, v1, m2, v2 = (torch.zeros(6) for _ in range(4))
    amp_C.multi_tensor_adam(2048, _flag(), [[g * 8], [p1], [m1], [v1]], torch.tensor([0.01]), 0.9, 0.999, 1e-8,
                            torch.tensor([1], dtype=torch.int), 1, 1, 0.0, torch.tensor([0.125]))
    amp_C.multi_tensor_adam(2048, _flag(), [[g], [p2], [m2], [v2]], 0.01, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    torch.testing.assert_close(p1, p2)


@pytest.mark.parametrize("momentum,nesterov,wd,dampening", [(0.0, False, 0.0, 0.0), (0.9, False, 1e-2, 0.0),
                                                            (0.9, True, 1e-2, 0.0), (0.5, False, 0.0, 0.3)])
def test_sgd_matches_torch(momentum, nesterov, wd, dampening):
    params = _params()
    ref = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.SGD(ref, lr=0.1, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=wd)
    bufs = [torch.zeros_like(p) for p in params]
    for step in range(3):
        grads = [torch.randn_like(p) for p in params]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        amp_C.multi_tensor_sgd(2048, _flag(), [grads, params, bufs], wd, momentum, dampening, 0.1, nesterov,
                               step == 0, False, 1.0)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-6)


def test_sgd_skips_when_flag_set_and_writes_model_copies():
    p, g, b = torch.randn(8), torch.randn(8), torch.zeros(8)
    before = p.clone()
    flag = _flag()
    flag.fill_(1)
    amp_C.multi_tensor_sgd(2048, flag, [[g], [p], [b]], 0.0, 0.9, 0.0, 0.1, False, True, False)
    assert torch.equal(p, before) and torch.equal(b, torch.zeros(8))
    half = torch.empty(8, dtype=torch.float16)
    amp_C.multi_tensor_sgd(2048, _flag(), [[g.half()], [p], [b], [half]], 0.0, 0.9, 0.0, 0.1, False, True, False,
                           0.5)
    expect = before - 0.1 * (g.half().float() * 0.5)
    torch.testing.assert_close(p, expect)
    assert torch.equal(half, p.half())
    torch.testing.assert_close(b, g.half().float() * 0.5)


def test_sgd_weight_decay_after_momentum():
    p, g, b = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64), torch.randn(8)
    p32, g32, b32 = p.float(), g.float(), b.clone()
    amp_C.multi_tensor_sgd(2048, _flag(), [[g32], [p32], [b32]], 0.1, 0.9, 0.0, 0.5, False, False, True)
    mom = 0.9 * b.double() + g
    expect = p - 0.5 * (mom + 0.1 * p)
    torch.testing.assert_close(p32.double(), expect, rtol=1e-6, atol=1e-6)


def _lamb_reference(g, p, m, v, *, lr, b1, b2, eps, step, wd, mode, ggn, max_norm, averaging, nvlamb):
    clip = ggn / max_norm if ggn > max_norm else 1.0
    g = g / clip
    if mode == 0:
        g = g + wd * p
    b3 = 1 - b1 if averaging else 1.0
    m = b1 * m + b3 * g
    v = b2 * v + (1 - b2) * g * g
    u = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)
    if mode == 1:
        u = u + wd * p
    pn, un = p.norm(), u.norm()
    ratio = pn / un if (nvlamb or wd != 0) and pn != 0 and un != 0 else 1.0
    return p - lr * ratio * u, m, v, u


@pytest.mark.parametrize("mode,wd,nvlamb", [(1, 0.01, False), (0, 0.01, False), (1, 0.0, False), (1, 0.0, True)])
def test_lamb_matches_formula(mode, wd, nvlamb):
    shapes = [(6, 4), (5,), (1,)]
    p64 = [torch.randn(s, dtype=torch.float64) for s in shapes]
    g64 = [torch.randn(s, dtype=torch.float64) for s in shapes]
    m64 = [torch.rand(s, dtype=torch.float64) for s in shapes]
    v64 = [torch.rand(s, dtype=torch.float64) for s in shapes]
    ps, gs, ms, vs = ([t.float() for t in ts] for ts in (p64, g64, m64, v64))
    ggn = float(torch.sqrt(sum((g * g).sum() for g in g64)))
    flag = _flag()
    amp_C.multi_tensor_lamb(2048, flag, [gs, ps, ms, vs], 0.01, 0.9, 0.999, 1e-6, 3, 1, wd, 1, mode,
                            torch.tensor([ggn]), 1.0, nvlamb)
    for i in range(len(shapes)):
        ep, em, ev, eu = _lamb_reference(g64[i], p64[i], m64[i], v64[i], lr=0.01, b1=0.9, b2=0.999, eps=1e-6,
                                         step=3, wd=wd, mode=mode, ggn=ggn, max_norm=1.0, averaging=True,
                                         nvlamb=nvlamb)
        torch.testing.assert_close(ps[i].double(), ep, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ms[i].double(), em, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(vs[i].double(), ev, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gs[i].double(), eu, rtol=1e-5, atol=1e-5)  # upstream leaves the update there
    assert flag.item() == 0


@pytest.mark.parametrize("mode", [0, 1])
def test_novograd_matches_formula(mode):
    shapes = [(4, 3), (7,)]
    p64 = [torch.randn(s, dtype=torch.float64) for s in shapes]
    g64 = [torch.randn(s, dtype=torch.float64) for s in shapes]
    m64 = [torch.randn(s, dtype=torch.float64) for s in shapes]
    norms = torch.tensor([1.5, 0.7])
    ps, gs, ms = ([t.float() for t in ts] for ts in (p64, g64, m64))
    lr, b1, b2, eps, step, wd = 0.05, 0.9, 0.98, 1e-8, 4, 0.01
    amp_C.multi_tensor_novograd(2048, _flag(), [gs, ps, ms], norms, lr, b1, b2, eps, step, 1, wd, 1, mode, 2)
    bc1, bc2 = 1 - b1**step, math.sqrt(1 - b2**step)
    for i in range(len(shapes)):
        d = float(norms[i]) / bc2 + eps
        if mode == 0:
            m = b1 * m64[i] + (1 - b1) * (g64[i] / d + wd * p64[i])
            p = p64[i] - lr * m / bc1
        else:
            m = b1 * m64[i] + (1 - b1) * g64[i]
            p = p64[i] - lr * ((m / bc1) / d + wd * p64[i])
        torch.testing.assert_close(ps[i].double(), p, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ms[i].double(), m, rtol=1e-5, atol=1e-6)


def test_adagrad_matches_torch_and_decoupled_formula():
    params = _params()
    ref = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.Adagrad(ref, lr=0.1, eps=1e-10, weight_decay=0.01)
    hs = [torch.zeros_like(p) for p in params]
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        amp_C.multi_tensor_adagrad(2048, _flag(), [grads, params, hs], 0.1, 1e-10, 0, 0.01)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-6)
    p64, g64 = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    p, h = p64.float(), torch.zeros(5)
    amp_C.multi_tensor_adagrad(2048, _flag(), [[g64.float()], [p], [h]], 0.1, 1e-10, 1, 0.01)
    expect = p64 - 0.1 * (g64 / (g64.abs() + 1e-10) + 0.01 * p64)
    torch.testing.assert_close(p.double(), expect, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- loss scale with hysteresis
def _ftz32(x):
    """x as flush-to-zero float32 arithmetic reads and writes it: below the smallest normal it is 0."""
    return 0.0 if abs(x) < np.finfo(np.float32).tiny else x


def _hysteresis_reference(state, found, growth_factor, backoff_factor, interval, hysteresis):
    """Upstream's documented rules on Python numbers; the scale rounded to float32 as a float32 state, with
    the flush-to-zero float32 arithmetic of upstream's kernel (built with fast math)."""
    scale, growth, hyst = state
    if found > 0:
        hyst -= 1
        if hyst > 0:
            return scale, 0, hyst
    if found != 0:  # nan too
        scale, growth = _ftz32(float(np.float32(_ftz32(scale) * backoff_factor))), 0
    elif growth + 1 == interval:
        with np.errstate(over="ignore"):
            grown = _ftz32(float(np.float32(_ftz32(scale) * growth_factor)))
        scale, growth = (grown if math.isfinite(grown) else scale), 0
    else:
        growth += 1
    if found <= 0:
        hyst = hysteresis
    return scale, growth, hyst


@pytest.mark.parametrize("seed", range(6))
def test_update_scale_hysteresis_follows_the_rules(seed, device):
    rng = np.random.default_rng(seed)
    interval, hysteresis = int(rng.integers(1, 5)), int(rng.integers(1, 4))
    growth_factor, backoff_factor = [(2.0, 0.5), (1.5, 0.3), (4.0, 0.125)][seed % 3]
    # near the top (growth that would overflow float32 is refused) and near the bottom (backoff reaches 0)
    init = [65536.0, 3.0e38, 1.0e-38, 1.0][seed % 4]
    scale = torch.tensor([init], dtype=torch.float32, device=device)
    growth = torch.zeros(1, dtype=torch.int32, device=device)
    hyst = torch.full((1,), hysteresis, dtype=torch.int64 if seed % 2 else torch.int32, device=device)
    found = torch.zeros(1, device=device)
    state = (float(np.float32(init)), 0, hysteresis)
    runs = rng.choice([0.0, 1.0, float("nan"), -1.0, 0.5], size=300, p=[0.55, 0.3, 0.05, 0.05, 0.05])
    for x in runs:
        found.fill_(float(x))
        out = amp_C.update_scale_hysteresis(scale, growth, hyst, found, growth_factor, backoff_factor, interval,
                                            hysteresis)
        assert out is scale
        state = _hysteresis_reference(state, float(x), growth_factor, backoff_factor, interval, hysteresis)
        assert (scale.item(), growth.item(), hyst.item()) == state


@pytest.mark.parametrize("init, factor, found, expect", [
    (2.0 ** -126, 0.5, 1.0, 0.0),             # backoff below the smallest normal: 0, not 2**-127
    (2.0 ** -125, 0.5, 1.0, 2.0 ** -126),     # to the smallest normal: kept
    (1.0e-38, 4.0, 0.0, 0.0),                 # a subnormal scale reads as 0, so growth gives 0
    (-(2.0 ** -126), 0.5, 1.0, -0.0),         # the sign of the zero is kept
])
def test_update_scale_hysteresis_flushes_subnormal_scales_to_zero(init, factor, found, expect, device):
    scale = torch.tensor([init], dtype=torch.float32, device=device)
    growth = torch.zeros(1, dtype=torch.int32, device=device)
    hyst = torch.ones(1, dtype=torch.int32, device=device)
    amp_C.update_scale_hysteresis(scale, growth, hyst, torch.tensor([found], device=device), factor, factor, 1, 1)
    assert scale.item() == expect and math.copysign(1.0, scale.item()) == math.copysign(1.0, expect)


def test_update_scale_hysteresis_holds_the_scale_for_hysteresis_minus_one_overflows():
    scale, growth = torch.tensor([1024.0]), torch.tensor([2], dtype=torch.int32)
    hyst, found = torch.tensor([3], dtype=torch.int32), torch.ones(1)
    for expect_hyst in (2, 1):
        amp_C.update_scale_hysteresis(scale, growth, hyst, found, 2.0, 0.5, 4, 3)
        assert (scale.item(), growth.item(), hyst.item()) == (1024.0, 0, expect_hyst)
    amp_C.update_scale_hysteresis(scale, growth, hyst, found, 2.0, 0.5, 4, 3)
    assert (scale.item(), growth.item(), hyst.item()) == (512.0, 0, 0)
    found.zero_()
    amp_C.update_scale_hysteresis(scale, growth, hyst, found, 2.0, 0.5, 4, 3)
    assert (scale.item(), growth.item(), hyst.item()) == (512.0, 1, 3)


@pytest.mark.parametrize("tracker_dtype, found_dtype", [
    (torch.int32, torch.float32), (torch.int64, torch.float64), (torch.uint8, torch.float16),
    (torch.int16, torch.bfloat16), (torch.int8, torch.float32),
])
@pytest.mark.parametrize("seed", range(4))
def test_update_scale_hysteresis_host_and_tensor_forms_agree_bitwise(tracker_dtype, found_dtype, seed, monkeypatch):
    """CPU states take the Python-number form; every other device the tensor-op form. Both run here on the same
    states (the tensor form forced), from edge scales (subnormal, largest finite, inf, nan, signed zeros) and
    trackers next to their dtype's wrap-around, with found values of every kind; results equal bit for bit."""
    from apex.multi_tensor_apply import amp_C as impl

    rng = np.random.default_rng(seed)
    info = torch.iinfo(tracker_dtype)
    scales = [65536.0, 3.0e38, 1.0e-38, 2.0 ** -126, -(2.0 ** -126), float("inf"), float("nan"), 0.0, -0.0, 1.0]
    founds = [0.0, 1.0, float("nan"), -1.0, 0.5, float("inf"), -0.0, 1e-50, 70000.0]
    factors = [(2.0, 0.5), (1.5, 0.3), (1e30, 1e-30), (4.0, 0.125)]

    def state(init, g, h):
        return (torch.tensor([init], dtype=torch.float32), torch.tensor([g], dtype=tracker_dtype),
                torch.tensor([h], dtype=tracker_dtype))

    for _ in range(40):
        init = scales[rng.integers(len(scales))]
        g = int(rng.choice([0, 1, info.max - 1, info.max, info.min]))
        h = int(rng.choice([0, 1, 2, info.max, info.min, info.min + 1]))
        growth_f, backoff_f = factors[rng.integers(len(factors))]
        interval = int(rng.choice([1, 2, 3, info.max, min(info.max + 1, 2 ** 63 - 1)]))
        hysteresis = int(rng.choice([1, 2, info.max]))
        on_host, on_device = state(init, g, h), state(init, g, h)
        for _ in range(12):
            found = torch.tensor([founds[rng.integers(len(founds))]], dtype=found_dtype)
            monkeypatch.setattr(impl, "_scalars_on_host", lambda t: True)
            amp_C.update_scale_hysteresis(*on_host, found, growth_f, backoff_f, interval, hysteresis)
            monkeypatch.setattr(impl, "_scalars_on_host", lambda t: False)
            amp_C.update_scale_hysteresis(*on_device, found, growth_f, backoff_f, interval, hysteresis)
            assert torch.equal(on_host[0].view(torch.int32), on_device[0].view(torch.int32)), (on_host, on_device)
            assert torch.equal(on_host[1], on_device[1]) and torch.equal(on_host[2], on_device[2])


def test_update_scale_hysteresis_takes_the_host_form_on_cpu(monkeypatch):
    from apex.multi_tensor_apply import amp_C as impl

    ops = []
    monkeypatch.setattr(impl, "_hysteresis_on_device", lambda *a: ops.append("device"))
    monkeypatch.setattr(impl, "_hysteresis_on_host", lambda *a: ops.append("host"))
    amp_C.update_scale_hysteresis(torch.ones(1), torch.zeros(1, dtype=torch.int32),
                                  torch.ones(1, dtype=torch.int32), torch.zeros(1), 2.0, 0.5, 2, 2)
    assert ops == ["host"]
    # a tensor off the host takes the device form (meta stands for one here: the op itself refuses meta tensors)
    assert not impl._scalars_on_host(torch.ones(1, device="meta"))


@pytest.mark.parametrize("change, error, match", [
    ({"current_scale": torch.tensor([1.0], dtype=torch.float64)}, TypeError, "current_scale.*float32"),
    ({"current_scale": torch.ones(2)}, TypeError, "current_scale.*2 elements"),
    ({"current_scale": 1.0}, TypeError, "current_scale.*float"),
    ({"growth_tracker": torch.zeros(1)}, TypeError, "growth_tracker.*integer"),
    ({"hysteresis_tracker": torch.zeros(1, dtype=torch.bool)}, TypeError, "hysteresis_tracker.*integer"),
    ({"found_inf": torch.zeros(1, dtype=torch.int32)}, TypeError, "found_inf.*floating"),
    ({"growth_interval": 2.0}, TypeError, "growth_interval must be an int"),
    ({"hysteresis": True}, TypeError, "hysteresis must be an int"),
    ({"hysteresis": 2 ** 31}, ValueError, r"hysteresis must be in \[-2147483648, 2147483647\]"),
    ({"growth_interval": 2 ** 63}, ValueError, "growth_interval must be in"),
    ({"growth_factor": "2"}, TypeError, "growth_factor must be a number"),
])
def test_update_scale_hysteresis_rejects_bad_arguments_before_writing(change, error, match):
    args = {"current_scale": torch.tensor([8.0]), "growth_tracker": torch.tensor([1], dtype=torch.int32),
            "hysteresis_tracker": torch.tensor([1], dtype=torch.int32), "found_inf": torch.ones(1),
            "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2, "hysteresis": 2}
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    args.update(change)
    with pytest.raises(error, match=match):
        amp_C.update_scale_hysteresis(**args)
    for k, v in before.items():
        if isinstance(args[k], torch.Tensor) and k not in change:
            assert torch.equal(args[k], v), k


# ---------------------------------------------------------------- bad arguments
def test_bad_arguments_raise_before_writing():
    xs = _tensors()
    outs = [torch.zeros_like(x) for x in xs]
    with pytest.raises(ValueError, match="expected 2 tensor lists, got 1"):
        amp_C.multi_tensor_scale(2048, _flag(), [xs], 1.0)
    with pytest.raises(ValueError, match="tensor list 1 has 4 tensors"):
        amp_C.multi_tensor_scale(2048, _flag(), [xs, outs[:-1]], 1.0)
    with pytest.raises(ValueError, match=r"tensor_lists\[1\]\[0\] has 6 elements"):
        amp_C.multi_tensor_scale(2048, _flag(), [xs, [torch.zeros(6), *outs[1:]]], 1.0)
    with pytest.raises(TypeError, match="noop_flag"):
        amp_C.multi_tensor_scale(2048, torch.zeros(1), [xs, outs], 1.0)
    with pytest.raises(TypeError, match="noop_flag"):
        amp_C.multi_tensor_scale(2048, 0, [xs, outs], 1.0)
    with pytest.raises(TypeError, match="float32, float16, bfloat16 or float64"):
        amp_C.multi_tensor_l2norm(2048, _flag(), [[torch.ones(3, dtype=torch.int64)]])
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        amp_C.multi_tensor_l2norm(0, _flag(), [xs])
    with pytest.raises(TypeError, match=r"chunk_size must be an int, got 2048\.0"):
        amp_C.multi_tensor_l2norm(2048.0, _flag(), [xs])
    ms, vs = [torch.zeros_like(x) for x in xs], [torch.zeros_like(x) for x in xs]
    with pytest.raises(ValueError, match="mode"):
        amp_C.multi_tensor_adam(2048, _flag(), [xs, outs, ms, vs], 1e-3, 0.9, 0.999, 1e-8, 1, 2, 1, 0.0)
    with pytest.raises(ValueError, match="arg_to_check"):
        amp_C.multi_tensor_axpby(2048, _flag(), [xs, xs, outs], 1.0, 1.0, 3)
    with pytest.raises(ValueError, match="grad_norms"):
        amp_C.multi_tensor_novograd(2048, _flag(), [xs, outs, ms], torch.ones(2), 1e-3, 0.9, 0.9, 1e-8, 1, 1,
                                    0.0, 1, 0, 2)
    with pytest.raises(TypeError, match="list of lists"):
        amp_C.multi_tensor_scale(2048, _flag(), xs, 1.0)
    assert all(not o.any() for o in outs + ms + vs)


def test_tensors_pair_in_memory_order_whatever_their_shapes():
    """Upstream's kernels index each tensor's memory linearly: tensor i of every list needs the same element count,
    not the same shape, and a channels_last tensor is read in its memory order."""
    x = torch.randn(2, 3, dtype=torch.float64)
    out = torch.zeros(3, 2, dtype=torch.float64)  # same count, other shape (the torch-ops path: float64)
    amp_C.multi_tensor_scale(2048, _flag(), [[torch.ones(4), x], [torch.zeros(4), out]], 2.0)
    assert torch.equal(out.reshape(-1), x.reshape(-1) * 2)
    cl = torch.randn(1, 3, 2, 2).to(memory_format=torch.channels_last)
    flat = torch.zeros(12)
    amp_C.multi_tensor_axpby(2048, _flag(), [[cl], [torch.ones(12)], [flat]], 2.0, 1.0, -1)
    memory_order = cl.permute(0, 2, 3, 1).reshape(-1)
    assert torch.equal(flat, memory_order * 2 + 1)


@pytest.mark.parametrize("op", ["scale", "sgd", "adam", "adagrad"])
def test_a_tensor_that_is_not_dense_is_rejected_before_anything_is_written(op):
    """An expanded (stride 0) or strided tensor anywhere in the lists: ValueError naming it, and tensor 0 of every
    list, which an op working tensor by tensor would have written first, unchanged (upstream: "A tensor was not
    contiguous")."""
    bad = torch.zeros(1).expand(3)
    ones = [torch.ones(3), torch.ones(3)]
    p0 = torch.ones(3)
    lists = {
        "scale": ([ones, [p0, bad]], (2.0,)),
        "sgd": ([ones, [p0, torch.ones(3)], [torch.zeros(3), bad]], (0.0, 0.9, 0.0, 0.1, False, True, False, 1.0)),
        "adam": ([ones, [p0, torch.ones(3)], [torch.zeros(3)] * 2, [torch.zeros(3), bad]],
                 (1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)),
        "adagrad": ([ones, [p0, torch.ones(6)[::2]], [torch.zeros(3), torch.zeros(3)]], (0.1, 1e-10, 0, 0.0)),
    }[op]
    with pytest.raises(ValueError, match=r"tensor_lists\[\d\]\[1\] must be contiguous"):
        getattr(amp_C, f"multi_tensor_{op}")(2048, _flag(), lists[0], *lists[1])
    assert torch.equal(p0, torch.ones(3))


@pytest.mark.parametrize("kind", ["sparse", "nested"])
def test_a_sparse_or_nested_tensor_is_refused_by_name(kind):
    if kind == "sparse":
        bad = torch.ones(3).to_sparse()
    else:
        bad = torch.nested.nested_tensor([torch.ones(1), torch.ones(2)], layout=torch.jagged)
    p0 = torch.ones(3)
    with pytest.raises(TypeError, match=r"tensor_lists\[0\]\[1\] must be a dense tensor, got "
                                        + ("layout torch.sparse_coo" if kind == "sparse" else "a nested tensor")):
        amp_C.multi_tensor_scale(2048, _flag(), [[torch.ones(3), bad], [p0, torch.zeros(3)]], 2.0)
    assert torch.equal(p0, torch.ones(3))


def test_ops_run_on_the_test_device(device):
    xs = _tensors(device=device)
    flag = _flag(device)
    total, per = amp_C.multi_tensor_l2norm(2048, flag, [xs], True)
    assert total.device.type == device and per.device.type == device
    ref = torch.linalg.vector_norm(torch.cat([x.double().reshape(-1) for x in xs]).cpu())
    assert total.item() == pytest.approx(float(ref), rel=1e-6)
    outs = [torch.empty_like(x) for x in xs]
    amp_C.multi_tensor_scale(2048, flag, [xs, outs], 2.0)
    assert flag.item() == 0 and all(torch.equal(o, x * 2) for o, x in zip(outs, xs))
    expect = [o * 0.5 for o in outs]
    amp_C.multi_tensor_scale(2048, flag, [outs, outs], 0.5)  # in place
    assert flag.item() == 0 and all(torch.equal(o, e) for o, e in zip(outs, expect))
    outs[-1].view(-1)[-1] = float("inf")
    amp_C.multi_tensor_scale(2048, flag, [outs, outs], 0.5)
    assert flag.item() == 1 and torch.equal(outs[0], expect[0] * 0.5)


# ---------------------------------------------------------------- whole lists off the host
# Lists off CPU take a few foreach launches and one host synchronisation (amp_C._off_host); forced here on CPU
# lists, and compared with the per-tensor path those lists take on CPU.
def _mixed_lists(src_dtype, dst_dtype, bad=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 3), (0,), (129,), (2, 3, 4), (1,)]
    src = [(torch.randn(s, generator=gen) * 300).to(src_dtype) for s in shapes]
    if bad is not None:
        src[2][5] = bad
    dst = [torch.full(s, -1.0, dtype=dst_dtype) for s in shapes]
    return src, dst


@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.float32, torch.float32), (torch.float32, torch.float64),
                                                 (torch.float32, torch.float16)])
@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
def test_scale_of_lists_off_the_host_matches_the_per_tensor_path(monkeypatch, src_dtype, dst_dtype, bad):
    """Bitwise: the copy is exact (same dtype or widening) and the multiply rounds once; a narrowing pair
    (fp32 into fp16) takes the per-tensor path, which rounds once too."""
    expect_src, expect_dst = _mixed_lists(src_dtype, dst_dtype, bad)
    flag_ref = torch.zeros(1, dtype=torch.int)
    amp_C.multi_tensor_scale(2048, flag_ref, [expect_src, expect_dst], 1.0 / 1024)
    monkeypatch.setattr(amp_C, "_off_host", lambda ts: bool(ts))
    src, dst = _mixed_lists(src_dtype, dst_dtype, bad)
    flag = torch.zeros(1, dtype=torch.int)
    amp_C.multi_tensor_scale(2048, flag, [src, dst], 1.0 / 1024)
    assert int(flag) == int(flag_ref) == (bad is not None)
    for a, b in zip(dst, expect_dst):
        assert a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan())
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
def test_scale_in_place_of_lists_off_the_host(monkeypatch, dtype, bad):
    """One tensor passed as both lists (multi-dimensional too: the ops see memory-order views) is scaled once, by
    torch's fused unscale op for float32/16/bf16 and by a multiply for float64, bitwise as per tensor; an inf/nan
    sets the flag and every value is still scaled."""
    ref, _ = _mixed_lists(dtype, dtype, bad, seed=3)
    flag_ref = torch.zeros(1, dtype=torch.int)
    amp_C.multi_tensor_scale(2048, flag_ref, [ref, ref], 1.0 / 3)
    monkeypatch.setattr(amp_C, "_off_host", lambda ts: bool(ts))
    ours, _ = _mixed_lists(dtype, dtype, bad, seed=3)
    flag = torch.zeros(1, dtype=torch.int)
    amp_C.multi_tensor_scale(2048, flag, [ours, ours], 1.0 / 3)
    assert int(flag) == int(flag_ref) == (bad is not None)
    assert all(torch.equal(a.isnan(), b.isnan()) for a, b in zip(ours, ref))
    assert all(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) for a, b in zip(ours, ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_l2norm_of_lists_off_the_host_matches_the_per_tensor_path(monkeypatch, dtype, per_tensor):
    ts, _ = _mixed_lists(dtype, dtype, seed=5)
    flag_ref = torch.zeros(1, dtype=torch.int)
    ref = amp_C.multi_tensor_unscale_l2norm(2048, flag_ref, [ts], torch.tensor([0.25]), per_tensor)
    monkeypatch.setattr(amp_C, "_off_host", lambda t: bool(t))
    flag = torch.zeros(1, dtype=torch.int)
    ours = amp_C.multi_tensor_unscale_l2norm(2048, flag, [ts], torch.tensor([0.25]), per_tensor)
    assert int(flag) == int(flag_ref) == 0
    for a, b in zip(ours, ref):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-7, atol=0)  # float64 norms either way, rounded to fp32


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 1e20])
def test_l2norm_of_lists_off_the_host_sets_the_flag(monkeypatch, bad):
    """inf/nan anywhere, or a sum of squares past fp32's range (1e20 squared), sets the flag, as per tensor."""
    monkeypatch.setattr(amp_C, "_off_host", lambda t: bool(t))
    ts, _ = _mixed_lists(torch.float32, torch.float32, bad)
    flag = torch.zeros(1, dtype=torch.int)
    amp_C.multi_tensor_l2norm(2048, flag, [ts], True)
    assert int(flag) == 1


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("arg_to_check,bad_in,expect", [(-1, "y", 1), (0, "y", 0), (1, "y", 1), (0, "x", 1),
                                                        (-1, None, 0)])
def test_axpby_of_lists_off_the_host_matches_the_per_tensor_path(monkeypatch, out_dtype, arg_to_check, bad_in,
                                                                 expect):
    """fp32 working copies, a * x then + b * y, each output rounded once: bitwise the per-tensor path on the
    same device; the flag from the checked argument only."""
    def lists():
        xs, _ = _mixed_lists(torch.float16, torch.float16, float("inf") if bad_in == "x" else None, seed=7)
        ys, outs = _mixed_lists(torch.float32, out_dtype, float("nan") if bad_in == "y" else None, seed=8)
        return xs, ys, outs

    xs, ys, ref = lists()
    with monkeypatch.context() as m:  # the per-tensor path with torch ops (what CUDA ran before)
        m.setattr(amp_C._core, "uses_kernel", lambda *t: False)
        flag_ref = torch.zeros(1, dtype=torch.int)
        amp_C.multi_tensor_axpby(2048, flag_ref, [xs, ys, ref], 0.5, -2.0, arg_to_check)
    monkeypatch.setattr(amp_C, "_off_host", lambda ts: bool(ts))
    xs, ys, outs = lists()
    flag = torch.zeros(1, dtype=torch.int)
    amp_C.multi_tensor_axpby(2048, flag, [xs, ys, outs], 0.5, -2.0, arg_to_check)
    assert int(flag) == int(flag_ref) == expect
    for a, b in zip(outs, ref):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def test_axpby_of_lists_off_the_host_may_write_into_an_input(monkeypatch):
    monkeypatch.setattr(amp_C, "_off_host", lambda ts: bool(ts))
    xs, _ = _mixed_lists(torch.float32, torch.float32, seed=9)
    ys, _ = _mixed_lists(torch.float32, torch.float32, seed=10)
    expect = [x.mul(2.0).add_(y, alpha=3.0) for x, y in zip(xs, ys)]  # the same ops, before ys is written
    amp_C.multi_tensor_axpby(2048, torch.zeros(1, dtype=torch.int), [xs, ys, ys], 2.0, 3.0, -1)
    assert all(torch.equal(y, e) for y, e in zip(ys, expect))


# ---------------------------------------------------------------- lists taken as they are
# Contiguous tensors whose shapes match across lists skip the per-tensor loop and the memory-order views
# (amp_C._plain_lists); every op must give the bits it gives when the loop and the views run.
_LIST_OPS = {
    "scale": (2, lambda f, L: amp_C.multi_tensor_scale(2048, f, L, 0.25)),
    "axpby": (3, lambda f, L: amp_C.multi_tensor_axpby(2048, f, L, 2.0, -0.5, -1)),
    "l2norm": (1, lambda f, L: amp_C.multi_tensor_l2norm(2048, f, L, True)),
    "unscale_l2norm": (1, lambda f, L: amp_C.multi_tensor_unscale_l2norm(2048, f, L, torch.tensor([0.5]), True)),
    "adam": (4, lambda f, L: amp_C.multi_tensor_adam(2048, f, L, 1e-3, 0.9, 0.999, 1e-8, 3, 1, 1, 0.01)),
    "sgd": (3, lambda f, L: amp_C.multi_tensor_sgd(2048, f, L, 0.01, 0.9, 0.0, 0.1, True, False, False, 1.0)),
    "lamb": (4, lambda f, L: amp_C.multi_tensor_lamb(2048, f, L, 1e-3, 0.9, 0.999, 1e-6, 3, 1, 0.01, 1, 1,
                                                     torch.tensor([2.0]), 1.0)),
    "novograd": (3, lambda f, L: amp_C.multi_tensor_novograd(2048, f, L, torch.ones(len(L[0])), 1e-3, 0.9, 0.99,
                                                             1e-8, 2, 1, 0.01, 1, 0, 2)),
    "adagrad": (3, lambda f, L: amp_C.multi_tensor_adagrad(2048, f, L, 1e-2, 1e-10, 1, 0.01)),
}


def _list_case(depth, shapes, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.rand(s, generator=gen).add_(0.1).to(dtype) for s in shapes] for _ in range(depth)]


@pytest.mark.parametrize("name", sorted(_LIST_OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lists_taken_as_they_are_give_the_bits_of_memory_order_views(name, dtype, monkeypatch):
    depth, op = _LIST_OPS[name]
    shapes = [(3, 5), (7,), (2, 3, 4), (), (0, 4), (1,)]
    fast = _list_case(depth, shapes, seed=11, dtype=dtype)
    slow = _list_case(depth, shapes, seed=11, dtype=dtype)
    taken = []
    real = amp_C._plain_lists
    monkeypatch.setattr(amp_C, "_plain_lists", lambda lists: taken.append(real(lists)) or taken[-1])
    flag_fast, flag_slow = _flag(), _flag()
    out_fast = op(flag_fast, fast)
    monkeypatch.setattr(amp_C, "_plain_lists", lambda lists: False)  # the loop and the views, as before
    out_slow = op(flag_slow, slow)
    assert taken == [True]
    assert int(flag_fast) == int(flag_slow)
    for a, b in zip((t for tl in fast for t in tl), (t for tl in slow for t in tl)):
        assert a.shape == b.shape and torch.equal(a, b)
    if out_fast is not None:
        for a, b in zip(out_fast, out_slow):
            assert torch.equal(a, b)


def _bad_lists():
    """Lists the per-tensor loop rejects or takes only through memory-order views, one per case."""
    x = torch.ones(6)
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    return {
        "not a tensor": [[x, 3.0], [x.clone(), x.clone()]],
        "integer dtype": [[x, torch.ones(6, dtype=torch.int32)], [x.clone(), x.clone()]],
        "sparse": [[x, torch.ones(6).to_sparse()], [x.clone(), x.clone()]],
        "nested": [[x, nested], [x.clone(), x.clone()]],
        "not contiguous": [[x, torch.ones(6, 2).t()], [x.clone(), torch.ones(2, 6)]],
        "other numel": [[x, torch.ones(6)], [x.clone(), torch.ones(5)]],
        "other device": [[x, torch.ones(6)], [x.clone(), torch.ones(6, device="meta")]],
        "meta": [[torch.ones(6, device="meta")], [torch.ones(6, device="meta")]],
        "other length": [[x, x.clone()], [x.clone()]],
        "same numel, other shape": [[x, torch.ones(2, 3)], [x.clone(), torch.ones(3, 2)]],
        "channels_last": [[torch.ones(1, 2, 2, 3).to(memory_format=torch.channels_last)],
                          [torch.ones(1, 2, 2, 3).to(memory_format=torch.channels_last)]],
    }


@pytest.mark.parametrize("case", sorted(_bad_lists()))
def test_lists_the_loop_must_see_are_never_taken_as_they_are(case, monkeypatch):
    """The fast test only accepts what the loop accepts unchanged; everything else reaches the loop, which raises
    naming the tensor or takes the memory-order views (the same outcome as when the fast test is skipped)."""
    lists = _bad_lists()[case]
    assert not amp_C._plain_lists([list(tl) for tl in lists])

    def outcome():
        try:
            amp_C.multi_tensor_scale(2048, _flag(), _bad_lists()[case], 2.0)
        except (TypeError, ValueError, RuntimeError, NotImplementedError) as exc:
            return type(exc), str(exc)
        return None

    with_fast = outcome()
    monkeypatch.setattr(amp_C, "_plain_lists", lambda lists: False)
    assert outcome() == with_fast


def test_one_list_passed_twice_is_checked_once_and_scaled_once_off_the_host(monkeypatch):
    """[grads, grads] (one list object) is in place: leaves that require grad are scaled under grad mode too."""
    monkeypatch.setattr(amp_C, "_off_host", lambda ts: bool(ts))
    ps = [torch.nn.Parameter(torch.full(s, 3.0)) for s in [(2, 3), (4,)]]
    flag = _flag()
    amp_C.multi_tensor_scale(2048, flag, [ps, ps], 0.5)
    assert int(flag) == 0 and all(torch.equal(p.detach(), torch.full(p.shape, 1.5)) for p in ps)
    ps[1].data[0] = float("inf")
    amp_C.multi_tensor_scale(2048, flag, [ps, ps], 0.5)
    assert int(flag) == 1 and torch.equal(ps[0].detach(), torch.full((2, 3), 0.75))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
def test_scale_in_place_on_cpu_in_one_call_gives_the_per_tensor_bits(dtype, bad, monkeypatch):
    """In place on CPU, the list takes one apex_C pass over its address table; bitwise the per-tensor calls."""
    ref, _ = _mixed_lists(dtype, dtype, bad, seed=7)
    ours, _ = _mixed_lists(dtype, dtype, bad, seed=7)
    calls = []
    real = amp_C._core._scale_gather_unchecked
    monkeypatch.setattr(amp_C._core, "_scale_gather_unchecked", lambda *a, **k: calls.append(1) or real(*a, **k))
    flag = _flag()
    amp_C.multi_tensor_scale(2048, flag, [ours, ours], 1.0 / 3)
    assert calls == [1]
    monkeypatch.setattr(amp_C, "_disjoint", lambda ts: False)  # the per-tensor loop
    flag_ref = _flag()
    amp_C.multi_tensor_scale(2048, flag_ref, [ref, ref], 1.0 / 3)
    assert calls == [1] and int(flag) == int(flag_ref) == (bad is not None)
    for a, b in zip(ours, ref):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


@pytest.mark.parametrize("off_host", [False, True])
def test_scale_in_place_of_a_list_holding_one_tensor_twice_scales_it_twice(off_host, monkeypatch):
    """Upstream's kernel visits each list entry in turn: a tensor listed twice is scaled twice, never raced (off
    the host too, where one launch over both entries would race)."""
    if off_host:
        monkeypatch.setattr(amp_C, "_off_host", lambda ts: bool(ts))
    x = torch.full((1000,), 8.0)
    overlap = [x, x[500:], torch.full((3,), 8.0)]  # x[500:] lies inside x
    for ts, expect in (([x, x], 2.0), (overlap, None)):
        x.fill_(8.0)
        amp_C.multi_tensor_scale(2048, _flag(), [ts, ts], 0.5)
        if expect is not None:
            assert torch.equal(x, torch.full((1000,), expect))
        else:
            assert torch.equal(x[:500], torch.full((500,), 4.0)) and torch.equal(x[500:], torch.full((500,), 2.0))
            assert torch.equal(overlap[2], torch.full((3,), 4.0))


# ---------------------------------------------------------------- bad scalars and flags: an error, nothing written
def _adam_lists():
    return [[torch.randn(3)], [torch.randn(3)], [torch.randn(3)], [torch.rand(3)]]


@pytest.mark.parametrize("beta1, beta2, step", [
    (0.9, 0.999, 0),          # 1 - beta**0 = 0: every element divided by 0
    (2.0, 0.999, 10**6),      # beta1**step overflows
    (0.9, 1.5, 1),            # 1 - beta2 < 0 under a square root
    (0.9, -0.5, 1.5),         # a negative beta at a fractional step: complex
    (-0.5, 0.999, 1.5),
])
@pytest.mark.parametrize("op", ["adam", "lamb", "novograd"])
def test_optimizer_ops_refuse_bias_corrections_they_cannot_apply(op, beta1, beta2, step):
    lists = _adam_lists()
    if op == "novograd":
        lists = lists[:3]
    before = [t.clone() for tl in lists for t in tl]
    with pytest.raises(ValueError, match=rf"multi_tensor_{op}: the bias corrections .* step={float(step)!r}"):
        if op == "adam":
            amp_C.multi_tensor_adam(64, _flag(), lists, 1e-3, beta1, beta2, 1e-8, step, 0, 1, 0.0)
        elif op == "lamb":
            amp_C.multi_tensor_lamb(64, _flag(), lists, 1e-3, beta1, beta2, 1e-6, step, 1, 0.01, 1, 1, 1.0, 1.0)
        else:
            amp_C.multi_tensor_novograd(64, _flag(), lists, torch.ones(1), 1e-3, beta1, beta2, 1e-8, step, 1,
                                        0.0, 1, 0, 2)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for tl in lists for t in tl]))
    # without bias correction the same scalars are upstream's plain update
    if op == "adam" and abs(beta1) <= 1 and abs(beta2) <= 1:
        amp_C.multi_tensor_adam(64, _flag(), lists, 1e-3, beta1, beta2, 1e-8, step, 0, 0, 0.0)


def test_lamb_refuses_to_clip_by_a_zero_max_norm():
    lists = _adam_lists()
    before = [t.clone() for tl in lists for t in tl]
    with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
        amp_C.multi_tensor_lamb(64, _flag(), lists, 1e-3, 0.9, 0.999, 1e-6, 1, 1, 0.01, 1, 1, 2.0, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for tl in lists for t in tl]))
    amp_C.multi_tensor_lamb(64, _flag(), lists, 1e-3, 0.9, 0.999, 1e-6, 1, 1, 0.01, 1, 1, 0.0, 0.0)  # no clip


def test_mode_accepts_integers_and_names_anything_else():
    lists = _adam_lists()
    amp_C.multi_tensor_adam(64, _flag(), lists, 1e-3, 0.9, 0.999, 1e-8, 1, np.int64(1), 1, 0.0)
    amp_C.multi_tensor_adam(64, _flag(), lists, 1e-3, 0.9, 0.999, 1e-8, 2, torch.tensor(0), 1, 0.0)
    with pytest.raises(ValueError, match=r"mode must be 0 \(L2 decay\) or 1"):
        amp_C.multi_tensor_adam(64, _flag(), lists, 1e-3, 0.9, 0.999, 1e-8, 3, torch.tensor([1, 0]), 1, 0.0)


def test_tensors_on_two_devices_are_refused_before_any_write():
    c = torch.ones(3)
    m = torch.ones(3, device="meta")
    with pytest.raises(ValueError, match=r"every tensor must be on one device: tensor_lists\[0\]\[1\] is on meta"):
        amp_C.multi_tensor_scale(64, _flag(), [[c, m], [c, m]], 2.0)
    x, y, out = torch.ones(2), torch.ones(2), torch.zeros(2)
    with pytest.raises(ValueError, match="every tensor must be on one device"):
        amp_C.multi_tensor_axpby(64, _flag(), [[x, m], [y, m], [out, m]], 2.0, 3.0, -1)
    assert torch.equal(c, torch.ones(3)) and not out.any()


def test_an_inference_flag_is_refused_before_any_write():
    with torch.inference_mode():
        flag = torch.zeros(1, dtype=torch.int)
    out = torch.zeros(1)
    with pytest.raises(TypeError, match="noop_flag is an inference tensor"):
        amp_C.multi_tensor_scale(64, flag, [[torch.tensor([float("nan")])], [out]], 2.0)
    assert not out.any() and not flag.any()
    with torch.inference_mode():  # inside inference mode it is writable, and is set
        amp_C.multi_tensor_scale(64, flag, [[torch.tensor([float("nan")])], [out]], 2.0)
    assert flag.item() == 1


@pytest.mark.parametrize("flag", [torch.zeros(2, 2, dtype=torch.int).t(), torch.zeros((), dtype=torch.int),
                                  torch.zeros(4, dtype=torch.int)[::2]], ids=["transposed", "0-d", "strided"])
def test_a_non_contiguous_flag_is_set_where_it_lives(flag):
    amp_C.multi_tensor_scale(64, flag, [[torch.tensor([float("nan")])], [torch.zeros(1)]], 2.0)
    assert flag.reshape(-1)[0].item() == 1 and flag.sum().item() == 1


def test_scalars_may_be_numpy_numbers_and_huge_ints_are_named():
    ts = [torch.ones(3)]
    out = [torch.zeros(3)]
    amp_C.multi_tensor_scale(64, _flag(), [ts, out], np.float32(0.5))
    assert torch.equal(out[0], torch.full((3,), 0.5))
    with pytest.raises(ValueError, match="scale must be within float32's range"):
        amp_C.multi_tensor_scale(64, _flag(), [ts, out], 10**400)
    assert torch.equal(out[0], torch.full((3,), 0.5))


def _adam_call(**over):
    lists = _adam_lists()
    args = dict(lr=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-8, step=1, mode=1, bias_correction=1, weight_decay=0.0)
    args.update(over)
    return lists, args


@pytest.mark.parametrize("name, value, error, pattern", [
    ("beta1", 1e308, ValueError, r"beta1 must be within float32's range"),
    ("lr", torch.tensor(1e300, dtype=torch.float64), ValueError, r"lr must be within float32's range"),
    ("epsilon", torch.empty((), device="meta"), ValueError, r"epsilon must hold a value, got a meta tensor"),
    ("lr", torch.tensor(1 + 2j), TypeError, r"lr must be a real number"),
    ("bias_correction", torch.ones(3), ValueError, r"bias_correction must be a number or a one-element tensor"),
    ("bias_correction", "yes", TypeError, r"bias_correction must be a bool \(or 0/1\), got 'yes'"),
    ("mode", torch.zeros(40, 40, dtype=torch.int), ValueError,
     r"mode must be 0 \(L2 decay\) or 1 \(decoupled decay\), got a torch.int32 tensor of shape \(40, 40\)"),
])
def test_a_bad_scalar_or_switch_is_refused_before_any_write(name, value, error, pattern):
    """Scalars beyond float32 (the ops compute in float32: torch refused them only after earlier tensors were
    written), tensors without a value (meta), complex ones, and switches that are not bools get apex's message
    before anything is written; a tensor is described by its kind and shape, not printed."""
    lists, args = _adam_call(**{name: value})
    before = [[t.clone() for t in lst] for lst in lists]
    with pytest.raises(error, match=pattern) as info:
        amp_C.multi_tensor_adam(64, _flag(), lists, *args.values())
    assert len(str(info.value)) < 200
    for lst, old in zip(lists, before):
        for t, o in zip(lst, old):
            assert torch.equal(t, o)


def test_lamb_and_adagrad_refuse_a_huge_finite_hyperparameter_before_any_write():
    lists = _adam_lists()
    before = [[t.clone() for t in lst] for lst in lists]
    with pytest.raises(ValueError, match="beta1 must be within float32's range"):
        amp_C.multi_tensor_lamb(64, _flag(), lists, 1e-3, 1e308, 0.999, 1e-6, 1, 1, 0.01, 1, 1, 1.0, 1.0)
    with pytest.raises(ValueError, match="lr must be within float32's range"):
        amp_C.multi_tensor_adagrad(64, _flag(), lists[:3], 1e308, 1e-10, 1, 0.0)
    for lst, old in zip(lists, before):
        for t, o in zip(lst, old):
            assert torch.equal(t, o)


# ---------------------------------------------------------------- memory shared between a written tensor and another
def _opt_call(op, lists):
    """``op`` (by its short name) on ``lists`` with ordinary hyperparameters."""
    flag = _flag()
    if op == "scale":
        return amp_C.multi_tensor_scale(64, flag, lists, 2.0)
    if op == "axpby":
        return amp_C.multi_tensor_axpby(64, flag, lists, 2.0, 3.0, -1)
    if op == "adam":
        return amp_C.multi_tensor_adam(64, flag, lists, 0.1, 0.9, 0.999, 1e-8, 1, 0, 1, 0.0)
    if op == "sgd":
        return amp_C.multi_tensor_sgd(64, flag, lists, 0.0, 0.9, 0.0, 0.1, False, True, False)
    if op == "lamb":
        return amp_C.multi_tensor_lamb(64, flag, lists, 1e-3, 0.9, 0.999, 1e-6, 1, 1, 0.01, 1, 1, 1.0, 1.0)
    if op == "novograd":
        return amp_C.multi_tensor_novograd(64, flag, lists, torch.ones(len(lists[0])), 1e-3, 0.9, 0.9, 1e-8, 1, 1,
                                           0.0, 1, 0, 2)
    if op == "adagrad":
        return amp_C.multi_tensor_adagrad(64, flag, lists, 0.1, 1e-8, 0, 0.0)
    raise AssertionError(op)


#: per op: how many lists it takes, and which it writes
_WRITES = {"scale": (2, (1,)), "axpby": (3, (2,)), "adam": (4, (1, 2, 3)), "sgd": (4, (1, 2, 3)),
           "lamb": (4, (0, 1, 2, 3)), "novograd": (3, (1, 2)), "adagrad": (3, (1, 2))}


def _overlap_cases():
    for op, (depth, writes) in _WRITES.items():
        for w in writes:
            for o in range(depth):
                if o != w:
                    yield op, w, o


_ALIASES = {("scale", 1, 0), ("axpby", 2, 0), ("axpby", 2, 1)}


@pytest.mark.parametrize("op, w, o", list(_overlap_cases()))
@pytest.mark.parametrize("how", ["partly", "wholly"])
def test_a_written_tensor_sharing_memory_with_another_of_its_position_is_refused_before_any_write(op, w, o, how):
    """Found mid-call, such an overlap failed (or read half-written values) after position 0 was written. The same
    memory is allowed only where the op works in place (scale: out is in; axpby: out is x or y), and only as the
    same dtype."""
    depth, writes = _WRITES[op]
    gen = torch.Generator().manual_seed(1)
    lists = [[torch.rand(4, generator=gen) + 0.5, torch.rand(4, generator=gen) + 0.5] for _ in range(depth)]
    base = torch.rand(8, generator=gen).add_(0.5).to(torch.float16)
    if how == "partly":
        lists[w][1], lists[o][1] = base[:4], base[2:6]
    elif (op, w, o) in _ALIASES:
        lists[w][1], lists[o][1] = base[:4], base[:4].view(torch.bfloat16)  # the same bytes as another dtype
    else:
        lists[w][1] = lists[o][1] = base[:4]
    first, second = (o, w) if o in writes and o < w else (w, o)  # each pair of written lists is checked once
    before = [t.clone() for tl in lists for t in tl] + [base.clone()]
    with pytest.raises(ValueError, match=rf"multi_tensor_{op}: tensor_lists\[{first}\]\[1\], which the op writes, "
                                         rf"overlaps tensor_lists\[{second}\]\[1\] in memory; expected no shared "):
        _opt_call(op, lists)
    after = [t for tl in lists for t in tl] + [base]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("op, w, o", sorted(_ALIASES))
def test_in_place_positions_may_alias_exactly(op, w, o):
    depth, _ = _WRITES[op]
    lists = [[torch.full((4,), 2.0), torch.full((3,), 2.0)] for _ in range(depth)]
    lists[w][1] = lists[o][1][:]  # another tensor object over the same memory
    _opt_call(op, lists)
    assert torch.equal(lists[w][1], torch.full((3,), 4.0 if op == "scale" else 10.0))


def test_zero_element_tensors_overlap_nothing():
    x = torch.ones(4)
    src, dst = [torch.ones(2), x[:0]], [x[2:], x[1:1]]  # x[1:1] lies inside x, but holds no element
    amp_C.multi_tensor_scale(64, _flag(), [src, dst], 3.0)
    assert torch.equal(x, torch.tensor([1.0, 1.0, 3.0, 3.0]))


def test_the_earliest_overlapping_position_is_named_whatever_the_lists():
    base = torch.ones(16)
    g = [torch.ones(4) for _ in range(3)]
    p = [torch.ones(4), torch.ones(4), base[:4]]
    m = [torch.zeros(4), base[8:12], torch.zeros(4)]
    v = [torch.zeros(4), base[10:14], base[2:6]]  # position 1: m and v; position 2: p and v
    with pytest.raises(ValueError, match=r"tensor_lists\[2\]\[1\], which the op writes, overlaps "
                                         r"tensor_lists\[3\]\[1\]"):
        amp_C.multi_tensor_adam(64, _flag(), [g, p, m, v], 0.1, 0.9, 0.999, 1e-8, 1, 0, 1, 0.0)
    assert torch.equal(base, torch.ones(16)) and not any(t.any() for t in m[:1] + v[:1])


@pytest.mark.parametrize("plain", [True, False])
def test_overlaps_are_found_by_the_whole_list_test_and_by_the_loop_alike(plain, monkeypatch):
    if not plain:
        monkeypatch.setattr(amp_C, "_plain_lists", lambda lists: False)
    x = torch.arange(10.0)
    out0 = torch.zeros(3)
    with pytest.raises(ValueError, match=r"tensor_lists\[1\]\[1\], which the op writes, overlaps "
                                         r"tensor_lists\[0\]\[1\] in memory; expected no shared memory, or "
                                         r"exactly the same memory and dtype \(in place\)"):
        amp_C.multi_tensor_scale(64, _flag(), [[torch.ones(3), x[:5]], [out0, x[3:8]]], 2.0)
    assert torch.equal(x, torch.arange(10.0)) and not out0.any()


# ---------------------------------------------------------------- flags, meta tensors
@pytest.mark.parametrize("kind", ["sparse", "meta"])
def test_a_flag_that_cannot_record_an_overflow_is_refused(kind):
    flag = torch.zeros(1, dtype=torch.int)
    flag = flag.to_sparse() if kind == "sparse" else flag.to("meta")
    x = torch.tensor([float("inf"), 1.0])
    out = torch.zeros(2)
    error, match = ((TypeError, "noop_flag must be a dense one-element integer tensor, got layout torch.sparse_coo")
                    if kind == "sparse" else (ValueError, "noop_flag must hold a value .*got a meta tensor"))
    with pytest.raises(error, match="multi_tensor_scale: " + match):
        amp_C.multi_tensor_scale(64, flag, [[x], [out]], 1.0)
    with pytest.raises(error, match="multi_tensor_l2norm: " + match):
        amp_C.multi_tensor_l2norm(64, flag, [[x]], False)
    p, buf = torch.ones(2), torch.zeros(2)
    with pytest.raises(error, match="multi_tensor_sgd: " + match):
        amp_C.multi_tensor_sgd(64, flag, [[torch.ones(2)], [p], [buf]], 0.0, 0.9, 0.0, 0.1, False, True, False)
    assert not out.any() and torch.equal(p, torch.ones(2)) and not buf.any()
    # with empty lists too: the flag is checked whatever the tensors
    with pytest.raises(error, match="multi_tensor_l2norm: " + match):
        amp_C.multi_tensor_l2norm(64, flag, [[]], False)


def test_a_flag_on_another_device_than_the_tensors_is_refused(device):
    if device == "cpu":
        pytest.skip("needs a second device")
    for flag, xs in ((_flag("cpu"), [torch.ones(3, device=device)]), (_flag(device), [torch.ones(3)])):
        outs = [torch.zeros_like(x) for x in xs]
        with pytest.raises(ValueError, match="multi_tensor_scale: expected noop flag to be on the same device as "
                                             "tensors: noop_flag is on"):
            amp_C.multi_tensor_scale(64, flag, [xs, outs], 2.0)
        assert not outs[0].any()
    amp_C.multi_tensor_l2norm(64, _flag("cpu"), [[]], False)  # no tensors: any flag


@pytest.mark.parametrize("op", [*sorted(_WRITES), "l2norm"])
@pytest.mark.parametrize("plain", [True, False])
def test_meta_tensors_are_refused_before_anything_runs(op, plain, monkeypatch):
    if not plain:
        monkeypatch.setattr(amp_C, "_plain_lists", lambda lists: False)
    depth = _WRITES[op][0] if op in _WRITES else 1
    lists = [[torch.ones(3, device="meta")] for _ in range(depth)]
    assert not amp_C._plain_lists(lists)
    with pytest.raises(ValueError, match=rf"multi_tensor_{op}: tensor_lists\[0\]\[0\] must hold values, got a meta "
                                         "tensor"):
        if op == "l2norm":
            amp_C.multi_tensor_l2norm(64, _flag(), lists, True)
        else:
            _opt_call(op, lists)


@pytest.mark.parametrize("arg", ["current_scale", "growth_tracker", "hysteresis_tracker", "found_inf"])
@pytest.mark.parametrize("kind", ["sparse", "meta"])
def test_update_scale_hysteresis_refuses_a_state_without_element_writes_before_any_change(arg, kind):
    states = {"current_scale": torch.tensor([4.0]), "growth_tracker": torch.tensor([0], dtype=torch.int32),
              "hysteresis_tracker": torch.tensor([2], dtype=torch.int32), "found_inf": torch.tensor([0.0])}
    before = {k: v.clone() for k, v in states.items()}
    states[arg] = states[arg].to_sparse() if kind == "sparse" else states[arg].to("meta")
    error, match = ((TypeError, f"{arg} must be a dense one-element .* tensor, got layout torch.sparse_coo")
                    if kind == "sparse" else (ValueError, f"{arg} must hold a value, got a meta tensor"))
    with pytest.raises(error, match="update_scale_hysteresis: " + match):
        amp_C.update_scale_hysteresis(*states.values(), 2.0, 0.5, 1, 2)
    for k, v in states.items():
        if k != arg:
            assert torch.equal(v, before[k])


# ---------------------------------------------------------------- autograd's version counter
@pytest.mark.parametrize("op", sorted(_WRITES))
def test_every_written_tensor_gets_a_new_version(op):
    """apex_C writes through raw addresses: the ops tell autograd, as torch's in-place ops do."""
    depth, writes = _WRITES[op]
    lists = [[torch.rand(s) + 0.5 for s in [(3,), (2, 2), (0,)]] for _ in range(depth)]
    versions = [[t._version for t in tl] for tl in lists]
    _opt_call(op, lists)
    for li, tl in enumerate(lists):
        for t, v in zip(tl, versions[li]):
            if t.numel():  # (an empty tensor holds nothing to change)
                assert (t._version > v) == (li in writes), (li, t._version, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("form", ["in place", "into another tensor", "axpby"])
def test_a_tensor_saved_for_backward_then_written_makes_backward_raise(dtype, form):
    x = torch.ones(3, dtype=dtype, requires_grad=True)
    w = torch.ones(3, dtype=dtype)
    y = (x * w).sum()  # saves w
    if form == "in place":
        amp_C.multi_tensor_scale(64, _flag(), [[w], [w]], 2.0)
    elif form == "into another tensor":
        amp_C.multi_tensor_scale(64, _flag(), [[torch.ones(3, dtype=dtype)], [w]], 2.0)
    else:
        amp_C.multi_tensor_axpby(64, _flag(), [[torch.ones(3)], [torch.ones(3)], [w]], 1.0, 1.0, -1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
