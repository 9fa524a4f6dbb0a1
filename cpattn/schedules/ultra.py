"""UltraAttn executor: runs a :class:`~cpattn.planner.Plan` on a process group (ultraattn.md, "Executor").

Layout: contiguous (rank r holds chunks ``r * c .. r * c + c - 1`` of the plan's ``c`` chunks per
rank). Topology: ``rt.topology`` (nodes x devices per node; on CPU/gloo an emulated one), else this
machine as one node (the ``local`` preset of :mod:`cpattn.cost.presets`). The plan is built on group
rank 0 (or read from its cache) and broadcast as JSON to the other ranks on a separate, uncounted
communicator, so every rank runs the identical plan; each process keeps the plans it has run in
memory. Planning errors are re-raised on every rank.

Each rank walks its operations in plan order:

- ``recv``: post an asynchronous receive (one call per message, so each can be waited on alone);
- ``send``: post an asynchronous send (consecutive sends go in one batched call); an input that this
  rank relays is sent as it arrived, a partial result after every contribution to it was folded in;
- ``compute``: wait for its inputs, run one kernel call (fused rectangle, causal square or partial
  cell) and fold its output into the per-chunk accumulators: lse merge of (out, lse) forward, float32
  sums of dq and of packed dk/dv backward;
- ``merge``: wait for a partial result and fold it in (pairwise, as partials arrive).

A chunk's accumulator on its owner is a view of the rank's output, so when all partials have been
merged the owner holds the exact result. Backward, a row's remote kernels get q, dout, the final out
and its lse from the owner, which makes per-block gradients add up exactly. Only key/value heads
travel (GQA). The plan's validation guarantees the order cannot deadlock and messages between two
ranks are posted in the same order on both sides.

Communication per rank: one ``send`` per transfer leaving it and one ``recv`` per transfer arriving,
with the sizes of :class:`cpattn.planner.kernel_graph.Sizes`; :meth:`UltraSchedule.volume` reads
them from the plan last run for that shape.

Cost model: :meth:`UltraSchedule.estimate_override` plans the problem on the topology asked for (or
reads the plan cache) and reports the plan's simulated makespans, so ``cpattn.cost.estimate`` and
"auto" (for masks other than causal and full) cover ``ultra`` too.
"""

from __future__ import annotations

import json
import logging

import torch

from .. import kernels
from ..comm import Communicator
from ..cost import presets
from ..cost.estimate import Estimate, resident_bytes
from ..cost.profile import ProfileError
from ..cost.steps import Problem, split_phase
from ..cost.topology import Topology
from ..kernels import acc_dtype
from ..layout import Layout
from ..layout import from_pieces as layout_from_pieces
from ..layout import pieces as layout_pieces
from ..masks import BlockKind
from ..merge import merge_into
from ..planner import Plan, PlanOptions, Request, choose_order, get_plan, request
from ..planner.kernel_graph import INPUTS, Sizes
from ..planner.plan import Op
from .base import Runtime, Schedule, Shape, Volume

log = logging.getLogger(__name__)
TAGS = {"forward": 0, "backward": 1}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float64: "float64"}


def _broadcast_text(comm: Communicator, text: str | None, device: torch.device) -> str:
    """Group rank 0's ``text`` on every rank (its length, then its UTF-8 bytes, as tensors on ``device``:
    NCCL only moves GPU tensors)."""
    raw = text.encode() if comm.rank == 0 else b""
    length = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    comm.broadcast(length, src=0)
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    if comm.rank == 0:
        data.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    comm.broadcast(data, src=0)
    return data.cpu().numpy().tobytes().decode()


