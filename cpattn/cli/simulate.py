"""``cpattn simulate``: predict every schedule on a topology at many GPU counts (the cost model)."""

from __future__ import annotations

import argparse

from . import args as a
from .output import Column, footnotes, save_json, schedule_style, stderr, stdout, table, to_stdout

DEFAULT_GPUS = [8, 64, 512, 4096]
#: the longest note kept in its cell; a longer one (why a schedule cannot run) is a numbered footnote
SHORT_NOTE = 24
#: the table's columns; ``drop``: the order in which they are left out of a narrow terminal (1 first)
TABLE = (Column("GPUs"), Column("seq", drop=4), Column("schedule", "left"), Column("total ms"),
         Column("compute ms", drop=3), Column("comm ms", drop=5), Column("exposed ms", drop=7),
         Column("TFLOP/s/GPU", drop=6), Column("vs ring"), Column("sent MB/GPU", drop=2),
         Column("wire MB/GPU", drop=1), Column("peak GiB/GPU", drop=8), Column("note", "left", wrap=True))
#: the model mode's columns
MODEL_TABLE = (Column("schedule", "left"), Column("step s"), Column("attention s", drop=3), Column("dense s", drop=2),
               Column("grad sync s (exposed)", drop=1), Column("tokens/s", drop=4), Column("MFU"),
               Column("vs reference"))


def add_parser(sub) -> argparse.ArgumentParser:
    m = sub.add_parser("simulate", help="predict every schedule on a topology preset at many GPU counts")
    m.add_argument("--topology", type=a.topology(), default="frontier",
                   help="frontier, dgx-h100, dgx-a100 or local (default frontier), or NxD (generic figures, "
                        "implies --gpus)")
    m.add_argument("--gpus", type=a.csv(a.positive), default=None,
                   help="comma-separated GPU counts (default 8,64,512,4096, or the devices of an NxD topology)")
    m.add_argument("--seq", type=a.positive, default=None, help="global sequence length (strong scaling)")
    m.add_argument("--seq-per-gpu", type=a.positive, default=None, help="tokens per GPU (weak scaling)")
    m.add_argument("--mask", type=a.mask, default="causal",
                   help='causal, full, or a mask spec (cpattn.masks.from_spec) as JSON, e.g. '
                        '\'{"kind": "star", "block_size": 2048, "sink": 1}\'')
    m.add_argument("--batch", type=a.positive, default=1)
    m.add_argument("--heads", type=a.positive, default=32)
    m.add_argument("--kv-heads", type=a.positive, default=8)
    m.add_argument("--head-dim", type=a.positive, default=128)
    m.add_argument("--dtype", default="bfloat16", choices=a.dtypes())
    m.add_argument("--phase", default="forward+backward", choices=["forward", "backward", "forward+backward"])
    m.add_argument("--schedules", type=a.csv(str), default=None,
                   help="comma-separated (default: all registered; ultra only for masks other than causal and full)")
    m.add_argument("--model", default=None, help="model-level mode: a decoder config (e.g. llama3-8b) trained with "
                                                 "--cp x --dp; predicts step time and MFU per schedule")
    m.add_argument("--cp", type=int, default=None, help="model mode: context-parallel degree")
    m.add_argument("--dp", type=int, default=1, help="model mode: data-parallel degree")
    m.add_argument("--matmul-efficiency", type=float, default=None,
                   help="model mode: fraction of the matmul peak the dense layers reach (default: the preset's "
                        "figure, cost.presets.MATMUL_EFFICIENCY: 0.66 for frontier; 0.7 where there is none)")
    m.add_argument("--peak-tflops", type=float, default=None,
                   help="model mode: dense bf16 peak per device (default: the preset's data-sheet figure)")
    m.add_argument("--reference-mfu", type=float, default=0.38,
                   help="model mode: the MFU to compare with (default 0.38, RingX's Llama3-8B at 1M tokens)")
    m.add_argument("--inference", action="store_true",
                   help="inference mode: prefill time per schedule and per-token decode latency per merge of --model "
                        "(default llama3-8b; also llama3-405b) at --seq tokens (default 1M) on --gpus = cp x --tp "
                        "devices, the key/value cache sharded over the context-parallel group")
    m.add_argument("--tp", type=a.positive, default=1, help="inference mode: tensor-parallel devices per "
                                                            "context-parallel rank (default 1)")
    m.add_argument("--profile", help="calibration profile for --topology local")
    m.add_argument("--algorithm", type=a.algorithm, default=None,
                   help="collective algorithms: auto (what NCCL/RCCL pick per op and size), ring, tree (for "
                        "all-reduce, broadcast and reduce), or per op, e.g. 'all_reduce:tree;broadcast:ring' (default: "
                        "$NCCL_ALGO if set, read as NCCL does: a bare ring or tree sets the all-reduce only; else "
                        "auto; local: the algorithms its calibration fitted)")
    m.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH ('-': to stdout, in place of "
                                                  "the tables)")
    m.add_argument("--plot", default="simulate.png", help="scaling plot PNG (default simulate.png; '' for none)")
    m.set_defaults(func=run)
    return m


