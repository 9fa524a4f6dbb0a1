"""``estimate(schedule, problem, topology)``: predicted time, traffic and memory of one schedule (pure).

The schedule declares its steps (``Schedule.steps``); each step is timed by its busiest rank:

    compute  = max over the step's per-rank Work of  sum(calls * Device.kernel_time(kernel))
               (ranks sharing CPU cores: processor sharing of those times, :func:`shared_compute`)
    comm     = sum of op_time(op) over the step's ops (they share the links), split into the part in
               flight (m) and the part that runs at the wait (w; the second level of a hierarchical
               collective, see ``collectives.op_times``)
    duration = compute + m - overlap * min(compute, m) + w   if the ops overlap the compute
             = compute + m + w                               otherwise

with ``overlap`` the topology's hidden fraction (1 on GPUs). The call takes the sum of its steps'
durations (steps are separated by waits, so the slowest rank sets the pace of each). Traffic is the
busiest rank's payload (``cpattn.core.comm`` units) from the steps' ops, and the busiest rank's wire bytes
(``cpattn.core.steps.wire``: what it sends, forwarding included, under the algorithm
``collectives.algorithm`` resolves for each op); memory is the resident inputs and outputs plus the
largest ``live_bytes`` of any step.

A schedule that plans (``Schedule.make_plan``: ``ultra``) is estimated from its plan instead
(:func:`plan_estimate`: what the plan predicts, ``cpattn.core.program.Prediction``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from .. import schedules
from ..core import memo
from ..core.kernels import DTYPES
from ..core.masks import CausalMask, FullMask, Mask
from ..core.program import Plan
from ..core.steps import CommOp, Problem, Step, group_size, split_phase, wire
from ..core.topology import Topology
from ..schedules.base import Schedule
from .collectives import algorithm, op_times


@dataclass(frozen=True)
class Estimate:
    """Prediction for one call. ``total``, ``compute``, ``comm``, ``exposed_comm``: seconds (compute and
    comm summed over steps on the busiest rank; exposed_comm = total - compute, the part of comm not
    hidden). ``bytes_per_rank``: payload bytes sent by the busiest rank (``cpattn.core.comm`` accounting).
    ``peak_memory``: bytes per rank. ``flops``: attention FLOPs of the whole problem (allowed pairs
    only). ``wire_bytes_per_rank``: bytes the busiest rank sends on the wire, forwarding for others
    included, under the topology's collective algorithms (``cpattn.core.steps.wire``): the payload for
    point-to-point traffic, all-gathers, reduce-scatters and reduces, more where broadcasts are
    forwarded; a tree all-reduce sends about 2 N per rank where the ring sends 2 (P-1) N / P.
    ``merge`` and ``launch``: the parts of ``compute`` spent in kernel epilogues (merging a block's
    result into the accumulators) and in per-call launch overheads (seconds; the rest of ``compute``
    is the kernels' FLOPs at their rates); a schedule that plans leaves them 0 (its plan's compute
    includes its merges)."""

    total: float
    compute: float
    comm: float
    exposed_comm: float
    bytes_per_rank: int
    peak_memory: int
    schedule: str = ""
    phase: str = "forward+backward"
    flops: float = 0.0
    wire_bytes_per_rank: int = 0
    merge: float = 0.0
    launch: float = 0.0

    def terms(self) -> dict[str, float]:
        """The estimate's additive terms (seconds): ``kernels`` (FLOPs at the kernel rates), ``merge``,
        ``launch`` and ``exposed_comm``; they sum to ``total``."""
        return {"kernels": self.compute - self.merge - self.launch, "merge": self.merge, "launch": self.launch,
                "exposed_comm": self.exposed_comm}

    def tflops_per_rank(self, world: int) -> float:
        """Achieved attention TFLOP/s per rank (FLOPs / total / world / 1e12)."""
        return self.flops / self.total / world / 1e12 if self.total > 0 else float("nan")


def declares_steps(schedule: Schedule | str) -> bool:
    """Whether ``schedule`` implements ``steps``."""
    return type(schedules.resolve(schedule)).steps is not Schedule.steps


def estimable(schedule: Schedule | str) -> bool:
    """Whether :func:`estimate` can predict ``schedule``: it declares ``steps`` or makes plans."""
    sched = schedules.resolve(schedule)
    return declares_steps(sched) or sched.make_plan is not None


def default_candidates(mask: Mask) -> list[str]:
    """The registered schedules "auto" estimates for ``mask``, in registry order: all of them, except
    those that plan (``ultra``) for the causal and full masks, where making a plan would add seconds
    to every new problem size (tens of seconds at 64 ranks and 512K tokens) and the balanced rings
    already spread the work evenly."""
    dense = isinstance(mask, (CausalMask, FullMask))
    return [n for n in schedules.names() if not (dense and schedules.get(n).make_plan is not None)]


def plan_estimate(plan: Plan, problem: Problem, phase: str, name: str) -> Estimate:
    """The estimate of a plan for ``problem``: per phase its :class:`~cpattn.core.program.Prediction`
    (``total``: its makespan; ``compute`` and ``comm``: the busiest rank's; a plan may also wait on
    dependencies, so total can exceed compute + comm), summed; ``peak_memory``: the resident tensors
    plus the most buffers a rank holds. A plan's transfers are point-to-point: nothing is forwarded,
    so the wire bytes are the payload."""
    total = compute = comm = 0.0
    sent = peak = 0
    for ph in split_phase(phase):
        p = plan.predict(problem, ph)
        total, compute, comm, sent = total + p.total, compute + p.compute, comm + p.comm, sent + p.bytes_sent
        peak = max(peak, resident_bytes(problem, ph) + p.buffer_bytes)
    return Estimate(total, compute, comm, total - compute, sent, peak, name, phase, problem.flops(phase),
                    wire_bytes_per_rank=sent)


def resident_bytes(problem: Problem, phase: str) -> int:
    """Inputs and outputs a rank holds whatever the schedule (bytes): q, k, v, out and lse forward;
    plus dout, dq, dk, dv backward."""
    b, s, d, e = problem.batch, problem.local_len, problem.head_dim, problem.elem
    q, kv, lse = b * s * problem.heads * d * e, b * s * problem.kv_heads * d * e, 4 * b * problem.heads * s
    forward = 2 * q + 2 * kv + lse
    return forward if phase == "forward" else forward + 2 * q + 2 * kv


def busiest_bytes_sent(steps: list[Step], topology: Topology) -> int:
    """Bytes sent by the rank that sends most over ``steps`` (``cpattn.core.comm`` accounting)."""
    base = 0
    extra: dict[int, int] = defaultdict(int)
    for st in steps:
        for op in st.comm:
            size = group_size(op.group, topology.world, topology)
            other = sum(v[1] for v in op.accounting(-1, size).values())  # a rank that is not the root
            base += other
            if op.op in ("broadcast", "reduce"):
                extra[op.root] += sum(v[1] for v in op.accounting(op.root, size).values()) - other
    most = max(extra.values(), default=0)
    if len(extra) < topology.world:  # some rank is never a root
        most = max(most, 0)
    return base + most


def busiest_wire_sent(steps: list[Step], topology: Topology) -> int:
    """Bytes sent on the wire by the rank that sends most over ``steps``: each op counted per rank by
    ``cpattn.core.steps.wire`` under the algorithm the cost model resolves for it on ``topology``."""
    per_rank = sum((wire_by_rank(op, topology) for st in steps for op in st.comm), np.zeros(topology.world, np.int64))
    return int(per_rank.max(initial=0))


def wire_by_rank(op: CommOp, topology: Topology) -> np.ndarray:
    """``[world]`` bytes each rank sends on the wire for ``op`` (every node runs a "node" op, every
    rail a "rail" op)."""
    g = group_size(op.group, topology.world, topology)
    kinds = ("send", "recv") if op.op == "sendrecv" else (op.op,)
    by_group_rank = np.roll(_wire_from_root_0(kinds, op.bytes, g, algorithm(op, topology)), op.root)
    if op.group == "node":
        return np.tile(by_group_rank, topology.world // g)
    if op.group == "rail":
        return np.repeat(by_group_rank, topology.world // g)
    return by_group_rank


def _wire_from_root_0(kinds: tuple[str, ...], nbytes: int, size: int, algo: str) -> np.ndarray:
    """Wire bytes of group ranks ``0 .. size-1`` for one op of ``kinds`` with root 0 (rolled by the
    caller to any other root: every algorithm here is relative to the root); read-only, kept in the
    active ``cpattn.core.memo`` scope."""
    def build() -> np.ndarray:
        out = np.array([sum(wire(k, nbytes, size, r, 0, algo) for k in kinds) for r in range(size)], dtype=np.int64)
        out.flags.writeable = False
        return out
    return memo.cached(("wire from root 0", kinds, nbytes, size, algo), build)


@memo.scoped
def estimate(schedule: Schedule | str, problem: Problem, topology: Topology,
             phase: str = "forward+backward", plan: Plan | None = None) -> Estimate:
    """Predict ``schedule`` (a name or a Schedule) on ``problem`` over ``topology`` for ``phase``
    ("forward", "backward" or "forward+backward"): its steps on ``topology``, timed; a schedule that
    plans from its plan (:func:`plan_estimate`: ``plan``, else the one it makes, kept in the active
    memo scope; making a plan is deterministic). Raises NotImplementedError when the schedule has
    neither, ValueError when it cannot run the problem."""
    sched = schedules.resolve(schedule)
    if not estimable(sched):
        raise NotImplementedError(
            f"schedule {sched.name!r} does not implement steps(problem, phase, topology), so the cost model cannot "
            "estimate it; see cpattn.core.steps for what a schedule must declare")
    if topology.world != problem.world:
        raise ValueError(f"topology has {topology.world} ranks ({topology.nodes} x {topology.devices_per_node}) "
                         f"but the problem has world={problem.world}")
    sched.check_mask(problem.mask)
    problem.layout_or(sched.layout_for(problem.mask)).check(problem.padded_len, problem.world)
    split_phase(phase)
    if sched.make_plan is not None:
        if plan is None:
            plan = memo.cached(("plan", sched, problem, topology), lambda: sched.make_plan(problem, topology))
        return plan_estimate(plan, problem, phase, sched.name)
    device = topology.device
    times: dict = {}
    total = compute = comm = merge = launch = 0.0
    sent, wired, peak = 0, 0, 0
    for ph in split_phase(phase):
        steps = sched.program(problem, ph, topology)
        for st in steps:
            per_rank, parts = [], []
            for w, ranks in st.work:
                t = epilogue = calls_n = 0.0
                for kernel, calls in w:
                    key = (kernel, ph)
                    if key not in times:
                        times[key] = device.kernel_time(kernel, problem, ph)
                    t += calls * times[key]
                    epilogue += calls * kernel.epilogue_bytes(problem, ph) / device.memory_bandwidth
                    calls_n += calls
                per_rank.append((t, ranks))
                parts.append((t, epilogue, calls_n * device.launch))
            c = shared_compute(per_rank, topology)
            busiest = max(parts, default=(0.0, 0.0, 0.0))
            if busiest[0] > 0:  # the busiest rank's split, scaled to the step's (shared-core) compute time
                merge += c * busiest[1] / busiest[0]
                launch += c * busiest[2] / busiest[0]
            split = [op_times(op, topology) for op in st.comm]
            m, blocking = sum(t for t, _ in split), sum(t for _, t in split)
            total += c + m - (topology.overlap * min(c, m) if st.overlap else 0.0) + blocking
            compute += c
            comm += m + blocking
        sent += busiest_bytes_sent(steps, topology)
        wired += busiest_wire_sent(steps, topology)
        peak = max(peak, resident_bytes(problem, ph) + max((st.live_bytes for st in steps), default=0))
    return Estimate(total, compute, comm, total - compute, sent, peak, sched.name, phase, problem.flops(phase),
                    wired, merge, launch)


def shared_compute(per_rank: list[tuple[float, int]], topology: Topology) -> float:
    """Compute time of a step whose ranks need ``per_rank`` (``(seconds, ranks)``: seconds at the
    device's rates, which hold when every rank computes). With a device per rank it is the busiest
    rank's. When the ranks share ``topology.cores`` it is processor sharing: the busy ranks split the
    cores (each at most ``threads_per_rank``), and as ranks finish the others speed up."""
    busiest = max((t for t, _ in per_rank), default=0.0)
    if topology.cores <= 0 or busiest <= 0:
        return busiest
    full = topology.core_share(topology.world)  # cores per rank that the device's rates assume
    elapsed = done = 0.0  # seconds so far; core-seconds each still-busy rank has done
    busy = sum(n for t, n in per_rank if t > 0)
    for t, n in sorted((t, n) for t, n in per_rank if t > 0):
        elapsed += (t * full - done) / topology.core_share(busy)
        done = t * full
        busy -= n
    return elapsed


#: how :func:`rank_schedules` words an exclusion for memory (``choose`` recognises it)
_OVER_MEMORY = "needs "


def check_supports(schedule: Schedule | str, problem: Problem) -> None:
    """Raise (ValueError / TypeError / NotImplementedError) unless ``schedule`` can run ``problem``:
    mask, layout split, shape and dtype (its own checks, on meta tensors), and a model (:func:`estimable`)."""
    sched = schedules.resolve(schedule)
    sched.check_mask(problem.mask)
    problem.layout_or(sched.layout_for(problem.mask)).check(problem.padded_len, problem.world)
    dtype = DTYPES[problem.dtype]
    b, s, d = problem.batch, problem.local_len, problem.head_dim
    q = torch.empty((b, s, problem.heads, d), dtype=dtype, device="meta")
    k = torch.empty((b, s, problem.kv_heads, d), dtype=dtype, device="meta")
    sched.check_shape(q, k, problem.world)
    if not estimable(sched):
        raise NotImplementedError(f"schedule {sched.name!r} does not implement steps(problem, phase, topology)")


@memo.scoped
def rank_schedules(problem: Problem, topology: Topology, names: list[str] | None = None,
                   phase: str = "forward+backward") -> list[tuple[str, Estimate | str]]:
    """Every candidate (default: :func:`default_candidates` of the problem's mask, in registry order)
    with its :class:`Estimate`, or the reason it cannot be used (unsupported, or over the device
    memory). Feasible ones come first, fastest first; ties keep registry order."""
    feasible: list[tuple[str, Estimate]] = []
    excluded: list[tuple[str, str]] = []
    for name in names if names is not None else default_candidates(problem.mask):
        try:
            check_supports(name, problem)
            est = estimate(name, problem, topology, phase)
        except (ValueError, TypeError, NotImplementedError) as exc:
            excluded.append((name, str(exc)))
            continue
        if est.peak_memory > topology.device.memory:
            excluded.append((name, f"{_OVER_MEMORY}{est.peak_memory / 2**30:.1f} GiB per rank, the device has "
                                   f"{topology.device.memory / 2**30:.1f} GiB"))
            continue
        feasible.append((name, est))
    feasible.sort(key=lambda item: item[1].total)  # stable: registry order breaks ties
    return [*feasible, *excluded]


@memo.scoped
def choose(problem: Problem, topology: Topology, names: list[str] | None = None,
           nominal_shape: bool = False) -> tuple[str, str]:
    """``(name, why)`` of the fastest feasible schedule for ``problem`` (forward + backward).
    Deterministic: the same inputs give the same choice on every rank, with no communication.

    ``nominal_shape``: the problem's heads and head dim are a stand-in (``schedule="auto"`` picks before
    it sees q, k, v), so when every supporting schedule is over the device memory only for that
    shape, the one needing the least memory per rank is chosen (and ``why`` says so) instead of
    raising: the real shape may well fit."""
    ranked = rank_schedules(problem, topology, names)
    if (not ranked or not isinstance(ranked[0][1], Estimate)) and nominal_shape:
        over = [n for n, r in ranked if isinstance(r, str) and r.startswith(_OVER_MEMORY)]
        if over:
            est, best = min(((estimate(n, problem, topology), n) for n in over),
                            key=lambda item: (item[0].peak_memory, item[0].total))
            return best, (f"no schedule fits {topology.device.memory / 2**30:.1f} GiB per rank for the nominal "
                          f"shape (S={problem.seq_len}, P={problem.world}, h={problem.heads}, d={problem.head_dim}); "
                          f"{best} needs the least ({est.peak_memory / 2**30:.1f} GiB)")
    if not ranked or not isinstance(ranked[0][1], Estimate):
        reasons = "; ".join(f"{n}: {r}" for n, r in ranked)
        raise ValueError(f"no registered schedule can run this problem ({reasons})")
    best, est = ranked[0]
    others = ", ".join(f"{n} {e.total * 1e3:.3g} ms" if isinstance(e, Estimate) else f"{n} excluded ({e})"
                       for n, e in ranked[1:])
    why = (f"lowest predicted forward+backward time {est.total * 1e3:.3g} ms on topology {topology.name!r} "
           f"(S={problem.seq_len}, P={problem.world}, mask {problem.mask.name}); others: {others}")
    return best, why


__all__ = ["Estimate", "busiest_bytes_sent", "busiest_wire_sent", "check_supports", "choose", "declares_steps",
           "default_candidates", "estimable", "estimate", "plan_estimate", "rank_schedules", "resident_bytes",
           "shared_compute", "wire_by_rank"]
