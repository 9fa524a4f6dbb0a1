"""``cpattn bench``: time every schedule on N local processes against one process (docs/bench.md).

One process runs the same attention on the whole sequence with all the cores the N ranks share; each
schedule runs on an N-rank gloo world with cores / N threads per rank. Each configuration is checked
once against the one-process result before it is timed; a wrong schedule is reported, not timed.
Times are the median over iterations of the slowest rank's time. A masked configuration also times
dense causal attention in one process (for the mask efficiency) and, as a peer, FlexAttention. With
``timeline=True`` every rank stamps one more forward and backward (``cpattn.core.trace.timeline``), which
becomes each row's Chrome trace (:func:`write_traces`) and its hidden transfer fraction. With
``speed_probe=True`` (``bench --predict``) every rank also times a few reference kernels before each timed
iteration (:data:`SPEED_PROBE`), so :func:`predict` can tell how fast the machine ran during each row
against its calibration profile.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from . import memory
from .core import masks, trace
from .core.kernels import DTYPES
from .core.steps import attention_flops
from .kernel_calls import kernel_calls, shape_of, square_kernel
from .timeline import fraction_text
from .verify import assemble

#: relative error against the one-process result above which a schedule is reported wrong
CHECK_TOLERANCE = {"float32": 1e-4, "float64": 1e-10, "bfloat16": 3e-2, "float16": 1e-2}

#: the speed probe of ``bench --predict``: the forward and backward of one block of each ``(kind, side)``,
#: timed on every rank at once before each timed iteration (:func:`probe_blocks`, :func:`probe_speeds`).
#: Over 100 two-rank samples, 8-sample windows of this probe and of an 8192 x 8192 causal backward plus a 4096
#: x 4096 full forward moved together (window speeds 0.98-1.11, their ratio within 0.95-1.02).
SPEED_PROBE = (("full", 1024), ("causal", 2048))

#: the probed rows on each side of a row whose probe samples set its speed (:func:`predict`): a row's own
#: 4-6 samples carry the second-to-second jitter, a whole configuration's miss the drift within it
SPEED_WINDOW = 1


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
    warmup: int = 1
    iters: int = 3
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
    speedup: float = float("nan")  # T(one process) / T(schedule), forward + backward
    fwd_speedup: float = float("nan")
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


def probe_speeds(probe: dict, problem, device) -> list[float]:
    """The machine's speed against the profile in each sample of one row's speed probe: the seconds
    ``device`` (the topology's: the profile's rates, shared between the ranks as in the estimates) gives the
    probe's kernel calls (launch + FLOPs / rate: the calls alone, as calibration timed them, without the
    epilogue an estimate adds for folding a result into accumulators) over the measured seconds (the
    slowest rank's); above 1: faster than calibrated. ``probe``: ``{"blocks": [(kind, side)], "seconds":
    [...]}`` (a row's ``extra["speed_probe"]``)."""
    calls = [(square_kernel(kind, n), phase) for kind, n in probe["blocks"] for phase in ("forward", "backward")]
    expected = sum(device.launch + k.flops(problem, phase) / device.rate(phase, k.kind, k.q_len, k.kv_len)
                   for k, phase in calls)
    return [expected / sec for sec in probe["seconds"] if sec > 0]


def rank_bench(schedule: str, cfg: dict, baseline: bool = False, timeline: bool = False,
               probe: bool = False) -> dict:
    """Runs on every rank: one checked call, then warm-up and timed iterations. The one-process
    ``baseline`` ignores the topology and layout. ``timeline``: then one more forward and backward,
    after a barrier, with ``cpattn.core.trace.timeline`` active (marks "forward", "backward", "end"), returned
    as ``"timeline"``. ``probe`` (on a CPU): before each timed iteration, after a barrier, one sample of the
    speed probe (:func:`probe_blocks`; seconds in ``"probe"``)."""
    from .api import ContextParallel
    from .core.layout import work_report
    from .core.topology import Topology

    c = BenchConfig(**cfg)
    device = rank_device()
    x = _inputs(c, device)
    topology = None
    if c.topology is not None and not baseline:
        topology = Topology(*c.topology) if device.type == "cuda" else \
            emulated_topology(c.world, c.topology[0], c.threads_per_rank(), os.cpu_count() or 1)
    cp = ContextParallel(c.seq, c.mask, schedule, topology=topology, layout=None if baseline else c.layout)
    work = work_report(cp.layout, cp.mask, cp.padded_len, cp.world_size, cp.seq_len) if cp.rank == 0 else None
    q, k, v, dout = (cp.shard(x[n]) for n in ("q", "k", "v", "dout"))
    del x
    probe_calls = _probe_calls(c) if probe and device.type == "cpu" else []
    probed: list[float] = []

    def step(backward: bool):
        qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))
        out = cp.attention(qq, kk, vv)
        if backward:
            out.backward(dout)
        _sync(device)
        return out, qq, kk, vv

    # correctness: the local pieces go back to the parent, which compares with one process
    out, qq, kk, vv = step(True)
    check = {n: t.detach().float().cpu().numpy() for n, t in
             (("out", out), ("dq", qq.grad), ("dk", kk.grad), ("dv", vv.grad))}
    times: dict[str, list[float]] = {"fwd": [], "fwd_bwd": []}
    cp.reset_comm_stats()
    with memory.PeakTracker(device) as mem:
        step(True)
    traffic = cp.comm_stats()["total"]
    for phase, backward in (("fwd", False), ("fwd_bwd", True)):
        for it in range(c.warmup + c.iters):
            if probe_calls and it >= c.warmup:
                cp.comm.barrier()
                t0 = time.perf_counter()
                for call in probe_calls:
                    call()
                probed.append(time.perf_counter() - t0)
            cp.comm.barrier()
            t0 = time.perf_counter()
            step(backward)
            if it >= c.warmup:
                times[phase].append(time.perf_counter() - t0)
    stamped = None
    if timeline:
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        cp.comm.barrier()
        with trace.timeline(device) as tl:
            tl.mark("forward")
            out = cp.attention(qq, kk, vv)
            tl.mark("backward")
            out.backward(dout)
            tl.mark("end")
        stamped = tl.as_dict()
    return {"rank": cp.rank, "positions": cp.positions().numpy(), "check": check, "times": times,
            "bytes_sent": traffic["bytes_sent"], "bytes_recv": traffic["bytes_recv"],
            "wire_sent": traffic["wire_sent"], "peak": mem.peak_bytes, "timeline": stamped, "probe": probed,
            "work": None if work is None else {"max": work.max, "mean": work.mean, "imbalance": work.imbalance}}


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

    A masked configuration (:func:`is_masked`) also times dense causal attention in the one-process
    world (``baseline["causal_fwd_s"]``, ``["causal_fwd_bwd_s"]``) and gives every row its
    :func:`mask_efficiency`. ``flex`` adds the FlexAttention peer (:func:`rank_flex`,
    ``baseline["flex"]``); None = only for a masked configuration. ``timeline``: each schedule stamps one
    more forward and backward on every rank; its row gets ``hidden_fraction`` and ``extra["timeline"]``
    (:func:`cpattn.timeline.summary` of the aligned ranks, with their ``spans``). ``speed_probe`` (on a
    CPU): each schedule's ranks also time the speed probe before each timed iteration; its row gets
    ``extra["speed_probe"]`` (``{"blocks", "seconds"}``: per sample, the slowest rank), which
    :func:`predict` turns into the row's ``speed``."""
    from . import schedules
    from . import timeline as timelines
    from .launcher import LocalWorld, RankError

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
        errs = [r for r in res if isinstance(r, RankError)]
        return f"{errs[0]}" if errs else None

    masked = is_masked(mask)
    flex = masked if flex is None else flex
    causal, flex_res = None, None
    say(f"one process, {tpr * cfg.world} threads, S={cfg.seq}")
    with LocalWorld(1, threads=tpr * cfg.world) as w:
        base = w.run(rank_bench, timeout=timeout, name="one process", schedule="ring", cfg=asdict(cfg),
                     baseline=True)
        if fail(base):
            raise RuntimeError(f"the one-process baseline failed: {fail(base)}")
        if masked:  # the reference of the mask efficiency: dense causal attention, same shape and phases
            say(f"one process, dense causal reference, S={cfg.seq}")
            causal = w.run(rank_bench, timeout=timeout, name="one process, causal", schedule="ring",
                           cfg={**asdict(cfg), "mask": "causal"}, baseline=True)
            if fail(causal):
                raise RuntimeError(f"the one-process causal reference failed: {fail(causal)}")
        if flex:
            say("FlexAttention peer: torch.compile (can take tens of seconds), then forward timing")
            flex_res = w.run(rank_flex, timeout=timeout, name="flex", cfg=asdict(cfg))[0]
            if isinstance(flex_res, RankError):
                flex_res = {"note": f"FlexAttention raised: {flex_res}"}
    base_fb, base_f = _slowest_median(base, "fwd_bwd"), _slowest_median(base, "fwd")
    ref = {n: _assemble(base, n) for n in ("out", "dq", "dk", "dv")}
    if flex_res is not None and "out" in flex_res:
        flex_res["error"] = _rel(flex_res.pop("out").astype(np.float64), ref["out"])
        if not flex_res["error"] <= CHECK_TOLERANCE[cfg.dtype]:
            flex_res = {"note": f"FlexAttention WRONG: relative error {flex_res['error']:.2e} vs one process"}
    if causal is not None:
        causal_fb, causal_f = _slowest_median(causal, "fwd_bwd"), _slowest_median(causal, "fwd")
    rows = []
    with LocalWorld(cfg.world, threads=tpr) as w:
        for name in schedule_names:
            say(f"{name} on {cfg.world} ranks")
            res = w.run(rank_bench, timeout=timeout, name=name, schedule=name, cfg=asdict(cfg), timeline=timeline,
                        probe=speed_probe)
            row = BenchRow(name)
            if fail(res):
                row.ok, row.note = False, fail(res)
                rows.append(row)
                continue
            row.error = max(_rel(_assemble(res, n), ref[n]) for n in ref)
            if not row.error <= CHECK_TOLERANCE[cfg.dtype]:
                row.ok, row.note = False, f"WRONG: relative error {row.error:.2e} vs one process"
                rows.append(row)
                continue
            row.fwd_s, row.fwd_bwd_s = _slowest_median(res, "fwd"), _slowest_median(res, "fwd_bwd")
            row.tflops_per_rank = total_flops / row.fwd_bwd_s / cfg.world / 1e12
            row.speedup, row.fwd_speedup = base_fb / row.fwd_bwd_s, base_f / row.fwd_s
            row.bytes_sent = max(r["bytes_sent"] for r in res)
            row.bytes_recv = max(r["bytes_recv"] for r in res)
            row.wire_sent = max(r["wire_sent"] for r in res)
            row.peak_mem_bytes = max(r["peak"] for r in res)
            row.extra["work"] = res[0]["work"]
            if res[0]["probe"]:
                row.extra["speed_probe"] = {"blocks": probe_blocks(cfg),
                                            "seconds": [max(samples) for samples in zip(*(r["probe"] for r in res))]}
            if causal is not None:
                row.mask_efficiency = mask_efficiency(causal_fb, mask, cfg.seq, row.fwd_bwd_s)
                row.fwd_mask_efficiency = mask_efficiency(causal_f, mask, cfg.seq, row.fwd_s)
            if timeline:
                ranks = timelines.align([timelines.spans(r["timeline"], r["rank"]) for r in res])
                summ = timelines.summary(ranks)
                if summ["hidden_fraction"] is not None:
                    row.hidden_fraction = summ["hidden_fraction"]
                row.extra["timeline"] = {"hidden_fraction": summ["hidden_fraction"], "hidden_min": summ["hidden_min"],
                                         "step_s": summ["step_s"], "per_rank": summ["ranks"], "spans": ranks}
            rows.append(row)
    baseline = {"fwd_s": base_f, "fwd_bwd_s": base_fb, "peak_mem_bytes": base[0]["peak"],
                "tflops": total_flops / base_fb / 1e12, "fwd_flops": fwd_flops, "fwd_bwd_flops": total_flops}
    if causal is not None:
        baseline |= {"causal_fwd_s": causal_f, "causal_fwd_bwd_s": causal_fb,
                     "mask_efficiency": mask_efficiency(causal_fb, mask, cfg.seq, base_fb),
                     "fwd_mask_efficiency": mask_efficiency(causal_f, mask, cfg.seq, base_f)}
    if flex_res is not None:
        if "fwd_s" in flex_res and causal is not None:
            flex_res["fwd_mask_efficiency"] = mask_efficiency(causal_f, mask, cfg.seq, flex_res["fwd_s"])
        baseline["flex"] = flex_res
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = {"cores": os.cpu_count(), "threads_per_rank": tpr, "torch": torch.__version__,
           "device": "cuda" if gpus else "cpu", "backend": "gloo", "gpus": gpus,
           "transfers": "staged through host buffers" if gpus else "host"}
    if sharing(cfg.world, gpus):
        env["sharing"] = sharing(cfg.world, gpus)
    return {"config": asdict(cfg), "baseline": baseline, "rows": [asdict(r) for r in rows], "environment": env}


