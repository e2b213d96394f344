"""apex.dump: per-module forward/backward dumps into HDF5, in the Ascend patch's layout.

Values are compared bitwise with what torch's own hooks of the same kind see on the same step.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

h5py = pytest.importorskip("h5py")

import apex  # noqa: E402
import apex.dump.dump as dump  # noqa: E402  (the patch's spelling)
from apex.dump import HookerAndDumper  # noqa: E402

# torch's own notes about the two kinds of module backward hooks, which these tests use on purpose
pytestmark = pytest.mark.filterwarnings("ignore:Using a non-full backward hook:FutureWarning",
                                        "ignore:Full backward hook is firing:UserWarning")


def _net(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(inplace=True),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2)).to(dtype)


def _recorded_step(model, x, full=False):
    """One forward/backward with recording hooks of the same kind as the dumper's: what each call saw."""
    calls, handles = [], []
    for _, child in model.named_children():
        handles.append(child.register_forward_hook(
            lambda m, i, o: calls.append((m._get_name(), "f", [t.detach().clone() for t in i], o.detach().clone()))))
        register = child.register_full_backward_hook if full else child.register_backward_hook
        handles.append(register(lambda m, gi, go: calls.append(
            (m._get_name(), "b", [None if g is None else g.clone() for g in gi], [g.clone() for g in go]))))
    model(x).float().sum().backward()
    for h in handles:
        h.remove()
    return calls


def _read(path):
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, (obj[()], dict(obj.attrs)))
                     if isinstance(obj, h5py.Dataset) else None)
    return out


def _check_against(data, calls):
    for index, (cls, kind, inputs, outputs) in enumerate(calls):
        group = f"{index:04d}_{cls}"
        if kind == "f":
            for i, t in enumerate(inputs):
                assert torch.equal(torch.from_numpy(data[f"{group}/feat_input{i}"][0]), t.float())
            assert torch.equal(torch.from_numpy(data[f"{group}/feat_output"][0]), outputs.float())
        else:
            for i, g in enumerate(outputs):
                assert torch.equal(torch.from_numpy(data[f"{group}/grad_output{i}"][0]), g.float())
            for i, g in enumerate(inputs):
                stored = data[f"{group}/grad_input{i}"][0]
                if g is None:
                    assert stored.shape == (0,) and stored.dtype.name == "float32"
                else:
                    assert torch.equal(torch.from_numpy(stored), g.float())


@pytest.mark.parametrize("full", [False, True], ids=["patch-hooks", "full-backward"])
def test_dump_holds_what_the_hooks_see(tmp_path, full):
    x = torch.randn(2, 3, 8, 8)
    if full:  # torch refuses in-place ops on a hooked module's output with full backward hooks
        model = torch.nn.Sequential(*[torch.nn.ReLU() if isinstance(m, torch.nn.ReLU) else m for m in _net()])
    else:
        model = _net()
    expected = _recorded_step(model, x, full=full)
    model.zero_grad()
    dumper = HookerAndDumper(file_path=str(tmp_path) + "/", full_backward=full)
    dumper.register_hooks(model, epoch=0, step=3)
    model(x).float().sum().backward()
    path = dumper.remove_hooks()
    assert path == str(tmp_path / "0-epoch_3-step_dump.hdf5")
    data = _read(path)
    groups = sorted({name.split("/")[0] for name in data})
    assert groups[:5] == ["0000_Conv2d", "0001_BatchNorm2d", "0002_ReLU", "0003_Flatten", "0004_Linear"]
    assert groups[5] == "0005_Linear" and groups[-1] == "0009_Conv2d"  # backward runs in reverse
    _check_against(data, expected)
    # the Conv's input needs no grad: an empty float32 dataset, as the patch writes for None
    assert data["0009_Conv2d/grad_input0"][0].shape == (0,)


def test_bf16_is_stored_as_float32_with_its_dtype_noted(tmp_path):
    model = _net(torch.bfloat16)
    x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16)
    expected = _recorded_step(model, x)
    model.zero_grad()
    dumper = HookerAndDumper(file_path=tmp_path)
    dumper.register_hooks(model, epoch=1, step=0)
    model(x).float().sum().backward()
    data = _read(dumper.remove_hooks())
    assert os.path.basename(dumper.file_path) == "1-epoch_0-step_dump.hdf5"  # an existing dir without "/"
    values, attrs = data["0000_Conv2d/feat_output"]
    assert values.dtype.name == "float32" and attrs["torch_dtype"] == "torch.bfloat16"
    _check_against(data, expected)


def test_file_name_is_the_prefix_then_epoch_and_step(tmp_path):
    prefix = str(tmp_path / "run_a_")
    dumper = HookerAndDumper(prefix)
    dumper.register_hooks(torch.nn.Sequential(torch.nn.Linear(2, 2)), epoch="e2", step=7)
    assert dumper.file_path == prefix + "e2-epoch_7-step_dump.hdf5" and os.path.isfile(dumper.file_path)


