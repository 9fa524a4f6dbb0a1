"""What runs on the ranks of ``cpattn bench`` and what :func:`run` collects from them (docs/bench.md).

One process runs the same attention on the whole sequence with all the cores the N ranks share; each
schedule runs on an N-rank gloo world with cores / N threads per rank. Each configuration is checked
once against the one-process result before it is timed; a wrong schedule is reported, not timed.
The one process and the schedules alternate over ``repeats`` rounds (one process, then each schedule, then
again), so a change in the machine's load reaches both sides of every ratio. A timed iteration is one
forward and backward step (its forward timed to its end as well); a round's time is the median over its
iterations of the slowest rank's time, and a row reports the median over rounds with the lowest and
highest (:func:`spread`). A ratio to the one process above what the ranks' cores or GPUs allow
(:func:`parallel_limit`) in any round is noise, flagged on the row. A masked configuration also times
dense causal attention in one process (for the mask efficiency) and, as a peer, FlexAttention. With
``timeline=True`` every rank stamps one more forward and backward (``cpattn.core.trace.timeline``), which
becomes each row's Chrome trace (:func:`write_traces`) and its hidden transfer fraction. With
``speed_probe=True`` (``bench --predict``) every rank also times a few reference kernels before each timed
iteration (:data:`SPEED_PROBE`), so :func:`predict` can tell how fast the machine ran during each row
against its calibration profile.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from .. import memory
from ..core import masks, trace
from ..core.kernels import DTYPES
from ..core.steps import attention_flops
from ..exactness import assemble
from ..timed_calls import kernel_calls, shape_of

#: relative error against the one-process result above which a schedule is reported wrong
CHECK_TOLERANCE = {"float32": 1e-4, "float64": 1e-10, "bfloat16": 3e-2, "float16": 1e-2}

#: the speed probe of ``bench --predict``: the forward and backward of one block of each ``(kind, side)``,
#: timed on every rank at once before each timed iteration (:func:`probe_blocks`, :func:`probe_speeds`).
#: Over 100 two-rank samples, 8-sample windows of this probe and of an 8192 x 8192 causal backward plus a 4096
#: x 4096 full forward moved together (window speeds 0.98-1.11, their ratio within 0.95-1.02).
SPEED_PROBE = (("full", 1024), ("causal", 2048))


@dataclass(frozen=True)
class BenchConfig:
    world: int = 2
    seq: int = 4096
    batch: int = 1
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    mask: str | dict = "causal"  # "causal", "full" or a mask spec (cpattn.masks.from_spec)
    dtype: str = "float32"
    warmup: int = 1  # untimed calls per round (in the first, the memory step is the first of them)
    iters: int = 1  # timed iterations per phase per round; a round's time is their median
    repeats: int = 3  # rounds: the one process and every schedule, alternating
    threads: int = 0  # per rank; 0 = cores // world (at least 1)
    seed: int = 0
    topology: tuple[int, int] | None = None  # (nodes, devices per node) given to ContextParallel
    layout: str | None = None  # None = each schedule's own; "balanced" etc. for schedules that accept one

    def threads_per_rank(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // self.world)


@dataclass
class BenchRow:
    schedule: str
    ok: bool = True
    error: float = 0.0  # max relative error of out, dq, dk, dv vs one process
    note: str = ""
    fwd_s: float = float("nan")
    fwd_bwd_s: float = float("nan")
    tflops_per_rank: float = float("nan")  # forward + backward
    speedup: float = float("nan")  # T(one process) / T(schedule), forward + backward: median over rounds
    fwd_speedup: float = float("nan")
    fwd_range: tuple[float, float] = (float("nan"), float("nan"))  # lowest and highest round, seconds
    fwd_bwd_range: tuple[float, float] = (float("nan"), float("nan"))
    speedup_range: tuple[float, float] = (float("nan"), float("nan"))  # of the ratio within each round
    noise: bool = False  # the speedup is above parallel_limit: not a result (see spread)
    bytes_sent: int = 0  # busiest rank, one forward + backward (payload, cpattn.core.comm accounting)
    bytes_recv: int = 0
    wire_sent: int = 0  # busiest rank, one forward + backward: sent on the wire, forwarding included
    peak_mem_bytes: int = 0  # busiest rank, peak live tensor bytes during forward + backward
    mask_efficiency: float = float("nan")  # masked configurations: see mask_efficiency(), fwd + bwd
    fwd_mask_efficiency: float = float("nan")
    pred_fwd_s: float = float("nan")  # cost-model prediction (see predict)
    pred_fwd_bwd_s: float = float("nan")
    pred_fwd_error: float = float("nan")  # (predicted - measured) / measured
    pred_error: float = float("nan")  # forward + backward
    speed: float = float("nan")  # the machine's speed during the row against the profile (see predict)
    hidden_fraction: float = float("nan")  # with a timeline: transfer time hidden behind kernel calls, mean over ranks
    extra: dict = field(default_factory=dict)


def _inputs(cfg: BenchConfig, device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed)
    b, s, h, hkv, d = cfg.batch, cfg.seq, cfg.heads, cfg.kv_heads, cfg.head_dim
    dt = DTYPES[cfg.dtype]
    shapes = {"q": (b, s, h, d), "k": (b, s, hkv, d), "v": (b, s, hkv, d), "dout": (b, s, h, d)}
    return {n: torch.randn(*shp, generator=g).to(dt).to(device) for n, shp in shapes.items()}


def rank_device() -> torch.device:
    """This rank's device: with CUDA, the GPUs in turn (rank r on GPU ``r % count``, so P ranks on fewer
    GPUs share them: their compute is time-sliced and their gloo transfers staged through host buffers,
    ``cpattn.core.staging``); else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def sharing(world: int, gpus: int) -> str | None:
    """What a reader must know of times taken with ``world`` ranks on ``gpus`` GPUs (None on the CPU or
    with a GPU per rank): that ranks shared GPUs and staged their transfers, so they are no cluster's."""
    if gpus < 1 or world <= gpus:
        return None
    per = -(-world // gpus)
    return (f"{world} ranks shared {gpus} GPU{'s' if gpus > 1 else ''} (up to {per} per GPU): their compute was "
            "time-sliced and their transfers staged through host buffers (gloo), so these are not a cluster's times")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_blocks(cfg: BenchConfig) -> list[tuple[str, int]]:
    """The speed probe's blocks ``(kind, side)`` for ``cfg``: :data:`SPEED_PROBE`, each side at most a
    rank's share of the sequence (and at least 64)."""
    share = max(64, cfg.seq // cfg.world)
    return [(kind, min(side, share)) for kind, side in SPEED_PROBE]


def _probe_calls(cfg: BenchConfig) -> list[Callable[[], object]]:
    """The forward and backward call of every :func:`probe_blocks` block, in the run's shape (calibration's
    kernel calls, so the probe times what the profile measured)."""
    return [call for kind, side in probe_blocks(cfg) for call in kernel_calls(kind, side, **shape_of(cfg)).values()]


def rank_bench(schedule: str, cfg: dict, baseline: bool = False, timeline: bool = False,
               probe: bool = False, first: bool = True) -> dict:
    """Runs on every rank, once per round: warm-up and timed iterations (each one forward and backward step,
    its forward timed to its end as ``fwd``, the whole step as ``fwd_bwd``); in the ``first`` round, before them,
    one checked call and one counted call (bytes, peak memory: the first warm-up), whose results only
    that round returns (``check``, ``bytes_*``, ``peak``, ``work``). The one-process ``baseline`` ignores the
    topology and layout. ``timeline``: then one more forward and backward,
    after a barrier, with ``cpattn.core.trace.timeline`` active (marks "forward", "backward", "end"), returned
    as ``"timeline"``. ``probe`` (on a CPU): before each timed iteration, after a barrier, one sample of the
    speed probe (:func:`probe_blocks`; seconds in ``"probe"``)."""
    from ..api import ContextParallel
    from ..core.layout import work_report
    from ..core.topology import Topology

    c = BenchConfig(**cfg)
    device = rank_device()
    x = _inputs(c, device)
    topology = None
    if c.topology is not None and not baseline:
        topology = Topology(*c.topology) if device.type == "cuda" else \
            emulated_topology(c.world, c.topology[0], c.threads_per_rank(), os.cpu_count() or 1)
    cp = ContextParallel(c.seq, c.mask, schedule, topology=topology, layout=None if baseline else c.layout)
    work = work_report(cp.layout, cp.mask, cp.padded_len, cp.world_size, cp.seq_len) \
        if first and cp.rank == 0 else None
    q, k, v, dout = (cp.shard(x[n]) for n in ("q", "k", "v", "dout"))
    del x
    probe_calls = _probe_calls(c) if probe and device.type == "cpu" else []
    probed: list[float] = []

    def step():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = cp.attention(qq, kk, vv)
        out.backward(dout)
        _sync(device)
        return out, qq, kk, vv

    found: dict = {"rank": cp.rank, "probe": probed}
    warmup = c.warmup
    if first:
        # correctness: the local pieces go back to the parent, which compares with one process
        out, qq, kk, vv = step()
        found["check"] = {n: t.detach().float().cpu().numpy() for n, t in
                          (("out", out), ("dq", qq.grad), ("dk", kk.grad), ("dv", vv.grad))}
        found["positions"] = cp.positions().numpy()
        cp.reset_comm_stats()
        with memory.PeakTracker(device) as mem:
            step()
        traffic = cp.comm_stats()["total"]
        found |= {"bytes_sent": traffic["bytes_sent"], "bytes_recv": traffic["bytes_recv"],
                  "wire_sent": traffic["wire_sent"], "peak": mem.peak_bytes,
                  "work": None if work is None else {"max": work.max, "mean": work.mean, "imbalance": work.imbalance}}
        warmup -= 1
    for _ in range(max(0, warmup)):
        step()
    times: dict[str, list[float]] = {"fwd": [], "fwd_bwd": []}
    for _ in range(c.iters):
        if probe_calls:
            cp.comm.barrier()
            t0 = time.perf_counter()
            for call in probe_calls:
                call()
            probed.append(time.perf_counter() - t0)
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        cp.comm.barrier()
        t0 = time.perf_counter()
        out = cp.attention(qq, kk, vv)
        _sync(device)
        times["fwd"].append(time.perf_counter() - t0)  # the forward of the training step, to its end
        out.backward(dout)
        _sync(device)
        times["fwd_bwd"].append(time.perf_counter() - t0)
    found["times"] = times
    stamped = None
    if timeline and first:
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        cp.comm.barrier()
        with trace.timeline(device) as tl:
            tl.mark("forward")
            out = cp.attention(qq, kk, vv)
            tl.mark("backward")
            out.backward(dout)
            tl.mark("end")
        stamped = tl.as_dict()
    found["timeline"] = stamped
    return found


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    den = float(np.linalg.norm(b)) or 1.0
    err = float(np.linalg.norm(a - b)) / den
    return err if np.isfinite(err) else float("inf")


def _assemble(per_rank: list[dict], name: str) -> np.ndarray:
    """The full-sequence tensor ``name`` from every rank's checked output (padding rows dropped)."""
    return assemble([{name: r["check"][name], "positions": r["positions"]} for r in per_rank], name, 1).numpy()


def _slowest_median(per_rank: list[dict], phase: str) -> float:
    per_iter = zip(*(r["times"][phase] for r in per_rank))
    return statistics.median(max(ts) for ts in per_iter)


def spread(samples: list[float]) -> tuple[float, tuple[float, float]]:
    """``(median, (lowest, highest))`` of one figure's samples, one per round (NaN without samples)."""
    if not samples:
        return float("nan"), (float("nan"), float("nan"))
    return statistics.median(samples), (min(samples), max(samples))


def round_figures(base: list[tuple[float, float]], times: list[tuple[float, float]], limit: float) -> dict:
    """A row's times and ratios from its rounds: ``base`` and ``times`` hold ``(fwd, fwd+bwd)`` seconds of the
    one process and of the schedule, one pair per round. Times: median and range over rounds; ``speedup``
    (forward+backward) and ``fwd_speedup``: the median of the ratio within each round, where both sides met
    the same load; ``noise``: a round measured above ``limit`` (:func:`parallel_limit`): that round met a
    load the other side did not, so neither the ratio nor its median is a result."""
    fwd_s, fwd_range = spread([f for f, _ in times])
    fwd_bwd_s, fwd_bwd_range = spread([fb for _, fb in times])
    speedup, speedup_range = spread([b[1] / t[1] for b, t in zip(base, times)])
    return {"fwd_s": fwd_s, "fwd_range": fwd_range, "fwd_bwd_s": fwd_bwd_s, "fwd_bwd_range": fwd_bwd_range,
            "speedup": speedup, "speedup_range": speedup_range,
            "fwd_speedup": spread([b[0] / t[0] for b, t in zip(base, times)])[0],
            "noise": speedup_range[1] > limit}


def parallel_limit(world: int, threads_per_rank: int, cores: int, gpus: int = 0) -> int:
    """The largest ratio T(one process) / T(schedule) the hardware allows: the number of processors the
    ``world`` ranks compute on at once (GPUs, else cores their threads can occupy). Even against a one
    process that used a single one of them, no schedule runs faster than this; a ratio above it says the
    machine's load changed between the timings (on a CPU the ranks share the one process's cores, so
    about 1 is the real ceiling, and the range says how far to trust a ratio near it)."""
    if gpus:
        return min(world, gpus)
    return max(1, min(cores, world * threads_per_rank))


def flops(cfg: BenchConfig) -> tuple[float, float]:
    """Attention FLOPs (forward, forward + backward) from the mask's allowed area (docs/bench.md)."""
    pairs = masks.allowed_pairs(masks.resolve(cfg.mask), cfg.seq)
    return (attention_flops(cfg.batch, cfg.heads, cfg.head_dim, pairs, "forward"),
            attention_flops(cfg.batch, cfg.heads, cfg.head_dim, pairs, "forward+backward"))


def is_masked(mask) -> bool:
    """Whether ``mask`` (a name, spec or :class:`~cpattn.masks.Mask`) is anything but plain causal or full
    attention: the configurations that get a mask efficiency and the FlexAttention peer."""
    return type(masks.resolve(mask)) not in (masks.CausalMask, masks.FullMask)


def mask_efficiency(causal_s: float, mask, seq: int, t_s: float) -> float:
    """T(dense causal attention, one process) x (pairs ``mask`` allows / causal pairs) / ``t_s``: how
    close a time ``t_s`` comes to running only the pairs the mask allows at the speed of dense causal
    attention (about 1 for a kernel that skips masked work perfectly; on a CPU the ranks share the
    reference's cores, so 1 is also the ceiling of a schedule)."""
    ratio = masks.allowed_pairs(masks.resolve(mask), seq) / (seq * (seq + 1) / 2)
    return causal_s * ratio / t_s


#: the largest sequence whose mask FlexAttention gets as a dense S x S boolean table (256 MiB)
FLEX_DENSE_MAX_SEQ = 16384
#: masks whose own ``mask_mod`` is index arithmetic on Python numbers, which torch.compile traces whole
_ARITHMETIC = (masks.FullMask, masks.CausalMask, masks.SlidingWindowMask, masks.StreamingMask,
               masks.GlobalLocalMask, masks.StridedMask)


def flex_mask_mod(mask: masks.Mask, seq: int, device=None) -> tuple[Callable, str]:
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` for ``mask`` over ``seq`` positions that
    ``torch.compile`` traces as one graph, and how it is built: the mask's own index arithmetic
    (windows, blocks, strides), a document-id lookup (``doc[q] == doc[kv]``), ``&`` / ``|`` of those,
    or else a dense ``[seq, seq]`` boolean table indexed by position (ValueError past
    :data:`FLEX_DENSE_MAX_SEQ`)."""
    if isinstance(mask, _ARITHMETIC):
        return (lambda b, h, q, kv: mask.mask_mod(q, kv)), "arithmetic"
    if isinstance(mask, masks.DocumentMask):
        lengths = torch.tensor(mask.lengths)
        doc = torch.repeat_interleave(torch.arange(len(mask.lengths)), lengths).to(device)
        if mask.causal:
            return (lambda b, h, q, kv: (doc[q] == doc[kv]) & (kv <= q)), "document ids"
        return (lambda b, h, q, kv: doc[q] == doc[kv]), "document ids"
    if isinstance(mask, (masks.AndMask, masks.OrMask)):
        (fa, ha), (fb, hb) = flex_mask_mod(mask.a, seq, device), flex_mask_mod(mask.b, seq, device)
        how = ha if ha == hb else f"{ha}, {hb}"
        if isinstance(mask, masks.AndMask):
            return (lambda b, h, q, kv: fa(b, h, q, kv) & fb(b, h, q, kv)), how
        return (lambda b, h, q, kv: fa(b, h, q, kv) | fb(b, h, q, kv)), how
    if seq > FLEX_DENSE_MAX_SEQ:
        raise ValueError(f"{mask!r} has no FlexAttention form but a dense S x S table, too large at S={seq} "
                         f"(limit {FLEX_DENSE_MAX_SEQ})")
    dense = mask.dense(0, seq, 0, seq).to(device)
    return (lambda b, h, q, kv: dense[q, kv]), "dense S x S table"


def rank_flex(cfg: dict) -> dict:
    """Runs in the one-process world: FlexAttention of the whole problem, ``torch.compile``-d (one graph,
    no fallback), forward only (FlexAttention has no CPU backward). Returns ``fwd_s`` (median over
    ``iters`` after ``warmup``), ``compile_s`` (the first call), ``mask_mod`` (how the mask was given)
    and ``out`` ``[b, s, h, d]`` for the check; or only a ``note`` saying why it could not run."""
    c = BenchConfig(**cfg)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as exc:
        return {"note": f"torch {torch.__version__} has no FlexAttention ({exc})"}
    device = rank_device()
    try:
        mod, how = flex_mask_mod(masks.resolve(c.mask), c.seq, device)
    except ValueError as exc:
        return {"note": str(exc)}
    x = _inputs(c, device)
    q, k, v = (x[n].transpose(1, 2).contiguous() for n in ("q", "k", "v"))
    del x
    block = create_block_mask(mod, None, None, c.seq, c.seq, device=device)
    fn = torch.compile(flex_attention, fullgraph=True)

    def call() -> torch.Tensor:
        with torch.no_grad():
            out = fn(q, k, v, block_mask=block, enable_gqa=c.heads != c.kv_heads)
        _sync(device)
        return out

    t0 = time.perf_counter()
    try:
        out = call()
    except Exception as exc:  # no C++ compiler / Triton, a dtype or shape it lacks: a note, not a failure
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        return {"note": f"torch.compile(flex_attention) failed here: {type(exc).__name__}: {first}"}
    compile_s = time.perf_counter() - t0
    times = []
    for it in range(c.warmup + c.iters):
        t0 = time.perf_counter()
        call()
        if it >= c.warmup:
            times.append(time.perf_counter() - t0)
    return {"fwd_s": statistics.median(times) if times else float("nan"), "compile_s": compile_s,
            "mask_mod": how, "out": out.transpose(1, 2).float().cpu().numpy()}


def run(cfg: BenchConfig, schedule_names: list[str], progress=None, timeout: float = 1800.0,
        flex: bool | None = None, timeline: bool = False, speed_probe: bool = False) -> dict:
    """Benchmark ``schedule_names``; returns ``{"config", "baseline", "rows", "environment"}``.

    The one process and the schedules alternate over ``cfg.repeats`` rounds; times are the median over
    rounds, with ``*_range`` the lowest and highest round (each round's in ``extra["rounds"]``, the one
    process's in ``baseline["rounds"]``), and ``speedup`` the median of the ratio within
    each round; a row whose ratio is above :func:`parallel_limit` (``environment["parallel_limit"]``) has
    ``noise`` set. A masked configuration (:func:`is_masked`) also times dense causal attention in the
    one-process world, in every round (``baseline["causal_fwd_s"]``, ``["causal_fwd_bwd_s"]``) and gives
    every row its :func:`mask_efficiency`. ``flex`` adds the FlexAttention peer (:func:`rank_flex`,
    ``baseline["flex"]``, once); None = only for a masked configuration. ``timeline``: each schedule stamps
    one more forward and backward on every rank in the first round; its row gets ``hidden_fraction`` and
    ``extra["timeline"]`` (:func:`cpattn.timeline.summary` of the aligned ranks, with their ``spans``).
    ``speed_probe`` (on a CPU): each schedule's ranks also time the speed probe before each timed
    iteration; its row gets ``extra["speed_probe"]`` (``{"blocks", "seconds"}``: per sample, the slowest
    rank, every round's), which :func:`predict` turns into the row's ``speed``."""
    from .. import schedules
    from ..launcher import LocalWorld, RankError

    mask = masks.resolve(cfg.mask)
    for name in schedule_names:
        sched = schedules.get(name)
        sched.check_mask(mask)
        if cfg.layout is not None and not sched.custom_layout:
            raise ValueError(f"schedule {name!r} runs only on its own layout, not layout={cfg.layout!r}")
    if cfg.topology is not None and cfg.topology[0] * cfg.topology[1] != cfg.world:
        raise ValueError(f"topology {cfg.topology[0]} x {cfg.topology[1]} does not have {cfg.world} ranks")
    say = progress or (lambda msg: None)
    tpr = cfg.threads_per_rank()
    fwd_flops, total_flops = flops(cfg)

    def fail(res: list) -> str | None:
        return next((str(r) for r in res if isinstance(r, RankError)), None)

    masked = is_masked(mask)
    flex = masked if flex is None else flex
    flex_res = None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    limit = parallel_limit(cfg.world, tpr, os.cpu_count() or 1, gpus)
    # seconds per round: (fwd, fwd+bwd) of the one process, its dense causal reference, and each schedule
    base_t: list[tuple[float, float]] = []
    causal_t: list[tuple[float, float]] = []
    rows = {name: BenchRow(name) for name in schedule_names}
    row_t: dict[str, list[tuple[float, float]]] = {name: [] for name in schedule_names}
    probes: dict[str, list[list[float]]] = {name: [] for name in schedule_names}
    ref: dict[str, np.ndarray] = {}
    base: list = []
    say(f"starting one process ({tpr * cfg.world} threads) and {cfg.world} ranks ({tpr} each), S={cfg.seq}")
    with LocalWorld(1, threads=tpr * cfg.world) as one, LocalWorld(cfg.world, threads=tpr) as w:
        if flex:
            say("FlexAttention peer: torch.compile (can take tens of seconds), then forward timing")
            flex_res = one.run(rank_flex, timeout=timeout, name="flex", cfg=asdict(cfg))[0]
            if isinstance(flex_res, RankError):
                flex_res = {"note": f"FlexAttention raised: {flex_res}"}
        for rnd in range(cfg.repeats):
            first = rnd == 0
            at = f"round {rnd + 1}/{cfg.repeats}: "
            say(f"{at}one process")
            res = one.run(rank_bench, timeout=timeout, name="one process", schedule="ring", cfg=asdict(cfg),
                          baseline=True, first=first)
            if fail(res):
                raise RuntimeError(f"the one-process baseline failed: {fail(res)}")
            base = res if first else base
            base_t.append((_slowest_median(res, "fwd"), _slowest_median(res, "fwd_bwd")))
            if masked:  # the reference of the mask efficiency: dense causal attention, same shape and phases
                say(f"{at}one process, dense causal reference")
                res = one.run(rank_bench, timeout=timeout, name="one process, causal", schedule="ring",
                              cfg={**asdict(cfg), "mask": "causal"}, baseline=True, first=first)
                if fail(res):
                    raise RuntimeError(f"the one-process causal reference failed: {fail(res)}")
                causal_t.append((_slowest_median(res, "fwd"), _slowest_median(res, "fwd_bwd")))
            if first:
                ref = {n: _assemble(base, n) for n in ("out", "dq", "dk", "dv")}
            for name, row in rows.items():
                if not row.ok:
                    continue
                say(f"{at}{name} on {cfg.world} ranks")
                res = w.run(rank_bench, timeout=timeout, name=name, schedule=name, cfg=asdict(cfg),
                            timeline=timeline, probe=speed_probe, first=first)
                if fail(res):
                    row.ok, row.note = False, fail(res)
                    continue
                if first:
                    row.error = max(_rel(_assemble(res, n), ref[n]) for n in ref)
                    if not row.error <= CHECK_TOLERANCE[cfg.dtype]:
                        row.ok, row.note = False, f"WRONG: relative error {row.error:.2e} vs one process"
                        continue
                    _first_round(row, res, timeline)
                row_t[name].append((_slowest_median(res, "fwd"), _slowest_median(res, "fwd_bwd")))
                if res[0]["probe"]:
                    probes[name].append([max(samples) for samples in zip(*(r["probe"] for r in res))])
    if flex_res is not None and "out" in flex_res:
        flex_res["error"] = _rel(flex_res.pop("out").astype(np.float64), ref["out"])
        if not flex_res["error"] <= CHECK_TOLERANCE[cfg.dtype]:
            flex_res = {"note": f"FlexAttention WRONG: relative error {flex_res['error']:.2e} vs one process"}
    base_f, base_f_range = spread([f for f, _ in base_t])
    base_fb, base_fb_range = spread([fb for _, fb in base_t])
    causal_f, causal_fb = spread([f for f, _ in causal_t])[0], spread([fb for _, fb in causal_t])[0]
    for name, row in rows.items():
        if not row.ok:
            continue
        for key, value in round_figures(base_t, row_t[name], limit).items():
            setattr(row, key, value)
        row.extra["rounds"] = {"fwd_s": [f for f, _ in row_t[name]], "fwd_bwd_s": [fb for _, fb in row_t[name]]}
        row.tflops_per_rank = total_flops / row.fwd_bwd_s / cfg.world / 1e12
        if probes[name]:
            seconds = [s for samples in probes[name] for s in samples]
            row.extra["speed_probe"] = {"blocks": probe_blocks(cfg), "seconds": seconds}
        if masked:
            row.mask_efficiency = mask_efficiency(causal_fb, mask, cfg.seq, row.fwd_bwd_s)
            row.fwd_mask_efficiency = mask_efficiency(causal_f, mask, cfg.seq, row.fwd_s)
    baseline = {"fwd_s": base_f, "fwd_bwd_s": base_fb, "fwd_range": list(base_f_range),
                "fwd_bwd_range": list(base_fb_range),
                "rounds": {"fwd_s": [f for f, _ in base_t], "fwd_bwd_s": [fb for _, fb in base_t]},
                "peak_mem_bytes": base[0]["peak"], "tflops": total_flops / base_fb / 1e12, "fwd_flops": fwd_flops,
                "fwd_bwd_flops": total_flops}
    if masked:
        baseline |= {"causal_fwd_s": causal_f, "causal_fwd_bwd_s": causal_fb,
                     "mask_efficiency": mask_efficiency(causal_fb, mask, cfg.seq, base_fb),
                     "fwd_mask_efficiency": mask_efficiency(causal_f, mask, cfg.seq, base_f)}
    if flex_res is not None:
        if "fwd_s" in flex_res and masked:
            flex_res["fwd_mask_efficiency"] = mask_efficiency(causal_f, mask, cfg.seq, flex_res["fwd_s"])
        baseline["flex"] = flex_res
    env = {"cores": os.cpu_count(), "threads_per_rank": tpr, "torch": torch.__version__,
           "device": "cuda" if gpus else "cpu", "backend": "gloo", "gpus": gpus,
           "transfers": "staged through host buffers" if gpus else "host", "parallel_limit": limit}
    if sharing(cfg.world, gpus):
        env["sharing"] = sharing(cfg.world, gpus)
    return {"config": asdict(cfg), "baseline": baseline, "rows": [asdict(r) for r in rows.values()],
            "environment": env}


def _first_round(row: BenchRow, res: list[dict], timeline: bool) -> None:
    """What a row takes from its first round only: bytes, peak memory, the layout's work, the timeline."""
    from .. import timeline as timelines

    row.bytes_sent = max(r["bytes_sent"] for r in res)
    row.bytes_recv = max(r["bytes_recv"] for r in res)
    row.wire_sent = max(r["wire_sent"] for r in res)
    row.peak_mem_bytes = max(r["peak"] for r in res)
    row.extra["work"] = res[0]["work"]
    if timeline:
        ranks = timelines.align([timelines.spans(r["timeline"], r["rank"]) for r in res])
        summ = timelines.summary(ranks)
        if summ["hidden_fraction"] is not None:
            row.hidden_fraction = summ["hidden_fraction"]
        row.extra["timeline"] = {"hidden_fraction": summ["hidden_fraction"], "hidden_min": summ["hidden_min"],
                                 "step_s": summ["step_s"], "per_rank": summ["ranks"], "spans": ranks}


def emulated_topology(world: int, nodes: int, threads_per_rank: int, cores: int, profile=None):
    """What ranks on this CPU plan for (``ultra``) and what the cost model predicts on: the ``local``
    topology (this machine's calibration ``profile``, default: the one at the default location, else
    conservative defaults) split into ``nodes`` emulated nodes."""
    from ..cost.presets import local
    from ..cost.profile import load_default

    return local(world, profile if profile is not None else load_default(), threads_per_rank=threads_per_rank,
                 cores=cores, nodes=nodes)
