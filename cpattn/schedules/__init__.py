"""Schedule registry: one algorithm per file, looked up by name.

``get(name)`` returns a new schedule object with default options (``USP(ulysses_degree=2)`` and
``Ultra(options)`` take options directly); ``available()`` says what each supports. A new schedule is
one file plus one entry in the registration loop below (see docs/architecture.md).
"""

from __future__ import annotations

from typing import Any

from ..core.masks import causal, full
from .allgather import AllGather
from .base import Schedule
from .ring import RingSchedule
from .ringx import RingX
from .stripe_ring import StripeRingSchedule
from .ultra import UltraSchedule
from .ulysses import UlyssesSchedule
from .usp import USPSchedule
from .zigzag_ring import ZigzagRingSchedule

#: the registered schedules, by name, in registry order: (class, options)
_REGISTRY: dict[str, tuple[type[Schedule], dict[str, Any]]] = {}

# friendly names for the schedules that take options
USP = USPSchedule
Ultra = UltraSchedule


def register(cls: type[Schedule], *names: str) -> type[Schedule]:
    """Add a schedule class under ``names`` (default: all of ``cls.aliases``, each with its options, or
    ``cls.name``; each must be new); returns it, so it works as a decorator."""
    if not (isinstance(cls, type) and issubclass(cls, Schedule)) or not (cls.aliases or isinstance(cls.name, str)
                                                                       and cls.name):
        raise TypeError(f"register() takes a Schedule subclass with a name, got {cls!r}")
    entries = cls.aliases or {cls.name: {}}
    names = names or tuple(entries)
    for name in names:
        if name not in entries:
            raise ValueError(f"{cls.__name__} has no alias {name!r}; its names: {', '.join(entries)}")
        if name in _REGISTRY:
            raise ValueError(f"schedule {name!r} is already registered")
    _REGISTRY.update((name, (cls, dict(entries[name]))) for name in names)
    return cls


for _cls, *_names in ((RingSchedule,), (ZigzagRingSchedule,), (StripeRingSchedule,), (AllGather, "allgather"),
                      (RingX, "ringx1", "ringx1o", "ringx2", "ringx2o"), (AllGather, "ringx3", "ringx3b"),
                      (RingX, "ringx4", "ringx4o"), (UltraSchedule,), (UlyssesSchedule,), (USPSchedule,)):
    register(_cls, *_names)


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str, **options) -> Schedule:
    """A new ``name`` schedule with ``options`` (the name's own for those not given)."""
    if name not in _REGISTRY:
        raise ValueError(f"schedule={name!r} is unknown; accepted: {', '.join(_REGISTRY)} or 'auto'")
    cls, own = _REGISTRY[name]
    return cls(**{**own, **options})


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
    for s in (get(name) for name in _REGISTRY):
        causal_layout, full_layout = s.layout_for(causal()), s.layout_for(full())
        rows.append({
            "name": s.name,
            "layout": s.layout if causal_layout == full_layout else f"{causal_layout} (causal) / {full_layout}",
            "masks": "any" if s.masks == "any" else ", ".join(s.masks),
            "causal": s.causal,
            "bidirectional": s.bidirectional,
            "gqa": True,
            "memory": s.memory,
            "summary": s.summary,
            "custom_layout": s.custom_layout,
        })
    return rows


__all__ = ["AllGather", "RingX", "USP", "Schedule", "Ultra", "available", "get", "names", "register", "resolve"]
