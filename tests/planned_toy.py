"""A schedule that plans, defined outside cpattn with its own planner and plan: what it needs must be
reachable through the schedule's hooks alone (``make_plan``, ``read_plan``, ``program``), so that
``ContextParallel``, the cost estimate and ``verify`` run it unmodified.

The plan: the order in which each rank visits the other ranks' key/value blocks (nearest first,
going down the ring), made by a tiny planner. The program: all-gather the packed kv, attend the own
block, then the others in the planned order; backward the same into per-source dk/dv slots and a
reduce-scatter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from cpattn import exactness, schedules
from cpattn.core.program import Prediction
from cpattn.core.steps import OWN, Attend, AttendBack, CommOp, Step, Zeros
from cpattn.schedules.base import Schedule

NAME = "toy_planned"


@dataclass(frozen=True)
class ToyPlan:
    """``order[r]``: the ranks whose kv rank r attends after its own, in order."""

    order: tuple[tuple[int, ...], ...]

    def to_json(self) -> str:
        return json.dumps({"schema": "toy-plan", "order": [list(o) for o in self.order]})

    @classmethod
    def from_json(cls, text: str) -> ToyPlan:
        data = json.loads(text)
        if data.get("schema") != "toy-plan":
            raise ValueError(f"not a toy plan: {text[:40]!r}")
        order = tuple(tuple(o) for o in data["order"])
        if any(sorted(o + (r,)) != list(range(len(order))) for r, o in enumerate(order)):
            raise ValueError("a toy plan visits every other rank once")
        return cls(order)

    def predict(self, problem, phase: str) -> Prediction:
        flops = problem.flops(phase) / problem.world
        seconds = flops / 1e12 + (problem.world - 1) * problem.kv_bytes / 1e10
        return Prediction(seconds, flops / 1e12, seconds - flops / 1e12, (problem.world - 1) * problem.kv_bytes,
                          (problem.world + 1) * problem.kv_bytes)


class ToyPlanned(Schedule):
    name = NAME
    layout = "contiguous"
    masks = "any"
    custom_layout = False
    summary = "a test schedule that plans the order it visits kv blocks in"
    made: list = []  # (problem, fast) of each plan made in this process

    def make_plan(self, problem, topology, fast=False):
        self.made.append((problem, fast))
        p = problem.world
        return ToyPlan(tuple(tuple((r - j) % p for j in range(1, p)) for r in range(p)))

    def read_plan(self, text):
        return ToyPlan.from_json(text)

    def program(self, problem, phase, topology=None, plan=None, rank=0):
        assert isinstance(plan, ToyPlan), plan
        gather = (CommOp("all_gather", problem.kv_bytes, send="kv0", recv="kv_all"),)
        others = plan.order[rank]
        if phase == "forward":
            return [Step(gather, run=(Zeros("out", "q", output=True), Attend("kv0", ("own",)))),
                    Step(run=tuple(Attend("kv_all", ("other", j), index=j) for j in others))]
        scatter = CommOp("reduce_scatter", problem.dkv_bytes, send="dkv_all", recv="dkv")
        return [Step(gather, run=(Zeros("dq", "q"), Zeros("dkv_all", "kv0", count=problem.world),
                                      AttendBack("kv0", ("own",), "dkv_all", dkv_index=OWN))),
                Step(run=tuple(AttendBack("kv_all", ("other", j), "dkv_all", index=j, dkv_index=j) for j in others)),
                Step((scatter,), overlap=False)]


def registered():
    """Register the toy (once per process) and return a function that removes it again."""
    schedules.register(ToyPlanned)
    return lambda: schedules._REGISTRY.pop(NAME, None)


def toy_case(**fields) -> dict:
    """``exactness.rank_case`` with the toy registered on this worker for the call only."""
    remove = registered()
    try:
        return exactness.rank_case(**fields)
    finally:
        remove()
