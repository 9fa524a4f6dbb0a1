"""``cpattn calibrate``: measure this machine and build a :class:`~cpattn.cost.profile.Profile`.

Runs on a local gloo world (2 ranks by default, sharing the cores as ``cpattn bench`` does):

- local kernels (``cpattn.kernels`` forward and backward; FULL, CAUSAL and PARTIAL blocks) at a few
  square block sizes, on every rank at once, giving FLOP/s versus block size;
- the merge epilogue, giving an effective memory bandwidth (bytes/s);
- every communication op at a few message sizes (``sendrecv``, all-gather, reduce-scatter, broadcast,
  reduce, all-reduce, all-to-all), each fitted to its cost formula (``cpattn.cost.collectives``) as a
  per-op link (alpha seconds, bandwidth bytes/s);
- how much of a transfer hides behind a concurrent kernel (``overlap``).

Times are medians over repetitions of the slowest rank.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from ..core import kernels
from ..core.comm import Communicator
from ..core.masks import BlockKind
from ..core.merge import merge_into
from ..core.steps import CommOp, Kernel, Problem
from ..core.topology import Link, RatePoint, Topology
from ..cost.collectives import op_time
from ..cost.presets import LOCAL_ALGORITHM
from ..cost.profile import Profile
from ..launcher import LocalWorld, RankError

CALIBRATED_OPS = ("sendrecv", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_reduce", "all_to_all")


@dataclass(frozen=True)
class Settings:
    """What to measure. ``sizes``: square block sides (tokens) for FULL/CAUSAL kernels;
    ``partial_sizes``: for PARTIAL ones; ``stacked_sizes``: sides of small FULL/CAUSAL pieces timed
    ``stacked_rows // n`` at a time in one stacked call (as the executor runs the pieces of a cover:
    short documents, band tiles), each point the per-piece rate; ``message_bytes``: message sizes
    (bytes); ``reps``: timed repetitions per point (after one warm-up), ``small_kernel_reps`` for
    kernels of at most ``512 x 512`` pairs and stacked pieces (a few milliseconds each, so one busy
    moment of the other rank moved a median of 3 by 30%), ``comm_reps`` for the collectives (a median
    of 3 moved a fitted bandwidth by up to 37% between two calibrations a second apart); a timed sample
    of a kernel or the merge repeats the call to span at least ``min_sample`` seconds. The kernel shape is
    ``[batch, n, heads, head_dim]`` with ``kv_heads`` key/value heads in ``dtype``; blocks larger than
    ``large_side`` run on fewer heads (:func:`kernel_heads`). The sizes reach the blocks that runs use
    (a rank's whole shard at 8K-16K tokens on 2 ranks, ``ulysses``' whole sequence): a causal block
    gains rate with size (its diagonal tiles waste less), and the rate of the largest measured block
    is what every larger one gets."""

    sizes: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
    partial_sizes: tuple[int, ...] = (256, 512)
    stacked_sizes: tuple[int, ...] = (4, 16, 64)
    stacked_rows: int = 2048
    message_bytes: tuple[int, ...] = (1 << 16, 1 << 20, 1 << 22, 1 << 24)
    reps: int = 5
    small_kernel_reps: int = 15
    comm_reps: int = 9
    min_sample: float = 0.02
    batch: int = 1
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float32"
    ranks: int = 2
    large_side: int = 2048


QUICK = Settings(sizes=(64, 128), partial_sizes=(64,), stacked_sizes=(16,), stacked_rows=64,
                 message_bytes=(1 << 12, 1 << 16), reps=1, small_kernel_reps=1, comm_reps=1, min_sample=0.0)


def _median_time(fn: Callable[[], object], reps: int, barrier: Callable[[], None], comm=None,
                 min_sample: float = 0.0) -> float:
    """Median seconds of one ``fn()`` over ``reps`` samples, each after ``barrier()``, after one warm-up.
    With ``comm`` and ``min_sample`` (seconds), a sample repeats ``fn`` as many times as the ranks agree
    it takes to span ``min_sample`` (the most any rank needs), so a call of a millisecond is not timed
    alone (one busy moment of the other rank moved such medians by 20-40% between calibrations)."""
    t0 = time.perf_counter()
    fn()  # warm-up
    calls = 1
    if comm is not None and min_sample > 0:
        need = torch.tensor([math.ceil(min_sample / max(time.perf_counter() - t0, 1e-9))], dtype=torch.float64)
        comm.all_reduce(need, op="max")
        calls = max(1, int(need.item()))
    times = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _comm():

    return Communicator()


def _inputs(s: Settings, n: int):

    g = torch.Generator().manual_seed(n)
    dt = kernels.DTYPES[s.dtype]
    q = torch.randn(s.batch, n, s.heads, s.head_dim, generator=g).to(dt)
    k = torch.randn(s.batch, n, s.kv_heads, s.head_dim, generator=g).to(dt)
    v = torch.randn(s.batch, n, s.kv_heads, s.head_dim, generator=g).to(dt)
    return q, k, v


def kernel_heads(s: Settings, n: int) -> tuple[int, int]:
    """(query heads, kv heads) of the calibration kernel of side ``n``: the settings' up to
    ``s.large_side``; above it fewer (at least 1), in proportion to ``(large_side / n)^2``, so that a
    call of a large block costs about what one of ``large_side`` does (a rate is per FLOP, and a
    CPU kernel's rate per head does not depend on the head count)."""
    if n <= s.large_side:
        return s.heads, s.kv_heads
    shrink = (n / s.large_side) ** 2
    kv = max(1, round(s.kv_heads / shrink))
    heads = max(kv, round(s.heads / shrink) // kv * kv)
    return heads, kv


def rank_kernels(settings: dict, kind: str, n: int, pieces: int = 1) -> dict[str, float]:
    """On every rank: median seconds of one forward and one backward ``kind`` kernel of side ``n``
    (on :func:`kernel_heads` heads), or of one stacked call of ``pieces`` such blocks
    (``kernels.forward_stacked``) when ``pieces > 1``."""

    s = Settings(**settings)
    heads, kv_heads = kernel_heads(s, n)
    s = replace(s, heads=heads, kv_heads=kv_heads)
    comm = _comm()
    q, k, v = _inputs(replace(s, batch=s.batch * pieces), n)
    block = BlockKind(kind)
    mask = None
    if block == BlockKind.PARTIAL:  # a band: every row attends a window around its diagonal
        idx = torch.arange(n)
        mask = (idx[:, None] - idx[None, :]).abs() < max(1, n // 4)
    scale = kernels.default_scale(s.head_dim)
    if pieces > 1:
        def fwd_call():
            return kernels.forward_stacked(q, k, v, block, scale, pieces)

        def bwd_call():
            return kernels.backward_stacked(dout, q, k, v, out, lse, block, scale, pieces)
    else:
        def fwd_call():
            return kernels.forward(q, k, v, block, scale, mask)

        def bwd_call():
            return kernels.backward(dout, q, k, v, out, lse, block, scale, mask)
    out, lse = fwd_call()
    out = out.to(q.dtype)
    dout = torch.randn_like(q)
    reps = s.small_kernel_reps if pieces > 1 or n <= 512 else s.reps
    fwd = _median_time(fwd_call, reps, comm.barrier, comm, s.min_sample)
    bwd = _median_time(bwd_call, reps, comm.barrier, comm, s.min_sample)
    return {"forward": fwd, "backward": bwd}


def rank_merge(settings: dict, n: int) -> float:
    """On every rank: median seconds of one pairwise merge of ``n`` query rows."""

    s = Settings(**settings)
    comm = _comm()
    g = torch.Generator().manual_seed(1)
    out = torch.randn(s.batch, n, s.heads, s.head_dim, generator=g)
    lse = torch.randn(s.batch, s.heads, n, generator=g)
    o2, l2 = torch.randn_like(out), torch.randn_like(lse)
    return _median_time(lambda: merge_into(out, lse, o2, l2), s.small_kernel_reps, comm.barrier, comm, s.min_sample)


def _run_op(comm, op: str, nbytes: int) -> Callable[[], None]:
    p, r = comm.world_size, comm.rank
    n = max(1, nbytes // 4)
    t = torch.randn(n)
    if op == "sendrecv":
        buf = torch.empty(n)
        return lambda: comm.send_recv([(t, (r + 1) % p)], [(buf, (r - 1) % p)]).wait()
    if op == "all_gather":
        out = torch.empty(p * n)
        return lambda: comm.all_gather(out, t)
    if op == "reduce_scatter":
        big = torch.randn(p * n)
        return lambda: comm.reduce_scatter(t, big)
    if op == "broadcast":
        return lambda: comm.broadcast(t, src=0)
    if op == "reduce":
        return lambda: comm.reduce(t, dst=0)
    if op == "all_reduce":
        return lambda: comm.all_reduce(t)
    big = torch.randn(p * n)
    out = torch.empty(p * n)
    return lambda: comm.all_to_all(out, big)


def rank_collective(settings: dict, op: str, nbytes: int) -> float:
    """On every rank: median seconds of ``op`` with a message of ``nbytes`` (see ``CommOp.bytes``)."""
    s = Settings(**settings)
    comm = _comm()
    return _median_time(_run_op(comm, op, nbytes), s.comm_reps, comm.barrier)


def rank_overlap(settings: dict, n: int, nbytes: int) -> dict[str, float]:
    """On every rank: seconds of a forward FULL kernel of side ``n``, of a ``sendrecv`` of ``nbytes``,
    and of both at once (the transfer issued before the kernel, waited after it)."""

    s = Settings(**settings)
    comm = _comm()
    q, k, v = _inputs(s, n)
    scale = kernels.default_scale(s.head_dim)
    p, r = comm.world_size, comm.rank
    t = torch.randn(max(1, nbytes // 4))
    buf = torch.empty_like(t)

    def kernel() -> None:
        kernels.forward(q, k, v, BlockKind.FULL, scale)

    def transfer():
        return comm.send_recv([(t, (r + 1) % p)], [(buf, (r - 1) % p)])

    def both() -> None:
        handle = transfer()
        kernel()
        handle.wait()

    return {"compute": _median_time(kernel, s.reps, comm.barrier),
            "comm": _median_time(lambda: transfer().wait(), s.reps, comm.barrier),
            "both": _median_time(both, s.reps, comm.barrier)}


def fit_link(op: str, ranks: int, points: list[tuple[int, float]]) -> Link:
    """Fit ``seconds = a * alpha + x / bandwidth`` to ``(bytes, seconds)`` points, where a and x are
    what :func:`~cpattn.cost.collectives.op_time` charges ``op`` on ``ranks`` ranks of one node under
    the algorithms the ``local`` topology prices with (:data:`~cpattn.cost.presets.LOCAL_ALGORITHM`)
    (least squares; alpha >= 0)."""
    unit_latency = Topology(1, ranks, intra=Link(1.0, 1e300), algorithm=LOCAL_ALGORITHM)
    unit_bytes = Topology(1, ranks, intra=Link(0.0, 1.0), algorithm=LOCAL_ALGORITHM)
    a = np.array([op_time(CommOp(op, b), unit_latency) for b, _ in points])
    x = np.array([op_time(CommOp(op, b), unit_bytes) for b, _ in points])
    t = np.array([sec for _, sec in points])
    (alpha, inv_bw), *_ = np.linalg.lstsq(np.stack([a, x], axis=1), t, rcond=None)
    if alpha < 0:
        alpha, inv_bw = 0.0, float(x @ t / (x @ x))
    if inv_bw <= 0:  # latency-bound at every size: take the bandwidth the largest message saw
        inv_bw = float(t[-1] / x[-1])
    return Link(float(alpha), 1.0 / float(inv_bw))


class Interference:
    """How much of the machine other processes used while calibration measured: CPU seconds of the
    whole machine minus those of this process and its children, over the wall time and the cores
    (0 = nothing else ran, 1 = every core busy with other work), and the 1-minute load average at the
    start. Call :meth:`start` once the measuring processes exist and :meth:`stop` before they exit."""

    #: the share of the cores other work may take before :attr:`busy` says the machine was busy
    LIMIT = 0.1

    def __init__(self) -> None:
        self.load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        self.share = float("nan")

    @staticmethod
    def _cpu() -> tuple[float, float, float]:
        import psutil

        me = psutil.Process()
        own = 0.0
        for proc in [me, *me.children(recursive=True)]:
            try:
                t = proc.cpu_times()
            except psutil.Error:  # a child that just exited
                continue
            own += t.user + t.system
        total = psutil.cpu_times()
        return time.perf_counter(), total.user + total.system + getattr(total, "nice", 0.0), own

    def start(self) -> None:
        self._t0 = self._cpu()

    def stop(self) -> None:
        (w0, all0, own0), (w1, all1, own1) = self._t0, self._cpu()
        cores = os.cpu_count() or 1
        self.share = max(0.0, ((all1 - all0) - (own1 - own0)) / max(1e-9, (w1 - w0) * cores))

    @property
    def busy(self) -> bool:
        return self.share > self.LIMIT

    def warning(self) -> str | None:
        """A sentence for the user when other work took more than :attr:`LIMIT` of the cores."""
        if not self.busy:
            return None
        return (f"the machine was busy while calibration measured: other processes used {self.share:.0%} of the "
                f"cores (load average {self.load_before:.2f} at the start); the rates are low and predictions will "
                "be high: calibrate again on an idle machine")


def calibrate(settings: Settings = Settings(), progress: Callable[[str, int, int], None] | None = None,
              timeout: float = 300.0, interference: Interference | None = None) -> Profile:
    """Measure this machine on a ``settings.ranks``-rank local world and return a :class:`Profile`.
    ``progress(what, done, total)`` is called before each measurement and once at the end.
    ``interference`` (an :class:`Interference`) measures what other processes took meanwhile; its
    figures also go to the profile's ``host`` (``load_before``, ``interference``)."""
    import psutil

    watch = interference or Interference()

    say = progress or (lambda what, done, total: None)
    cores = os.cpu_count() or 1
    threads = max(1, cores // settings.ranks)
    cfg = asdict(settings)
    kernel_jobs = [(kind, n, 1) for kind in ("full", "causal") for n in settings.sizes]
    kernel_jobs += [(kind, n, max(1, settings.stacked_rows // n)) for kind in ("full", "causal")
                    for n in settings.stacked_sizes]
    kernel_jobs += [("partial", n, 1) for n in settings.partial_sizes]
    comm_jobs = [(op, b) for op in CALIBRATED_OPS for b in settings.message_bytes]
    total = len(kernel_jobs) + 1 + len(comm_jobs) + 1
    done = 0

    def checked(results: list) -> list:
        errors = [r for r in results if isinstance(r, RankError)]
        if errors:
            raise RuntimeError(f"calibration failed: {errors[0]}")
        return results

    problem = Problem(settings.ranks * max(settings.sizes), settings.ranks, "full", settings.batch, settings.heads,
                      settings.kv_heads, settings.head_dim, settings.dtype)
    points: list[RatePoint] = []
    with LocalWorld(settings.ranks, threads=threads) as w:
        watch.start()
        for kind, n, pieces in kernel_jobs:
            say(f"kernel {kind} {n}x{n}" + (f" x {pieces} stacked" if pieces > 1 else ""), done, total)
            res = checked(w.run(rank_kernels, timeout=timeout, settings=cfg, kind=kind, n=n, pieces=pieces))
            heads, kv_heads = kernel_heads(settings, n)
            kernel = Kernel(kind, n, n, n * (n + 1) // 2 if kind == "causal" else n * n, heads, kv_heads)
            for phase in ("forward", "backward"):
                seconds = max(r[phase] for r in res)  # per piece: the rate of one block of a stacked call
                points.append(RatePoint(phase, kind, n, n, pieces * kernel.flops(problem, phase) / seconds))
            done += 1
        merge_n = min(max(settings.sizes), settings.large_side)
        say("merge epilogue", done, total)
        merge_s = max(checked(w.run(rank_merge, timeout=timeout, settings=cfg, n=merge_n)))
        memory_bandwidth = Kernel("full", merge_n, merge_n, 0).epilogue_bytes(problem, "forward") / merge_s
        done += 1
        measured: dict[str, list[tuple[int, float]]] = {op: [] for op in CALIBRATED_OPS}
        for op, nbytes in comm_jobs:
            say(f"{op} {nbytes / 2**20:.3g} MiB", done, total)
            measured[op].append((nbytes, max(checked(w.run(rank_collective, timeout=timeout, settings=cfg, op=op,
                                                            nbytes=nbytes)))))
            done += 1
        say("overlap of a transfer and a kernel", done, total)
        overlap_n = min(settings.sizes[len(settings.sizes) // 2], settings.large_side)
        ov = checked(w.run(rank_overlap, timeout=timeout, settings=cfg, n=overlap_n,
                           nbytes=max(settings.message_bytes)))
        tc, tm, tb = (max(r[key] for r in ov) for key in ("compute", "comm", "both"))
        overlap = min(1.0, max(0.0, (tc + tm - tb) / min(tc, tm)))
        done += 1
        watch.stop()
    say("done", done, total)
    links = {op: fit_link(op, settings.ranks, pts) for op, pts in measured.items()}
    host = {"torch": torch.__version__, "platform": platform.platform(), "machine": platform.machine(),
            "kernel_shape": f"b={settings.batch} h={settings.heads}:{settings.kv_heads} d={settings.head_dim} "
                            f"{settings.dtype}",
            "load_before": f"{watch.load_before:.2f}", "interference": f"{watch.share:.3f}"}
    return Profile(tuple(points), links, memory_bandwidth, overlap, cores, settings.ranks, threads,
                   int(psutil.virtual_memory().total), host)


def rates(profile: Profile) -> dict[str, float]:
    """Every figure of ``profile`` the estimates use, by name: kernel rates (FLOP/s, ``"forward causal
    2048x2048"``), per-op link bandwidths (bytes/s, ``"sendrecv bandwidth"``) and latencies (seconds,
    ``"sendrecv latency"``), ``"memory bandwidth"`` (bytes/s) and ``"overlap"`` (a fraction)."""
    out = {f"{p.phase} {p.kind} {p.q_len}x{p.kv_len}": p.flop_per_s for p in profile.kernels}
    for op, link in profile.links.items():
        out[f"{op} bandwidth"] = link.bandwidth
        out[f"{op} latency"] = link.latency
    out["memory bandwidth"] = profile.memory_bandwidth
    out["overlap"] = profile.overlap
    return out


def is_rate(name: str) -> bool:
    """Whether the figure ``name`` (see :func:`rates`) is a rate, compared between calibrations by its
    relative difference; latencies (a few to hundreds of microseconds, often fitted to 0) and the
    overlap fraction are compared by their absolute difference."""
    return not (name.endswith(" latency") or name == "overlap")


def spread(profiles: list[Profile]) -> dict[str, tuple[float, float, float]]:
    """``{figure: (smallest, largest, difference)}`` over ``profiles`` for every figure of :func:`rates`
    they all have; the difference is ``largest / smallest - 1`` for a rate (:func:`is_rate`) and
    ``largest - smallest`` otherwise."""
    each = [rates(p) for p in profiles]
    out = {}
    for name in each[0]:
        values = [r[name] for r in each if name in r]
        if len(values) != len(each):
            continue
        lo, hi = min(values), max(values)
        out[name] = (lo, hi, (hi / lo - 1.0 if lo > 0 else float("inf")) if is_rate(name) else hi - lo)
    return out


def combine(profiles: list[Profile]) -> Profile:
    """One profile from several calibrations of the same machine: the median of each figure (kernel
    rates, link latency and bandwidth, memory bandwidth, overlap); the rest from the last."""
    last = profiles[-1]
    med = statistics.median
    kernels = tuple(replace(p, flop_per_s=med(q.flop_per_s for prof in profiles for q in prof.kernels
                                              if (q.phase, q.kind, q.q_len, q.kv_len) == (p.phase, p.kind, p.q_len,
                                                                                            p.kv_len)))
                    for p in last.kernels)
    links = {op: Link(med(pr.links[op].latency for pr in profiles), med(pr.links[op].bandwidth for pr in profiles))
             for op in last.links}
    return replace(last, kernels=kernels, links=links,
                   memory_bandwidth=med(p.memory_bandwidth for p in profiles),
                   overlap=med(p.overlap for p in profiles))


__all__ = ["CALIBRATED_OPS", "QUICK", "Interference", "Settings", "calibrate", "combine", "fit_link", "is_rate",
           "kernel_heads", "rates", "spread"]
