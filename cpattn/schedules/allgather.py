"""All-gather KV (Llama3 style): every rank gathers the whole key/value sequence once.

Forward: an async all-gather of the packed kv is in flight while each rank attends its queries to its
own kv; then it attends to every other rank's kv under the mask and merges pairwise.
Backward: all-gather kv again (so the forward keeps only local tensors), overlapped with the local
diagonal backward; per-source float32 dk/dv go into one zeroed buffer, and one reduce-scatter returns
each rank its own. Layout: zigzag for causal masks (balanced), contiguous otherwise.

Per rank: forward one all-gather ((P-1) packed kv); backward one all-gather plus one reduce-scatter of
(P-1) float32 dk/dv.
"""

from __future__ import annotations

import torch

from ..kernels import acc_dtype
from ..steps import CommOp, Problem, Step
from ..topology import Topology
from .base import Runtime, Schedule, attend, attend_backward, new_accumulators


class AllGatherSchedule(Schedule):
    name = "allgather"
    layout = "contiguous"  # "zigzag" when the mask is causal: see layout_for
    masks = "any"
    custom_layout = True
    memory = "O(global kv)"
    summary = "all-gather kv, reduce-scatter dk/dv"

    def layout_for(self, mask) -> str:
        return "zigzag" if mask.is_causal else "contiguous"

    def _gather(self, rt: Runtime, kv: torch.Tensor):
        """Start gathering every rank's packed kv: ``([P, 2, b, s, h_kv, d], handle)``."""
        gathered = rt.comm.new_buffer((rt.world, *kv.shape), kv.dtype, kv.device)
        topology = rt.topology if self.hierarchical else None
        return gathered, rt.comm.hierarchical_all_gather(gathered, kv, topology, async_op=True)

    def forward(self, rt: Runtime, q, k, v):
        p, r = rt.world, rt.rank
        acc = new_accumulators(q)
        kv = torch.stack([k, v])
        gathered, handle = self._gather(rt, kv)
        attend(rt, q, k, v, rt.blocks(r, [r]), acc)
        handle.wait()
        for j in range(p):
            if j != r:
                attend(rt, q, gathered[j, 0], gathered[j, 1], rt.blocks(r, [j]), acc)
        return acc.out.to(q.dtype), acc.lse

    def backward(self, rt: Runtime, dout, q, k, v, out, lse):
        p, r = rt.world, rt.rank
        acc = acc_dtype(q.dtype)
        kv = torch.stack([k, v])
        gathered, handle = self._gather(rt, kv)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv_all = torch.zeros((p, *kv.shape), dtype=acc, device=q.device)
        attend_backward(rt, dout, q, k, v, out, lse, rt.blocks(r, [r]), dq, dkv_all[r, 0], dkv_all[r, 1])
        handle.wait()
        for j in range(p):
            if j != r:
                attend_backward(rt, dout, q, gathered[j, 0], gathered[j, 1], out, lse, rt.blocks(r, [j]),
                                dq, dkv_all[j, 0], dkv_all[j, 1])
        dkv = rt.comm.new_buffer(kv.shape, acc, q.device)
        rt.comm.hierarchical_reduce_scatter(dkv, dkv_all, rt.topology if self.hierarchical else None)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)

    def steps(self, problem: Problem, phase: str, topology: Topology | None = None) -> list[Step]:
        """The local diagonal overlaps the all-gather; then each rank attends every other rank's kv
        (no wait until the end); backward ends with the reduce-scatter, after all compute."""
        p, shape, pairs = problem.world, problem, self.pairs(problem)
        gather = (CommOp("all_gather", shape.kv_bytes, hierarchical=self.hierarchical),)
        live = (p + 1) * shape.kv_bytes + shape.acc_bytes  # stacked and gathered kv, accumulators
        if phase == "forward":
            return [Step(pairs.by_offset(0), gather, live_bytes=live), Step(pairs.remote_rows(), live_bytes=live)]
        live += (p + 1) * shape.dkv_bytes  # per-source dk/dv and the reduce-scatter output
        return [Step(pairs.by_offset(0), gather, live_bytes=live), Step(pairs.remote_rows(), live_bytes=live),
                Step((), (CommOp("reduce_scatter", shape.dkv_bytes, hierarchical=self.hierarchical),), overlap=False,
                     live_bytes=live)]
