"""Process-group plumbing shared by DistributedDataParallel, Reducer, SyncBatchNorm and amp's combine_ddp.

Everything rides ``torch.distributed`` (gloo on cpu, nccl on cuda, hccl on npu);
there is no transport of our own. What this module adds:

* ``default_backend``: the backend name for a device type;
* ``CollectiveError``: every collective failure (a rank that died, one that never
  arrived within the process group's timeout, mismatched calls) is re-raised as
  one exception type whose message says which operation failed and why that
  usually happens, instead of a transport-level message;
* ``agree_layout``: ranks compare a list of (name, shape, dtype) entries with one
  small all-reduce; only when they differ is the full list gathered, so that every
  rank raises the same error naming the first difference (and no rank hangs in a
  later collective of a different size, or aborts: gloo terminates the process
  when the sizes of one collective differ across ranks);
* ``agree_values``: the same for named options that fix a collective's size;
* ``check_process_group``: a TypeError naming the argument for anything but a
  process group, before any collective is attempted with it;
* ``broadcast_tensors`` / ``flat_dist_call``: collectives over many tensors
  through a few flat buffers (one per dtype x device, split into chunks).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import _device

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}

#: chunk size (elements) of flat collectives over many tensors, by element size (96 MiB per chunk)
_CHUNK_BYTES = 96 * 2**20


class CollectiveError(RuntimeError):
    """A torch.distributed collective failed or timed out (the original error is the ``__cause__``)."""


def default_backend(device: Any = None) -> str:
    """torch.distributed backend for a device: "gloo" (cpu), "nccl" (cuda), "hccl" (npu).

    ``device`` is a device type, a ``torch.device`` or None (the device apex
    detects, see ``apex._device.detect_device``).
    """
    kind = _device.autocast_device_type(device)
    return _BACKENDS[kind]


def require_initialized(what: str) -> None:
    if not dist.is_available():
        raise RuntimeError(f"{what} needs torch.distributed, which this torch build does not provide")
    if not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs an initialized default process group: call torch.distributed.init_process_group("
            f"backend=apex.parallel.default_backend(), ...) first (torchrun sets the rank and world size)"
        )


def check_process_group(value: Any, what: str) -> None:
    """TypeError unless ``value`` is a torch.distributed process group or None (the default group); ``what``
    names the argument ("apex.parallel.DistributedDataParallel: process_group")."""
    pg_type = getattr(dist, "ProcessGroup", None) if dist.is_available() else None
    if value is not None and pg_type is not None and not isinstance(value, pg_type):
        raise TypeError(f"{what} must be a torch.distributed process group (or None for the default group), got "
                        f"{value!r:.80} ({type(value).__name__})")


def group_or_world(group: Any) -> Any:
    return dist.group.WORLD if group is None else group


def world_size(group: Any = None) -> int:
    return dist.get_world_size(group_or_world(group))


def group_timeout(group: Any = None) -> Optional[datetime.timedelta]:
    """The process group's collective timeout, where torch exposes it (for messages only)."""
    pg = group_or_world(group)
    for device in ("cpu", "cuda", "npu"):
        try:
            backend = pg._get_backend(torch.device(device))
            return backend.options._timeout
        except Exception:  # backends differ in what they expose; the timeout is only informative
            continue
    return None


def describe_failure(what: str, group: Any = None) -> str:
    timeout = group_timeout(group)
    within = f" within the process group timeout ({timeout})" if timeout is not None else ""
    return (
        f"{what} failed. Usually a rank died, did not arrive{within}, or ran a different sequence of "
        "collectives (a different model, number of backward passes or steps on some rank)"
    )


@contextlib.contextmanager
def collective(what: str, group: Any = None) -> Iterator[None]:
    """Re-raise any failure inside as CollectiveError with a message naming ``what``."""
    try:
        yield
    except CollectiveError:
        raise
    except (RuntimeError, ValueError) as exc:  # torch's DistBackendError / DistNetworkError are RuntimeErrors
        raise CollectiveError(f"{describe_failure(what, group)}: {exc}") from exc


def check_device_backend(tensor: torch.Tensor, group: Any, what: str) -> None:
    """A clear error when the tensors' device cannot go through the group's backend (e.g. cpu over nccl)."""
    try:
        backend = str(dist.get_backend(group_or_world(group))).lower()
    except (RuntimeError, ValueError):
        return
    kind = tensor.device.type
    if backend == "nccl" and kind != "cuda":
        raise RuntimeError(f"{what}: tensors are on {kind} but the process group's backend is nccl (cuda only); "
                           f"use backend={default_backend(kind)!r} for {kind}")
    if backend == "hccl" and kind != "npu":
        raise RuntimeError(f"{what}: tensors are on {kind} but the process group's backend is hccl (npu only); "
                           f"use backend={default_backend(kind)!r} for {kind}")


