"""RingX X3 (causal, zigzag) and X3b (bidirectional, contiguous): all-gather kv, reduce-scatter dk/dv.

Forward: an async all-gather of the packed kv is in flight while each rank attends its queries to its
own kv (X3: the causal diagonal of its two zigzag chunks); then, for every source i != r, it attends
to kv_i and merges pairwise. Under the causal mask on the zigzag layout (rank r holds chunks r and
2P-1-r) the classifier yields the balanced rule: from i < r, all local queries against the first
half of kv_i; from i > r, the second local half (chunk 2P-1-r) against all of kv_i. X3 takes any
mask contained in the causal one (documents, causal windows, streaming, ...): the classifier decides
every block, EMPTY ones are skipped, and the two collectives run regardless (any rank may need any
kv). X3b attends every chunk the mask allows, under any mask without ``is_causal``.

This is the ``allgather`` schedule's algorithm (inherited from it) with the two collectives made
hierarchical. Backward: all-gather kv again (the forward keeps only local tensors), overlapped with the local
diagonal's backward; per-source dk/dv go into one zeroed float32 buffer ``[P, 2, b, s, h_kv, d]``
and one reduce-scatter returns each rank its own; dq stays local.

With ``rt.topology`` of several nodes and several devices per node, both collectives run in two
levels (:meth:`~cpattn.comm.Communicator.hierarchical_all_gather`: across nodes along each rail,
then inside the node; reduce-scatter mirrored); the result and the payload per rank are the flat
collective's. Per rank: forward one all-gather of (P-1) packed kv; backward one all-gather of (P-1)
packed kv and one reduce-scatter of (P-1) float32 dk/dv.
"""

from __future__ import annotations

from .allgather import AllGatherSchedule


class RingX3(AllGatherSchedule):
    name = "ringx3"
    layout = "zigzag"
    bidirectional = False
    hierarchical = True
    summary = "all-gather kv (hierarchical with a topology), zigzag causal rule; reduce-scatter dk/dv"

    def layout_for(self, mask) -> str:
        return self.layout


class RingX3b(RingX3):
    name = "ringx3b"
    layout = "contiguous"
    causal = False
    bidirectional = True
    summary = "all-gather kv (hierarchical with a topology), attend every chunk; reduce-scatter dk/dv"
