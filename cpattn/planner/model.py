"""The UltraAttn plan as data: what every rank does, and its JSON form (docs/ultraattn.md, "Plan").

A :class:`Plan` holds the problem key, the block table, chunk ownership and, per phase, a
:class:`PhasePlan`: the cell placement, fused kernels, transfers, and each rank's ordered operations
(:class:`Op`) with their dependencies and predicted times. :meth:`Plan.to_json` writes it;
:meth:`Plan.from_json` reads it back (a file of another format version: :class:`PlanVersionError`) and
checks it: :func:`validate` raises ValueError unless a plan is complete and consistent, so that every
rank can run it. :mod:`cpattn.planner.build` makes plans, :mod:`cpattn.planner.cache` stores them.

Checked: the problem key against the block table and contiguous ownership; per phase, that every
non-EMPTY cell is placed on a rank and computed by exactly one well-formed kernel on that rank; that
the transfers are the routing of those kernels (:func:`cpattn.planner.kernel_graph.route`); that each
rank lists exactly its operations, with the dependencies :func:`cpattn.planner.kernel_graph.dependencies`
derives, each after the local ones it waits for; that each pair of ranks posts its messages in one
order on both sides; and that the ranks, replaying the executor's blocking rules, never wait on each
other forever.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..core.layout import check_order, source_ranges
from ..core.program import Prediction
from ..core.topology import Topology
from .block_table import BlockTable
from .kernel_graph import OUTPUTS, PHASES, Transfer, dependencies, route
from .messages import Sizes
from .tiling import TileKernel, owners

SCHEMA = "cpattn-plan"
SCHEMA_VERSION = 5  # also bumped when the planner's output changes, so cached plans are rebuilt
OP_KINDS = ("recv", "send", "compute", "merge")


class PlanVersionError(ValueError):
    """A plan written in another format version than this cpattn reads (``found``, ``expected``;
    ``path``: the file it was read from, or None)."""

    def __init__(self, path: str | Path | None, found: int, expected: int = SCHEMA_VERSION) -> None:
        self.path, self.found, self.expected = None if path is None else str(path), found, expected
        message = f"has format version {found}, this cpattn reads version {expected}"
        super().__init__(f"plan {message}" if path is None else f"plan {path} {message}: delete the file, or write it "
                         "again with this cpattn (`cpattn plan ... --json PATH`)")


@dataclass(frozen=True)
class PlanOptions:
    """Planner settings (part of the problem key).

    ``eps``: load tolerance of the partition ILP. ``time_budget``: about how many seconds the CP-SAT
    solves of one plan may take together (forward and backward: 35% each for the placements, which
    run in parallel threads across nodes, 15% each for the schedule); ``partition_time_limit`` /
    ``schedule_time_limit`` cap one solve (seconds). ``seed``: solver seed. ``use_solver``: False skips CP-SAT (greedy
    placement and list schedule). ``chunks_per_rank`` / ``node_chunk``: fix the granularity (None:
    automatic, see :mod:`cpattn.planner.build`). ``min_chunk_tokens``, ``max_chunks_per_rank`` and
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
    kernels: tuple[TileKernel, ...]
    transfers: tuple[Transfer, ...]
    ops: tuple[tuple[Op, ...], ...]
    predicted: float
    scheduler: dict


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
        return source_ranges(chunk, self.table.chunk, int(self.key["seq_len"]), self.order)

    def phase(self, name: str) -> PhasePlan:
        if name not in PHASES:
            raise ValueError(f"phase={name!r} is unknown; accepted: {', '.join(PHASES)}")
        return self.forward if name == "forward" else self.backward

    def sizes(self, batch: int, heads: int, kv_heads: int, head_dim: int, elem: int, acc_elem: int) -> Sizes:
        return Sizes(batch, self.table.chunk, heads, kv_heads, head_dim, elem, acc_elem)

    def predict(self, problem, phase: str) -> Prediction:
        """What this plan predicts for ``phase`` of ``problem`` (a ``cpattn.core.steps.Problem``):
        ``total``, its simulated makespan; ``compute``, the busiest rank's compute lane (kernels and
        merges); ``comm``, the busiest rank's transfers (the busier of its send and receive lanes);
        ``bytes_sent``, the busiest sender's bytes (as :meth:`volume` counts them); ``buffer_bytes``,
        the most a rank receives and sends in the phase (its buffers live to the end of the phase)."""
        sizes = self.sizes(problem.batch, problem.heads, problem.kv_heads, problem.head_dim, problem.elem,
                           problem.acc_elem)
        pp = self.phase(phase)
        out, into = [0] * self.world, [0] * self.world
        for t in pp.transfers:
            out[t.src] += sizes.item_bytes(t.item)
            into[t.dst] += sizes.item_bytes(t.item)

        def busy(ops, kinds: tuple[str, ...]) -> float:  # one lane per rank: its operations' times add
            return sum(op.end - op.start for op in ops if op.kind in kinds)

        return Prediction(pp.predicted, max(busy(ops, ("compute", "merge")) for ops in pp.ops),
                          max(max(busy(ops, ("send",)), busy(ops, ("recv",))) for ops in pp.ops), max(out),
                          max(a + b for a, b in zip(out, into)))

    def volume(self, rank: int, sizes: Sizes) -> dict[str, dict[str, dict[str, int]]]:
        """Analytic bytes and calls per op on ``rank`` (``cpattn.core.comm`` units): one send per transfer
        leaving it, one recv per transfer arriving, for each phase."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for name in PHASES:
            out[name] = {}
            for op, end, counted in (("send", "src", "bytes_sent"), ("recv", "dst", "bytes_recv")):
                mine = [t for t in self.phase(name).transfers if getattr(t, end) == rank]
                if mine:
                    out[name][op] = {"calls": len(mine), "bytes_sent": 0, "bytes_recv": 0,
                                     counted: sum(sizes.item_bytes(t.item) for t in mine)}
        return out

    # ------------------------------------------------------------------ JSON
    def as_dict(self) -> dict:
        return {"schema": SCHEMA, "version": SCHEMA_VERSION, "key": self.key, "table": self.table.as_dict(),
                "owner": list(self.owner), "seconds": self.seconds,
                "phases": {name: _phase_dict(self.phase(name)) for name in PHASES}}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> Plan:
        """Parse and :func:`validate`; ValueError on anything malformed or inconsistent
        (:class:`PlanVersionError` for a plan of another format version)."""
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
        found = data.get("version")
        if found != SCHEMA_VERSION:  # before the rest: another version's layout differs
            if type(found) is not int:
                raise ValueError(f"plan version {found!r}, this cpattn reads {SCHEMA_VERSION}")
            raise PlanVersionError(None, found)
        phases = {}
        for name in PHASES:
            p = data["phases"][name]
            phases[name] = PhasePlan(
                name, tuple(int(a) for a in p["assign"]), tuple(dict(r) for r in p["levels"]), int(p["max_cells"]),
                tuple(TileKernel(int(d), tuple(int(i) for i in r), tuple(int(j) for j in c), str(kind))
                      for d, r, c, kind in p["kernels"]),
                tuple(Transfer(int(s), int(d), str(item), int(c)) for s, d, item, c in p["transfers"]),
                tuple(tuple(Op(str(k), int(i), float(s), float(e), tuple(str(x) for x in deps))
                            for k, i, s, e, deps in ops) for ops in p["ops"]),
                float(p["predicted"]), dict(p["scheduler"]))
        return Plan(dict(data["key"]), BlockTable.from_dict(data["table"]), tuple(int(o) for o in data["owner"]),
                    phases["forward"], phases["backward"], float(data.get("seconds", 0.0)))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed plan: {type(exc).__name__}: {exc}") from exc


def validate(plan: Plan) -> None:
    """Raise ValueError unless ``plan`` is complete and consistent (see the module docstring, "Checked")."""
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
        seq_len = int(plan.key["seq_len"])
        order = check_order(plan.key["order"], seq_len, plan.world)
        if order == tuple(range(len(order))) or seq_len % plan.table.n:
            raise ValueError("key.order is the identity or does not fit the table")
    topology = Topology(int(plan.key["nodes"]), int(plan.key["devices_per_node"]))
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
        if not all(axis and list(axis) == sorted(set(axis)) and 0 <= axis[0] and axis[-1] < n
                   for axis in (kn.rows, kn.cols)):
            raise ValueError(f"{ph.phase}: kernel {k} has invalid rows {kn.rows} or columns {kn.cols}")
        kinds = {table.kind(i, j) for i in kn.rows for j in kn.cols}
        if kn.kind == "full" and kinds != {"full"}:
            raise ValueError(f"{ph.phase}: full kernel {k} covers cells of kinds {sorted(kinds)}")
        if kn.kind == "causal":
            a, b = kn.rows[0], kn.rows[-1] + 1
            single = len(kn.rows) == len(kn.cols) == 1 and kinds == {"causal"}
            square = kn.rows == kn.cols == tuple(range(a, b)) and table.causal_square(a, a, b - a)
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
    _check_progress(ph)
    # every pair of ranks posts its transfers in one order across both directions (NCCL matches a
    # pair's operations in sequence, whatever their direction; so each direction's order matches too)
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
