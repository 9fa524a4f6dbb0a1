"""``cpattn bench``: time schedules on N local processes against one process."""

from __future__ import annotations

import argparse

from . import args as a
from .output import show_wide, stderr, stdout


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("bench", help="time schedules on N local processes against one process")
    b.add_argument("--world", "-P", type=a.csv(int), default=None,
                   help="number of local ranks (default 2, or the devices of --topology); a comma-separated list "
                        "runs each")
    b.add_argument("--seq", type=a.csv(int), default=[4096],
                   help="global sequence length (default 4096); a comma-separated list runs each")
    b.add_argument("--batch", type=int, default=1)
    b.add_argument("--heads", type=int, default=8)
    b.add_argument("--kv-heads", type=int, default=2)
    b.add_argument("--head-dim", type=int, default=64)
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
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--iters", type=int, default=3)
    b.add_argument("--threads", type=int, default=0, help="torch threads per rank (default cores / world)")
    b.add_argument("--flex", action=argparse.BooleanOptionalAction, default=None,
                   help="time torch FlexAttention (torch.compile, forward only, one process) as a peer column; "
                        "default: only for a masked configuration (neither causal nor full)")
    b.add_argument("--predict", action="store_true",
                   help="add the cost model's prediction and its error to each row, and the median |error|")
    b.add_argument("--profile", help="calibration profile for --predict (default: the one `cpattn calibrate` wrote)")
    b.add_argument("--json", help="also write the rows as JSON to this path (several configurations: {runs: [...]})")
    b.add_argument("--plot", help="also write a PNG bar chart of efficiency (of the last configuration), with a "
                                  "per-rank timeline panel of one stamped step for each schedule")
    b.add_argument("--trace", metavar="DIR",
                   help="stamp one more forward+backward per schedule and write its Chrome trace (Perfetto, "
                        "chrome://tracing) per configuration into DIR; adds the hidden transfer fraction column")
    b.set_defaults(func=run)
    return b


def supporting(names: list[str] | None, mask_spec, layout: str | None = None) -> list[str]:
    """``names``, each checked (it exists, runs the mask and accepts ``layout``; a ValueError otherwise),
    or every registered schedule that runs ``mask_spec`` and accepts ``layout``."""
    from .. import schedules
    from ..core.masks import resolve

    mask = resolve(mask_spec)
    if names:
        for name in names:
            sched = schedules.get(name)
            try:
                sched.check_mask(mask)
            except NotImplementedError as exc:  # the schedule refuses this mask: a usage error here
                raise ValueError(str(exc)) from None
            if layout is not None and not sched.custom_layout:
                raise ValueError(f"schedule {name!r} runs only on its own layout, not layout={layout!r}")
        return names
    out = []
    for name in schedules.names():
        sched = schedules.get(name)
        try:
            sched.check_mask(mask)
        except (ValueError, NotImplementedError):
            continue
        if layout is None or sched.custom_layout:
            out.append(name)
    return out


def configs(args) -> list[tuple]:
    """Every ``(BenchConfig, schedule names)`` the arguments ask for, all checked before any process
    starts (a ValueError for a bad mask, schedule, layout or world size)."""
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
                                iters=args.iters, threads=args.threads, topology=shape, layout=layout)
        out.append((cfg, supporting(args.schedules, mask, layout)))
    return out


def run(args) -> int:
    import json

    from .. import bench

    console = stderr()
    todo = configs(args)
    profile = a.load_profile(args.profile) if args.predict else None
    results = []
    stamp = bool(args.trace or args.plot)  # the timeline step feeds the traces and the plot's panels
    for cfg, names in todo:
        with console.status("starting") as status:
            result = bench.run(cfg, names, progress=lambda msg, status=status: status.update(f"bench: {msg}"),
                               flex=args.flex, timeline=stamp)
        if args.predict:
            bench.predict(result, profile)
        if args.trace:
            for path in bench.write_traces(result, args.trace):
                console.print(f"wrote {path}")
        show_wide(bench.render(result))
        results.append(result)
    if args.predict:
        summary = bench.prediction_summary(results)
        stdout().print(f"prediction error over {summary['rows']} schedule runs: median |error| "
                       f"{summary['median_abs_error']:.1%} forward+backward, {summary['median_abs_fwd_error']:.1%} "
                       "forward")
    if args.json:
        if len(results) == 1:
            bench.save_json(results[0], args.json)
        else:
            with open(args.json, "w") as f:
                json.dump({"runs": results, "prediction": bench.prediction_summary(results) if args.predict else None},
                          f, indent=2)
        console.print(f"wrote {args.json}")
    if args.plot:
        bench.plot(results[-1], args.plot)
        console.print(f"wrote {args.plot}")
    return 0 if all(r["ok"] for res in results for r in res["rows"]) else 1
