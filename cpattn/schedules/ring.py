"""Ring attention (point-to-point): key/value blocks travel around the ring.

Forward: P steps; at step t rank r holds the packed kv of rank (r - t) mod P, sends it to r + 1 while
receiving the next from r - 1 (the transfer is in flight during this step's compute), attends its
queries to it under the mask (EMPTY blocks skipped) and merges pairwise.

Backward: kv goes round again; a float32 dk/dv accumulator travels with each kv block, every rank adds
its contribution, and after P hops it is home. The incoming accumulator is waited for only after this
step's block gradients are computed, so its transfer overlaps compute too. dq stays local.

Per rank (P > 1): forward sends and receives (P-1) packed kv; backward (P-1) packed kv plus P float32
dk/dv accumulators (what :meth:`RingSchedule.steps` declares). ``ring_forward`` / ``ring_backward``
run the same ring over any list of ranks (``usp`` runs it across its Ulysses groups). Any range layout
works (``custom_layout``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..blocks import Block
from ..kernels import acc_dtype
from ..steps import CommOp, Problem, Step, Work
from ..topology import Topology
from .base import Runtime, Schedule, attend, attend_backward, new_accumulators

TAG_KV, TAG_DKV = 0, 1


def ring_forward(rt: Runtime, q: torch.Tensor, kv: torch.Tensor, ring: list[int],
                 blocks_of: Callable[[int], list[Block]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward ring over the group ranks ``ring`` (this rank among them): packed ``kv [2, b, s, h_kv,
    d]`` moves one place along the ring per step; at step t this rank attends ``q`` to the kv that
    started t places behind it, with blocks ``blocks_of(t)``. Returns the float32 (out, lse)
    accumulators."""
    comm, n, i = rt.comm, len(ring), ring.index(rt.rank)
    nxt_rank, prv_rank = ring[(i + 1) % n], ring[(i - 1) % n]
    acc = new_accumulators(q)
    cur = kv  # one message per step
    for t in range(n):
        if t < n - 1:
            nxt = comm.new_buffer(cur.shape, cur.dtype, cur.device)
            handle = comm.send_recv([(cur, nxt_rank)], [(nxt, prv_rank)], tag=TAG_KV)
        attend(rt, q, cur[0], cur[1], blocks_of(t), acc)
        if t < n - 1:
            handle.wait()
            cur = nxt
    return acc.out, acc.lse


def ring_backward(rt: Runtime, dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, ring: list[int], blocks_of: Callable[[int], list[Block]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward ring matching :func:`ring_forward`; returns float32 ``dq`` and this rank's packed
    ``dkv [2, b, s, h_kv, d]`` (home after a full turn)."""
    comm, n, i = rt.comm, len(ring), ring.index(rt.rank)
    nxt_rank, prv_rank = ring[(i + 1) % n], ring[(i - 1) % n]
    dq = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
    cur = kv
    incoming = None  # (handle, buffer) of the dk/dv accumulator arriving from the previous rank
    for t in range(n):
        if t < n - 1:
            nxt = comm.new_buffer(cur.shape, cur.dtype, cur.device)
            kv_handle = comm.send_recv([(cur, nxt_rank)], [(nxt, prv_rank)], tag=TAG_KV)
        local = torch.zeros(cur.shape, dtype=dq.dtype, device=q.device)
        attend_backward(rt, dout, q, cur[0], cur[1], out, lse, blocks_of(t), dq, local[0], local[1])
        if incoming is not None:
            incoming[0].wait()
            local += incoming[1]
        if n > 1:
            buf = comm.new_buffer(local.shape, local.dtype, local.device)
            incoming = (comm.send_recv([(local, nxt_rank)], [(buf, prv_rank)], tag=TAG_DKV), buf)
        if t < n - 1:
            kv_handle.wait()
            cur = nxt
    if incoming is not None:
        incoming[0].wait()
        local = incoming[1]
    return dq, local


def ring_steps(n: int, work_at: Callable[[int], tuple[tuple[Work, int], ...]], kv: CommOp, dkv: CommOp, phase: str,
               live: int) -> list[Step]:
    """The cost-model steps of :func:`ring_forward` / :func:`ring_backward` on a ring of ``n`` ranks: step
    t runs ``work_at(t)`` (a distribution over every rank) while the next ``kv`` travels. Backward, the
    ``dkv`` accumulator sent after step t's compute travels during step t+1; the last one lands after the
    loop (a step with nothing to overlap). ``live``: buffer bytes alive on a rank."""
    if phase == "forward":
        return [Step(work_at(t), (kv,) if t < n - 1 else (), live_bytes=live) for t in range(n)]
    steps = [Step(work_at(t), ((kv,) if t < n - 1 else ()) + ((dkv,) if t > 0 else ()), live_bytes=live)
             for t in range(n)]
    if n > 1:
        steps.append(Step((), (dkv,), overlap=False, live_bytes=live))
    return steps


class RingSchedule(Schedule):
    name = "ring"
    layout = "contiguous"
    masks = "any"
    custom_layout = True
    memory = "O(local), 2 kv buffers"
    summary = "p2p ring of kv blocks; dk/dv travel with their kv"

    def forward(self, rt: Runtime, q, k, v):
        p, r = rt.world, rt.rank
        out_acc, lse_acc = ring_forward(rt, q, torch.stack([k, v]), list(range(p)),
                                        lambda t: rt.blocks(r, [(r - t) % p]))
        return out_acc.to(q.dtype), lse_acc

    def backward(self, rt: Runtime, dout, q, k, v, out, lse):
        p, r = rt.world, rt.rank
        dq, dkv = ring_backward(rt, dout, q, torch.stack([k, v]), out, lse, list(range(p)),
                                lambda t: rt.blocks(r, [(r - t) % p]))
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)

    def steps(self, problem: Problem, phase: str, topology: Topology | None = None) -> list[Step]:
        """Step t attends the kv of rank r - t while the next kv travels (:func:`ring_steps`)."""
        kv, dkv = CommOp("sendrecv", problem.kv_bytes), CommOp("sendrecv", problem.dkv_bytes)
        live = 2 * problem.kv_bytes + problem.acc_bytes  # current and next kv, output accumulators
        if phase != "forward":
            live += 2 * problem.dkv_bytes  # outgoing and incoming dk/dv
        return ring_steps(problem.world, self.pairs(problem).by_offset, kv, dkv, phase, live)
