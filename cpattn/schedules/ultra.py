"""UltraAttn: a plan (a :class:`cpattn.planner.Plan`, docs/ultraattn.md) compiled into each rank's
executor steps.

``make_plan`` asks ``cpattn.planner`` for the plan of a problem (or reads it from the plan cache);
``ContextParallel`` does so on group rank 0 and hands every rank the same plan, and the cost model
asks it for its prediction. The planner's message table (``cpattn.planner.messages``) fixes what each
message holds and its bytes, so the bytes it plans are the bytes these steps send.

Layout: the plan's owner map (rank r holds chunks ``r * c .. r * c + c - 1`` of the plan's ``c``
chunks per rank, over the sequence in the plan's piece order). :func:`compile_steps` turns a rank's
operations, in plan order, into steps that the one executor (``cpattn.core.executor.execute``) runs
from the ordinary start roles (``q``, ``kv0``; backward also ``dout``, ``out``, ``lse``):

- ``recv``: a ``recv`` op from the sender into a new buffer, waited for at its first use;
- ``send``: a ``send`` op to the receiver; an input that this rank relays is sent as it arrived, a
  partial result after every contribution to it was folded in;
- ``compute``: gather the kernel's rows and columns (views of the local tensors when this rank owns
  them in order, else concatenated with what arrived), then one :class:`~cpattn.core.steps.Attend`
  (forward) or :class:`~cpattn.core.steps.AttendBack` over the cell's blocks (a fused rectangle or
  causal square; a PARTIAL cell the mask's own cover of it, stacked as every schedule's blocks are),
  and one :class:`~cpattn.core.steps.Fold` per chunk into that chunk's accumulator: the rank's own
  ``out`` / ``dq`` / ``dkv`` rows when it owns the chunk, else a partial result it will send;
- ``merge``: fold a received partial result in (pairwise, as partials arrive).

So when all partials have been merged the owner holds the exact result. Backward, a row's remote
kernels get q, dout, its final lse and ``D = rowsum(dout * out)`` (one float per row and head, made
once on the owner) from the owner: with the final lse and D, per-block gradients add up exactly, and
D is all of ``out`` that the gradients use (``AttendBack(delta=...)``). Only key/value heads travel
(GQA). The plan's validation guarantees the order cannot deadlock and messages between two ranks are
posted in the same order on both sides.

Communication per rank: one ``send`` per transfer leaving it and one ``recv`` per transfer arriving,
of :meth:`Sizes.item_bytes` each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import planner
from ..core import blocks as blocks_mod
from ..core import kernels
from ..core.comm import Communicator
from ..core.kernels import acc_dtype
from ..core.layout import Layout, from_pieces, pieces
from ..core.masks import BlockKind, Mask
from ..core.steps import Attend, AttendBack, CommOp, Fold, Local, Problem, Step, Zeros
from ..core.topology import Topology
from ..planner.messages import ITEMS, Sizes
from .base import Runtime, Schedule

TAGS = {"forward": 0, "backward": 1}
#: per input item, the start roles its parts come from (in the order of a message's parts); "out": the
#: final output of rows this rank owns, which a kernel gathers and never receives
OWN_ROLES = {"q": ("q",), "kv": ("kv0",), "qb": ("q", "dout", "lse", "delta"), "out": ("out",)}
#: per partial item, the rank's own accumulator of an owned chunk
OWN_ACC = {"o": "out", "dq": "dq", "dkv": "dkv"}


@dataclass(frozen=True)
class Codec:
    """How one message of an item is made on a device: its receive buffer ``(shape, dtype)`` for the
    sizes and the (input, accumulation) dtypes, how it is packed from its parts and unpacked into them."""

    buffer: Callable[[Sizes, torch.dtype, torch.dtype], tuple[tuple[int, ...], torch.dtype]]
    pack: Callable[[Any], torch.Tensor]
    unpack: Callable[[torch.Tensor, Sizes, torch.dtype, torch.dtype], Any]


def _pack_qb(value) -> torch.Tensor:
    q, dout, lse, delta = value  # lse and delta (accumulation dtype) first, so every part stays aligned
    rows = torch.stack([lse, delta]).reshape(-1).view(torch.uint8)
    return torch.cat([rows, torch.stack([q, dout]).reshape(-1).view(torch.uint8)])


def _unpack_qb(buf: torch.Tensor, z: Sizes, dtype: torch.dtype, acc: torch.dtype):
    row_bytes = 2 * z.rows * z.acc_elem
    lse, delta = buf[:row_bytes].view(acc).view(2, z.batch, z.heads, z.chunk)
    q, dout = buf[row_bytes:].view(dtype).view(2, z.batch, z.chunk, z.heads, z.head_dim)
    return q, dout, lse, delta


def _unpack_o(buf: torch.Tensor, z: Sizes, dtype: torch.dtype, acc: torch.dtype):
    n = z.rows * z.head_dim
    return buf[:n].view(z.batch, z.chunk, z.heads, z.head_dim), buf[n:].view(z.batch, z.heads, z.chunk)


def _q_shape(z: Sizes) -> tuple[int, ...]:
    return (z.batch, z.chunk, z.heads, z.head_dim)


def _kv_shape(z: Sizes) -> tuple[int, ...]:
    return (2, z.batch, z.chunk, z.kv_heads, z.head_dim)


#: every message kind's codec (the planner's :data:`~cpattn.planner.messages.ITEMS` has its bytes)
CODECS: dict[str, Codec] = {
    "q": Codec(lambda z, dt, acc: (_q_shape(z), dt), lambda v: v[0].contiguous(), lambda b, z, dt, acc: (b,)),
    "kv": Codec(lambda z, dt, acc: (_kv_shape(z), dt), torch.stack, lambda b, z, dt, acc: (b[0], b[1])),
    "o": Codec(lambda z, dt, acc: ((z.rows * (z.head_dim + 1),), acc),
               lambda v: torch.cat([v[0].reshape(-1), v[1].reshape(-1)]), _unpack_o),
    "qb": Codec(lambda z, dt, acc: ((z.item_bytes("qb"),), torch.uint8), _pack_qb, _unpack_qb),
    "dq": Codec(lambda z, dt, acc: (_q_shape(z), acc), lambda v: v.contiguous(), lambda b, z, dt, acc: b),
    "dkv": Codec(lambda z, dt, acc: (_kv_shape(z), acc), lambda v: v.contiguous(), lambda b, z, dt, acc: b),
}


def _seq_dims(item: str) -> tuple[int, ...]:
    """The sequence dimension of each part of an input item (lse and delta are ``[b, h, s]``)."""
    return {"q": (1,), "kv": (1, 1), "qb": (1, 1, 2, 2), "out": (1,)}[item]


def compile_steps(plan, phase: str, rank: int, sizes: Sizes) -> list[Step]:
    """``rank``'s operations of ``phase`` in ``plan`` as executor steps (``cpattn.core.executor``): a
    first step that makes the accumulators (and, backward, D), one step per operation and a last,
    empty one (see the module docstring). Every message has the phase's tag; the plan's validation
    guarantees that two ranks post the messages between them in the same order, so none can
    deadlock. ``Local`` actions name :class:`Functions` keys."""
    ph, tag, n = plan.phase(phase), TAGS[phase], sizes.chunk
    forward = phase == "forward"
    inputs = {i for i, it in ITEMS.items() if phase in it.phases and it.role == "input"}
    incoming = {(t.item, t.chunk): i for i, t in enumerate(ph.transfers) if t.dst == rank and t.item in inputs}
    owned, base = plan.owner, rank * plan.chunks_per_rank
    row_item = "q" if forward else "qb"

    def rows(chunk: int) -> tuple[int, int]:  # local token rows of an owned chunk
        return (chunk - base) * n, (chunk - base + 1) * n

    def gather(item: str, chunks) -> tuple[tuple, tuple[str, ...]]:
        """The parts key (own rows, or None for the next message) and the roles it reads."""
        parts = tuple(rows(c) if owned[c] == rank else None for c in chunks)
        msgs = tuple(f"m{incoming[item, c]}" for c in chunks if owned[c] != rank)
        return parts, OWN_ROLES[item] + msgs

    def own_span(chunks) -> int | None:
        """The first local row of ``chunks`` when this rank owns them all, consecutive; else None."""
        if all(owned[c] == rank for c in chunks) and list(chunks) == list(range(chunks[0], chunks[-1] + 1)):
            return rows(chunks[0])[0]
        return None

    def acc_of(item: str, chunk: int) -> tuple[str, tuple[int, int] | None]:
        return (OWN_ACC[item], rows(chunk)) if owned[chunk] == rank else (f"p{item}{chunk}", None)

    ops = ph.ops[rank]
    end = len(ops) + 1
    first_use: dict[int, int] = {}
    for i, op in enumerate(ops, start=1):
        if op.kind == "compute":
            kn = ph.kernels[op.id]
            for item, chunks in ((row_item, kn.rows), ("kv", kn.cols)):
                for c in chunks:
                    if owned[c] != rank:
                        first_use.setdefault(incoming[item, c], i)
        elif op.kind == "merge":
            first_use.setdefault(op.id, i)
        elif op.kind == "send":
            t = ph.transfers[op.id]
            if t.item in inputs and owned[t.chunk] != rank:  # a relay
                first_use.setdefault(incoming[t.item, t.chunk], i)
    steps = [Step(after=(Zeros("out", "q", output=True),) if forward else
                  (Zeros("dq", "q"), Zeros("dkv", "kv0"), Local(("delta",), ("dout", "out"), "delta")))]
    for op in ops:
        if op.kind == "recv":
            t = ph.transfers[op.id]
            role = f"m{op.id}"
            steps.append(Step(before=(Local(("buffer", t.item), (), role),), comm=(
                CommOp("recv", sizes.item_bytes(t.item), root=t.src, recv=role, tag=tag,
                       wait=first_use.get(op.id, end)),)))
        elif op.kind == "send":
            t = ph.transfers[op.id]
            role, pack = f"s{op.id}", ()
            if t.item in inputs and owned[t.chunk] != rank:  # a relay: sent as it arrived
                role = f"m{incoming[t.item, t.chunk]}"
            elif t.item in inputs:
                pack = (Local(("pack", t.item, rows(t.chunk)), OWN_ROLES[t.item], role),)
            else:
                pack = (Local(("pack", t.item), acc_of(t.item, t.chunk)[0], role),)
            steps.append(Step(before=pack, comm=(CommOp("send", sizes.item_bytes(t.item), root=t.dst, send=role,
                                                        tag=tag, wait=end),)))
        elif op.kind == "compute":
            kn, k = ph.kernels[op.id], op.id
            ro, co = own_span(kn.rows), own_span(kn.cols)
            src = ("cell", phase, k, ro or 0, co or 0)
            run = []
            if co is None:  # columns gathered: dk/dv into a buffer of their own, folded per chunk
                col_parts, col_roles = gather("kv", kn.cols)
                kv, dkv = f"c{k}", f"g{k}"
                run.append(Local(("gather", "kv", col_parts), col_roles, kv))
                if not forward:
                    run.append(Zeros(dkv, kv))
                folds = [Fold("dkv", dkv, *acc_of("dkv", c), at=(t * n, (t + 1) * n)) for t, c in enumerate(kn.cols)]
            else:  # this rank's own consecutive columns: the blocks read kv0 and add into dkv in place
                kv, dkv, folds = "kv0", "dkv", []
            if ro is not None:  # this rank's own consecutive rows: the blocks work on its q and accumulators
                run.append(Attend(kv, src) if forward else AttendBack(kv, src, dkv))
            elif forward:
                row_parts, row_roles = gather("q", kn.rows)
                run += [Local(("gather", "q", row_parts, 0), row_roles, f"r{k}"), Zeros(f"o{k}", f"r{k}", output=True),
                        Attend(kv, src, q=f"r{k}", into=f"o{k}")]
                run += [Fold("o", f"o{k}", *acc_of("o", c), at=(t * n, (t + 1) * n)) for t, c in enumerate(kn.rows)]
            else:
                row_parts, row_roles = gather("qb", kn.rows)
                names = [f"r{k}.{x}" for x in range(4)]
                run += [Local(("gather", "qb", row_parts, x), row_roles, names[x]) for x in range(4)]
                own_out = all(p is not None for p in row_parts)
                if own_out:
                    run.append(Local(("gather", "out", row_parts, 0), ("out",), f"u{k}"))
                run += [Zeros(f"h{k}", names[0]),
                        AttendBack(kv, src, dkv, q=names[0], dout=names[1], lse=names[2],
                                   out=f"u{k}" if own_out else None, delta=None if own_out else names[3],
                                   dq=f"h{k}")]
                run += [Fold("dq", f"h{k}", *acc_of("dq", c), at=(t * n, (t + 1) * n)) for t, c in enumerate(kn.rows)]
            steps.append(Step(run=tuple(run if forward else run + folds)))
        else:
            t = ph.transfers[op.id]
            steps.append(Step(run=(Local(("unpack", t.item), f"m{op.id}", f"x{op.id}"),
                                   Fold(t.item, f"x{op.id}", *acc_of(t.item, t.chunk)))))
    steps.append(Step())
    return steps


class Functions:
    """The :class:`~cpattn.core.steps.Local` functions of :func:`compile_steps`' programs for one call
    (its message sizes and dtypes, and the device): pure functions of the roles they are given, keyed
    by ``(kind, ...)``: ``("buffer", item)`` a receive buffer; ``("pack", item, rows)`` this rank's
    own input rows as a message, ``("pack", item)`` a partial result as one; ``("unpack", item)`` a
    message as its parts; ``("gather", item, parts, x)`` part x of an input item over a kernel's
    chunks (``parts``: per chunk, its own local rows, or None for the next message given); ``("delta",)``
    ``D = rowsum(dout * out)``."""

    def __init__(self, sizes: Sizes, dtype: torch.dtype, device: torch.device) -> None:
        self.sizes, self.dtype, self.acc, self.device = sizes, dtype, acc_dtype(dtype), device

    def __getitem__(self, key) -> Callable:
        kind, item = key[0], key[1] if len(key) > 1 else None
        if kind == "buffer":
            return lambda _: Communicator.new_buffer(*CODECS[item].buffer(self.sizes, self.dtype, self.acc),
                                                     self.device)
        if kind == "pack" and len(key) == 3:
            return lambda own: CODECS[item].pack(self._own(item, own, slice(*key[2])))
        if kind == "pack":
            return CODECS[item].pack
        if kind == "unpack":
            return lambda buf: CODECS[item].unpack(buf, self.sizes, self.dtype, self.acc)
        if kind == "gather":
            return lambda values: self._gather(item, key[2], key[3] if len(key) > 3 else 0, values)
        if kind == "delta":
            return lambda values: kernels.row_delta(*values)
        raise KeyError(key)

    def _own(self, item: str, own: tuple, sl: slice) -> tuple[torch.Tensor, ...]:
        """The parts of an input item for own rows ``sl`` from its start roles (``kv0`` is ``(k, v)``)."""
        if item == "kv":
            own = tuple(own[0])
        return tuple(t[(slice(None),) * dim + (sl,)] for t, dim in zip(own, _seq_dims(item)))

    def _gather(self, item: str, parts: tuple, x: int, values: tuple) -> Any:
        """An input item over a kernel's chunks that are not this rank's own consecutive ones (those the
        kernel reads in place): each chunk's parts, own rows or the next message's, concatenated."""
        width = len(OWN_ROLES[item])
        own, messages = values[:width], iter(values[width:])
        pieces = [self._own(item, own, slice(*p)) if p is not None else
                  CODECS[item].unpack(next(messages), self.sizes, self.dtype, self.acc) for p in parts]
        got = tuple(torch.cat([pc[i] for pc in pieces], dim) if len(pieces) > 1 else pieces[0][i]
                    for i, dim in enumerate(_seq_dims(item)))
        return got if item == "kv" else got[x]


def plan_sizes(plan, problem: Problem) -> Sizes:
    """The message sizes of ``plan`` for ``problem``."""
    return Sizes(problem.batch, plan.table.chunk, problem.heads, problem.kv_heads, problem.head_dim, problem.elem,
                 problem.acc_elem)


@dataclass(frozen=True, eq=False)
class UltraSchedule(Schedule):
    """``plan_options``: a ``cpattn.planner.PlanOptions`` for the planner (None: its defaults)."""

    plan_options: Any = None
    name = "ultra"
    layout = "contiguous"
    custom_layout = True
    masks = "any"
    memory = "O(local) + the chunks the plan brings in"
    summary = "UltraAttn: ILP-placed cells, fused kernels, scheduled p2p, exact merges at owners"

    def __post_init__(self) -> None:
        if isinstance(self.plan_options, dict):  # options read back from JSON
            object.__setattr__(self, "plan_options", planner.PlanOptions(**self.plan_options))

    def _options(self, fast: bool = False):
        options = self.plan_options or planner.PlanOptions()
        return dataclasses.replace(options, use_solver=False) if fast else options

    def choose_layout(self, mask: Mask, seq_len: int, world: int) -> tuple[Layout, int] | None:
        """The planner's owner map (round-robin pieces for strided masks), or None (contiguous)."""
        padded = Layout(self.layout_for(mask)).padded_len(seq_len, world)
        order = planner.choose_order(mask, padded, world, valid_len=seq_len, options=self._options())
        if order is None:
            return None
        return from_pieces(order, padded, world, f"{self.name}-round-robin-{len(order) // world}"), padded

    def make_plan(self, problem: Problem, topology: Topology, fast: bool = False):
        """The plan of ``problem`` on ``topology`` (from the plan cache when a valid one is there);
        ``fast``: placed greedily, without the solver, and not written to the cache."""
        if problem.layout is None:
            order = planner.choose_order(problem.mask, problem.padded_len, problem.world, valid_len=problem.seq_len,
                                         options=self._options(fast))
        else:
            _, order = pieces(problem.layout, problem.padded_len, problem.world)
        req = planner.request(problem.mask, problem.padded_len, topology, problem.batch, problem.heads,
                              problem.kv_heads, problem.head_dim, problem.dtype, self._options(fast), problem.seq_len,
                              order)
        return planner.get_plan(req, cache=not fast)

    def read_plan(self, text: str):
        return planner.Plan.from_json(text)

    def program(self, problem, phase, topology=None, plan=None, rank=0):
        if plan is None:
            raise ValueError("ultra runs a plan (Runtime.plan); run it through cpattn.ContextParallel, "
                             "which makes the plan with cpattn.planner")
        return compile_steps(plan, phase, rank, plan_sizes(plan, problem))

    def local_fns(self, rt: Runtime, q, k):
        return Functions(plan_sizes(rt.plan, rt.problem(q, k)), q.dtype, q.device)

    def blocks_of(self, rt: Runtime, src) -> list[blocks_mod.Block]:
        """``("cell", phase, k, rows, cols)``: the blocks of kernel k of the plan's phase, their rows and
        columns starting at local rows ``rows`` and ``cols`` of the tensors they read: one fused block,
        or for a PARTIAL cell the mask's own cover of it (``cpattn.core.blocks.rectangles`` over the
        cell's original token ranges: the plan may hold the sequence reordered; padding is never
        covered). Kept with the ContextParallel."""
        _, phase, k, r0, c0 = src
        plan = rt.plan
        kn = plan.phase(phase).kernels[k]
        kind = BlockKind(kn.kind)
        if kind != BlockKind.PARTIAL:
            n = plan.table.chunk
            return rt.block_cache.get(("ultra fused", kind, r0, c0, len(kn.rows) * n, len(kn.cols) * n), lambda: [
                blocks_mod.Block(slice(r0, r0 + len(kn.rows) * n), slice(c0, c0 + len(kn.cols) * n), kind)])
        rows, cols = tuple(plan.source_ranges(kn.rows[0])), tuple(plan.source_ranges(kn.cols[0]))
        valid = plan.key["valid_len"]

        def cover() -> list[blocks_mod.Block]:
            return [dataclasses.replace(b, q=slice(b.q.start + r0, b.q.stop + r0),
                                        kv=slice(b.kv.start + c0, b.kv.stop + c0))
                    for b in blocks_mod.rectangles(rt.mask, rows, cols, valid, regions=rt.regions)]

        return rt.block_cache.get(("ultra cell", rows, cols, valid, r0, c0, rt.regions), cover)


__all__ = ["CODECS", "Codec", "Functions", "UltraSchedule", "compile_steps", "plan_sizes"]
