"""NVIDIA's ``amp_C`` multi-tensor ops, on every device.

Each op has NVIDIA's signature: ``op(chunk_size, noop_flag, tensor_lists, *args)``, where
``noop_flag`` is a one-element integer tensor (``torch.zeros(1, dtype=torch.int)``) and
``tensor_lists`` a list of equally long lists of dense tensors (contiguous or channels_last, as
upstream requires; tensor ``i`` of every list has one element count, and the ops pair elements in
memory order whatever the shapes, as upstream's kernels do). Every argument is checked before
anything is written: tensors must hold values (no meta tensors), the flag must be dense and, as
upstream requires, on the tensors' device, and at each position a tensor the op writes may share no
memory with that position's other tensors, except as the very same memory and dtype where the op
works in place (``multi_tensor_scale``'s out is its in; ``multi_tensor_axpby``'s out is its x or y).
Call them directly or through :data:`apex.multi_tensor_apply.multi_tensor_applier`, which supplies
``chunk_size``.

The flag, as upstream:

* set to 1 when a non-finite value is seen by ``multi_tensor_scale`` (in the inputs),
  ``multi_tensor_axpby`` (in the checked argument), the ``multi_tensor_l2norm`` family (a
  non-finite norm) and ``multi_tensor_lamb`` (a non-finite param or update norm); never cleared;
* read by ``multi_tensor_sgd`` only: when it is already set, the op changes nothing. The other
  optimizer ops (adam, lamb, novograd, adagrad) update even then, as upstream's do
  (their kernels propagate inf/nan on purpose); callers test the flag before calling them.

Numerics: fp32 arithmetic whatever the storage dtype, one rounding per stored value, as
upstream's kernels. ``chunk_size`` only sets how upstream's kernels cut work into CUDA
blocks; results here do not depend on it (reductions accumulate in float64 per tensor).

Executors: on CPU the elementwise checks, scales and sums of squares go through
``apex._core`` (the C++ core's one-pass kernels for contiguous fp32/fp16/bf16 tensors) and the
optimizer updates through the optimizers' per-tensor math; on CUDA / NPU the same code runs as
torch ops, except that ``multi_tensor_scale``, ``multi_tensor_axpby`` and the norms take whole
lists at once there (foreach ops and one host synchronisation, where a per-tensor loop would wait
on the device once per tensor). Every written tensor gets a new autograd version, as after torch's
in-place ops (upstream's CUDA kernels leave it as it was): backward through a tensor saved before an
op wrote it raises rather than using the new values.
``available`` is True: nothing here needs a compiled extension.
"""

from __future__ import annotations

import itertools
import math
import numbers
import operator
import struct
from typing import Any, List, Optional, Sequence, Tuple

import torch

from apex import _core
from apex._checks import FLOAT32_MAX, check_int, real_number
from apex._tensor_utils import (
    data_ptr,
    detach,
    get_device,
    get_dtype,
    get_is_cpu,
    get_is_nested,
    get_layout,
    get_nbytes,
    get_shape,
    is_contiguous,
)
from apex.optimizers._functional import adagrad_math, adam_math, l2_grad, lamb_direction, lamb_moments
from apex.optimizers.sgd import sgd_math

__all__ = [
    "available",
    "multi_tensor_adagrad",
    "multi_tensor_adam",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_l2norm_mp",
    "multi_tensor_lamb",
    "multi_tensor_novograd",
    "multi_tensor_scale",
    "multi_tensor_sgd",
    "multi_tensor_unscale_l2norm",
    "update_scale_hysteresis",
]

available = True

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FLOATS = (*_KERNEL_DTYPES, torch.float64)
_FLOAT_SET = frozenset(_FLOATS)
_KERNEL_SET = frozenset(_KERNEL_DTYPES)

_is = operator.is_
_repeat = itertools.repeat


# ---------------------------------------------------------------- argument checks
def _check_call(op: str, chunk_size: Any, noop_flag: Any, tensor_lists: Any, depths: Sequence[int],
                writes: Sequence[int] = (), aliases: Sequence[Tuple[int, int]] = ()) -> List[List[torch.Tensor]]:
    """Validate the common arguments; returns the lists as lists. Raises before anything is written.

    ``writes``: the lists the op writes; at each position, their tensors may share no memory with the position's
    other tensors, except a pair ``(written, other)`` of ``aliases`` that is exactly the same memory (in place)."""
    check_int(chunk_size, f"{op}: chunk_size", 1)
    _check_flag(op, noop_flag)
    if not isinstance(tensor_lists, (list, tuple)) or not all(isinstance(x, (list, tuple)) for x in tensor_lists):
        raise TypeError(f"{op}: tensor_lists must be a list of lists of tensors, got {type(tensor_lists).__name__}")
    copies: dict = {}  # a list passed twice (in place: [grads, grads]) stays one list, checked once
    lists = [copies[id(x)] if id(x) in copies else copies.setdefault(id(x), list(x)) for x in tensor_lists]
    if len(lists) not in depths:
        expected = " or ".join(str(d) for d in depths)
        raise ValueError(f"{op}: expected {expected} tensor lists, got {len(lists)}")
    plain = _plain_lists(lists)
    if not plain:
        _check_tensors(op, lists)
    if lists[0] and noop_flag.device != lists[0][0].device:
        # upstream's rule; a flag elsewhere would be written (or read) on another device than the tensors'
        raise ValueError(f"{op}: expected noop flag to be on the same device as tensors: noop_flag is on "
                         f"{noop_flag.device}, tensor_lists[0][0] on {lists[0][0].device}")
    if writes:
        _check_overlaps(op, lists, writes, aliases)
    if plain:
        return lists
    # one memory-order 1-D view per tensor: the ops then pair elements as upstream's kernels do (by position in
    # memory), and no shape difference between lists can fail halfway through, after earlier tensors were written
    return [[_memory_order(t) for t in tl] for tl in lists]


