"""Stand-in for ``torch_npu``, backed by the emulated npu device (tests only; never the real package).

It provides the parts of torch_npu that ``apex._device`` uses, each computing a real answer on the emulator:

* ``torch_npu.npu`` is ``torch.npu`` (the emulator's device module), with ``torch_npu.npu.utils``:
  ``is_support_inf_nan()`` (False in the emulator's saturation mode), ``get_npu_overflow_flag()`` /
  ``clear_npu_overflow_flag()`` over the emulator's float-status flag, which every operator raises when it
  produces inf/nan in a floating result;
* storage formats: ``get_npu_format(t)`` reports ND (2) for every npu tensor unless ``npu_format_cast`` gave it
  another (the emulator keeps the bytes strided; only the reported code changes, enough to drive apex's delegation
  of private formats to torch_npu);
* ``torch_npu.utils.npu_combine_tensors(tensors, require_copy_value=True)`` and ``is_combined_tensor_valid``: the
  native combine, done for real on the emulated device (one zero-initialised buffer, tensors rebound as views).

Importing it loads the emulator, as importing the real package loads its backend.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import torch
import torch.utils.weak

_EMULATOR_DIR = Path(__file__).resolve().parents[2]


def _emulator():
    mod = sys.modules.get("npu_emulator")
    if mod is None:
        spec = importlib.util.spec_from_file_location(
            "npu_emulator", _EMULATOR_DIR / "__init__.py", submodule_search_locations=[str(_EMULATOR_DIR)]
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["npu_emulator"] = mod
        spec.loader.exec_module(mod)
    return mod


_emu = _emulator()
_emu.load()

__version__ = "0.0+emulated"
ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29

npu = torch.npu

# -------------------------------------------------------------------------------------------- overflow flag


def is_support_inf_nan() -> bool:
    """INF_NAN mode (True) unless the emulator runs in saturation mode (older chips)."""
    return not _emu.saturation_mode()


def get_npu_overflow_flag() -> bool:
    return _emu.get_overflow_flag()


def clear_npu_overflow_flag() -> None:
    _emu.clear_overflow_flag()


# -------------------------------------------------------------------------------------------- storage formats

_formats = torch.utils.weak.WeakIdKeyDictionary()  # tensor -> format code; by identity (tensors compare elementwise)


def _check_npu(tensor, where: str) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "npu":
        got = tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise RuntimeError(f"{where}: expected an npu tensor, got {got}")


def get_npu_format(tensor: torch.Tensor) -> int:
    _check_npu(tensor, "get_npu_format")
    return _formats.get(tensor, ACL_FORMAT_ND)


def npu_format_cast(tensor: torch.Tensor, acl_format: int) -> torch.Tensor:
    """A copy of ``tensor`` reported in storage format ``acl_format`` (its bytes stay strided here)."""
    _check_npu(tensor, "npu_format_cast")
    out = tensor.clone()
    _formats[out] = int(acl_format)
    return out


def get_storage_size(tensor: torch.Tensor) -> int:
    """Elements of the whole storage behind ``tensor`` (torch_npu sizes the storage, not the view)."""
    _check_npu(tensor, "get_storage_size")
    return tensor.untyped_storage().nbytes() // tensor.element_size()


# -------------------------------------------------------------------------------------------- native combine


def npu_combine_tensors(tensors, require_copy_value: bool = True) -> torch.Tensor | None:
    """Rebind ``tensors`` (one dtype, one npu device) as consecutive views of one zero-initialised buffer."""
    tensors = list(tensors)
    if not tensors:
        return None
    for t in tensors:
        _check_npu(t, "npu_combine_tensors")
    first = tensors[0]
    if any(t.dtype != first.dtype or t.device != first.device for t in tensors):
        raise RuntimeError("npu_combine_tensors: every tensor must have the dtype and device of the first")
    total = sum(t.numel() for t in tensors)
    with torch.no_grad():
        combined = torch.zeros(total, dtype=first.dtype, device=first.device)
        offset = 0
        for t in tensors:
            n = t.numel()
            view = combined[offset:offset + n].view(t.shape)
            if require_copy_value:
                view.copy_(t.detach())
            fmt = _formats.get(t)
            t.data = view
            if fmt is not None:
                _formats[t] = fmt
            offset += n
    return combined


def is_combined_tensor_valid(combined, tensors) -> bool:
    """Whether every tensor's data lies inside ``combined``'s memory."""
    if combined is None:
        return False
    lo = combined.data_ptr()
    hi = lo + combined.numel() * combined.element_size()
    for t in tensors:
        start = t.data_ptr()
        if t.numel() and not (lo <= start and start + t.numel() * t.element_size() <= hi):
            return False
    return True


# torch_npu's layout: torch_npu.npu.utils.<name>, re-exported as torch_npu.npu.<name>; torch_npu.utils.<combine>.
_npu_utils = types.ModuleType("torch_npu.npu.utils")
for _name in ("is_support_inf_nan", "get_npu_overflow_flag", "clear_npu_overflow_flag"):
    setattr(_npu_utils, _name, globals()[_name])
    setattr(npu, _name, globals()[_name])
npu.utils = _npu_utils
utils = types.ModuleType("torch_npu.utils")
utils.npu_combine_tensors = npu_combine_tensors
utils.is_combined_tensor_valid = is_combined_tensor_valid
sys.modules.setdefault("torch_npu.npu", npu)
sys.modules["torch_npu.npu.utils"] = _npu_utils
sys.modules["torch_npu.utils"] = utils
