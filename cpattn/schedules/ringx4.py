"""RingX X4 and X4o: broadcast every kv block, zigzag causal rule, O(local) memory.

Forward, one step per source rank i: i broadcasts its packed kv_i; every rank attends its local
queries to it under the causal mask on the zigzag layout (the X3 rule, given by the classifier: from
i < r all local queries against the first half of kv_i, from i > r the second local half against all
of kv_i, from i = r the causal diagonal) and merges pairwise into its own accumulators. No partial
output travels. Backward is X1's: broadcast kv_i, run the block rule, reduce-sum a zeroed float32
dk_i/dv_i onto i; dq stays local.

Any mask contained in the causal one runs (documents, causal windows, streaming, causal block tables
and predicates): the classifier gives the blocks of each (rank, source) pair on the zigzag layout,
EMPTY ones are skipped and PARTIAL ones run the masked kernel. A source whose kv no other rank's
queries reach computes its own block alone, without a broadcast (``RingX1._owners``); every other
source's broadcast and reduce include all ranks, with or without work.

X4o issues the broadcast of step i+1 before step i's compute (two kv buffers) and waits for the
dk/dv reduce of step i at step i+1.

At world size 1 everything is local. Per rank, for P > 1 under the causal mask: forward P broadcasts (send KV once,
receive (P-1) KV); backward P broadcasts of KV and P reduces (send (P-1) dKV, receive dKV), with KV
the packed kv in the input dtype and dKV the packed float32 dk/dv.
"""

from __future__ import annotations

from ..steps import Problem, Step
from ..topology import Topology
from .ringx1 import RingX1


class RingX4(RingX1):
    name = "ringx4"
    layout = "zigzag"
    causal = True
    bidirectional = False
    summary = "broadcast kv_i, zigzag causal rule, pairwise merge; backward reduce dk/dv onto i"

    def travels(self, phase: str) -> str:
        return "kv"

    def steps(self, problem: Problem, phase: str, topology: Topology | None = None) -> list[Step]:
        """Forward, per source i: broadcast the packed kv_i, every rank r computes pair(r, i) (the
        zigzag block rule) and merges it pairwise; no partial output travels. Backward is X1's. Live
        forward: the stacked local kv, the kv buffers (two with overlap) and the output accumulators."""
        if phase != "forward":
            return self._backward_steps(problem)
        live = (2 + self.overlap) * problem.kv_bytes + problem.acc_bytes
        return self._owner_steps(problem, phase, "pairwise", problem.kv_bytes, live, ())


class RingX4o(RingX4):
    name = "ringx4o"
    memory = "O(local), 2 buffers"
    summary = "X4 pipelined: next kv broadcast in flight during compute, reduces waited one step later"
    overlap = True