def _check_flag(op: str, noop_flag: Any) -> None:
    if not isinstance(noop_flag, torch.Tensor):
        raise TypeError(f"{op}: noop_flag must be a one-element integer tensor, got {type(noop_flag).__name__}")
    if noop_flag.is_nested or noop_flag.layout != torch.strided:
        # a sparse flag takes no element write: an overflow would go unrecorded
        raise TypeError(f"{op}: noop_flag must be a dense one-element integer tensor, got "
                        f"{'a nested tensor' if noop_flag.is_nested else f'layout {noop_flag.layout}'}")
    if noop_flag.is_meta:
        raise ValueError(f"{op}: noop_flag must hold a value (a one-element integer tensor on the tensors' "
                         "device), got a meta tensor")
    if noop_flag.numel() < 1 or noop_flag.is_floating_point() or noop_flag.is_complex():
        raise TypeError(f"{op}: noop_flag must be a one-element integer tensor (torch.zeros(1, dtype=torch.int)), "
                        f"got {noop_flag.dtype} with {noop_flag.numel()} elements")
    if noop_flag.is_inference() and not torch.is_inference_mode_enabled():
        raise TypeError(f"{op}: noop_flag is an inference tensor, which cannot be written outside "
                        "torch.inference_mode(); create the flag outside inference mode")


def _check_tensors(op: str, lists: List[list]) -> None:
    """The per-tensor form of `_plain_lists`' test: raises naming the first tensor that fails it."""
    n = len(lists[0])
    for li, tl in enumerate(lists):
        if len(tl) != n:
            raise ValueError(f"{op}: tensor list {li} has {len(tl)} tensors, list 0 has {n}")
        for ti, t in enumerate(tl):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}: tensor_lists[{li}][{ti}] must be a tensor, got {type(t).__name__}")
            if t.dtype not in _FLOATS:
                raise TypeError(f"{op}: tensor_lists[{li}][{ti}] must be float32, float16, bfloat16 or float64, "
                                f"got {t.dtype}")
            if t.is_nested or t.layout != torch.strided:
                raise TypeError(f"{op}: tensor_lists[{li}][{ti}] must be a dense tensor, got "
                                f"{'a nested tensor' if t.is_nested else f'layout {t.layout}'}")
            ref = lists[0][ti]
            if t.numel() != ref.numel():
                raise ValueError(f"{op}: tensor_lists[{li}][{ti}] has {t.numel()} elements, "
                                 f"tensor_lists[0][{ti}] has {ref.numel()}")
            if t.device != lists[0][0].device:
                raise ValueError(f"{op}: every tensor must be on one device: tensor_lists[{li}][{ti}] is on "
                                 f"{t.device}, tensor_lists[0][0] on {lists[0][0].device}")
            if t.is_meta:
                raise ValueError(f"{op}: tensor_lists[{li}][{ti}] must hold values, got a meta tensor")
            if not _dense(t):
                raise ValueError(f"{op}: tensor_lists[{li}][{ti}] must be contiguous (or channels_last), got "
                                 f"shape {tuple(t.shape)} with strides {tuple(t.stride())}")


#: a start past every address and an end before every address: an empty tensor's span, which overlaps nothing
_NO_START, _NO_END = 1 << 62, -1
_DTYPE_IDS = {dtype: i for i, dtype in enumerate(_FLOATS)}


