"""The papers' evaluations, reproduced in the cost model (pure: data in, data out).

- RingX (:func:`ringx_case`, :func:`ring_bandwidth_for_speedup`): every RingX variant against ``ring``
  on the ``frontier`` preset over a grid of GCD counts, masks and batch x tokens-per-GCD shapes
  (weak scaling, as the RingX release's benchmark), with whether each fits a GCD's memory; and, per
  variant, the effective point-to-point bandwidth the ring would have to see for the variant to reach
  the paper's 3.4x (the collectives kept at the preset's figures).
- UltraAttn (:func:`ultra_pattern`, :func:`ultra_case`, :func:`ultra_averages`): ``ultra`` (estimated
  from its plan) against the ring-family baselines and all-gather on the ``dgx-h100`` preset, per
  block-sparse pattern, sequence length, head count and GPU count, and the average over patterns
  against the paper's 5.5x.

Everything goes through :func:`cpattn.cost.estimate` and :func:`cpattn.cost.preset`; nothing here
depends on how a schedule or a collective is priced. The command line is ``cpattn reproduce``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from .. import schedules
from ..core.masks import resolve
from ..core.steps import Problem
from ..core.topology import Link, Topology
from ..cost.estimate import Estimate, check_supports, estimate
from ..cost.presets import preset

#: RingX's headline: collective variants up to 3.4x faster than ring attention on Frontier
RINGX_CLAIM = 3.4
#: UltraAttn's headline: 5.5x on average over context-parallel baselines, block-sparse patterns, 64 GPUs
ULTRA_CLAIM = 5.5

# --- RingX: the release's benchmark grid (weak scaling: constant tokens per GCD)
RINGX_TOPOLOGY = "frontier"
RINGX_GCDS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
RINGX_MASKS = ("full", "causal")
#: (batch, tokens per GCD): the release ran batches 32 to 256 and 1K to 8K local tokens; these pairs keep
#: batch x tokens (the tokens a GCD holds) constant
RINGX_SHAPES = ((256, 1024), (128, 2048), (64, 4096), (32, 8192))
#: the release set NCCL_ALGO=Tree, which in NCCL/RCCL changes the all-reduce only (their broadcast and
#: reduce are rings whatever it says); ``--algorithm tree`` prices tree broadcasts and reduces as well
RINGX_ALGORITHM = "all_reduce:tree;broadcast:ring;reduce:ring"
RINGX_BASELINE = "ring"
#: shown for context next to the causal variants (same p2p traffic as ring, balanced layouts)
RINGX_CONTEXT = ("zigzag_ring", "stripe_ring")

# --- UltraAttn: patterns on blocks of 1/16 of the sequence (our reading of the paper's parameters)
ULTRA_TOPOLOGY = "dgx-h100"
ULTRA_PATTERNS = ("strided", "global_local", "star", "streaming")
ULTRA_BLOCKS = 16
ULTRA_RING_FAMILY = ("ring", "zigzag_ring", "stripe_ring")
ULTRA_BASELINES = ("ring", "zigzag_ring", "stripe_ring", "allgather")


def ringx_variants(mask: str) -> list[str]:
    """The registered RingX variants (``ringx*``) that run ``mask``, in registry order."""
    m = resolve(mask)
    out = []
    for name in [n for n in schedules.names() if n.startswith("ringx")]:
        try:
            schedules.get(name).check_mask(m)
            out.append(name)
        except (ValueError, NotImplementedError):
            pass
    return out


@dataclass(frozen=True)
class Case:
    """Estimates of several schedules on one problem and topology. ``estimates``: schedule -> its
    :class:`Estimate`; ``notes``: schedule -> why it has none (it cannot run the problem); ``memory``:
    the device's memory (bytes); ``seconds``: wall time each estimate took (planning included)."""

    problem: Problem
    topology: str
    memory: int
    estimates: dict[str, Estimate]
    notes: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def total(self, name: str) -> float | None:
        """Seconds of ``name``, None when it has no estimate."""
        est = self.estimates.get(name)
        return None if est is None else est.total

    def fits(self, name: str) -> bool:
        """Whether ``name``'s peak memory per rank fits the device (False without an estimate)."""
        est = self.estimates.get(name)
        return est is not None and est.peak_memory <= self.memory

    def speedup(self, name: str, over: str | None) -> float | None:
        """T(over) / T(name); None when either has no estimate (or ``over`` is None)."""
        a, b = self.total(name), self.total(over)
        return None if a is None or b is None else b / a

    def fastest(self, names: Iterable[str], fitting: bool = True) -> str | None:
        """The fastest of ``names`` that has an estimate (and fits the device when ``fitting``)."""
        ok = [n for n in names if n in self.estimates and (self.fits(n) or not fitting)]
        return min(ok, key=lambda n: self.estimates[n].total, default=None)

    def to_json(self) -> dict:
        p = self.problem
        return {"seq_len": p.seq_len, "world": p.world, "mask": p.mask.spec(), "batch": p.batch, "heads": p.heads,
                "kv_heads": p.kv_heads, "head_dim": p.head_dim, "dtype": p.dtype, "topology": self.topology,
                "device_memory": self.memory,
                "estimates": {n: {"total": e.total, "compute": e.compute, "comm": e.comm,
                                  "exposed_comm": e.exposed_comm, "bytes_per_rank": e.bytes_per_rank,
                                  "peak_memory": e.peak_memory, "fits": self.fits(n), "seconds": self.seconds.get(n)}
                              for n, e in self.estimates.items()},
                "notes": dict(self.notes)}