def algorithm_choice(given: str | None) -> str | None:
    """The collective algorithms to simulate with: ``--algorithm``, else ``$NCCL_ALGO`` when set (it must
    be a spec ``--algorithm`` accepts; a bare "ring" or "tree" sets the all-reduce only, as in NCCL and
    RCCL, whose broadcast and reduce are always rings), else None (the topology's own: auto, or local's
    calibrated ones)."""
    import os

    from ..core.topology import parse_algorithm

    if given is not None:
        return given
    env = os.environ.get("NCCL_ALGO")
    if not env:
        return None
    try:
        parse_algorithm(env)
    except ValueError as exc:
        raise ValueError(f"NCCL_ALGO={env!r} sets the default of --algorithm but is not understood ({exc}); pass "
                         "--algorithm explicitly, e.g. --algorithm auto") from None
    bare = env.strip().lower()
    return f"all_reduce:{bare}" if bare in ("ring", "tree") else env


def run(args) -> int:
    from dataclasses import replace

    from rich.progress import Progress

    from .. import cost, schedules
    from ..core.masks import resolve
    from ..core.steps import split_phase

    if args.inference:
        from .simulate_inference import run_inference

        return run_inference(args)
    if args.model is not None:
        return run_model(args)
    if (args.seq is None) == (args.seq_per_gpu is None):
        raise ValueError("give exactly one of --seq (global tokens) and --seq-per-gpu (tokens per GPU)")
    gpus = a.device_counts(args.topology, args.gpus, DEFAULT_GPUS, "--gpus")
    mask = resolve(args.mask)
    names, skipped, unmodelled = [], [], []
    candidates = args.schedules or cost.default_candidates(mask)
    unplanned = [] if args.schedules else [n for n in schedules.names() if n not in candidates]
    for name in candidates:
        try:
            schedules.get(name).check_mask(mask)
        except (ValueError, NotImplementedError):
            skipped.append(name)
            continue
        (names if cost.estimable(name) else unmodelled).append(name)
    prof = a.load_profile(args.profile) if args.topology.preset == "local" else None
    algo = algorithm_choice(args.algorithm)
    rows, bounds = [], {}
    with Progress(console=stderr(), transient=True) as progress:
        task = progress.add_task("simulate", total=len(gpus) * len(names))
        for p in gpus:
            topo = args.topology.build(p, prof)
            if algo is not None:
                topo = replace(topo, algorithm=algo)
            seq = args.seq if args.seq is not None else args.seq_per_gpu * p
            try:
                problem = cost.Problem(seq, p, mask, args.batch, args.heads, args.kv_heads, args.head_dim, args.dtype)
            except ValueError as exc:
                rows += [{"gpus": p, "seq": seq, "schedule": n, "estimate": None, "note": str(exc)} for n in names]
                progress.advance(task, len(names))
                continue
            dev = topo.device  # the bound: every rank does 1/P of the work at the large-block rates
            bounds[p] = sum(problem.flops(ph) / p / (dev.forward_flops if ph == "forward" else dev.backward_flops)
                            for ph in split_phase(args.phase))
            for name in names:
                progress.update(task, description=f"P={p} {name}")
                rows.append(_row(name, problem, topo, args.phase))
                progress.advance(task)
    notes, ring = [], {r["gpus"]: r["estimate"] for r in rows if r["schedule"] == "ring" and r["estimate"] is not None}
    cells = []
    for r in rows:
        e = r["estimate"]
        short = len(r["note"]) <= SHORT_NOTE  # e.g. "exceeds 64 GiB" stays in its cell; longer notes are footnotes
        notes.append("" if short else r["note"])
        if e is None:
            cells.append([str(r["gpus"]), str(r["seq"]), r["schedule"], *["-"] * 9, ""])
            continue
        vs = f"{ring[r['gpus']].total / e.total:.2f}x" if r["gpus"] in ring else "-"
        cells.append([str(r["gpus"]), str(r["seq"]), r["schedule"], f"{e.total * 1e3:.4g}", f"{e.compute * 1e3:.4g}",
                      f"{e.comm * 1e3:.4g}", f"{e.exposed_comm * 1e3:.4g}", f"{e.tflops_per_rank(r['gpus']):.3g}", vs,
                      f"{e.bytes_per_rank / 1e6:.4g}", f"{e.wire_bytes_per_rank / 1e6:.4g}",
                      f"{e.peak_memory / 2**30:.3g}", ""])
    marks, texts = footnotes(notes)
    for row, r, mark in zip(cells, rows, marks):
        row[-1] = mark or r["note"]
    quiet = to_stdout(args.json)
    out = stdout(quiet)
    out.print(table(TABLE, cells,
                    title=f"cpattn simulate: {args.topology}, {mask!r}, h={args.heads}:{args.kv_heads} "
                          f"d={args.head_dim} b={args.batch} {args.dtype}, {args.phase}, "
                          f"collectives {algo or 'default'}",
                    caption="times on the busiest rank; TFLOP/s counts allowed (q, k) pairs (bwd = 2.5 x fwd); "
                            "vs ring = T(ring) / T(schedule); sent = payload of the busiest rank, wire = what the "
                            "busiest rank sends on the wire, forwarding for others included (collective algorithms)",
                    everything="--json PATH has every figure"))
    for text in texts:
        out.print(text, highlight=False)
    if bounds:
        out.print("balanced bound (every GPU does 1/P of the work at the device's large-block rate, no "
                  "communication): " + ", ".join(f"P={p}: {b * 1e3:.4g} ms" for p, b in bounds.items()))
    if skipped:
        out.print(f"not shown, they cannot run the {mask.name} mask: {', '.join(skipped)}")
    if unmodelled:
        out.print(f"not modelled (they do not implement steps(problem, phase)): {', '.join(unmodelled)}")
    if unplanned:
        out.print(f"not planned for the {mask.name} mask unless named in --schedules (planning takes seconds "
                  f"per size): {', '.join(unplanned)}")
    if args.json:
        from dataclasses import asdict

        save_json([{**r, "estimate": asdict(r["estimate"]) if r["estimate"] else None} for r in rows], args.json)
    if args.plot:
        plot(rows, args, mask.name, args.plot)
        stderr().print(f"wrote {args.plot}")
    return 0


