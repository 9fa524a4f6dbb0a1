"""``cpattn bench``: time schedules on N local processes against one process."""

from __future__ import annotations

import argparse

from ..output import save_json, stderr, stdout, to_stdout
from . import args as a


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("bench", help="time schedules on N local processes against one process")
    b.add_argument("--world", "-P", type=a.csv(a.positive), default=None,
                   help="number of local ranks (default 2, or the devices of --topology); a comma-separated list "
                        "runs each")
    b.add_argument("--seq", type=a.csv(a.positive), default=[4096],
                   help="global sequence length (default 4096); a comma-separated list runs each")
    b.add_argument("--batch", type=a.positive, default=1)
    b.add_argument("--heads", type=a.positive, default=8)
    b.add_argument("--kv-heads", type=a.positive, default=2)
    b.add_argument("--head-dim", type=a.positive, default=64)
    b.add_argument("--mask", type=a.masks, default=["causal"],
                   help="causal, full, or both: causal,full; or a JSON mask spec (or list of specs), e.g. "
                        '\'{"kind": "strided", "block_size": 1024, "stride": 4}\'')
    b.add_argument("--topology", type=a.topology(presets=False), default=None,
                   help="NODESxDEVICES given to every schedule (emulated on this machine), e.g. 2x2; implies "
                        "--world")
    b.add_argument("--layout", type=a.layouts, default=[None],
                   help="comma-separated layouts to compare: default (each schedule's own), balanced, "
                        "contiguous, zigzag; only schedules that accept a layout run under a non-default one")
    b.add_argument("--dtype", default="float32", choices=a.dtypes())
    b.add_argument("--schedules", type=a.csv(str), default=None,
                   help="comma-separated names (default: every schedule that supports the mask)")
    b.add_argument("--repeats", type=a.positive, default=3,
                   help="rounds in which the one process and every schedule run in turn (default 3); the table "
                        "shows the median over rounds and the lowest-highest")
    b.add_argument("--warmup", type=int, default=1, help="untimed calls per round (default 1)")
    b.add_argument("--iters", type=a.positive, default=1,
                   help="timed iterations per phase per round (default 1); a round's time is their median")
    b.add_argument("--threads", type=int, default=0, help="torch threads per rank (default cores / world)")
    b.add_argument("--flex", action=argparse.BooleanOptionalAction, default=None,
                   help="time torch FlexAttention (torch.compile, forward only, one process) as a peer column; "
                        "default: only for a masked configuration (neither causal nor full)")
    b.add_argument("--predict", action="store_true",
                   help="add the cost model's prediction and its error to each row, and the median |error|; a "
                        "speed probe (a few reference kernels before each timed iteration) measures how fast the "
                        "machine runs against its calibration, and predictions are at that speed")
    b.add_argument("--profile", help="calibration profile for --predict (default: the one `cpattn calibrate` wrote)")
    b.add_argument("--json", metavar="PATH",
                   help="also write the rows as JSON to PATH (several configurations: {runs: [...]}); '-': to "
                        "stdout, in place of the tables")
    b.add_argument("--plot", help="also write a PNG: a bar chart of efficiency per configuration (one panel each), "
                                  "and per-rank timeline panels of one stamped step for each schedule")
    b.add_argument("--trace", metavar="DIR",
                   help="stamp one more forward+backward per schedule and write its Chrome trace (Perfetto, "
                        "chrome://tracing) per configuration into DIR; adds the hidden transfer fraction column")
    b.set_defaults(func=run)
    return b


