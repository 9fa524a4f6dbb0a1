"""``cpattn simulate``: predict every schedule on a topology at many GPU counts (the cost model)."""

from __future__ import annotations

import argparse

from ..cost.documents import DISTRIBUTIONS
from ..cost.profile import SHIPPED
from ..output import Column, footnotes, save_json, schedule_style, stderr, stdout, table, to_stdout
from . import args as a

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
                   help="frontier, dgx-h100, dgx-h200, dgx-a100 or local (default frontier), or NxD (generic "
                        "figures, implies --gpus)")
    m.add_argument("--gpus", type=a.csv(a.positive), default=None,
                   help="comma-separated GPU counts (default 8,64,512,4096, or the devices of an NxD topology)")
    m.add_argument("--seq", type=a.positive, default=None, help="global sequence length (strong scaling)")
    m.add_argument("--seq-per-gpu", type=a.positive, default=None, help="tokens per GPU (weak scaling)")
    m.add_argument("--mask", type=a.mask, default="causal",
                   help='causal, full, or a mask spec (cpattn.masks.from_spec) as JSON, e.g. '
                        '\'{"kind": "star", "block_size": 2048, "sink": 1}\'')
    m.add_argument("--documents", choices=sorted(DISTRIBUTIONS), default=None,
                   help="pack documents drawn from a published length distribution into each sequence "
                        "(cpattn.cost.documents; magiattention: MagiAttention's CP benchmark), under --mask causal "
                        "or full")
    m.add_argument("--seed", type=int, default=0, help="--documents: the seed of the packing (default 0)")
    m.add_argument("--batch", type=a.positive, default=1)
    m.add_argument("--heads", type=a.positive, default=32)
    m.add_argument("--kv-heads", type=a.positive, default=8)
    m.add_argument("--head-dim", type=a.positive, default=128)
    m.add_argument("--dtype", default="bfloat16", choices=a.dtypes())
    m.add_argument("--phase", default="forward+backward", choices=["forward", "backward", "forward+backward"])
    m.add_argument("--schedules", type=a.csv(str), default=None,
                   help="comma-separated (default: all registered; ultra only for masks other than causal and full)")
    m.add_argument("--tflops", action="store_true",
                   help="print attention TFLOP/s per GPU, forward / backward, one row per schedule and one column "
                        "per GPU count (in place of the time table; --phase does not apply)")
    m.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="ultra: about how long its planner's solves may take per plan (default: the planner's, "
                        "cpattn.planner.PlanOptions)")
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
    m.add_argument("--profile",
                   help="a calibration profile (a path, or a shipped GPU profile by name: "
                        f"{', '.join(SHIPPED)}): for --topology local, this machine's (default: the default "
                        "location); for a GPU preset, a GPU profile whose measured kernel rates replace the data-sheet "
                        "ones (dgx-h200's default: h200-2026-12-04-cudnn)")
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


def _masks(args, seqs: list[int]) -> dict:
    """``{seq: mask}`` for every sequence length: ``--mask``, or with ``--documents`` a document mask of
    lengths packed into that many tokens (causal when ``--mask`` is causal, else full)."""
    from ..core.masks import document, resolve
    from ..cost import documents

    if args.documents is None:
        return dict.fromkeys(seqs, resolve(args.mask))
    if args.mask not in ("causal", "full"):
        raise ValueError(f"--documents packs documents under a causal or full mask, not --mask {args.mask!r}")
    return {seq: document(documents.pack(args.documents, seq, args.seed), causal=args.mask == "causal")
            for seq in seqs}