def _spans(tensors: List[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """int64 tables of each (dense: contiguous or channels_last) tensor's first and past-the-end byte address."""
    start = _core.int_table(list(map(data_ptr, tensors)))
    size = _core.int_table(list(map(get_nbytes, tensors)))
    end = start + size
    empty = size == 0
    if bool(empty.any()):
        start.masked_fill_(empty, _NO_START)
        end.masked_fill_(empty, _NO_END)
    return start, end


def _check_overlaps(op: str, lists: List[List[torch.Tensor]], writes: Sequence[int],
                    aliases: Sequence[Tuple[int, int]]) -> None:
    """Raises where a tensor the op writes shares memory with another tensor of its position (see `_check_call`).
    Found mid-call, such an overlap fails (or silently reads half-written values) after earlier positions were
    written. Vectorised over positions: two address tables per list and a few int64 comparisons per pair of
    lists, no Python frame per tensor."""
    if not lists[0]:
        return
    spans: dict = {}

    def span(li: int) -> Tuple[torch.Tensor, torch.Tensor]:
        key = id(lists[li])  # (a list passed twice is one object: its table is built once)
        if key not in spans:
            spans[key] = _spans(lists[li])
        return spans[key]

    first: Optional[Tuple[int, int, int]] = None  # (position, written list, other list) of the earliest clash
    written = [w for w in writes if w < len(lists)]
    for w in written:
        for o in range(len(lists)):
            if o == w or (o in written and o < w):  # each pair of written lists once
                continue
            allowed = (w, o) in aliases or (o, w) in aliases
            if allowed and (lists[w] is lists[o] or _in_place(lists[w], lists[o])):
                continue  # the very same tensors: in place
            (ws, we), (os_, oe) = span(w), span(o)
            clash = (ws < oe) & (os_ < we)
            if allowed:
                # exactly the same memory as the same dtype is in place; any other overlap is a clash
                same = (ws == os_) & (we == oe)
                if bool(same.any()):
                    codes = [_core.int_table(list(map(_DTYPE_IDS.__getitem__, map(get_dtype, lists[li]))))
                             for li in (w, o)]
                    clash &= ~(same & (codes[0] == codes[1]))
            hits = clash.nonzero()
            if len(hits):
                i = int(hits[0, 0])
                if first is None or i < first[0]:
                    first = (i, w, o)
    if first is not None:
        i, w, o = first
        allowed = (w, o) in aliases or (o, w) in aliases
        expected = ("no shared memory, or exactly the same memory and dtype (in place)" if allowed
                    else "no shared memory")
        raise ValueError(f"{op}: tensor_lists[{w}][{i}], which the op writes, overlaps tensor_lists[{o}][{i}] in "
                         f"memory; expected {expected}")


def _plain_lists(lists: List[list]) -> bool:
    """Whether the lists pass `_check_call`'s checks as they are: tensors of a supported float dtype, strided and
    contiguous, each with the shape and device (not meta) of its position in list 0. Such tensors are their own
    memory-order views (memory order is index order, and pairs have equal shapes). One map per property, no Python
    frame per tensor: a Megatron- or DeepSpeed-style caller clips and unscales every grad through these ops at
    every step, and the per-tensor loop and views cost about 3 us a tensor. False sends the lists to that loop,
    which names the culprit or accepts what this test does not (channels_last tensors, pairs of different
    shapes)."""
    first = lists[0]
    others = [tl for tl in lists[1:] if tl is not first]
    for tl in [first, *others]:
        if len(tl) != len(first) or not all(map(isinstance, tl, _repeat(torch.Tensor))):
            return False
        if not (all(map(_FLOAT_SET.__contains__, map(get_dtype, tl))) and not any(map(get_is_nested, tl))
                and all(map(_is, map(get_layout, tl), _repeat(torch.strided))) and all(map(is_contiguous, tl))):
            return False
    shapes, devices = list(map(get_shape, first)), list(map(get_device, first))
    if len(set(devices)) > 1:  # upstream's rule: every tensor on the device of the first
        return False
    if devices and devices[0].type == "meta":  # (every tensor is on that device: one test for all)
        return False
    return all(list(map(get_shape, tl)) == shapes and list(map(get_device, tl)) == devices for tl in others)


def _dense(t: torch.Tensor) -> bool:
    """Upstream's rule: contiguous, or channels_last (3d) contiguous."""
    if t.is_contiguous():
        return True
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements as a 1-D view, in memory order (the tensor itself when it is one already)."""
    if t.dim() == 1 and t.is_contiguous():
        return t
    return t.detach().as_strided((t.numel(),), (1,), t.storage_offset())


def _flag_is_set(noop_flag: torch.Tensor) -> bool:
    return bool(noop_flag.reshape(-1)[0].item() != 0)


def _set_flag(noop_flag: torch.Tensor) -> None:
    # the first element in index order, written where it lives (reshape would copy a non-contiguous flag)
    noop_flag[(0,) * noop_flag.dim()].fill_(1)


def _brief(value: Any) -> str:
    """A value for an error message: a tensor by its kind and shape, anything else by a repr cut to 60 chars."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _scalar_tensor(value: torch.Tensor, name: str, op: str) -> Any:
    """The Python value of a one-element tensor, refusing what has none (meta) or is not real."""
    if value.numel() != 1:
        raise ValueError(f"{op}: {name} must be a number or a one-element tensor, got {value.numel()} elements")
    if value.is_meta:
        raise ValueError(f"{op}: {name} must hold a value, got a meta tensor")
    if value.is_complex():
        raise TypeError(f"{op}: {name} must be a real number, got {_brief(value)}")
    if value.layout != torch.strided:
        value = value.to_dense()
    return value.item()


def _number(value: Any, name: str, op: str) -> float:
    """A Python float from a number or a one-element tensor (upstream's capturable ops pass tensors). A finite
    value beyond float32's range is refused here: the ops compute in float32, and torch would refuse it only
    after earlier tensors of the call were written."""
    if isinstance(value, torch.Tensor):
        number = float(_scalar_tensor(value, name, op))
    else:
        real = real_number(value)  # numpy's scalars too
        if real is None:
            raise TypeError(f"{op}: {name} must be a number, got {type(value).__name__}")
        try:
            number = float(real)
        except OverflowError:  # an int beyond the float range
            raise ValueError(f"{op}: {name} must be within float32's range, got {value}") from None
    if math.isfinite(number) and abs(number) > FLOAT32_MAX:
        raise ValueError(f"{op}: {name} must be within float32's range (|v| <= {FLOAT32_MAX:.4g}), got {number}")
    return number


def _flag(value: Any, name: str, op: str) -> bool:
    """A switch given as a bool, an int (upstream's 0/1), a numpy bool or a one-element tensor."""
    if isinstance(value, torch.Tensor):
        value = _scalar_tensor(value, name, op)
    if isinstance(value, (bool, numbers.Integral)) or type(value).__name__ == "bool_":
        return bool(value)
    raise TypeError(f"{op}: {name} must be a bool (or 0/1), got {_brief(value)}")


def _choice(value: Any, allowed: tuple, name: str, op: str, meaning: str) -> int:
    """An int code among ``allowed`` (ints, numpy ints, one-element integer tensors)."""
    try:
        code = operator.index(value)
    except TypeError:
        code = None
    if code not in allowed:
        raise ValueError(f"{op}: {name} must be {meaning}, got {_brief(value)}")
    return code


def _f32(t: torch.Tensor) -> torch.Tensor:
    """A float32 working copy (a new tensor even for float32 input)."""
    return t.detach().to(torch.float32, copy=True)


def _store(dst: torch.Tensor, value: torch.Tensor) -> None:
    """Write a float32 result into ``dst`` (rounding once), unless it was computed in place there."""
    if value.dtype == dst.dtype and value.data_ptr() == dst.data_ptr() and value.stride() == dst.stride():
        return
    dst.detach().copy_(value)


def _nonfinite(t: torch.Tensor) -> bool:
    if t.dtype in _KERNEL_DTYPES:
        return _core.has_nonfinite(t.detach())
    return bool(t.numel()) and not bool(torch.isfinite(t).all())


def _sum_sq(t: torch.Tensor) -> float:
    if t.dtype in _KERNEL_DTYPES:
        return _core.sum_sq(t.detach())
    return float(t.detach().double().pow(2).sum()) if t.numel() else 0.0


# ---------------------------------------------------------------- whole lists off the host
# A per-tensor loop off CPU pays a host synchronisation per tensor for each inf/nan check and each norm (upstream's
# kernels read none). Lists that live off the host take a few foreach launches and one synchronisation instead.

#: (source dtype, destination dtype) pairs where copying then multiplying in the destination dtype rounds once,
#: as upstream's fp32 arithmetic does: the copy is exact (same dtype, or a widening one)
_EXACT_COPIES = {
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float64),
    (torch.bfloat16, torch.float64), (torch.float32, torch.float64),
}


def _off_host(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the list takes the whole-list path: non-empty, every tensor off CPU (CPU tensors take apex_C's
    one-pass kernels, which read no flag on the host either)."""
    return bool(tensors) and not any(map(get_is_cpu, tensors))


def _one_fused_unscale(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether torch's fused unscale op can take the whole list in one call: one device, float32/16/bf16."""
    device = tensors[0].device
    return (all(map(_KERNEL_SET.__contains__, map(get_dtype, tensors)))
            and all(map(operator.eq, map(get_device, tensors), _repeat(device))))


def _any_nonfinite(tensors: Sequence[torch.Tensor]) -> bool:
    """One synchronisation for the whole list: the infinity norm of a tensor is inf/nan iff it holds one."""
    live = [t.detach() for t in tensors if t.numel()]  # (an empty tensor has no infinity norm, and no inf/nan)
    if not live:
        return False
    return not bool(torch.stack(torch._foreach_norm(live, float("inf"))).isfinite().all())


def _disjoint(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether no two of the (contiguous) tensors share an element: a tensor listed twice is scaled twice in
    turn by the per-tensor loop, where one threaded pass over both would race."""
    spans = sorted(zip(map(data_ptr, tensors), map(get_nbytes, tensors)))
    return all(map(operator.le, [a + n for a, n in spans[:-1]], [a for a, _ in spans[1:]]))


def _in_place(src: List[torch.Tensor], dst: List[torch.Tensor]) -> bool:
    """Whether each output is its input, the same tensor object (one list passed twice: ``[grads, grads]``)."""
    return src is dst or all(map(_is, src, dst))


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two of `_check_call`'s memory-order views cover the same elements (one tensor passed in two lists)."""
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.numel() == b.numel()


def _scale_lists(src: List[torch.Tensor], dst: List[torch.Tensor], scale: float) -> Optional[bool]:
    """``dst = src * scale`` over whole lists (in place where dst is src); whether src held inf/nan. None, with
    nothing written, when a pair would round twice this way (a narrowing copy) or shares memory partly, or when
    two outputs share memory (one launch over both would race; the per-tensor path writes them in turn)."""
    if not _disjoint(dst):
        return None
    moved = []
    for s, d in () if _in_place(src, dst) else zip(src, dst):
        if _same_memory(s, d):
            continue  # in place
        if (d.dtype != s.dtype and (s.dtype, d.dtype) not in _EXACT_COPIES) or _shares_memory(d, s):
            return None
        moved.append((d.detach(), s.detach()))
    if not moved and _one_fused_unscale(src):
        # All in place: torch's fused unscale checks and multiplies in one read of each tensor, in float32 math
        # like the multiply below (float64 keeps the multiply: the fused op's factor is float32)
        with torch.no_grad():  # (in place on leaves that require grad, as a detach of each would allow)
            bad = _core.torch_fused_unscale_(src, scale)
        if bad is not None:
            return bad
    bad = _any_nonfinite(src)  # before an in-place scale changes src
    if moved:
        torch._foreach_copy_([d for d, _ in moved], [s for _, s in moved])
    if dst:
        torch._foreach_mul_(list(map(detach, dst)), scale)
    return bad


def _axpby_lists(xs: List[torch.Tensor], ys: List[torch.Tensor], outs: List[torch.Tensor], a: float,
                 b: float) -> None:
    """``out = a * x + b * y`` over whole lists, in fp32 working copies (the per-tensor path's ``mul_`` then
    ``add_(alpha=b)``), each output rounded once; an output may be its x or its y."""
    def f32(ts):
        work = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in ts]
        torch._foreach_copy_(work, [t.detach() for t in ts])
        return work

    work = f32(xs)
    torch._foreach_mul_(work, a)
    torch._foreach_add_(work, f32(ys), alpha=b)
    torch._foreach_copy_([o.detach() for o in outs], work)


# ---------------------------------------------------------------- elementwise ops
def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, scale: float) -> None:
    """``out[i] = in[i] * scale`` for ``tensor_lists = [in, out]`` (dtypes may differ, e.g. fp16 grads into
    fp32 masters); sets the flag if any input holds inf/nan. Runs even when the flag is already set."""
    op = "multi_tensor_scale"
    src, dst = _check_call(op, chunk_size, noop_flag, tensor_lists, (2,), writes=(1,), aliases=((1, 0),))
    scale = _number(scale, "scale", op)
    if _off_host(src) and _off_host(dst):
        bad = _scale_lists(src, dst, scale)
        if bad is not None:
            if bad:
                _set_flag(noop_flag)
            return
    if _in_place(src, dst) and _core.kernel_many(src) and _disjoint(src):
        # in place on CPU: one apex_C pass over the tensors' address table, where the loop below makes one call
        # per tensor (the same element kernel: the same bits)
        bad = _core._scale_gather_unchecked(src, scale, check=True)
        _bump_versions(src)
        if bad:
            _set_flag(noop_flag)
        return
    bad = False
    for s, d in zip(src, dst):
        if s.dtype in _KERNEL_DTYPES and d.dtype in _KERNEL_DTYPES:
            bad |= _core.scale_(s.detach(), scale, out=d.detach())
        else:
            bad |= _nonfinite(s)
            d.detach().copy_(s.detach().to(torch.float64) * scale)
    _bump_versions(dst)
    if bad:
        _set_flag(noop_flag)


def multi_tensor_axpby(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, a: float, b: float,
                       arg_to_check: int) -> None:
    """``out[i] = a * x[i] + b * y[i]`` for ``tensor_lists = [x, y, out]`` (``out`` may be ``x`` or ``y``).

    ``arg_to_check``: -1 checks x and y for inf/nan, 0 only x, 1 only y; a hit sets the flag.
    """
    op = "multi_tensor_axpby"
    xs, ys, outs = _check_call(op, chunk_size, noop_flag, tensor_lists, (3,), writes=(2,),
                               aliases=((2, 0), (2, 1)))
    a, b = _number(a, "a", op), _number(b, "b", op)
    arg_to_check = _choice(arg_to_check, (-1, 0, 1), "arg_to_check", op, "-1 (both), 0 (x) or 1 (y)")
    if _off_host(xs) and _off_host(ys) and _off_host(outs):
        checked = (xs if arg_to_check in (-1, 0) else []) + (ys if arg_to_check in (-1, 1) else [])
        if _any_nonfinite(checked):  # the inputs, before an aliased output changes them
            _set_flag(noop_flag)
        _axpby_lists(xs, ys, outs, a, b)
        return
    bad = False
    for x, y, out in zip(xs, ys, outs):
        if arg_to_check in (-1, 0):
            bad |= _nonfinite(x)
        if arg_to_check in (-1, 1):
            bad |= _nonfinite(y)
        distinct = out is not x and out is not y and not _shares_memory(out, x) and not _shares_memory(out, y)
        if distinct and out.dtype == torch.float32 and all(t.dtype in _KERNEL_DTYPES for t in (x, y)):
            _core.scale_(x.detach(), a, out=out.detach(), check=False)   # out = a*x (fp32)
            _core.axpy_(y.detach(), out.detach(), b, check=False)        # out += b*y
        else:
            _store(out, _f32(x).mul_(a).add_(_f32(y), alpha=b))
    _bump_versions(outs)
    if bad:
        _set_flag(noop_flag)


def _bump_versions(written: List[torch.Tensor]) -> None:
    """Tells autograd that the tensors changed in place. apex_C writes through raw addresses, which torch does
    not see: a tensor saved for backward and then written here would otherwise give a silently wrong gradient,
    where torch's in-place ops make backward raise. (Tensors written by torch's ops get a second bump, which
    autograd allows.) One call for the list: about 0.2 us a tensor."""
    torch.autograd.graph.increment_version(written)


def _shares_memory(u: torch.Tensor, v: torch.Tensor) -> bool:
    if u.numel() == 0 or v.numel() == 0:
        return False
    return u.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()


# ---------------------------------------------------------------- norms
def _norms(op: str, noop_flag: torch.Tensor, tensors: List[torch.Tensor], factor: float,
           per_tensor: Optional[bool]) -> Tuple[torch.Tensor, torch.Tensor]:
    if per_tensor is not None and not isinstance(per_tensor, bool):
        raise TypeError(f"{op}: per_tensor must be a bool or None, got {type(per_tensor).__name__}")
    device = tensors[0].device if tensors else noop_flag.device
    if _off_host(tensors):
        try:
            return _norms_off_host(noop_flag, tensors, factor, per_tensor)
        except (RuntimeError, NotImplementedError):  # a backend without float64 foreach norms: per tensor
            pass
    sums = [_sum_sq(t) * factor * factor for t in tensors]
    total = math.fsum(sums)
    # Upstream accumulates in fp32: a sum that does not fit it is an overflow too.
    as_f32 = torch.tensor([total, *sums], dtype=torch.float64).to(torch.float32)
    if not bool(torch.isfinite(as_f32).all()):
        _set_flag(noop_flag)
    norm = torch.tensor([total], dtype=torch.float64).sqrt().to(device=device, dtype=torch.float32)
    if per_tensor:
        each = torch.tensor(sums, dtype=torch.float64).sqrt().to(device=device, dtype=torch.float32)
    else:
        each = torch.empty(0, dtype=torch.float32, device=device)
    return norm, each


def _norms_off_host(noop_flag: torch.Tensor, tensors: List[torch.Tensor], factor: float,
                    per_tensor: Optional[bool]) -> Tuple[torch.Tensor, torch.Tensor]:
    """`_norms` for a list off the host: float64 norms from one foreach launch, the flag from one
    synchronisation, the results left on the device."""
    each64 = torch.stack(torch._foreach_norm([t.detach() for t in tensors], 2, dtype=torch.float64)) * factor
    squares = each64.square()
    total_sq = squares.sum().reshape(1)
    # upstream accumulates in fp32: a sum of squares that does not fit it is an overflow too
    if not bool(torch.cat([total_sq, squares]).to(torch.float32).isfinite().all()):
        _set_flag(noop_flag)
    norm = total_sq.sqrt().to(torch.float32)
    each = each64.to(torch.float32) if per_tensor else torch.empty(0, dtype=torch.float32, device=norm.device)
    return norm, each


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                        per_tensor: Optional[bool] = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(total, per_tensor_norms)``: the L2 norm of all tensors of ``tensor_lists = [tensors]`` as a float32
    tensor of shape ``[1]``, and with ``per_tensor=True`` each tensor's norm (shape ``[n]``; else shape
    ``[0]``), on the tensors' device. Sets the flag when a norm is not finite."""
    op = "multi_tensor_l2norm"
    (tensors,) = _check_call(op, chunk_size, noop_flag, tensor_lists, (1,))
    return _norms(op, noop_flag, tensors, 1.0, per_tensor)


