"""How ring-flash-attn's calls become ``ContextParallel`` calls.

Its packed ``[total_local, h, d]`` tensors are one row of a ``[1, S, h, d]`` sequence; its ``cu_seqlens``
are a document mask over the global sequence; the way it splits each document over the ranks is an
explicit :class:`cpattn.layout.Layout`:

- ring varlen: every document cut into P equal contiguous pieces, rank r holding piece r of each, so the
  local ``cu_seqlens`` are the global ones divided by P (``schedule="ring"``);
- zigzag varlen: every document cut into 2P equal chunks, rank r holding chunks r and 2P-1-r of each
  (``schedule="zigzag_ring"``);
- llama3: the contiguous slice ``[r S/P, (r+1) S/P)`` of the packed row, documents of any length
  (``schedule="allgather"``, ``layout="contiguous"``).

One ``ContextParallel`` is kept per (schedule, group, length, mask, layout) and found again by the
identity of the ``cu_seqlens`` tensor a call passes (its host values are read once per tensor and
version), so a model's layers reuse one object per step without reading the device.
"""

from __future__ import annotations

import os
import weakref
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ... import agree, cost, schedules
from ...api import ContextParallel, _exchange_device
from ...core import layout as layout_mod
from ...core.comm import Communicator
from ...core.masks import Mask
from ...core.memo import BoundedCache
from ...functional import refuse_dropout_and_alibi, refuse_nondeterministic_device
from ...packing import document_lengths as _lengths
from ...packing import document_mask, read_bounds
from ...packing import show_bounds as _show
from ...schedules.base import Schedule

#: ContextParallel objects kept (a step's few; one per distinct documents, schedule and group)
OBJECTS_KEPT = 32
_OBJECTS = BoundedCache(OBJECTS_KEPT)  # by value: (schedule, ranks, seq_len, mask, layout)
_BY_TENSOR = BoundedCache(OBJECTS_KEPT)  # by a cu_seqlens tensor's identity and version: the object above
#: the last OBJECTS_KEPT records of llama3_flash_attn_prepare_cu_seqlens, by the identity of the cu_seqlens_q it
#: returned (the record holds that tensor, so its id is not reused while the record is kept)
_PREPARED: OrderedDict[int, Prepared] = OrderedDict()
#: a process group -> (rank, global ranks of its members); weak keys: torch.distributed owns the groups
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def refuse_unsupported(dropout_p, alibi_slopes, deterministic, device: torch.device) -> None:
    """The arguments ring-flash-attn takes that cpattn refuses, as ``cpattn.functional`` refuses them."""
    refuse_dropout_and_alibi(dropout_p, alibi_slopes)
    refuse_nondeterministic_device(deterministic, device)


def members(group) -> tuple[int, tuple[int, ...]]:
    """This process's rank in ``group`` and the global ranks of its members (one rank without
    torch.distributed)."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialised")
        return 0, (0,)
    group = dist.group.WORLD if group is None else group
    found = _GROUPS.get(group)
    if found is None:
        found = _GROUPS[group] = (dist.get_rank(group), tuple(dist.get_process_group_ranks(group)))
    return found


def _version(t: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by in-place changes); None for an inference tensor, which has none."""
    try:
        return t._version
    except RuntimeError:
        return None


# ------------------------------------------------------------------ the schedule behind a borrowed call
#: names the schedule (or "auto") behind the borrowed calls whose code passes none
SCHEDULE_ENV = "CPATTN_SCHEDULE"


def requested_schedule(schedule: str | Schedule | None = None) -> str | Schedule | None:
    """The schedule a borrowed call asks for: ``schedule`` when given, else ``$CPATTN_SCHEDULE``, else None
    (the call's own schedule)."""
    if schedule is not None:
        return schedule
    return os.environ.get(SCHEDULE_ENV) or None


def _runs_on(sched: Schedule, layout: layout_mod.Layout, mask: Mask) -> str | layout_mod.Layout | None | bool:
    """The ``layout`` argument that makes ``sched`` run on the caller's ``layout`` (None: the schedule's own
    layout is the caller's), or False when it cannot without moving tokens."""
    if sched.custom_layout and layout.name != "striped":
        return layout
    if layout.rank_ranges is None and layout.name == sched.layout_for(mask):
        return None
    return False