def run(args) -> int:
    from rich.progress import Progress

    from .. import cost, schedules
    from ..core.steps import split_phase

    if (args.inference or args.model is not None) and (args.tflops or args.documents):
        raise ValueError("--tflops and --documents apply to the schedule tables, not to --model or --inference")
    if args.inference:
        from .simulate_inference import run_inference

        return run_inference(args)
    if args.model is not None:
        return run_model(args)
    if (args.seq is None) == (args.seq_per_gpu is None):
        raise ValueError("give exactly one of --seq (global tokens) and --seq-per-gpu (tokens per GPU)")
    gpus = a.device_counts(args.topology, args.gpus, DEFAULT_GPUS, "--gpus")
    seqs = {p: args.seq if args.seq is not None else args.seq_per_gpu * p for p in gpus}
    mask_of = _masks(args, sorted(set(seqs.values())))
    mask = mask_of[seqs[gpus[0]]]  # which schedules run it (a packing of documents stands for the others)
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
    build, algo = a.topology_builder(args)
    # the row's key of each phase's estimate ("estimate": the --phase table's one, as --json has always named it)
    phases = {"forward": "forward", "backward": "backward"} if args.tflops else {"estimate": args.phase}
    rows, bounds = [], {}
    with Progress(console=stderr(), transient=True) as progress:
        task = progress.add_task("simulate", total=len(gpus) * len(names))
        for p in gpus:
            topo = build(p)
            device = topo.device
            seq = seqs[p]
            try:
                problem = cost.Problem(seq, p, mask_of[seq], args.batch, args.heads, args.kv_heads, args.head_dim,
                                       args.dtype)
            except ValueError as exc:
                rows += [{"gpus": p, "seq": seq, "schedule": n, **dict.fromkeys(phases), "note": str(exc)}
                         for n in names]
                progress.advance(task, len(names))
                continue
            # the bound: every rank does 1/P of the work at the large-block rates
            bounds[p] = {ph: problem.flops(ph) / p / (device.forward_flops if ph == "forward" else
                                                      device.backward_flops) for ph in split_phase(args.phase)}
            for name in names:
                progress.update(task, description=f"P={p} {name}")
                sched = a.planned_schedule(name, args.time_budget)
                row = {"gpus": p, "seq": seq, "schedule": name, "note": ""}
                for key, phase in phases.items():
                    row[key], note = _estimate(sched, problem, topo, phase)
                    row["note"] = row["note"] or note
                rows.append(row)
                progress.advance(task)
            if "estimate" in phases:
                _explain_slow([r for r in rows if r["gpus"] == p], problem, topo, args.phase, args.time_budget)
    out = stdout(to_stdout(args.json))
    # the mask as the title names it: its repr, or the documents packed under it (--documents)
    label = repr(mask) if args.documents is None else f"{args.documents} documents (seed {args.seed}), {args.mask}"
    title = (f"cpattn simulate: {args.topology}, {label}, h={args.heads}:{args.kv_heads} "
             f"d={args.head_dim} b={args.batch} {args.dtype}, {'forward / backward' if args.tflops else args.phase}, "
             f"collectives {algo or 'default'}")
    if args.tflops:
        _print_tflops(out, rows, gpus, names, title)
    else:
        _print_times(out, rows, title)
    out.print(f"device: {device.name}", highlight=False)
    if bounds:
        what = (f"{device.forward_flops / 1e12:.0f} / {device.backward_flops / 1e12:.0f} TFLOP/s per GPU" if args.tflops
                else ", ".join(f"P={p}: {sum(b.values()) * 1e3:.4g} ms" for p, b in bounds.items()))
        out.print("balanced bound (every GPU does 1/P of the work at the device's large-block rate, no "
                  f"communication): {what}")
    if skipped:
        out.print(f"not shown, they cannot run the {mask.name} mask: {', '.join(skipped)}")
    if unmodelled:
        out.print(f"not modelled (they do not implement steps(problem, phase)): {', '.join(unmodelled)}")
    if unplanned:
        out.print(f"not planned for the {mask.name} mask unless named in --schedules (planning takes seconds "
                  f"per size): {', '.join(unplanned)}")
    if args.json:
        from dataclasses import asdict

        save_json([{**r, **{key: asdict(r[key]) if r[key] else None for key in phases}} for r in rows], args.json)
    if args.plot:
        (plot_tflops if args.tflops else plot)(rows, args, mask.name, args.plot)
        stderr().print(f"wrote {args.plot}")
    return 0