def supporting(names: list[str] | None, mask_spec, layout: str | None = None
               ) -> tuple[list[str], list[tuple[str, str]]]:
    """``(run, skipped)``: of ``names`` (default: every registered schedule), those that run
    ``mask_spec`` and accept ``layout``, and ``(name, why)`` for the others. An unknown name, or named
    schedules none of which can run, is a ValueError."""
    from .. import schedules
    from ..core.masks import resolve

    mask = resolve(mask_spec)
    run, skipped = [], []
    for name in names or schedules.names():
        sched = schedules.get(name)  # an unknown name raises, naming the registered ones
        try:
            sched.check_mask(mask)
        except (ValueError, NotImplementedError):
            kind = "bidirectional-only" if not sched.causal else "causal-only" if not sched.bidirectional \
                else "does not run this mask"
            skipped.append((name, kind))
            continue
        if layout is not None and not sched.custom_layout:
            skipped.append((name, f"runs only on its own {sched.layout_for(mask)!r} layout"))
            continue
        run.append(name)
    if not run:
        why = "; ".join(f"{n}: {w}" for n, w in skipped)
        raise ValueError(f"no schedule asked for can run the {mask.name} mask"
                         f"{'' if layout is None else f' on layout {layout!r}'} ({why}); `cpattn schedules` "
                         "lists what each runs")
    return run, skipped


def configs(args) -> list[tuple]:
    """Every ``(BenchConfig, schedule names, skipped)`` the arguments ask for, all checked before any
    process starts (a ValueError for a bad mask, schedule, layout or world size; ``skipped``: the
    ``(name, why)`` of schedules asked for, or registered, that cannot run the configuration)."""
    import itertools

    from .. import bench
    from ..core.masks import resolve

    for mask in args.mask:
        resolve(mask)  # a clear error for a bad name or spec
    worlds = a.device_counts(args.topology, args.world, [2], "--world")
    shape = args.topology.shape if args.topology is not None else None
    out = []
    for world, seq, mask, layout in itertools.product(worlds, args.seq, args.mask, args.layout):
        cfg = bench.BenchConfig(world=world, seq=seq, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                                head_dim=args.head_dim, mask=mask, dtype=args.dtype, warmup=args.warmup,
                                iters=args.iters, repeats=args.repeats, threads=args.threads, topology=shape,
                                layout=layout)
        out.append((cfg, *supporting(args.schedules, mask, layout)))
    return out


def run(args) -> int:
    from .. import bench

    console = stderr()
    todo = configs(args)
    profile = a.load_profile(args.profile) if args.predict else None
    results = []
    stamp = bool(args.trace or args.plot)  # the timeline step feeds the traces and the plot's panels
    out = stdout(quiet=to_stdout(args.json))
    for cfg, names, skipped in todo:
        if skipped:
            groups: dict[str, list[str]] = {}
            for name, why in skipped:
                groups.setdefault(why, []).append(name)
            console.print(f"not run for the {cfg.mask if isinstance(cfg.mask, str) else 'given'} mask"
                          f"{'' if cfg.layout is None else f' on layout {cfg.layout}'}: "
                          + "; ".join(f"{', '.join(n)} ({why})" for why, n in groups.items())
                          + " (`cpattn schedules` lists what each runs)", soft_wrap=True)
        with console.status("starting") as status:
            result = bench.run(cfg, names, progress=lambda msg, status=status: status.update(f"bench: {msg}"),
                               flex=args.flex, timeline=stamp, speed_probe=args.predict)
        if args.predict:
            bench.predict(result, profile)
        if args.trace:
            for path in bench.write_traces(result, args.trace):
                console.print(f"wrote {path}")
        out.print(bench.render(result))
        if args.predict:
            out.print(bench.render_breakdown(result))
        results.append(result)
    summary = bench.prediction_summary(results) if args.predict else None
    if summary is not None:
        line = (f"prediction error over {summary['rows']} schedule runs: median |error| "
                f"{summary['median_abs_error']:.1%} forward+backward, {summary['median_abs_fwd_error']:.1%} forward")
        if summary["speed"]:
            lo, mid, hi = summary["speed"]
            line += (f"; the machine ran at {mid:.3f} x its calibrated speed (rows {lo:.3f}-{hi:.3f}, speed probe), "
                     f"at which the predictions are; at the profile's speed: "
                     f"{summary['median_abs_error_at_profile_speed']:.1%} forward+backward")
        out.print(line)
    if args.json:
        save_json(results[0] if len(results) == 1 else {"runs": results, "prediction": summary}, args.json)
    if args.plot:
        bench.plot(results, args.plot)
        console.print(f"wrote {args.plot}")
    return 0 if all(r["ok"] for res in results for r in res["rows"]) else 1
