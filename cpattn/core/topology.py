"""Cluster topology: how ranks map to nodes, and the links, NICs and device they run on (pure data).

``Topology(nodes, devices_per_node)`` alone is a valid topology (rank r lives on node
r // devices_per_node, at local index r % devices_per_node) with generic, deliberately modest link and
device figures; the presets in :mod:`cpattn.cost.presets` fill in published ones.

Links are full duplex. ``intra`` is what one device gets to any other device of its node (per
direction); ``inter`` is one NIC (per direction). The node's ``nics_per_node`` NICs are shared by its
devices in rails: local device l uses NIC ``l * nics_per_node // devices_per_node``.

Device model (:class:`Device`): throughput is FLOP/s of the attention kernels, counted as in
``Kernel.flops`` (4 b h d per attending pair forward, 2.5x backward). Small blocks run less efficiently
than large ones: without measurements the rate of a ``q_len x kv_len`` block is ``peak * q_len / (q_len
+ half) * kv_len / (kv_len + half)`` times a per-kind efficiency; with measurements (``table``, from
``cpattn calibrate``) it is interpolated in log(area) between the measured blocks of the same phase and
kind, clamped at the ends.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace

from .steps import PHASES, Kernel, Problem

KINDS = ("full", "causal", "partial")


@dataclass(frozen=True)
class RatePoint:
    """A measured kernel rate: ``phase`` ("forward"/"backward"), ``kind`` ("full"/"causal"/"partial"),
    block ``q_len x kv_len`` (tokens), ``flop_per_s`` (FLOP/s)."""

    phase: str
    kind: str
    q_len: int
    kv_len: int
    flop_per_s: float


@dataclass(frozen=True)
class Device:
    """One accelerator (or one CPU rank).

    ``forward_flops`` / ``backward_flops``: large-block FULL attention rate (FLOP/s).
    ``half_tokens``: block side at which a dimension runs at half efficiency (tokens).
    ``causal_efficiency`` / ``partial_efficiency``: rate of CAUSAL / PARTIAL kernels relative to FULL.
    ``launch``: fixed cost per kernel call (seconds). ``memory_bandwidth``: bytes/s for the merge and
    accumulation epilogues. ``memory``: capacity (bytes). ``table``: measured rates, which replace the
    analytic curve for each (phase, kind) they cover.
    """

    name: str
    forward_flops: float
    backward_flops: float
    memory_bandwidth: float
    memory: int
    half_tokens: float = 128.0
    causal_efficiency: float = 0.9
    partial_efficiency: float = 0.25
    launch: float = 10e-6
    table: tuple[RatePoint, ...] = ()

    def __post_init__(self) -> None:
        for name in ("forward_flops", "backward_flops", "memory_bandwidth", "half_tokens", "causal_efficiency",
                     "partial_efficiency"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"Device.{name} must be a positive finite number, got {value!r}")
        if not (math.isfinite(self.launch) and self.launch >= 0):
            raise ValueError(f"Device.launch must be >= 0 seconds, got {self.launch!r}")
        if not isinstance(self.memory, int) or self.memory < 1:
            raise ValueError(f"Device.memory must be a positive int (bytes), got {self.memory!r}")
        for pt in self.table:
            if pt.phase not in PHASES or pt.kind not in KINDS or pt.q_len < 1 or pt.kv_len < 1 or \
                    not (math.isfinite(pt.flop_per_s) and pt.flop_per_s > 0):
                raise ValueError(f"Device.table has an invalid point {pt!r}")

    def scaled(self, factor: float) -> Device:
        """The same device with every compute rate multiplied by ``factor`` (e.g. a share of the cores)."""
        return replace(self, forward_flops=self.forward_flops * factor, backward_flops=self.backward_flops * factor,
                       table=tuple(replace(p, flop_per_s=p.flop_per_s * factor) for p in self.table))

    def rate(self, phase: str, kind: str, q_len: int, kv_len: int) -> float:
        """FLOP/s of one ``q_len x kv_len`` kernel of ``kind`` in ``phase``."""
        points = [p for p in self.table if p.phase == phase and p.kind == kind]
        if points:
            return _interpolate(points, q_len * kv_len)
        peak = self.forward_flops if phase == "forward" else self.backward_flops
        eff = {"full": 1.0, "causal": self.causal_efficiency, "partial": self.partial_efficiency}[kind]
        full_points = [p for p in self.table if p.phase == phase and p.kind == "full"]
        if full_points:
            return eff * _interpolate(full_points, q_len * kv_len)
        h = self.half_tokens
        return peak * eff * (q_len / (q_len + h)) * (kv_len / (kv_len + h))

    def merge_time(self, nbytes: int) -> float:
        """Seconds to fold one received partial result of ``nbytes`` bytes into an accumulator of the same
        size (lse merge of outputs, or a gradient sum): read both and write one, plus one launch."""
        return self.launch + 3.0 * nbytes / self.memory_bandwidth

    def kernel_time(self, kernel: Kernel, problem: Problem, phase: str) -> float:
        """Seconds for one call of ``kernel``: launch + FLOPs / rate + epilogue bytes / bandwidth."""
        flops = kernel.flops(problem, phase)
        rate = self.rate(phase, kernel.kind, kernel.q_len, kernel.kv_len)
        return self.launch + flops / rate + kernel.epilogue_bytes(problem, phase) / self.memory_bandwidth


def _interpolate(points: list[RatePoint], area: int) -> float:
    """Rate at ``area`` (pairs) from measured points, linear in log-log, clamped at both ends."""
    best: dict[int, float] = {}
    for p in points:  # several shapes of one area: keep the fastest
        a = p.q_len * p.kv_len
        best[a] = max(best.get(a, 0.0), p.flop_per_s)
    areas = sorted(best)
    i = bisect.bisect_left(areas, area)
    if i == 0:
        return best[areas[0]]
    if i == len(areas):
        return best[areas[-1]]
    a0, a1 = areas[i - 1], areas[i]
    w = (math.log(area) - math.log(a0)) / (math.log(a1) - math.log(a0))
    return math.exp((1 - w) * math.log(best[a0]) + w * math.log(best[a1]))


@dataclass(frozen=True)
class Link:
    """``latency`` alpha (seconds per message or per collective step) and ``bandwidth`` 1/beta
    (bytes/s per direction)."""

    latency: float
    bandwidth: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"Link.latency must be >= 0 seconds, got {self.latency!r}")
        if not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"Link.bandwidth must be a positive number of bytes/s, got {self.bandwidth!r}")

    def time(self, nbytes: float) -> float:
        """alpha + bytes * beta (seconds)."""
        return self.latency + nbytes / self.bandwidth


#: generic figures for a bare ``Topology(nodes, devices_per_node)``: PCIe-4-class links inside a node
#: (~25 GB/s per direction) and one 100 Gb/s NIC per node; a mid-range accelerator.
GENERIC_INTRA = Link(latency=10e-6, bandwidth=25e9)
GENERIC_INTER = Link(latency=20e-6, bandwidth=12.5e9)
GENERIC_DEVICE = Device("generic", forward_flops=100e12, backward_flops=75e12, memory_bandwidth=1e12,
                        memory=40 * 2**30)


#: collectives that have a ring and a tree algorithm (the others are rings, pairwise exchanges or p2p)
ALGORITHM_OPS = ("all_reduce", "broadcast", "reduce")
ALGORITHMS = ("auto", "ring", "tree")
_OP_ALIASES = {"allreduce": "all_reduce", "all_reduce": "all_reduce", "broadcast": "broadcast", "reduce": "reduce"}


def parse_algorithm(spec: str) -> dict[str, str]:
    """``{op: algorithm}`` for every op of :data:`ALGORITHM_OPS` from an ``NCCL_ALGO``-like ``spec``:
    one of :data:`ALGORITHMS` for all of them (case-insensitive), or ``"op:algo;op:algo"`` (ops as
    ``all_reduce``/``allreduce``, ``broadcast``, ``reduce``; unnamed ops stay ``auto``). Raises
    ValueError naming what is wrong."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"collective algorithm must be a non-empty string such as 'auto', 'ring', 'tree' or "
                         f"'all_reduce:tree;broadcast:ring', got {spec!r}")
    text = spec.strip().lower()
    if ":" not in text:
        if text not in ALGORITHMS:
            raise ValueError(f"collective algorithm {spec!r} is unknown; accepted: {', '.join(ALGORITHMS)}, or per op "
                             "'all_reduce:tree;broadcast:ring'")
        return dict.fromkeys(ALGORITHM_OPS, text)
    out = dict.fromkeys(ALGORITHM_OPS, "auto")
    for part in filter(None, (p.strip() for p in text.split(";"))):
        op, _, algo = (x.strip() for x in part.partition(":"))
        if op not in _OP_ALIASES:
            raise ValueError(f"collective algorithm {spec!r}: op {op!r} has no algorithm choice; accepted ops: "
                             f"{', '.join(ALGORITHM_OPS)}")
        if algo not in ALGORITHMS:
            raise ValueError(f"collective algorithm {spec!r}: {algo!r} for {op} is unknown; accepted: "
                             f"{', '.join(ALGORITHMS)}")
        out[_OP_ALIASES[op]] = algo
    return out