def _collective_device(group: Any) -> torch.device:
    """Device of the small bookkeeping tensors: cpu for gloo, the current accelerator otherwise."""
    backend = str(dist.get_backend(group_or_world(group))).lower()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "hccl":
        return torch.device("npu", torch.npu.current_device())  # only reachable with torch_npu loaded
    return torch.device("cpu")


def any_across_ranks(flag: bool, group: Any = None, what: str = "agreeing on a flag") -> bool:
    """True on every rank if ``flag`` is True on any rank (one all-reduce of one element)."""
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float32, device=_collective_device(group))
    with collective(what, group):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group_or_world(group))
    return bool(t.item() > 0)


# ---------------------------------------------------------------- layout agreement

LayoutEntry = Tuple[str, Tuple[int, ...], str]


def _signature(entries: Sequence[LayoutEntry]) -> List[int]:
    """Deterministic across processes (Python's hash() of strings is not)."""
    digest = hashlib.sha256(repr(list(entries)).encode()).digest()
    return [int.from_bytes(digest[i:i + 7], "little") for i in (0, 7, 14)] + [len(entries)]


def _first_difference(mine: Sequence[LayoutEntry], others: List[Sequence[LayoutEntry]]) -> Tuple[int, int]:
    """(index, rank) of the first entry where some rank differs from rank 0."""
    ref = others[0]
    best = None
    for rank, theirs in enumerate(others[1:], start=1):
        n = max(len(ref), len(theirs))
        for i in range(n):
            a = ref[i] if i < len(ref) else None
            b = theirs[i] if i < len(theirs) else None
            if a != b:
                if best is None or i < best[0]:
                    best = (i, rank)
                break
    assert best is not None  # only called when the signatures differ
    return best


def _describe_entry(entry: Optional[LayoutEntry], noun: str) -> str:
    if entry is None:
        return f"no {noun} there"
    name, shape, dtype = entry
    return f"{name!r} of shape {tuple(shape)} ({dtype})"


def _plural(noun: str) -> str:
    return noun[:-1] + "ies" if noun.endswith("y") else noun + "s"  # "state_dict entry" -> "state_dict entries"


def agree_layout(entries: Sequence[LayoutEntry], what: str, noun: str = "parameter", group: Any = None,
                 hint: str = "") -> None:
    """Raise the same RuntimeError on every rank unless all ranks hold identical ``entries``.

    One all-reduce of a signature; the full lists are gathered only when they differ.
    """
    pg = group_or_world(group)
    if _same_everywhere(_signature(entries), f"{what}: comparing the {noun} layout across ranks", group):
        return
    gathered: List[Any] = [None] * dist.get_world_size(pg)
    with collective(f"{what}: gathering the {noun} layouts of all ranks", group):
        dist.all_gather_object(gathered, list(entries), group=pg)
    index, rank = _first_difference(entries, gathered)
    ref, theirs = gathered[0], gathered[rank]
    a = ref[index] if index < len(ref) else None
    b = theirs[index] if index < len(theirs) else None
    raise RuntimeError(
        f"{what}: the {_plural(noun)} differ across ranks. First difference at {noun} {index}: rank 0 has "
        f"{_describe_entry(a, noun)}, rank {rank} has {_describe_entry(b, noun)} (rank 0 lists {len(ref)}, "
        f"rank {rank} lists {len(theirs)}). Every rank must build the same model{hint}."
    )


def _same_everywhere(signature: List[int], what: str, group: Any) -> bool:
    """Whether every rank of the group holds the same ``signature`` (one all-reduce of a fixed size)."""
    sig = torch.tensor(signature, dtype=torch.int64)
    both = torch.cat([sig, -sig]).to(_collective_device(group))
    with collective(what, group):
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group_or_world(group))
    n = sig.numel()
    return torch.equal(both[:n].cpu(), -both[n:].cpu())  # max == min everywhere: all ranks agree


