"""The contract between a schedule that plans and everything that runs or prices it (pure data).

Most schedules declare rank-generic steps (``Schedule.steps``). A schedule that plans (``ultra``)
makes a :class:`Plan` for a problem (``Schedule.make_plan``), and its per-rank program
(``Schedule.program``) is compiled from that plan. ``ContextParallel`` builds the plan on group rank 0
and hands every rank the same one (its JSON form, read back by ``Schedule.read_plan``); the cost
model asks the plan for its :class:`Prediction`. Nothing outside the schedule and its planner knows
what a plan holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Prediction:
    """What a plan predicts for one phase: ``total`` seconds (its makespan), the busiest rank's
    ``compute`` and ``comm`` seconds, the busiest sender's ``bytes_sent`` and the most ``buffer_bytes``
    a rank holds beyond its resident inputs and outputs."""

    total: float
    compute: float
    comm: float
    bytes_sent: int
    buffer_bytes: int


@runtime_checkable
class Plan(Protocol):
    """A schedule's plan for one problem: JSON-able (validated when read back) and able to predict
    each phase."""

    def to_json(self) -> str: ...

    def predict(self, problem, phase: str) -> Prediction: ...


__all__ = ["Plan", "Prediction"]
