"""Event-driven simulation of a task graph on lanes (pure): the timing model of UltraAttn plans.

A :class:`Task` occupies one or more *lanes* for its whole ``duration`` and starts after its
dependencies end. Each device has a compute lane, a send lane and a receive lane (:func:`lane`); a
transfer occupies the sender's send lane and the receiver's receive lane (:func:`transfer`), so a
device can compute, send and receive at once, but does one thing at a time on each lane.

:func:`simulate` places tasks one at a time, always the eligible task that can start earliest (ties:
the order given), at the earliest time its dependencies have ended and its lanes are free; a lane
never runs a task before one placed on it earlier (no backfilling). With ``order`` (lane -> task
names: a plan's per-device issue order) a task is eligible only once the tasks before it on each of
its ordered lanes are placed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .topology import Topology

LANE_KINDS = ("compute", "send", "recv")


def lane(device: int, kind: str) -> str:
    """Name of ``device``'s lane of ``kind`` ("compute", "send" or "recv")."""
    if kind not in LANE_KINDS:
        raise ValueError(f"lane kind {kind!r} is unknown; accepted: {', '.join(LANE_KINDS)}")
    return f"{device}.{kind}"


@dataclass(frozen=True)
class Task:
    """``name`` (unique), ``duration`` (seconds), the ``lanes`` it occupies, the tasks it waits for."""

    name: str
    duration: float
    lanes: tuple[str, ...]
    deps: tuple[str, ...] = ()


def compute(name: str, device: int, seconds: float, deps: Sequence[str] = ()) -> Task:
    """A kernel on ``device``'s compute lane."""
    return Task(name, seconds, (lane(device, "compute"),), tuple(deps))


def transfer(name: str, src: int, dst: int, nbytes: float, topology: Topology, deps: Sequence[str] = ()) -> Task:
    """``nbytes`` from device ``src`` to ``dst``: alpha + bytes / bandwidth of the intra-node link or,
    across nodes, of one NIC; occupies ``src``'s send lane and ``dst``'s receive lane."""
    link = topology.intra if topology.node_of(src) == topology.node_of(dst) else topology.inter
    return Task(name, link.time(nbytes), (lane(src, "send"), lane(dst, "recv")), tuple(deps))


@dataclass(frozen=True)
class Interval:
    task: str
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """``makespan`` (seconds), each task's ``start``/``end``, and each lane's intervals in time order."""

    makespan: float
    start: dict[str, float]
    end: dict[str, float]
    lanes: dict[str, list[Interval]]

    def busy(self, lane_name: str) -> float:
        """Seconds ``lane_name`` is occupied."""
        return sum(iv.end - iv.start for iv in self.lanes.get(lane_name, []))


def _validate(tasks: Sequence[Task], order: Mapping[str, Sequence[str]] | None) -> dict[str, int]:
    index: dict[str, int] = {}
    for n, t in enumerate(tasks):
        if t.name in index:
            raise ValueError(f"task name {t.name!r} is used twice")
        if not (math.isfinite(t.duration) and t.duration >= 0):
            raise ValueError(f"task {t.name!r} has duration {t.duration!r}; it must be >= 0 seconds")
        if not t.lanes:
            raise ValueError(f"task {t.name!r} occupies no lane")
        index[t.name] = n
    for t in tasks:
        for d in t.deps:
            if d not in index:
                raise ValueError(f"task {t.name!r} depends on unknown task {d!r}")
    for ln, names in (order or {}).items():
        for name in names:
            if name not in index:
                raise ValueError(f"order for lane {ln!r} names unknown task {name!r}")
            if ln not in tasks[index[name]].lanes:
                raise ValueError(f"order for lane {ln!r} names task {name!r}, which does not use that lane")
        if len(set(names)) != len(names):
            raise ValueError(f"order for lane {ln!r} repeats a task")
    return index


def simulate(tasks: Sequence[Task], order: Mapping[str, Sequence[str]] | None = None) -> Simulation:
    """Schedule ``tasks`` (see the module docstring). Raises ValueError on unknown dependencies, bad
    durations, or a dependency/order cycle (naming tasks on it)."""
    index = _validate(tasks, order)
    order = {ln: list(names) for ln, names in (order or {}).items()}
    position = {(ln, name): n for ln, names in order.items() for n, name in enumerate(names)}
    lane_next = {ln: 0 for ln in order}  # how many of each ordered lane's tasks are placed
    waiting = {t.name: len(set(t.deps)) for t in tasks}
    children: dict[str, list[str]] = {t.name: [] for t in tasks}
    for t in tasks:
        for d in set(t.deps):
            children[d].append(t.name)
    lane_free: dict[str, float] = {}
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    lanes: dict[str, list[Interval]] = {}

    def in_turn(t: Task) -> bool:
        return all(lane_next[ln] == position[(ln, t.name)] for ln in t.lanes if (ln, t.name) in position)

    def earliest(t: Task) -> float:
        ready = max((end[d] for d in t.deps), default=0.0)
        return max([ready, *(lane_free.get(ln, 0.0) for ln in t.lanes)])

    heap: list[tuple[float, int, str]] = []
    pushed: set[str] = set()

    def offer(name: str) -> None:
        t = tasks[index[name]]
        if waiting[name] == 0 and name not in pushed and in_turn(t):
            pushed.add(name)
            heapq.heappush(heap, (earliest(t), index[name], name))

    for t in tasks:
        offer(t.name)
    while heap:
        key, n, name = heapq.heappop(heap)
        t = tasks[n]
        now = earliest(t)
        if now > key:  # a lane got busier since it was offered: re-queue at its true time
            heapq.heappush(heap, (now, n, name))
            continue
        start[name], end[name] = now, now + t.duration
        for ln in t.lanes:
            lane_free[ln] = end[name]
            lanes.setdefault(ln, []).append(Interval(name, now, end[name]))
            if ln in lane_next:
                lane_next[ln] += 1
                if lane_next[ln] < len(order[ln]):
                    offer(order[ln][lane_next[ln]])
        for child in children[name]:
            waiting[child] -= 1
            offer(child)
    if len(start) < len(tasks):
        stuck = [t.name for t in tasks if t.name not in start]
        raise ValueError(f"tasks never became ready (a dependency or lane-order cycle): {', '.join(stuck[:10])}")
    return Simulation(max(end.values(), default=0.0), start, end, lanes)


__all__ = ["LANE_KINDS", "Interval", "Simulation", "Task", "compute", "lane", "simulate", "transfer"]
