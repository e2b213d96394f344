"""Loss scaler dynamics, amp.state_dict format, and checkpoint/restore mid-run."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from _amp_harness import bn_mlp

from apex import amp
from apex.amp import LossScaler

pytestmark = pytest.mark.usefixtures("amp_env")

INIT = 2.0**16


def net():
    torch.manual_seed(3)
    return bn_mlp(4, 8, 2)


def train_step(m, o, x, overflow=False, loss_id=0):
    o.zero_grad()
    loss = (m(x).float() - 1).pow(2).mean()
    with amp.scale_loss(loss, o, loss_id=loss_id) as scaled:
        scaled.backward()
        if overflow:
            with torch.no_grad():
                m[0].weight.grad.view(-1)[0] = float("nan")
    o.step()


# ---------------------------------------------------------------- LossScaler itself


def test_scaler_backoff_growth_bounds():
    s = LossScaler("dynamic", init_scale=2.0**20, max_loss_scale=2.0**18, scale_window=3, min_loss_scale=2.0**15)
    assert s.loss_scale() == 2.0**18  # init = min(max, init)
    for k in range(1, 4):
        s.clear_overflow_state()
        s.record_overflow(True)
        assert s.update_scale() is True
        assert (s.loss_scale(), s._unskipped) == (max(2.0**18 / 2**k, 2.0**15), 0)
    for _ in range(2):
        s.clear_overflow_state()
        assert s.update_scale() is False
    assert (s.loss_scale(), s._unskipped) == (2.0**15, 2)
    s.update_scale()
    assert (s.loss_scale(), s._unskipped) == (2.0**16, 0)  # grew after scale_window clean steps
    for _ in range(9):
        s.update_scale()
    assert s.loss_scale() == 2.0**18  # capped at max


def test_dynamic_backoff_without_a_floor_stops_at_the_smallest_normal_float32():
    """Overflow after overflow (inf loss every step) without min_loss_scale: the scale halves down to 2**-126 and
    stays there (halving on would reach 0, whose reciprocal the unscale cannot take), each step skipped."""
    s = LossScaler("dynamic", init_scale=2.0**-120)
    for _ in range(20):
        s.clear_overflow_state()
        s.record_overflow(True)
        assert s.update_scale() is True
    assert s.loss_scale() == 2.0**-126
    # a scale whose inverse is not a normal float32 (a subnormal one, say) would unscale every grad to inf or 0
    # unnoticed: a checkpoint holding one is refused, and the scaler keeps its state
    for bad in (1e-320, 2.0**-127, 2.0**127):
        with pytest.raises(ValueError, match=r"loss_scale'\] must be in \[2\*\*-126, 2\*\*126\]"):
            s.load(bad, 0)
        assert s.loss_scale() == 2.0**-126


def test_scaler_custom_factors():
    s = LossScaler("dynamic", init_scale=64.0, scale_factor=4.0, backoff_factor=0.25, scale_window=1)
    s.record_overflow(True)
    s.update_scale()
    assert s.loss_scale() == 16.0
    s.clear_overflow_state()
    s.update_scale()
    assert s.loss_scale() == 64.0


def test_static_scaler_never_skips():
    s = LossScaler(128.0)
    s.record_overflow(True)
    assert s.update_scale() is False and s.loss_scale() == 128.0


def test_overflow_buf_is_made_on_first_access_and_read_by_update_scale():
    s = LossScaler("dynamic", init_scale=2.0**10, scale_window=2)
    assert s._overflow_flag is None  # amp's own unscale does not need it: no tensor, no host sync
    assert s.update_scale() is False and s._unskipped == 1
    own = s._overflow_buf
    assert own.dtype == torch.int32 and own.shape == (1,) and own.item() == 0 and s._overflow_buf is own
    flag = torch.tensor([3], dtype=torch.int32)  # what amp_C.multi_tensor_scale leaves after an inf/nan
    s._overflow_buf = flag
    assert s.update_scale() is True and s.loss_scale() == 2.0**9 and s._unskipped == 0
    s.clear_overflow_state()
    assert flag.item() == 0 and not s.has_overflow()  # cleared as upstream's
    assert s.update_scale() is False and s.update_scale() is False and s.loss_scale() == 2.0**10  # grew


def test_overflow_buf_is_ignored_by_a_static_scaler_and_checked_on_assignment():
    s = LossScaler(128.0)
    s._overflow_buf = torch.ones(1, dtype=torch.int32)
    assert s.update_scale() is False and s.loss_scale() == 128.0 and not s.has_overflow()
    flag = s._overflow_buf
    for bad in (None, 1, torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.complex64)):
        with pytest.raises(TypeError, match=r"_overflow_buf must be a one-element real tensor"):
            s._overflow_buf = bad
        assert s._overflow_buf is flag  # unchanged


# ---------------------------------------------------------------- through amp


def test_forced_overflows_back_off_and_skip(caplog):
    m = net()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    amp.initialize(m, o, opt_level="O1", verbosity=1)
    x = torch.randn(8, 4)
    w0 = m[0].weight.detach().clone()
    with caplog.at_level("INFO", logger="apex.amp"):
        for k in range(1, 4):
            train_step(m, o, x, overflow=True)
            assert amp.state_dict() == {"loss_scaler0": {"loss_scale": INIT / 2**k, "unskipped": 0}}
    assert torch.equal(m[0].weight, w0)  # every step skipped
    msgs = [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()]
    assert msgs == [f"Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to {INIT / 2**k}"
                    for k in range(1, 4)]
    train_step(m, o, x)
    assert not torch.equal(m[0].weight, w0)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": INIT / 8, "unskipped": 1}


@pytest.mark.parametrize("combine", [False, True])
def test_growth_after_window_and_limits(combine):
    m = net()
    o = torch.optim.SGD(m.parameters(), lr=0.01)
    amp.initialize(m, o, opt_level="O1", scale_window=2, max_loss_scale=2.0**17, min_loss_scale=2.0**15,
                   combine_grad=combine or None, verbosity=0)
    x = torch.randn(8, 4)
    expected = [2.0**16, 2.0**17, 2.0**17, 2.0**17]  # grows after 2 clean steps, capped at max
    for k in range(4):
        train_step(m, o, x)
        assert amp.state_dict()["loss_scaler0"]["loss_scale"] == expected[k]
    for _ in range(4):
        train_step(m, o, x, overflow=True)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 0}


def test_static_loss_scale_never_skips(caplog):
    m = net()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    amp.initialize(m, o, opt_level="O1", loss_scale=128.0, verbosity=1)
    with caplog.at_level("INFO", logger="apex.amp"):
        train_step(m, o, torch.randn(8, 4), overflow=True)
    assert torch.isnan(m[0].weight).any()  # the step ran with the nan
    assert "Gradient overflow" not in caplog.text
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 128.0


def test_delay_overflow_check_leaves_scale():
    m = net()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    amp.initialize(m, o, opt_level="O1", verbosity=0)
    loss = m(torch.randn(8, 4)).float().sum()
    with amp.scale_loss(loss, o, delay_overflow_check=True) as scaled:
        scaled.backward()
        m[0].weight.grad.view(-1)[0] = float("inf")
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": INIT, "unskipped": 0}
    assert "step" in o.__dict__ and o._amp_stash.skip_pending is None


def _post_accumulation_allreduce(o, inject_inf=False):
    """Scripts' own post-accumulation all-reduce (BERT pretraining): the unscaled master grads are rescaled into
    views of one flat buffer, the buffer is all-reduced, scaled back with an overflow flag, and the scaler reads
    that flag through its swapped-in ``_overflow_buf``. Returns update_scale()'s answer."""
    import amp_C
    import apex_C
    import torch.distributed as dist

    from apex.amp import _amp_state

    scaler = _amp_state.loss_scalers[0]
    loss_scale = scaler.loss_scale()
    grads = [p.grad for p in amp.master_params(o) if p.grad is not None]
    flat = torch.empty(sum(g.numel() for g in grads), dtype=torch.float32)
    views = apex_C.unflatten(flat, grads)
    flag = torch.zeros(1, dtype=torch.int32)
    amp_C.multi_tensor_scale(65536, flag, [grads, views], loss_scale / dist.get_world_size())
    dist.all_reduce(flat)
    if inject_inf:
        flat[3] = float("inf")  # as if another rank had overflowed
    flag.zero_()
    amp_C.multi_tensor_scale(65536, flag, [views, grads], 1.0 / loss_scale)
    old = scaler._overflow_buf
    scaler._overflow_buf = flag
    had_overflow = scaler.update_scale()
    scaler._overflow_buf = old
    return had_overflow


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_scripts_own_allreduce_through_unflatten_and_overflow_buf(tmp_path, level):
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    from apex.optimizers import FusedLAMB

    m = net()
    o = FusedLAMB(m.parameters(), lr=0.01)
    amp.initialize(m, o, opt_level=level, loss_scale="dynamic", verbosity=0)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        x = torch.randn(8, 4)
        for inject in (False, True, False):
            o.zero_grad()
            loss = (m(x).float() - 1).pow(2).mean()
            with amp.scale_loss(loss, o, delay_overflow_check=True) as scaled:
                scaled.backward()
            expect = [p.grad.clone() for p in amp.master_params(o)]  # unscaled at the exit
            scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
            had_overflow = _post_accumulation_allreduce(o, inject_inf=inject)
            assert had_overflow is inject
            assert amp.state_dict()["loss_scaler0"]["loss_scale"] == (scale / 2 if inject else scale)
            if not inject:  # one rank, power-of-two scales: the round trip is exact
                for g, e in zip((p.grad for p in amp.master_params(o)), expect):
                    torch.testing.assert_close(g, e, rtol=0, atol=0)
                w0 = [p.detach().clone() for p in amp.master_params(o)]
                o.step()
                assert any(not torch.equal(p, w) for p, w in zip(amp.master_params(o), w0))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- amp.state_dict / load_state_dict