def emulated_topology(world: int, nodes: int, threads_per_rank: int, cores: int, profile=None):
    """What ranks on this CPU plan for (``ultra``) and what the cost model predicts on: the ``local``
    topology (this machine's calibration ``profile``, default: the one at the default location, else
    conservative defaults) split into ``nodes`` emulated nodes."""
    from .cost.presets import local
    from .cost.profile import load_default

    return local(world, profile if profile is not None else load_default(), threads_per_rank=threads_per_rank,
                 cores=cores, nodes=nodes)


def predict(result: dict, profile=None, speed_window: int | None = SPEED_WINDOW) -> dict:
    """Add the cost model's predictions to a :func:`run` result (in place; also returned).

    Each row gains ``pred_fwd_s``, ``pred_fwd_bwd_s`` and the relative errors ``pred_fwd_error`` and
    ``pred_error`` ((predicted - measured) / measured), and ``extra["prediction_terms"]`` (per phase,
    ``Estimate.terms()``: kernels, merge, launch, exposed_comm seconds), estimated on :func:`emulated_topology` for the
    run's world size, emulated nodes, cores and threads per rank, from ``profile`` (a
    :class:`cpattn.cost.Profile`; None = the profile at the default location, else conservative
    defaults); ``ultra`` from its plan for that topology (on a CPU, the plan its ranks ran). A schedule
    the model cannot estimate keeps NaN and says why in ``extra["prediction"]``. ``result["prediction"]``
    gets the topology used and the median absolute error over the rows.

    Rows run with the speed probe (``run(speed_probe=True)``) get ``speed``: how fast the machine ran
    against the profile, the median of the :func:`probe_speeds` samples of the row and of the
    ``speed_window`` probed rows before and after it (None: of every probed row of the configuration), and
    their predictions are the model's over that speed; the model's own, at the profile's speed, and their
    errors stay in ``extra["at_profile_speed"]`` (``fwd_s``, ``fwd_bwd_s``, ``fwd_error``, ``error``). The
    terms are always at the profile's speed.
    """
    from .cost import Problem, estimate

    cfg, env = result["config"], result["environment"]
    nodes = cfg["topology"][0] if cfg.get("topology") else 1
    topo = emulated_topology(cfg["world"], nodes, env["threads_per_rank"], env["cores"], profile)
    problem = Problem(cfg["seq"], cfg["world"], cfg["mask"], cfg["batch"], cfg["heads"], cfg["kv_heads"],
                      cfg["head_dim"], cfg["dtype"])
    probed = [(row, probe_speeds(row["extra"]["speed_probe"], problem, topo.device)) for row in result["rows"]
              if row["ok"] and row["extra"].get("speed_probe")]
    for i, (row, _) in enumerate(probed):
        near = probed if speed_window is None else probed[max(0, i - speed_window):i + speed_window + 1]
        samples = [x for _, speeds in near for x in speeds]
        row["speed"] = statistics.median(samples) if samples else float("nan")
    for row in result["rows"]:
        if not row["ok"]:
            continue
        try:
            est_fwd = estimate(row["schedule"], problem, topo, "forward")
            est_both = estimate(row["schedule"], problem, topo, "forward+backward")
        except (NotImplementedError, ValueError) as exc:
            row["extra"]["prediction"] = str(exc)
            continue
        fwd, both = est_fwd.total, est_both.total
        row["extra"]["prediction_terms"] = {"forward": est_fwd.terms(), "forward+backward": est_both.terms()}
        row["extra"]["at_profile_speed"] = {"fwd_s": fwd, "fwd_bwd_s": both, "fwd_error": (fwd - row["fwd_s"]) /
                                            row["fwd_s"], "error": (both - row["fwd_bwd_s"]) / row["fwd_bwd_s"]}
        if np.isfinite(row.get("speed", float("nan"))):
            fwd, both = fwd / row["speed"], both / row["speed"]
        row["pred_fwd_s"], row["pred_fwd_bwd_s"] = fwd, both
        row["pred_fwd_error"] = (fwd - row["fwd_s"]) / row["fwd_s"]
        row["pred_error"] = (both - row["fwd_bwd_s"]) / row["fwd_bwd_s"]
    result["prediction"] = {"topology": topo.name, **prediction_summary([result])}
    return result


