"""UltraAttn: a plan (a :class:`cpattn.planner.Plan`, docs/ultraattn.md) compiled into each rank's
executor steps.

The plan arrives in ``Runtime.plan``: ``ContextParallel`` builds it with ``cpattn.planner`` (or reads
it from the plan cache) on group rank 0, broadcasts it, and keeps it. The planner reads :data:`ITEMS`
(what each message holds and its bytes) and :class:`Sizes` from here, so the bytes it plans are the
bytes the steps send.

Layout: the plan's owner map (rank r holds chunks ``r * c .. r * c + c - 1`` of the plan's ``c``
chunks per rank, over the sequence in the plan's piece order). :func:`compile_steps` turns a rank's
operations, in plan order, into steps that the one executor (``cpattn.core.executor.execute``) runs:

- ``recv``: a ``recv`` op from the sender (one call per message), waited for at its first use;
- ``send``: a ``send`` op to the receiver; an input that this rank relays is sent as it arrived, a
  partial result after every contribution to it was folded in;
- ``compute``: one kernel call (fused rectangle or causal square; a partial cell runs the mask's own
  cover of it, ``cpattn.core.blocks.rectangles``, its equal pieces stacked as ``attend`` stacks them)
  folded into the per-chunk accumulators: lse merge of (out, lse) forward, float32 sums of dq and of
  packed dk/dv backward;
- ``merge``: fold a received partial result in (pairwise, as partials arrive).

A chunk's accumulator on its owner is a view of the rank's output, so when all partials have been
merged the owner holds the exact result. Backward, a row's remote kernels get q, dout, its final lse
and ``D = rowsum(dout * out)`` (one float per row and head, computed once on the owner) from the
owner: with the final lse and D, per-block gradients add up exactly, and D is all of ``out`` that the
gradients use. A kernel whose rows this rank owns passes its local ``out``; one with a fetched row
passes D (``kernels.backward(..., out=None, delta=D)``: ``math`` takes it as is, a fused path a
stand-in ``out`` with the same rowsum). Only key/value heads travel (GQA). The plan's validation
guarantees the order cannot deadlock and messages between two ranks are posted in the same order on
both sides.

Communication per rank: one ``send`` per transfer leaving it and one ``recv`` per transfer arriving,
of :meth:`Sizes.item_bytes` each (``Plan.volume``). ``ultra`` declares no rank-generic ``steps()``: the
cost model simulates its plan's dependency graph (``cost.plan_estimate``), and the recording check
holds a run to the steps compiled for each rank (``verify.spec_report``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..core import blocks as blocks_mod
from ..core import kernels
from ..core.comm import Communicator
from ..core.executor import execute
from ..core.kernels import acc_dtype
from ..core.masks import BlockKind
from ..core.merge import merge_into
from ..core.steps import CommOp, Local, Step
from .base import Runtime, Schedule, attend, attend_backward, finish, new_accumulators

TAGS = {"forward": 0, "backward": 1}


@dataclass(frozen=True)
class Sizes:
    """What a message's size depends on: ``batch``, ``chunk`` tokens, ``heads``, ``kv_heads``,
    ``head_dim``; ``elem`` / ``acc_elem`` bytes per element of the inputs / the accumulators."""

    batch: int
    chunk: int
    heads: int
    kv_heads: int
    head_dim: int
    elem: int
    acc_elem: int

    @property
    def rows(self) -> int:
        """Query rows of one chunk over all heads: ``b * chunk * h``."""
        return self.batch * self.chunk * self.heads

    @property
    def kv(self) -> int:
        """Elements of one chunk's packed k and v: ``2 * b * chunk * h_kv * d``."""
        return 2 * self.batch * self.chunk * self.kv_heads * self.head_dim

    def item_bytes(self, item: str) -> int:
        """Bytes of one message of ``item`` (:data:`ITEMS`)."""
        if item not in ITEMS:
            raise ValueError(f"item {item!r} is unknown; accepted: {', '.join(ITEMS)}")
        return ITEMS[item].nbytes(self)


@dataclass(frozen=True)
class Item:
    """One kind of message: in which ``phases`` it travels, whether it is an ``input`` of kernels or a
    ``partial`` result, whether it follows a kernel's ``rows`` or ``cols``, its size, and how one
    message is packed from and unpacked into its parts (:meth:`_Program._own_input` gives the parts)."""

    phases: tuple[str, ...]
    role: str  # "input" or "partial"
    follows: str  # "rows" or "cols"
    nbytes: Callable[[Sizes], int]
    #: the receive buffer: ``(shape, dtype)`` for the sizes and the (input, accumulation) dtypes
    buffer: Callable[[Sizes, torch.dtype, torch.dtype], tuple[tuple[int, ...], torch.dtype]]
    pack: Callable[[Any], torch.Tensor]
    #: a received buffer as its parts, given the sizes and the (input, accumulation) dtypes
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