class _Phase:
    """The state of one phase on one rank: inputs at hand, pending receives, accumulators, sends."""

    def __init__(self, rt: Runtime, plan: Plan, phase: str, local: dict[str, torch.Tensor],
                 acc: dict[str, torch.Tensor]) -> None:
        self.rt, self.plan, self.phase = rt, plan, phase
        self.ph = plan.phase(phase)
        self.rank, self.world = rt.rank, rt.world
        self.local, self.own_acc = local, acc
        self.c = plan.chunks_per_rank
        self.chunk = plan.table.chunk
        q = local["q"]
        self.batch, _, self.heads, self.head_dim = q.shape
        self.kv_heads = local["k"].shape[2]
        self.dtype, self.acc = q.dtype, acc_dtype(q.dtype)
        self.device = q.device
        self.input_items = {item for item, _ in INPUTS[phase]}
        self.incoming = {(t.item, t.chunk): n for n, t in enumerate(self.ph.transfers)
                         if t.dst == self.rank and t.item in self.input_items}
        self.inputs: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}  # received, unpacked
        self.raw: dict[tuple[str, int], torch.Tensor] = {}  # received, as they arrived (for relays)
        self.pending: dict[int, tuple[object, torch.Tensor]] = {}  # transfer id -> (handle, buffer)
        self.partial: dict[tuple[str, int], object] = {}  # (item, chunk) -> accumulator on this rank
        self.send_batch: list[tuple[torch.Tensor, int]] = []
        self.send_handles: list = []
        self.keep: list[torch.Tensor] = []  # send buffers, alive until their sends complete

    # ------------------------------------------------------------------ chunk views
    def _rows(self, first: int, last: int) -> slice:
        """Local token rows of owned chunks ``first .. last``."""
        return slice((first - self.rank * self.c) * self.chunk, (last + 1 - self.rank * self.c) * self.chunk)

    def _owned(self, chunk: int) -> bool:
        return self.plan.owner[chunk] == self.rank

    def _own_input(self, item: str, sl: slice) -> tuple[torch.Tensor, ...]:
        """Parts of an input item for owned rows ``sl``: q: (q,); kv: (k, v); qb: (q, dout, out, lse)."""
        loc = self.local
        if item == "q":
            return (loc["q"][:, sl],)
        if item == "kv":
            return loc["k"][:, sl], loc["v"][:, sl]
        return loc["q"][:, sl], loc["dout"][:, sl], loc["out"][:, sl], loc["lse"][:, :, sl]

    def _own_acc(self, item: str, chunk: int):
        sl, acc = self._rows(chunk, chunk), self.own_acc
        if item == "o":
            return acc["out"][:, sl], acc["lse"][:, :, sl]
        if item == "dq":
            return acc["dq"][:, sl]
        return acc["dkv"][:, :, sl]  # dkv: [2, b, chunk, h_kv, d]

    def _gather(self, item: str, chunks: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """An input item's parts for ``chunks``, each concatenated along its sequence dimension (a view
        of the local tensors when they are consecutive chunks this rank owns)."""
        if all(self._owned(c) for c in chunks) and list(chunks) == list(range(chunks[0], chunks[-1] + 1)):
            return self._own_input(item, self._rows(chunks[0], chunks[-1]))
        parts = [self._own_input(item, self._rows(c, c)) if self._owned(c) else self._arrive(item, c)
                 for c in chunks]
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat([p[x] for p in parts], 2 if item == "qb" and x == 3 else 1)
                     for x in range(len(parts[0])))

    # ------------------------------------------------------------------ messages
    def _sizes(self) -> Sizes:
        return self.plan.sizes(self.batch, self.heads, self.kv_heads, self.head_dim,
                               torch.empty((), dtype=self.dtype).element_size(),
                               torch.empty((), dtype=self.acc).element_size())

    def _buffer(self, item: str) -> torch.Tensor:
        b, n, h, hkv, d = self.batch, self.chunk, self.heads, self.kv_heads, self.head_dim
        new = Communicator.new_buffer
        if item in ("q", "dq"):
            return new((b, n, h, d), self.dtype if item == "q" else self.acc, self.device)
        if item in ("kv", "dkv"):
            return new((2, b, n, hkv, d), self.dtype if item == "kv" else self.acc, self.device)
        if item == "o":
            return new((b * n * h * (d + 1),), self.acc, self.device)
        return new((self._sizes().item_bytes("qb"),), torch.uint8, self.device)

    def _unpack(self, item: str, buf: torch.Tensor):
        """Input items as a tuple of parts (see :meth:`_own_input`); ``o`` as (out, lse); dq, dkv as is."""
        b, n, h, d = self.batch, self.chunk, self.heads, self.head_dim
        if item == "q":
            return (buf,)
        if item == "kv":
            return buf[0], buf[1]
        if item == "o":
            return buf[:b * n * h * d].view(b, n, h, d), buf[b * n * h * d:].view(b, h, n)
        if item == "qb":  # lse (accumulation dtype) first, so every part stays aligned
            lse_bytes = b * h * n * torch.empty((), dtype=self.acc).element_size()
            lse = buf[:lse_bytes].view(self.acc).view(b, h, n)
            rest = buf[lse_bytes:].view(self.dtype).view(3, b, n, h, d)
            return rest[0], rest[1], rest[2], lse
        return buf

    def _pack(self, item: str, value) -> torch.Tensor:
        """One contiguous message: the inverse of :meth:`_unpack`."""
        if item == "q":
            return value[0].contiguous()
        if item == "kv":
            return torch.stack(value)
        if item == "o":
            return torch.cat([value[0].reshape(-1), value[1].reshape(-1)])
        if item == "qb":
            q, dout, out, lse = value
            rest = torch.stack([q, dout, out]).reshape(-1).view(torch.uint8)
            return torch.cat([lse.contiguous().view(-1).view(torch.uint8), rest])
        return value.contiguous()

    def _wait(self, n: int) -> torch.Tensor:
        handle, buf = self.pending.pop(n)
        handle.wait()
        return buf

    def _arrive(self, item: str, chunk: int) -> tuple[torch.Tensor, ...]:
        """A received input (waiting for its transfer the first time it is needed)."""
        if (item, chunk) not in self.inputs:
            buf = self._wait(self.incoming[item, chunk])
            self.raw[item, chunk] = buf
            self.inputs[item, chunk] = self._unpack(item, buf)
        return self.inputs[item, chunk]

    def _flush_sends(self) -> None:
        if self.send_batch:
            self.send_handles.append(self.rt.comm.send_recv(sends=self.send_batch, tag=TAGS[self.phase]))
            self.send_batch = []

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

    # ------------------------------------------------------------------ operations
    def recv(self, n: int) -> None:
        t = self.ph.transfers[n]
        buf = self._buffer(t.item)
        self.pending[n] = (self.rt.comm.send_recv(recvs=[(buf, t.src)], tag=TAGS[self.phase]), buf)

    def send(self, n: int) -> None:
        t = self.ph.transfers[n]
        if t.item not in self.input_items:
            buf = self._pack(t.item, self.partial.pop((t.item, t.chunk)))
        elif self._owned(t.chunk):
            buf = self._pack(t.item, self._own_input(t.item, self._rows(t.chunk, t.chunk)))
        else:  # a relay forwards the message as it arrived
            self._flush_sends()
            self._arrive(t.item, t.chunk)
            buf = self.raw[t.item, t.chunk]
        self.keep.append(buf)
        self.send_batch.append((buf, t.dst))

    def merge(self, n: int) -> None:
        t = self.ph.transfers[n]
        self._fold(t.item, t.chunk, self._unpack(t.item, self._wait(n)))

    def compute(self, k: int) -> None:
        kn, rt, n = self.ph.kernels[k], self.rt, self.chunk
        kind = BlockKind(kn.kind)
        mask = self._dense(kn.rows[0], kn.cols[0]) if kind == BlockKind.PARTIAL else None
        k_cat, v_cat = self._gather("kv", kn.cols)
        if self.phase == "forward":
            (q_cat,) = self._gather("q", kn.rows)
            out, lse = kernels.forward(q_cat, k_cat, v_cat, kind, rt.scale, mask, rt.backend)
            for t, i in enumerate(kn.rows):
                self._fold("o", i, (out[:, t * n:(t + 1) * n], lse[:, :, t * n:(t + 1) * n]))
            return
        q_cat, dout_cat, out_cat, lse_cat = self._gather("qb", kn.rows)
        dq, dk, dv = kernels.backward(dout_cat, q_cat, k_cat, v_cat, out_cat, lse_cat, kind, rt.scale, mask,
                                      rt.backend)
        for t, i in enumerate(kn.rows):
            self._fold("dq", i, dq[:, t * n:(t + 1) * n])
        for t, j in enumerate(kn.cols):
            self._fold("dkv", j, (dk[:, t * n:(t + 1) * n], dv[:, t * n:(t + 1) * n]))

    def _dense(self, i: int, j: int) -> torch.Tensor:
        """Boolean mask of cell (i, j), assembled from the original token ranges of its chunks (the plan
        may hold the sequence reordered); padding rows and columns (positions >= valid_len) attend
        nothing."""
        n, valid = self.chunk, self.plan.key["valid_len"]
        allowed = torch.zeros(n, n, dtype=torch.bool)
        row = 0
        for q0, q1 in self.plan.source_ranges(i):
            col = 0
            for k0, k1 in self.plan.source_ranges(j):
                qe, ke = min(q1, valid), min(k1, valid)
                if qe > q0 and ke > k0:
                    allowed[row:row + qe - q0, col:col + ke - k0] = self.rt.mask.dense(q0, qe, k0, ke)
                col += k1 - k0
            row += q1 - q0
        return allowed.to(self.device)

    # ------------------------------------------------------------------ run
    def run(self) -> None:
        for op in self.ph.ops[self.rank]:
            if op.kind == "send":
                self.send(op.id)
                continue
            self._flush_sends()
            if op.kind == "recv":
                self.recv(op.id)
            elif op.kind == "compute":
                self.compute(op.id)
            else:
                self.merge(op.id)
        self._flush_sends()
        if self.pending or self.partial:
            raise RuntimeError(f"ultra {self.phase}: rank {self.rank} ended with {len(self.pending)} unread "
                               f"messages and {len(self.partial)} unsent partial results (invalid plan)")
        for h in self.send_handles:
            h.wait()