def run_model(args) -> int:
    """Model-level mode: one training step of ``--model`` at ``--seq`` tokens per replica on ``--cp`` x
    ``--dp`` devices of the topology, per schedule (``cpattn.cost.training``)."""
    from dataclasses import asdict, replace

    from .. import cost, schedules
    from ..core.masks import resolve
    from ..cost.presets import DEFAULT_MATMUL_EFFICIENCY, MATMUL_EFFICIENCY, MATMUL_PEAK
    from ..cost.training import DecoderShape, dp_group, step_estimate
    from ..models import flops
    from ..models.llama import LLAMA_CONFIGS

    if args.model not in LLAMA_CONFIGS:
        raise ValueError(f"--model {args.model!r} is unknown; accepted: {', '.join(LLAMA_CONFIGS)}")
    if args.cp is None or args.cp < 1 or args.dp < 1:
        raise ValueError("model mode needs --cp (and --dp, default 1) of at least 1")
    if args.seq_per_gpu is not None:
        raise ValueError("model mode takes --seq (tokens per sequence), not --seq-per-gpu")
    preset = args.topology.preset
    peak = args.peak_tflops * 1e12 if args.peak_tflops else MATMUL_PEAK.get(preset)
    if peak is None:
        raise ValueError(f"--peak-tflops is needed: no matmul peak is known for topology {args.topology}")
    conf = LLAMA_CONFIGS[args.model]
    shape = DecoderShape(conf.layers, conf.heads, conf.kv_heads, conf.head_dim, flops.matmul_param_count(conf),
                         flops.param_count(conf))
    seq = args.seq or 1 << 20
    mask = resolve(args.mask)
    efficiency = args.matmul_efficiency
    if efficiency is None:
        efficiency = MATMUL_EFFICIENCY.get(preset, DEFAULT_MATMUL_EFFICIENCY)
    algo = algorithm_choice(args.algorithm)

    def build(world: int, profile=None):
        built = args.topology.build(world, profile)
        return built if algo is None else replace(built, algorithm=algo)

    topo = build(args.cp, a.load_profile(args.profile) if preset == "local" else None)
    # the gradient all-reduce's group on the whole machine (a preset); else each replica on nodes of its own
    dp_topo = dp_group(build(args.cp * args.dp), args.cp) if preset in MATMUL_PEAK else None
    names = args.schedules or [n for n in cost.default_candidates(mask) if cost.estimable(n)]
    rows, skipped = [], []
    for name in names:
        try:
            schedules.get(name).check_mask(mask)
            cost.check_supports(name, cost.Problem(seq, args.cp, mask, 1, conf.heads, conf.kv_heads, conf.head_dim))
            rows.append(step_estimate(shape, seq, args.cp, args.dp, mask, name, topo, peak, efficiency, dp_topo))
        except (ValueError, TypeError, NotImplementedError) as exc:
            if args.schedules:  # asked for by name: say why not
                stderr().print(f"{name}: {exc}")
            skipped.append(name)
    out = stdout(to_stdout(args.json))
    out.print(table(MODEL_TABLE, [[r.schedule, f"{r.step:.4g}", f"{r.attention:.4g}", f"{r.dense:.4g}",
                                   f"{r.grad_sync:.3g} ({r.grad_sync_exposed:.3g})", f"{r.tokens_per_s:.4g}",
                                   f"{100 * r.mfu:.1f}%", f"{r.mfu / args.reference_mfu:.2f}x"]
                                  for r in sorted(rows, key=lambda r: r.step)],
                    title=f"{args.model} at {seq} tokens, cp {args.cp} x dp {args.dp} = {args.cp * args.dp} devices "
                          f"on {args.topology}, {mask.name} (peak {peak / 1e12:.4g} TFLOP/s per device, dense layers "
                          f"at {100 * efficiency:.0f}% of it)",
                    caption=f"MFU counts 6N plus the attention pairs the mask computes; reference MFU "
                            f"{100 * args.reference_mfu:.0f}%", everything="--json PATH has every figure"))
    if skipped:
        out.print(f"not shown, they cannot run this problem: {', '.join(skipped)}")
    if args.json:
        save_json([asdict(r) for r in rows], args.json)
    return 0