@dataclass(frozen=True)
class Topology:
    """``nodes`` x ``devices_per_node`` ranks; rank r lives on node r // devices_per_node.

    ``intra``/``inter``: :class:`Link` inside a node (per device) and per NIC. ``nics_per_node``: NICs
    shared by a node's devices in rails. ``device``: the :class:`Device` every rank runs on.
    ``overlap``: fraction of the communication a schedule overlaps with compute that actually hides
    (1 on GPUs with separate streams; lower where compute and communication share cores).
    ``op_links``: measured per-op links (``(op, Link)`` pairs, from calibration) that replace ``intra``
    for that op inside a node. ``cores``: 0 when every rank has its own device; > 0 when the ranks
    share that many CPU cores (local runs), each using at most ``threads_per_rank`` of them, so the
    device's rates hold when every rank computes and a rank with fewer peers busy runs faster (the
    cost model times such steps by processor sharing). ``algorithm``: the collective algorithms
    (:func:`parse_algorithm`: ``"auto"``, what NCCL/RCCL's tuners pick per op and size; ``"ring"``;
    ``"tree"``; or per op, ``"all_reduce:tree;broadcast:ring"``), like ``NCCL_ALGO``. ``name``: the
    preset it came from.
    """

    nodes: int
    devices_per_node: int
    intra: Link = GENERIC_INTRA
    inter: Link = GENERIC_INTER
    nics_per_node: int = 1
    device: Device = GENERIC_DEVICE
    overlap: float = 1.0
    op_links: tuple[tuple[str, Link], ...] = ()
    algorithm: str = "auto"
    cores: float = 0.0
    threads_per_rank: int = 1
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        for field_name in ("nodes", "devices_per_node", "nics_per_node"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Topology.{field_name} must be a positive int, got {value!r}")
        if not (0.0 <= self.overlap <= 1.0):
            raise ValueError(f"Topology.overlap must be in [0, 1], got {self.overlap!r}")
        parse_algorithm(self.algorithm)
        if not (math.isfinite(self.cores) and self.cores >= 0):
            raise ValueError(f"Topology.cores must be >= 0 (0: a device per rank), got {self.cores!r}")
        if not isinstance(self.threads_per_rank, int) or self.threads_per_rank < 1:
            raise ValueError(f"Topology.threads_per_rank must be a positive int, got {self.threads_per_rank!r}")

    def core_share(self, busy: int) -> float:
        """Cores each of ``busy`` computing ranks gets when the ranks share ``cores`` (see the class)."""
        return min(float(self.threads_per_rank), self.cores / busy)

    def algorithm_for(self, op: str) -> str:
        """``"ring"``, ``"tree"`` or ``"auto"`` for collective ``op`` (all_reduce, broadcast, reduce)."""
        return parse_algorithm(self.algorithm).get(op, "auto")

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def local_index(self, rank: int) -> int:
        return rank % self.devices_per_node

    def nic_of(self, rank: int) -> int:
        """The NIC (0 .. nics_per_node - 1 on its node) that ``rank``'s inter-node traffic uses."""
        return self.local_index(rank) * self.nics_per_node // self.devices_per_node

    def link_for(self, op: str) -> Link:
        """The intra-node link for ``op`` (a measured one when calibration provided it)."""
        return dict(self.op_links).get(op, self.intra)


__all__ = ["ALGORITHMS", "ALGORITHM_OPS", "GENERIC_DEVICE", "GENERIC_INTER", "GENERIC_INTRA", "KINDS", "Device", "Link",
           "RatePoint", "Topology", "parse_algorithm"]
