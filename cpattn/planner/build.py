"""Making a plan (docs/ultraattn.md, "How the design maps to code"): from a problem to a
:class:`~cpattn.planner.model.Plan`.

:func:`request` checks the problem and resolves its granularity; :func:`build_plan` runs the planner:
block table at the chosen granularity, node- and device-level placement
(:mod:`~cpattn.planner.tiling`), kernel fusion under the size bound that the cost model predicts
fastest, routing and the kernel graph (:mod:`~cpattn.planner.kernel_graph`), the schedule
(:mod:`~cpattn.planner.schedule_ilp`), then each rank's ordered operations with their dependencies
— separately for forward and backward (same ownership, possibly different placements) — and checks
the result (:func:`~cpattn.planner.model.validate`). :func:`choose_order` picks the owner map.

Granularity. ``chunks_per_rank`` c (chunks of ``seq_len / (world * c)`` tokens) goes through powers
of two (up to ``max_chunks_per_rank`` and ``max_chunks`` in all, chunks of at least
``min_chunk_tokens``; the mask is classified once, at the finest, and coarsened) while the cost
model's forward + backward kernel time of the busiest rank, cells placed longest first, keeps
falling: finer chunks balance better and turn PARTIAL cells of block patterns into FULL or EMPTY ones,
coarser chunks run more efficient kernels. The node-level chunk is the coarsest at which a
longest-processing-time placement meets the load bound. Both can be fixed in
:class:`~cpattn.planner.model.PlanOptions`.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass

from ..core.layout import check_order
from ..core.masks import Mask, resolve
from ..core.simulator import Simulation, simulate
from ..core.steps import DTYPE_BYTES, Problem
from ..core.topology import Topology
from . import block_table as bt
from .block_table import BlockTable
from .kernel_graph import OUTPUTS, PHASES, KernelGraph
from .kernel_graph import build as build_graph
from .messages import Sizes
from .model import OP_KINDS, Op, PhasePlan, Plan, PlanOptions, validate
from .partition_ilp import MessageUnits, load_bound
from .pricing import Pricing
from .schedule_ilp import Scheduled, schedule
from .tiling import allocate, fuse_all, grouped_problem, owners


def _topology_digest(topology: Topology) -> str:
    text = json.dumps(asdict(topology), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _lpt_ratio(table: BlockTable, devices: int, home: list[int], group: int, eps: float) -> float:
    """Load of an LPT placement of ``table`` (chunks grouped ``group`` at a time) over ``devices``
    units, relative to the ``(1 + eps)`` bound; <= 1 means the granularity can be balanced."""
    problem, _ = grouped_problem(table, group, home, devices, MessageUnits.for_phase("forward", 1, 1), eps)
    total = sum(problem.work)
    if total == 0:
        return 0.0
    return load_bound(problem) / math.ceil((1 + eps) * total / devices)


def _balanced_compute(table: BlockTable, topology: Topology, pricing: Pricing) -> float:
    """Seconds of forward + backward kernels on the busiest rank when every cell runs as its own
    kernel (cost model, ``pricing``) and cells are placed longest first, diagonal cells on their
    owners: what the granularity alone allows, before any communication."""
    owner = owners(table.n, topology.world)
    times: dict[tuple[str, int], float] = {}
    load = [0.0] * topology.world
    free = []
    for i, j in table.cells():
        kind = table.kind(i, j)
        key = (kind, table.area[i * table.n + j]) if kind != "partial" else (kind, i, j)
        if key not in times:
            times[key] = sum(pricing.seconds(table, kind, (i,), (j,), ph) for ph in PHASES)
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


def _chunk_counts(counts: tuple[int, ...], seq_len: int, world: int, options: PlanOptions) -> list[int]:
    """The chunks per rank of ``counts`` within the granularity limits of ``options``."""
    return [c for c in counts if c <= options.max_chunks_per_rank and world * c <= options.max_chunks
            and seq_len % (world * c) == 0 and seq_len // (world * c) >= options.min_chunk_tokens]


def choose_granularity(problem: Problem, topology: Topology, options: PlanOptions, order: tuple[int, ...] | None
                       ) -> tuple[BlockTable, int]:
    """The block table and node-level chunk (see the module docstring) of ``problem``: its mask over
    ``padded_len`` tokens, those past ``seq_len`` padding. ``order``: the ranks hold the sequence's
    ``len(order)`` equal pieces in this order (see :func:`cpattn.layout.pieces`; None: contiguous); the
    table is of the sequence so reordered, classified at a granularity that splits every piece."""
    world, seq_len, mask = topology.world, problem.padded_len, problem.mask
    if options.chunks_per_rank is not None:
        if seq_len % (world * options.chunks_per_rank):
            raise ValueError(f"chunks_per_rank={options.chunks_per_rank}: seq_len={seq_len} is not a multiple of "
                             f"world x chunks = {world * options.chunks_per_rank}")
        candidates = [options.chunks_per_rank]
    else:
        candidates = [1, *_chunk_counts((2, 4, 8, 16, 32), seq_len, world, options)]
    n_finest = world * candidates[-1] if order is None else math.lcm(world * candidates[-1], len(order))
    if seq_len % n_finest:
        raise ValueError(f"seq_len={seq_len} cannot be cut into {n_finest} chunks (the layout's pieces x ranks)")
    finest = bt.build_cached(mask, seq_len, n_finest, problem.seq_len)  # classified once, then coarsened
    if order is not None:
        finest = bt.permute(finest, order)
    pricing = Pricing(mask, seq_len, problem.seq_len, order, topology.device, problem)
    best = None
    for c in candidates:  # finer until the balanced compute time stops improving
        table = finest.coarsen(n_finest // (world * c))
        seconds = _balanced_compute(table, topology, pricing)
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
    if order is not None:
        order = check_order(order, seq_len, topology.world)
        order = None if order == tuple(range(len(order))) else order  # the identity is contiguous
    valid = seq_len if valid_len is None else valid_len
    problem = Problem(valid, topology.world, mask, batch, heads, kv_heads, head_dim, dtype, padded_len=seq_len)
    table, node_chunk = choose_granularity(problem, topology, options, order)
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
    cands = _chunk_counts((2, 4, 8), seq_len, world, options)
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


def _ops(graph: KernelGraph, timeline: Simulation, world: int) -> tuple[tuple[Op, ...], ...]:
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
        posting = kind in ("send", "recv")  # cheap and never blocking: first among equal times
        issue = max((timeline.end[d] for d in deps[name]), default=0.0) if posting else op.start
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


def _kernel_bounds(assign: dict[tuple[int, int], int]) -> list[int]:
    """Kernel size bounds to try (cells): 1, 2, 4, ... up to the most cells any rank computes."""
    most = max(Counter(assign.values()).values(), default=1)
    bounds = [1]
    while bounds[-1] < most:
        bounds.append(2 * bounds[-1])
    return bounds


def _phase(req: Request, phase: str, problem: Problem, sizes: Sizes, pricing: Pricing) -> PhasePlan:
    topology, table, opts = req.topology, req.table, req.options
    owner = owners(table.n, topology.world)
    units = MessageUnits.for_phase(phase, req.heads, req.kv_heads)
    batches = (topology.nodes > 1) + math.ceil(topology.nodes / (os.cpu_count() or 1))  # sequential solve rounds
    partition_limit = min(opts.partition_time_limit, 0.35 * opts.time_budget / batches)
    schedule_limit = min(opts.schedule_time_limit, 0.15 * opts.time_budget)
    levels = allocate(table, topology, units, req.node_chunk, opts.eps, partition_limit, opts.seed, opts.use_solver)
    best = None
    for bound in _kernel_bounds(levels.assign):  # doubling; stop once it gets worse
        kernels = fuse_all(table, levels.assign, topology.world, bound)
        graph = build_graph(phase, table, kernels, owner, topology, sizes, pricing)
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
    problem = Problem(req.valid_len, req.topology.world, req.mask, req.batch, req.heads, req.kv_heads, req.head_dim,
                      req.dtype, padded_len=req.seq_len)
    sizes = Sizes(req.batch, req.table.chunk, req.heads, req.kv_heads, req.head_dim, problem.elem, problem.acc_elem)
    pricing = Pricing(req.mask, req.seq_len, req.valid_len, req.order, req.topology.device, problem)
    phases = {name: _phase(req, name, problem, sizes, pricing) for name in PHASES}
    plan = Plan(req.key(), req.table, tuple(owners(req.table.n, req.topology.world)), phases["forward"],
                phases["backward"], time.perf_counter() - start)
    validate(plan)
    return plan
