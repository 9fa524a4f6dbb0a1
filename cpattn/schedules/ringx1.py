"""RingX X1 and X1o: ring attention's exchange expressed as broadcasts and reduces (bidirectional).

Forward, one step per owner rank i: i broadcasts its queries q_i; every rank attends q_i to its own
key/value block; the partials are combined onto i by the distributed merge (all-reduce max of lse,
reduce of the numerator and of the denominator). Each rank is owner once, so after P steps every rank
holds its exact output. Backward, one step per owner i: i broadcasts its packed kv_i; every rank runs
the local backward of its own (q, dout, out, lse) against kv_i, adding into its dq (which never
travels) and into a zeroed float32 dk_i/dv_i, which is reduce-summed onto i.

X1o pipelines the same steps with two buffers: the broadcast of step i+1 is in flight during step i's
compute, and the reduces of step i are waited for at step i+1, after its compute.

Which pairs attend comes from the mask classifier (``rt.blocks``): for owner i the forward block is
q_i against kv_r, the backward block q_r against kv_i; EMPTY blocks are skipped, but a rank with
nothing to compute still joins the step's collectives. An owner whose block no other rank has work
for (a document that stays on its rank) computes it alone, before the shared steps, with no
communication (:meth:`RingX1._owners`). Causal masks are rejected (``causal = False``); ``ringx2`` is
the causal form of this exchange.

At world size 1 there is nothing to exchange and the step runs locally. Per rank, for P > 1 and a
mask that shares every owner's step (the full mask), what :meth:`RingX1.steps` declares, with Q
the local queries (input dtype), O and R the bytes of a float32 output ``[b, s, h, d]`` and of one
float32 per query row ``[b, h, s]``, KV the packed local kv (input dtype) and dKV the packed float32
dk/dv: forward P broadcasts (send Q once, receive (P-1) Q), P all-reduces of R (the lse maximum) and
2P reduces (numerator and denominator: send (P-1) (O + R), receive O + R); backward P broadcasts
(send KV once, receive (P-1) KV) and P reduces (send (P-1) dKV, receive dKV).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, partial

import torch

from ..kernels import acc_dtype
from ..merge import merge_into, start_distributed_merge
from ..pairs import PairWork, TriangularPairs, pair_work
from ..steps import CommOp, Problem, Step, Work, area, distribution
from ..topology import Topology
from .base import Runtime, Schedule, attend, attend_backward, new_accumulators

#: per owner i, the kernel calls of every rank in i's step: ``((Work, ranks), ...)``
OwnerWork = Callable[[int], tuple[tuple[Work, int], ...]]
#: per owner i, communication ops of i's step
OwnerOps = Callable[[int], tuple[CommOp, ...]]


def merge_bytes(problem: Problem) -> tuple[int, int, int]:
    """Bytes of the local queries (input dtype), and of the numerator ``[b, s, h, d]`` and the
    denominator ``[b, s, h, 1]`` of a distributed merge (accumulation dtype; the lse maximum is the
    denominator's size)."""
    rows = problem.batch * problem.local_len * problem.heads
    return problem.q_bytes, rows * problem.head_dim * problem.acc_elem, rows * problem.acc_elem


class RingX1(Schedule):
    name = "ringx1"
    layout = "contiguous"
    masks = "any"
    causal = False
    memory = "O(local)"
    summary = "broadcast q_i, distributed merge onto i; backward broadcast kv_i, reduce dk/dv onto i"
    #: issue the next broadcast before this step's compute and wait for this step's reduces one step later
    overlap = False

    def travels(self, phase: str) -> str:
        """What the owner broadcasts in ``phase``: its queries ("q") or its packed kv ("kv")."""
        return "q" if phase == "forward" else "kv"

    def _owners(self, pairs: PairWork, phase: str) -> list[int]:
        """The owners whose step of ``phase`` is shared: some rank other than the owner has work for
        the block it broadcasts (q_i against that rank's kv, or that rank's q against kv_i). A step
        only its owner computes runs locally, without communication; under the causal mask on the
        contiguous layout that is owner 0's forward and owner P-1's backward, under a document or
        window mask every owner whose block no other rank's tokens reach."""
        by = pairs.by_q_rank if self.travels(phase) == "q" else pairs.by_kv_rank
        return [i for i in range(pairs.world) if sum(n for w, n in by(i) if w) > bool(pairs.pair(i, i))]

    def _step_pairs(self, pairs: PairWork, phase: str, i: int) -> tuple[tuple[Work, int], ...]:
        """Over ranks: the work of owner i's step of ``phase`` (q_i against each rank's kv when q
        travels, each rank's q against kv_i when kv does)."""
        return pairs.by_q_rank(i) if self.travels(phase) == "q" else pairs.by_kv_rank(i)

    def _local_first(self, pairs: PairWork, phase: str) -> bool:
        """:meth:`_decide_local_first`, cached per (schedule, pair work, phase)."""
        return _local_first_cached(self, pairs, phase)

    def _decide_local_first(self, pairs: PairWork, phase: str) -> bool:
        """Whether every rank computes its own diagonal block before the shared steps (and skips it in
        its own step). The steps are lock-step, so owner i's step lasts as long as its busiest rank:
        when the diagonal blocks outweigh the rest (a window or short documents on the zigzag layout)
        every step waits for one owner's diagonal, P diagonals one after the other, where computing
        them first takes the time of one. Chosen when it lowers the sum over steps of the busiest
        rank's allowed pairs; never for the causal and full masks, whose layouts balance each step."""
        if pairs.world == 1 or isinstance(pairs, TriangularPairs):  # the causal and full masks
            return False
        owners = self._owners(pairs, phase)
        lockstep = sum(max((area(w) for w, _ in self._step_pairs(pairs, phase, i)), default=0) for i in owners)
        first = max(area(pairs.pair(r, r)) for r in range(pairs.world))
        rest = sum(max((area(w) for w, _ in self._without_owner(pairs, phase, i)), default=0) for i in owners)
        return first + rest < lockstep

    def _without_owner(self, pairs: PairWork, phase: str, i: int) -> tuple[tuple[Work, int], ...]:
        """Owner i's step with the owner's own (diagonal) work taken out."""
        dist = dict(self._step_pairs(pairs, phase, i))
        own = pairs.pair(i, i)
        dist[own] -= 1
        dist[()] = dist.get((), 0) + 1
        return distribution(w for w, n in dist.items() for _ in range(n))

    @staticmethod
    def _run_pairs(rt: Runtime) -> PairWork:
        """The pair work :meth:`steps` reads (:func:`~cpattn.pairs.pair_work` of the padded problem), so
        the run shares exactly the steps the description declares."""
        return pair_work(rt.mask, rt.layout, rt.padded_len, rt.world, rt.seq_len)

    @staticmethod
    def _broadcast(rt: Runtime, mine: torch.Tensor, owners: list[int], n: int):
        """Start broadcasting step ``n``'s tensor from its owner; ``(tensor, handle)``, None past the end."""
        if n >= len(owners):
            return None
        i = owners[n]
        buf = mine if rt.rank == i else rt.comm.new_buffer(mine.shape, mine.dtype, mine.device)
        return buf, rt.comm.broadcast(buf, src=i, async_op=True)

    def forward(self, rt: Runtime, q, k, v):
        r = rt.rank
        pairs = self._run_pairs(rt)
        owners, first = self._owners(pairs, "forward"), self._local_first(pairs, "forward")
        result = new_accumulators(q)
        if first or r not in owners:
            attend(rt, q, k, v, rt.blocks(r, [r]), result)
        incoming = self._broadcast(rt, q, owners, 0)
        merging = None  # (owner, pending distributed merge) of the previous step
        for n, i in enumerate(owners):
            q_i, handle = incoming
            if self.overlap:
                incoming = self._broadcast(rt, q, owners, n + 1)
            handle.wait()
            partial = new_accumulators(q_i)  # stays (0, -inf) where kv_r has nothing for q_i
            if not (first and i == r):
                attend(rt, q_i, k, v, rt.blocks(i, [r]), partial)
            if merging is not None:
                result = self._land(r, merging, result, first)
            merging = (i, start_distributed_merge(partial.out, partial.lse, i, rt.comm))
            if not self.overlap:
                result = self._land(r, merging, result, first)
                merging = None
                incoming = self._broadcast(rt, q, owners, n + 1)
        if merging is not None:
            result = self._land(r, merging, result, first)
        out, lse = result
        return out.to(q.dtype), lse

    @staticmethod
    def _land(rank: int, merging, result, first: bool = False):
        """Wait for a distributed merge; on the owner the merged result replaces ``result`` (fresh
        tensors), or is merged into it when the owner computed its diagonal first."""
        owner, pending = merging
        merged = pending.wait()
        if owner != rank:
            return result
        if first:
            merge_into(*result, *merged)
            return result
        return merged

    def backward(self, rt: Runtime, dout, q, k, v, out, lse):
        r = rt.rank
        acc = acc_dtype(q.dtype)
        kv = torch.stack([k, v])  # one broadcast per step: [2, b, s, h_kv, d]
        pairs = self._run_pairs(rt)
        owners, first = self._owners(pairs, "backward"), self._local_first(pairs, "backward")
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        if first or r not in owners:
            attend_backward(rt, dout, q, k, v, out, lse, rt.blocks(r, [r]), dq, dkv[0], dkv[1])
        incoming = self._broadcast(rt, kv, owners, 0)
        reducing = None  # (owner, buffer, handle) of the previous step's dk/dv reduce
        for n, i in enumerate(owners):
            kv_i, handle = incoming
            if self.overlap:
                incoming = self._broadcast(rt, kv, owners, n + 1)
            handle.wait()
            dkv_i = torch.zeros(kv.shape, dtype=acc, device=q.device)
            if not (first and i == r):
                attend_backward(rt, dout, q, kv_i[0], kv_i[1], out, lse, rt.blocks(r, [i]), dq, dkv_i[0],
                                dkv_i[1])
            if reducing is not None:
                dkv = self._land_reduce(r, reducing, dkv, first)
            reducing = (i, dkv_i, rt.comm.reduce(dkv_i, dst=i, async_op=True))
            if not self.overlap:
                dkv = self._land_reduce(r, reducing, dkv, first)
                reducing = None
                incoming = self._broadcast(rt, kv, owners, n + 1)
        if reducing is not None:
            dkv = self._land_reduce(r, reducing, dkv, first)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)

    @staticmethod
    def _land_reduce(rank: int, reducing, dkv: torch.Tensor, first: bool = False) -> torch.Tensor:
        """Wait for a dk/dv reduce; on its owner the reduced buffer is the result (plus the owner's
        own diagonal gradients when it computed them first)."""
        owner, buf, handle = reducing
        handle.wait()
        if owner != rank:
            return dkv
        return buf.add_(dkv) if first else buf

    # ------------------------------------------------------------------ steps
    def steps(self, problem: Problem, phase: str, topology: Topology | None = None) -> list[Step]:
        """Forward, per owner i: broadcast q_i, every rank r computes pair(i, r), then the lse
        maximum (a blocking all-reduce) and the reduces of the numerator and the denominator onto i.
        Backward: :meth:`_backward_steps`. Live: the q buffers (two with overlap), the running and the
        per-step output accumulators, and the merge's numerator, denominator and maximum (those of
        the previous step too while its reduces are in flight)."""
        if phase != "forward":
            return self._backward_steps(problem)
        q, num, den = merge_bytes(problem)
        live = (1 + self.overlap) * (q + num + 2 * den) + 2 * problem.acc_bytes
        return self._owner_steps(problem, phase, q, self.pairs(problem).by_q_rank,
                                 lambda i: (CommOp("all_reduce", den),),
                                 lambda i: (CommOp("reduce", num, root=i), CommOp("reduce", den, root=i)), live)

    def _backward_steps(self, problem: Problem) -> list[Step]:
        """Per owner i: broadcast the packed kv_i, every rank r computes pair(r, i), reduce the float32
        dk_i/dv_i onto i. Live: the stacked local kv and the kv buffers (two with overlap), dq, the
        dk/dv result and the step's dk_i/dv_i (and the previous step's while its reduce is in flight)."""
        kv, dkv = problem.kv_bytes, problem.dkv_bytes
        live = (2 + self.overlap) * kv + problem.acc_bytes + (2 + self.overlap) * dkv
        return self._owner_steps(problem, "backward", kv, self.pairs(problem).by_kv_rank, lambda i: (),
                                 lambda i: (CommOp("reduce", dkv, root=i),), live)

    def _owner_steps(self, problem: Problem, phase: str, payload: int, work_of: OwnerWork, after: OwnerOps,
                     land: OwnerOps, live: int) -> list[Step]:
        """The steps of ``phase``, as :meth:`forward` / :meth:`backward` run them. Ranks owning a step
        nobody shares first compute their own diagonal, before any communication, and so does every
        rank when :meth:`_local_first` (then an owner has nothing to compute in its own step). Then,
        per owner i:
        the broadcast of ``payload`` bytes from i, the compute ``work_of(i)``, the blocking ops
        ``after(i)`` and the asynchronous ops ``land(i)``. Without overlap each owner's step runs
        all of these one after the other. With overlap the first broadcast runs alone; owner n's
        compute hides the broadcast of owner n+1 and the ``land`` ops of owner n-1, which are waited
        right after it; ``after`` follows the compute; the last ``land`` ops run after the loop.
        ``live``: bytes alive in every step."""
        p, pairs = problem.world, self.pairs(problem)
        owners, first = self._owners(pairs, phase), self._local_first(pairs, phase)
        shared = set(owners)
        steps = []
        if first or len(shared) < p:
            local = distribution(pairs.pair(r, r) if first or r not in shared else () for r in range(p))
            steps.append(Step(local, live_bytes=live))
        if not owners:
            return steps
        if first:
            work_of = partial(self._without_owner, pairs, phase)

        def bcast(i: int) -> tuple[CommOp, ...]:
            return (CommOp("broadcast", payload, root=i),)

        if not self.overlap:
            return steps + [Step(work_of(i), bcast(i) + after(i) + land(i), overlap=False, live_bytes=live)
                            for i in owners]
        steps.append(Step((), bcast(owners[0]), overlap=False, live_bytes=live))
        for n, i in enumerate(owners):
            in_flight = (bcast(owners[n + 1]) if n + 1 < len(owners) else ()) + (land(owners[n - 1]) if n else ())
            steps.append(Step(work_of(i), in_flight, live_bytes=live))
            if after(i):
                steps.append(Step((), after(i), overlap=False, live_bytes=live))
        if land(owners[-1]):
            steps.append(Step((), land(owners[-1]), overlap=False, live_bytes=live))
        return steps


@lru_cache(maxsize=64)
def _local_first_cached(schedule: RingX1, pairs: PairWork, phase: str) -> bool:
    """:meth:`RingX1._decide_local_first`, once per (schedule, pair work, phase): the forward and the
    backward of every call ask (a few milliseconds at 64 ranks)."""
    return schedule._decide_local_first(pairs, phase)


class RingX1o(RingX1):
    name = "ringx1o"
    memory = "O(local), 2 buffers"
    summary = "X1 pipelined: next broadcast in flight during compute, reduces waited one step later"
    overlap = True