def prediction_summary(results: list[dict]) -> dict:
    """Median absolute relative prediction error over every predicted row of ``results`` (forward +
    backward, and forward), with the number of rows; and, where rows were probed (:func:`probe_speeds`), the
    median absolute error of the model at the profile's speed (``median_abs_error_at_profile_speed``) and the
    range of the probed speeds (``speed``: ``[lowest, median, highest]``), else NaN and None."""
    rows = [r for res in results for r in res["rows"] if r["ok"] and np.isfinite(r["pred_error"])]
    if not rows:
        return {"rows": 0, "median_abs_error": float("nan"), "median_abs_fwd_error": float("nan"),
                "median_abs_error_at_profile_speed": float("nan"), "speed": None}
    speeds = [r["speed"] for r in rows if np.isfinite(r.get("speed", float("nan")))]
    return {"rows": len(rows), "median_abs_error": statistics.median(abs(r["pred_error"]) for r in rows),
            "median_abs_fwd_error": statistics.median(abs(r["pred_fwd_error"]) for r in rows),
            "median_abs_error_at_profile_speed": statistics.median(abs(r["extra"]["at_profile_speed"]["error"])
                                                                   for r in rows) if speeds else float("nan"),
            "speed": [min(speeds), statistics.median(speeds), max(speeds)] if speeds else None}


