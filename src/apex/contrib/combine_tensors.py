"""Combined (flat) tensors: many tensors rebound as views into one buffer.

Elementwise work on one flat buffer costs one kernel launch (npu/cuda) or one
memory pass (cpu) instead of one per tensor; with thousands of small
parameters that is the difference between a per-tensor overhead dominated
step and a bandwidth-bound one. :func:`combine_tensors` allocates a zero-filled
buffer, copies the values in (when asked) and rebinds every input *in place*:
the Python objects (``nn.Parameter`` included) stay the same, only their data
now lives in the buffer, so modules, optimizers and autograd keep working.

Layout rule (:func:`plan_layout`)
---------------------------------
Tensors are placed in order; each slot starts at a multiple of
``ALIGN_ELEMENTS`` = 32 elements and holds exactly ``numel`` elements; there is
no other padding. Buffers come from torch's allocators, which return at least
64-byte aligned memory (CPU: 64, CUDA caching allocator: 512), so every slot
starts 64-byte (half types) or 128-byte (fp32) aligned: on a cache-line and
AVX-512 vector boundary. Per-slot kernels (optimizer segments, per-tensor
norms) start on aligned loads, and two slots never share a cache line, so
threads working on different slots do not false-share. Alignment in
elements (not bytes) keeps the offsets of one plan valid for the fp32 master
copy and the fp16/bf16 model copy alike. The gaps stay zero, so whole-buffer
reductions (norms, non-finite checks) are unaffected.

The Ascend patch's layout (:func:`plan_ascend_layout`, used by its API name
:func:`combine_npu`): slot ``i`` is ``ceil(n_i / 16) * 16 + 32`` elements
(:func:`get_aligned_storage_size`), slots follow each other, and the buffer is
exactly the sum, so code written for the patch that steps data pointers by
``get_aligned_storage_size`` or compares the buffer's storage size with their
sum runs unchanged. That padding served torch_npu's private storage formats
(FRACTAL_NZ, ...), whose memory is not a plain strided array; here an npu
tensor with such a format sends the whole call to torch_npu's native combine op
instead (see ``apex._device.npu_combine_op``), which knows those formats. The
optimizers and amp combine with :func:`combine_tensors` (``plan_layout``),
whose slots are cache-line aligned and carry no tail padding.

Validity (:func:`is_combined_tensor_valid`) is stricter than the original,
which only tested that each tensor's data pointer fell inside the buffer: here
every tensor must start exactly at its slot in one of the two layouts (and be
dense, of the buffer's dtype), so a tensor that was rebound elsewhere, or a
list given in another order, is reported as invalid.

Checkpoints: ``torch.save`` writes the whole storage behind a view, and
``safetensors`` refuses tensors that share one. So when parameters are
combined, every module that holds one of them gets a state-dict post hook
(:func:`_compact_module_state`, installed once per module): its
``state_dict()`` entries for those parameters become tensors over a storage
that covers only their own bytes. These alias the parameters' memory exactly as
torch's ``param.detach()`` entries do (no copy; ``keep_vars=True`` entries are
the parameters themselves and stay as they are), so saving costs what it costs
for an uncombined model and ``load_state_dict`` still copies into the combined
slots. The modules are found once per combine, by a scan of the objects the
garbage collector tracks (params do not know their modules).
:func:`compact_state_dict` / :func:`register_compact_state_dict_hook` clone
views of any other object (optimizer states: fused optimizers' ``state_dict``
already returns clones).
"""

from __future__ import annotations

import gc
import itertools
import logging
import sys
import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from apex import _device
from apex._checks import check_int
from apex._tensor_utils import map_tensors
from apex.contrib._ascend_compat import CallableModule, get_aligned_storage_size

__all__ = [
    "ALIGN_ELEMENTS",
    "change_data_ptr",
    "combine_npu",
    "combine_tensors",
    "compact_state_dict",
    "get_aligned_storage_size",
    "get_part_combined_tensor",
    "is_combined_tensor_valid",
    "npu_combine_tensors",
    "plan_ascend_layout",
    "plan_layout",
    "register_compact_state_dict_hook",
]

logger = logging.getLogger(__name__)