def test_tuple_outputs_get_indexed_names(tmp_path):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(4, 3, batch_first=True)

        def forward(self, x):
            out, _ = self.lstm(x)
            return out

    dumper = HookerAndDumper(str(tmp_path) + "/")
    model = Net()
    dumper.register_hooks(model, 0, 0)
    with torch.no_grad():
        model(torch.randn(2, 5, 4))
    data = _read(dumper.remove_hooks())
    assert sorted(data) == ["0000_LSTM/feat_input0", "0000_LSTM/feat_output0", "0000_LSTM/feat_output1_0",
                            "0000_LSTM/feat_output1_1"]
    assert data["0000_LSTM/feat_output1_0"][0].shape == (1, 2, 3)


def test_register_again_moves_to_a_new_file_and_remove_stops_writing(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    dumper = HookerAndDumper(str(tmp_path) + "/")
    dumper.register_hooks(model, 0, 0)
    model(torch.randn(1, 3))
    first = dumper.file_path
    dumper.register_hooks(model, 0, 1)
    assert len(model[0]._forward_hooks) == 1  # the first registration's hooks are gone
    model(torch.randn(1, 3))
    second = dumper.remove_hooks()
    model(torch.randn(1, 3))
    assert not model[0]._forward_hooks and not model[0]._backward_hooks
    assert sorted(_read(first)) == ["0000_Linear/feat_input0", "0000_Linear/feat_output"]
    assert sorted(_read(second)) == ["0000_Linear/feat_input0", "0000_Linear/feat_output"]


def test_read_h5py_data_prints_and_returns_the_layout(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    dumper = HookerAndDumper(str(tmp_path) + "/")
    with pytest.raises(FileNotFoundError, match="register_hooks first"):
        dumper.read_h5py_data()
    dumper.register_hooks(model, 0, 0)
    model(torch.randn(4, 3))
    dumper.remove_hooks()
    layout = dumper.read_h5py_data()
    assert layout == {"0000_Linear": None, "0000_Linear/feat_input0": ("float32", (4, 3)),
                      "0000_Linear/feat_output": ("float32", (4, 2))}
    assert "0000_Linear/feat_output  float32  (4, 2)" in capsys.readouterr().out


def test_screen_display_is_opt_in(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    quiet = HookerAndDumper(str(tmp_path) + "/q_")
    quiet.register_hooks(model, 0, 0)
    model(torch.randn(1, 3))
    quiet.remove_hooks()
    assert capsys.readouterr().out == ""
    loud = HookerAndDumper(str(tmp_path) + "/l_", is_screen_display=True)
    loud.register_hooks(model, 0, 0)
    model(torch.randn(1, 3))
    loud.remove_hooks()
    out = capsys.readouterr().out
    assert "hooked child 0: Linear" in out and "0000_Linear/feat_output: shape (1, 2)" in out


@pytest.mark.parametrize("kwargs, match", [
    (dict(file_path=3), "file_path must be a str"),
    (dict(is_screen_display="yes"), "is_screen_display must be True or False"),
    (dict(full_backward=1), "full_backward must be True or False"),
])
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(TypeError, match=match):
        HookerAndDumper(**kwargs)


@pytest.mark.parametrize("args, match", [
    (("not a module", 0, 0), "model must be a torch.nn.Module"),
    ((None, 0, 0), "model must be a torch.nn.Module"),
    ((torch.nn.Sequential(torch.nn.Linear(2, 2)), 0.5, 0), "epoch must be an int or a str"),
    ((torch.nn.Sequential(torch.nn.Linear(2, 2)), 0, True), "step must be an int or a str"),
])
def test_bad_register_arguments_change_nothing(tmp_path, args, match):
    dumper = HookerAndDumper(str(tmp_path) + "/")
    with pytest.raises(TypeError, match=match):
        dumper.register_hooks(*args)
    assert os.listdir(tmp_path) == [] and dumper.handles == []
    if isinstance(args[0], torch.nn.Module):
        assert not args[0][0]._forward_hooks


def test_a_child_that_refuses_a_hook_leaves_no_hook_and_no_file(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[1].register_full_backward_hook(lambda m, gi, go: None)  # torch allows one kind per module
    dumper = HookerAndDumper(str(tmp_path) + "/")
    with pytest.raises(RuntimeError):
        dumper.register_hooks(model, 0, 0)
    assert not model[0]._forward_hooks and not model[0]._backward_hooks and not model[1]._forward_hooks
    assert os.listdir(tmp_path) == []


def test_missing_h5py_is_named_at_register(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "h5py", None)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    dumper = HookerAndDumper(str(tmp_path) + "/")
    with pytest.raises(ImportError, match="pip install h5py"):
        dumper.register_hooks(model, 0, 0)
    assert not model[0]._forward_hooks and os.listdir(tmp_path) == []


def test_module_spellings():
    assert dump.HookerAndDumper is HookerAndDumper is apex.dump.HookerAndDumper
    assert "dump" in dir(apex)
