"""The one executor: the runtime a call runs in, the local block computations, and the runner of a
schedule's steps.

A schedule's ``steps(problem, phase, topology)`` (``cpattn.core.steps``) are its program: per step, the
communication ops (with the buffer roles they send and receive into) and the actions of the step's
compute (:class:`~cpattn.core.steps.Attend`, :class:`~cpattn.core.steps.AttendBack`, ...). :func:`execute` runs
such a list on one rank: per step it issues the ops, runs the compute while they are in flight, waits
for them, runs the step's ``after`` actions, and drops the buffers no later step uses. So issue and
wait order, double buffering and the overlap of transfers with compute live here, once, and the
recording check (``cpattn.exactness.check_steps``) holds the run to the very steps it was given.

Also here: :class:`Runtime` (what a call needs, identical on every rank), :class:`Accumulators`
(output and lse accumulators whose written rows are known on the host, so nothing is read back from
the device), :func:`attend` / :func:`attend_backward` (blocks batched into stacked kernel calls).

Why one module over 500 lines: the runner and the block computations it calls share the
runtime's caches and the accumulators' host-side record; apart, each would reach into the other's
internals.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import blocks as blocks_mod
from . import kernels
from .comm import Communicator
from .kernels import acc_dtype
from .layout import Layout
from .masks import Mask
from .memo import BoundedCache
from .merge import merge_finish, merge_into, merge_weights
from .program import Plan
from .steps import OWN, Add, Attend, AttendBack, CommOp, Fold, Land, Local, LseMax, Problem, Step, Weigh, Zeros
from .topology import Topology


@dataclass
class Runtime:
    """Everything a schedule needs for one call, identical on every rank of the group."""

    comm: Communicator
    mask: Mask
    layout: Layout
    padded_len: int  # the length the layout splits
    scale: float = 1.0
    backend: str = "auto"
    topology: Topology | None = None  # nodes x devices per node, when the schedule should use it
    seq_len: int | None = None  # the real tokens (None: padded_len); positions >= seq_len are padding
    plan: Plan | None = None  # a schedule that plans (``Schedule.make_plan``): the plan of this call
    sinks: torch.Tensor | None = None  # per-head sink logits ``[h]`` of this call (None: no sinks)
    softcap: float | None = None  # scores soft-capped as tanh(s / softcap) * softcap (None: not capped)
    regions: bool = False  # a step's blocks of one rank as one call (``blocks.rectangles``; ``kernels.region_calls``)
    block_cache: BoundedCache = field(default_factory=BoundedCache, repr=False)  # owned by the ContextParallel
    batch_cache: BoundedCache = field(default_factory=BoundedCache, repr=False)  # owned by the ContextParallel

    def __post_init__(self) -> None:
        if self.seq_len is None:
            self.seq_len = self.padded_len

    @property
    def rank(self) -> int:
        return self.comm.rank

    def problem(self, q: torch.Tensor, k: torch.Tensor) -> Problem:
        """The :class:`~cpattn.core.steps.Problem` of a call with local ``q [b, s, h, d]``, ``k [b, s, h_kv,
        d]`` on this runtime (its layout and padding)."""
        b, _, h, d = q.shape
        return Problem(self.seq_len, self.world, self.mask, b, h, k.shape[2], d, kernels.dtype_name(q.dtype),
                       layout=self.layout, padded_len=self.padded_len)

    @property
    def world(self) -> int:
        return self.comm.world_size

    def blocks(self, q_rank: int | list[int], kv_ranks: list[int]) -> list[blocks_mod.Block]:
        """Cached block list of the queries of ``q_rank`` (a rank, or several concatenated in that
        order) against ``kv_ranks``' keys (concatenated in that order); padding is never covered."""
        key = (q_rank if isinstance(q_rank, int) else tuple(q_rank), tuple(kv_ranks), self.regions)
        return self.block_cache.get(key, lambda: blocks_mod.for_ranks(self.mask, self.layout, self.padded_len,
                                                                      self.world, q_rank, list(kv_ranks),
                                                                      self.seq_len, self.regions))

    def batches(self, blocks: list[blocks_mod.Block], device: torch.device) -> list[Run]:
        """The stacked kernel calls of ``blocks`` (``cpattn.core.blocks.batches``) with their row and column
        indices and masks already on ``device``, kept per block list: a steady-state call copies nothing
        from the host and reads nothing back."""
        return self.batch_cache.get_for(blocks, (id(blocks), str(device)),
                                        lambda: [Run.of(b, device) for b in blocks_mod.batches(blocks)])


