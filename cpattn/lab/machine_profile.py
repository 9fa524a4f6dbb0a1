"""``cpattn calibrate``: measure this machine and build a :class:`~cpattn.cost.profile.Profile`.

Runs on a local gloo world (2 ranks by default, sharing the cores as ``cpattn bench`` does):

- local kernels (``cpattn.kernels`` forward and backward; FULL, CAUSAL and PARTIAL blocks) at a few
  square block sizes, on every rank at once, giving FLOP/s versus block size;
- the merge epilogue, giving an effective memory bandwidth (bytes/s);
- every communication op at a few message sizes (``sendrecv``, all-gather, reduce-scatter, broadcast,
  reduce, all-reduce, all-to-all), each fitted to its cost formula (``cpattn.cost.collectives``) as a
  per-op link (alpha seconds, bandwidth bytes/s);
- how much of a transfer hides behind a concurrent kernel (``overlap``).

Every figure is the median, over passes that each time everything once, of the slowest rank.

On a GPU (:func:`calibrate_gpu`) it measures one device at world size 1 instead: the forward and backward
of FULL and CAUSAL square blocks on the kernel path the dispatch takes (``kernels.kernel_for``), timed by
CUDA events, and the merge epilogue's bandwidth, into a GPU profile (``cost.profile.GpuInfo``). The
device and the timer are arguments, so the same code runs on the CPU with a stand-in timer in the tests.

Why one module over 500 lines: each measurement's loop and the profile field it fills sit side
by side, so a profile's figures can be traced to the code that timed them.
"""

from __future__ import annotations

import datetime
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
from ..cost.profile import GpuInfo, Profile, extrapolate_below, from_json
from ..launcher import LocalWorld, RankError
from ..timed_calls import block_inputs, kernel_calls, shape_of, square_kernel
from ..version import __version__