def schedule_for_layout(requested: str | Schedule, layout: layout_mod.Layout, mask: Mask, seq_len: int, world: int,
                        shape: tuple) -> tuple[str | Schedule, str | layout_mod.Layout | None]:
    """``(schedule, layout argument)`` of a ContextParallel that runs ``requested`` (a name, a schedule object
    or ``"auto"``) on the caller's ``layout``; ``shape`` = ``(batch, heads, kv_heads, head_dim, dtype)``.
    ``"auto"``: the cost model's choice (``cpattn.cost.choose``) among :func:`candidates`. A schedule that
    needs another layout raises ``ValueError``: a borrowed call's tokens are never laid out again."""
    if isinstance(requested, str) and requested == "auto":
        names = candidates(layout, mask)
        name, _why = cost.choose(problem(layout, mask, seq_len, world, shape), topology(world), names)
        return name, _runs_on(schedules.resolve(name), layout, mask)
    sched = schedules.resolve(requested)
    arg = _runs_on(sched, layout, mask)
    if arg is False:
        raise ValueError(f"schedule={sched.name!r} runs on its own {sched.layout_for(mask)!r} layout, but this call's "
                         f"tokens are in the {layout.name!r} layout, and a borrowed call's tensors are never laid out "
                         f"again; schedules that run on it: {', '.join(candidates(layout, mask, every=True))} (or "
                         "'auto')")
    return requested, arg


def candidates(layout: layout_mod.Layout, mask: Mask, every: bool = False) -> list[str]:
    """The schedules that run on ``layout`` as it is, in registry order: ``"auto"``'s (those the cost model
    estimates from their steps, ``cpattn.cost.default_candidates`` of the mask, leaving out the ones that plan:
    a borrowed call's documents change every step, and a plan costs seconds), or ``every`` registered one."""
    names = schedules.names() if every else cost.default_candidates(mask)
    return [n for n in names if _runs_on(schedules.get(n), layout, mask) is not False
            and (every or cost.declares_steps(n))]


def problem(layout: layout_mod.Layout, mask: Mask, seq_len: int, world: int, shape: tuple) -> cost.Problem:
    """The cost model's problem of a borrowed call: its length, mask, layout and shape ``(batch, heads,
    kv_heads, head_dim, dtype)``."""
    batch, heads, kv_heads, head_dim, dtype = shape
    return cost.Problem(seq_len, world, mask, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                        dtype=str(dtype).removeprefix("torch."), layout=layout)


def topology(world: int) -> cost.Topology:
    """Where ``"auto"`` estimates a borrowed call: this machine's preset (its calibration profile, else
    conservative defaults), the same on every rank."""
    return cost.presets.this_machine(world, "schedule='auto' behind a borrowed call")


# ------------------------------------------------------------------ bytes the borrowed calls moved
_LIVE: weakref.WeakSet = weakref.WeakSet()  # the ContextParallel objects made here that are still alive
_FOLDED: dict[str, dict[str, int]] = {}  # the counts of those collected since


def _add(into: dict[str, dict[str, int]], stats: dict[str, dict[str, int]]) -> None:
    for op, counts in stats.items():
        if op == "levels":
            continue
        acc = into.setdefault(op, {})
        for k, v in counts.items():
            acc[k] = acc.get(k, 0) + v


def _made(cp: ContextParallel) -> ContextParallel:
    """Count ``cp``'s traffic in :func:`comm_stats`, while it lives and after."""
    _LIVE.add(cp)
    weakref.finalize(cp, lambda comm=cp.comm: _add(_FOLDED, comm.stats()))
    return cp


def comm_stats() -> dict[str, dict[str, int]]:
    """Bytes sent and received and calls per op kind on this rank over every borrowed call that ran through
    a ContextParallel of the compat layer, since the process started or :func:`reset_comm_stats`."""
    out: dict[str, dict[str, int]] = {}
    _add(out, _FOLDED)
    for cp in list(_LIVE):
        _add(out, cp.comm.stats())
    out.setdefault("total", {"calls": 0, "bytes_sent": 0, "bytes_recv": 0, "wire_sent": 0})
    return out


def reset_comm_stats() -> None:
    _FOLDED.clear()
    for cp in list(_LIVE):
        cp.reset_comm_stats()