#: the order in which the bench table leaves out columns in a narrow terminal (1 first); the schedule,
#: fwd+bwd ms, vs 1 proc, max rel err and pred err columns are always shown
DROP_ORDER = ("wire MB/rank", "recv MB/rank", "pred fwd ms", "layout work max/mean", "TFLOP/s/rank", "peak MB/rank",
              "flex fwd ms", "fwd ms", "sent MB/rank", "hidden", "vs ring", "vs zigzag_ring", "pred fwd+bwd ms",
              "mask eff")


def render(result: dict, width: int | None = None):
    """A rich table of a :func:`run` result (with prediction columns after :func:`predict`), fitted to
    ``width`` (default: the terminal's, ``$COLUMNS``, or full width outside a terminal) by leaving out
    columns in :data:`DROP_ORDER`. A schedule that failed its check reads "failed (n)" and its whole
    error is note (n) at the head of the caption, so no error is cut short."""
    from .cli.output import Column, footnotes, table

    cfg, env, base = result["config"], result["environment"], result["baseline"]
    predicted = "prediction" in result
    mask = cfg["mask"] if isinstance(cfg["mask"], str) else json.dumps(cfg["mask"], separators=(",", ":"))
    where = f"P={cfg['world']}"
    if cfg.get("topology"):
        where += f" ({cfg['topology'][0]}x{cfg['topology'][1]})"
    if cfg.get("layout"):
        where += f" layout={cfg['layout']}"
    title = (f"cpattn bench: {where} S={cfg['seq']} b={cfg['batch']} h={cfg['heads']}:{cfg['kv_heads']} "
             f"d={cfg['head_dim']} {mask} {cfg['dtype']} | {env['cores']} cores, "
             f"{env['threads_per_rank']} threads/rank, torch {env['torch']}, {env['backend']}"
             + (f", {env['gpus']} GPU{'s' if env['gpus'] > 1 else ''} shared by {cfg['world']} ranks"
                if env.get("sharing") else ""))
    ok = {r["schedule"]: r for r in result["rows"] if r["ok"]}
    refs = [n for n in ("ring", "zigzag_ring") if n in ok]
    marks, notes = footnotes([f"{r['schedule']} failed: {r['note']}" if not r["ok"] else "" for r in result["rows"]])
    caption = "".join(f"{n}; " for n in notes)
    if env.get("sharing"):
        caption += f"NOTE: {env['sharing']}; "
    caption += (f"one process ({env['threads_per_rank'] * cfg['world']} threads): "
                f"fwd {base['fwd_s'] * 1e3:.1f} ms, fwd+bwd {base['fwd_bwd_s'] * 1e3:.1f} ms; "
                "times: median over iterations of the slowest rank; "
                "TFLOP/s counts only allowed (q, k) pairs, bwd = 2.5 x fwd; vs X = T(X) / T(schedule), "
                "forward+backward; layout work max/mean = allowed pairs of the busiest rank's queries over the mean")
    caption += "; peak MB/rank = most live tensor bytes during one forward+backward (cpattn.memory)"
    caption += ("; sent/recv MB/rank = payload (cpattn.core.comm accounting); wire MB/rank = bytes the busiest rank "
                "sends on the wire, forwarding for others included, under the cost model's collective algorithms")
    masked = "causal_fwd_bwd_s" in base
    if masked:
        ratio = masks.allowed_pairs(masks.resolve(cfg["mask"]), cfg["seq"]) / (cfg["seq"] * (cfg["seq"] + 1) / 2)
        caption += (f"; mask eff = T(dense causal, one process: fwd {base['causal_fwd_s'] * 1e3:.1f} ms, fwd+bwd "
                    f"{base['causal_fwd_bwd_s'] * 1e3:.1f} ms) x allowed / causal pairs ({ratio:.3f}) / T(schedule), "
                    f"forward+backward, 1 = at the speed of the mask (one process: {base['mask_efficiency']:.2f})")
    flex = base.get("flex")
    if flex is not None:
        caption += f"; {flex_note(flex, env['threads_per_rank'] * cfg['world'])}"
    if predicted:
        caption += (f"; predicted on topology {result['prediction']['topology']!r}, "
                    "error = (predicted - measured) / measured")
        if result["prediction"].get("speed"):
            caption += ("; predictions at the machine's speed during each row (speed probe; the prediction "
                        "breakdown has the model's at the profile's speed)")
    traced = any("timeline" in r["extra"] for r in result["rows"] if r["ok"])
    if traced:
        caption += ("; hidden = share of the time transfers are in flight (issue to end of wait) during which a "
                    "kernel call runs on the same rank, one extra stamped fwd+bwd step, mean over ranks")
    headers = ["schedule", "fwd ms", *(["flex fwd ms"] if flex is not None else []), "fwd+bwd ms", "TFLOP/s/rank",
               "vs 1 proc", *(["mask eff"] if masked else []), *[f"vs {n}" for n in refs],
               *(["hidden"] if traced else []), "sent MB/rank", "wire MB/rank", "recv MB/rank", "peak MB/rank",
               "layout work max/mean", "max rel err"]
    if predicted:
        headers += ["pred fwd ms", "pred fwd+bwd ms", "pred err"]
    cols = [Column(h, "left" if h == "schedule" else "right",
                   drop=DROP_ORDER.index(h) + 1 if h in DROP_ORDER else 0) for h in headers]
    rows = []
    for r, mark in zip(result["rows"], marks):
        if not r["ok"]:
            rows.append([r["schedule"] if h == "schedule" else f"[red]failed {mark}[/red]" if h == "fwd+bwd ms"
                         else "" for h in headers])
            continue
        work = r["extra"].get("work")
        cells = [r["schedule"], f"{r['fwd_s'] * 1e3:.1f}",
                 *([f"{flex['fwd_s'] * 1e3:.1f}" if "fwd_s" in flex else "-"] if flex is not None else []),
                 f"{r['fwd_bwd_s'] * 1e3:.1f}", f"{r['tflops_per_rank']:.4f}", f"{r['speedup']:.2f}x",
                 *([f"{r['mask_efficiency']:.2f}"] if masked else []),
                 *[f"{ok[n]['fwd_bwd_s'] / r['fwd_bwd_s']:.2f}x" for n in refs],
                 *([fraction_text(r["extra"].get("timeline", {}).get("hidden_fraction"))] if traced else []),
                 f"{r['bytes_sent'] / 1e6:.1f}", f"{r['wire_sent'] / 1e6:.1f}", f"{r['bytes_recv'] / 1e6:.1f}",
                 f"{r['peak_mem_bytes'] / 1e6:.1f}",
                 f"{work['imbalance']:.2f}" if work else "-", f"{r['error']:.1e}"]
        if predicted:
            if np.isfinite(r["pred_error"]):
                cells += [f"{r['pred_fwd_s'] * 1e3:.1f}", f"{r['pred_fwd_bwd_s'] * 1e3:.1f}",
                          f"{r['pred_error']:+.0%}"]
            else:
                cells += ["-", "-", "not modelled"]
        rows.append(cells)
    return table(cols, rows, title=title, caption=caption, width=width,
                 everything="--json PATH has every figure")


