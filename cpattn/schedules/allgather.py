"""All-gather KV (Llama3 style): every rank gathers the whole key/value sequence once.

Forward: an async all-gather of the packed kv is in flight while each rank attends its queries to its
own kv; then it attends to every other rank's kv under the mask and merges pairwise.
Backward: all-gather kv again (so the forward keeps only local tensors), overlapped with the local
diagonal backward; per-source float32 dk/dv go into one zeroed buffer, and one reduce-scatter returns
each rank its own. Layout: zigzag for causal masks (balanced), contiguous otherwise.

Per rank: forward one all-gather ((P-1) packed kv); backward one all-gather plus one reduce-scatter of
(P-1) float32 dk/dv. The steps are the program (``cpattn.executor`` runs them).
"""

from __future__ import annotations

from ..steps import OWN, Attend, AttendBack, CommOp, Problem, Step, Zeros
from ..topology import Topology
from .base import Schedule


class AllGatherSchedule(Schedule):
    name = "allgather"
    layout = "contiguous"  # "zigzag" when the mask is causal: see layout_for
    masks = "any"
    custom_layout = True
    memory = "O(global kv)"
    summary = "all-gather kv, reduce-scatter dk/dv"

    def layout_for(self, mask) -> str:
        return "zigzag" if mask.is_causal else "contiguous"

    def steps(self, problem: Problem, phase: str, topology: Topology | None = None) -> list[Step]:
        """The local diagonal overlaps the all-gather of the packed kv (role ``kv_all``); then each rank
        attends every other rank's kv (no wait until the end); backward gathers kv again, adds each
        source's dk/dv into its slot of ``dkv_all`` and ends with the reduce-scatter, after all
        compute."""
        p, shape, pairs = problem.world, problem, self.pairs(problem)
        gather = (CommOp("all_gather", shape.kv_bytes, hierarchical=self.hierarchical, send="kv0", recv="kv_all"),)
        live = (p + 1) * shape.kv_bytes + shape.acc_bytes  # stacked and gathered kv, accumulators
        if phase == "forward":
            return [Step(pairs.by_offset(0), gather, live_bytes=live,
                         run=(Zeros("out", "q", output=True), Attend("kv0", ("own",)))),
                    Step(pairs.remote_rows(), live_bytes=live,
                         run=tuple(Attend("kv_all", ("other", j), index=j) for j in range(p)))]
        live += (p + 1) * shape.dkv_bytes  # per-source dk/dv and the reduce-scatter output
        scatter = CommOp("reduce_scatter", shape.dkv_bytes, hierarchical=self.hierarchical, send="dkv_all",
                         recv="dkv")
        return [Step(pairs.by_offset(0), gather, live_bytes=live,
                     run=(Zeros("dq", "q"), Zeros("dkv_all", "kv0", count=p),
                          AttendBack("kv0", ("own",), "dkv_all", dkv_index=OWN))),
                Step(pairs.remote_rows(), live_bytes=live,
                     run=tuple(AttendBack("kv_all", ("other", j), "dkv_all", index=j, dkv_index=j) for j in range(p))),
                Step((), (scatter,), overlap=False, live_bytes=live)]
