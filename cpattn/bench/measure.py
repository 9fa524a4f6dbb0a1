"""What runs on the ranks of ``cpattn bench`` and what :func:`run` collects from them (docs/bench.md).

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


def rank_bench(schedule: str, cfg: dict, baseline: bool = False, timeline: bool = False,
               probe: bool = False) -> dict:
    """Runs on every rank: one checked call, then warm-up and timed iterations. The one-process
    ``baseline`` ignores the topology and layout. ``timeline``: then one more forward and backward,
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
    from .. import schedules
    from .. import timeline as timelines
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
            rows.append(row)
            if fail(res):
                row.ok, row.note = False, fail(res)
                continue
            row.error = max(_rel(_assemble(res, n), ref[n]) for n in ref)
            if not row.error <= CHECK_TOLERANCE[cfg.dtype]:
                row.ok, row.note = False, f"WRONG: relative error {row.error:.2e} vs one process"
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
    from ..cost.presets import local
    from ..cost.profile import load_default

    return local(world, profile if profile is not None else load_default(), threads_per_rank=threads_per_rank,
                 cores=cores, nodes=nodes)