#: every message kind, one row each (the planner's kernel graph reads it too)
ITEMS: dict[str, Item] = {
    # query rows of a chunk
    "q": Item(("forward",), "input", "rows", lambda z: z.rows * z.head_dim * z.elem,
              lambda z, dt, acc: (_q_shape(z), dt), lambda v: v[0].contiguous(), lambda b, z, dt, acc: (b,)),
    # keys and values of a chunk, packed
    "kv": Item(("forward", "backward"), "input", "cols", lambda z: z.kv * z.elem,
               lambda z, dt, acc: (_kv_shape(z), dt), lambda v: torch.stack(v), lambda b, z, dt, acc: (b[0], b[1])),
    # a partial output and its lse, flat, in the accumulation dtype
    "o": Item(("forward",), "partial", "rows", lambda z: z.rows * (z.head_dim + 1) * z.acc_elem,
              lambda z, dt, acc: ((z.rows * (z.head_dim + 1),), acc),
              lambda v: torch.cat([v[0].reshape(-1), v[1].reshape(-1)]), _unpack_o),
    # backward inputs of a row: its final lse and D = rowsum(dout * out) (accumulation dtype), then q and
    # dout, as bytes
    "qb": Item(("backward",), "input", "rows", lambda z: z.rows * 2 * (z.head_dim * z.elem + z.acc_elem),
               lambda z, dt, acc: ((z.rows * 2 * (z.head_dim * z.elem + z.acc_elem),), torch.uint8),
               _pack_qb, _unpack_qb),
    # a partial dq
    "dq": Item(("backward",), "partial", "rows", lambda z: z.rows * z.head_dim * z.acc_elem,
               lambda z, dt, acc: (_q_shape(z), acc), lambda v: v.contiguous(), lambda b, z, dt, acc: b),
    # a partial dk and dv, packed
    "dkv": Item(("backward",), "partial", "cols", lambda z: z.kv * z.acc_elem,
                lambda z, dt, acc: (_kv_shape(z), acc), lambda v: v.contiguous(), lambda b, z, dt, acc: b),
}


def compile_steps(plan, phase: str, rank: int, sizes: Sizes) -> list[Step]:
    """``rank``'s operations of ``phase`` in ``plan`` as executor steps (``cpattn.core.executor``), one
    step per operation and a last, empty one:

    - ``recv n``: a ``before`` action makes the buffer (``("buffer", n)``), then a ``recv`` op from the
      sender into role ``m<n>``, waited for at the step of its first use (a kernel, a merge, or the
      relay that forwards it), so it arrives while the steps before compute;
    - ``send n``: a ``send`` op to the receiver of role ``s<n>`` (packed by ``("pack", n)``: an own input,
      or a partial result once all its contributions were folded in), or of the received ``m<i>`` it
      relays as it arrived; waited for at the last step;
    - ``compute k``: one ``run`` action ``("compute", k)`` over the received inputs it reads;
    - ``merge n``: one ``run`` action ``("merge", n)`` that folds the received partial ``m<n>`` in.

    Every message has the phase's tag; the plan's validation guarantees that two ranks post the
    messages between them in the same order, so none can deadlock."""
    ph, tag = plan.phase(phase), TAGS[phase]
    inputs = {n for n, it in ITEMS.items() if phase in it.phases and it.role == "input"}
    incoming = {(t.item, t.chunk): n for n, t in enumerate(ph.transfers) if t.dst == rank and t.item in inputs}
    owned = plan.owner

    def received(item: str, chunks) -> list[int]:
        return [incoming[item, c] for c in chunks if owned[c] != rank]

    ops = ph.ops[rank]
    end = len(ops)
    first_use: dict[int, int] = {}
    for i, op in enumerate(ops):
        if op.kind == "compute":
            kn = ph.kernels[op.id]
            row_item = "q" if phase == "forward" else "qb"
            for n in received(row_item, kn.rows) + received("kv", kn.cols):
                first_use.setdefault(n, i)
        elif op.kind == "merge":
            first_use.setdefault(op.id, i)
        elif op.kind == "send":
            t = ph.transfers[op.id]
            if t.item in inputs and owned[t.chunk] != rank:  # a relay
                first_use.setdefault(incoming[t.item, t.chunk], i)
    steps = []
    for op in ops:
        if op.kind == "recv":
            t = ph.transfers[op.id]
            role = f"m{op.id}"
            steps.append(Step(before=(Local(("buffer", op.id), (), role),), overlap=True, comm=(
                CommOp("recv", sizes.item_bytes(t.item), root=t.src, recv=role, tag=tag,
                       wait=first_use.get(op.id, end)),)))
        elif op.kind == "send":
            t = ph.transfers[op.id]
            nbytes = sizes.item_bytes(t.item)
            if t.item in inputs and owned[t.chunk] != rank:
                steps.append(Step(comm=(CommOp("send", nbytes, root=t.dst, send=f"m{incoming[t.item, t.chunk]}",
                                               tag=tag, wait=end),)))
            else:
                role = f"s{op.id}"
                steps.append(Step(before=(Local(("pack", op.id), (), role),), comm=(
                    CommOp("send", nbytes, root=t.dst, send=role, tag=tag, wait=end),)))
        elif op.kind == "compute":
            kn = ph.kernels[op.id]
            row_item = "q" if phase == "forward" else "qb"
            src = tuple(f"m{n}" for n in received(row_item, kn.rows) + received("kv", kn.cols))
            steps.append(Step(run=(Local(("compute", op.id), src, None),)))
        else:
            steps.append(Step(run=(Local(("merge", op.id), f"m{op.id}", None),)))
    steps.append(Step())
    return steps