@dataclass(frozen=True)
class Run:
    """One stacked kernel call of a :class:`cpattn.core.blocks.Batch`, ready to run on a device: its rows and
    columns as slices when contiguous, else as device indices (``host_rows``: the rows on the host), and
    the stacked masks of PARTIAL blocks on the device."""

    batch: blocks_mod.Batch
    row_span: slice | None
    col_span: slice | None
    rows: torch.Tensor | None
    cols: torch.Tensor | None
    host_rows: np.ndarray | None
    masks: torch.Tensor | None

    @classmethod
    def of(cls, batch: blocks_mod.Batch, device: torch.device) -> Run:
        if not batch.stacked:
            return cls(batch, None, None, None, None, None, None)
        rs, cs = batch.row_span(), batch.col_span()
        host_rows = batch.row_index() if rs is None else None
        rows = torch.from_numpy(host_rows).to(device) if rs is None else None
        cols = batch.cols().to(device) if cs is None else None
        masks = batch.masks()
        return cls(batch, rs, cs, rows, cols, host_rows, None if masks is None else masks.to(device))


class Accumulators:
    """The float32 output ``[b, s, h, d]`` and lse ``[b, h, s]`` accumulators of local queries ``[b, s,
    h, d]``, starting at (0, -inf), and which rows a block has written so far. That record is kept on
    the host from the block lists, so deciding whether a block's rows can take its result as is (no
    merge) never reads a device value. Unpacks as ``out, lse``."""

    def __init__(self, q: torch.Tensor) -> None:
        b, s, h, d = q.shape
        acc = acc_dtype(q.dtype)
        self.out = torch.zeros(b, s, h, d, dtype=acc, device=q.device)
        self.lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
        self._written = np.zeros(s, dtype=bool)  # per local query row

    def __iter__(self):
        return iter((self.out, self.lse))

    def claim(self, rows: slice | np.ndarray) -> bool:
        """Mark ``rows`` (a slice or host indices) written; True when none of them was written before (the
        block's result can be copied in rather than merged)."""
        fresh = not self._written[rows].any()
        self._written[rows] = True
        return fresh