def estimate_case(problem: Problem, topology: Topology, names: Iterable[str | object], phase: str = "forward+backward",
                  progress: Callable[[str], None] | None = None) -> Case:
    """Estimate every schedule of ``names`` (a name, or a Schedule with options, e.g. planner settings,
    kept under its name) on ``problem`` over ``topology``; those that cannot run it get a note instead
    (``check_supports``/``estimate`` refuse with ValueError, TypeError or NotImplementedError).
    ``progress(name)`` is called before each estimate."""
    import time

    ests: dict[str, Estimate] = {}
    notes: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for sched in names:
        name = sched if isinstance(sched, str) else sched.name
        if progress is not None:
            progress(name)
        start = time.perf_counter()
        try:
            check_supports(sched, problem)
            ests[name] = estimate(sched, problem, topology, phase)
        except (ValueError, TypeError, NotImplementedError) as exc:
            notes[name] = str(exc)
        seconds[name] = time.perf_counter() - start
    return Case(problem, topology.name, topology.device.memory, ests, notes, seconds)


# ----------------------------------------------------------------------------------------------- RingX
def ringx_topology(gcds: int, algorithm: str = RINGX_ALGORITHM) -> Topology:
    return preset(RINGX_TOPOLOGY, gcds, algorithm=algorithm)


def ringx_schedules(mask: str, context: bool = True) -> list[str]:
    """``ring``, the RingX variants that run ``mask`` and, for causal masks when ``context``, the
    balanced rings (for full attention they equal ``ring``)."""
    extra = list(RINGX_CONTEXT) if context and resolve(mask).is_causal else []
    return [RINGX_BASELINE, *extra, *ringx_variants(mask)]


def ringx_case(mask: str, gcds: int, batch: int, tokens_per_gcd: int, heads: int = 32, kv_heads: int = 32,
               head_dim: int = 128, dtype: str = "bfloat16", algorithm: str = RINGX_ALGORITHM,
               phase: str = "forward+backward", context: bool = True) -> Case:
    """``ring``, every RingX variant for ``mask`` (and the balanced rings for causal masks when
    ``context``) at one grid point on the RingX preset with collective ``algorithm``: ``tokens_per_gcd x
    gcds`` global tokens (weak scaling)."""
    problem = Problem(tokens_per_gcd * gcds, gcds, mask, batch, heads, kv_heads, head_dim, dtype)
    return estimate_case(problem, ringx_topology(gcds, algorithm), ringx_schedules(mask, context), phase)


