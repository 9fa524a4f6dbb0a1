"""Striped ring attention: the ring of ``ring.py`` on the striped layout (token t on rank t mod P).

Under a causal mask, queries of rank r attend the keys of rank j <= r as a causal block and those of
rank j > r as a causal block shifted by one (local query i sees local keys < i), so every step is
balanced. ``cpattn.blocks.striped`` states that rule.
"""

from __future__ import annotations

from .ring import RingSchedule


class StripeRingSchedule(RingSchedule):
    name = "stripe_ring"
    layout = "striped"
    masks = ("causal", "full")
    summary = "p2p ring on the striped layout: balanced causal work"