def _take(x: torch.Tensor, span: slice | None, index: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows ``span`` (a view) or ``index`` (a gather) of ``x`` along ``dim``."""
    if span is not None:
        return x[(slice(None),) * dim + (span,)]
    return x.index_select(dim, index)


def _stack(x: torch.Tensor, span: slice | None, index: torch.Tensor, pieces: int) -> torch.Tensor:
    """Rows of ``x [b, s, ...]`` (``pieces`` runs of equal length) -> ``[b * pieces, run, ...]``."""
    g = _take(x, span, index, 1)
    return g.reshape(g.shape[0] * pieces, g.shape[1] // pieces, *g.shape[2:])


def _write(acc: Accumulators, span: slice | None, index: torch.Tensor | None, host_rows: np.ndarray | None,
           o: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge ``(o, lse)`` into the accumulator rows ``span`` / ``index`` (distinct rows; ``host_rows``:
    the same rows on the host when ``index`` is given). Rows no block has reached yet (out 0, lse -inf)
    take the block's result as is: the merge would give exactly that, at the cost of a read and two
    weightings of every output element."""
    out_acc, lse_acc = acc.out, acc.lse
    fresh = acc.claim(span if span is not None else host_rows)
    if span is not None:
        if fresh:
            out_acc[:, span].copy_(o)
            lse_acc[:, :, span].copy_(lse)
        else:
            merge_into(out_acc[:, span], lse_acc[:, :, span], o, lse)
        return
    if fresh:
        acc_o, acc_l = o.to(out_acc.dtype), lse.to(lse_acc.dtype)
    else:
        acc_o, acc_l = out_acc.index_select(1, index), lse_acc.index_select(2, index)
        merge_into(acc_o, acc_l, o, lse)
    out_acc.index_copy_(1, index, acc_o)
    lse_acc.index_copy_(2, index, acc_l)


def attend(rt: Runtime, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: list[blocks_mod.Block],
           acc: Accumulators) -> None:
    """Run the forward kernel on the blocks and merge them into the accumulators ``acc`` (in place).
    Blocks of one kind and shape run as one stacked call (``cpattn.core.blocks.batches``); their rows are
    disjoint, so the call's output goes into the accumulator rows at once (merged, or written where
    nothing was)."""
    b = q.shape[0]
    for run in rt.batches(blocks, q.device):
        batch = run.batch
        if not batch.stacked:
            blk = batch.blocks[0]
            o, lse = kernels.forward(q[:, blk.q], k[:, blk.kv], v[:, blk.kv], blk.kind, rt.scale, blk.mask,
                                     rt.backend, rt.softcap)
            _write(acc, blk.q, None, None, o, lse)
            continue
        n = len(batch.blocks)
        rs, cs, rows, cols = run.row_span, run.col_span, run.rows, run.cols
        o, lse = kernels.forward_stacked(_stack(q, rs, rows, n), _stack(k, cs, cols, n), _stack(v, cs, cols, n),
                                         batch.kind, rt.scale, n, rt.backend, run.masks, rt.softcap)
        o = o.reshape(b, -1, *o.shape[2:])
        lse = lse.reshape(b, n, *lse.shape[1:]).transpose(1, 2).reshape(b, lse.shape[1], -1)
        _write(acc, rs, rows, run.host_rows, o, lse)


def attend_backward(rt: Runtime, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor | None, lse: torch.Tensor, blocks: list[blocks_mod.Block],
                    dq_acc: torch.Tensor, dk_acc: torch.Tensor, dv_acc: torch.Tensor,
                    delta: torch.Tensor | None = None) -> None:
    """Run the backward kernel on the blocks (stacked as in :func:`attend`) and add their gradients into
    the accumulators; ``index_add_`` sums the key gradients of blocks that share key rows. ``out``
    None: the rows' ``delta = rowsum(dout * out)`` stands for it (``kernels.backward``; stacked calls
    get ``kernels.out_for_delta``)."""
    b = q.shape[0]
    for run in rt.batches(blocks, q.device):
        batch = run.batch
        if not batch.stacked:
            blk = batch.blocks[0]
            dq, dk, dv = kernels.backward(dout[:, blk.q], q[:, blk.q], k[:, blk.kv], v[:, blk.kv],
                                          None if out is None else out[:, blk.q], lse[:, :, blk.q], blk.kind,
                                          rt.scale, blk.mask, rt.backend,
                                          delta=None if delta is None else delta[:, :, blk.q], softcap=rt.softcap)
            dq_acc[:, blk.q] += dq
            dk_acc[:, blk.kv] += dk
            dv_acc[:, blk.kv] += dv
            continue
        n = len(batch.blocks)
        rs, cs, rows, cols = run.row_span, run.col_span, run.rows, run.cols
        stand_in = out if out is not None else kernels.out_for_delta(dout, delta)
        lse_b = _take(lse, rs, rows, 2)
        lse_b = lse_b.reshape(b, lse.shape[1], n, -1).transpose(1, 2).reshape(b * n, lse.shape[1], -1)
        dq, dk, dv = kernels.backward_stacked(
            _stack(dout, rs, rows, n), _stack(q, rs, rows, n), _stack(k, cs, cols, n), _stack(v, cs, cols, n),
            _stack(stand_in, rs, rows, n), lse_b, batch.kind, rt.scale, n, rt.backend, run.masks, rt.softcap)
        for acc, grad, span, index in ((dq_acc, dq, rs, rows), (dk_acc, dk, cs, cols), (dv_acc, dv, cs, cols)):
            grad = grad.reshape(b, -1, *grad.shape[2:])
            if span is not None:
                acc[:, span] += grad
            else:
                acc.index_add_(1, index, grad)


# ---------------------------------------------------------------------- the runner
#: ``blocks_of(src)``: the blocks of an action's source on this rank (None: nothing to compute)
BlocksOf = Callable[[Hashable], "list[blocks_mod.Block] | None"]


def _reads_writes(action) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The buffer roles an action reads (or updates in place) and those it makes."""
    if isinstance(action, Attend):
        return (action.kv, action.q, action.into), ()
    if isinstance(action, AttendBack):
        rows = (action.out if action.delta is None else action.delta,)
        return (action.kv, action.dkv, action.q, action.dout, action.lse, action.dq, *rows), ()
    if isinstance(action, Fold):
        return (action.src,), (action.into,)
    if isinstance(action, Zeros):
        return (action.like,), (action.role,)
    if isinstance(action, Add):
        return (action.into, action.src), ()
    if isinstance(action, LseMax):
        return (action.part,), (action.into,)
    if isinstance(action, Weigh):
        return (action.part, action.m), (action.num, action.den)
    if isinstance(action, Land):
        return (action.num, action.den, action.m, action.into), ()
    if isinstance(action, Local):
        return (action.src if isinstance(action.src, tuple) else (action.src,)), \
            ((action.dst,) if action.dst is not None else ())
    raise TypeError(f"unknown action {action!r}")


#: what a role holds: a query-like ``[b, s, h, d]`` tensor, key/values (packed ``[2, b, s, h_kv, d]`` or the
#: ``(k, v)`` pair), output accumulators (or an ``(out, lse)`` pair), an lse ``[b, h, s]``, or what a
#: schedule's own ``Local`` function makes (not checked); ``"*"`` after a kind: several of them stacked
#: (an action takes one by its index)
ROWS, KV, ACC, LSE, ANY = "rows", "kv", "acc", "lse", "any"
#: the roles a phase's program starts from (``Schedule.forward`` / ``Schedule.backward``), with their kinds
START_ROLES = {"forward": {"q": ROWS, "kv0": KV},
               "backward": {"q": ROWS, "kv0": KV, "dout": ROWS, "out": ROWS, "lse": LSE}}


def _made(action, kinds: dict[str, str]) -> dict[str, str]:
    """The kinds of the roles an action makes."""
    if isinstance(action, Zeros):
        like = kinds.get(action.like, ANY).rstrip("*")
        return {action.role: ACC if action.output else like + ("*" if action.count is not None else "")}
    if isinstance(action, Fold):
        return {action.into: {"o": ACC, "dq": ROWS, "dkv": KV}[action.item]}
    if isinstance(action, LseMax):
        return {action.into: LSE}
    return dict.fromkeys(_reads_writes(action)[1], ANY)


def _expected(action) -> list[tuple[str, str, object]]:
    """``(role, kind, index)`` of what an action reads that must be of a kind (``index``: the slice it
    takes of a stacked role; None: it takes the role whole)."""
    if isinstance(action, Attend):
        return [(action.q, ROWS, None), (action.kv, KV, action.index), (action.into, ACC, None)]
    if isinstance(action, AttendBack):
        rows = [(r, ROWS, None) for r in (action.q, action.dout, action.dq, action.out) if r is not None]
        return rows + [(action.lse, LSE, None), (action.kv, KV, action.index), (action.dkv, KV, action.dkv_index)]
    if isinstance(action, LseMax | Weigh):
        return [(action.part, ACC, None)]
    if isinstance(action, Land):
        return [(action.into, ACC, None)]
    return []


def check_program(steps: list[Step], start: dict[str, str]) -> list[Step]:
    """``steps`` when every role an action or op reads was declared before it (one of ``start``, a map of
    roles to their kinds, or made by an earlier action or received by an earlier op) and holds what the
    action takes (:data:`ROWS`, :data:`KV`, :data:`ACC`, :data:`LSE`; stacked ones by an index), else
    ``ValueError`` naming the first that does not; checked before anything runs."""
    kinds = dict(start)

    def need(i: int, what, roles) -> None:
        for role in roles:
            if role not in kinds:
                raise ValueError(f"step {i}: {what!r} uses the role {role!r}, which no earlier step declares "
                                 f"(known: {', '.join(sorted(kinds))})")

    def act(i: int, action) -> None:
        need(i, action, _reads_writes(action)[0])
        for role, kind, index in _expected(action):
            got = kinds[role]
            if got != ANY and got != (kind + "*" if index is not None else kind):
                raise ValueError(f"step {i}: {action!r} takes role {role!r} as {kind}"
                                 f"{' (one of several, by index)' if index is not None else ''}, but it holds {got}")
        kinds.update(_made(action, kinds))

    for i, st in enumerate(steps):
        for action in st.before:
            act(i, action)
        for op in st.comm:
            need(i, op, [op.send] if op.send is not None else [])
            if op.op == "recv":
                need(i, op, [op.recv])
            elif op.recv is not None:
                sent = kinds.get(op.send, ANY)
                kinds[op.recv] = (sent + "*" if op.op == "all_gather" and sent != ANY
                                  else sent.rstrip("*") if op.op == "reduce_scatter" else sent)
        for action in (*st.run, *st.after):
            act(i, action)
    return steps


def _last_uses(steps: list[Step]) -> list[set[str]]:
    """Per step, the roles whose last use is in it (dropped once the step ends; a role an op sends or
    receives into lives until the op's wait)."""
    last: dict[str, int] = {}
    for i, st in enumerate(steps):
        for op in st.comm:
            for role in (op.send, op.recv):
                if role is not None:
                    last[role] = max(last.get(role, i), i if op.wait is None else op.wait)
        for action in (*st.before, *st.run, *st.after):
            for role in sum(_reads_writes(action), ()):
                last[role] = i
    drop: list[set[str]] = [set() for _ in steps]
    for role, i in last.items():
        drop[i].add(role)
    return drop


def _peers(rt: Runtime, op: CommOp) -> tuple[int, int, int, int]:
    """A sendrecv's (destination, source) group ranks, and their places inside the ``within`` group."""
    size = op.within or rt.world
    base, x = divmod(rt.rank, size)
    to, frm = (x + op.peer) % size, (x - op.peer) % size
    return base * size + to, base * size + frm, to, frm


def _tensor(roles: dict[str, Any], role: str) -> torch.Tensor:
    """Role ``role`` as one tensor: a pair of tensors (``(k, v)``, as a schedule's forward starts) is
    stacked the first time it must be one (sent, or the model of a buffer), and kept so."""
    value = roles[role]
    if isinstance(value, tuple):
        value = roles[role] = torch.stack(value)
    return value


def _issue(rt: Runtime, op: CommOp, tag: int, roles: dict[str, Any]):
    """Start ``op`` on this rank; its handle. Received buffers are new (``Communicator.new_buffer``)."""
    comm = rt.comm
    if op.op == "recv":  # into the buffer an action of the step (``before``) made
        return comm.send_recv(recvs=[(roles[op.recv], op.root)], tag=tag)
    send = _tensor(roles, op.send)

    def received(shape: tuple[int, ...] = send.shape) -> torch.Tensor:
        """A new buffer of ``shape`` in ``send``'s dtype and device, kept as role ``op.recv``."""
        roles[op.recv] = buf = comm.new_buffer(shape, send.dtype, send.device)
        return buf

    if op.op == "broadcast":  # the root's own tensor is its received role
        roles[op.recv] = buf = send if rt.rank == op.root else received()
        return comm.broadcast(buf, src=op.root, async_op=True)
    if op.op == "send":
        return comm.send_recv(sends=[(send, op.root)], tag=tag)
    if op.op == "all_reduce":
        return comm.all_reduce(send, op=op.reduce_op, async_op=True)
    if op.op == "reduce":
        return comm.reduce(send, dst=op.root, op=op.reduce_op, async_op=True)
    if op.op == "sendrecv":
        dst, src, to, frm = _peers(rt, op)
        if not op.slot:
            return comm.send_recv([(send, dst)], [(received(), src)], tag=tag)
        buf = roles.get(op.recv)
        if buf is None:  # the exchange's first slice: the buffer, with this rank's own slice
            buf = received()
            own = rt.rank % (op.within or rt.world)
            buf[own].copy_(send[own])
        return comm.send_recv([(send[to], dst)], [(buf[frm], src)], tag=tag)
    if op.op == "all_to_all":
        return comm.all_to_all(received(), send, async_op=True)
    hierarchy = rt.topology if op.hierarchical else None
    if op.op == "all_gather":
        return comm.hierarchical_all_gather(received((comm.world_size, *send.shape)), send, hierarchy, async_op=True)
    if op.op == "reduce_scatter":
        return comm.hierarchical_reduce_scatter(received(send.shape[1:]), send, hierarchy, async_op=True)
    raise NotImplementedError(f"the executor does not run {op.op!r} ops yet")


def _slice(t: torch.Tensor, index: int | str | None, rank: int) -> torch.Tensor:
    if index is None:
        return t
    return t[rank if index == OWN else index]


def _do(rt: Runtime, action, roles: dict[str, Any], blocks_of: BlocksOf,
        transforms: dict[str, Callable[[Any], Any]]) -> None:
    if isinstance(action, Attend):
        blocks = blocks_of(action.src)
        if blocks is not None:
            kv = _slice(roles[action.kv], action.index, rt.rank)
            attend(rt, roles[action.q], kv[0], kv[1], blocks, roles[action.into])
    elif isinstance(action, AttendBack):
        blocks = blocks_of(action.src)
        if blocks is not None:
            kv = _slice(roles[action.kv], action.index, rt.rank)
            dkv = _slice(roles[action.dkv], action.dkv_index, rt.rank)
            out = None if action.out is None else roles[action.out]
            delta = None if action.delta is None else roles[action.delta]
            attend_backward(rt, roles[action.dout], roles[action.q], kv[0], kv[1], out, roles[action.lse], blocks,
                            roles[action.dq], dkv[0], dkv[1], delta)
    elif isinstance(action, Zeros):
        like = roles[action.like]
        if action.output:
            roles[action.role] = Accumulators(like)
            return
        shape = (len(like), *like[0].shape) if isinstance(like, tuple) else tuple(like.shape)
        ref = like[0] if isinstance(like, tuple) else like
        shape = shape if action.count is None else (action.count, *shape)
        roles[action.role] = torch.zeros(shape, dtype=acc_dtype(ref.dtype), device=ref.device)
    elif isinstance(action, Fold):
        _fold(action, roles)
    elif isinstance(action, Add):
        if action.on is None or action.on == rt.rank:
            roles[action.into] += roles[action.src]
    elif isinstance(action, LseMax):
        roles[action.into] = roles[action.part].lse.clone()
    elif isinstance(action, Weigh):
        part = roles[action.part]
        roles[action.num], roles[action.den] = merge_weights(part.out, part.lse, roles[action.m])
    elif isinstance(action, Local):
        src = tuple(roles[r] for r in action.src) if isinstance(action.src, tuple) else roles[action.src]
        result = transforms[action.fn](src)
        if action.dst is not None:
            roles[action.dst] = result
    elif isinstance(action, Land):
        if action.owner == rt.rank:
            acc = roles[action.into]
            merge_into(acc.out, acc.lse, *merge_finish(roles[action.num], roles[action.den], roles[action.m]))
    else:
        raise TypeError(f"unknown action {action!r}")


def _rows_of(item: str, value, span: tuple[int, int] | None):
    """Sequence rows ``span`` of a partial result of ``item`` (views; all of it for None). An "o" partial,
    output accumulators or an ``(out, lse)`` pair, comes as the pair."""
    sl = slice(None) if span is None else slice(*span)
    if item == "o":
        out, lse = value  # Accumulators unpack as (out, lse) too
        return out[:, sl], lse[:, :, sl]
    return value[:, :, sl] if item == "dkv" else value[:, sl]


def _fold(action: Fold, roles: dict[str, Any]) -> None:
    value = _rows_of(action.item, roles[action.src], action.at)
    if action.into not in roles:  # the first contribution becomes the partial result
        roles[action.into] = value
        return
    into = roles[action.into]
    target = _rows_of(action.item, into, action.rows)
    if action.item == "o" and isinstance(into, Accumulators) and into.claim(slice(*(action.rows or (None,)))):
        for t, x in zip(target, value):  # rows no block reached yet take the partial as is (now written)
            t.copy_(x)
    elif action.item == "o":
        merge_into(target[0], target[1], value[0], value[1])
    else:
        target.add_(value)


def execute(rt: Runtime, steps: list[Step], roles: dict[str, Any], blocks_of: BlocksOf,
            keep: tuple[str, ...] = (), transforms: Mapping[Hashable, Callable[[Any], Any]] | None = None
            ) -> dict[str, Any]:
    """Run ``steps`` on this rank, starting from the buffers ``roles`` (e.g. ``q``, ``kv0``; backward
    also ``dout``, ``out``, ``lse``); returns the roles alive at the end, and those of ``keep`` whatever
    their last use. Per step: its ``before`` actions, issue its ops (in order; the i-th op of a step
    has tag i), its ``run`` actions, wait for the ops, its ``after`` actions, then drop the roles no
    later step names. An op with a later ``wait`` stays in flight until the step it names, where it is
    waited for first of all, before that step's actions and ops (so a message arrives while earlier
    steps compute, and a step can forward what it waited for).
    ``blocks_of``: the blocks of an action's source on this rank; ``transforms``: the functions
    :class:`~cpattn.core.steps.Local` actions name."""
    transforms = transforms or {}
    drops = rt.block_cache.get_for(steps, ("last uses", id(steps)), lambda: _last_uses(steps))
    keep = set(keep)
    due: dict[int, list] = {}  # step index -> handles: earlier steps' waited for at its start, its own after its run
    for i, (st, drop) in enumerate(zip(steps, drops)):
        for handle in due.pop(i, ()):
            handle.wait()
        for action in st.before:
            _do(rt, action, roles, blocks_of, transforms)
        for n, op in enumerate(st.comm):
            handle = _issue(rt, op, n if op.tag is None else op.tag, roles)
            wait = i if op.wait is None else op.wait
            if wait < i:
                raise ValueError(f"step {i}: an op cannot be waited for at an earlier step ({op.wait})")
            due.setdefault(wait, []).append(handle)
        for action in st.run:
            _do(rt, action, roles, blocks_of, transforms)
        for handle in due.pop(i, ()):  # its own ops (popped: a finished op's handle still holds its tensors)
            handle.wait()
        for action in st.after:
            _do(rt, action, roles, blocks_of, transforms)
        for role in drop - keep:
            roles.pop(role, None)
    if due:
        raise ValueError(f"ops wait at steps {sorted(due)}, past the last step ({len(steps) - 1})")
    return roles


__all__ = ["ACC", "ANY", "KV", "LSE", "ROWS", "START_ROLES", "Accumulators", "BoundedCache", "Run", "Runtime",
           "attend", "attend_backward", "check_program", "execute"]
