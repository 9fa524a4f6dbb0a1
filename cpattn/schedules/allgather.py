"""All-gather KV (Llama3 style): every rank gathers the whole key/value sequence once.

Forward: an async all-gather of the packed kv is in flight while each rank attends its queries to its
own kv; then it attends to every other rank's kv under the mask and merges pairwise.
Backward: all-gather kv again (so the forward keeps only local tensors), overlapped with the local
diagonal backward; per-source float32 dk/dv go into one zeroed buffer, and one reduce-scatter returns
each rank its own. Layout: zigzag for causal masks (balanced), contiguous otherwise.

Per rank: forward one all-gather ((P-1) packed kv); backward one all-gather plus one reduce-scatter of
(P-1) float32 dk/dv. The steps are the program (``cpattn.core.executor`` runs them).

RingX X3 (``ringx3``, causal masks on the zigzag layout) and X3b (``ringx3b``, bidirectional masks on
the contiguous layout) are this algorithm with both collectives hierarchical: with a topology of
several nodes and several devices per node they run in two levels
(:meth:`~cpattn.core.comm.Communicator.hierarchical_all_gather`: across nodes along each rail, then inside
the node; reduce-scatter mirrored); the result and the payload per rank are the flat collective's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.steps import OWN, Attend, AttendBack, CommOp, Problem, Step, Zeros
from ..core.topology import Topology
from .base import Schedule


@dataclass(frozen=True, eq=False)
class AllGather(Schedule):
    """All-gather kv, reduce-scatter dk/dv. ``hierarchical``: both collectives in two levels with a
    two-level topology (RingX X3); ``only``: None for any mask (the zigzag layout for causal ones),
    ``"causal"`` (zigzag; ``ringx3``) or ``"bidirectional"`` (contiguous; ``ringx3b``)."""

    hierarchical: bool = False
    only: str | None = None
    masks = "any"
    custom_layout = True
    balances_documents = True
    memory = "O(global kv)"
    aliases = {"allgather": {}, "ringx3": {"hierarchical": True, "only": "causal"},
               "ringx3b": {"hierarchical": True, "only": "bidirectional"}}

    def __post_init__(self) -> None:
        if self.only not in (None, "causal", "bidirectional"):
            raise ValueError(f"AllGather(only={self.only!r}): expected None, 'causal' or 'bidirectional'")
        if not isinstance(self.hierarchical, bool):
            raise ValueError(f"AllGather(hierarchical={self.hierarchical!r}): expected a bool")

    @property
    def name(self) -> str:  # type: ignore[override]
        return {None: "allgather", "causal": "ringx3", "bidirectional": "ringx3b"}[self.only]

    @property
    def layout(self) -> str:  # type: ignore[override]
        return "zigzag" if self.only == "causal" else "contiguous"

    @property
    def causal(self) -> bool:  # type: ignore[override]
        return self.only != "bidirectional"

    @property
    def bidirectional(self) -> bool:  # type: ignore[override]
        return self.only != "causal"

    @property
    def summary(self) -> str:  # type: ignore[override]
        if self.only is None:
            levels = " (hierarchical with a topology)" if self.hierarchical else ""
            return f"all-gather kv{levels}, reduce-scatter dk/dv"
        rule = "zigzag causal rule" if self.only == "causal" else "attend every chunk"
        return f"all-gather kv (hierarchical with a topology), {rule}; reduce-scatter dk/dv"

    def layout_for(self, mask) -> str:
        if self.only is not None:
            return self.layout
        return "zigzag" if mask.is_causal else "contiguous"

    def steps(self, problem: Problem, phase: str, topology: Topology | None = None) -> list[Step]:
        """The local diagonal overlaps the all-gather of the packed kv (role ``kv_all``); then each rank
        attends every other rank's kv (no wait until the end); backward gathers kv again, adds each
        source's dk/dv into its slot of ``dkv_all`` and ends with the reduce-scatter, after all
        compute."""
        p, shape = problem.world, problem
        gather = (CommOp("all_gather", shape.kv_bytes, hierarchical=self.hierarchical, send="kv0", recv="kv_all"),)
        live = (p + 1) * shape.kv_bytes + shape.acc_bytes  # stacked and gathered kv, accumulators
        if phase == "forward":
            return [Step(gather, live_bytes=live,
                         run=(Zeros("out", "q", output=True), Attend("kv0", ("own",)))),
                    Step(live_bytes=live,
                         run=tuple(Attend("kv_all", ("other", j), index=j) for j in range(p)))]
        live += (p + 1) * shape.dkv_bytes  # per-source dk/dv and the reduce-scatter output
        scatter = CommOp("reduce_scatter", shape.dkv_bytes, hierarchical=self.hierarchical, send="dkv_all",
                         recv="dkv")
        return [Step(gather, live_bytes=live,
                     run=(Zeros("dq", "q"), Zeros("dkv_all", "kv0", count=p),
                          AttendBack("kv0", ("own",), "dkv_all", dkv_index=OWN))),
                Step(live_bytes=live,
                     run=tuple(AttendBack("kv_all", ("other", j), "dkv_all", index=j, dkv_index=j) for j in range(p))),
                Step((scatter,), overlap=False, live_bytes=live)]