def _describe_ranks(values: List[str], ranks: List[int], limit: int = 8) -> str:
    """'3 on rank 0, 4 on ranks 1, 2' for the per-rank ``values`` (at most ``limit`` values and ranks each)."""
    by_value: Dict[str, List[int]] = {}
    for value, rank in zip(values, ranks):
        by_value.setdefault(value, []).append(rank)
    parts = []
    for value, where in list(by_value.items())[:limit]:
        listed = ", ".join(map(str, where[:limit])) + (", ..." if len(where) > limit else "")
        parts.append(f"{value} on rank{'s' if len(where) > 1 else ''} {listed}")
    if len(by_value) > limit:
        parts.append(f"{len(by_value) - limit} more values")
    return ", ".join(parts)


def agree_values(named: Sequence[Tuple[str, Any]], what: str, group: Any = None, hint: str = "") -> None:
    """Raise the same RuntimeError on every rank unless all ranks hold equal values (compared by ``repr``) under
    each name: options that fix the size or the sequence of later collectives.

    One all-reduce of a fixed size (a signature); the values are gathered only when they differ, and the error
    names the first option that differs with the value of every rank (global ranks).
    """
    pg = group_or_world(group)
    entries = [(name, repr(value)) for name, value in named]
    if dist.get_world_size(pg) == 1:
        return
    if _same_everywhere(_signature(entries), f"{what}: comparing {entries[0][0]} across ranks", group):
        return
    gathered: List[Any] = [None] * dist.get_world_size(pg)
    with collective(f"{what}: gathering {entries[0][0]} of all ranks", group):
        dist.all_gather_object(gathered, entries, group=pg)
    ranks = list(range(len(gathered))) if pg is dist.group.WORLD else dist.get_process_group_ranks(pg)
    for i, (name, _) in enumerate(entries):
        values = [theirs[i][1] if i < len(theirs) else "nothing" for theirs in gathered]
        if len(set(values)) > 1:
            raise RuntimeError(f"{what}: {name} differs across the ranks of the process group: "
                               f"{_describe_ranks(values, ranks)}{hint}")
    listed = _describe_ranks([repr([name for name, _ in theirs]) for theirs in gathered], ranks)
    raise RuntimeError(f"{what}: the ranks compare different options: {listed}{hint}")


def layout_of(named: Sequence[Tuple[str, torch.Tensor]]) -> List[LayoutEntry]:
    return [(name, tuple(t.shape), str(t.dtype).replace("torch.", "")) for name, t in named]


# ---------------------------------------------------------------- flat collectives over many tensors


def split_by_kind(tensors: Sequence[torch.Tensor]) -> Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]]:
    out: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.dtype, t.device), []).append(t)
    return out


def _chunks(tensors: List[torch.Tensor]) -> Iterator[List[torch.Tensor]]:
    """Consecutive runs of tensors of at most _CHUNK_BYTES (a larger single tensor is its own run)."""
    run: List[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if run and size + nbytes > _CHUNK_BYTES:
            yield run
            run, size = [], 0
        run.append(t)
        size += nbytes
    if run:
        yield run


def flat_dist_call(tensors: Sequence[torch.Tensor], call: Callable[..., Any], extra_args: Optional[tuple] = None,
                   group: Any = None, what: str = "flat collective") -> None:
    """Apply a collective (``dist.all_reduce``, ``dist.broadcast``) to many tensors through flat buffers.

    Tensors are grouped by dtype and device and copied into flat chunks; each
    chunk is one collective; results are copied back. As upstream apex, an
    all-reduce is averaged over the group's ranks.
    """
    tensors = list(tensors) if not isinstance(tensors, torch.Tensor) else [tensors]
    for k, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: tensors[{k}] must be a tensor, got {type(t).__name__}")
    pg = group_or_world(group)
    extra_args = tuple(extra_args or ())
    average = call is dist.all_reduce
    ws = dist.get_world_size(pg)
    for ts in split_by_kind([t for t in tensors if t.numel()]).values():
        check_device_backend(ts[0], group, what)
        for run in _chunks(ts):
            flat = torch.cat([t.detach().reshape(-1) for t in run])
            with collective(what, group):
                call(flat, *extra_args, group=pg)
            if average:
                flat.div_(ws)
            with torch.no_grad():
                offset = 0
                for t in run:
                    n = t.numel()
                    t.copy_(flat[offset:offset + n].view_as(t))
                    offset += n


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int = 0, group: Any = None,
                      what: str = "broadcasting from rank 0") -> None:
    """Every rank's ``tensors`` receive rank ``src``'s values (in place, through flat chunks)."""
    if world_size(group) == 1:
        return
    flat_dist_call(list(tensors), dist.broadcast, (src,), group=group, what=what)