CALIBRATED_OPS = ("sendrecv", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_reduce", "all_to_all")


@dataclass(frozen=True)
class Settings:
    """What to measure. ``sizes``: square block sides (tokens) for FULL/CAUSAL kernels; ``partial_sizes``: for
    PARTIAL ones; ``stacked_sizes``: sides of small FULL/CAUSAL pieces timed ``stacked_rows // n`` at a time in
    one stacked call (as the executor runs the pieces of a cover: short documents, band tiles), each point the
    per-piece rate; ``message_bytes``: message sizes (bytes). Every figure is the median of its samples over
    ``passes`` passes: each pass times every kernel, the merge, every collective and the overlap probe once
    (:func:`probes`; the small kernels ``small_samples`` times, the merge, collectives and overlap probe
    ``comm_samples`` times), so the samples of one figure are spread over the whole calibration rather than
    bunched in a second (a shared machine's speed drifts by +-7% from one second to the next, the same on both
    ranks, and a figure timed in one burst carried that drift: two calibrations differed by up to 26% on a
    kernel rate and 22% on a bandwidth). A sample repeats its call to span at least ``min_sample`` seconds. The
    kernel shape is ``[batch, n, heads, head_dim]`` with ``kv_heads`` key/value heads in ``dtype``; every block
    runs on all of them, the large ones too: with both ranks busy, a backward of 8192 x 8192 on 8:2 heads ran
    7% below one on 1:1 heads, which an earlier calibration (large blocks on fewer heads) had priced every
    run's large blocks at. Blocks larger than ``large_side`` (seconds per call, the steadiest figures) are
    timed in every ``large_every``-th pass. The sizes reach the blocks that runs use (a rank's whole shard at
    8K-16K tokens on 2 ranks, ``ulysses``' whole sequence): a causal block gains rate with size (its diagonal
    tiles waste less), and the rate of the largest measured block is what every larger one gets."""

    sizes: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
    partial_sizes: tuple[int, ...] = (256, 512)
    stacked_sizes: tuple[int, ...] = (4, 16, 64)
    stacked_rows: int = 2048
    message_bytes: tuple[int, ...] = (1 << 16, 1 << 20, 1 << 22, 1 << 24)
    passes: int = 11
    small_samples: int = 3
    comm_samples: int = 4
    min_sample: float = 0.03
    batch: int = 1
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float32"
    ranks: int = 2
    large_side: int = 2048
    large_every: int = 2


QUICK = Settings(sizes=(64, 128), partial_sizes=(64,), stacked_sizes=(16,), stacked_rows=64,
                 message_bytes=(1 << 12, 1 << 16), passes=1, small_samples=1, comm_samples=1, min_sample=0.0)


def kernel_jobs(s: Settings) -> list[tuple[str, int, int]]:
    """``(kind, side, pieces)`` of every kernel calibration times: FULL and CAUSAL blocks of each size,
    stacked small pieces (``pieces > 1``), PARTIAL blocks."""
    jobs = [(kind, n, 1) for kind in ("full", "causal") for n in s.sizes]
    jobs += [(kind, n, max(1, s.stacked_rows // n)) for kind in ("full", "causal") for n in s.stacked_sizes]
    return jobs + [("partial", n, 1) for n in s.partial_sizes]


def _merge_call(s, n: int, device: torch.device | str = "cpu") -> Callable[[], object]:
    """One pairwise merge of ``n`` query rows (``s``: settings with ``batch``, ``heads``, ``head_dim``) of
    float32 accumulators on ``device``."""
    g = torch.Generator().manual_seed(1)
    out = torch.randn(s.batch, n, s.heads, s.head_dim, generator=g).to(device)
    lse = torch.randn(s.batch, s.heads, n, generator=g).to(device)
    o2, l2 = torch.randn_like(out), torch.randn_like(lse)
    return lambda: merge_into(out, lse, o2, l2)


def _op_call(comm, op: str, nbytes: int) -> Callable[[], None]:
    """One ``op`` with a message of ``nbytes`` (see ``CommOp.bytes``), waited."""
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


def _overlap_calls(comm, s: Settings, n: int, nbytes: int) -> dict[str, Callable[[], object]]:
    """A forward FULL kernel of side ``n``, a ``sendrecv`` of ``nbytes``, and both at once (the transfer
    issued before the kernel, waited after it)."""
    q, k, v = block_inputs(n, **shape_of(s))
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

    return {"compute": kernel, "comm": lambda: transfer().wait(), "both": both}


def probes(s: Settings, index: int = 0) -> list[tuple]:
    """The keys of everything pass ``index`` times, in order: ``("kernel", kind, side, pieces, phase)``,
    ``("merge", rows)``, ``("op", name, bytes)``, ``("overlap", part)``. Kernels larger than
    ``large_side`` (a second or more per call, and the steadiest figures) come in every
    ``large_every``-th pass only; the small kernels (at most ``512 x 512``, stacked pieces)
    ``small_samples`` times a pass; the merge, the collectives and the overlap probe (memory-bound, and
    noisier) ``comm_samples`` times; each repetition after all the others of its group."""
    kernel_keys = [("kernel", kind, n, pieces, phase) for kind, n, pieces in kernel_jobs(s)
                   for phase in ("forward", "backward") if n <= s.large_side or index % s.large_every == 0]
    small = [key for key in kernel_keys if key[3] > 1 or key[2] <= 512]
    memory = [("merge", max(s.sizes))]
    memory += [("op", op, b) for op in CALIBRATED_OPS for b in s.message_bytes]
    memory += [("overlap", part) for part in ("compute", "comm", "both")]
    return kernel_keys + small * (s.small_samples - 1) + memory * s.comm_samples


#: this rank's calls and how many of each make a sample, set by :func:`rank_prepare`
_PREPARED: dict[str, object] = {}


def rank_prepare(settings: dict) -> int:
    """On every rank: build the call of every :func:`probes` key, warm each up once, and agree with
    the other ranks how many calls make a sample of at least ``min_sample`` seconds (the most any rank
    needs). Returns the number of probes."""
    s = Settings(**settings)
    comm = Communicator()
    calls: dict[tuple, Callable[[], object]] = {}
    built = {job: kernel_calls(*job, **shape_of(s)) for job in kernel_jobs(s)}
    overlap_n = min(s.sizes[len(s.sizes) // 2], 2048)
    overlap = _overlap_calls(comm, s, overlap_n, max(s.message_bytes))
    every = [probes(s, i) for i in range(min(s.passes, s.large_every))]
    for key in dict.fromkeys(key for keys in every for key in keys):
        if key[0] == "kernel":
            calls[key] = built[key[1:4]][key[4]]
        elif key[0] == "merge":
            calls[key] = _merge_call(s, key[1])
        elif key[0] == "op":
            calls[key] = _op_call(comm, key[1], key[2])
        else:
            calls[key] = overlap[key[1]]
    need = []
    for fn in calls.values():
        comm.barrier()
        t0 = time.perf_counter()
        fn()  # warm-up
        need.append(math.ceil(s.min_sample / max(time.perf_counter() - t0, 1e-9)))
    agreed = torch.tensor(need, dtype=torch.float64)
    comm.all_reduce(agreed, op="max")
    repeat = {key: max(1, int(c)) for key, c in zip(calls, agreed.tolist(), strict=True)}
    _PREPARED.update(comm=comm, calls=calls, repeat=repeat, settings=s)
    return len(calls)


def sample(fn: Callable[[], object], calls: int, barrier: Callable[[], None]) -> float:
    """Seconds of one ``fn()``: ``calls`` calls timed together after ``barrier()``, over ``calls``."""
    barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def rank_pass(index: int) -> list[float]:
    """On every rank: one sample of every probe of pass ``index`` (:func:`probes`), in order (seconds
    per call)."""
    comm, calls, repeat = _PREPARED["comm"], _PREPARED["calls"], _PREPARED["repeat"]
    return [sample(calls[key], repeat[key], comm.barrier) for key in probes(_PREPARED["settings"], index)]


def rank_release() -> None:
    """On every rank: drop what :func:`rank_prepare` built."""
    _PREPARED.clear()


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


def pass_speeds(per_pass: list[list[tuple[tuple, float]]], seconds: dict[tuple, float]) -> list[float]:
    """The machine's speed in each pass against the calibration as a whole: per pass, the median over
    its samples of ``seconds[key] / sample`` (above 1: that pass ran faster than the figures' medians).
    Their range is the drift the calibration saw; two calibrations can differ by as much."""
    return [statistics.median(seconds[key] / s for key, s in samples if s > 0) for samples in per_pass if samples]


def calibrate(settings: Settings = Settings(), progress: Callable[[str, int, int], None] | None = None,
              timeout: float = 300.0, interference: Interference | None = None) -> Profile:
    """Measure this machine on a ``settings.ranks``-rank local world and return a :class:`Profile`.
    ``progress(what, done, total)`` is called before each pass and once at the end.
    ``interference`` (an :class:`Interference`) measures what other processes took meanwhile; its
    figures also go to the profile's ``host`` (``load_before``, ``interference``)."""
    import psutil

    watch = interference or Interference()
    say = progress or (lambda what, done, total: None)
    cores = os.cpu_count() or 1
    threads = max(1, cores // settings.ranks)
    total = settings.passes + 1

    def checked(results: list) -> list:
        errors = [r for r in results if isinstance(r, RankError)]
        if errors:
            raise RuntimeError(f"calibration failed: {errors[0]}")
        return results

    samples: dict[tuple, list[float]] = {}
    per_pass: list[list[tuple[tuple, float]]] = []
    with LocalWorld(settings.ranks, threads=threads) as w:
        watch.start()
        say("building and warming up every kernel and collective", 0, total)
        checked(w.run(rank_prepare, timeout=timeout, settings=asdict(settings)))
        for i in range(settings.passes):
            keys = probes(settings, i)
            say(f"pass {i + 1}/{settings.passes}: {len(keys)} kernels, merges and collectives", i + 1, total)
            res = checked(w.run(rank_pass, timeout=timeout, index=i))
            per_pass.append([(key, max(r[j] for r in res)) for j, key in enumerate(keys)])  # the slowest rank
            for key, seconds in per_pass[-1]:
                samples.setdefault(key, []).append(seconds)
        checked(w.run(rank_release, timeout=timeout))
        watch.stop()
    say("done", total, total)
    seconds = {key: statistics.median(v) for key, v in samples.items()}

    problem = Problem(settings.ranks * max(settings.sizes), settings.ranks, "full", settings.batch, settings.heads,
                      settings.kv_heads, settings.head_dim, settings.dtype)
    points: list[RatePoint] = []
    for kind, n, pieces in kernel_jobs(settings):
        kernel = square_kernel(kind, n)
        for phase in ("forward", "backward"):  # per piece: the rate of one block of a stacked call
            points.append(RatePoint(phase, kind, n, n, pieces * kernel.flops(problem, phase)
                                    / seconds[("kernel", kind, n, pieces, phase)]))
    merge_key = ("merge", max(settings.sizes))
    memory_bandwidth = Kernel("full", merge_key[1], merge_key[1], 0).epilogue_bytes(problem, "forward") \
        / seconds[merge_key]
    links = {op: fit_link(op, settings.ranks, [(b, seconds[("op", op, b)]) for b in settings.message_bytes])
             for op in CALIBRATED_OPS}
    tc, tm, tb = (seconds[("overlap", part)] for part in ("compute", "comm", "both"))
    overlap = min(1.0, max(0.0, (tc + tm - tb) / min(tc, tm)))
    host = {"torch": torch.__version__, "platform": platform.platform(), "machine": platform.machine(),
            "kernel_shape": f"b={settings.batch} h={settings.heads}:{settings.kv_heads} d={settings.head_dim} "
                            f"{settings.dtype}",
            "load_before": f"{watch.load_before:.2f}", "interference": f"{watch.share:.3f}",
            "passes": str(settings.passes),
            "pass_speed": " ".join(f"{x:.3f}" for x in pass_speeds(per_pass, seconds))}
    return Profile(tuple(points), links, memory_bandwidth, overlap, cores, settings.ranks, threads,
                   int(psutil.virtual_memory().total), host)


@dataclass(frozen=True)
class GpuSettings:
    """What :func:`calibrate_gpu` measures. ``sizes``: square block sides (tokens) of the FULL and CAUSAL
    kernels; smaller blocks get extrapolated points (``cost.profile.extrapolate_below``). The kernel shape
    is ``[batch, n, heads, head_dim]`` queries with ``kv_heads`` key/value heads in ``dtype``, as
    ``scripts/gpu_check.py`` benches it. ``path``: the kernel path to time (None: the one the dispatch
    takes for each kind, ``kernels.kernel_for``). ``merge_rows``: query rows of the merge whose bandwidth
    is the epilogue's. Each figure is the median of ``repeats`` timed calls after ``warmup`` untimed ones."""

    sizes: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    path: str | None = None
    merge_rows: int = 8192
    warmup: int = 3
    repeats: int = 10


GPU_QUICK = GpuSettings(sizes=(1024, 2048), merge_rows=1024, warmup=1, repeats=3)

#: ``timer(call, warmup, repeats)``: seconds per call of ``call`` (the median of ``repeats`` timed calls
#: after ``warmup`` untimed ones)
Timer = Callable[[Callable[[], object], int, int], float]


def cuda_timer(call: Callable[[], object], warmup: int, repeats: int) -> float:
    """:data:`Timer` by CUDA events around each call on the current stream (seconds)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def wall_timer(call: Callable[[], object], warmup: int, repeats: int) -> float:
    """:data:`Timer` by the wall clock (devices whose calls return when done, the CPU)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _device_facts(device: torch.device) -> tuple[str, tuple[int, int], int]:
    """``(name, compute capability, memory bytes)`` of ``device``; a CPU stand-in reports (0, 0) and the
    host's memory."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return torch.cuda.get_device_name(device), kernels.capability(device), int(props.total_memory)
    import psutil

    return f"{device.type} ({platform.machine()})", (0, 0), int(psutil.virtual_memory().total)


def calibrate_gpu(settings: GpuSettings = GpuSettings(), device: torch.device | str = "cuda",
                  timer: Timer | None = None, progress: Callable[[str, int, int], None] | None = None) -> Profile:
    """Measure one device at world size 1 into a GPU profile (validated): the forward and backward rates
    (FLOP/s, counted as ``Kernel.flops``) of FULL and CAUSAL square blocks of ``settings.sizes`` on the
    kernel path the dispatch takes for ``device`` (or ``settings.path``), extrapolated points below them,
    and the merge epilogue's bandwidth (bytes/s). ``timer`` (:data:`Timer`) defaults to CUDA events on a
    CUDA device and the wall clock elsewhere; ``progress(what, done, total)`` is called before each
    figure."""
    device = torch.device(device)
    timer = timer or (cuda_timer if device.type == "cuda" else wall_timer)
    say = progress or (lambda what, done, total: None)
    dt = kernels.DTYPES[settings.dtype]
    probe = torch.empty(1, 1, settings.heads, settings.head_dim, dtype=dt, device=device)  # what dispatch reads
    paths = {kind: settings.path or kernels.kernel_for(probe, BlockKind(kind), kv_len=max(settings.sizes))
             for kind in ("full", "causal")}
    problem = Problem(max(settings.sizes), 1, "full", settings.batch, settings.heads, settings.kv_heads,
                      settings.head_dim, settings.dtype)
    total = 2 * len(settings.sizes) + 1
    points = []
    for kind in ("full", "causal"):
        for n in settings.sizes:
            say(f"{kind} {n} x {n} on {paths[kind]}", len(points) // 2, total)
            calls = kernel_calls(kind, n, device=device, path=paths[kind], **shape_of(settings))
            for phase in ("forward", "backward"):
                seconds = timer(calls[phase], settings.warmup, settings.repeats)
                points.append(RatePoint(phase, kind, n, n, square_kernel(kind, n).flops(problem, phase) / seconds))
            del calls
    say(f"merge of {settings.merge_rows} rows", total - 1, total)
    merge_seconds = timer(_merge_call(settings, settings.merge_rows, device), settings.warmup, settings.repeats)
    bandwidth = Kernel("full", settings.merge_rows, settings.merge_rows, 0).epilogue_bytes(problem, "forward") \
        / merge_seconds
    name, capability, memory = _device_facts(device)
    software = {"torch": torch.__version__, "cpattn": __version__}
    if device.type == "cuda":
        software.update(cuda=str(torch.version.cuda), cudnn=str(torch.backends.cudnn.version()))
    shape = f"b={settings.batch}, {settings.heads}:{settings.kv_heads} heads, d={settings.head_dim}, {settings.dtype}"
    low, high = min(settings.sizes), max(settings.sizes)
    note = (f"Measured by cpattn calibrate: forward and backward of FULL and CAUSAL square blocks of "
            f"{', '.join(map(str, settings.sizes))} tokens ({shape}), each the median of {settings.repeats} timed "
            f"calls after {settings.warmup} warm-ups. Extrapolated: blocks below {low} tokens, on Device's analytic "
            f"curve through the {low} block (cost.profile.extrapolate_below); blocks above {high} get its rate. "
            f"Not measured: PARTIAL blocks. Memory: the device's total; memory bandwidth: the merge epilogue's "
            f"({settings.merge_rows} rows).")
    info = GpuInfo(name, capability, paths, datetime.date.today().isoformat(), software, tuple(settings.sizes), note)
    say("done", total, total)
    prof = Profile(tuple(points) + extrapolate_below(tuple(points)), {}, bandwidth, 1.0, 1, 1, 1, memory,
                   {"platform": platform.platform()}, info)
    return from_json(prof.to_json(), "GPU calibration")


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


def levels(profiles: list[Profile]) -> list[float]:
    """Each calibration's overall speed against the first's: the median over the kernel rates of its rate
    over the first's (the machine's speed drifts between calibrations, and moves every rate together)."""
    each = [rates(p) for p in profiles]
    first = each[0]
    kernel = [name for name in first if name.split(" ", 1)[0] in ("forward", "backward") and first[name] > 0]
    return [statistics.median(r[name] / first[name] for name in kernel) for r in each]


def at_speed(profile: Profile, speed: float) -> Profile:
    """``profile`` as the machine would measure it running ``speed`` times as fast: every kernel rate and
    bandwidth times ``speed``, every latency over it, the overlap as it is."""
    return replace(profile, kernels=tuple(replace(p, flop_per_s=p.flop_per_s * speed) for p in profile.kernels),
                   links={op: Link(link.latency / speed, link.bandwidth * speed) for op, link in profile.links.items()},
                   memory_bandwidth=profile.memory_bandwidth * speed)


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


__all__ = ["CALIBRATED_OPS", "GPU_QUICK", "QUICK", "GpuSettings", "Interference", "Settings", "Timer", "at_speed",
           "calibrate", "calibrate_gpu", "combine", "cuda_timer", "fit_link", "is_rate", "kernel_jobs", "levels",
           "pass_speeds", "probes", "rates", "spread", "wall_timer"]