@dataclass(frozen=True)
class BandwidthGap:
    """What the ring's point-to-point bandwidth would have to be for ``variant`` to be ``target`` times
    faster than ``ring`` (the variant priced on the unchanged topology).

    ``factor``: the multiplier of the topology's intra- and inter-node link bandwidths at which the ring
    takes ``target`` times the variant's time (None: no factor in ``[lo, hi]`` does it; ``reason`` says
    why). ``bandwidth`` / ``preset_bandwidth``: the link the ring's transfers cross (the NIC when the
    ranks span nodes, else the intra-node link), scaled and as preset (bytes/s per direction).
    ``overlap``: the fraction of the ring's communication hidden behind compute that was assumed.
    ``speedup``: T(ring at factor) / T(variant), within ``rtol`` of ``target`` when found; ``at_preset``:
    the variant's speedup with the preset's figures; ``evaluations``: ring estimates it took."""

    variant: str
    target: float
    factor: float | None
    bandwidth: float | None
    preset_bandwidth: float
    link: str
    overlap: float
    speedup: float | None
    at_preset: float
    reason: str
    evaluations: int

    @property
    def found(self) -> bool:
        return self.factor is not None


def scale_links(topology: Topology, factor: float) -> Topology:
    """``topology`` with its intra- and inter-node link bandwidths (and any measured per-op links)
    multiplied by ``factor``; latencies unchanged."""
    def scaled(link: Link) -> Link:
        return Link(link.latency, link.bandwidth * factor)

    return replace(topology, intra=scaled(topology.intra), inter=scaled(topology.inter),
                   op_links=tuple((op, scaled(link)) for op, link in topology.op_links))


def ring_bandwidth_for_speedup(variant: str | Estimate, problem: Problem, topology: Topology,
                               target: float = RINGX_CLAIM, phase: str = "forward+backward",
                               overlap: float | None = None, baseline: str = RINGX_BASELINE, lo: float = 1e-4,
                               hi: float = 1e4, rtol: float = 1e-3, max_evaluations: int = 60) -> BandwidthGap:
    """Find the link-bandwidth factor f at which ``baseline`` (``ring``: point-to-point only) takes
    ``target`` times as long as ``variant`` (a name, or its estimate on ``topology``), searching f in
    ``[lo, hi]``. ``overlap``: price the ring with this overlap fraction (None: the topology's).

    T_ring(f) falls as f grows; with u = 1/f it is increasing and, for step-wise max(compute, transfer)
    pricing, convex and piecewise linear, so a safeguarded regula falsi (Illinois) in u converges in a
    few estimates, with a bisection in log f whenever it stalls. Returns a :class:`BandwidthGap`;
    ``factor`` None when the ring is still faster than ``target`` allows at ``lo`` (it would need a
    lower bandwidth) or still slower at ``hi`` (its compute and latencies alone exceed ``target`` times
    the variant: no bandwidth does it)."""
    return ring_bandwidth_gaps([variant], problem, topology, target, phase, overlap, baseline, lo, hi, rtol,
                               max_evaluations)[0]