def multi_tensor_l2norm_mp(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                           per_tensor: Optional[bool] = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """As :func:`multi_tensor_l2norm` (upstream's variant for mixed-precision lists; every dtype is
    accumulated at full precision here anyway)."""
    op = "multi_tensor_l2norm_mp"
    (tensors,) = _check_call(op, chunk_size, noop_flag, tensor_lists, (1,))
    return _norms(op, noop_flag, tensors, 1.0, per_tensor)


def multi_tensor_unscale_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, inv_scale,
                                per_tensor: Optional[bool] = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The norms of ``tensors * inv_scale`` (``inv_scale`` a one-element tensor or a number), as
    :func:`multi_tensor_l2norm`; the tensors are only read."""
    op = "multi_tensor_unscale_l2norm"
    (tensors,) = _check_call(op, chunk_size, noop_flag, tensor_lists, (1,))
    factor = abs(_number(inv_scale, "inv_scale", op))
    return _norms(op, noop_flag, tensors, factor, per_tensor)


# ---------------------------------------------------------------- optimizer ops
def _bias_corrections(op: str, beta1: float, beta2: float, step: float, on: bool,
                      root: bool = False) -> Tuple[float, float]:
    """(1 - beta1^step, 1 - beta2^step), or (1, 1) when ``on`` is false. Raises, before anything is written,
    where upstream's kernels would divide every element by 0 or inf, or take the root of a negative (``root``:
    the second correction is square-rooted) or complex number: a step of 0, |beta| > 1 at a large step, a
    negative beta at a fractional step."""
    if not on:
        return 1.0, 1.0
    try:
        bcs = (1 - beta1**step, 1 - beta2**step)
    except (OverflowError, ZeroDivisionError):
        bcs = None
    if (bcs is None or not all(isinstance(b, float) and math.isfinite(b) and b != 0 for b in bcs)
            or (root and bcs[1] < 0)):
        need = "a finite nonzero real number" + (", the second one positive" if root else "")
        raise ValueError(f"{op}: the bias corrections 1 - beta1**step and 1 - beta2**step must each be {need}; "
                         f"got beta1={beta1!r}, beta2={beta2!r}, step={step!r}")
    return bcs


def _check_mode(op: str, mode: Any) -> int:
    return _choice(mode, (0, 1), "mode", op, "0 (L2 decay) or 1 (decoupled decay)")


def multi_tensor_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr, beta1: float, beta2: float,
                      epsilon: float, step, mode: int, bias_correction: int, weight_decay: float,
                      inv_scale=None) -> None:
    """Adam on ``tensor_lists = [grads, params, exp_avg, exp_avg_sq]`` (in place; grads unchanged).

    ``mode`` 0: L2 decay added to the grad (torch.optim.Adam); 1: decoupled decay (AdamW).
    ``bias_correction`` 1 divides the moments by ``1 - beta^step``. ``lr`` and ``step`` may be
    one-element tensors, and a trailing ``inv_scale`` multiplies the grads first (upstream's
    capturable form). Updates even when the flag is set, as upstream's op.
    """
    op = "multi_tensor_adam"
    gs, ps, ms, vs = _check_call(op, chunk_size, noop_flag, tensor_lists, (4,), writes=(1, 2, 3))
    lr, step = _number(lr, "lr", op), _number(step, "step", op)
    mode = _check_mode(op, mode)
    grad_scale = 1.0 if inv_scale is None else _number(inv_scale, "inv_scale", op)
    beta1, beta2 = _number(beta1, "beta1", op), _number(beta2, "beta2", op)
    eps, wd = _number(epsilon, "epsilon", op), _number(weight_decay, "weight_decay", op)
    bias_correction = _flag(bias_correction, "bias_correction", op)
    _bias_corrections(op, beta1, beta2, step, bias_correction, root=True)  # raises before any write
    for g, p, m, v in zip(gs, ps, ms, vs):
        p32, m32, v32 = _work(p), _work(m), _work(v)
        adam_math(p32, g.detach().float(), m32, v32, None, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                  weight_decay=wd, step=step, amsgrad=False, decoupled=mode == 1,
                  bias_correction=bias_correction, grad_scale=grad_scale)
        _store(p, p32)
        _store(m, m32)
        _store(v, v32)


def _work(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself when it can be updated in place as float32, else a float32 working copy."""
    if t.dtype == torch.float32:
        return t.detach()
    return _f32(t)


