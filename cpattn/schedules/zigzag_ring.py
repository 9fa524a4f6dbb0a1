"""Zigzag ring attention: the ring of ``ring.py`` on the zigzag layout.

The sequence is cut into 2P chunks and rank r holds chunks r and 2P-1-r, so under a causal mask every
off-diagonal step is the same amount of work on every rank: from a source i < r, all local queries
attend the first half of kv_i; from i > r, the second local half attends all of kv_i. That rule is not
written out here: it is what the mask classifier yields on this layout (see ``cpattn.core.blocks``). Other
masks are exact too (the classifier decides every block); only the balance is causal-specific.
"""

from __future__ import annotations

from .ring import RingSchedule


class ZigzagRingSchedule(RingSchedule):
    name = "zigzag_ring"
    layout = "zigzag"
    balances_documents = False  # the zigzag layout is what it is
    masks = "any"  # exact for every mask (blocks come from the classifier); balanced for causal
    summary = "p2p ring on the zigzag layout: balanced causal work"
