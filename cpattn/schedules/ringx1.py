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

from functools import lru_cache, partial

from ..pairs import PairWork, TriangularPairs
from ..steps import Add, Attend, AttendBack, CommOp, Land, LseMax, Problem, Step, Weigh, Work, Zeros, area, distribution
from ..topology import Topology
from .base import Runtime, Schedule


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

    def blocks_of(self, rt: Runtime, src):
        """Sources of the owner steps (see :meth:`_owner_steps`): ``("diag", first, owners)``, this
        rank's diagonal when it goes first or owns no shared step; ``("q_of", i, first)``, owner i's
        queries against this rank's kv; ``("kv_of", i, first)``, this rank's queries against owner i's
        kv; both None on the owner when it computed its diagonal first."""
        r, kind = rt.rank, src[0]
        if kind == "diag":
            _, first, owners = src
            return rt.blocks(r, [r]) if first or r not in owners else None
        if kind in ("q_of", "kv_of"):
            _, i, first = src
            if first and i == r:
                return None
            return rt.blocks(i, [r]) if kind == "q_of" else rt.blocks(r, [i])
        return super().blocks_of(rt, src)

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
        return self._owner_steps(problem, phase, "merge", q, live, (num, den))

    def _backward_steps(self, problem: Problem) -> list[Step]:
        """Per owner i: broadcast the packed kv_i, every rank r computes pair(r, i), reduce the float32
        dk_i/dv_i onto i. Live: the stacked local kv and the kv buffers (two with overlap), dq, the
        dk/dv result and the step's dk_i/dv_i (and the previous step's while its reduce is in flight)."""
        kv, dkv = problem.kv_bytes, problem.dkv_bytes
        live = (2 + self.overlap) * kv + problem.acc_bytes + (2 + self.overlap) * dkv
        return self._owner_steps(problem, "backward", "reduce", kv, live, (dkv,))

    def _owner_steps(self, problem: Problem, phase: str, kind: str, payload: int, live: int,
                     sizes: tuple[int, ...]) -> list[Step]:
        """The steps of ``phase``, the program the executor runs. ``kind``: what an owner step does,
        "merge" (q_i travels; partials merge onto i: X1 and X2 forward), "pairwise" (kv_i travels;
        every rank merges into its own output: X4 forward) or "reduce" (kv_i travels; dk_i/dv_i are
        reduce-summed onto i: backward); ``payload``: the broadcast's bytes; ``sizes``: the merge's
        numerator and denominator bytes, or the dk/dv bytes. Ranks owning a step nobody shares first
        compute their own diagonal, before any communication, and so does every rank when
        :meth:`_local_first` (then an owner has nothing to compute in its own step). Then, per owner
        i: the broadcast from i, the compute, the blocking lse maximum (merge) and the asynchronous
        reduces onto i. Without overlap each owner's step runs these one after the other. With
        overlap the first broadcast runs alone; owner n's compute hides the broadcast of owner n+1
        and the reduces of owner n-1, which are waited (and landed) right after it; the maximum
        follows the compute; the last reduces run after the loop. ``live``: bytes alive in every
        step."""
        p, pairs = problem.world, self.pairs(problem)
        owners, first = self._owners(pairs, phase), self._local_first(pairs, phase)
        shared = set(owners)
        by = pairs.by_q_rank if kind == "merge" else pairs.by_kv_rank
        work_of = partial(self._without_owner, pairs, phase) if first else by
        travel = "q" if kind == "merge" else "kv0"

        def bcast(i: int) -> tuple[CommOp, ...]:
            return (CommOp("broadcast", payload, root=i, send=travel, recv=f"b{i}"),)

        def compute(i: int) -> tuple:
            if kind == "merge":
                return (Zeros(f"p{i}", f"b{i}", output=True),
                        Attend("kv0", ("q_of", i, first), q=f"b{i}", into=f"p{i}"), LseMax(f"p{i}", f"m{i}"))
            if kind == "pairwise":
                return (Attend(f"b{i}", ("kv_of", i, first)),)
            return (Zeros(f"g{i}", "kv0"), AttendBack(f"b{i}", ("kv_of", i, first), f"g{i}"))

        def after(i: int) -> tuple[tuple[CommOp, ...], tuple]:  # blocking ops after the compute, then actions
            if kind != "merge":
                return (), ()
            return ((CommOp("all_reduce", sizes[1], send=f"m{i}", reduce_op="max"),),
                    (Weigh(f"p{i}", f"m{i}", f"num{i}", f"den{i}"),))

        def land(i: int) -> tuple[tuple[CommOp, ...], tuple]:  # asynchronous ops onto i, then actions
            if kind == "merge":
                return ((CommOp("reduce", sizes[0], root=i, send=f"num{i}"),
                         CommOp("reduce", sizes[1], root=i, send=f"den{i}")),
                        (Land(i, f"num{i}", f"den{i}", f"m{i}"),))
            if kind == "reduce":
                return (CommOp("reduce", sizes[0], root=i, send=f"g{i}"),), (Add("dkv", f"g{i}", on=i),)
            return (), ()

        init = (Zeros("out", "q", output=True),) if phase == "forward" else (Zeros("dq", "q"), Zeros("dkv", "kv0"))
        diag = (Attend("kv0", ("diag", first, tuple(owners))) if phase == "forward"
                else AttendBack("kv0", ("diag", first, tuple(owners)), "dkv"))
        steps = []
        if first or len(shared) < p:
            local = distribution(pairs.pair(r, r) if first or r not in shared else () for r in range(p))
            steps.append(Step(local, live_bytes=live, run=init + (diag,)))
            init = ()
        if not owners:
            return steps or [Step((), run=init)]
        if not self.overlap:
            for i in owners:
                steps += [Step((), bcast(i), overlap=False, live_bytes=live, run=init),
                          Step(work_of(i), live_bytes=live, run=compute(i))]
                init = ()
                for ops, actions in (after(i), land(i)):
                    if ops:
                        steps.append(Step((), ops, overlap=False, live_bytes=live, after=actions))
            return steps
        steps.append(Step((), bcast(owners[0]), overlap=False, live_bytes=live, run=init))
        for n, i in enumerate(owners):
            landing = land(owners[n - 1]) if n else ((), ())
            in_flight = (bcast(owners[n + 1]) if n + 1 < len(owners) else ()) + landing[0]
            steps.append(Step(work_of(i), in_flight, live_bytes=live, run=compute(i), after=landing[1]))
            ops, actions = after(i)
            if ops:
                steps.append(Step((), ops, overlap=False, live_bytes=live, after=actions))
        ops, actions = land(owners[-1])
        if ops:
            steps.append(Step((), ops, overlap=False, live_bytes=live, after=actions))
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