def test_state_dict_format_and_load():
    m = net()
    amp.initialize(m, opt_level="O1", num_losses=3, verbosity=0)
    sd = amp.state_dict()
    assert list(sd) == ["loss_scaler0", "loss_scaler1", "loss_scaler2"]
    assert all(v == {"loss_scale": INIT, "unskipped": 0} for v in sd.values())
    assert isinstance(sd["loss_scaler0"]["loss_scale"], float)
    new = {f"loss_scaler{i}": {"loss_scale": 2.0**i, "unskipped": i} for i in range(3)}
    amp.load_state_dict(new)
    assert amp.state_dict() == new


@pytest.mark.parametrize("bad,exc,match", [
    ({"scaler0": {"loss_scale": 1.0, "unskipped": 0}}, RuntimeError, "Unexpected key"),
    ({"loss_scaler0": {"loss_scale": 1.0}}, TypeError, "must be a dict with 'loss_scale' and 'unskipped'"),
    ({"loss_scaler0": {"loss_scale": -1.0, "unskipped": 0}}, ValueError, "must be a finite positive number"),
    ({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0.5}}, TypeError, "must be an int"),
])
def test_load_state_dict_errors_change_nothing(bad, exc, match):
    amp.initialize(net(), opt_level="O1", num_losses=2, verbosity=0)
    before = amp.state_dict()
    good = {"loss_scaler1": {"loss_scale": 8.0, "unskipped": 1}}
    with pytest.raises(exc, match=match):
        amp.load_state_dict({**good, **bad})
    assert amp.state_dict() == before
    with pytest.raises(TypeError, match="expected a dict"):
        amp.load_state_dict([("loss_scaler0", {})])