def measured_kernel_s(row: dict) -> float:
    """Seconds the busiest rank spent in kernel calls during the row's stamped forward+backward step
    (``bench --timeline``), or NaN without a timeline."""
    ranks = row["extra"].get("timeline", {}).get("spans")
    if not ranks:
        return float("nan")
    return max(sum(s["t1"] - s["t0"] for s in rk["compute"]) for rk in ranks) / 1e9


def render_breakdown(result: dict, width: int | None = None):
    """The prediction's terms next to the measured forward+backward time (after :func:`predict`): per
    schedule, predicted kernels, merges, launch overheads and exposed communication (ms), their sum,
    the measured time and the error; with a timeline (``bench --timeline``), also the busiest rank's
    measured kernel time in its stamped step, to set against the predicted kernels."""
    from .cli.output import Column, table

    rows = [r for r in result["rows"] if r["ok"] and "prediction_terms" in r["extra"]]
    traced = any("timeline" in r["extra"] for r in rows)
    probed = any(np.isfinite(r.get("speed", float("nan"))) for r in rows)
    headers = ["schedule", "kernels", *(["meas kernels"] if traced else []), "merges", "launch", "exposed comm",
               *(["model", "model err", "speed"] if probed else []), "predicted", "measured", "pred err"]
    drop = {"launch": 1, "meas kernels": 2, "merges": 3, "model": 4}
    cols = [Column(h, "left" if h == "schedule" else "right", drop=drop.get(h, 0)) for h in headers]
    cells = []
    for r in rows:
        t = r["extra"]["prediction_terms"]["forward+backward"]
        model = r["extra"]["at_profile_speed"]
        cells.append([r["schedule"], f"{t['kernels'] * 1e3:.1f}",
                      *([f"{measured_kernel_s(r) * 1e3:.1f}"] if traced else []),
                      f"{t['merge'] * 1e3:.1f}", f"{t['launch'] * 1e3:.1f}", f"{t['exposed_comm'] * 1e3:.1f}",
                      *([f"{model['fwd_bwd_s'] * 1e3:.1f}", f"{model['error']:+.0%}", f"{r['speed']:.3f}"]
                        if probed else []),
                      f"{r['pred_fwd_bwd_s'] * 1e3:.1f}", f"{r['fwd_bwd_s'] * 1e3:.1f}", f"{r['pred_error']:+.0%}"])
    caption = ("forward+backward, ms; predicted = kernels + merges + launch + exposed comm (the cost model's terms, "
               "busiest rank per step)")
    if probed:
        caption = ("forward+backward, ms; model = kernels + merges + launch + exposed comm (the cost model's terms "
                   "at the profile's speed, busiest rank per step); speed = how fast the machine ran during the row "
                   "against the profile: the model's time for the speed probe's kernels (fwd+bwd of "
                   + " and ".join(f"{kind} {n}x{n}" for kind, n in rows[0]["extra"]["speed_probe"]["blocks"])
                   + ", every rank at once, before each timed iteration) over their measured time, median over "
                   "the samples of the row and of the rows next to it; predicted = model / speed")
    if traced:
        caption += "; meas kernels = the busiest rank's kernel calls in one stamped step"
    return table(cols, cells, title="prediction breakdown", caption=caption, width=width)


