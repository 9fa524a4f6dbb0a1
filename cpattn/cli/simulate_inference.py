"""``cpattn simulate --inference``: predicted prefill time per schedule and per-token decode latency per merge
of a decoder whose key/value cache is sharded over context-parallel groups (``cpattn.cost.inference``),
next to the published figures of the same configuration when there are some.

Each GPU count is ``cp x tp`` devices of the topology preset: tensor parallelism (``--tp``) inside a
context-parallel rank, the context-parallel group across them. A row whose weights and cache do not fit
in a device is marked, not dropped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..output import Column, save_json, stdout, table, to_stdout

#: the context of the published prefill figures (Meta's "1M")
MILLION = 1 << 20


@dataclass(frozen=True)
class Published:
    """A published prefill measurement: ``seconds`` for ``seq`` tokens of ``model`` on ``gpus`` devices of
    ``topology`` as ``cp`` context-parallel ranks of ``tp`` devices, with its parallel efficiency."""

    source: str
    model: str
    topology: str
    seq: int
    gpus: int
    cp: int
    tp: int
    seconds: float
    efficiency: float
    mfu: float


#: Yang et al., "Context Parallelism for Scalable Million-Token Inference" (Meta, 2024, arXiv 2411.01783),
#: abstract: "1M context prefill with Llama3 405B model in 77s (93% parallelization efficiency, 63% FLOPS
#: utilization)" with "up to 128 H100 GPUs across 16 nodes" (16 context-parallel nodes of 8 GPUs, read here
#: as tensor parallelism 8 inside each node)
PUBLISHED = (Published("Meta context-parallel inference (Yang et al. 2024)", "llama3-405b", "dgx-h100", MILLION, 128,
                       16, 8, 77.0, 0.93, 0.63),)


def models() -> dict:
    """The decoders inference mode knows: the reference configs and Llama 3.1 405B (its published sizes:
    126 layers of width 16,384, 128 query and 8 key/value heads of 128, SwiGLU width 53,248)."""
    from ..models.llama import LLAMA_CONFIGS, LlamaConfig

    return {**LLAMA_CONFIGS, "llama3-405b": LlamaConfig(vocab=128256, dim=16384, layers=126, heads=128, kv_heads=8,
                                                        ffn_dim=53248)}


def run_inference(args) -> int:
    from .. import cost, schedules
    from ..core.masks import causal
    from ..cost import inference as icost
    from ..cost.presets import DEFAULT_MATMUL_EFFICIENCY, MATMUL_EFFICIENCY, MATMUL_PEAK
    from ..models.flops import matmul_param_count, param_count
    from . import args as a

    known = models()
    name = args.model or "llama3-8b"
    if name not in known:
        raise ValueError(f"--model {name!r} is unknown; accepted: {', '.join(known)}")
    conf = known[name]
    tp = args.tp
    shape = icost.ModelShape(conf.layers, conf.heads, conf.kv_heads, conf.head_dim, conf.dim, matmul_param_count(conf))
    preset = args.topology.preset
    peak = args.peak_tflops * 1e12 if args.peak_tflops else MATMUL_PEAK.get(preset)
    if peak is None:
        raise ValueError(f"--peak-tflops is needed: no matmul peak is known for topology {args.topology}")
    efficiency = args.matmul_efficiency or MATMUL_EFFICIENCY.get(preset, DEFAULT_MATMUL_EFFICIENCY)
    seq = args.seq or MILLION
    gpus = a.device_counts(args.topology, args.gpus, [tp * c for c in (1, 2, 4, 8, 16)], "--gpus")
    bad = [g for g in gpus if g % tp]
    if bad:
        raise ValueError(f"--gpus {bad}: every count must be a multiple of --tp {tp}")
    build, _ = a.topology_builder(args)
    names, causal_less = [], []
    for sched in args.schedules or [n for n in cost.default_candidates(causal()) if cost.estimable(n)]:
        try:
            schedules.get(sched).check_mask(causal())
            names.append(sched)
        except (ValueError, NotImplementedError):
            causal_less.append(sched)
    weights = param_count(conf) * 2 / tp  # bf16 weights per device
    prefill, decode, skipped = [], [], {}
    for g in gpus:
        cp = g // tp
        topo = build(g)
        single = build(tp)
        for sched in names:
            try:
                est = icost.prefill_estimate(shape, seq, cp, tp, sched, topo, peak, efficiency, args.dtype)
                base = icost.prefill_estimate(shape, seq, 1, tp, sched, single, peak, efficiency, args.dtype)
            except (ValueError, TypeError, NotImplementedError) as exc:
                skipped.setdefault(sched, str(exc))
                continue
            gib, memory = 2 ** 30, topo.device.memory
            note = "" if weights + est.kv_bytes <= memory else \
                f"bf16 weights {weights / gib:.0f} + cache {est.kv_bytes / gib:.0f} > {memory / gib:.0f} GiB"
            scaling = icost.parallel_efficiency(base.total, est.total, cp)
            prefill.append({"gpus": g, **asdict(est), "efficiency": scaling, "note": note})
        decode += [{"gpus": g, **asdict(d)} for d in icost.decode_estimate(shape, seq, cp, tp, topo, rows=args.batch)]
    title = (f"{name} at {seq} tokens, tp {tp} (dense layers at {100 * efficiency:.0f}% of {peak / 1e12:.4g} "
             "TFLOP/s)")
    # columns leave a narrow terminal in this order (drop 1 first); GPUs, schedule, times and MFU stay
    drop = {"dense s": 1, "TP comm s": 2, "attention s": 3, "cp x tp": 4, "KV GiB/GPU": 5, "efficiency": 6}
    cols = [Column(c, "left" if c in ("schedule", "note") else "right", drop=drop.get(c, 0), wrap=c == "note")
            for c in ("GPUs", "cp x tp", "schedule", "prefill s", "attention s", "dense s", "TP comm s", "MFU",
                      "efficiency", "KV GiB/GPU", "note")]
    rows = [[str(r["gpus"]), f"{r['cp']} x {r['tp']}", r["schedule"], f"{r['total']:.4g}", f"{r['attention']:.4g}",
             f"{r['dense']:.4g}", f"{r['tp_comm']:.3g}", f"{100 * r['mfu']:.1f}%", f"{100 * r['efficiency']:.1f}%",
             f"{r['kv_bytes'] / 2**30:.3g}", r["note"]] for r in prefill]
    out = stdout(to_stdout(args.json))
    out.print(table(cols, rows, title=f"cpattn simulate: {args.topology}, prefill of {title}",
                    caption="efficiency = T(cp=1) / (cp x T(cp)), the same schedule; MFU counts 2N per token and "
                            "the causal attention pairs", everything="--json PATH has every figure"))
    drop = {"weights ms": 1, "attention ms": 2, "TP comm ms": 3, "sent B/layer": 4}
    cols = [Column(c, "left" if c == "merge" else "right", drop=drop.get(c, 0))
            for c in ("GPUs", "cp x tp", "merge", "ms/token", "weights ms", "attention ms", "merge ms", "TP comm ms",
                      "sent B/layer")]
    rows = [[str(r["gpus"]), f"{r['cp']} x {r['tp']}", r["merge"] + (" *" if r["chosen"] else ""),
             f"{r['total'] * 1e3:.4g}", f"{r['weights'] * 1e3:.4g}", f"{r['attention'] * 1e3:.4g}",
             f"{r['merge_comm'] * 1e3:.4g}", f"{r['tp_comm'] * 1e3:.3g}", str(r["bytes_per_layer"])] for r in decode]
    out.print(table(cols, rows, title=f"cpattn simulate: {args.topology}, decoding {args.batch} row(s) of {title}",
                    caption="per generated token; weights and cache read once from memory; merge = the decode "
                            "merge's collectives over the CP group, all layers; * the cost model's choice",
                    everything="--json PATH has every figure"))
    for pub in PUBLISHED:
        ours = [r for r in prefill if r["gpus"] == pub.gpus and r["cp"] == pub.cp]
        if pub.model != name or pub.topology != preset or pub.seq != seq or not ours:
            continue
        best = min(ours, key=lambda r: r["total"])
        out.print(f"published ({pub.source}): {pub.seconds:g} s on {pub.gpus} GPUs (cp {pub.cp} x tp {pub.tp}), "
                  f"{100 * pub.efficiency:.0f}% parallel efficiency, {100 * pub.mfu:.0f}% FLOPS utilization; "
                  f"predicted: {best['total']:.3g} s ({best['schedule']}), {100 * best['efficiency']:.0f}% efficiency, "
                  f"{100 * best['mfu']:.0f}% MFU: {best['total'] / pub.seconds:.2f}x the published time")
    if causal_less:
        out.print(f"not shown, they cannot run the causal mask: {', '.join(causal_less)}")
    if skipped:
        out.print("not shown: " + "; ".join(f"{s} ({why})" for s, why in skipped.items()))
    if args.json:
        save_json({"prefill": prefill, "decode": decode}, args.json)
    return 0