class _Program:
    """What ``rank``'s steps of one phase do locally (:func:`compile_steps` names them): make receive
    buffers, pack messages, run kernels and fold partial results into the per-chunk accumulators. The
    executor issues and waits for every message; this object holds the phase's inputs and accumulators.
    Given to :func:`cpattn.core.executor.execute` as its ``transforms``: ``program[("compute", 3)]`` is
    the function of that action."""

    def __init__(self, rt: Runtime, plan, phase: str, local: dict[str, torch.Tensor],
                 acc: dict[str, torch.Tensor]) -> None:
        self.rt, self.plan, self.phase = rt, plan, phase
        self.ph = plan.phase(phase)
        self.rank = rt.rank
        self.local, self.own_acc = local, acc
        self.c = plan.chunks_per_rank
        self.chunk = plan.table.chunk
        q = local["q"]
        self.dtype, self.acc = q.dtype, acc_dtype(q.dtype)
        self.device = q.device
        self.sizes = plan_sizes(plan, q, local["k"])
        self.partial: dict[tuple[str, int], object] = {}  # (item, chunk) -> accumulator on this rank

    def __getitem__(self, fn) -> Callable:
        kind, n = fn
        return {"buffer": lambda _: self._buffer(n), "pack": lambda _: self._pack_send(n),
                "compute": lambda values: self._compute(n, values),
                "merge": lambda value: self._merge(n, value)}[kind]

    # ------------------------------------------------------------------ chunk views
    def _rows(self, first: int, last: int) -> slice:
        """Local token rows of owned chunks ``first .. last``."""
        return slice((first - self.rank * self.c) * self.chunk, (last + 1 - self.rank * self.c) * self.chunk)

    def _owned(self, chunk: int) -> bool:
        return self.plan.owner[chunk] == self.rank

    def _own_input(self, item: str, sl: slice) -> tuple[torch.Tensor, ...]:
        """Parts of an input item for owned rows ``sl``: q: (q,); kv: (k, v); qb: (q, dout, lse, delta)."""
        loc = self.local
        if item == "q":
            return (loc["q"][:, sl],)
        if item == "kv":
            return loc["k"][:, sl], loc["v"][:, sl]
        return loc["q"][:, sl], loc["dout"][:, sl], loc["lse"][:, :, sl], loc["delta"][:, :, sl]

    def _own_acc(self, item: str, chunk: int):
        sl, acc = self._rows(chunk, chunk), self.own_acc
        if item == "o":
            return acc["out"][:, sl], acc["lse"][:, :, sl]
        if item == "dq":
            return acc["dq"][:, sl]
        return acc["dkv"][:, :, sl]  # dkv: [2, b, chunk, h_kv, d]

    def _consecutive_owned(self, chunks: tuple[int, ...]) -> bool:
        return all(self._owned(c) for c in chunks) and list(chunks) == list(range(chunks[0], chunks[-1] + 1))

    def _gather(self, item: str, chunks: tuple[int, ...], arrived) -> tuple[torch.Tensor, ...]:
        """An input item's parts for ``chunks``, each concatenated along its sequence dimension (a view
        of the local tensors when they are consecutive chunks this rank owns); ``arrived``: the received
        messages of the chunks this rank does not own, in order."""
        if self._consecutive_owned(chunks):
            return self._own_input(item, self._rows(chunks[0], chunks[-1]))
        parts = [self._own_input(item, self._rows(c, c)) if self._owned(c) else self._unpack(item, next(arrived))
                 for c in chunks]
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat([p[x] for p in parts], 2 if item == "qb" and x >= 2 else 1)
                     for x in range(len(parts[0])))

    def _own_out(self, chunks: tuple[int, ...]) -> torch.Tensor | None:
        """The final out of rows ``chunks`` when this rank owns them all (fused kernel paths take it),
        else None (fetched rows bring only D)."""
        if self._consecutive_owned(chunks):
            return self.local["out"][:, self._rows(chunks[0], chunks[-1])]
        if not all(self._owned(c) for c in chunks):
            return None
        return torch.cat([self.local["out"][:, self._rows(c, c)] for c in chunks], 1)

    # ------------------------------------------------------------------ messages
    def _buffer(self, n: int) -> torch.Tensor:
        shape, dtype = ITEMS[self.ph.transfers[n].item].buffer(self.sizes, self.dtype, self.acc)
        return Communicator.new_buffer(shape, dtype, self.device)

    def _unpack(self, item: str, buf: torch.Tensor):
        """A message as its parts: inputs as :meth:`_own_input` gives them, ``o`` as (out, lse)."""
        return ITEMS[item].unpack(buf, self.sizes, self.dtype, self.acc)

    def _pack_send(self, n: int) -> torch.Tensor:
        """The message of send ``n``: this rank's own input rows, or a partial result (complete: every
        contribution to it was folded in before the send, in plan order)."""
        t = self.ph.transfers[n]
        if ITEMS[t.item].role == "partial":
            return ITEMS[t.item].pack(self.partial.pop((t.item, t.chunk)))
        return ITEMS[t.item].pack(self._own_input(t.item, self._rows(t.chunk, t.chunk)))

    # ------------------------------------------------------------------ accumulators
    def _fold(self, item: str, chunk: int, value) -> None:
        """Fold a partial result into this rank's accumulator of (item, chunk). ``value``: (out, lse)
        for ``o``; the dq tensor; for ``dkv`` a packed [2, ...] tensor (as received) or a (dk, dv) pair
        (a kernel's column slices, added without packing them first)."""
        if self._owned(chunk):
            target = self._own_acc(item, chunk)
        elif (item, chunk) not in self.partial:  # the first contribution becomes the accumulator
            self.partial[item, chunk] = torch.stack(value) if isinstance(value, tuple) and item == "dkv" else value
            return
        else:
            target = self.partial[item, chunk]
        if item == "o":
            merge_into(target[0], target[1], value[0], value[1])
        elif item == "dkv":
            target[0].add_(value[0])
            target[1].add_(value[1])
        else:
            target.add_(value)

    def _merge(self, n: int, buf: torch.Tensor) -> None:
        t = self.ph.transfers[n]
        self._fold(t.item, t.chunk, self._unpack(t.item, buf))

    def _compute(self, k: int, received: tuple[torch.Tensor, ...]) -> None:
        kn, rt, n = self.ph.kernels[k], self.rt, self.chunk
        kind = BlockKind(kn.kind)
        arrived = iter(received)  # rows' messages first, then columns' (compile_steps' order)
        forward = self.phase == "forward"
        rows = self._gather("q" if forward else "qb", kn.rows, arrived)
        k_cat, v_cat = self._gather("kv", kn.cols, arrived)
        cover = self._cover(kn.rows[0], kn.cols[0]) if kind == BlockKind.PARTIAL else None
        if forward:
            (q_cat,) = rows
            if cover is None:
                out, lse = kernels.forward(q_cat, k_cat, v_cat, kind, rt.scale, None, rt.backend, rt.softcap)
            else:
                acc = new_accumulators(q_cat)
                attend(rt, q_cat, k_cat, v_cat, cover, acc)
                out, lse = acc
            for t, i in enumerate(kn.rows):
                self._fold("o", i, (out[:, t * n:(t + 1) * n], lse[:, :, t * n:(t + 1) * n]))
            return
        q_cat, dout_cat, lse_cat, delta_cat = rows
        out_cat = self._own_out(kn.rows)
        if cover is None:
            dq, dk, dv = kernels.backward(dout_cat, q_cat, k_cat, v_cat, out_cat, lse_cat, kind, rt.scale, None,
                                          rt.backend, delta=None if out_cat is not None else delta_cat,
                                          softcap=rt.softcap)
        else:
            dq = torch.zeros(q_cat.shape, dtype=self.acc, device=self.device)
            dk = torch.zeros(k_cat.shape, dtype=self.acc, device=self.device)
            dv = torch.zeros(v_cat.shape, dtype=self.acc, device=self.device)
            if out_cat is None:  # fetched rows: the stand-in out whose rowsum with dout is D
                out_cat = kernels.out_for_delta(dout_cat, delta_cat)
            attend_backward(rt, dout_cat, q_cat, k_cat, v_cat, out_cat, lse_cat, cover, dq, dk, dv)
        for t, i in enumerate(kn.rows):
            self._fold("dq", i, dq[:, t * n:(t + 1) * n])
        for t, j in enumerate(kn.cols):
            self._fold("dkv", j, (dk[:, t * n:(t + 1) * n], dv[:, t * n:(t + 1) * n]))

    def _cover(self, i: int, j: int) -> list[blocks_mod.Block]:
        """The blocks of PARTIAL cell (i, j): ``cpattn.core.blocks.rectangles`` over the original token ranges
        of its chunks (the plan may hold the sequence reordered), so the mask's own FULL and CAUSAL
        pieces run stacked (``attend``) and only what has no structure runs densely. Padding rows and
        columns (positions >= valid_len) are never covered. Cached with the ContextParallel."""
        rows, cols = tuple(self.plan.source_ranges(i)), tuple(self.plan.source_ranges(j))
        valid = self.plan.key["valid_len"]
        return self.rt.block_cache.get(("ultra cell", rows, cols, valid),
                                       lambda: blocks_mod.rectangles(self.rt.mask, rows, cols, valid))

    def run(self) -> None:
        execute(self.rt, program_steps(self.rt, self.plan, self.phase, self.sizes), {}, lambda _: None,
                transforms=self)
        if self.partial:
            raise RuntimeError(f"ultra {self.phase}: rank {self.rank} ended with {len(self.partial)} unsent "
                               "partial results (invalid plan)")