ALIGN_ELEMENTS = 32
# The Ascend patch's slot rule (get_aligned_storage_size's defaults): round up to 16 elements, add 32.
ASCEND_ALIGN_ELEMENTS = 16
ASCEND_PAD_ELEMENTS = 32


# ---------------------------------------------------------------- layout


def plan_layout(tensors: Sequence[Any]) -> Tuple[List[int], int]:
    """Element offsets of each tensor's slot and the buffer length.

    ``tensors`` may hold tensors or plain element counts. Slot ``i`` starts at
    ``offsets[i]``, a multiple of 32, right after slot ``i-1`` rounded up;
    ``total`` is the end of the last slot (no tail padding); an empty input
    gives ``([], 0)``.
    """
    offsets: List[int] = []
    end = 0
    for i, t in enumerate(tensors):
        n = _entry_numel(i, t, "plan_layout")
        start = (end + ALIGN_ELEMENTS - 1) // ALIGN_ELEMENTS * ALIGN_ELEMENTS
        offsets.append(start)
        end = start + n
    return offsets, end


def _entry_numel(i: int, t: Any, where: str) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel()
    if isinstance(t, int) and not isinstance(t, bool) and t >= 0:
        return t
    raise TypeError(f"{where}: entry {i}: expected a tensor or a non-negative int, got {t!r}")


def _ascend_slot(n: int) -> int:
    return (n + ASCEND_ALIGN_ELEMENTS - 1) // ASCEND_ALIGN_ELEMENTS * ASCEND_ALIGN_ELEMENTS + ASCEND_PAD_ELEMENTS


def plan_ascend_layout(tensors: Sequence[Any]) -> Tuple[List[int], int]:
    """The Ascend patch's layout: element offsets of each slot and the buffer length.

    Slot ``i`` holds ``ceil(n_i / 16) * 16 + 32`` elements (``n_i`` the
    tensor's element count, or the int given), which is
    ``get_aligned_storage_size`` of a dense tensor; slots follow each other
    from offset 0, so every slot starts at a multiple of 16 elements, and
    ``total`` is the sum of the slots (the padding after the last tensor
    included). An empty input gives ``([], 0)``.
    """
    offsets: List[int] = []
    end = 0
    for i, t in enumerate(tensors):
        n = _entry_numel(i, t, "plan_ascend_layout")
        offsets.append(end)
        end += _ascend_slot(n)
    return offsets, end


# ---------------------------------------------------------------- validation


def _dense_problem(t: torch.Tensor) -> str | None:
    """None if ``t`` covers exactly ``numel`` consecutive elements, else what is wrong.

    Sorting the dims by stride, a dense non-overlapping tensor has each stride
    equal to the product of the sizes of the dims before it; a smaller stride
    means elements are shared (expand, stride 0), a larger one means gaps.
    Size-1 dims have no effect on the memory covered and are ignored.
    """
    if t.is_contiguous() or t.numel() == 0:  # the common case, answered in C++
        return None
    dims = sorted((st, sz) for sz, st in zip(t.size(), t.stride()) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st < expected:
            return f"overlapping memory (size {tuple(t.size())}, stride {tuple(t.stride())})"
        if st > expected:
            return f"gaps between elements (size {tuple(t.size())}, stride {tuple(t.stride())})"
        expected *= sz
    return None


def _storage_key(t: torch.Tensor) -> int:
    # Identity of the StorageImpl (shared by all views of one storage); data
    # pointers cannot serve, since every empty storage has pointer 0.
    return t.untyped_storage()._cdata


def _as_list(tensors: Any, where: str) -> list:
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"{where}: expected a list of tensors, got a single tensor of shape {tuple(tensors.shape)}")
    if tensors is None:
        raise TypeError(f"{where}: expected a list of tensors, got None")
    try:
        return list(tensors)
    except TypeError:
        raise TypeError(f"{where}: expected a list of tensors, got {type(tensors).__name__}") from None


