"""Schedule registry: one algorithm per file, looked up by name.

``get(name)`` returns the schedule object; ``available()`` says what each supports.
"""

from __future__ import annotations

from ..masks import causal, full
from .allgather import AllGatherSchedule
from .base import Schedule
from .ring import RingSchedule
from .ringx1 import RingX1, RingX1o
from .ringx2 import RingX2, RingX2o
from .ringx3 import RingX3, RingX3b
from .ringx4 import RingX4, RingX4o
from .stripe_ring import StripeRingSchedule
from .ultra import UltraSchedule
from .ulysses import UlyssesSchedule
from .usp import USPSchedule
from .zigzag_ring import ZigzagRingSchedule

_REGISTRY: dict[str, Schedule] = {}


def register(schedule: Schedule) -> Schedule:
    if schedule.name in _REGISTRY:
        raise ValueError(f"schedule {schedule.name!r} is already registered")
    _REGISTRY[schedule.name] = schedule
    return schedule


for _cls in (RingSchedule, ZigzagRingSchedule, StripeRingSchedule, AllGatherSchedule,
             RingX1, RingX1o, RingX2, RingX2o, RingX3, RingX3b, RingX4, RingX4o, UltraSchedule,
             UlyssesSchedule, USPSchedule):
    register(_cls())


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str) -> Schedule:
    if name not in _REGISTRY:
        raise ValueError(f"schedule={name!r} is unknown; accepted: {', '.join(_REGISTRY)} or 'auto'")
    return _REGISTRY[name]


def available() -> list[dict]:
    """One row per schedule: name, layout, masks, causal, bidirectional, gqa, memory, summary, and
    custom_layout (whether ``ContextParallel(layout=...)``, e.g. "balanced", may replace its layout).
    ``masks`` is "any" or the mask names it accepts; causal-only / bidirectional-only schedules
    accept only masks with / without ``is_causal``."""
    rows = []
    causal_layout, full_layout = (lambda s: s.layout_for(causal())), (lambda s: s.layout_for(full()))
    for s in _REGISTRY.values():
        same = causal_layout(s) == full_layout(s)
        rows.append({
            "name": s.name,
            "layout": s.layout if same else f"{causal_layout(s)} (causal) / {full_layout(s)}",
            "masks": "any" if s.masks == "any" else ", ".join(s.masks),
            "causal": s.causal,
            "bidirectional": s.bidirectional,
            "gqa": True,
            "memory": s.memory,
            "summary": s.summary,
            "custom_layout": s.custom_layout,
        })
    return rows


__all__ = ["Schedule", "available", "get", "names", "register"]
