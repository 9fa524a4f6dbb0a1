"""Schedule registry: one algorithm per file, looked up by name.

``get(name)`` returns a new schedule object with default options (``USP(ulysses_degree=2)`` and
``Ultra(options)`` take options directly); ``available()`` says what each supports. A new schedule is
one file plus one entry in the registration loop below (see docs/architecture.md).
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

#: the registered schedule classes, by name, in registry order
_REGISTRY: dict[str, type[Schedule]] = {}

# friendly names for the schedules that take options
USP = USPSchedule
Ultra = UltraSchedule


def register(cls: type[Schedule]) -> type[Schedule]:
    """Add a schedule class (its ``name`` must be new); returns it, so it works as a decorator."""
    if not (isinstance(cls, type) and issubclass(cls, Schedule)) or not cls.name:
        raise TypeError(f"register() takes a Schedule subclass with a name, got {cls!r}")
    if cls.name in _REGISTRY:
        raise ValueError(f"schedule {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


for _cls in (RingSchedule, ZigzagRingSchedule, StripeRingSchedule, AllGatherSchedule,
             RingX1, RingX1o, RingX2, RingX2o, RingX3, RingX3b, RingX4, RingX4o, UltraSchedule,
             UlyssesSchedule, USPSchedule):
    register(_cls)


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str, **options) -> Schedule:
    """A new ``name`` schedule with ``options`` (its defaults for those not given)."""
    if name not in _REGISTRY:
        raise ValueError(f"schedule={name!r} is unknown; accepted: {', '.join(_REGISTRY)} or 'auto'")
    return _REGISTRY[name](**options)


def resolve(schedule: str | Schedule) -> Schedule:
    """A schedule object from a registered name or a schedule object (returned as is)."""
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, str):
        return get(schedule)
    raise TypeError(f"schedule must be a name (str) or a cpattn.schedules.Schedule, got {type(schedule).__name__}")


def available() -> list[dict]:
    """One row per schedule: name, layout, masks, causal, bidirectional, gqa, memory, summary, and
    custom_layout (whether ``ContextParallel(layout=...)``, e.g. "balanced", may replace its layout).
    ``masks`` is "any" or the mask names it accepts; causal-only / bidirectional-only schedules
    accept only masks with / without ``is_causal``."""
    rows = []
    causal_layout, full_layout = (lambda s: s.layout_for(causal())), (lambda s: s.layout_for(full()))
    for s in (cls() for cls in _REGISTRY.values()):
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


__all__ = ["USP", "Schedule", "Ultra", "available", "get", "names", "register", "resolve"]