def ring_bandwidth_gaps(variants: Iterable[str | Estimate], problem: Problem, topology: Topology,
                        target: float = RINGX_CLAIM, phase: str = "forward+backward", overlap: float | None = None,
                        baseline: str = RINGX_BASELINE, lo: float = 1e-4, hi: float = 1e4, rtol: float = 1e-3,
                        max_evaluations: int = 60) -> list[BandwidthGap]:
    """:func:`ring_bandwidth_for_speedup` for several variants of one problem, sharing the ring's
    estimates (the bracket ends and the preset point are the same for all)."""
    base_topo = topology if overlap is None else replace(topology, overlap=overlap)
    seen: dict[float, float] = {}

    def ring_time(f: float) -> float:
        if f not in seen:
            seen[f] = estimate(baseline, problem, scale_links(base_topo, f), phase).total
        return seen[f]

    preset_ring = ring_time(1.0) if base_topo == topology else estimate(baseline, problem, topology, phase).total
    link = "inter" if topology.nodes > 1 else "intra"
    preset_bw = (topology.inter if link == "inter" else topology.intra).bandwidth
    out = []
    for variant in variants:
        var_est = variant if isinstance(variant, Estimate) else estimate(variant, problem, topology, phase)
        before = len(seen)
        f, reason = _gap(var_est, ring_time, target, lo, hi, rtol, max_evaluations, baseline)
        out.append(BandwidthGap(var_est.schedule, target, f, None if f is None else f * preset_bw, preset_bw, link,
                                base_topo.overlap, None if f is None else ring_time(f) / var_est.total,
                                preset_ring / var_est.total, reason, len(seen) - before))
    return out


def _gap(var_est: Estimate, ring_time: Callable[[float], float], target: float, lo: float, hi: float, rtol: float,
         max_evaluations: int, baseline: str) -> tuple[float | None, str]:
    """``(factor, "")``, or ``(None, why not)``: the root of T_ring(f) = target x T_variant (see
    :func:`ring_bandwidth_for_speedup`)."""
    name, goal = var_est.schedule, target * var_est.total
    # g(u) = T_ring(1/u) - goal: increasing in u = 1/f
    u_a, u_b = 1.0 / hi, 1.0 / lo
    g_a, g_b = ring_time(hi) - goal, ring_time(lo) - goal
    if g_a > 0:
        return None, (f"{baseline} is {ring_time(hi) / var_est.total:.3g}x slower than {name} even at {hi:g}x the "
                      f"bandwidth (its compute and latencies alone): {name} is over {target:g}x at any bandwidth")
    if g_b < 0:
        return None, (f"{baseline} is only {ring_time(lo) / var_est.total:.3g}x slower than {name} at {lo:g}x the "
                      f"bandwidth: {name} is not {target:g}x faster at any bandwidth in range")
    side = 0
    for _ in range(max_evaluations):
        u = (u_a * g_b - u_b * g_a) / (g_b - g_a)
        if not (u_a < u < u_b) or abs(side) >= 3:  # stalled on one side: bisect in log f
            u = math.sqrt(u_a * u_b)
            side = 0
        g = ring_time(1.0 / u) - goal
        if abs(g) <= rtol * goal:
            return 1.0 / u, ""
        if g < 0:
            u_a, g_a = u, g
            g_b = g_b / 2 if side < 0 else g_b  # Illinois: the end kept twice counts half
            side = min(side, 0) - 1
        else:
            u_b, g_b = u, g
            g_a = g_a / 2 if side > 0 else g_a
            side = max(side, 0) + 1
        if u_b / u_a <= 1 + rtol:
            u = u_a if abs(ring_time(1.0 / u_a) - goal) < abs(ring_time(1.0 / u_b) - goal) else u_b
            return 1.0 / u, ""
    return None, f"no convergence in {max_evaluations} steps"


