"""Scheduling a kernel graph (docs/ultraattn.md, "Schedule"): start times that minimise the
makespan with no overlap on any lane, and the per-device issue order that follows from them.

Two schedulers, both over the cost model's tasks (:class:`cpattn.core.simulator.Task`):

- greedy list scheduling by earliest start: the cost model's event simulator
  (:func:`cpattn.core.simulator.simulate`) without an order;
- CP-SAT: one interval per task (durations rounded to integer ticks), ``start >= end`` of every
  dependency, no overlap on every lane, minimise the makespan; one worker, a fixed seed, a time
  limit, started from the greedy schedule. Its per-lane order is then replayed in the simulator, so
  the predicted time of either answer comes from the same model; the shorter one wins.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..core.simulator import Simulation, Task, simulate
from .partition_ilp import deterministic_solver

log = logging.getLogger(__name__)
#: the makespan is resolved to about this many ticks in the CP-SAT model
TICKS = 100_000


@dataclass(frozen=True)
class Scheduled:
    """A schedule: the simulated ``timeline`` (seconds), ``method`` ("cp-sat" or "greedy"), the
    solver ``status``, the greedy makespan for comparison and the time spent (seconds)."""

    timeline: Simulation
    method: str
    status: str
    greedy_makespan: float
    seconds: float

    def report(self) -> dict:
        return {"method": self.method, "status": self.status, "makespan": self.timeline.makespan,
                "greedy_makespan": self.greedy_makespan, "seconds": round(self.seconds, 3)}


def lane_order(timeline: Simulation) -> dict[str, list[str]]:
    """Each lane's tasks in start order."""
    return {ln: [iv.task for iv in ivs] for ln, ivs in timeline.lanes.items()}


def _cpsat_order(tasks: Sequence[Task], greedy: Simulation, time_limit: float,
                 seed: int) -> tuple[dict[str, list[str]] | None, str]:
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        return None, "OR-Tools is not installed"
    span = max(greedy.makespan, max((t.duration for t in tasks), default=0.0))
    if span <= 0:
        return None, "nothing to schedule"
    tick = span / TICKS
    dur = {t.name: max(1, math.ceil(t.duration / tick)) for t in tasks}
    # the greedy order replayed with the rounded durations: a feasible integer schedule to start from
    hint = simulate([replace(t, duration=float(dur[t.name])) for t in tasks], lane_order(greedy))
    horizon = round(hint.makespan)
    m = cp_model.CpModel()
    start = {t.name: m.new_int_var(0, horizon - dur[t.name], f"s_{t.name}") for t in tasks}
    interval = {t.name: m.new_fixed_size_interval_var(start[t.name], dur[t.name], f"i_{t.name}") for t in tasks}
    lanes: dict[str, list[str]] = {}  # lane -> its tasks, in task order
    for t in tasks:
        for ln in t.lanes:
            lanes.setdefault(ln, []).append(t.name)
        for d in t.deps:
            m.add(start[t.name] >= start[d] + dur[d])
    for names in lanes.values():
        if len(names) > 1:
            m.add_no_overlap([interval[name] for name in names])
    makespan = m.new_int_var(0, horizon, "makespan")
    for t in tasks:
        m.add(makespan >= start[t.name] + dur[t.name])
    m.minimize(makespan)
    for t in tasks:
        m.add_hint(start[t.name], round(hint.start[t.name]))
    solver = deterministic_solver(seed, time_limit)
    status = solver.solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, "solver timed out" if status == cp_model.UNKNOWN else f"solver {solver.status_name(status)}"
    rank = {t.name: n for n, t in enumerate(tasks)}
    order = {ln: sorted(names, key=lambda name: (solver.value(start[name]), rank[name])) for ln, names in lanes.items()}
    return order, "OPTIMAL" if status == cp_model.OPTIMAL else "FEASIBLE (time limit)"


def schedule(tasks: Sequence[Task], time_limit: float = 10.0, seed: int = 0, use_solver: bool = True) -> Scheduled:
    """The better of the greedy list schedule and the CP-SAT schedule (when ``use_solver``)."""
    begin = time.perf_counter()
    greedy = simulate(tasks)
    if not use_solver:
        return Scheduled(greedy, "greedy", "greedy (solver not requested)", greedy.makespan,
                         time.perf_counter() - begin)
    order, status = _cpsat_order(tasks, greedy, time_limit, seed)
    if order is None:
        log.warning("schedule ILP: %s; using the greedy list schedule", status)
        return Scheduled(greedy, "greedy", f"greedy: {status}", greedy.makespan, time.perf_counter() - begin)
    replay = simulate(tasks, order)
    if replay.makespan > greedy.makespan:
        return Scheduled(greedy, "greedy", f"greedy: shorter than the solver's ({status})", greedy.makespan,
                         time.perf_counter() - begin)
    return Scheduled(replay, "cp-sat", status, greedy.makespan, time.perf_counter() - begin)