def _row(name: str, problem, topo, phase: str) -> dict:
    """One table row: the estimate, a note when it exceeds the device memory, or why there is none.
    ``check_supports`` refuses with ValueError, TypeError or NotImplementedError (its contract);
    ``estimate`` with ValueError or NotImplementedError. Anything else is a bug and propagates."""
    from .. import cost

    row = {"gpus": problem.world, "seq": problem.seq_len, "schedule": name, "estimate": None, "note": ""}
    try:
        cost.check_supports(name, problem)
    except (ValueError, TypeError, NotImplementedError) as exc:
        row["note"] = str(exc)
        return row
    try:
        est = cost.estimate(name, problem, topo, phase)
    except (ValueError, NotImplementedError) as exc:
        row["note"] = str(exc)
        return row
    row["estimate"] = est
    if est.peak_memory > topo.device.memory:
        row["note"] = f"exceeds {topo.device.memory / 2**30:.0f} GiB"
    return row


def plot(rows: list[dict], args, mask_label: str, path: str) -> None:
    """PNG: predicted time and TFLOP/s per GPU versus GPUs, one line per schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(r["schedule"] for r in rows):
        pts = [(r["gpus"], r["estimate"]) for r in rows if r["schedule"] == name and r["estimate"] is not None]
        if not pts:
            continue
        gpus = [g for g, _ in pts]
        style = schedule_style(name)  # colour, marker and dashes: no two schedules alike, the same in every plot
        ax_t.plot(gpus, [e.total for _, e in pts], label=name, **style)
        ax_f.plot(gpus, [e.tflops_per_rank(g) for g, e in pts], label=name, **style)
    scaling = f"{args.seq} tokens" if args.seq is not None else f"{args.seq_per_gpu} tokens per GPU"
    for ax, label in ((ax_t, "predicted time (s)"), (ax_f, "attention TFLOP/s per GPU")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    ax_f.legend(fontsize=8)
    fig.suptitle(f"{args.topology}: {mask_label}, {scaling}, h={args.heads}:{args.kv_heads} d={args.head_dim}, "
                 f"{args.phase}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
