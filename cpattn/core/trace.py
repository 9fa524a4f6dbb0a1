"""Recording mode: what this process issues, waits for and computes, in order; and, as a timeline, when.

Inside ``with cpattn.core.trace.recording() as events:`` every communicator call and every block a local
kernel computes appends one event (a dict) to ``events`` (a stacked call of several equal-shaped
blocks, ``kernels.forward_stacked``, records one event per block, as ``steps()`` counts them);
outside it nothing is recorded and the cost is a ``None`` check or two. Tests compare a recording with
the schedule's ``steps()`` (what it declares to send and to overlap; see ``cpattn.exactness.check_steps``).

- ``issue``: ``call`` (one id per communicator call), ``op`` (the accounting kind: send, recv,
  broadcast, ...), ``sent``, ``recv`` (payload bytes, as ``Communicator.stats()`` counts them);
- ``wait``: ``call``, whose handle was waited on (synchronous calls: right after their issue);
- ``compute``: ``phase`` ("forward"/"backward"), ``kind`` ("full"/"causal"/"partial"), ``q``, ``kv``
  (rows of the block).

A batched point-to-point call issues one event per message under one ``call`` id. A hierarchical
collective is one call (its second level runs inside ``wait``), as it is one op in the accounting.

**Timeline.** Inside ``with cpattn.core.trace.timeline(device) as tl:`` the same hooks also stamp wall time
(``time.perf_counter_ns``) into ``tl.events``, a list of its own (a recording's events are unchanged,
and either may be active without the other):

- ``issue``: ``call``, ``ops`` (``[(op, sent, recv), ...]``, the call's messages), ``t`` (taken as the
  communicator call begins, before it starts any transfer);
- ``wait``: ``call``, ``t0`` (the wait starts), ``t1`` (it returns);
- ``kernel``: ``phase``, ``kind``, ``q``, ``kv``, ``pieces`` (blocks of a stacked call), ``t0``, ``t1``:
  one event per kernel call, a stacked call included;
- ``mark``: ``name``, ``t`` (:meth:`Trace.mark`, e.g. where a step's backward begins).

On a CUDA ``device`` each stamp is a ``torch.cuda.Event`` recorded on the current stream (no host
synchronisation while the timeline runs); they are turned into the same nanosecond clock when the
block ends, which synchronises once. ``cpattn.timeline`` turns timelines into spans, a Chrome trace
and the fraction of transfer time hidden behind kernel calls.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


class Trace:
    """Wall-clock stamps of one process (see the module's docstring). ``origin``: the stamp taken when
    the timeline began, on the same clock as the events' (nanoseconds once the block has ended)."""

    def __init__(self, device=None) -> None:
        self.events: list[dict] = []
        self.first_call = 0  # calls issued before the timeline began are not its own
        self._cuda = None
        if device is not None and str(device).startswith("cuda"):
            # the reference: a CUDA event and the host clock, read together once the device is idle
            torch.cuda.synchronize(device)
            ref = torch.cuda.Event(enable_timing=True)
            ref.record()
            ref.synchronize()
            self._cuda = (ref, time.perf_counter_ns(), device)
        self.origin = self.stamp()

    def stamp(self):
        """Now: ``perf_counter_ns()``, or on CUDA an event recorded on the current stream."""
        if self._cuda is None:
            return time.perf_counter_ns()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def mark(self, name: str) -> None:
        self.events.append({"ev": "mark", "name": name, "t": self.stamp()})

    def _resolve(self) -> None:
        """CUDA stamps into nanoseconds of the host clock (one synchronisation)."""
        if self._cuda is None:
            return
        ref, host, device = self._cuda
        torch.cuda.synchronize(device)

        def ns(ev):
            return ev if ev is None or isinstance(ev, int) else host + round(ref.elapsed_time(ev) * 1e6)

        self.origin = ns(self.origin)
        for ev in self.events:
            for key in ("t", "t0", "t1"):
                if key in ev:
                    ev[key] = ns(ev[key])
        self._cuda = None

    def as_dict(self) -> dict:
        """Plain data (picklable, JSON-ready): ``{"origin": ns, "events": [...]}``."""
        return {"origin": self.origin, "events": self.events}


@dataclass(slots=True)
class _State:
    """What is active: a recording's events (and its first call id), a timeline, or both."""

    events: list[dict] | None = None
    events_from: int = 0
    timeline: Trace | None = None


_state = _State()
_next_call = 0


@contextmanager
def recording() -> Iterator[list[dict]]:
    """Record events into the yielded list until the block ends (not re-entrant)."""
    if _state.events is not None:
        raise RuntimeError("cpattn.core.trace.recording() is already active")
    _state.events, _state.events_from = [], _next_call
    try:
        yield _state.events
    finally:
        _state.events = None


@contextmanager
def timeline(device=None) -> Iterator[Trace]:
    """Stamp issues, waits and kernel calls with wall time until the block ends (not re-entrant);
    ``device``: where the kernels run (a CUDA device: stamps are CUDA events, resolved at the end)."""
    if _state.timeline is not None:
        raise RuntimeError("cpattn.core.trace.timeline() is already active")
    tl = Trace(device)
    tl.first_call = _next_call
    _state.timeline = tl
    try:
        yield tl
    finally:
        _state.timeline = None
        tl._resolve()


def active() -> bool:
    """Whether a recording is active (a timeline alone does not count)."""
    return _state.events is not None


def now():
    """A timeline's stamp of this moment, or None without a timeline (a communicator call takes it
    before it starts anything, and passes it to :func:`issue`)."""
    tl = _state.timeline
    return None if tl is None else tl.stamp()


def issue(ops: list[tuple[str, int, int]], start=None) -> int | None:
    """Record one call issuing ``ops`` ``(kind, bytes_sent, bytes_recv)``; its call id, or None when
    neither a recording nor a timeline is active. ``start``: the call's :func:`now` (default: a stamp
    taken here)."""
    global _next_call
    st = _state
    if st.events is None and st.timeline is None:
        return None
    call = _next_call
    _next_call += 1
    if st.events is not None:
        for op, sent, recv in ops:
            st.events.append({"ev": "issue", "call": call, "op": op, "sent": int(sent), "recv": int(recv)})
    tl = st.timeline
    if tl is not None:
        tl.events.append({"ev": "issue", "call": call, "t": start if start is not None else tl.stamp(),
                          "ops": [(op, int(sent), int(recv)) for op, sent, recv in ops]})
    return call


def wait(call: int | None, start=None) -> None:
    """The wait for ``call`` has returned; ``start``: the :func:`now` of its start (the timeline's stamp)."""
    st = _state
    if call is None:
        return
    if st.events is not None and call >= st.events_from:
        st.events.append({"ev": "wait", "call": call})
    tl = st.timeline
    if tl is not None and start is not None and call >= tl.first_call:
        tl.events.append({"ev": "wait", "call": call, "t0": start, "t1": tl.stamp()})


def compute(phase: str, kind: str, q_rows: int, kv_rows: int, pieces: int = 1) -> dict | None:
    """A kernel call of ``pieces`` blocks of ``q_rows`` x ``kv_rows`` starts: one recording event per
    block. With a timeline, returns the call's timeline event (pass it to :func:`computed` when the
    call returns); None otherwise."""
    st = _state
    if st.events is not None:
        for _ in range(pieces):
            st.events.append({"ev": "compute", "phase": phase, "kind": kind, "q": int(q_rows), "kv": int(kv_rows)})
    tl = st.timeline
    if tl is None:
        return None
    span = {"ev": "kernel", "phase": phase, "kind": kind, "q": int(q_rows), "kv": int(kv_rows),
            "pieces": int(pieces), "t0": tl.stamp(), "t1": None}
    tl.events.append(span)
    return span


def computed(span: dict | None) -> None:
    """The kernel call whose :func:`compute` returned ``span`` has returned."""
    if span is not None and _state.timeline is not None:
        span["t1"] = _state.timeline.stamp()


__all__ = ["Trace", "active", "compute", "computed", "issue", "now", "recording", "timeline", "wait"]