def flex_note(flex: dict, threads: int) -> str:
    """The caption's account of the FlexAttention peer: what was run, or why it was not."""
    if "fwd_s" not in flex:
        return f"flex fwd ms: not run ({flex['note']})"
    out = (f"flex fwd ms = torch FlexAttention, torch.compile (compiled in {flex['compile_s']:.1f} s), forward only, "
           f"one process, {threads} threads, mask as {flex['mask_mod']}, max rel err {flex['error']:.1e}")
    if "fwd_mask_efficiency" in flex:
        out += f", mask eff fwd {flex['fwd_mask_efficiency']:.2f}"
    return out


def save_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")


def trace_name(schedule: str, config: dict) -> str:
    """The file name of a row's Chrome trace: schedule, mask, world and sequence, then the layout,
    topology and dtype when not the defaults (a mask spec: its kind and a short hash of the spec)."""
    mask = config["mask"]
    if not isinstance(mask, str):
        spec = json.dumps(mask, sort_keys=True, separators=(",", ":"))
        mask = f"{mask.get('kind', 'mask')}-{hashlib.sha1(spec.encode()).hexdigest()[:8]}"
    parts = [schedule, mask, f"P{config['world']}", f"S{config['seq']}"]
    if config.get("layout"):
        parts.append(config["layout"])
    if config.get("topology"):
        parts.append(f"{config['topology'][0]}x{config['topology'][1]}")
    if config.get("dtype", "float32") != "float32":
        parts.append(config["dtype"])
    return "_".join(_slug(str(p)) for p in parts) + ".trace.json"