def context_parallel(what: str, group, settings, schedule: str | Schedule | None = None,
                     shape: tuple | None = None) -> ContextParallel:
    """The ContextParallel for ``settings()`` -> ``(schedule, seq_len, mask, layout)``, made once and kept by
    value. When it is new (a step's first call, on every rank alike) the ranks first agree (one small
    exchange): an error ``settings()`` raised on any rank is raised on every rank, the same, before any
    attention traffic; then every rank makes it (collectively). ``schedule``: the schedule a caller asked
    for (see :func:`requested_schedule`) in place of the call's own, on the call's layout (see
    :func:`schedule_for_layout`; ``shape`` as it takes it)."""
    _rank, ranks = members(group)
    error, key = None, None
    try:
        schedule_, seq_len, mask, layout = settings()
        if schedule is not None:
            given = layout_mod.Layout(layout) if isinstance(layout, str) else layout
            schedule_, layout = schedule_for_layout(schedule, given, mask, seq_len, len(ranks), shape)
        key = (schedule_, ranks, seq_len, mask, layout)
    except Exception as exc:  # reaches every rank (agree), or the others would wait
        error = exc
    if key is not None and key in _OBJECTS:
        return _OBJECTS.get(key, None)
    if len(ranks) > 1:
        comm = Communicator(group, record=False)
        agree.agree(comm, what, {}, error, _exchange_device(comm))
    elif error is not None:
        raise error
    return _OBJECTS.get(key, lambda: _made(ContextParallel(seq_len, mask=mask, schedule=schedule_, group=group,
                                                           layout=layout)))


# ------------------------------------------------------------------ ring and zigzag varlen
def per_document_layout(local_bounds: tuple[int, ...], world: int, zigzag: bool) -> layout_mod.Layout:
    """The explicit layout of documents split over ``world`` ranks as ring-flash-attn's varlen functions
    split them: each local document is 1/world of its global one (contiguous pieces, or zigzag chunks r and
    2P-1-r), at global offset ``world`` times its local one."""
    rule = layout_mod.Layout("zigzag" if zigzag else "contiguous")  # of one document, at its offset
    ranks: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for a, b in zip(local_bounds, local_bounds[1:]):
        n, start = b - a, world * a
        if n == 0:
            continue
        for r in range(world):
            ranks[r] += [(start + lo, start + hi) for lo, hi in rule.ranges(world * n, world, r)]
    return layout_mod.Layout.explicit(ranks, name="ring_flash_attn zigzag varlen" if zigzag
                                      else "ring_flash_attn ring varlen")


def varlen_object(q: torch.Tensor, cu_seqlens, group, zigzag: bool, is_causal: bool,
                  window_size, kv_heads: int | None = None) -> ContextParallel:
    """The ContextParallel of a ring or zigzag varlen call with local ``cu_seqlens``; found by the tensor's
    identity and version after its first call. ``$CPATTN_SCHEDULE`` (:func:`requested_schedule`) replaces
    ``ring`` / ``zigzag_ring`` on the same per-document layout (``kv_heads``: k's heads, for ``"auto"``)."""
    _rank, ranks = members(group)
    world = len(ranks)
    version = _version(cu_seqlens) if isinstance(cu_seqlens, torch.Tensor) else None
    fast = version is not None  # found again by identity only while in-place changes would show
    requested = requested_schedule()
    shape = None if requested is None else (1, q.shape[1], kv_heads or q.shape[1], q.shape[2], q.dtype)
    key = ("varlen", id(cu_seqlens), version, zigzag, ranks, bool(is_causal),
           tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size, q.shape[0], requested, shape)

    def settings():
        bounds = read_bounds(cu_seqlens, "cu_seqlens")
        if bounds[-1] != q.shape[0]:
            raise ValueError(f"cu_seqlens ends at {bounds[-1]} but q holds {q.shape[0]} tokens (dim 0): the local "
                             "cu_seqlens must sum to the local tensor's length")
        odd = next((i for i, (a, b) in enumerate(zip(bounds, bounds[1:])) if (b - a) % 2), None) if zigzag else None
        if odd is not None:
            raise ValueError(f"cu_seqlens: document {odd} has {bounds[odd + 1] - bounds[odd]} local tokens; the "
                             f"zigzag layout holds two equal chunks of every document per rank, so every local "
                             "document length must be even")
        mask = document_mask([world * n for n in _lengths(bounds)], is_causal, window_size)
        return "zigzag_ring" if zigzag else "ring", world * bounds[-1], mask, per_document_layout(bounds, world, zigzag)

    what = f"{'zigzag_' if zigzag else ''}ring_flash_attn_varlen_func"
    if not fast:
        return context_parallel(what, group, settings, requested, shape)
    return _BY_TENSOR.get_for(cu_seqlens, key, lambda: context_parallel(what, group, settings, requested, shape))