def multi_tensor_sgd(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, wd: float, momentum: float,
                     dampening: float, lr: float, nesterov: bool, first_run: bool, wd_after_momentum: bool,
                     scale: float = 1.0) -> None:
    """SGD on ``tensor_lists = [grads, params, momentum_buffers]`` or ``[..., model_params]`` (the fourth
    list receives each updated param rounded to its dtype, e.g. fp16 copies of fp32 masters).

    Grads are multiplied by ``scale`` first. ``first_run`` starts each momentum buffer as the
    (decayed) grad. Does nothing when the flag is already set.
    """
    op = "multi_tensor_sgd"
    lists = _check_call(op, chunk_size, noop_flag, tensor_lists, (3, 4), writes=(1, 2, 3))
    wd, momentum = _number(wd, "wd", op), _number(momentum, "momentum", op)
    dampening, lr = _number(dampening, "dampening", op), _number(lr, "lr", op)
    scale = _number(scale, "scale", op)
    nesterov, first_run = _flag(nesterov, "nesterov", op), _flag(first_run, "first_run", op)
    wd_after_momentum = _flag(wd_after_momentum, "wd_after_momentum", op)
    if _flag_is_set(noop_flag):
        return
    copies = lists[3] if len(lists) == 4 else [None] * len(lists[0])
    for g, p, buf, out in zip(lists[0], lists[1], lists[2], copies):
        p32 = _work(p)
        b32 = _work(buf) if momentum != 0 else None
        decay = p32 * wd if wd != 0 and wd_after_momentum else None
        sgd_math(p32, g.detach().float(), b32, lr=lr, momentum=momentum, dampening=dampening,
                 weight_decay=0.0 if wd_after_momentum else wd, nesterov=nesterov, first=first_run,
                 grad_scale=scale, settle=lambda t: None)
        if decay is not None:
            p32.add_(decay, alpha=-lr)
        _store(p, p32)
        if b32 is not None:
            _store(buf, b32)
        if out is not None:
            out.detach().copy_(p32)


