"""RingX X1, X2, X4 and their pipelined forms: ring attention's exchange as broadcasts and reduces.

X1 (``ringx1``, bidirectional masks). Forward, one step per owner rank i: i broadcasts its queries
q_i; every rank attends q_i to its own key/value block; the partials are combined onto i by the
distributed merge (all-reduce max of lse, reduce of the numerator and of the denominator). Each rank
is owner once, so after P steps every rank holds its exact output. Backward, one step per owner i: i
broadcasts its packed kv_i; every rank runs the local backward of its own (q, dout, out, lse) against
kv_i, adding into its dq (which never travels) and into a zeroed float32 dk_i/dv_i, which is
reduce-summed onto i.

X2 (``ringx2``): X1 under a mask contained in the causal one (contiguous layout). Rank r attends q_i
only where the mask lets q_i reach kv_r; the others contribute lse = -inf and out = 0 to the merge.
An owner's step is a collective only when some other rank has work for its block; otherwise the
owner computes it alone (under the causal mask owner 0's forward and owner P-1's backward).

X4 (``ringx4``): the owner broadcasts its packed kv_i forward too; every rank attends its local
queries to it under the causal rule of the zigzag layout (given by the classifier) and merges
pairwise into its own accumulators: no partial output travels. Backward is X1's.

The ``o`` forms (``ringx1o``, ``ringx2o``, ``ringx4o``) pipeline the same steps with two buffers:
the broadcast of step i+1 is in flight during step i's compute, and the reduces of step i are waited
for at step i+1, after its compute. These are options of one class, :class:`RingX` (``sends``,
``causal_only``, ``overlap``); the names are aliases.

Which pairs attend comes from the mask classifier; EMPTY blocks are skipped, but a rank with nothing
to compute still joins the step's collectives. Under windows or short documents on the zigzag layout
every rank may compute its own diagonal first (:meth:`RingX._local_first`). The steps are the
program (``cpattn.core.executor`` runs them). At world size 1 everything is local. Per rank, for P > 1
and a mask that shares every owner's step (the full mask), X1 declares, with Q the local queries
(input dtype), O and R the bytes of a float32 output ``[b, s, h, d]`` and of one float32 per query
row ``[b, h, s]``, KV the packed local kv (input dtype) and dKV the packed float32 dk/dv: forward P
broadcasts (send Q once, receive (P-1) Q), P all-reduces of R (the lse maximum) and 2P reduces
(numerator and denominator: send (P-1) (O + R), receive O + R); backward P broadcasts (send KV once,
receive (P-1) KV) and P reduces (send (P-1) dKV, receive dKV).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import memo
from ..core.pairs import PairWork, TriangularPairs
from ..core.steps import (
    Add,
    Attend,
    AttendBack,
    CommOp,
    Land,
    LseMax,
    Problem,
    Step,
    Weigh,
    Work,
    Zeros,
    area,
    distribution,
)
from ..core.topology import Topology
from .base import Schedule


@dataclass(frozen=True, eq=False)
class RingX(Schedule):
    """RingX's broadcast-and-reduce exchange, one class for its variants (their names are aliases):

    ``sends``: what an owner broadcasts forward, ``"q"`` (X1, X2: partials merge onto the owner) or
    ``"kv"`` (X4: every rank merges into its own output; the zigzag layout); ``causal_only``: for
    masks contained in the causal one (X2, X4) or for the others (X1); ``overlap``: the next broadcast in
    flight during this step's compute and this step's reduces waited one step later (the ``o``
    variants: two buffers)."""

    sends: str = "q"
    causal_only: bool = False
    overlap: bool = False
    masks = "any"
    aliases = {"ringx1": {}, "ringx1o": {"overlap": True}, "ringx2": {"causal_only": True},
               "ringx2o": {"causal_only": True, "overlap": True}, "ringx4": {"sends": "kv", "causal_only": True},
               "ringx4o": {"sends": "kv", "causal_only": True, "overlap": True}}

    def __post_init__(self) -> None:
        if self.sends not in ("q", "kv"):
            raise ValueError(f"RingX(sends={self.sends!r}): expected 'q' or 'kv'")
        if self.sends == "kv" and not self.causal_only:
            raise ValueError("RingX(sends='kv') is X4, for causal masks: pass causal_only=True")
        for name in ("causal_only", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RingX({name}={getattr(self, name)!r}): expected a bool")

    @property
    def name(self) -> str:  # type: ignore[override]
        base = "ringx4" if self.sends == "kv" else "ringx2" if self.causal_only else "ringx1"
        return base + ("o" if self.overlap else "")

    @property
    def layout(self) -> str:  # type: ignore[override]
        return "zigzag" if self.sends == "kv" else "contiguous"

    @property
    def causal(self) -> bool:  # type: ignore[override]
        return self.causal_only

    @property
    def bidirectional(self) -> bool:  # type: ignore[override]
        return not self.causal_only

    @property
    def memory(self) -> str:  # type: ignore[override]
        return "O(local), 2 buffers" if self.overlap else "O(local)"

    @property
    def summary(self) -> str:  # type: ignore[override]
        what = {("q", False): "broadcast q_i, distributed merge onto i",
                ("q", True): "X1 under a causal mask: only ranks the mask lets reach q_i attend it",
                ("kv", True): "broadcast kv_i, zigzag causal rule, pairwise merge"}[self.sends, self.causal_only]
        return what + ("; pipelined: next broadcast in flight during compute, reduces waited one step later"
                       if self.overlap else "; backward broadcast kv_i, reduce dk/dv onto i")

    def travels(self, phase: str) -> str:
        """What the owner broadcasts in ``phase``: its queries ("q") or its packed kv ("kv")."""
        return self.sends if phase == "forward" else "kv"

    def _owners(self, pairs: PairWork, phase: str) -> list[int]:
        """The owners whose step of ``phase`` is shared: some rank other than the owner has work for
        the block it broadcasts (q_i against that rank's kv, or that rank's q against kv_i). A step
        only its owner computes runs locally, without communication; under the causal mask on the
        contiguous layout that is owner 0's forward and owner P-1's backward, under a document or
        window mask every owner whose block no other rank's tokens reach."""
        return [i for i in range(pairs.world)
                if sum(n for w, n in self._step_pairs(pairs, phase, i) if w) > bool(pairs.pair(i, i))]

    def _step_pairs(self, pairs: PairWork, phase: str, i: int) -> tuple[tuple[Work, int], ...]:
        """Over ranks: the work of owner i's step of ``phase`` (q_i against each rank's kv when q
        travels, each rank's q against kv_i when kv does)."""
        return pairs.by_q_rank(i) if self.travels(phase) == "q" else pairs.by_kv_rank(i)

    def _local_first(self, pairs: PairWork, phase: str) -> bool:
        """:meth:`_decide_local_first`, kept per (schedule, pair work, phase) in the active
        ``cpattn.core.memo`` scope (a few milliseconds at 64 ranks)."""
        return memo.cached(("local first", self, pairs, phase), lambda: self._decide_local_first(pairs, phase))

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
        rest = sum(max((area(w) for w, _ in _less(self._step_pairs(pairs, phase, i), pairs.pair(i, i))), default=0)
                   for i in owners)  # each owner's step with its own diagonal taken out
        return first + rest < lockstep

    def rank_pairs(self, src, rank: int, world: int) -> list[tuple[int, int]]:
        """Sources of the owner steps (see :meth:`_owner_steps`): ``("diag", first, owners)``, this
        rank's diagonal when it goes first or owns no shared step; ``("q_of", i, first)``, owner i's
        queries against this rank's kv; ``("kv_of", i, first)``, this rank's queries against owner i's
        kv; both none on the owner when it computed its diagonal first."""
        kind = src[0]
        if kind == "diag":
            _, first, owners = src
            return [(rank, rank)] if first or rank not in owners else []
        if kind in ("q_of", "kv_of"):
            _, i, first = src
            if first and i == rank:
                return []
            return [(i, rank)] if kind == "q_of" else [(rank, i)]
        return super().rank_pairs(src, rank, world)

    def work_of(self, problem: Problem, srcs) -> tuple[tuple[Work, int], ...]:
        """An owner step's work in closed form: owner i's queries against every rank's kv
        (``by_q_rank``) or every rank's queries against its kv (``by_kv_rank``), less the owner's own
        diagonal when it went first."""
        if len(srcs) == 1 and srcs[0][0] in ("q_of", "kv_of"):
            kind, i, first = srcs[0]
            pairs = self.pairs(problem)
            dist = (pairs.by_q_rank if kind == "q_of" else pairs.by_kv_rank)(i)
            return _less(dist, pairs.pair(i, i)) if first else dist
        return super().work_of(problem, srcs)

    # ------------------------------------------------------------------ steps
    def steps(self, problem: Problem, phase: str, topology: Topology | None = None) -> list[Step]:
        """Forward, per owner i (``sends="q"``): broadcast q_i, every rank r computes pair(i, r), then
        the lse maximum (a blocking all-reduce) and the reduces of the numerator and the denominator
        onto i. Live: the q buffers (two with overlap), the running and the per-step output
        accumulators, and the merge's numerator, denominator and maximum (those of the previous step
        too while its reduces are in flight). With ``sends="kv"`` (X4): broadcast the packed kv_i,
        every rank r computes pair(r, i) and merges it pairwise; no partial output travels (live: the
        stacked local kv, the kv buffers and the output accumulators). Backward:
        :meth:`_backward_steps`."""
        if phase != "forward":
            return self._backward_steps(problem)
        if self.sends == "kv":
            live = (2 + self.overlap) * problem.kv_bytes + problem.acc_bytes
            return self._owner_steps(problem, phase, "pairwise", problem.kv_bytes, live, ())
        # the distributed merge's numerator [b, s, h, d] and denominator [b, s, h, 1] (accumulation dtype;
        # the lse maximum is the denominator's size)
        rows = problem.batch * problem.local_len * problem.heads
        q, num, den = problem.q_bytes, rows * problem.head_dim * problem.acc_elem, rows * problem.acc_elem
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

        def blocking(ops: tuple[CommOp, ...], actions: tuple) -> list[Step]:  # ops waited for at once, then actions
            return [Step(ops, overlap=False, live_bytes=live, after=actions)] if ops else []

        init = (Zeros("out", "q", output=True),) if phase == "forward" else (Zeros("dq", "q"), Zeros("dkv", "kv0"))
        diag = (Attend("kv0", ("diag", first, tuple(owners))) if phase == "forward"
                else AttendBack("kv0", ("diag", first, tuple(owners)), "dkv"))
        steps = []
        if first or len(owners) < p:
            steps.append(Step(live_bytes=live, run=init + (diag,)))
            init = ()
        if not owners:
            return steps or [Step(run=init)]
        if not self.overlap:
            for i in owners:
                steps += [Step(bcast(i), overlap=False, live_bytes=live, run=init),
                          Step(live_bytes=live, run=compute(i))]
                init = ()
                steps += blocking(*after(i)) + blocking(*land(i))
            return steps
        steps.append(Step(bcast(owners[0]), overlap=False, live_bytes=live, run=init))
        for n, i in enumerate(owners):
            landing = land(owners[n - 1]) if n else ((), ())
            in_flight = (bcast(owners[n + 1]) if n + 1 < len(owners) else ()) + landing[0]
            steps += [Step(in_flight, live_bytes=live, run=compute(i), after=landing[1])] + blocking(*after(i))
        return steps + blocking(*land(owners[-1]))


def _less(dist: tuple[tuple[Work, int], ...], own: Work) -> tuple[tuple[Work, int], ...]:
    """A work distribution with one rank's ``own`` work taken out (that rank then idle)."""
    counts = dict(dist)
    counts[own] -= 1
    counts[()] = counts.get((), 0) + 1
    return distribution(w for w, n in counts.items() for _ in range(n))
