"""``cpattn plan``: build (or load) an UltraAttn plan; print the placement and predicted time, draw a
heatmap and a timeline."""

from __future__ import annotations

import argparse

from .. import output as tables
from ..output import Column, stderr, stdout
from . import args as a

DEFAULT_GPUS = 8
#: the tables' columns; ``drop``: the order in which they are left out of a narrow terminal (1 first)
LEVELS = (Column("phase", "left"), Column("level", "left", wrap=True), Column("method", "left", drop=2),
          Column("status", "left", drop=4, wrap=True), Column("V"), Column("greedy V", drop=1),
          Column("max load / bound", drop=3), Column("s", drop=5))
SCHEDULE = (Column("phase", "left"), Column("kernels"), Column("max cells", drop=2), Column("transfers"),
            Column("busiest sent MB", drop=3), Column("busiest recv MB", drop=4), Column("predicted ms"),
            Column("scheduler", "left", drop=1, wrap=True))


def add_parser(sub) -> argparse.ArgumentParser:
    pl = sub.add_parser("plan", help="build (or load) an UltraAttn plan: print the placement and predicted time, "
                                     "draw a heatmap and a timeline")
    pl.add_argument("--topology", type=a.topology(), default="dgx-h100",
                    help="a preset (dgx-h100, dgx-h200, dgx-a100, frontier, local) or NxD, e.g. 2x4, which implies "
                         "--gpus (default dgx-h100)")
    pl.add_argument("--gpus", "-P", type=a.positive, default=None,
                    help=f"number of devices (default {DEFAULT_GPUS}, or the devices of an NxD topology)")
    pl.add_argument("--seq", type=a.positive, default=65536, help="global sequence length (default 65536)")
    pl.add_argument("--mask", type=a.mask, default="causal",
                    help="causal, full, or a mask spec (cpattn.masks.from_spec) as JSON")
    pl.add_argument("--batch", type=a.positive, default=1)
    pl.add_argument("--heads", type=a.positive, default=32)
    pl.add_argument("--kv-heads", type=a.positive, default=8)
    pl.add_argument("--head-dim", type=a.positive, default=128)
    pl.add_argument("--dtype", default="bfloat16", choices=a.dtypes(float64=True))
    pl.add_argument("--eps", type=float, default=0.1, help="load tolerance of the partition ILP (default 0.1)")
    pl.add_argument("--time-budget", type=float, default=15.0, help="seconds of CP-SAT solving per plan (default 15)")
    pl.add_argument("--no-solver", action="store_true", help="greedy placement and list schedule only")
    pl.add_argument("--chunks-per-rank", type=a.positive, default=None, help="fix the granularity (default: automatic)")
    pl.add_argument("--owner-map", choices=["auto", "contiguous"], default="auto",
                    help="which rank holds which tokens: ultra's own choice (round-robin pieces when they keep "
                         "clearly more work local) or contiguous (default auto)")
    pl.add_argument("--cache-dir", default=None, help="plan cache (default $CPATTN_CACHE_DIR or ~/.cache/cpattn/plans)")
    pl.add_argument("--no-cache", action="store_true", help="always plan anew; store nothing")
    pl.add_argument("--json", help="also write the plan JSON to this path")
    pl.add_argument("--heatmap", default="plan_heatmap.png", help="PNG of which rank computes each cell ('' for none)")
    pl.add_argument("--timeline", default="plan_timeline.png", help="PNG of every rank's lanes ('' for none)")
    pl.set_defaults(func=run)
    return pl


