"""RingX X2 and X2o: X1's broadcasts and reduces under a causal mask (contiguous layout).

Forward, owner i broadcasts q_i; rank r attends it to its own kv_r only where the mask lets q_i reach
kv_r (under the causal mask r <= i, r == i with the causal diagonal); the others contribute lse = -inf
and out = 0 to the distributed merge onto i. Backward, owner i broadcasts kv_i; every rank whose
queries reach kv_i runs their backward (under the causal mask rank i its diagonal, ranks r > i the
full block); dk_i/dv_i are reduce-summed onto i and dq stays where it is (no dq is ever reduced).
The code is X1's: the blocks come from the mask classifier, EMPTY ones are skipped, PARTIAL ones
(a document boundary, a window edge) run the masked kernel.

Any mask contained in the causal one (``mask.is_causal``: documents, causal windows, streaming,
causal block tables and predicates) runs. An owner's step is a collective only when some other rank
has work for its block; otherwise the owner computes it alone, without communication. Under the
causal mask that is owner 0's forward step (nobody but rank 0 attends q_0) and owner P-1's backward
step, so per rank, for P > 1, the volume is X1's with P-1 steps per phase instead of P; masks that
cut the sequence into pieces a rank keeps to itself (documents, short windows) skip more steps.
Within a shared step a rank with nothing to compute still joins the broadcast and the merge.

X2o pipelines the steps like X1o (double buffers, reduces waited one step later).
"""

from __future__ import annotations

from .ringx1 import RingX1


class RingX2(RingX1):
    name = "ringx2"
    causal = True
    bidirectional = False
    summary = "X1 under a causal mask: only ranks the mask lets reach q_i attend it; backward reduces dk/dv only"


class RingX2o(RingX2):
    name = "ringx2o"
    memory = "O(local), 2 buffers"
    summary = "X2 pipelined: next broadcast in flight during compute, reduces waited one step later"
    overlap = True
