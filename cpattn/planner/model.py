"""The UltraAttn plan as data: what every rank does, and its JSON form (docs/ultraattn.md, "Plan").

A :class:`Plan` holds the problem key, the block table, chunk ownership and, per phase, a
:class:`PhasePlan`: the cell placement, fused kernels, transfers, and each rank's ordered operations
(:class:`Op`) with their dependencies and predicted times. :meth:`Plan.to_json` writes it;
:meth:`Plan.from_json` reads it back and checks it (:func:`cpattn.planner.validate.validate`).
:mod:`cpattn.planner.build` makes plans, :mod:`cpattn.planner.cache` stores them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from ..core.layout import source_ranges
from ..schedules.ultra import Sizes
from .block_table import BlockTable
from .kernel_graph import PHASES, Transfer
from .tiling import Kernel

SCHEMA = "cpattn-plan"
SCHEMA_VERSION = 5  # also bumped when the planner's output changes, so cached plans are rebuilt
OP_KINDS = ("recv", "send", "compute", "merge")


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
        return source_ranges(chunk, self.table.chunk, int(self.key["seq_len"]), self.order)

    def phase(self, name: str) -> PhasePlan:
        if name not in PHASES:
            raise ValueError(f"phase={name!r} is unknown; accepted: {', '.join(PHASES)}")
        return self.forward if name == "forward" else self.backward

    def sizes(self, batch: int, heads: int, kv_heads: int, head_dim: int, elem: int, acc_elem: int) -> Sizes:
        return Sizes(batch, self.table.chunk, heads, kv_heads, head_dim, elem, acc_elem)

    def volume(self, rank: int, sizes: Sizes) -> dict[str, dict[str, dict[str, int]]]:
        """Analytic bytes and calls per op on ``rank`` (``cpattn.core.comm`` units): one send per transfer
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
        """Parse and :func:`~cpattn.planner.validate.validate`; ValueError on anything malformed or
        inconsistent."""
        from .validate import validate  # validate reads this module's types: imported on use

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
