"""Recording mode: what this process issues, waits for and computes, in order.

Inside ``with cpattn.trace.recording() as events:`` every communicator call and every block a local
kernel computes appends one event (a dict) to ``events`` (a stacked call of several equal-shaped
blocks, ``kernels.forward_stacked``, records one event per block, as ``steps()`` counts them);
outside it nothing is recorded and the cost is one ``None`` check. Tests compare a recording with
the schedule's ``steps()`` (what it declares to send and to overlap; see ``cpattn.verify.check_steps``).

- ``issue``: ``call`` (one id per communicator call), ``op`` (the accounting kind: send, recv,
  broadcast, ...), ``sent``, ``recv`` (payload bytes, as ``Communicator.stats()`` counts them);
- ``wait``: ``call``, whose handle was waited on (synchronous calls: right after their issue);
- ``compute``: ``phase`` ("forward"/"backward"), ``kind`` ("full"/"causal"/"partial"), ``q``, ``kv``
  (rows of the block).

A batched point-to-point call issues one event per message under one ``call`` id. A hierarchical
collective is one call (its second level runs inside ``wait``), as it is one op in the accounting.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

_events: list[dict] | None = None
_calls = itertools.count()


@contextmanager
def recording() -> Iterator[list[dict]]:
    """Record events into the yielded list until the block ends (not re-entrant)."""
    global _events
    if _events is not None:
        raise RuntimeError("cpattn.trace.recording() is already active")
    _events = []
    try:
        yield _events
    finally:
        _events = None


def active() -> bool:
    return _events is not None


def issue(ops: list[tuple[str, int, int]]) -> int | None:
    """Record one call issuing ``ops`` ``(kind, bytes_sent, bytes_recv)``; its call id, or None when not
    recording."""
    if _events is None:
        return None
    call = next(_calls)
    for op, sent, recv in ops:
        _events.append({"ev": "issue", "call": call, "op": op, "sent": int(sent), "recv": int(recv)})
    return call


def wait(call: int | None) -> None:
    if _events is not None and call is not None:
        _events.append({"ev": "wait", "call": call})


def compute(phase: str, kind: str, q_rows: int, kv_rows: int) -> None:
    if _events is not None:
        _events.append({"ev": "compute", "phase": phase, "kind": kind, "q": int(q_rows), "kv": int(kv_rows)})


__all__ = ["active", "compute", "issue", "recording", "wait"]
