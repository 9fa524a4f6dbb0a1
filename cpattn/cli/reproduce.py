"""``cpattn reproduce ringx`` and ``cpattn reproduce ultraattn``: the papers' evaluations in the cost model.

Each prints its tables, draws a PNG in the paper's style and optionally writes JSON; the computation
(grids, speedups, the bandwidth bisection) is :mod:`cpattn.lab.papers`, which only calls
``cost.estimate`` and ``cost.preset``.
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import asdict

from ..output import Column, save_json, schedule_style, stderr, stdout, table, to_stdout
from . import args as a

#: what ``ultraattn --full`` runs (the paper's grid); the default is the part that plans in minutes
ULTRA_FULL = {"seq": [65536, 524288], "gpus": [8, 16, 32, 64], "heads": [1, 32]}
ULTRA_DEFAULT = {"seq": [65536], "gpus": [8, 64], "heads": [1, 32]}


def add_parser(sub) -> argparse.ArgumentParser:
    from ..lab import papers as r

    p = sub.add_parser("reproduce", help="reproduce RingX's or UltraAttn's evaluation in the cost model")
    papers = p.add_subparsers(dest="paper", required=True)

    x = papers.add_parser("ringx", help="RingX's benchmark grid on Frontier: every variant against ring attention")
    x.add_argument("--gcds", type=a.csv(a.positive), default=list(r.RINGX_GCDS),
                   help="comma-separated GCD counts (default 8,16,...,4096)")
    x.add_argument("--masks", type=a.csv(str), default=list(r.RINGX_MASKS), help="full and/or causal (default both)")
    x.add_argument("--batch", type=a.csv(a.positive), default=[b for b, _ in r.RINGX_SHAPES],
                   help="batch sizes, paired with --tokens-per-gcd (default 256,128,64,32)")
    x.add_argument("--tokens-per-gcd", type=a.csv(a.positive), default=[s for _, s in r.RINGX_SHAPES],
                   help="local tokens per GCD, paired with --batch (default 1024,2048,4096,8192)")
    x.add_argument("--heads", type=a.csv(a.positive), default=[32], help="query heads (list, paired with --kv-heads)")
    x.add_argument("--kv-heads", type=a.csv(a.positive), default=[32], help="key/value heads (list)")
    x.add_argument("--head-dim", type=a.csv(a.positive), default=[128], help="head dim (list)")
    x.add_argument("--dtype", default="bfloat16", choices=a.dtypes())
    x.add_argument("--phase", default="forward+backward", choices=["forward", "backward", "forward+backward"])
    x.add_argument("--algorithm", type=a.algorithm, default=r.RINGX_ALGORITHM,
                   help="collective algorithms, as NCCL_ALGO: auto, ring, tree, or per op "
                        "'all_reduce:tree;broadcast:ring' (default: a tree all-reduce and ring broadcasts and reduces, "
                        "what NCCL_ALGO=Tree gives on NCCL/RCCL, as the RingX release set)")
    x.add_argument("--target", type=float, default=r.RINGX_CLAIM, help="the speedup to explain (default 3.4)")
    x.add_argument("--gap-gcds", type=a.csv(a.positive), default=None,
                   help="GCD counts at which to find the ring bandwidth that gives --target (default: the largest "
                        "of --gcds; '' for none)")
    x.add_argument("--no-context", action="store_true", help="leave out zigzag_ring and stripe_ring (causal)")
    x.add_argument("--json", metavar="PATH",
                   help="also write the results as JSON to PATH ('-': to stdout, in place of the tables)")
    x.add_argument("--plot", default="reproduce_ringx.png", help="PNG (default reproduce_ringx.png; '' for none)")
    x.set_defaults(func=run_ringx)

    u = papers.add_parser("ultraattn", help="UltraAttn's evaluation on DGX H100: ultra against ring-family "
                                            "baselines for block-sparse patterns")
    u.add_argument("--patterns", type=a.csv(str), default=list(r.ULTRA_PATTERNS),
                   help="strided, global_local, star, streaming (default all; blocks of 1/16 of the sequence)")
    u.add_argument("--seq", type=a.csv(a.positive), default=None, help="global sequence lengths (default 65536)")
    u.add_argument("--gpus", type=a.csv(a.positive), default=None, help="GPU counts (default 8,64)")
    u.add_argument("--heads", type=a.csv(a.positive), default=None, help="query heads (default 1,32)")
    u.add_argument("--kv-heads", type=a.positive, default=None,
                   help="key/value heads (default: as many as query heads)")
    u.add_argument("--head-dim", type=a.positive, default=128)
    u.add_argument("--dtype", default="bfloat16", choices=a.dtypes())
    u.add_argument("--phase", default="forward+backward", choices=["forward", "backward", "forward+backward"])
    u.add_argument("--full", action="store_true",
                   help="the paper's whole grid: 64K and 512K tokens, 8, 16, 32 and 64 GPUs, heads 1 and 32 "
                        "(64 plans; tens of minutes on two cores the first time) unless --seq/--gpus/--heads say")
    u.add_argument("--baselines", type=a.csv(str), default=list(r.ULTRA_BASELINES),
                   help="baselines (default ring,zigzag_ring,stripe_ring,allgather)")
    u.add_argument("--time-budget", type=float, default=None,
                   help="seconds of CP-SAT solving per plan (default: the ultra schedule's planner default, 15)")
    u.add_argument("--target", type=float, default=r.ULTRA_CLAIM, help="the paper's average speedup (default 5.5)")
    u.add_argument("--json", metavar="PATH",
                   help="also write the results as JSON to PATH ('-': to stdout, in place of the tables)")
    u.add_argument("--plot", default="reproduce_ultraattn.png",
                   help="PNG (default reproduce_ultraattn.png; '' for none)")
    u.set_defaults(func=run_ultraattn)
    return p


def _pairs(first: list[int], second: list[int], what: str) -> list[tuple[int, int]]:
    """Element-wise pairs of two lists, a single value standing for all."""
    if len(first) != len(second) and 1 not in (len(first), len(second)):
        raise ValueError(f"{what}: give lists of one length, or one value for all ({first} and {second})")
    n = max(len(first), len(second))
    return [(first[i if len(first) > 1 else 0], second[i if len(second) > 1 else 0]) for i in range(n)]


def _x(value: float | None, fits: bool = True) -> str:
    return "-" if value is None else f"{value:.2f}x" + ("" if fits else "*")


def _gbs(bw: float | None) -> str:
    return "none" if bw is None else f"{bw / 1e9:.3g} GB/s"


# --------------------------------------------------------------------------------------------- ringx
def run_ringx(args) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..lab import papers as r

    start = time.perf_counter()
    masks = args.masks
    for m in masks:
        if m not in r.RINGX_MASKS:
            raise ValueError(f"--masks: {m!r} is not one of {', '.join(r.RINGX_MASKS)}")
    shapes = _pairs(args.batch, args.tokens_per_gcd, "--batch and --tokens-per-gcd")
    heads = _pairs(args.heads, args.kv_heads, "--heads and --kv-heads")
    models = [(h, kv, d) for (h, kv), d in itertools.product(heads, args.head_dim)]
    gcds = sorted(set(args.gcds))
    if not gcds:
        raise ValueError("--gcds: give at least one GCD count")
    gap_gcds = [max(gcds)] if args.gap_gcds is None else sorted(set(args.gap_gcds))

    grid = list(itertools.product(masks, models, shapes, gcds))
    n_gaps = sum(len(r.ringx_variants(m)) for m in masks) * len(models) * len(shapes) * len(gap_gcds)
    cases: dict[tuple, r.Case] = {}
    gaps: list[dict] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=stderr(), transient=True) as progress:
        task = progress.add_task("grid", total=len(grid) + 2 * n_gaps)
        for mask, (h, kv, d), (b, s), p in grid:
            progress.update(task, description=f"{mask} b={b} s={s} P={p}")
            cases[mask, (h, kv, d), (b, s), p] = r.ringx_case(mask, p, b, s, h, kv, d, args.dtype, args.algorithm,
                                                              args.phase, not args.no_context)
            progress.advance(task)
        for mask, model, (b, s), p in itertools.product(masks, models, shapes, gap_gcds):
            case = cases.get((mask, model, (b, s), p)) or r.ringx_case(
                mask, p, b, s, *model, args.dtype, args.algorithm, args.phase, False)
            variants = [case.estimates[n] for n in r.ringx_variants(mask) if n in case.estimates]
            topo = r.ringx_topology(p, args.algorithm)
            for overlap in (None, 0.0):
                progress.update(task, description=f"gap {mask} b={b} s={s} P={p}"
                                                  + (" ring without overlap" if overlap == 0.0 else ""))
                found = r.ring_bandwidth_gaps(variants, case.problem, topo, args.target, args.phase, overlap)
                gaps += [{"mask": mask, "heads": model[0], "kv_heads": model[1], "head_dim": model[2], "batch": b,
                          "tokens_per_gcd": s, "gcds": p, "fits": case.fits(g.variant), **asdict(g)} for g in found]
                progress.advance(task, len(r.ringx_variants(mask)))
    elapsed = time.perf_counter() - start

    out = stdout(to_stdout(args.json))
    several_models = len(models) > 1
    for mask in masks:
        names = [n for n in r.ringx_schedules(mask, not args.no_context) if n != r.RINGX_BASELINE]
        variants = r.ringx_variants(mask)
        heads = (["h:kv d"] if several_models else []) + ["b x s/GCD", "GCDs", "ring s", *names, "best", "best x"]
        # a narrow terminal loses the ring's own time first, then the context baselines, then the variants
        # that do not overlap, then the pipelined ones; the best variant and its speedup always stay
        order = ["ring s", *[n for n in names if n in r.RINGX_CONTEXT], *[n for n in names if not n.endswith("o")],
                 *[n for n in names if n.endswith("o")]]
        order = list(dict.fromkeys(order))
        cols = [Column(h, "left" if h in ("best", "b x s/GCD", "h:kv d") else "right",
                       drop=order.index(h) + 1 if h in order else 0) for h in heads]
        rows = []
        for (m, model, (b, s), p), case in cases.items():
            if m != mask:
                continue
            best = case.fastest(variants)
            row = [f"{model[0]}:{model[1]} {model[2]}"] if several_models else []
            ring = case.total(r.RINGX_BASELINE)
            row += [f"{b} x {s}", str(p), "-" if ring is None else f"{ring:.4g}"]
            row += [_x(case.speedup(n, r.RINGX_BASELINE), case.fits(n)) for n in names]
            row += [best or "none fits", _x(case.speedup(best, r.RINGX_BASELINE))]
            rows.append(row)
        out.print(table(cols, rows, everything="--json PATH has every figure",
                        title=f"RingX on {r.RINGX_TOPOLOGY} ({args.algorithm} collectives): {mask} attention, "
                              f"{args.phase}, speedup T(ring) / T(schedule)",
                        caption=f"* needs more than the {_gib(cases, mask)} GiB of a GCD; best: the fastest RingX "
                                f"variant that fits; paper: up to {args.target:g}x"))
        notes = {n: note for case in cases.values() if case.problem.mask.name == mask for n, note in case.notes.items()}
        for n, note in notes.items():
            out.print(f"[dim]{n}: {note}[/dim]")

    if gaps:
        heads = (["h:kv d"] if several_models else []) + ["mask", "b x s/GCD", "GCDs", "variant", "fits",
                                                          "at preset", "needs (overlap)", "needs (no overlap)",
                                                          "preset", "note"]
        order = ["preset", "fits", "at preset", "mask", "needs (no overlap)"]
        cols = [Column(h, "right" if h in ("GCDs", "at preset") else "left",
                       drop=order.index(h) + 1 if h in order else 0, wrap=h in ("note", "needs (overlap)",
                                                                              "needs (no overlap)"),
                       min_width=20 if h == "note" else None) for h in heads]
        paired = {}
        for g in gaps:
            paired.setdefault((g["mask"], g["heads"], g["kv_heads"], g["head_dim"], g["batch"], g["tokens_per_gcd"],
                               g["gcds"], g["variant"]), []).append(g)
        rows = []
        for (mask, h, kv, d, b, s, p, variant), (ov, no) in paired.items():
            row = [f"{h}:{kv} {d}"] if several_models else []
            row += [mask, f"{b} x {s}", str(p), variant, "yes" if ov["fits"] else "no", _x(ov["at_preset"]),
                    _need(ov), _need(no), _gbs(ov["preset_bandwidth"]), ov["reason"] or no["reason"]]
            rows.append(row)
        out.print(table(cols, rows, everything="--json PATH has every figure",
                        title=f"What the ring's point-to-point bandwidth would have to be for each variant to be "
                              f"{args.target:g}x faster than ring (the variant at the preset's figures)",
                        caption="overlap: the ring's transfers hidden behind compute as the model has it; no "
                                "overlap: the ring's transfers exposed; preset: the link the ring's transfers cross "
                                "(a Slingshot NIC across nodes, Infinity Fabric inside one)"))
    out.print(f"grid: {len(grid)} points, {len(gaps)} bandwidth searches, {elapsed:.1f} s")

    if args.json:
        save_json({"command": "reproduce ringx", "topology": r.RINGX_TOPOLOGY, "algorithm": args.algorithm,
                   "phase": args.phase, "dtype": args.dtype, "target": args.target, "seconds": elapsed,
                   "cases": [{**c.to_json(), "tokens_per_gcd": k[2][1], "best": c.fastest(r.ringx_variants(k[0])),
                              "speedups": {n: c.speedup(n, r.RINGX_BASELINE) for n in c.estimates}}
                             for k, c in cases.items()],
                   "gaps": gaps}, args.json)
    if args.plot:
        plot_ringx(cases, masks, models, shapes, args.target, args.algorithm, args.plot, not args.no_context)
        stderr().print(f"wrote {args.plot}")
    return 0


def _gib(cases, mask: str) -> str:
    mem = next((c.memory for c in cases.values() if c.problem.mask.name == mask), 0)
    return f"{mem / 2**30:.0f}"


def _need(g: dict) -> str:
    return "none" if g["bandwidth"] is None else f"{g['bandwidth'] / 1e9:.3g} GB/s ({g['factor']:.2g}x)"


def plot_ringx(cases: dict, masks: list[str], models: list, shapes: list, target: float, algorithm: str, path: str,
               context: bool) -> None:
    """PNG in the paper's style: speedup over ring versus GCDs (log2), one line per variant, one panel
    per mask (rows) and batch x tokens (columns); hollow markers where a schedule does not fit a GCD;
    a dashed line at the paper's ``target``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..lab import papers as r

    cols = [(m, s) for m in models for s in shapes]
    fig, axes = plt.subplots(len(masks), len(cols), figsize=(3.6 * len(cols) + 1, 3.2 * len(masks) + 0.6),
                             squeeze=False, sharey="row")
    for i, mask in enumerate(masks):
        names = [n for n in r.ringx_schedules(mask, context) if n != r.RINGX_BASELINE]
        for j, (model, shape) in enumerate(cols):
            ax = axes[i][j]
            pts = sorted((k[3], c) for k, c in cases.items() if k[0] == mask and k[1] == model and k[2] == shape)
            for n in names:
                have = [(p, c.speedup(n, r.RINGX_BASELINE), c.fits(n)) for p, c in pts if c.total(n) is not None]
                if not have:
                    continue
                style = schedule_style(n)  # every line its own colour, marker and dashes
                if n in r.RINGX_CONTEXT:  # the context baselines in grey, dotted
                    style |= {"linestyle": ":", "color": "grey" if n == "zigzag_ring" else "silver"}
                (line,) = ax.plot([p for p, _, _ in have], [y for _, y, _ in have], label=n, **style)
                over = [(p, y) for p, y, fits in have if not fits]
                if over:
                    ax.scatter([p for p, _ in over], [y for _, y in over], s=60, facecolors="white",
                               edgecolors=line.get_color(), zorder=3)
            ax.axhline(target, linestyle="--", color="black", linewidth=1)
            ax.axhline(1.0, color="black", linewidth=0.5)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mask}, b={shape[0]} x {shape[1]} tokens/GCD"
                         + (f", h {model[0]}:{model[1]} d {model[2]}" if len(models) > 1 else ""), fontsize=9)
            ax.set_xlabel("GCDs")
            ax.grid(True, which="both", alpha=0.3)
            if j == 0:
                ax.set_ylabel("speedup over ring")
        axes[i][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(f"RingX variants vs ring attention, Frontier model ({algorithm} collectives); dashed: the paper's "
                 f"{target:g}x; hollow: over the {_gib(cases, masks[0])} GiB of a GCD", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------- ultraattn
def run_ultraattn(args) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .. import schedules
    from ..lab import papers as r
    from ..planner.cache import cache_dir

    grid_defaults = ULTRA_FULL if args.full else ULTRA_DEFAULT
    seqs = args.seq or grid_defaults["seq"]
    gpus = args.gpus or grid_defaults["gpus"]
    heads = args.heads or grid_defaults["heads"]
    for pattern in args.patterns:
        r.ultra_pattern(pattern, 16 * r.ULTRA_BLOCKS)  # an unknown pattern fails here, before planning
    ultra = a.planned_schedule("ultra", args.time_budget)
    start = time.perf_counter()
    cases: list[tuple[str, r.Case]] = []
    grid = list(itertools.product(seqs, gpus, heads, args.patterns))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=stderr(), transient=True) as progress:
        task = progress.add_task("plans", total=len(grid))
        for seq, p, h, pattern in grid:
            label = f"{pattern} S={seq} P={p} Nh={h}"

            def show(name: str, label: str = label) -> None:
                what = f"planning {name}" if schedules.get(name).make_plan is not None else name
                progress.update(task, description=f"{label}: {what}")

            case = r.ultra_case(pattern, seq, p, h, args.kv_heads or h, args.head_dim, args.dtype, args.baselines,
                                args.phase, ultra=ultra, progress=show)
            cases.append((pattern, case))
            progress.advance(task)
    elapsed = time.perf_counter() - start
    planning = sum(c.seconds.get("ultra", 0.0) for _, c in cases)
    speedups = [r.ultra_speedup(pattern, case) for pattern, case in cases]
    averages = r.ultra_averages(speedups)

    out = stdout(to_stdout(args.json))
    heads = ["S", "Nh", "GPUs", "pattern", "ultra ms", *[f"{b} ms" for b in args.baselines], "best ring family",
             "vs ring family", "best", "vs best", "plan s"]
    order = ["plan s", *[f"{b} ms" for b in reversed(args.baselines)], "S", "best ring family", "best"]
    cols = [Column(h, "left" if h in ("pattern", "best ring family", "best") else "right",
                   drop=order.index(h) + 1 if h in order else 0) for h in heads]
    rows = []
    for (pattern, case), sp in zip(cases, speedups):
        ms = [case.total(n) for n in ("ultra", *args.baselines)]
        rows.append([str(sp.seq_len), str(sp.heads), str(sp.gpus), pattern,
                     *["-" if v is None else f"{v * 1e3:.4g}" for v in ms], sp.best_ring or "-", _x(sp.vs_ring),
                     sp.best_any or "-", _x(sp.vs_any), f"{case.seconds.get('ultra', 0.0):.1f}"])
    out.print(table(cols, rows, everything="--json PATH has every figure",
                    title=f"UltraAttn on {r.ULTRA_TOPOLOGY}: ultra (its plan) against the baselines, {args.phase}, "
                          f"d={args.head_dim} {args.dtype}, batch 1",
                    caption="times in ms on the busiest rank; vs ring family: T(best of ring, zigzag_ring, "
                            "stripe_ring run) / T(ultra); vs best: the best baseline including allgather"))
    for pattern, case in cases:
        for n, note in case.notes.items():
            out.print(f"[dim]{pattern} S={case.problem.seq_len} P={case.problem.world}: {n}: {note}[/dim]")
    cols = [Column(h) for h in ("S", "Nh", "GPUs", "mean vs ring family", "mean vs best", f"of {args.target:g}x")]
    rows = []
    for row in averages:
        mr, mb = row["mean_vs_ring_family"], row["mean_vs_best"]
        rows.append([str(row["seq_len"]), str(row["heads"]), str(row["gpus"]), _x(mr), _x(mb),
                     "-" if mr is None else f"{100 * mr / args.target:.0f}%"])
    out.print(table(cols, rows, title=f"Average over patterns ({', '.join(args.patterns)}) against the paper's "
                                      f"{args.target:g}x",
                    caption="arithmetic mean of ultra's speedup per pattern"))
    out.print(f"{len(cases)} cases in {elapsed:.1f} s, of which {planning:.1f} s for ultra's plans (plan cache: "
              f"{cache_dir()}; a second run reads them from there)")

    if args.json:
        save_json({"command": "reproduce ultraattn", "topology": r.ULTRA_TOPOLOGY, "phase": args.phase,
                   "target": args.target, "seconds": elapsed, "planning_seconds": planning,
                   "cases": [{**case.to_json(), "pattern": pattern, **asdict(sp)}
                             for (pattern, case), sp in zip(cases, speedups)],
                   "averages": averages}, args.json)
    if args.plot:
        plot_ultraattn(speedups, averages, args.patterns, args.target, args.plot)
        stderr().print(f"wrote {args.plot}")
    return 0


def plot_ultraattn(speedups: list, averages: list[dict], patterns: list[str], target: float, path: str) -> None:
    """PNG in the paper's style: grouped bars, one group per pattern (and the mean), one bar per GPU count,
    the height ultra's speedup over the best ring-family baseline; black ticks mark the speedup over the
    best baseline including all-gather; one panel per (S, heads); a dashed line at the paper's ``target``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(s.seq_len, s.heads) for s in speedups})
    gpus = sorted({s.gpus for s in speedups})
    mean = {(a["seq_len"], a["heads"], a["gpus"]): (a["mean_vs_ring_family"], a["mean_vs_best"]) for a in averages}
    each = {(s.pattern, s.seq_len, s.heads, s.gpus): (s.vs_ring, s.vs_any) for s in speedups}
    fig, axes = plt.subplots(1, len(panels), figsize=(1.2 + 0.5 * (len(patterns) + 1) * len(gpus) * len(panels)
                                                      + 1.5 * len(panels), 3.8), squeeze=False)
    width = 0.8 / len(gpus)
    groups = [*patterns, "mean"]
    for ax, (seq, h) in zip(axes[0], panels):
        for k, p in enumerate(gpus):
            ring, best = zip(*(mean.get((seq, h, p), (None, None)) if g == "mean" else
                               each.get((g, seq, h, p), (None, None)) for g in groups))
            xs = [i + (k - (len(gpus) - 1) / 2) * width for i in range(len(groups))]
            ax.bar(xs, [v or 0.0 for v in ring], width, label=f"{p} GPUs")
            ax.scatter([x for x, v in zip(xs, best) if v], [v for v in best if v], marker="_", s=120, color="black",
                       zorder=3, label="vs best incl. allgather" if k == 0 else None)
        ax.axhline(target, linestyle="--", color="black", linewidth=1, label=f"paper {target:g}x")
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_xticks(range(len(groups)), [g.replace("_", "+") for g in groups], fontsize=8)
        ax.set_title(f"S={seq // 1024}K, Nh={h}", fontsize=9)
        ax.set_ylabel("ultra speedup over best ring family")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle("UltraAttn (its plan) vs the best ring-family baseline run, DGX H100 model, forward + backward",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