def _check_entry(i: int, t: Any, where: str) -> None:
    if t is None:
        raise TypeError(f"{where}: entry {i}: expected a tensor, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: entry {i}: expected a tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.is_nested:
        raise TypeError(f"{where}: entry {i}: expected a dense (strided) tensor, got "
                        f"{'a nested tensor' if t.is_nested else f'layout {t.layout}'}")
    if t.is_complex() or not t.is_floating_point():
        raise TypeError(f"{where}: entry {i}: expected a floating-point tensor, got {t.dtype}")
    if t.is_inference() and not torch.is_inference_mode_enabled():
        # rebinding it to a buffer made outside inference mode would leave a tensor torch can no longer use
        raise TypeError(f"{where}: entry {i}: expected a normal tensor, got an inference tensor (made under "
                        "torch.inference_mode()); combine it inside inference mode or pass a normal tensor")


def _validate(tensors: list, where: str) -> None:
    """Every check combine_tensors needs, done before anything is changed."""
    for i, t in enumerate(tensors):
        _check_entry(i, t, where)
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.dtype != first.dtype:
            raise TypeError(
                f"{where}: all tensors must share one dtype: entry 0 is {first.dtype}, entry {i} is {t.dtype}"
            )
        if t.device != first.device:
            raise ValueError(
                f"{where}: all tensors must be on one device: entry 0 is on {first.device}, entry {i} on {t.device}"
            )
    for i, t in enumerate(tensors):
        problem = _dense_problem(t)
        if problem is not None:
            raise ValueError(f"{where}: entry {i}: expected a non-overlapping and dense tensor, got {problem}")
    _check_no_aliasing(tensors, where)


def _check_no_aliasing(tensors: list, where: str) -> None:
    """Reject entries that are the same tensor or share memory.

    After combining they would become independent copies, silently breaking
    whatever relied on the sharing (and one slot would be orphaned).
    """
    seen: Dict[int, int] = {}
    for i, t in enumerate(tensors):
        j = seen.setdefault(id(t), i)
        if j != i:
            raise ValueError(f"{where}: entries {j} and {i} are the same tensor; expected each tensor once")
    if tensors[0].device.type == "meta":  # meta tensors have no memory to share
        return
    ranges = []
    for i, t in enumerate(tensors):
        if t.numel():
            start = t.storage_offset()
            ranges.append((_storage_key(t), start, start + t.numel(), i))
    ranges.sort()
    for (k0, _s0, e0, i0), (k1, s1, _e1, i1) in zip(ranges, ranges[1:]):
        if k0 == k1 and s1 < e0:
            raise ValueError(
                f"{where}: entries {min(i0, i1)} and {max(i0, i1)} share memory; expected tensors that do not overlap"
            )


# ---------------------------------------------------------------- combine


def _slot_view(buffer: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
    # as_strided over the slot keeps like's strides (channels_last stays channels_last).
    return buffer.as_strided(like.size(), like.stride(), buffer.storage_offset() + offset)


def combine_tensors(tensors: Iterable[torch.Tensor], require_copy_value: bool = True, *,
                    allow_empty: bool = True) -> torch.Tensor | None:
    """Rebind ``tensors`` in place as views into one new flat, zero-filled buffer.

    Args:
        tensors: floating-point tensors of one dtype and device, each
            non-overlapping and dense (contiguous, channels_last, ...).
        require_copy_value: copy each tensor's values into its slot; when
            False the tensors read as zeros afterwards (state buffers).
        allow_empty: an empty list returns None, like the original
            ``combine_npu([])``; pass False to make it a ValueError.

    Returns:
        The 1-D buffer (same dtype/device, ``plan_layout(tensors)[1]``
        elements), or None for an empty list. Every input keeps its identity,
        shape and strides; ``requires_grad`` and autograd on parameters are
        unaffected. A list of only empty tensors gives a 0-element buffer
        (the original returned None there too; a buffer lets
        :func:`is_combined_tensor_valid` confirm the combine). On npu, when a
        tensor has a private storage format, the result is whatever torch_npu's
        native op returns.

    Raises:
        TypeError / ValueError describing the first bad input (RuntimeError
        when an npu private format needs a torch_npu op that is missing);
        nothing is rebound when raising.
    """
    return _combine(tensors, require_copy_value, allow_empty, plan_layout, "combine_tensors")


def combine_npu(tensors: Iterable[torch.Tensor], require_copy_value: bool = True, *,
                allow_empty: bool = True) -> torch.Tensor | None:
    """:func:`combine_tensors` with the Ascend patch's layout (:func:`plan_ascend_layout`).

    Each tensor gets ``get_aligned_storage_size(t)`` elements (its element
    count rounded up to 16, plus 32), one slot after the other, and the buffer
    is their sum: ``y.data_ptr() == x.data_ptr() + get_aligned_storage_size(x)
    * x.element_size()`` for consecutive ``x, y``, as code written for the
    patch expects. Arguments, checks, errors, in-place rebinding and the npu
    private-format hand-off are those of :func:`combine_tensors`; the padding
    stays zero. Buffers for this package's optimizers come from
    :func:`combine_tensors` (cache-line aligned slots, no tail padding).
    """
    return _combine(tensors, require_copy_value, allow_empty, plan_ascend_layout, "combine_npu")


def _combine(tensors: Iterable[torch.Tensor], require_copy_value: bool, allow_empty: bool, planner: Any,
             where: str) -> torch.Tensor | None:
    tensors = _as_list(tensors, where)
    if not tensors:
        if allow_empty:
            return None
        raise ValueError(f"{where}: expected at least one tensor, got an empty list")
    _validate(tensors, where)

    if _device.any_npu_private_format(tensors):
        native = _device.npu_combine_op()
        if native is None:
            raise RuntimeError(
                f"{where}: npu tensors with a private storage format need torch_npu's "
                "npu_combine_tensors, which this torch_npu does not provide"
            )
        logger.debug("%s: delegating %d npu tensors with private formats to torch_npu", where, len(tensors))
        return native(tensors, require_copy_value=require_copy_value)

    offsets, total = planner(tensors)
    first = tensors[0]
    with torch.no_grad():
        buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
        views = [_slot_view(buffer, t, off) for t, off in zip(tensors, offsets)]
        if require_copy_value:
            for view, t in zip(views, tensors):
                view.copy_(t.detach())
        # Only now, with every allocation and copy done, are the inputs rebound.
        for view, t in zip(views, tensors):
            t.data = view
    _hook_owning_modules(tensors)
    return buffer


npu_combine_tensors = combine_tensors


# ---------------------------------------------------------------- parts, validity, rebinding


def _check_flat(buffer: Any, name: str, where: str) -> torch.Tensor:
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a tensor, got {type(buffer).__name__}")
    if buffer.layout != torch.strided or buffer.is_nested:
        raise ValueError(f"{where}: {name} must be a contiguous (flat) tensor, got "
                         f"{'a nested tensor' if buffer.is_nested else f'layout {buffer.layout}'}")
    if not buffer.is_contiguous():
        raise ValueError(f"{where}: {name} must be a contiguous (flat) tensor, got stride {tuple(buffer.stride())}")
    return buffer


def get_part_combined_tensor(combined: torch.Tensor, index: int, size: int) -> torch.Tensor:
    """View of ``size`` elements of ``combined`` starting at element ``index``.

    The view shares memory with the buffer (writes go both ways). Raises
    TypeError for non-int arguments, ValueError for negative ones and
    IndexError when ``index + size`` runs past the buffer.
    """
    where = "get_part_combined_tensor"
    _check_flat(combined, "combined", where)
    index = check_int(index, f"{where}: index", 0)
    size = check_int(size, f"{where}: size", 0)
    if index + size > combined.numel():
        raise IndexError(
            f"{where}: elements [{index}, {index + size}) requested, but the buffer has {combined.numel()} elements"
        )
    return combined.reshape(-1).narrow(0, index, size)


def is_combined_tensor_valid(combined: torch.Tensor | None, tensors: Iterable[torch.Tensor]) -> bool:
    """True iff every tensor still lives in ``combined`` at its slot.

    The slots are those of ``plan_layout(tensors)`` (:func:`combine_tensors`)
    or, failing that, of ``plan_ascend_layout(tensors)`` (:func:`combine_npu`).
    For each tensor: same dtype as the buffer, dense, and its first element
    at the buffer's address of its slot (the same memory, hence the same
    storage and device; empty tensors, whose data pointer reads 0, are matched
    by storage identity and offset instead); and the buffer must be long
    enough. An empty list is trivially valid;
    ``combined=None`` with a non-empty list is not; non-tensor or sparse
    entries are simply invalid. For npu tensors with a private format
    (combined by torch_npu) torch_npu's own check decides.

    Optimizers may call this every step, so it is one pass of a few cheap
    attribute reads per tensor with the layout rule inlined.
    """
    tensors = _as_list(tensors, "is_combined_tensor_valid")
    if not tensors:
        return True
    if combined is None:
        return False
    if not isinstance(combined, torch.Tensor):
        raise TypeError(f"is_combined_tensor_valid: combined must be a tensor or None, got {type(combined).__name__}")
    if combined.layout != torch.strided or not combined.is_contiguous():
        return False
    if _device.any_npu_private_format(tensors):
        native = _device.npu_combined_valid_op()
        return bool(native(combined, tensors)) if native is not None else False
    return _valid_in(combined, tensors, ascend=False) or _valid_in(combined, tensors, ascend=True)


def _valid_in(combined: torch.Tensor, tensors: list, ascend: bool) -> bool:
    dtype, itemsize = combined.dtype, combined.element_size()
    ptr0, base = combined.data_ptr(), combined.storage_offset()
    end = 0  # plan_layout: end of the previous tensor; plan_ascend_layout: end of the previous slot
    try:
        for t in tensors:
            n = t.numel()
            start = end if ascend else (end + ALIGN_ELEMENTS - 1) // ALIGN_ELEMENTS * ALIGN_ELEMENTS
            if n:
                if t.data_ptr() != ptr0 + start * itemsize:
                    return False
            elif t.storage_offset() != base + start or _storage_key(t) != _storage_key(combined):
                return False
            if t.dtype != dtype or _dense_problem(t) is not None:
                return False
            end = start + (_ascend_slot(n) if ascend else n)
    except (AttributeError, RuntimeError, NotImplementedError):  # a non-tensor, or a sparse tensor (no data_ptr)
        return False
    return combined.numel() >= end


def change_data_ptr(dst: torch.Tensor, src: torch.Tensor, offset: int) -> torch.Tensor:
    """Rebind ``dst`` in place as a view of ``src``'s memory starting ``offset`` elements into ``src``.

    ``dst`` keeps its identity, shape and strides; its old values are not
    copied (it reads what ``src`` holds there). Returns ``dst``.
    Raises TypeError (non-tensors, dtype mismatch, non-int offset),
    ValueError (device mismatch, negative offset, ``dst`` not dense, ``src``
    not contiguous) or IndexError (the slot runs past ``src``); ``dst`` is
    unchanged when raising.
    """
    where = "change_data_ptr"
    if not isinstance(dst, torch.Tensor):
        raise TypeError(f"{where}: dst must be a tensor, got {type(dst).__name__}")
    _check_flat(src, "src", where)
    offset = check_int(offset, f"{where}: offset", 0)
    if dst.dtype != src.dtype:
        raise TypeError(f"{where}: dst and src must share a dtype, got dst {dst.dtype} and src {src.dtype}")
    if dst.device != src.device:
        raise ValueError(f"{where}: dst and src must be on one device, got dst {dst.device} and src {src.device}")
    if dst.layout != torch.strided or dst.is_nested:
        raise ValueError(f"{where}: dst must be a dense (strided) tensor, got "
                         f"{'a nested tensor' if dst.is_nested else f'layout {dst.layout}'}")
    problem = _dense_problem(dst)
    if problem is not None:
        raise ValueError(f"{where}: dst must be a non-overlapping and dense tensor, got {problem}")
    if offset + dst.numel() > src.numel():
        raise IndexError(
            f"{where}: dst needs elements [{offset}, {offset + dst.numel()}) of src, which has {src.numel()}"
        )
    with torch.no_grad():
        dst.data = src.detach().as_strided(dst.size(), dst.stride(), src.storage_offset() + offset)
    return dst


# ---------------------------------------------------------------- checkpoints


def _extent(t: torch.Tensor) -> int:
    """Elements of storage ``t`` can reach, counted from its first element."""
    if t.numel() == 0:
        return 0
    return 1 + sum((sz - 1) * st for sz, st in zip(t.size(), t.stride()))


def _needs_compaction(t: torch.Tensor) -> bool:
    if t.layout != torch.strided or t.device.type == "meta" or _device.npu_has_private_format(t):
        return False
    return t.untyped_storage().nbytes() > _extent(t) * t.element_size()


def _compact_tensor(t: torch.Tensor, memo: Dict[tuple, torch.Tensor]) -> torch.Tensor:
    if not _needs_compaction(t):
        return t
    # Identical views (tied weights) map to one clone, so the file still shares them.
    key = (_storage_key(t), t.storage_offset(), tuple(t.size()), tuple(t.stride()), t.dtype)
    out = memo.get(key)
    if out is None:
        out = t.detach().clone()  # preserve_format: dense strides (channels_last) survive
        if isinstance(t, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
        memo[key] = out
    return out


def _compact(obj: Any, memo: Dict[tuple, torch.Tensor]) -> Any:
    # containers are copied, never mutated: inner dicts may be an optimizer's live per-parameter state
    return map_tensors(obj, lambda t: _compact_tensor(t, memo))


def compact_state_dict(obj: Any) -> Any:
    """Copy of ``obj`` (nested dicts/lists/tuples) with storage-sharing views cloned.

    Every tensor whose storage is larger than the elements it can reach (a
    view into a combined buffer, or any other slice) is replaced by a compact
    clone, so ``torch.save`` writes only its own elements instead of the
    whole buffer. Other tensors and non-tensor leaves are kept as they are;
    containers are copied, the input is never modified.
    """
    return _compact(obj, {})


def register_compact_state_dict_hook(target: Any) -> Any:
    """Make ``target.state_dict()`` return compact tensors (see :func:`compact_state_dict`).

    ``target`` is an ``nn.Module`` or a ``torch.optim.Optimizer``. Returns the
    hook handle (``handle.remove()`` undoes it).
    """
    if isinstance(target, torch.nn.Module):

        def module_hook(module, state_dict, prefix, local_metadata):
            memo: Dict[tuple, torch.Tensor] = {}
            for k in list(state_dict.keys()):
                if k.startswith(prefix):
                    state_dict[k] = _compact(state_dict[k], memo)

        # Public post-hooks (torch >= 2.2) must edit in place and return None; older torch only has the private one.
        register = getattr(target, "register_state_dict_post_hook", None) or target._register_state_dict_hook
        return register(module_hook)
    if isinstance(target, torch.optim.Optimizer):

        def optimizer_hook(optimizer, state_dict):
            return compact_state_dict(state_dict)

        return target.register_state_dict_post_hook(optimizer_hook)
    raise TypeError(
        f"register_compact_state_dict_hook: expected an nn.Module or Optimizer, got {type(target).__name__}"
    )


# ---------------------------------------------------------------- compact module state dicts by default

_HOOKED_MARK = "_apex_state_dict_compacted"  # set on a param once the modules holding it have the hook


# (storage, offset, size, stride, dtype) of a combined slot -> its live own-bytes view. Shared by all hooks, so a
# param held by two modules (tied weights) gets one view, one storage: torch.save still writes it once. Weak
# values: an entry lives as long as some state_dict holds the view (which keeps the slot's storage alive too).
_slot_views: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _own_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` over a storage that is exactly the bytes it reaches (a storage slice: same memory, no copy)."""
    start = t.storage_offset() * t.element_size()
    nbytes = _extent(t) * t.element_size()
    key = (_storage_key(t), start, tuple(t.size()), tuple(t.stride()), t.dtype)
    out = _slot_views.get(key)
    if out is None:
        try:
            storage = t.untyped_storage()[start:start + nbytes]
            out = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.size(), t.stride())
        except (RuntimeError, TypeError, NotImplementedError):  # a backend without storage slices
            out = t.detach().clone()
        _slot_views[key] = out
    return out


def _compact_module_state(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post hook: the module's own param entries that view a larger storage become own-bytes views.

    Entries that are the live params or buffers (``keep_vars=True``) are left alone. A module-level
    function, so modules with the hook still pickle and deep-copy.
    """
    for name, p in module._parameters.items():
        key = prefix + name
        v = state_dict.get(key) if p is not None else None
        if isinstance(v, torch.Tensor) and v is not p and not isinstance(v, torch.nn.Parameter) \
                and _needs_compaction(v):
            state_dict[key] = _own_bytes_view(v)


def _has_compact_hook(module: torch.nn.Module) -> bool:
    return any(h is _compact_module_state for h in module._state_dict_hooks.values())


def _module_types() -> set:
    """nn.Module and every subclass alive now (a few hundred classes: well under a millisecond)."""
    seen = {torch.nn.Module}
    stack = [torch.nn.Module]
    while stack:
        for sub in type.__subclasses__(stack.pop()):
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
    return seen


# The nn.Modules known to this process, once the first combine asked: the modules one walk over the
# interpreter's objects found then (and at each later walk), and every module that registered a param since
# (torch's global parameter-registration hook). A param put straight into ``_parameters`` of a known module is
# found too (each module's ``_parameters`` is read when asked). None: not tracking yet.
_tracked_modules: Optional[weakref.WeakSet] = None
_registration_handle = None


def _track_module(module: torch.nn.Module, name: str, param: Any) -> None:
    """Global parameter-registration hook: remembers the module (the param is left as it is)."""
    if _tracked_modules is not None:
        _tracked_modules.add(module)


def _walk_modules() -> List[torch.nn.Module]:
    """Every nn.Module the interpreter holds: the filter runs in C (type lookups in a set of classes)."""
    objs = gc.get_objects()
    modules = list(itertools.compress(objs, map(_module_types().__contains__, map(type, objs))))
    del objs
    return modules


def _start_tracking() -> List[torch.nn.Module]:
    """A walk over the interpreter's modules, which seeds the tracked set when torch has the global
    parameter-registration hook (installed here, before the walk, so that a module made meanwhile is not
    missed); without that hook nothing is tracked and every call walks."""
    global _tracked_modules, _registration_handle
    register = getattr(torch.nn.modules.module, "register_module_parameter_registration_hook", None)
    if register is not None:
        _tracked_modules = weakref.WeakSet()
        _registration_handle = register(_track_module)
    modules = _walk_modules()
    if _tracked_modules is not None:
        _tracked_modules.update(modules)
    return modules


def _tracked() -> List[torch.nn.Module]:
    for _ in range(3):
        try:
            return list(_tracked_modules)
        except RuntimeError:  # another thread registered a param while the set was read
            continue
    return _walk_modules()


def _hook_owners(modules: Iterable[torch.nn.Module], ids: set) -> set:
    """Hooks each of ``modules`` whose own params include one of ``ids``; returns the ids found."""
    found: set = set()
    for obj in modules:
        own = obj.__dict__.get("_parameters")
        if not own:
            continue
        hit = ids.intersection(map(id, own.values()))
        if hit:
            found |= hit
            if not _has_compact_hook(obj):
                register = getattr(obj, "register_state_dict_post_hook", None)
                if register is not None:  # torch >= 2.2
                    register(_compact_module_state)
    return found


def _hook_owning_modules(tensors: Iterable[Any]) -> None:
    """Installs `_compact_module_state` on every module holding one of the given params (once per module).

    The modules are first the tracked ones (one walk over the interpreter's objects seeds the set, then torch's
    parameter-registration hook extends it), asked once for all the params of a call, so a caller that combines
    several sets (an optimizer's groups) asks once. A param no tracked module holds makes one walk: modules
    that never registered a param (a ``copy.deepcopy`` or unpickled model) are found there and tracked from
    then on; a param held by no module (a free tensor) costs that walk at its first combine. Params already
    handled, and anything that is not an nn.Parameter, are skipped without a look.
    """
    # Params are marked with an attribute (no weak references: torch's swap_tensors refuses tensors that have
    # any), so a re-combine of the same params costs no look.
    params = [t for t in tensors if isinstance(t, torch.nn.Parameter) and not t.__dict__.get(_HOOKED_MARK)]
    if not params:
        return
    ids = {id(p) for p in params}
    if _tracked_modules is None:
        _hook_owners(_start_tracking(), ids)
    elif _hook_owners(_tracked(), ids) != ids:
        modules = _walk_modules()
        _tracked_modules.update(modules)
        _hook_owners(modules, ids)
    for p in params:
        p.__dict__[_HOOKED_MARK] = True


# `apex.contrib.combine_tensors` is this module (the Ascend layout: `ct.combine_npu(...)`), and calling it
# calls combine_tensors() (`from apex.contrib import combine_tensors; combine_tensors(params)`).
sys.modules[__name__].__class__ = CallableModule
__call_target__ = "combine_tensors"
