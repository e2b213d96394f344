"""Per-module dumps of one training step into an HDF5 file, for comparing runs (NPU against GPU or CPU).

The Ascend patch's ``apex.dump.dump.HookerAndDumper`` interface and file layout: hooks on the model's direct
children; each hook call writes one group ``NNNN_<ModuleClass>`` (a counter shared by forward and backward calls,
four digits) with datasets ``feat_input``/``feat_output`` (forward) or ``grad_output``/``grad_input``
(backward); a tuple writes one dataset per element with its index appended (``feat_input0``), ``None`` an
empty float32 dataset of shape (0,). The file is ``<file_path><epoch>-epoch_<step>-step_dump.hdf5``.

Backward hooks are torch's module backward hooks of the kind the patch used (``register_backward_hook``): the
grads they see are those of the last autograd node of each module's forward, which is what files written by the
patch hold, so dumps from both compare name by name. ``full_backward=True`` uses
``register_full_backward_hook`` instead (grads with respect to the module's inputs and outputs, as torch
documents them; torch then refuses in-place ops on a hooked module's output, such as ``ReLU(inplace=True)``
after a hooked BatchNorm).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

__all__ = ["HookerAndDumper"]


def _h5py():
    try:
        import h5py
    except ImportError as err:
        raise ImportError(f"apex.dump writes HDF5 files through h5py, which is not installed ({err}); "
                          "install it with `pip install h5py`") from err
    return h5py


def _as_array(tensor: torch.Tensor) -> Tuple[Any, Dict[str, str]]:
    """The tensor's values as a numpy array, with attributes saying what was changed to get them there.

    numpy has no bfloat16: those are stored as float32 (every bf16 value is exact in float32) with the attribute
    ``torch_dtype``. Tensors without host-readable values (meta, ...) give an empty float32 dataset with the
    attribute ``unavailable``."""
    import numpy as np

    attrs: Dict[str, str] = {}
    t = tensor.detach()
    try:
        if t.layout != torch.strided:
            attrs["torch_layout"] = str(t.layout)
            t = t.to_dense()
        if t.dtype == torch.bfloat16:
            attrs["torch_dtype"] = str(t.dtype)
            t = t.float()
        t = t.cpu().resolve_conj().resolve_neg()
        return t.numpy(), attrs
    except (RuntimeError, TypeError, NotImplementedError) as err:
        return np.zeros((0,), dtype=np.float32), {"unavailable": f"{type(tensor).__name__} {tuple(tensor.shape)} "
                                                               f"{tensor.dtype} on {tensor.device}: {err}"}


def _entries(name: str, value: Any, nested: bool = False) -> List[Tuple[str, Any]]:
    """(dataset name, value) pairs for one hook argument: a tensor or None as it is, a tuple or list one entry
    per element with its index appended (``feat_input0``; a nested one's joined by "_": ``feat_output1_0``), a
    Python number as a 0-d array. Other objects (strings, dicts, custom classes) are not written."""
    if value is None or isinstance(value, torch.Tensor):
        return [(name, value)]
    if isinstance(value, (tuple, list)):
        out: List[Tuple[str, Any]] = []
        for i, item in enumerate(value):
            out += _entries(f"{name}_{i}" if nested else f"{name}{i}", item, nested=True)
        return out
    if isinstance(value, (bool, int, float, complex)):
        return [(name, value)]
    return []


class HookerAndDumper:
    """Dump the forward inputs/outputs and backward grads of a model's direct children for one step.

    ``file_path`` is the prefix of the file name (end it with "/" for a directory, as the patch's documentation
    says; an existing directory is used as one with or without the "/"). ``is_screen_display`` prints what is
    registered and written. Register right before the step to dump, remove right after it::

        dumper = HookerAndDumper(file_path="dumps/")
        dumper.register_hooks(model, epoch=0, step=3)
        loss = model(x).sum(); loss.backward()
        dumper.remove_hooks()
        dumper.read_h5py_data()          # prints the groups and datasets
    """

    def __init__(self, file_path: Union[str, os.PathLike] = "", is_screen_display: bool = False,
                 full_backward: bool = False) -> None:
        if not isinstance(file_path, (str, os.PathLike)):
            raise TypeError(f"HookerAndDumper: file_path must be a str or os.PathLike, got "
                            f"{type(file_path).__name__}")
        for name, value in (("is_screen_display", is_screen_display), ("full_backward", full_backward)):
            if not isinstance(value, bool):
                raise TypeError(f"HookerAndDumper: {name} must be True or False, got {value!r}")
        self.base_path = os.fspath(file_path)
        self.file_path = self.base_path  # the file of the latest register_hooks (upstream's attribute)
        self.is_screen_display = is_screen_display
        self.full_backward = full_backward
        self.handles: List[Any] = []
        self.model: Optional[torch.nn.Module] = None
        self.count = 0  # groups written to the current file

    # ------------------------------------------------------------ output
    def _say(self, *parts: Any) -> None:
        if self.is_screen_display:
            print(*parts, file=sys.stdout)

    def _target(self, epoch: Any, step: Any) -> str:
        name = f"{epoch}-epoch_{step}-step_dump.hdf5"
        if self.base_path and os.path.isdir(self.base_path):
            return os.path.join(self.base_path, name)
        return self.base_path + name

    def _write(self, module: torch.nn.Module, arguments: Tuple[Tuple[str, Any], ...]) -> None:
        h5py = _h5py()
        group_name = f"{self.count:04d}_{module._get_name()}"
        self.count += 1
        with h5py.File(self.file_path, "a") as f:
            group = f.create_group(group_name)
            for base, value in arguments:
                for name, item in _entries(base, value):
                    if item is None:
                        group.create_dataset(name, shape=(0,), dtype="f4")
                        self._say(f"{group_name}/{name}: None")
                        continue
                    if isinstance(item, torch.Tensor):
                        data, attrs = _as_array(item)
                    else:
                        data, attrs = item, {}
                    dataset = group.create_dataset(name, data=data)
                    for key, text in attrs.items():
                        dataset.attrs[key] = text
                    self._say(f"{group_name}/{name}: shape {tuple(dataset.shape)}, {dataset.dtype}")

    # ------------------------------------------------------------ hooks (upstream's names)
    def forward_hook_fn(self, module: torch.nn.Module, feat_input: Any, feat_output: Any) -> None:
        self._write(module, (("feat_input", feat_input), ("feat_output", feat_output)))

    def backward_hook_fn(self, module: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
        self._write(module, (("grad_output", grad_output), ("grad_input", grad_input)))

    def register_hooks(self, model: torch.nn.Module, epoch: Any = 0, step: Any = 0) -> List[Any]:
        """Start a new dump file for (epoch, step) and hook every direct child of ``model``.

        Hooks of an earlier ``register_hooks`` on this dumper are removed first (one file at a time). Returns the
        handles. Nothing is registered and no file is made when an argument is wrong or a child refuses a hook."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"HookerAndDumper.register_hooks: model must be a torch.nn.Module, got "
                            f"{type(model).__name__}")
        for name, value in (("epoch", epoch), ("step", step)):
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise TypeError(f"HookerAndDumper.register_hooks: {name} must be an int or a str (it names the "
                                f"file), got {value!r}")
        h5py = _h5py()
        target = self._target(epoch, step)
        handles: List[Any] = []
        try:
            for name, child in model.named_children():
                handles.append(child.register_forward_hook(self.forward_hook_fn))
                if self.full_backward:
                    handles.append(child.register_full_backward_hook(self.backward_hook_fn))
                else:
                    handles.append(child.register_backward_hook(self.backward_hook_fn))
                self._say(f"hooked child {name}: {child._get_name()}")
        except Exception:
            for handle in handles:
                handle.remove()
            raise
        try:
            with h5py.File(target, "w"):
                pass
        except Exception:
            for handle in handles:
                handle.remove()
            raise
        self.remove_hooks(quiet=True)
        self.handles, self.model, self.file_path, self.count = handles, model, target, 0
        self._say(f"writing {target}")
        return list(handles)

    def remove_hooks(self, quiet: bool = False) -> str:
        """Remove every hook this dumper registered; returns the path of the file written."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if not quiet:
            self._say(f"hooks removed; dump written to {self.file_path}")
        return self.file_path

    def read_h5py_data(self) -> Dict[str, Optional[Tuple[str, Tuple[int, ...]]]]:
        """Print the file's groups and datasets (dtype and shape), and return them: name -> (dtype, shape) for a
        dataset, None for a group."""
        h5py = _h5py()
        if not os.path.isfile(self.file_path):
            raise FileNotFoundError(f"HookerAndDumper.read_h5py_data: no dump file at {self.file_path!r} (call "
                                    "register_hooks first)")
        found: Dict[str, Optional[Tuple[str, Tuple[int, ...]]]] = {}
        with h5py.File(self.file_path, "r") as f:
            def visit(name: str, obj: Any) -> None:
                if isinstance(obj, h5py.Dataset):
                    found[name] = (str(obj.dtype), tuple(obj.shape))
                    print(f"{name}  {obj.dtype}  {tuple(obj.shape)}")
                else:
                    found[name] = None
                    print(name)

            f.visititems(visit)
        return found