def _print_times(out, rows: list[dict], title: str) -> None:
    """The time table: one row per (GPU count, schedule), long notes as numbered footnotes."""
    ring = {r["gpus"]: r["estimate"] for r in rows if r["schedule"] == "ring" and r["estimate"] is not None}
    # e.g. "exceeds 64 GiB" stays in its cell; longer notes are footnotes
    marks, texts = footnotes(["" if len(r["note"]) <= SHORT_NOTE else r["note"] for r in rows])
    cells = []
    for r, mark in zip(rows, marks):
        e = r["estimate"]
        if e is None:
            cells.append([str(r["gpus"]), str(r["seq"]), r["schedule"], *["-"] * 9, mark or r["note"]])
            continue
        ratio = ring[r["gpus"]].total / e.total if r["gpus"] in ring else None
        vs = "-" if ratio is None else f"{ratio:.2f}x" if ratio >= 0.01 else f"{ratio:.2g}x"  # never 0.00x
        cells.append([str(r["gpus"]), str(r["seq"]), r["schedule"], f"{e.total * 1e3:.4g}", f"{e.compute * 1e3:.4g}",
                      f"{e.comm * 1e3:.4g}", f"{e.exposed_comm * 1e3:.4g}", f"{e.tflops_per_rank(r['gpus']):.3g}", vs,
                      f"{e.bytes_per_rank / 1e6:.4g}", f"{e.wire_bytes_per_rank / 1e6:.4g}",
                      f"{e.peak_memory / 2**30:.3g}", mark or r["note"]])
    out.print(table(TABLE, cells, title=title,
                    caption="times on the busiest rank; TFLOP/s counts allowed (q, k) pairs (bwd = 2.5 x fwd); "
                            "vs ring = T(ring) / T(schedule); sent = payload of the busiest rank, wire = what the "
                            "busiest rank sends on the wire, forwarding for others included (collective algorithms)",
                    everything="--json PATH has every figure"))
    for text in texts:
        out.print(text, highlight=False)


def _print_tflops(out, rows: list[dict], gpus: list[int], names: list[str], title: str) -> None:
    """The ``--tflops`` table: one row per schedule, one column per GPU count, each cell the attention
    TFLOP/s per GPU forward / backward (why a cell is empty: a numbered footnote)."""
    by = {(r["gpus"], r["schedule"]): r for r in rows}
    empty = {key for key, r in by.items() if r["forward"] is None or r["backward"] is None}
    marks, texts = footnotes([by[p, n]["note"] if (p, n) in empty else "" for n in names for p in gpus])
    mark = iter(marks)  # one per cell, in the order the cells are filled
    cells = []
    for n in names:
        line = [n]
        for p in gpus:
            r, m = by[p, n], next(mark)
            line.append(f"- {m}".strip() if (p, n) in empty
                        else f"{r['forward'].tflops_per_rank(p):.0f} / {r['backward'].tflops_per_rank(p):.0f}")
        cells.append(line)
    columns = (Column("schedule", "left"), *(Column(f"{p} GPUs") for p in gpus))
    out.print(title, highlight=False)  # a line of its own: wrapped as the title of this narrow table, it reads badly
    out.print(table(columns, cells, everything="--json PATH has every figure"))
    for text in texts:
        out.print(text, highlight=False)
    out.print("attention TFLOP/s per GPU, forward / backward: the allowed (q, k) pairs' FLOPs (4 b h d per pair "
              "forward, 2.5x that backward) over the predicted time of the phase, per GPU", highlight=False)


def run_model(args) -> int:
    """Model-level mode: one training step of ``--model`` at ``--seq`` tokens per replica on ``--cp`` x
    ``--dp`` devices of the topology, per schedule (``cpattn.cost.training``)."""
    from dataclasses import asdict

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
    build, _ = a.topology_builder(args)
    topo = build(args.cp)
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


#: a schedule this many times slower than ring gets a note saying why (its ratio would print as 0.00x)
SLOW_VS_RING = 100.0