def multi_tensor_lamb(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float, beta1: float,
                      beta2: float, epsilon: float, step, bias_correction: int, weight_decay: float,
                      grad_averaging: int, mode: int, global_grad_norm, max_grad_norm: float,
                      use_nvlamb: Optional[bool] = None) -> None:
    """LAMB on ``tensor_lists = [grads, params, exp_avg, exp_avg_sq]``, as upstream's op.

    Grads are divided by ``global_grad_norm / max_grad_norm`` when the norm exceeds
    ``max_grad_norm``; ``grad_averaging`` 1 makes the first moment's grad weight ``1 - beta1``
    (else 1); ``mode`` 0 adds the decay to the grad, 1 to the update. The trust ratio
    ``||p|| / ||update||`` (1 if either is 0) applies where ``weight_decay != 0`` or ``use_nvlamb``.
    As upstream, each grad tensor holds its update afterwards.
    """
    op = "multi_tensor_lamb"
    gs, ps, ms, vs = _check_call(op, chunk_size, noop_flag, tensor_lists, (4,), writes=(0, 1, 2, 3))
    lr, step = _number(lr, "lr", op), _number(step, "step", op)
    beta1, beta2 = _number(beta1, "beta1", op), _number(beta2, "beta2", op)
    eps, wd = _number(epsilon, "epsilon", op), _number(weight_decay, "weight_decay", op)
    mode = _check_mode(op, mode)
    norm, max_norm = _number(global_grad_norm, "global_grad_norm", op), _number(max_grad_norm, "max_grad_norm", op)
    if norm > max_norm and not max_norm > 0:
        raise ValueError(f"{op}: max_grad_norm must be > 0 to clip by global_grad_norm / max_grad_norm; got "
                         f"max_grad_norm={max_norm!r} with global_grad_norm={norm!r}")
    clip = norm / max_norm if norm > max_norm else 1.0
    bias_correction, grad_averaging = _flag(bias_correction, "bias_correction", op), _flag(grad_averaging,
                                                                                           "grad_averaging", op)
    use_nvlamb = use_nvlamb is not None and _flag(use_nvlamb, "use_nvlamb", op)
    bc1, bc2 = _bias_corrections(op, beta1, beta2, step, bias_correction, root=True)
    beta3 = 1 - beta1 if grad_averaging else 1.0
    ratio_on = use_nvlamb or wd != 0
    param_norms = _norms(op, noop_flag, ps, 1.0, True)[1].tolist() if ps else []
    updates = []
    for g, p, m, v in zip(gs, ps, ms, vs):
        p32, m32, v32 = _f32(p), _work(m), _work(v)
        g32 = l2_grad(g.detach().float() / clip, p32, 1.0, wd if mode == 0 else 0.0)
        lamb_moments(g32, m32, v32, beta1=beta1, beta2=beta2, beta3=beta3)
        u = lamb_direction(p32, m32, v32, eps=eps, weight_decay=wd if mode == 1 else 0.0, bc1=bc1, bc2=bc2)
        _store(m, m32)
        _store(v, v32)
        _store(g, u)
        updates.append(u)
    update_norms = _norms(op, noop_flag, updates, 1.0, True)[1].tolist() if updates else []
    for p, u, pn, un in zip(ps, updates, param_norms, update_norms):
        ratio = pn / un if ratio_on and pn != 0 and un != 0 else 1.0
        p32 = _work(p)
        p32.add_(u, alpha=-lr * ratio)
        _store(p, p32)


