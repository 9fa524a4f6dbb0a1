"""Checking a plan (docs/ultraattn.md, "Plan"): :func:`validate` raises ValueError unless a
:class:`~cpattn.planner.model.Plan` is complete and consistent, so that every rank can run it.

Checked: the schema version and problem key against the block table and contiguous ownership;
per phase, that every non-EMPTY cell is placed on a rank and computed by exactly one well-formed
kernel on that rank; that the transfers are the routing of those kernels
(:func:`cpattn.planner.kernel_graph.route`); that each rank lists exactly its operations, with the
dependencies :func:`cpattn.planner.kernel_graph.dependencies` derives, each after the local ones it
waits for; that each pair of ranks posts its messages in one order on both sides; and that the ranks,
replaying the executor's blocking rules, never wait on each other forever.
"""

from __future__ import annotations

import math

from ..core.layout import check_order
from ..core.topology import Topology
from .kernel_graph import OUTPUTS, PHASES, dependencies, route
from .model import OP_KINDS, SCHEMA_VERSION, PhasePlan, Plan
from .tiling import owners


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