def write_traces(result: dict, directory: str) -> list[str]:
    """One Chrome trace (``cpattn.timeline.chrome_trace``) per row of ``result`` that has a timeline, into
    ``directory`` (created), named by :func:`trace_name`; each row's ``extra["timeline"]["file"]`` gets its
    path. Returns the paths."""
    from .timeline import chrome_trace

    os.makedirs(directory, exist_ok=True)
    paths = []
    for row in result["rows"]:
        tl = row["extra"].get("timeline") if row["ok"] else None
        if tl is None:
            continue
        path = os.path.join(directory, trace_name(row["schedule"], result["config"]))
        meta = {"schedule": row["schedule"], "config": result["config"], "environment": result["environment"],
                "fwd_bwd_s": row["fwd_bwd_s"], "traced_step_s": tl["step_s"],
                "hidden_fraction": tl["hidden_fraction"], "hidden_min": tl["hidden_min"], "per_rank": tl["per_rank"],
                "clock": "perf_counter_ns of each rank (one host clock), zero = the earliest rank's step start"}
        with open(path, "w") as f:
            json.dump(chrome_trace(tl["spans"], meta), f)
        tl["file"] = path
        paths.append(path)
    return paths


#: at most this many per-rank timeline panels in a plot; beyond it, only the last configuration's
PLOT_TIMELINES = 6