def multi_tensor_novograd(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, grad_norms: torch.Tensor,
                          lr: float, beta1: float, beta2: float, epsilon: float, step, bias_correction: int,
                          weight_decay: float, grad_averaging: int, mode: int, norm_type: int) -> None:
    """NovoGrad on ``tensor_lists = [grads, params, exp_avg]`` with ``grad_norms[i]`` the (already
    blended) second moment of tensor ``i``, as upstream's op::

        d = grad_norms[i] / bc2 + eps          bc2 = sqrt(1 - beta2^step) (1 without bias_correction)
        mode 0: m = beta1 m + beta3 (g / d + wd p);   p -= lr m / bc1
        mode 1: m = beta1 m + beta3 g;                p -= lr ((m / bc1) / d + wd p)

    with ``bc1 = 1 - beta1^step`` and ``beta3 = 1 - beta1`` when ``grad_averaging`` else 1.
    ``norm_type`` (2 or 0) names how the norms were computed.
    """
    op = "multi_tensor_novograd"
    gs, ps, ms = _check_call(op, chunk_size, noop_flag, tensor_lists, (3,), writes=(1, 2))
    if not isinstance(grad_norms, torch.Tensor) or grad_norms.numel() != len(gs):
        got = grad_norms.numel() if isinstance(grad_norms, torch.Tensor) else type(grad_norms).__name__
        raise ValueError(f"{op}: grad_norms must be a tensor with one norm per tensor ({len(gs)}), got {got}")
    if grad_norms.is_meta or grad_norms.layout != torch.strided or not grad_norms.is_floating_point():
        raise ValueError(f"{op}: grad_norms must be a dense floating-point tensor holding values, got "
                         f"{_brief(grad_norms)} ({grad_norms.layout})")
    _choice(norm_type, (0, 2), "norm_type", op, "2 (L2) or 0 (inf)")
    lr, step = _number(lr, "lr", op), _number(step, "step", op)
    beta1, beta2 = _number(beta1, "beta1", op), _number(beta2, "beta2", op)
    eps, wd = _number(epsilon, "epsilon", op), _number(weight_decay, "weight_decay", op)
    mode = _check_mode(op, mode)
    bias_correction, grad_averaging = _flag(bias_correction, "bias_correction", op), _flag(grad_averaging,
                                                                                           "grad_averaging", op)
    bc1, bc2 = _bias_corrections(op, beta1, beta2, step, bias_correction, root=True)
    bc2 = math.sqrt(bc2)
    beta3 = 1 - beta1 if grad_averaging else 1.0
    for g, p, m, gn in zip(gs, ps, ms, grad_norms.detach().float().reshape(-1).tolist()):
        p32, m32 = _work(p), _work(m)
        d = gn / bc2 + eps
        g32 = g.detach().float()
        if mode == 0:
            g32 = g32 / d
            if wd != 0:
                g32.add_(p32, alpha=wd)
            m32.mul_(beta1).add_(g32, alpha=beta3)
            p32.add_(m32, alpha=-lr / bc1)
        else:
            m32.mul_(beta1).add_(g32, alpha=beta3)
            u = m32 / bc1 / d
            if wd != 0:
                u.add_(p32, alpha=wd)
            p32.add_(u, alpha=-lr)
        _store(p, p32)
        _store(m, m32)


def multi_tensor_adagrad(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float, epsilon: float,
                         mode: int, weight_decay: float) -> None:
    """Adagrad on ``tensor_lists = [grads, params, sums]``: mode 0 adds ``weight_decay * p`` to the grad
    (L2), mode 1 to the update (decoupled); ``h += g^2``, ``p -= lr * g / (sqrt(h) + eps)``."""
    op = "multi_tensor_adagrad"
    gs, ps, hs = _check_call(op, chunk_size, noop_flag, tensor_lists, (3,), writes=(1, 2))
    lr, eps, wd = _number(lr, "lr", op), _number(epsilon, "epsilon", op), _number(weight_decay, "weight_decay", op)
    mode = _check_mode(op, mode)
    for g, p, h in zip(gs, ps, hs):
        p32, h32 = _work(p), _work(h)
        adagrad_math(p32, g.detach().float(), h32, lr=lr, eps=eps, weight_decay=wd, decoupled=mode == 1,
                     grad_scale=1.0)
        _store(p, p32)
        _store(h, h32)