def packed_attention(cp: ContextParallel, q, k, v, softmax_scale, return_attn_probs, softcap=None, sinks=None):
    """``cp.attention`` on packed ``[total, h, d]`` tensors (one row): ``out [total, h, d]`` or ``(out, lse [h,
    total], None)``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a packed [total_tokens, heads, head_dim] tensor, got "
                             + (f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__))
    out, lse = cp.attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale=softmax_scale,
                            return_lse=True, softcap=softcap, sinks=sinks)
    return (out[0], lse[0], None) if return_attn_probs else out[0]


def varlen_call(zigzag: bool, q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, is_causal, window_size,
                alibi_slopes, deterministic, return_attn_probs, group):
    """``ring_flash_attn_varlen_func`` (``zigzag=False``) and ``zigzag_ring_flash_attn_varlen_func``."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError("q must be a packed [total_tokens, heads, head_dim] tensor")
    refuse_unsupported(dropout_p, alibi_slopes, deterministic, q.device)
    cp = varlen_object(q, cu_seqlens, group, zigzag, is_causal, window_size,
                       k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 3 else None)
    return packed_attention(cp, q, k, v, softmax_scale, return_attn_probs)


# ------------------------------------------------------------------ llama3 (all-gather) varlen
@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare` returned on this rank, and the global documents it came from."""

    bounds: tuple[int, ...]  # the global cu_seqlens
    causal: bool
    rank: int
    world: int
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    q_bounds: tuple[int, ...]
    k_bounds: tuple[int, ...]
    max_seqlen_q: int
    max_seqlen_k: int
    local_k_slice: slice
    version: int | None  # cu_seqlens_q's, when prepared (None: an inference tensor)


def prepare(cu_seqlens, is_causal: bool, rank: int, world_size: int):
    """``llama3_flash_attn_prepare_cu_seqlens``: this rank's slice of the packed row in flash-attn's varlen
    terms, and the record of the global documents behind it."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
    bounds = read_bounds(cu_seqlens, "cu_seqlens")
    total = bounds[-1]
    if total == 0 or total % world_size:
        raise ValueError(f"cu_seqlens ends at {total} tokens, which {world_size} ranks cannot split into equal "
                         f"contiguous slices: the total must be a positive multiple of {world_size} (pad the packed "
                         "row, e.g. into its last document: cu_seqlens[-1] += pad)")
    n = total // world_size
    lo, hi = rank * n, (rank + 1) * n
    first = bisect_left(bounds, lo)  # the documents that meet [lo, hi): boundaries first .. last
    if bounds[first] != lo:
        first -= 1
    last = bisect_left(bounds, hi)
    held = bounds[first:last + 1]
    q_bounds = (0, *(b - lo for b in held[1:-1]), n)
    k_left = held[0]
    k_right = hi if is_causal else held[-1]
    k_bounds = (*(b - k_left for b in held[:-1]), k_right - k_left)
    max_q = max(b - a for a, b in zip(q_bounds, q_bounds[1:]))
    max_k = max(b - a for a, b in zip(k_bounds, k_bounds[1:]))
    like = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else torch.empty(0, dtype=torch.int32)
    cu_q = torch.tensor(q_bounds, dtype=like.dtype, device=like.device)
    cu_k = torch.tensor(k_bounds, dtype=like.dtype, device=like.device)
    record = Prepared(bounds, bool(is_causal), rank, world_size, cu_q, cu_k, q_bounds, k_bounds, max_q, max_k,
                      slice(k_left, k_right), _version(cu_q))
    _PREPARED[id(cu_q)] = record
    while len(_PREPARED) > OBJECTS_KEPT:
        _PREPARED.popitem(last=False)
    return cu_q, cu_k, max_q, max_k, slice(k_left, k_right)


def _find_prepared(cu_seqlens_q, cu_seqlens_k, rank: int, world: int) -> Prepared:
    """The record of the prepared values a call passes: by the identity of ``cu_seqlens_q``, else by the
    values of both (read from the device); ValueError when no prepared values of this process match."""
    record = _PREPARED.get(id(cu_seqlens_q))
    if record is not None and record.cu_seqlens_q is cu_seqlens_q and record.version == _version(cu_seqlens_q):
        return record
    q_bounds = read_bounds(cu_seqlens_q, "cu_seqlens_q")
    k_bounds = read_bounds(cu_seqlens_k, "cu_seqlens_k")
    for record in reversed(_PREPARED.values()):
        if (record.q_bounds, record.k_bounds, record.rank, record.world) == (q_bounds, k_bounds, rank, world):
            return record
    raise ValueError("cu_seqlens_q and cu_seqlens_k were not made by llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, "
                     f"causal, rank={rank}, world_size={world}) in this process: cpattn runs the packed row's global "
                     "documents, which it learns there; call it with the global cu_seqlens first (as "
                     "update_ring_flash_attn_params does) and pass its values")


def _check_prepared(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    heads_k_stride, local_k_slice, is_causal: bool, rank: int, world: int) -> Prepared:
    """The record of the prepared values a llama3 call passes, after checking them against it."""
    record = _find_prepared(cu_seqlens_q, cu_seqlens_k, rank, world)
    if cu_seqlens_k is not record.cu_seqlens_k and read_bounds(cu_seqlens_k, "cu_seqlens_k") != record.k_bounds:
        raise ValueError(f"cu_seqlens_k {_show(read_bounds(cu_seqlens_k, 'cu_seqlens_k'))} is not the one prepared "
                         f"with cu_seqlens_q ({_show(record.k_bounds)})")
    given = (max_seqlen_q, max_seqlen_k)
    if given != (record.max_seqlen_q, record.max_seqlen_k):
        raise ValueError(f"max_seqlen_q, max_seqlen_k = {given} do not match the prepared values "
                         f"({record.max_seqlen_q}, {record.max_seqlen_k})")
    if not isinstance(local_k_slice, slice) or local_k_slice != record.local_k_slice:
        raise ValueError(f"local_k_slice={local_k_slice!r} does not match the prepared one, "
                         f"{record.local_k_slice!r}: pass the values llama3_flash_attn_prepare_cu_seqlens returned")
    if bool(is_causal) != record.causal:
        raise ValueError(f"causal={bool(is_causal)}, but the cu_seqlens were prepared with causal={record.causal}")
    if (record.rank, record.world) != (rank, world):
        raise ValueError(f"the cu_seqlens were prepared for rank {record.rank} of {record.world}, but this process is "
                         f"rank {rank} of the group's {world}")
    n = record.bounds[-1] // world
    for name, t in (("q", q), ("k", k)):
        if t.shape[1] != n:
            raise ValueError(f"{name} holds {t.shape[1]} tokens, but this rank's slice of the "
                             f"{record.bounds[-1]}-token packed row is {n} tokens (cu_seqlens[-1] / world_size)")
    if isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, int) or heads_k_stride < 1 \
            or k.shape[2] % heads_k_stride:
        raise ValueError(f"heads_k_stride={heads_k_stride!r} must be a positive int that divides the {k.shape[2]} "
                         "key/value heads")
    return record


def llama3_object(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  heads_k_stride, local_k_slice, is_causal: bool, window_size, group,
                  schedule: str | Schedule | None = None) -> ContextParallel:
    """The ContextParallel of a llama3 varlen call (``q``, ``k`` as ``[b, s_local, h, d]``), after checking the
    prepared values against the record of :func:`prepare`; a step's first call agrees on them between the
    ranks, so a bad value on any rank raises on every rank. ``schedule``: in place of ``allgather``, on the
    contiguous slices (:func:`requested_schedule`)."""
    rank, ranks = members(group)
    world = len(ranks)
    checked = (q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride, local_k_slice,
               is_causal, rank, world)
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    try:
        record = _check_prepared(*checked)
    except Exception as exc:  # raised on every rank through context_parallel's agreement
        failed = exc

        def settings():
            raise failed

        return context_parallel("llama3_flash_attn_varlen_func", group, settings)

    def settings():
        mask = document_mask(_lengths(record.bounds), is_causal, window_size)
        return "allgather", record.bounds[-1], mask, "contiguous"

    requested = requested_schedule(schedule)
    shape = None if requested is None else (q.shape[0], q.shape[2], k.shape[2], q.shape[3], q.dtype)
    return _BY_TENSOR.get_for(record, ("llama3", id(record), ranks, window, requested, shape),
                              lambda: context_parallel("llama3_flash_attn_varlen_func", group, settings, requested,
                                                       shape))


def llama3_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride, local_k_slice,
                dropout_p, softmax_scale, is_causal, window_size, alibi_slopes, deterministic, return_attn_probs,
                group):
    """``llama3_flash_attn_varlen_func`` on packed ``[total_local, h, d]`` tensors."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not isinstance(k, torch.Tensor) or k.dim() != 3:
        raise ValueError("q, k and v must be packed [total_tokens, heads, head_dim] tensors")
    refuse_unsupported(dropout_p, alibi_slopes, deterministic, q.device)
    cp = llama3_object(q.unsqueeze(0), k.unsqueeze(0), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       heads_k_stride, local_k_slice, is_causal, window_size, group)
    return packed_attention(cp, q, k, v, softmax_scale, return_attn_probs)