def _explain_slow(rows: list[dict], problem, topo, phase: str, time_budget: float) -> None:
    """Give each row of one GPU count that predicts :data:`SLOW_VS_RING` times ring's time or more a note
    saying why: how much of its time is exposed communication, and the collectives it issues per call
    (from its ``steps()``), each over the whole group and paying its latency there."""
    from collections import Counter

    from .. import schedules
    from ..core.steps import split_phase

    ring = next((r["estimate"] for r in rows if r["schedule"] == "ring" and r["estimate"] is not None), None)
    for r in rows:
        e = r["estimate"]
        if ring is None or e is None or r["note"] or e.total < SLOW_VS_RING * ring.total:
            continue
        ops: Counter = Counter()
        sizes: list[int] = []
        try:
            sched = schedules.resolve(a.planned_schedule(r["schedule"], time_budget))
            for ph in split_phase(phase):
                for step in sched.steps(problem, ph, topo):
                    ops.update(op.op for op in step.comm)
                    sizes += [op.bytes for op in step.comm]
        except NotImplementedError:  # a schedule that plans: its plan, not steps(), says what it sends
            pass
        calls = (f"{sum(ops.values())} collectives per call ("
                 + ", ".join(f"{n} {op}" for op, n in ops.most_common()) + f") over the {r['gpus']} GPUs, "
                 f"{sum(sizes) / len(sizes) / 2**20:.3g} MiB each on average, issued one after another; "
                 if ops else "")
        r["note"] = (f"{r['schedule']} predicts {e.total / ring.total:.0f}x ring's time at {r['gpus']} GPUs "
                     f"(vs ring {ring.total / e.total:.2g}x, not zero): {e.exposed_comm / e.total:.1%} of its "
                     f"{e.total:.3g} s is exposed communication: {calls}each pays the latency of a collective "
                     f"across the whole group under the topology's algorithms ({topo.algorithm}; `--algorithm "
                     f"tree` prices tree collectives), and {problem.seq_len // r['gpus']} tokens per GPU leave "
                     "no compute to hide it")


def _estimate(name, problem, topo, phase: str) -> tuple[object | None, str]:
    """``(estimate, note)`` of schedule ``name`` (a name or a schedule) for one table row: the note says
    when it exceeds the device memory, or why there is no estimate. ``check_supports`` refuses with
    ValueError, TypeError or NotImplementedError (its contract); ``estimate`` with ValueError or
    NotImplementedError. Anything else is a bug and propagates."""
    from .. import cost

    try:
        cost.check_supports(name, problem)
    except (ValueError, TypeError, NotImplementedError) as exc:
        return None, str(exc)
    try:
        est = cost.estimate(name, problem, topo, phase)
    except (ValueError, NotImplementedError) as exc:
        return None, str(exc)
    return est, f"exceeds {topo.device.memory / 2**30:.0f} GiB" if est.peak_memory > topo.device.memory else ""


def plot(rows: list[dict], args, mask_label: str, path: str) -> None:
    """PNG: predicted time and TFLOP/s per GPU versus GPUs, one line per schedule."""
    _draw(rows, args, f"{mask_label}, {args.phase}", path,
          (("estimate", "predicted time (s)", lambda e, g: e.total, True),
           ("estimate", "attention TFLOP/s per GPU", lambda e, g: e.tflops_per_rank(g), False)))


def plot_tflops(rows: list[dict], args, mask_label: str, path: str) -> None:
    """PNG (``--tflops``): attention TFLOP/s per GPU forward and backward versus GPUs, one line per schedule."""
    _draw(rows, args, mask_label, path,
          tuple((phase, f"{phase} TFLOP/s per GPU", lambda e, g: e.tflops_per_rank(g), False)
                for phase in ("forward", "backward")))


def _draw(rows: list[dict], args, what: str, path: str, panels) -> None:
    """One panel per ``(row key, y label, value of (estimate, GPUs), log y)``, one line per schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(11, 4.2))
    for ax, (key, label, value, log_y) in zip(axes, panels):
        for name in dict.fromkeys(r["schedule"] for r in rows):
            pts = [(r["gpus"], r[key]) for r in rows if r["schedule"] == name and r[key] is not None]
            if pts:  # colour, marker and dashes: no two schedules alike, the same in every plot
                ax.plot([g for g, _ in pts], [value(e, g) for g, e in pts], label=name, **schedule_style(name))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        if log_y:
            ax.set_yscale("log")
    axes[-1].legend(fontsize=8)
    scaling = f"{args.seq} tokens" if args.seq is not None else f"{args.seq_per_gpu} tokens per GPU"
    fig.suptitle(f"{args.topology}: {what}, {scaling}, h={args.heads}:{args.kv_heads} d={args.head_dim}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