# ---------------------------------------------------------------- loss scale with hysteresis
def _one_element(op: str, name: str, t: Any, kind: str) -> torch.Tensor:
    """``t`` if it is a one-element tensor of the kind ("float32", "floating point" or "integer")."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a one-element {kind} tensor, got {type(t).__name__}")
    if kind == "float32":
        ok = t.dtype == torch.float32
    elif kind == "floating point":
        ok = t.is_floating_point()
    else:
        ok = not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
    if t.is_nested or t.layout != torch.strided:
        raise TypeError(f"{op}: {name} must be a dense one-element {kind} tensor, got "
                        f"{'a nested tensor' if t.is_nested else f'layout {t.layout}'}")
    if t.is_meta:
        raise ValueError(f"{op}: {name} must hold a value, got a meta tensor")
    if t.numel() != 1 or not ok:
        raise TypeError(f"{op}: {name} must be a one-element {kind} tensor, got {t.dtype} with {t.numel()} elements")
    return t


def _int_arg(op: str, name: str, value: Any, dtype: torch.dtype = torch.int64) -> int:
    """``value`` if it is an int that ``dtype`` holds."""
    info = torch.iinfo(dtype)
    return check_int(value, f"{op}: {name}", info.min, info.max)


_FLT_TINY = torch.finfo(torch.float32).smallest_normal


def _scalars_on_host(t: torch.Tensor) -> bool:
    """Whether a one-element state is updated with Python numbers (CPU tensors: a handful of element reads and
    writes, where the tensor-op form costs some forty small ops per call)."""
    return t.device.type == "cpu"


def _wrap(value: int, dtype: torch.dtype) -> int:
    """``value`` stored into an integer tensor of ``dtype`` as a C cast stores it: modulo 2**bits."""
    info = torch.iinfo(dtype)
    span = 1 << info.bits
    return (value - info.min) % span + info.min


def _to_f32(x: float) -> float:
    """``x`` rounded to float32: to nearest, and to an infinity beyond what rounds to the largest finite one."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _hysteresis_on_host(scale, growth, hyst, found, growth_f, backoff_f, interval, hysteresis) -> None:
    """`update_scale_hysteresis` on Python numbers: the same rules, products and roundings as the device form
    (the counts compared as int64, stored as the tracker's dtype stores them)."""
    f = _to_f32(float(found.item()))
    kept = float(scale.item())
    g, h = int(growth.item()), int(hyst.item())
    over = f > 0
    if over:
        h -= 1
    held = over and _wrap(h, torch.int64) > 0
    backoff = not held and f != 0  # nan != 0 too
    due = f == 0 and _wrap(g + 1, torch.int64) == interval
    if backoff or due:
        read = kept * 0.0 if abs(kept) < _FLT_TINY else kept  # a subnormal scale reads as zero
        new = _to_f32(read * (backoff_f if backoff else growth_f))  # the product in float64, rounded once
        new = new * 0.0 if abs(new) < _FLT_TINY else new
        if backoff or math.isfinite(new):
            scale.detach().fill_(new)
    growth.detach().fill_(0 if held or backoff or due else _wrap(g + 1, growth.dtype))
    hyst.detach().fill_(hysteresis if f <= 0 else _wrap(h, hyst.dtype))


def _hysteresis_on_device(scale, growth, hyst, found, growth_f, backoff_f, interval, hysteresis) -> None:
    """`update_scale_hysteresis` as tensor ops on the tensors' device: no host synchronisation."""
    with torch.no_grad():
        f = found.detach().reshape(()).to(torch.float32)
        kept = scale.detach().reshape(())
        g1 = growth.detach().reshape(()).to(torch.int64) + 1  # counts in int64; stored wrapped by copy_
        h0 = hyst.detach().reshape(()).to(torch.int64)
        over = f > 0
        h = torch.where(over, h0 - 1, h0)
        held = over & (h > 0)                 # an overflow the hysteresis absorbs: only the growth count resets
        backoff = (f != 0) > held             # nonzero (nan too) and not held
        due = (f == 0) & (g1 == interval)
        # flush-to-zero reads and writes: x * (|x| >= tiny) is x, or a zero of x's sign (an inf is kept)
        read = kept * (kept.abs() >= _FLT_TINY)
        if _to_f32(backoff_f) == backoff_f and _to_f32(growth_f) == growth_f:
            # float32 factors: the float32 product is the exact product rounded once, as the float64 one is
            new = torch.where(backoff, read * backoff_f, read * growth_f)
        else:
            read = read.to(torch.float64)
            new = torch.where(backoff, read * backoff_f, read * growth_f).to(torch.float32)
        size = new.abs()
        new = new * (size >= _FLT_TINY)
        # written in place (kept views the scale); |x| < inf is finiteness from the magnitude already taken
        torch.where(backoff | (due & (size < math.inf)), new, kept, out=kept)
        growth.detach().copy_(torch.where(held | backoff | due, 0, g1).reshape(growth.shape))
        hyst.detach().copy_(torch.where(f <= 0, hysteresis, h).reshape(hyst.shape))


def update_scale_hysteresis(current_scale: torch.Tensor, growth_tracker: torch.Tensor,
                            hysteresis_tracker: torch.Tensor, found_inf: torch.Tensor, growth_factor: float,
                            backoff_factor: float, growth_interval: int, hysteresis: int) -> torch.Tensor:
    """One loss-scale update of a dynamic scaler that tolerates ``hysteresis`` overflowing steps before it
    backs off, as upstream's op (Megatron/NeMo-style scalers); updates the three state tensors in place and
    returns ``current_scale``.

    With ``f = found_inf``:

    * ``f > 0``: ``hysteresis_tracker -= 1``; while it stays above 0, only ``growth_tracker = 0`` (the scale
      is kept);
    * otherwise, ``f`` nonzero (a nan too): ``scale *= backoff_factor`` (no floor), ``growth_tracker = 0``;
    * ``f`` zero: ``growth_tracker += 1``; when it reaches ``growth_interval``, ``scale *= growth_factor``
      unless that is not finite in float32, and ``growth_tracker = 0``;
    * ``f <= 0``: ``hysteresis_tracker = hysteresis``.

    A new scale is the product in float64 rounded once to float32, with upstream's flush-to-zero float32
    arithmetic (its kernel is built with fast math): a scale below float32's smallest normal is read as 0,
    and a product that rounds below it is stored as 0. So backing off from ``2**-126`` by 0.5 gives 0, not a
    subnormal, and a zero scale stays 0.

    ``current_scale`` is a one-element float32 tensor, ``found_inf`` a one-element floating point tensor,
    the trackers one-element integer tensors (``hysteresis`` must fit the tracker's dtype), all on one
    device. The update is computed with tensor ops on that device (no host synchronisation); arguments
    are checked before anything is written.
    """
    op = "update_scale_hysteresis"
    scale = _one_element(op, "current_scale", current_scale, "float32")
    growth = _one_element(op, "growth_tracker", growth_tracker, "integer")
    hyst = _one_element(op, "hysteresis_tracker", hysteresis_tracker, "integer")
    found = _one_element(op, "found_inf", found_inf, "floating point")
    devices = {t.device for t in (scale, growth, hyst, found)}
    if len(devices) > 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    growth_f, backoff_f = _number(growth_factor, "growth_factor", op), _number(backoff_factor, "backoff_factor", op)
    interval = _int_arg(op, "growth_interval", growth_interval)
    hysteresis = _int_arg(op, "hysteresis", hysteresis, hyst.dtype)

    if _scalars_on_host(scale):
        _hysteresis_on_host(scale, growth, hyst, found, growth_f, backoff_f, interval, hysteresis)
    else:
        _hysteresis_on_device(scale, growth, hyst, found, growth_f, backoff_f, interval, hysteresis)
    return current_scale