# ------------------------------------------------------------------------------------------ UltraAttn
def ultra_pattern(name: str, seq_len: int, blocks: int = ULTRA_BLOCKS) -> dict:
    """The mask spec of UltraAttn pattern ``name`` on ``seq_len`` tokens cut into ``blocks`` blocks.
    Our reading of the paper's parameters: strided with stride 4 and a local band of 3 blocks (causal);
    global+local with 1 global and 1 local block (bidirectional); star with 1 sink block; streaming
    with 1 sink block and a window of 3 blocks (causal)."""
    if seq_len % blocks:
        raise ValueError(f"seq_len={seq_len} must be a multiple of the {blocks} pattern blocks")
    b = seq_len // blocks
    specs = {"strided": {"kind": "strided", "block_size": b, "stride": 4, "local": 3},
             "global_local": {"kind": "global_local", "block_size": b, "global_blocks": 1, "local_blocks": 1},
             "star": {"kind": "star", "block_size": b, "sink": 1},
             "streaming": {"kind": "streaming", "block_size": b, "sink": 1, "window": 3}}
    if name not in specs:
        raise ValueError(f"UltraAttn pattern {name!r} is unknown; accepted: {', '.join(specs)}")
    return specs[name]


def ultra_case(pattern: str, seq_len: int, gpus: int, heads: int = 32, kv_heads: int = 32, head_dim: int = 128,
               dtype: str = "bfloat16", baselines: Iterable[str] = ULTRA_BASELINES, phase: str = "forward+backward",
               ultra: object = "ultra", progress: Callable[[str], None] | None = None) -> Case:
    """``ultra`` (from its plan: built by the planner, or read from the plan cache) and ``baselines`` on
    one pattern, sequence length and GPU count of the UltraAttn preset (batch 1). ``ultra``: the
    schedule to estimate under that name (a Schedule with planner options, or the name); ``progress``: as
    for :func:`estimate_case`."""
    problem = Problem(seq_len, gpus, ultra_pattern(pattern, seq_len), 1, heads, kv_heads, head_dim, dtype)
    return estimate_case(problem, preset(ULTRA_TOPOLOGY, gpus), [*baselines, ultra], phase, progress=progress)


@dataclass(frozen=True)
class UltraSpeedup:
    """``ultra``'s speedup on one case over the best ring-family baseline and over the best baseline
    including all-gather (None where a side has no estimate), with which baselines those were."""

    pattern: str
    seq_len: int
    gpus: int
    heads: int
    ultra: float | None
    best_ring: str | None
    vs_ring: float | None
    best_any: str | None
    vs_any: float | None


def ultra_speedup(pattern: str, case: Case) -> UltraSpeedup:
    ring = case.fastest(ULTRA_RING_FAMILY, fitting=False)
    anyb = case.fastest([n for n in case.estimates if n != "ultra"], fitting=False)
    p = case.problem
    return UltraSpeedup(pattern, p.seq_len, p.world, p.heads, case.total("ultra"), ring, case.speedup("ultra", ring),
                        anyb, case.speedup("ultra", anyb))


def ultra_averages(rows: Iterable[UltraSpeedup]) -> list[dict]:
    """Per (sequence length, heads, GPUs): the arithmetic mean over patterns of ``ultra``'s speedup over
    the best ring-family baseline and over the best baseline including all-gather (as the paper
    averages), with the patterns counted."""
    groups: dict[tuple[int, int, int], list[UltraSpeedup]] = {}
    for r in rows:
        groups.setdefault((r.seq_len, r.heads, r.gpus), []).append(r)
    out = []
    for (seq, heads, gpus), rs in groups.items():
        ring = [r.vs_ring for r in rs if r.vs_ring is not None]
        anyb = [r.vs_any for r in rs if r.vs_any is not None]
        out.append({"seq_len": seq, "heads": heads, "gpus": gpus, "patterns": len(rs),
                    "mean_vs_ring_family": sum(ring) / len(ring) if ring else None,
                    "mean_vs_best": sum(anyb) / len(anyb) if anyb else None})
    return out


__all__ = ["RINGX_CLAIM", "ULTRA_CLAIM", "BandwidthGap", "Case", "UltraSpeedup", "estimate_case",
           "ring_bandwidth_for_speedup", "ring_bandwidth_gaps", "ringx_case", "ringx_schedules", "ringx_topology",
           "ringx_variants", "scale_links", "ultra_averages", "ultra_case", "ultra_pattern", "ultra_speedup"]
