"""The UltraAttn plan: what every rank does, as plain, validated JSON (ultraattn.md, "Plan").

:func:`build_plan` runs the planner: block table at a chosen granularity, node- and device-level
placement (:mod:`~cpattn.planner.tiling`), kernel fusion under the size bound that the cost model
predicts fastest, routing and the kernel graph (:mod:`~cpattn.planner.kernel_graph`), the schedule
(:mod:`~cpattn.planner.schedule_ilp`), then each rank's ordered operations with their dependencies
— separately for forward and backward (same ownership, possibly different placements).

:func:`get_plan` adds the on-disk cache: one JSON file per problem key under :func:`cache_dir`. A
file is validated on load (:func:`validate`: structure, coverage of every cell, routing, dependencies,
per-pair message order and freedom from deadlock); a corrupt or stale one is rebuilt with a warning.

Granularity. ``chunks_per_rank`` c (chunks of ``seq_len / (world * c)`` tokens) goes through powers
of two (up to ``max_chunks_per_rank`` and ``max_chunks`` in all, chunks of at least
``min_chunk_tokens``; the mask is classified once, at the finest, and coarsened) while the cost
model's forward + backward kernel time of the busiest rank, cells placed longest first, keeps
falling: finer chunks balance better and turn PARTIAL cells of block patterns into FULL or EMPTY ones,
coarser chunks run more efficient kernels. The node-level chunk is the coarsest at which a
longest-processing-time placement meets the load bound. Both can be fixed in :class:`PlanOptions`.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..cost.simulator import Timeline, simulate
from ..cost.steps import DTYPE_BYTES, Problem
from ..cost.steps import Kernel as CostKernel
from ..cost.topology import Topology
from ..layout import check_order
from ..masks import Mask, resolve
from . import block_table as bt
from .block_table import BlockTable
from .kernel_graph import OUTPUTS, PHASES, KernelGraph, Sizes, Transfer, dependencies, route
from .kernel_graph import build as build_graph
from .partition_ilp import MessageUnits, PartitionProblem, load_bound
from .schedule_ilp import Scheduled, schedule
from .tiling import Kernel, allocate, fuse_all, owners

log = logging.getLogger(__name__)

SCHEMA = "cpattn-plan"
SCHEMA_VERSION = 3  # also bumped when the planner's output changes, so cached plans are rebuilt
CACHE_ENV = "CPATTN_CACHE_DIR"
OP_KINDS = ("recv", "send", "compute", "merge")


@dataclass(frozen=True)
class PlanOptions:
    """Planner settings (part of the problem key).

    ``eps``: load tolerance of the partition ILP. ``time_budget``: about how many seconds the CP-SAT
    solves of one plan may take together (forward and backward: 35% each for the placements, which
    run in parallel threads across nodes, 15% each for the schedule); ``partition_time_limit`` /
    ``schedule_time_limit`` cap one solve (seconds). ``seed``: solver seed. ``use_solver``: False skips CP-SAT (greedy
    placement and list schedule). ``chunks_per_rank`` / ``node_chunk``: fix the granularity (None:
    automatic, see the module docstring). ``min_chunk_tokens``, ``max_chunks_per_rank`` and
    ``max_chunks`` (chunks of the whole sequence; the table has its square of cells): limits of the
    automatic choice."""

    eps: float = 0.1
    time_budget: float = 15.0
    partition_time_limit: float = 5.0
    schedule_time_limit: float = 10.0
    seed: int = 0
    use_solver: bool = True
    chunks_per_rank: int | None = None
    node_chunk: int | None = None
    min_chunk_tokens: int = 16
    max_chunks_per_rank: int = 8
    max_chunks: int = 128

    def __post_init__(self) -> None:
        if not (math.isfinite(self.eps) and self.eps >= 0):
            raise ValueError(f"PlanOptions.eps must be >= 0, got {self.eps!r}")
        for name in ("time_budget", "partition_time_limit", "schedule_time_limit"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PlanOptions.{name} must be > 0 seconds, got {getattr(self, name)!r}")
        for name in ("chunks_per_rank", "node_chunk"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"PlanOptions.{name} must be a positive int or None, got {value!r}")


@dataclass(frozen=True)
class Op:
    """One operation of a rank, in issue order: ``kind`` "recv"/"send" (transfer ``id``), "compute"
    (kernel ``id``) or "merge" (partial of transfer ``id``); predicted ``start``/``end`` (seconds);
    ``deps``: the tasks it waits for (``c{k}``, ``t{n}``, ``m{n}``)."""

    kind: str
    id: int
    start: float
    end: float
    deps: tuple[str, ...] = ()


@dataclass(frozen=True)
class PhasePlan:
    """One phase. ``assign``: rank of each cell, row-major, -1 for EMPTY cells. ``levels``: one report
    per placement solved. ``max_cells``: the kernel size bound chosen. ``ops[r]``: rank r's operations
    in issue order. ``predicted``: makespan (seconds). ``scheduler``: how the schedule was found."""

    phase: str
    assign: tuple[int, ...]
    levels: tuple[dict, ...]
    max_cells: int
    kernels: tuple[Kernel, ...]
    transfers: tuple[Transfer, ...]
    ops: tuple[tuple[Op, ...], ...]
    predicted: float
    scheduler: dict

    def sent(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src == rank]

    def received(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.dst == rank]


@dataclass(frozen=True)
class Plan:
    """A whole plan. ``key``: the problem (mask name and block-table digest, sizes, topology, options);
    ``table``; ``owner[i]``: the rank that holds chunk i; ``forward`` / ``backward``; ``seconds``: time
    spent planning."""

    key: dict
    table: BlockTable
    owner: tuple[int, ...]
    forward: PhasePlan
    backward: PhasePlan
    seconds: float = 0.0
    schema_version: int = field(default=SCHEMA_VERSION)

    @property
    def world(self) -> int:
        return int(self.key["world"])

    @property
    def chunks_per_rank(self) -> int:
        return self.table.n // self.world

    @property
    def order(self) -> tuple[int, ...] | None:
        """The sequence's pieces in the ranks' order (None: contiguous); plan chunks index the sequence
        so reordered."""
        order = self.key.get("order")
        return None if order is None else tuple(order)

    def source_ranges(self, chunk: int) -> list[tuple[int, int]]:
        """Original ``[start, stop)`` token ranges of plan chunk ``chunk``, in order."""
        n = self.table.chunk
        start, end = chunk * n, (chunk + 1) * n
        order = self.order
        if order is None:
            return [(start, end)]
        piece = int(self.key["seq_len"]) // len(order)
        out: list[tuple[int, int]] = []
        while start < end:
            p, off = divmod(start, piece)
            step = min(piece - off, end - start)
            a = order[p] * piece + off
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], a + step)
            else:
                out.append((a, a + step))
            start += step
        return out

    def phase(self, name: str) -> PhasePlan:
        if name not in PHASES:
            raise ValueError(f"phase={name!r} is unknown; accepted: {', '.join(PHASES)}")
        return self.forward if name == "forward" else self.backward

    def sizes(self, batch: int, heads: int, kv_heads: int, head_dim: int, elem: int, acc_elem: int) -> Sizes:
        return Sizes(batch, self.table.chunk, heads, kv_heads, head_dim, elem, acc_elem)

    def volume(self, rank: int, sizes: Sizes) -> dict[str, dict[str, dict[str, int]]]:
        """Analytic bytes and calls per op on ``rank`` (``cpattn.comm`` units): one send per transfer
        leaving it, one recv per transfer arriving, for each phase."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for name in PHASES:
            ph = self.phase(name)
            sent, recv = ph.sent(rank), ph.received(rank)
            vol = {}
            if sent:
                vol["send"] = {"calls": len(sent), "bytes_sent": sum(sizes.item_bytes(t.item) for t in sent),
                               "bytes_recv": 0}
            if recv:
                vol["recv"] = {"calls": len(recv), "bytes_sent": 0,
                               "bytes_recv": sum(sizes.item_bytes(t.item) for t in recv)}
            out[name] = vol
        return out

    # ------------------------------------------------------------------ JSON
    def as_dict(self) -> dict:
        return {"schema": SCHEMA, "version": self.schema_version, "key": self.key, "table": self.table.as_dict(),
                "owner": list(self.owner), "seconds": self.seconds,
                "phases": {name: _phase_dict(self.phase(name)) for name in PHASES}}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> Plan:
        """Parse and :func:`validate`; ValueError on anything malformed or inconsistent."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from exc
        plan = _from_dict(data)
        validate(plan)
        return plan


def _phase_dict(ph: PhasePlan) -> dict:
    return {"assign": list(ph.assign), "levels": list(ph.levels), "max_cells": ph.max_cells,
            "kernels": [[k.device, list(k.rows), list(k.cols), k.kind] for k in ph.kernels],
            "transfers": [[t.src, t.dst, t.item, t.chunk] for t in ph.transfers],
            "ops": [[[o.kind, o.id, o.start, o.end, list(o.deps)] for o in ops] for ops in ph.ops],
            "predicted": ph.predicted, "scheduler": ph.scheduler}


def _from_dict(data: dict) -> Plan:
    try:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"schema is {data.get('schema')!r}, expected {SCHEMA!r}")
        if data.get("version") != SCHEMA_VERSION:
            raise ValueError(f"schema version {data.get('version')!r}, this cpattn reads {SCHEMA_VERSION} (stale)")
        phases = {}
        for name in PHASES:
            p = data["phases"][name]
            phases[name] = PhasePlan(
                name, tuple(int(a) for a in p["assign"]), tuple(dict(r) for r in p["levels"]), int(p["max_cells"]),
                tuple(Kernel(int(d), tuple(int(i) for i in r), tuple(int(j) for j in c), str(kind))
                      for d, r, c, kind in p["kernels"]),
                tuple(Transfer(int(s), int(d), str(item), int(c)) for s, d, item, c in p["transfers"]),
                tuple(tuple(Op(str(k), int(i), float(s), float(e), tuple(str(x) for x in deps))
                            for k, i, s, e, deps in ops) for ops in p["ops"]),
                float(p["predicted"]), dict(p["scheduler"]))
        return Plan(dict(data["key"]), BlockTable.from_dict(data["table"]), tuple(int(o) for o in data["owner"]),
                    phases["forward"], phases["backward"], float(data.get("seconds", 0.0)), int(data["version"]))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed plan: {type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------------------- validation
def _topology_of(plan: Plan) -> Topology:
    return Topology(int(plan.key["nodes"]), int(plan.key["devices_per_node"]))


def _check_kernels(plan: Plan, ph: PhasePlan) -> None:
    table, world, n = plan.table, plan.world, plan.table.n
    if len(ph.assign) != n * n:
        raise ValueError(f"{ph.phase}: assign has {len(ph.assign)} cells, the table {n * n}")
    for idx, (g, kind) in enumerate(zip(ph.assign, table.kinds)):
        i, j = divmod(idx, n)
        if (kind == "empty") != (g == -1) or not -1 <= g < world:
            raise ValueError(f"{ph.phase}: cell ({i}, {j}) ({kind}) is assigned to {g}")
        if i == j and kind != "empty" and g != plan.owner[i]:
            raise ValueError(f"{ph.phase}: diagonal cell ({i}, {i}) is on rank {g}, not its owner {plan.owner[i]}")
    covered = [0] * (n * n)
    for k, kn in enumerate(ph.kernels):
        if not 0 <= kn.device < world or kn.kind not in ("full", "causal", "partial"):
            raise ValueError(f"{ph.phase}: kernel {k} has device {kn.device} and kind {kn.kind!r}")
        if (not kn.rows or not kn.cols or list(kn.rows) != sorted(set(kn.rows))
                or list(kn.cols) != sorted(set(kn.cols)) or kn.rows[-1] >= n or kn.cols[-1] >= n or kn.rows[0] < 0
                or kn.cols[0] < 0):
            raise ValueError(f"{ph.phase}: kernel {k} has invalid rows {kn.rows} or columns {kn.cols}")
        kinds = {table.kind(i, j) for i in kn.rows for j in kn.cols}
        if kn.kind == "full" and kinds != {"full"}:
            raise ValueError(f"{ph.phase}: full kernel {k} covers cells of kinds {sorted(kinds)}")
        if kn.kind == "causal":
            a, b = kn.rows[0], kn.rows[-1] + 1
            single = len(kn.rows) == len(kn.cols) == 1 and kinds == {"causal"}
            square = kn.rows == kn.cols == tuple(range(a, b)) and all(
                table.kind(i, j) == ("causal" if i == j else "full" if i > j else "empty")
                for i in kn.rows for j in kn.cols)
            if not (single or square):
                raise ValueError(f"{ph.phase}: causal kernel {k} is neither a causal cell nor a causal square on "
                                 "the diagonal")
        if kn.kind == "partial" and (len(kn.rows) != 1 or len(kn.cols) != 1 or kinds != {"partial"}):
            raise ValueError(f"{ph.phase}: partial kernel {k} must be one partial cell")
        for i in kn.rows:
            for j in kn.cols:
                if table.kind(i, j) == "empty":
                    continue
                if ph.assign[i * n + j] != kn.device:
                    raise ValueError(f"{ph.phase}: kernel {k} on rank {kn.device} computes cell ({i}, {j}) "
                                     f"assigned to rank {ph.assign[i * n + j]}")
                covered[i * n + j] += 1
    for idx, kind in enumerate(table.kinds):
        if (kind != "empty") != (covered[idx] == 1):
            raise ValueError(f"{ph.phase}: cell {divmod(idx, n)} is computed {covered[idx]} times")


def _check_ops(plan: Plan, ph: PhasePlan, deps: dict[str, tuple[str, ...]]) -> None:
    world = plan.world
    if len(ph.ops) != world:
        raise ValueError(f"{ph.phase}: operations for {len(ph.ops)} ranks, the world has {world}")
    outputs = {item for item, _ in OUTPUTS[ph.phase]}
    expected: dict[tuple[int, str, int], tuple[str, ...]] = {}
    for k, kn in enumerate(ph.kernels):
        expected[kn.device, "compute", k] = deps[f"c{k}"]
    for n, t in enumerate(ph.transfers):
        expected[t.src, "send", n] = deps[f"t{n}"]
        expected[t.dst, "recv", n] = ()
        if t.item in outputs:
            expected[t.dst, "merge", n] = (f"t{n}",)
    seen: dict[tuple[int, str, int], int] = {}
    for r, ops in enumerate(ph.ops):
        for pos, op in enumerate(ops):
            key = (r, op.kind, op.id)
            if op.kind not in OP_KINDS or key not in expected or key in seen:
                raise ValueError(f"{ph.phase}: rank {r} has an unexpected or repeated operation {op.kind} {op.id}")
            if op.deps != expected[key]:
                raise ValueError(f"{ph.phase}: rank {r} {op.kind} {op.id} lists dependencies {op.deps}, "
                                 f"expected {expected[key]}")
            if not (math.isfinite(op.start) and math.isfinite(op.end) and op.end >= op.start):
                raise ValueError(f"{ph.phase}: rank {r} {op.kind} {op.id} has times {op.start}, {op.end}")
            seen[key] = pos
    missing = set(expected) - set(seen)
    if missing:
        r, kind, i = sorted(missing)[0]
        raise ValueError(f"{ph.phase}: rank {r} lacks the operation {kind} {i}")
    # local dependencies come first on their rank
    for (r, kind, i), pos in seen.items():
        for d in expected[r, kind, i]:
            n = int(d[1:])
            local = (r, "recv", n) if d[0] == "t" else (r, "compute" if d[0] == "c" else "merge", n)
            if local not in seen or seen[local] >= pos:
                raise ValueError(f"{ph.phase}: rank {r} issues {kind} {i} before the {d} it waits for")
    # messages between two ranks are posted in the same order on both sides (they match in order)
    for src in range(world):
        for dst in range(world):
            sends = [op.id for op in ph.ops[src] if op.kind == "send" and ph.transfers[op.id].dst == dst]
            recvs = [op.id for op in ph.ops[dst] if op.kind == "recv" and ph.transfers[op.id].src == src]
            if sends != recvs:
                raise ValueError(f"{ph.phase}: rank {src} sends to {dst} in the order {sends}, which receives "
                                 f"in the order {recvs}")
    _check_progress(ph)
    # every pair of ranks posts its transfers in one order across both directions (NCCL matches a
    # pair's operations in sequence, whatever their direction)
    for a in range(world):
        for b in range(a + 1, world):
            seqs = [[op.id for op in ph.ops[r] if op.kind in ("send", "recv")
                     and {ph.transfers[op.id].src, ph.transfers[op.id].dst} == {a, b}] for r in (a, b)]
            if seqs[0] != seqs[1]:
                raise ValueError(f"{ph.phase}: ranks {a} and {b} post their transfers in different orders "
                                 f"({seqs[0]} and {seqs[1]})")


def _check_progress(ph: PhasePlan) -> None:
    """Replay the executor's blocking rules: sends and receives are posted without waiting; a
    compute, a merge, or the forwarding of a received input waits until the sender has posted the
    transfers it needs. Raises when the ranks would wait on each other forever."""
    posted: set[int] = set()
    pos = [0] * len(ph.ops)
    while True:
        moved = False
        for r, ops in enumerate(ph.ops):
            while pos[r] < len(ops):
                op = ops[pos[r]]
                waits = [int(d[1:]) for d in op.deps if d[0] == "t"]  # transfers it needs to have arrived
                if any(n not in posted for n in waits):
                    break
                if op.kind == "send":
                    posted.add(op.id)
                pos[r] += 1
                moved = True
        if all(p == len(ops) for p, ops in zip(pos, ph.ops)):
            return
        if not moved:
            stuck = {r: f"{ops[pos[r]].kind} {ops[pos[r]].id}" for r, ops in enumerate(ph.ops) if pos[r] < len(ops)}
            raise ValueError(f"{ph.phase}: the ranks would wait on each other forever at {stuck}")


def validate(plan: Plan) -> None:
    """Raise ValueError unless ``plan`` is complete and consistent (see the module docstring)."""
    if plan.schema_version != SCHEMA_VERSION:
        raise ValueError(f"schema version {plan.schema_version}, this cpattn reads {SCHEMA_VERSION} (stale)")
    for name in ("world", "nodes", "devices_per_node"):
        if not isinstance(plan.key.get(name), int) or plan.key[name] < 1:
            raise ValueError(f"key.{name} is missing or invalid")
    if plan.key["nodes"] * plan.key["devices_per_node"] != plan.world:
        raise ValueError("key: nodes x devices_per_node differs from world")
    if plan.key.get("table") != plan.table.digest():
        raise ValueError("key.table does not match the block table")
    if plan.table.n % plan.world or tuple(owners(plan.table.n, plan.world)) != plan.owner:
        raise ValueError("ownership is not contiguous over the world")
    if plan.key.get("order") is not None:
        order = _check_order(plan.key["order"], int(plan.key["seq_len"]), plan.world)
        if order is None or int(plan.key["seq_len"]) % plan.table.n:
            raise ValueError("key.order is the identity or does not fit the table")
    topology = _topology_of(plan)
    for name in PHASES:
        ph = plan.phase(name)
        if ph.phase != name:
            raise ValueError(f"phase {name} is labelled {ph.phase!r}")
        _check_kernels(plan, ph)
        if list(ph.transfers) != route(name, ph.kernels, list(plan.owner), topology):
            raise ValueError(f"{name}: transfers differ from the routing of its kernels")
        _check_ops(plan, ph, dependencies(name, ph.kernels, ph.transfers, list(plan.owner)))
        if not (math.isfinite(ph.predicted) and ph.predicted >= 0):
            raise ValueError(f"{name}: predicted time {ph.predicted!r}")


# --------------------------------------------------------------------------------------- building
def _topology_digest(topology: Topology) -> str:
    text = json.dumps(asdict(topology), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _lpt_ratio(table: BlockTable, devices: int, home: list[int], group: int, eps: float) -> float:
    """Load of an LPT placement of ``table`` (chunks grouped ``group`` at a time) over ``devices``
    units, relative to the ``(1 + eps)`` bound; <= 1 means the granularity can be balanced."""
    work: dict[tuple[int, int], int] = {}
    for i, j in table.cells():
        key = (i // group, j // group)
        work[key] = work.get(key, 0) + table.work(i, j)
    cells = sorted(work)
    homes = {big: home[big * group] for big in range(table.n // group)}
    pinned = {c: homes[i] for c, (i, j) in enumerate(cells) if i == j}
    units = MessageUnits.for_phase("forward", 1, 1)
    problem = PartitionProblem(devices, tuple(cells), tuple(work[k] for k in cells), homes, homes, pinned, units, eps)
    total = sum(problem.work)
    if total == 0:
        return 0.0
    return load_bound(problem) / math.ceil((1 + eps) * total / devices)


def _balanced_compute(table: BlockTable, topology: Topology, problem: Problem) -> float:
    """Seconds of forward + backward kernels on the busiest rank when every cell runs as its own
    kernel (cost model) and cells are placed longest first, diagonal cells on their owners: what the
    granularity alone allows, before any communication."""
    device, c = topology.device, table.chunk
    owner = owners(table.n, topology.world)
    times: dict[tuple[str, int], float] = {}
    load = [0.0] * topology.world
    free = []
    for i, j in table.cells():
        key = (table.kind(i, j), table.area[i * table.n + j])
        if key not in times:
            kernel = CostKernel(key[0], c, c, key[1])
            times[key] = sum(device.kernel_time(kernel, problem, ph) for ph in PHASES)
        if i == j:
            load[owner[i]] += times[key]
        else:
            free.append(times[key])
    heap = [(t, r) for r, t in enumerate(load)]
    heapq.heapify(heap)
    for t in sorted(free, reverse=True):
        least, r = heapq.heappop(heap)
        heapq.heappush(heap, (least + t, r))
    return max(t for t, _ in heap)


def choose_granularity(mask: Mask, topology: Topology, problem: Problem, options: PlanOptions,
                       valid_len: int | None = None, order: tuple[int, ...] | None = None
                       ) -> tuple[BlockTable, int]:
    """The block table and node-level chunk (see the module docstring); positions ``>= valid_len``
    are padding. ``order``: the ranks hold the sequence's ``len(order)`` equal pieces in this order
    (see :func:`cpattn.layout.pieces`; None: contiguous); the table is of the sequence so reordered,
    classified at a granularity that splits every piece."""
    world, seq_len = topology.world, problem.seq_len
    if options.chunks_per_rank is not None:
        if seq_len % (world * options.chunks_per_rank):
            raise ValueError(f"chunks_per_rank={options.chunks_per_rank}: seq_len={seq_len} is not a multiple of "
                             f"world x chunks = {world * options.chunks_per_rank}")
        candidates = [options.chunks_per_rank]
    else:
        candidates = [c for c in (1, 2, 4, 8, 16, 32) if c == 1 or (
            c <= options.max_chunks_per_rank and world * c <= options.max_chunks and seq_len % (world * c) == 0
            and seq_len // (world * c) >= options.min_chunk_tokens)]
    n_finest = world * candidates[-1] if order is None else math.lcm(world * candidates[-1], len(order))
    if seq_len % n_finest:
        raise ValueError(f"seq_len={seq_len} cannot be cut into {n_finest} chunks (the layout's pieces x ranks)")
    finest = bt.build_cached(mask, seq_len, n_finest, valid_len)  # classified once, then coarsened
    if order is not None:
        finest = bt.permute(finest, order)
    best = None
    for c in candidates:  # finer until the balanced compute time stops improving
        table = finest.coarsen(n_finest // (world * c))
        seconds = _balanced_compute(table, topology, problem)
        if best is not None and seconds >= best[0]:
            break
        best = (seconds, table)
    table = best[1]
    per_node = table.n // topology.nodes
    if options.node_chunk is not None:
        if per_node % options.node_chunk:
            raise ValueError(f"node_chunk={options.node_chunk} must divide the {per_node} chunks of a node")
        return table, options.node_chunk
    if topology.nodes == 1:
        return table, per_node
    node_home = [topology.node_of(o) for o in owners(table.n, world)]
    best_m = None
    for m in sorted((m for m in range(1, per_node + 1) if per_node % m == 0), reverse=True):
        ratio = _lpt_ratio(table, topology.nodes, node_home, m, options.eps)
        if best_m is None or ratio < best_m[0] - 1e-9:
            best_m = (ratio, m)
        if ratio <= 1.0:
            break
    return table, best_m[1]


def _check_problem(seq_len: int, topology: Topology, batch: int, heads: int, kv_heads: int, head_dim: int,
                   dtype: str) -> None:
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a cpattn.cost.Topology, got {type(topology).__name__}")
    for name, value in (("seq_len", seq_len), ("batch", batch), ("heads", heads), ("kv_heads", kv_heads),
                        ("head_dim", head_dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is unknown; accepted: {', '.join(DTYPE_BYTES)}")
    if seq_len % topology.world:
        raise ValueError(f"seq_len={seq_len} must be a multiple of the world size {topology.world} "
                         "(ultra keeps contiguous tokens per rank)")


@dataclass(frozen=True)
class Request:
    """Everything a plan depends on, resolved: the problem, its block table and node-level chunk."""

    mask: Mask
    seq_len: int
    topology: Topology
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    options: PlanOptions
    table: BlockTable
    node_chunk: int
    valid_len: int
    order: tuple[int, ...] | None = None  # pieces of the sequence in the ranks' order; None: contiguous

    def key(self) -> dict:
        return {"mask": self.mask.name, "table": self.table.digest(), "seq_len": self.seq_len,
                "valid_len": self.valid_len, "order": None if self.order is None else list(self.order),
                "world": self.topology.world, "nodes": self.topology.nodes,
                "devices_per_node": self.topology.devices_per_node, "topology": _topology_digest(self.topology),
                "topology_name": self.topology.name, "batch": self.batch, "heads": self.heads,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim, "dtype": self.dtype,
                "node_chunk": self.node_chunk, "options": asdict(self.options)}

    def digest(self) -> str:
        text = json.dumps(self.key(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:24]


def request(mask: Mask | str | dict, seq_len: int, topology: Topology, batch: int = 1, heads: int = 8,
            kv_heads: int = 8, head_dim: int = 64, dtype: str = "bfloat16", options: PlanOptions | None = None,
            valid_len: int | None = None, order: tuple[int, ...] | None = None) -> Request:
    """Check the problem and resolve its granularity (no solver runs here). ``seq_len`` tokens, of
    which those at positions ``>= valid_len`` (default: none) are padding. ``order``: how the ranks hold
    the sequence, as equal pieces (:func:`cpattn.layout.pieces`; None or the identity: contiguous)."""
    mask = resolve(mask)
    options = options or PlanOptions()
    _check_problem(seq_len, topology, batch, heads, kv_heads, head_dim, dtype)
    order = _check_order(order, seq_len, topology.world)
    valid = seq_len if valid_len is None else valid_len
    problem = Problem(seq_len, topology.world, mask, batch, heads, kv_heads, head_dim, dtype)
    table, node_chunk = choose_granularity(mask, topology, problem, options, valid, order)
    return Request(mask, seq_len, topology, batch, heads, kv_heads, head_dim, dtype, options, table, node_chunk,
                   valid, order)


def choose_order(mask: Mask | str | dict, seq_len: int, world: int, valid_len: int | None = None,
                 options: PlanOptions | None = None) -> tuple[int, ...] | None:
    """The owner map ``ultra`` runs on by default: None (contiguous) or the sequence cut into
    ``world * c`` pieces dealt round-robin (piece p to rank p mod world; c in 2, 4, 8 within the
    granularity limits of ``options``), as :func:`cpattn.layout.pieces` orders them.

    Each map is scored on the mask's block table at the finest of those granularities: the work of
    cells whose query and key chunks sit on different ranks (it needs traffic wherever it runs) plus
    each rank's local work above its ``(1 + eps)`` share (it must be moved off). Round-robin is taken
    when it scores under 3/4 of contiguous: strided patterns whose stride is a multiple of the
    ranks' count become purely local; windows, documents and global rows stay contiguous."""
    mask = resolve(mask)
    options = options or PlanOptions()
    cands = [c for c in (2, 4, 8) if c <= options.max_chunks_per_rank and world * c <= options.max_chunks
             and seq_len % (world * c) == 0 and seq_len // (world * c) >= options.min_chunk_tokens]
    if world == 1 or not cands:
        return None
    n = world * cands[-1]
    table = bt.build_cached(mask, seq_len, n, valid_len)
    cells = [(i, j, table.work(i, j)) for i, j in table.cells()]
    fair = (1 + options.eps) * sum(w for _, _, w in cells) / world

    def score(owner: list[int]) -> float:
        local = [0] * world
        remote = 0
        for i, j, w in cells:
            if owner[i] == owner[j]:
                local[owner[i]] += w
            else:
                remote += w
        return remote + sum(max(0.0, x - fair) for x in local)

    best, best_order = 0.75 * score([i * world // n for i in range(n)]), None
    for c in cands:
        per_piece = n // (world * c)
        sc = score([(i // per_piece) % world for i in range(n)])
        if sc < best:
            best, best_order = sc, tuple(p for r in range(world) for p in range(r, world * c, world))
    return best_order


def _check_order(order, seq_len: int, world: int) -> tuple[int, ...] | None:
    """``order`` as a tuple, None for the identity; ValueError unless it is a permutation of equal
    pieces that splits evenly over the ranks."""
    if order is None:
        return None
    order = check_order(order, seq_len, world)
    return None if order == tuple(range(len(order))) else order


def _ops(graph: KernelGraph, timeline: Timeline, world: int) -> tuple[tuple[Op, ...], ...]:
    """Each rank's operations in the order it issues them. Kernels and merges go at their predicted
    start; a transfer is posted, on both its ranks, as soon as what it carries is ready (the end of its
    last dependency), not at the start the scheduler gave it: the scheduler only places work on the
    critical path early, and a send posted late stalls its receiver. Both ends order a transfer by the
    same key, so every pair of ranks posts its messages in one order (which also keeps NCCL's in-order
    point-to-point matching consistent in both directions). Ties: posting first, then dependency order."""
    deps = {t.name: t.deps for t in graph.tasks}
    topo = {name: n for n, name in enumerate(_topological(graph))}
    outputs = {item for item, _ in OUTPUTS[graph.phase]}
    per_rank: dict[int, list[tuple[tuple, Op]]] = {}

    def add(rank: int, kind: str, idx: int, name: str, op_deps: tuple[str, ...]) -> None:
        op = Op(kind, idx, timeline.start[name], timeline.end[name], op_deps)
        issue = op.start
        if kind in ("send", "recv"):
            issue = max((timeline.end[d] for d in deps[name]), default=0.0)
        posting = kind in ("send", "recv")  # cheap and never blocking: first among equal times
        per_rank.setdefault(rank, []).append(((issue, not posting, topo[name], OP_KINDS.index(kind)), op))

    for k, kn in enumerate(graph.kernels):
        add(kn.device, "compute", k, f"c{k}", deps[f"c{k}"])
    for n, t in enumerate(graph.transfers):
        add(t.src, "send", n, f"t{n}", deps[f"t{n}"])
        add(t.dst, "recv", n, f"t{n}", ())
        if t.item in outputs:
            add(t.dst, "merge", n, f"m{n}", deps[f"m{n}"])
    return tuple(tuple(op for _, op in sorted(per_rank.get(r, []), key=lambda x: x[0])) for r in range(world))


def _topological(graph: KernelGraph) -> list[str]:
    """Task names in a dependency order (Kahn, ties in task order)."""
    index = {t.name: n for n, t in enumerate(graph.tasks)}
    waiting = {t.name: len(set(t.deps)) for t in graph.tasks}
    children: dict[str, list[str]] = {t.name: [] for t in graph.tasks}
    for t in graph.tasks:
        for d in set(t.deps):
            children[d].append(t.name)
    heap = [(index[name], name) for name, w in waiting.items() if w == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, name = heapq.heappop(heap)
        out.append(name)
        for child in children[name]:
            waiting[child] -= 1
            if waiting[child] == 0:
                heapq.heappush(heap, (index[child], child))
    return out


def _kernel_bounds(assign: dict[tuple[int, int], int], world: int) -> list[int]:
    """Kernel size bounds to try (cells): 1, 2, 4, ... up to the most cells any rank computes."""
    most = max((sum(1 for g in assign.values() if g == r) for r in range(world)), default=1)
    bounds, b = [], 1
    while True:
        bounds.append(b)
        if b >= most:
            return bounds
        b *= 2


def _phase(req: Request, phase: str, problem: Problem, sizes: Sizes) -> PhasePlan:
    topology, table, opts = req.topology, req.table, req.options
    owner = owners(table.n, topology.world)
    units = MessageUnits.for_phase(phase, req.heads, req.kv_heads)
    batches = (topology.nodes > 1) + math.ceil(topology.nodes / (os.cpu_count() or 1))  # sequential solve rounds
    partition_limit = min(opts.partition_time_limit, 0.35 * opts.time_budget / batches)
    schedule_limit = min(opts.schedule_time_limit, 0.15 * opts.time_budget)
    levels = allocate(table, topology, units, req.node_chunk, opts.eps, partition_limit, opts.seed, opts.use_solver)
    best = None
    for bound in _kernel_bounds(levels.assign, topology.world):  # doubling; stop once it gets worse
        kernels = fuse_all(table, levels.assign, topology.world, bound)
        graph = build_graph(phase, table, kernels, owner, topology, problem, sizes)
        makespan = simulate(graph.tasks).makespan
        if best is not None and makespan > best[0]:
            break
        best = (makespan, bound, graph)
    _, bound, graph = best
    sched: Scheduled = schedule(graph.tasks, schedule_limit, opts.seed, opts.use_solver)
    n = table.n
    assign = tuple(levels.assign.get(divmod(idx, n), -1) for idx in range(n * n))
    ops = _ops(graph, sched.timeline, topology.world)
    return PhasePlan(phase, assign, levels.reports, bound, graph.kernels, graph.transfers, ops,
                     sched.timeline.makespan, sched.report())


def build_plan(req: Request) -> Plan:
    """Run the planner for ``req`` (see the module docstring). Pure: no cache, no communication."""
    start = time.perf_counter()
    problem = Problem(req.seq_len, req.topology.world, req.mask, req.batch, req.heads, req.kv_heads, req.head_dim,
                      req.dtype)
    sizes = Sizes(req.batch, req.table.chunk, req.heads, req.kv_heads, req.head_dim, problem.elem, problem.acc_elem)
    phases = {name: _phase(req, name, problem, sizes) for name in PHASES}
    plan = Plan(req.key(), req.table, tuple(owners(req.table.n, req.topology.world)), phases["forward"],
                phases["backward"], time.perf_counter() - start)
    validate(plan)
    return plan


# --------------------------------------------------------------------------------------- cache
def cache_dir() -> Path:
    """``$CPATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/cpattn/plans`` (``~/.cache/cpattn/plans``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "cpattn" / "plans"


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file (ValueError naming the file when it is not a valid plan)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read plan {path}: {exc}") from exc
    try:
        return Plan.from_json(text)
    except ValueError as exc:
        raise ValueError(f"plan {path} is invalid: {exc}") from exc


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` as JSON, atomically (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(plan.to_json())
    os.replace(tmp, path)


def get_plan(req: Request, cache: bool = True, directory: str | Path | None = None) -> Plan:
    """The plan for ``req``: from the cache when a valid file for its key exists, else built (and
    stored when ``cache``). A corrupt or stale file is rebuilt with a warning."""
    path = Path(directory or cache_dir()) / f"{req.digest()}.json"
    if cache and path.exists():
        try:
            plan = load_plan(path)
            if plan.key != json.loads(json.dumps(req.key())):
                raise ValueError("its problem key differs (stale)")
            return plan
        except ValueError as exc:
            log.warning("rebuilding the cached plan %s: %s", path, exc)
    plan = build_plan(req)
    if cache:
        try:
            save_plan(plan, path)
        except OSError as exc:
            log.warning("could not cache the plan at %s: %s", path, exc)
    return plan
