"""Ring attention (point-to-point): key/value blocks travel around the ring.

Forward: P steps; at step t rank r holds the packed kv of rank (r - t) mod P, sends it to r + 1 while
receiving the next from r - 1 (the transfer is in flight during this step's compute), attends its
queries to it under the mask (EMPTY blocks skipped) and merges pairwise.

Backward: kv goes round again; a float32 dk/dv accumulator travels with each kv block, every rank adds
its contribution, and after P hops it is home. The incoming accumulator is waited for only after this
step's block gradients are computed, so its transfer overlaps compute too. dq stays local.

Per rank (P > 1): forward sends and receives (P-1) packed kv; backward (P-1) packed kv plus P float32
dk/dv accumulators (what :meth:`RingSchedule.steps` declares). The steps are the program: the
executor (``cpattn.core.executor``) runs them, so the loop below is data, not code. :func:`ring_steps`
is the ring over any stride of ranks (``usp`` runs it across its Ulysses groups). Any range layout
works (``custom_layout``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import replace

from ..core.steps import Add, Attend, AttendBack, CommOp, Problem, Step, Zeros
from ..core.topology import Topology
from .base import Schedule


def ring_steps(n: int, kv: CommOp, dkv: CommOp, phase: str, live: int,
               source: Callable[[int], Hashable] = lambda t: ("ring", t)) -> list[Step]:
    """The ring on ``n`` ranks, as a program (``cpattn.core.executor``). Forward, step t attends the kv that
    started t places behind (role ``kv{t}``, source ``("ring", t)``) while ``kv{t}`` travels one place
    on as ``kv{t+1}``. Backward, the same kv ring; step t's float32 dk/dv (``dkv{t}``) is sent after
    its compute, travels during step t+1 and is added to the next rank's ``dkv{t+1}``; the last one
    lands after the loop (a step with nothing to overlap) as ``dkv``, home after a full turn.
    ``live``: buffer bytes alive on a rank; ``source(t)``: the block source of step t (``usp``'s ring
    runs between groups of ranks)."""
    def kv_move(t: int) -> tuple[CommOp, ...]:
        return (replace(kv, send=f"kv{t}", recv=f"kv{t + 1}"),) if t < n - 1 else ()

    def grads(t: int) -> str:  # step t's dk/dv (on one rank, already home)
        return "dkv" if n == 1 else f"dkv{t}"

    if phase == "forward":
        return [Step(kv_move(t), live_bytes=live,
                     run=((Zeros("out", "q", output=True),) if t == 0 else ()) + (Attend(f"kv{t}", source(t)),))
                for t in range(n)]
    steps = []
    for t in range(n):
        dkv_move = (replace(dkv, send=grads(t - 1), recv=f"in{t}"),) if t > 0 else ()
        run = ((Zeros("dq", "q"),) if t == 0 else ()) + (Zeros(grads(t), f"kv{t}"),
                                                          AttendBack(f"kv{t}", source(t), grads(t)))
        steps.append(Step(kv_move(t) + dkv_move, live_bytes=live, run=run,
                          after=(Add(grads(t), f"in{t}"),) if t > 0 else ()))
    if n > 1:
        steps.append(Step((replace(dkv, send=grads(n - 1), recv="dkv"),), overlap=False, live_bytes=live))
    return steps


class RingSchedule(Schedule):
    name = "ring"
    layout = "contiguous"
    masks = "any"
    custom_layout = True
    balances_documents = True
    memory = "O(local), 2 kv buffers"
    summary = "p2p ring of kv blocks; dk/dv travel with their kv"

    def steps(self, problem: Problem, phase: str, topology: Topology | None = None) -> list[Step]:
        """Step t attends the kv of rank r - t while the next kv travels (:func:`ring_steps`)."""
        kv, dkv = CommOp("sendrecv", problem.kv_bytes), CommOp("sendrecv", problem.dkv_bytes)
        live = 2 * problem.kv_bytes + problem.acc_bytes  # current and next kv, output accumulators
        if phase != "forward":
            live += 2 * problem.dkv_bytes  # outgoing and incoming dk/dv
        return ring_steps(problem.world, kv, dkv, phase, live)
