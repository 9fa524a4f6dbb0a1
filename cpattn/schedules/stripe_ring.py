"""Striped ring attention: the ring of ``ring.py`` on the striped layout (token t on rank t mod P).

Under a causal mask, queries of rank r attend the keys of rank j <= r as a causal block and those of
rank j > r as a causal block shifted by one (local query i sees local keys < i), so every step is
balanced. ``cpattn.blocks.striped`` states that rule. Other masks are rejected (NotImplementedError):
on strided positions every block of a window or document mask would be PARTIAL, i.e. a dense local x
local mask per step; use ``ring``, ``zigzag_ring``, ``allgather``, ``ulysses`` or ``usp`` for them.
"""

from __future__ import annotations

from .ring import RingSchedule


class StripeRingSchedule(RingSchedule):
    name = "stripe_ring"
    layout = "striped"
    masks = ("causal", "full")  # blocks.striped knows these two; other masks: ring, zigzag_ring, ...
    custom_layout = False
    summary = "p2p ring on the striped layout: balanced causal work"