def plan_sizes(plan, q: torch.Tensor, k: torch.Tensor) -> Sizes:
    """The message sizes of ``plan`` for local ``q [b, s, h, d]``, ``k [b, s, h_kv, d]``."""
    return Sizes(q.shape[0], plan.table.chunk, q.shape[2], k.shape[2], q.shape[3], q.element_size(),
                 kernels.acc_bytes(q.dtype))


def program_steps(rt: Runtime, plan, phase: str, sizes: Sizes) -> list[Step]:
    """:func:`compile_steps` for this rank, kept with the runtime's cache per plan, phase and sizes."""
    key = ("ultra steps", id(plan), phase, rt.rank, sizes)
    entry = rt.block_cache.get(key, lambda: (plan, compile_steps(plan, phase, rt.rank, sizes)))
    if entry[0] is not plan:  # a plan that died left its id to this one
        entry = (plan, compile_steps(plan, phase, rt.rank, sizes))
        rt.block_cache.put(key, entry)
    return entry[1]


@dataclass(frozen=True, eq=False)
class UltraSchedule(Schedule):
    """``plan_options``: a ``cpattn.planner.PlanOptions`` for the planner (None: its defaults)."""

    plan_options: Any = None
    name = "ultra"
    layout = "contiguous"
    custom_layout = True
    masks = "any"
    memory = "O(local) + the chunks the plan brings in"
    planned = True
    summary = "UltraAttn: ILP-placed cells, fused kernels, scheduled p2p, exact merges at owners"

    @staticmethod
    def _plan(rt: Runtime):
        if rt.plan is None:
            raise RuntimeError("ultra runs a plan (Runtime.plan); run it through cpattn.ContextParallel, "
                               "which builds the plan with cpattn.planner")
        return rt.plan

    def forward(self, rt: Runtime, q, k, v):
        plan = self._plan(rt)
        b, s, h, d = q.shape
        acc = acc_dtype(q.dtype)
        out = torch.zeros(b, s, h, d, dtype=acc, device=q.device)
        lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
        _Program(rt, plan, "forward", {"q": q, "k": k, "v": v}, {"out": out, "lse": lse}).run()
        return finish(rt, out, lse, q.dtype)

    def backward(self, rt: Runtime, dout, q, k, v, out, lse):
        plan = self._plan(rt)
        acc = acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=acc, device=q.device)
        delta = kernels.row_delta(dout, out)  # [b, h, s] like lse: all a fetched row's kernels need of out
        local = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse, "delta": delta}
        _Program(rt, plan, "backward", local, {"dq": dq, "dkv": dkv}).run()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


__all__ = ["ITEMS", "Item", "Sizes", "UltraSchedule", "compile_steps", "plan_sizes", "program_steps"]