def test_load_state_dict_count_mismatch(caplog):
    amp.initialize(net(), opt_level="O1", num_losses=1, verbosity=0)
    with caplog.at_level("WARNING", logger="apex.amp"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 2},
                             "loss_scaler1": {"loss_scale": 8.0, "unskipped": 3}})
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 4.0, "unskipped": 2}}
    assert "skipping loss_scaler1" in caplog.text and "contains 2 entries, while 1 loss_scalers" in caplog.text


# ---------------------------------------------------------------- checkpoint mid-run


def _save(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _make_opt(model, kind):
    if kind == "apex_adam":
        from apex.optimizers import NpuFusedAdam

        return NpuFusedAdam(model.parameters(), lr=0.01)
    return torch.optim.Adam(model.parameters(), lr=0.01)


CKPT_CASES = [("O1", {}, "adam"), ("O1", {"combine_grad": True}, "adam"), ("O2", {}, "adam"),
              ("O2", {"combine_grad": True}, "adam"), ("O1", {"combine_grad": True}, "apex_adam"),
              ("O2", {"combine_grad": True}, "apex_adam")]


@pytest.mark.parametrize("level,kw,kind", CKPT_CASES, ids=str)
def test_checkpoint_restore_is_identical(level, kw, kind):
    if kind == "apex_adam":
        pytest.importorskip("apex.optimizers")
    steps, at = 7, 4
    data = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(steps)]
    overflow_at = {2}
    opts = dict(opt_level=level, scale_window=2, verbosity=0, **kw)

    m = net()
    o = _make_opt(m, kind)
    amp.initialize(m, o, **opts)
    ckpt = None
    for i in range(steps):
        if i == at:
            ckpt = _save({"model": m.state_dict(), "optimizer": o.state_dict(), "amp": amp.state_dict()})
        train_step(m, o, data[i], overflow=i in overflow_at)
    final = copy.deepcopy(m.state_dict())
    final_amp = amp.state_dict()
    assert ckpt["amp"]["loss_scaler0"] != {"loss_scale": INIT, "unskipped": 0}
    amp.deinitialize()

    torch.manual_seed(123)  # a differently initialised model: everything must come from the checkpoint
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    o2 = _make_opt(m2, kind)
    amp.initialize(m2, o2, **opts)
    m2.load_state_dict(ckpt["model"])
    o2.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"])
    for i in range(at, steps):
        train_step(m2, o2, data[i], overflow=i in overflow_at)
    assert amp.state_dict() == final_amp
    for name, value in m2.state_dict().items():
        torch.testing.assert_close(value, final[name], rtol=0, atol=0, msg=lambda s, n=name: f"{n}: {s}")


def test_o2_masters_follow_model_loaded_after_initialize():
    """Upstream order (initialize, then load the model only): masters are taken from the loaded weights."""
    src = net()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.0)
    m = net()
    o = torch.optim.SGD(m.parameters(), lr=0.0)
    amp.initialize(m, o, opt_level="O2", verbosity=0)
    sd = {k: v.to(torch.bfloat16) if k.startswith(("0.", "3.")) else v for k, v in src.state_dict().items()}
    m.load_state_dict(sd)
    train_step(m, o, torch.randn(8, 4))  # lr 0: the step writes the masters back into the model
    for name, value in m.named_parameters():
        torch.testing.assert_close(value, sd[name], rtol=0, atol=0)