def config_label(config: dict) -> str:
    """A configuration in a few words: ranks (and topology), sequence, mask, layout."""
    mask = config["mask"] if isinstance(config["mask"], str) else config["mask"].get("kind", "mask")
    topo = f" ({config['topology'][0]}x{config['topology'][1]})" if config.get("topology") else ""
    layout = f", layout {config['layout']}" if config.get("layout") else ""
    return f"P={config['world']}{topo}, S={config['seq']}, {mask}{layout}, {config['dtype']}"


def plot(results: dict | list[dict], path: str) -> None:
    """PNG: for every configuration of ``results`` (:func:`run` results, or one), a bar panel of the
    forward+backward efficiency (one process / schedule) per schedule, side by side on one scale; below
    them, for rows with a timeline (``run(..., timeline=True)``), a per-rank panel of its stamped step
    (``cpattn.timeline.draw``): every configuration's when there are at most :data:`PLOT_TIMELINES`,
    else the last configuration's (the title says so; ``--trace`` writes them all)."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .cli.output import schedule_style
    from .timeline import draw, lanes

    results = [results] if isinstance(results, dict) else list(results)
    traced = [(res, r) for res in results for r in res["rows"] if r["ok"] and r["extra"].get("timeline")]
    note = ""
    if len(traced) > PLOT_TIMELINES:
        traced = [(res, r) for res, r in traced if res is results[-1]]
        note = f"; timelines of the last configuration only ({config_label(results[-1]['config'])})"
    ncols = min(len(results), 4)
    nrows = math.ceil(len(results) / ncols)
    most = max(len([r for r in res["rows"] if r["ok"]]) for res in results)
    heights = [3.6] * nrows + [0.3 * sum(1 + len(lanes(rk["transfers"])) for rk in r["extra"]["timeline"]["spans"])
                               + 1.4 for _, r in traced]
    width = max(5.0, ncols * (0.7 * most + 1.8), 10.0 if traced else 0.0)
    height = sum(heights) + 0.6
    fig = plt.figure(figsize=(width, height))
    grid = fig.add_gridspec(len(heights), ncols, height_ratios=heights)
    first = None
    for i, res in enumerate(results):
        ax = fig.add_subplot(grid[i // ncols, i % ncols], sharey=first)
        first = first or ax
        rows = [r for r in res["rows"] if r["ok"]]
        ax.bar([r["schedule"] for r in rows], [r["speedup"] for r in rows],
               color=[schedule_style(r["schedule"])["color"] for r in rows])  # a schedule's colour in every panel
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        if i % ncols == 0:
            ax.set_ylabel("T(one process) / T(schedule)")
        ax.set_title(config_label(res["config"]), fontsize=9)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    for k, (res, r) in enumerate(traced):
        tl = r["extra"]["timeline"]
        where = f" [{config_label(res['config'])}]" if len(results) > 1 else ""
        draw(fig.add_subplot(grid[nrows + k, :]), tl["spans"],
             f"{r['schedule']}{where}: one stamped fwd+bwd step ({tl['step_s'] * 1e3:.1f} ms), transfer time hidden "
             f"behind kernel calls: {fraction_text(tl['hidden_fraction'])} (mean over ranks)")
    fig.suptitle(f"cpattn bench: forward+backward efficiency against one process, {len(results)} "
                 f"configuration{'s' if len(results) > 1 else ''}{note}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / height))  # the top half inch is the title's
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["BenchConfig", "BenchRow", "DROP_ORDER", "PLOT_TIMELINES", "config_label", "flex_mask_mod", "flops",
           "is_masked", "mask_efficiency", "measured_kernel_s", "plot", "predict", "prediction_summary", "render",
           "render_breakdown", "run", "save_json", "trace_name", "write_traces"]