def run(args) -> int:
    from .. import planner
    from ..core.masks import resolve
    from ..core.steps import DTYPE_BYTES
    from ..planner import plot

    (gpus,) = a.device_counts(args.topology, None if args.gpus is None else [args.gpus], [DEFAULT_GPUS], "--gpus")
    topology = args.topology.build(gpus)
    mask = resolve(args.mask)
    options = planner.PlanOptions(eps=args.eps, time_budget=args.time_budget, use_solver=not args.no_solver,
                                  chunks_per_rank=args.chunks_per_rank)
    order = None if args.owner_map == "contiguous" else planner.choose_order(mask, args.seq, gpus, options=options)
    req = planner.request(mask, args.seq, topology, args.batch, args.heads, args.kv_heads, args.head_dim, args.dtype,
                          options, order=order)
    owner_map = "contiguous" if order is None else (f"round-robin, {len(order) // gpus} pieces of "
                                                    f"{args.seq // len(order)} tokens per rank (cells in the "
                                                    "ranks' order)")
    err = stderr()
    with err.status(f"planning {gpus} devices ({topology.nodes} x {topology.devices_per_node})"):
        plan = planner.get_plan(req, cache=not args.no_cache, directory=args.cache_dir)
    out = stdout()
    table = plan.table
    out.print(f"[bold]UltraAttn plan[/bold]: mask {mask!r}, S={args.seq}, {topology.nodes} x "
              f"{topology.devices_per_node} devices ({topology.name}), h={args.heads}:{args.kv_heads} "
              f"d={args.head_dim} b={args.batch} {args.dtype}; {table.n} x {table.n} cells of {table.chunk} tokens "
              f"({plan.chunks_per_rank} per rank), node-level chunk {req.node_chunk}; owner map: {owner_map}; "
              f"built in {plan.seconds:.1f} s; "
              f"cache: {'off' if args.no_cache else args.cache_dir or planner.cache_dir()}")
    rows = []
    for name in ("forward", "backward"):
        for r in plan.phase(name).levels:
            where = r["level"] + (f" {r['node']}" if "node" in r else "") + (" (reused)" if r.get("reused") else "")
            rows.append([name, where, r["method"], r["status"], str(r["v"]), str(r["greedy_v"] or "-"),
                         f"{r['max_load']} / {r['bound']}", f"{r['seconds']:.2f}"])
    out.print(tables.table(LEVELS, rows, everything="--json PATH has the whole plan",
                           title="placement (partition ILP per level; V = busiest unit's traffic in message units)"))
    elem = DTYPE_BYTES[args.dtype]
    sizes = plan.sizes(args.batch, args.heads, args.kv_heads, args.head_dim, elem, 8 if elem == 8 else 4)
    rows = []
    for name in ("forward", "backward"):
        ph = plan.phase(name)
        vols = [plan.volume(r, sizes)[name] for r in range(plan.world)]
        sent = max(v.get("send", {}).get("bytes_sent", 0) for v in vols)
        recv = max(v.get("recv", {}).get("bytes_recv", 0) for v in vols)
        rows.append([name, str(len(ph.kernels)), str(ph.max_cells), str(len(ph.transfers)), f"{sent / 1e6:.4g}",
                     f"{recv / 1e6:.4g}", f"{ph.predicted * 1e3:.4g}", f"{ph.scheduler['method']} "
                                                                      f"({ph.scheduler['status']})"])
    out.print(tables.table(SCHEDULE, rows, everything="--json PATH has the whole plan",
                           title="schedule (kernel graph on compute / send / receive lanes)"))
    digits = len(str(plan.world - 1))
    if table.n <= 64 and table.n * (digits + 1) - 1 <= (tables.columns() or tables.FULL_WIDTH):
        out.print("block table ('.' empty, '#' full, '\\' causal, '+' partial):", highlight=False)
        out.print(table.render(), highlight=False, markup=False)
        for name in ("forward", "backward"):
            ph = plan.phase(name)
            out.print(f"{name} placement (rank per cell, '.' empty):", highlight=False)
            for i in range(table.n):
                out.print(" ".join("." * digits if ph.assign[i * table.n + j] < 0
                                   else str(ph.assign[i * table.n + j]).rjust(digits) for j in range(table.n)),
                          highlight=False)
    else:
        out.print(f"({table.n} x {table.n} cells: see the heatmap)")
    for path, write in ((args.json, planner.save_plan), (args.heatmap, plot.heatmap), (args.timeline, plot.timeline)):
        if path:
            write(plan, path)
            err.print(f"wrote {path}")
    return 0