class UltraSchedule(Schedule):
    name = "ultra"
    layout = "contiguous"
    custom_layout = True
    masks = "any"
    memory = "O(local) + the chunks the plan brings in"
    planned = True
    summary = "UltraAttn: ILP-placed cells, fused kernels, scheduled p2p, exact merges at owners"

    def __init__(self, options: PlanOptions | None = None) -> None:
        self.options = options or PlanOptions()
        self._requests: dict[tuple, Request] = {}  # problem -> its resolved request
        self._plans: dict[str, Plan] = {}  # request digest -> plan, on this process
        self._by_shape: dict[tuple, Plan] = {}  # for volume(): the plan last run for a shape
        self._estimated: dict[str, Plan] = {}  # request digest -> plan, for estimates only

    def plan(self, rt: Runtime, q: torch.Tensor, k: torch.Tensor) -> Plan:
        """The plan for this call: from this process's memory, else built (or read from the cache)
        on group rank 0 and broadcast."""
        topology = rt.topology if rt.topology is not None else _local_topology(rt.world)
        if topology.world != rt.world:
            raise ValueError(f"topology {topology.nodes} x {topology.devices_per_node} = {topology.world} ranks, "
                             f"but the group has {rt.world}")
        b, _, h, d = q.shape
        _, order = layout_pieces(rt.layout, rt.seq_len, rt.world)
        args = (rt.mask, rt.seq_len, topology, b, h, k.shape[2], d, _DTYPE_NAMES[q.dtype], self.options, rt.valid_len,
                order)
        req = self._requests.get(args)
        if req is None:  # resolving a request classifies the mask's cells: once per problem
            req = self._requests[args] = request(*args)
        digest = req.digest()
        plan = self._plans.get(digest)
        if plan is None:
            plan = self._distribute(rt, req, q.device)
            self._plans[digest] = plan
        self._by_shape[_shape_key(Shape.of(q, k, rt.world))] = plan
        return plan

    def estimate_override(self, problem: Problem, topology: Topology, phase: str) -> Estimate:
        """The plan's prediction for ``problem`` on ``topology``, the plan built with this schedule's
        options (or read from the plan cache: :func:`cpattn.planner.get_plan`; the planner is
        deterministic). Per phase: ``total``, the plan's simulated makespan (seconds); ``compute``, the
        busiest rank's compute lane (kernels and merges); ``comm``, the busiest rank's transfers (the
        busier of its send and receive lanes; a plan may also wait on dependencies, so total can exceed
        compute + comm); ``bytes_per_rank``, the busiest sender's bytes (as :meth:`Plan.volume` counts
        them); ``peak_memory``, the resident tensors plus everything a rank receives and sends in the
        phase (its buffers live to the end of the phase). Planning takes from under a second to tens of
        seconds (64 ranks, 512K tokens)."""
        order = choose_order(problem.mask, problem.seq_len, problem.world, options=self.options)
        args = (problem.mask, problem.seq_len, topology, problem.batch, problem.heads, problem.kv_heads,
                problem.head_dim, problem.dtype, self.options, None, order)
        req = self._requests.get(args)
        if req is None:
            req = self._requests[args] = request(*args)
        digest = req.digest()
        plan = self._estimated.get(digest)
        if plan is None:  # not self._plans: a plan there skips the broadcast that every rank must join
            plan = self._estimated[digest] = get_plan(req)
        sizes = plan.sizes(problem.batch, problem.heads, problem.kv_heads, problem.head_dim, problem.elem,
                           problem.acc_elem)
        total = compute = comm = 0.0
        sent = peak = 0
        for ph in split_phase(phase):
            pp = plan.phase(ph)
            total += pp.predicted
            compute += max(_busy(ops, ("compute", "merge")) for ops in pp.ops)
            comm += max(max(_busy(ops, ("send",)), _busy(ops, ("recv",))) for ops in pp.ops)
            out, into = [0] * problem.world, [0] * problem.world
            for t in pp.transfers:
                out[t.src] += sizes.item_bytes(t.item)
                into[t.dst] += sizes.item_bytes(t.item)
            sent += max(out)
            peak = max(peak, resident_bytes(problem, ph) + max(a + b for a, b in zip(out, into)))
        return Estimate(total, compute, comm, total - compute, sent, peak, self.name, phase, problem.flops(phase))

    def default_layout(self, mask, seq_len: int, world: int) -> tuple[Layout, int] | None:
        """Round-robin pieces when :func:`cpattn.planner.choose_order` finds that they keep clearly more
        work local than contiguous ranks (e.g. strided masks); None (contiguous) otherwise."""
        padded = Layout(self.layout).padded_len(seq_len, world)
        order = choose_order(mask, padded, world, valid_len=seq_len, options=self.options)
        if order is None:
            return None
        return layout_from_pieces(order, padded, world, f"ultra-round-robin-{len(order) // world}"), padded

    def _distribute(self, rt: Runtime, req: Request, device: torch.device) -> Plan:
        if rt.world == 1:
            return get_plan(req)
        setup = Communicator(rt.comm.group)  # planning traffic is not attention traffic
        text = None
        if setup.rank == 0:
            try:
                text = get_plan(req).to_json()
            except Exception as exc:  # every rank must hear about it, or they would wait forever
                text = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
        text = _broadcast_text(setup, text, device)
        if text.startswith('{"error":'):
            raise RuntimeError(f"ultra: planning failed on rank 0: {json.loads(text)['error']}")
        return Plan.from_json(text)

    def forward(self, rt: Runtime, q, k, v):
        plan = self.plan(rt, q, k)
        b, s, h, d = q.shape
        acc = acc_dtype(q.dtype)
        out = torch.zeros(b, s, h, d, dtype=acc, device=q.device)
        lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
        _Phase(rt, plan, "forward", {"q": q, "k": k, "v": v}, {"out": out, "lse": lse}).run()
        return out.to(q.dtype), lse

    def backward(self, rt: Runtime, dout, q, k, v, out, lse):
        plan = self.plan(rt, q, k)
        acc = acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=acc, device=q.device)
        local = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}
        _Phase(rt, plan, "backward", local, {"dq": dq, "dkv": dkv}).run()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)

    def volume(self, shape: Shape, rank: int) -> Volume:
        plan = self._by_shape.get(_shape_key(shape))
        if plan is None:
            raise ValueError("ultra's volume comes from its plan: run the schedule on this shape first "
                             "(or use cpattn.planner.Plan.volume)")
        return plan.volume(rank, plan.sizes(shape.batch, shape.heads, shape.kv_heads, shape.head_dim, shape.elem,
                                            shape.acc_elem))


def _local_topology(world: int) -> Topology:
    """This machine (one node): its calibration profile's figures, or conservative defaults."""
    try:
        return presets.preset("local", world)
    except ProfileError as exc:
        log.warning("ultra: ignoring the calibration profile (%s); planning with conservative defaults", exc)
        return presets.local(world)


def _busy(ops: tuple[Op, ...], kinds: tuple[str, ...]) -> float:
    """Seconds a rank's operations of ``kinds`` take in its plan (they share one lane, so they add)."""
    return sum(op.end - op.start for op in ops if op.kind in kinds)


def _shape_key(shape: Shape) -> tuple:
    return (shape.world, shape.local_len, shape.batch, shape.heads, shape.kv_heads, shape.head_dim, shape.elem)


__all__ = ["UltraSchedule"]
