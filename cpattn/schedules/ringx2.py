"""RingX X2 and X2o: X1's broadcasts and reduces under a causal mask (contiguous layout).

Forward, owner i broadcasts q_i; rank r attends it to its own kv_r only when r <= i (r == i with the
causal diagonal); the others contribute lse = -inf and out = 0 to the distributed merge onto i.
Backward, owner i broadcasts kv_i; rank i runs its causal diagonal, ranks r > i the full block, ranks
r < i nothing; dk_i/dv_i are reduce-summed onto i and dq stays where it is (no dq is ever reduced).
These block kinds are what the mask classifier gives on the contiguous layout; the code is X1's.

One step is local: in the forward nobody but rank 0 attends q_0, and in the backward nobody but rank
P-1 attends kv_{P-1}, so those owners neither broadcast nor merge. Per rank, for P > 1, the volume is
X1's with P-1 steps per phase instead of P (rank 0 owns no forward step, rank P-1 no backward step).

X2o pipelines the steps like X1o (double buffers, reduces waited one step later).
"""

from __future__ import annotations

from .ringx1 import RingX1


class RingX2(RingX1):
    name = "ringx2"
    masks = ("causal",)
    causal = True
    bidirectional = False
    summary = "X1 under a causal mask: only ranks r <= i attend q_i; backward reduces dk/dv only"

    def shared(self, world: int, owner: int, phase: str) -> bool:
        if phase == "forward":
            return owner > 0
        return owner < world - 1


class RingX2o(RingX2):
    name = "ringx2o"
    memory = "O(local), 2 buffers"
    summary = "X2 pipelined: next broadcast in flight during compute, reduces waited one step later"
    overlap = True
