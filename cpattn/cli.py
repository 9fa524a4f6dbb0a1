"""Command line: ``cpattn bench``, ``verify``, ``schedules``, ``calibrate``, ``simulate``."""

from __future__ import annotations

import argparse
import logging
import sys

from rich.console import Console


def _stdout() -> Console:
    """Wide enough for the tables even when stdout is not a terminal (CI logs, pipes)."""
    return Console() if sys.stdout.isatty() else Console(width=160)


def _csv(kind):
    def parse(text: str):
        return [kind(x) for x in text.split(",") if x]
    return parse


def _cmd_schedules(args) -> int:
    from rich.table import Table

    from . import schedules

    t = Table(title="cpattn schedules")
    for col in ("name", "layout", "masks", "causal", "bidirectional", "gqa", "memory", "summary"):
        t.add_column(col)
    for row in schedules.available():
        t.add_row(*[str(row[c]) for c in ("name", "layout", "masks", "causal", "bidirectional", "gqa", "memory",
                                          "summary")])
    _stdout().print(t)
    return 0


def _supporting(names: list[str] | None, mask_name, layout: str | None = None) -> list[str]:
    """``names``, or every registered schedule that runs ``mask_name`` (and accepts ``layout``)."""
    from . import schedules
    from .masks import resolve

    mask = resolve(mask_name)
    if names:
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


def _masks_arg(text: str) -> list:
    """``--mask``: comma-separated names (causal, full), or one JSON mask spec / a JSON list of them
    (cpattn.masks.from_spec), e.g. '{"kind": "strided", "block_size": 1024, "stride": 4}'."""
    import json

    text = text.strip()
    if text.startswith(("{", "[")):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--mask is not valid JSON: {exc}") from None
        return value if isinstance(value, list) else [value]
    return [x for x in text.split(",") if x]


def _topology_arg(text: str) -> tuple[int, int]:
    """``--topology NxD``: N nodes of D devices."""
    try:
        nodes, devices = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--topology {text!r}: expected NODESxDEVICES, e.g. 2x2") from None
    return nodes, devices


def _layouts_arg(text: str) -> list[str | None]:
    """``--layout``: comma-separated; 'default' = each schedule's own layout."""
    return [None if x == "default" else x for x in text.split(",") if x]


def _cmd_bench(args) -> int:
    import itertools
    import json

    from . import bench

    console = Console(stderr=True)
    from .masks import resolve

    for mask in args.mask:
        resolve(mask)  # a clear error for a bad name or spec, before any process starts
    profile = _profile(args.profile) if args.predict else None
    results = []
    for world, seq, mask, layout in itertools.product(args.world, args.seq, args.mask, args.layout):
        cfg = bench.BenchConfig(world=world, seq=seq, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                                head_dim=args.head_dim, mask=mask, dtype=args.dtype, warmup=args.warmup,
                                iters=args.iters, threads=args.threads, topology=args.topology, layout=layout)
        names = _supporting(args.schedules, mask, layout)
        with console.status("starting") as status:
            result = bench.run(cfg, names, progress=lambda msg: status.update(f"bench: {msg}"))
        if args.predict:
            bench.predict(result, profile)
        _stdout().print(bench.render(result))
        results.append(result)
    if args.predict:
        summary = bench.prediction_summary(results)
        _stdout().print(f"prediction error over {summary['rows']} schedule runs: median |error| "
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


def _profile(path: str | None):
    """The calibration profile at ``path``, or at the default location (None when there is none)."""
    from .cost import profile

    return profile.load(path) if path else profile.load_default()


def _cmd_calibrate(args) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from .cost import calibrate, profile

    settings = calibrate.QUICK if args.quick else calibrate.Settings()
    err = Console(stderr=True)
    with Progress(TextColumn("calibrate: {task.description}"), BarColumn(), TimeElapsedColumn(), console=err,
                  transient=True) as progress:
        task = progress.add_task("starting a local world", total=None)

        def update(what: str, done: int, total: int) -> None:
            progress.update(task, description=what, completed=done, total=total)

        prof = calibrate.calibrate(settings, progress=update)
    path = profile.save(prof, args.profile)
    out = _stdout()
    out.print(f"{prof.ranks} ranks x {prof.threads_per_rank} threads on {prof.cores} cores; kernel shape "
              f"{prof.host.get('kernel_shape', '')}")
    t = Table(title="kernel throughput, GFLOP/s per rank")
    for col in ("kind", "block", "forward", "backward"):
        t.add_column(col, justify="left" if col == "kind" else "right")
    rates = {(p.kind, p.q_len, p.phase): p.flop_per_s for p in prof.kernels}
    for kind, n in sorted({(p.kind, p.q_len) for p in prof.kernels}):
        t.add_row(kind, f"{n}x{n}", *(f"{rates.get((kind, n, ph), float('nan')) / 1e9:.1f}"
                                      for ph in ("forward", "backward")))
    out.print(t)
    t = Table(title="communication (fitted to each op's cost formula)")
    for col in ("op", "latency us", "bandwidth GB/s"):
        t.add_column(col, justify="left" if col == "op" else "right")
    for op, link in prof.links.items():
        t.add_row(op, f"{link.latency * 1e6:.1f}", f"{link.bandwidth / 1e9:.3f}")
    out.print(t)
    out.print(f"epilogue memory bandwidth {prof.memory_bandwidth / 1e9:.1f} GB/s; a transfer hides "
              f"{prof.overlap:.0%} behind a concurrent kernel")
    out.print(f"wrote {path}")
    return 0


def _cmd_simulate(args) -> int:
    import json

    from rich.progress import Progress
    from rich.table import Table

    from . import cost, schedules
    from .cost.presets import preset
    from .cost.steps import split_phase
    from .masks import resolve

    if (args.seq is None) == (args.seq_per_gpu is None):
        raise ValueError("give exactly one of --seq (global tokens) and --seq-per-gpu (tokens per GPU)")
    mask = resolve(json.loads(args.mask) if args.mask.lstrip().startswith("{") else args.mask)
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
    prof = _profile(args.profile) if args.topology == "local" else None
    rows, bounds = [], {}
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("simulate", total=len(args.gpus) * len(names))
        for p in args.gpus:
            topo = preset(args.topology, p, prof)
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
                row = {"gpus": p, "seq": seq, "schedule": name, "estimate": None, "note": ""}
                try:
                    cost.check_supports(name, problem)
                    est = cost.estimate(name, problem, topo, args.phase)
                    row["estimate"] = est
                    if est.peak_memory > topo.device.memory:
                        row["note"] = f"exceeds {topo.device.memory / 2**30:.0f} GiB"
                except (ValueError, TypeError, NotImplementedError) as exc:
                    row["note"] = str(exc)
                rows.append(row)
                progress.advance(task)
    t = Table(title=f"cpattn simulate: {args.topology}, {mask!r}, h={args.heads}:{args.kv_heads} d={args.head_dim} "
                    f"b={args.batch} {args.dtype}, {args.phase}",
              caption="times on the busiest rank; TFLOP/s counts allowed (q, k) pairs (bwd = 2.5 x fwd); "
                      "vs ring = T(ring) / T(schedule)")
    for col in ("GPUs", "seq", "schedule", "total ms", "compute ms", "comm ms", "exposed ms", "TFLOP/s/GPU",
                "vs ring", "sent MB/GPU", "peak GiB/GPU", "note"):
        t.add_column(col, justify="left" if col in ("schedule", "note") else "right")
    ring = {r["gpus"]: r["estimate"] for r in rows if r["schedule"] == "ring" and r["estimate"] is not None}
    for r in rows:
        e = r["estimate"]
        if e is None:
            t.add_row(str(r["gpus"]), str(r["seq"]), r["schedule"], *[""] * 8, f"[dim]{r['note']}[/dim]")
            continue
        vs = f"{ring[r['gpus']].total / e.total:.2f}x" if r["gpus"] in ring else "-"
        t.add_row(str(r["gpus"]), str(r["seq"]), r["schedule"], f"{e.total * 1e3:.4g}", f"{e.compute * 1e3:.4g}",
                  f"{e.comm * 1e3:.4g}", f"{e.exposed_comm * 1e3:.4g}", f"{e.tflops_per_rank(r['gpus']):.3g}", vs,
                  f"{e.bytes_per_rank / 1e6:.4g}", f"{e.peak_memory / 2**30:.3g}", r["note"])
    out = _stdout()
    out.print(t)
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

        with open(args.json, "w") as f:
            json.dump([{**r, "estimate": asdict(r["estimate"]) if r["estimate"] else None} for r in rows], f,
                      indent=2)
        Console(stderr=True).print(f"wrote {args.json}")
    if args.plot:
        _plot_simulation(rows, args, mask.name, args.plot)
        Console(stderr=True).print(f"wrote {args.plot}")
    return 0


def _plot_simulation(rows: list[dict], args, mask_label: str, path: str) -> None:
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
        ax_t.plot(gpus, [e.total for _, e in pts], marker="o", label=name)
        ax_f.plot(gpus, [e.tflops_per_rank(g) for g, e in pts], marker="o", label=name)
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


def _cmd_verify(args) -> int:
    from rich.progress import Progress
    from rich.table import Table

    from . import schedules as registry
    from . import verify
    from .comm import POISON_ENV
    from .launcher import LocalWorld

    names = args.schedules or registry.names()
    cases = verify.matrix(names, worlds=tuple(args.world), subgroup=not args.no_subgroup and 4 in args.world,
                          masks=tuple(args.masks), dtypes=tuple(args.dtypes), seed=args.seed)
    worlds: dict[int, LocalWorld] = {}
    results = []
    try:
        with Progress(console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task("verify", total=len(cases))
            for case in cases:
                progress.update(task, description=case.label)
                w = worlds.get(case.world)
                if w is None or not w.alive:
                    w = worlds[case.world] = LocalWorld(case.world, env={POISON_ENV: "1"})
                results.append(verify.run(w, case, timeout=args.timeout))
                progress.advance(task)
    finally:
        for w in worlds.values():
            w.close()
    t = Table(title="cpattn verify: relative error vs float64 (tolerance 2 x single-device error + 1e-6)")
    for col in ("case", "result", *verify.QUANTITIES, "max err/tol", "comm"):
        t.add_column(col, justify="left" if col in ("case", "result") else "right")
    for r in results:
        cells = [f"{r.errors[q]:.1e}" if q in r.errors else "-" for q in verify.QUANTITIES]
        comm = "[red]differs[/red]" if r.comm_mismatches else ("-" if r.failure else "ok")
        verdict = "[green]pass[/green]" if r.passed else "[red]FAIL[/red]"
        ratio = max((r.errors[q] / r.tolerances[q] for q in r.errors), default=float("nan"))
        t.add_row(r.case.label, verdict, *cells, f"{ratio:.2f}", comm)
    console = _stdout()
    console.print(t)
    failed = [r for r in results if not r.passed]
    for r in failed:
        console.print(f"[red]FAIL[/red] {r.describe()}", markup=True, highlight=False)
    console.print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump([r.as_dict() for r in results], f, indent=2)
    return 1 if failed else 0


def _plan_topology(spec: str, world: int):
    """A preset name (``dgx-h100``, ``frontier``, ...) or ``NxD`` (nodes x devices, generic figures)."""
    from .cost import Topology
    from .cost.presets import preset

    if "x" in spec and spec.replace("x", "").isdigit():
        nodes, per_node = (int(x) for x in spec.split("x"))
        if nodes * per_node != world:
            raise ValueError(f"--topology {spec} has {nodes * per_node} devices but --gpus is {world}")
        return Topology(nodes, per_node, name=spec)
    return preset(spec, world)


def _cmd_plan(args) -> int:
    import json

    from rich.table import Table

    from . import planner
    from .cost.steps import DTYPE_BYTES
    from .masks import resolve
    from .planner import plot

    topology = _plan_topology(args.topology, args.gpus)
    mask = resolve(json.loads(args.mask) if args.mask.lstrip().startswith("{") else args.mask)
    options = planner.PlanOptions(eps=args.eps, time_budget=args.time_budget, use_solver=not args.no_solver,
                                  chunks_per_rank=args.chunks_per_rank)
    order = None if args.owner_map == "contiguous" else planner.choose_order(mask, args.seq, args.gpus, options=options)
    req = planner.request(mask, args.seq, topology, args.batch, args.heads, args.kv_heads, args.head_dim, args.dtype,
                          options, order=order)
    owner_map = "contiguous" if order is None else (f"round-robin, {len(order) // args.gpus} pieces of "
                                                    f"{args.seq // len(order)} tokens per rank (cells in the "
                                                    "ranks' order)")
    err = Console(stderr=True)
    with err.status(f"planning {args.gpus} devices ({topology.nodes} x {topology.devices_per_node})"):
        plan = planner.get_plan(req, cache=not args.no_cache, directory=args.cache_dir)
    out = _stdout()
    table = plan.table
    out.print(f"[bold]UltraAttn plan[/bold]: mask {mask!r}, S={args.seq}, {topology.nodes} x "
              f"{topology.devices_per_node} devices ({topology.name}), h={args.heads}:{args.kv_heads} "
              f"d={args.head_dim} b={args.batch} {args.dtype}; {table.n} x {table.n} cells of {table.chunk} tokens "
              f"({plan.chunks_per_rank} per rank), node-level chunk {req.node_chunk}; owner map: {owner_map}; "
              f"built in {plan.seconds:.1f} s; "
              f"cache: {'off' if args.no_cache else args.cache_dir or planner.cache_dir()}")
    levels = Table(title="placement (partition ILP per level; V = busiest unit's traffic in message units)")
    for col in ("phase", "level", "method", "status", "V", "greedy V", "max load / bound", "s"):
        levels.add_column(col, justify="left" if col in ("phase", "level", "method", "status") else "right")
    for name in ("forward", "backward"):
        for r in plan.phase(name).levels:
            where = r["level"] + (f" {r['node']}" if "node" in r else "") + (" (reused)" if r.get("reused") else "")
            levels.add_row(name, where, r["method"], r["status"], str(r["v"]), str(r["greedy_v"] or "-"),
                           f"{r['max_load']} / {r['bound']}", f"{r['seconds']:.2f}")
    out.print(levels)
    elem = DTYPE_BYTES[args.dtype]
    sizes = plan.sizes(args.batch, args.heads, args.kv_heads, args.head_dim, elem, 8 if elem == 8 else 4)
    summary = Table(title="schedule (kernel graph on compute / send / receive lanes)")
    for col in ("phase", "kernels", "max cells", "transfers", "busiest sent MB", "busiest recv MB", "predicted ms",
                "scheduler"):
        summary.add_column(col, justify="left" if col in ("phase", "scheduler") else "right")
    for name in ("forward", "backward"):
        ph = plan.phase(name)
        vols = [plan.volume(r, sizes)[name] for r in range(plan.world)]
        sent = max(v.get("send", {}).get("bytes_sent", 0) for v in vols)
        recv = max(v.get("recv", {}).get("bytes_recv", 0) for v in vols)
        summary.add_row(name, str(len(ph.kernels)), str(ph.max_cells), str(len(ph.transfers)), f"{sent / 1e6:.4g}",
                        f"{recv / 1e6:.4g}", f"{ph.predicted * 1e3:.4g}",
                        f"{ph.scheduler['method']} ({ph.scheduler['status']})")
    out.print(summary)
    if table.n <= 64:
        out.print("block table ('.' empty, '#' full, '\\' causal, '+' partial):", highlight=False)
        out.print(table.render(), highlight=False, markup=False)
        for name in ("forward", "backward"):
            ph = plan.phase(name)
            width = len(str(plan.world - 1))
            out.print(f"{name} placement (rank per cell, '.' empty):", highlight=False)
            for i in range(table.n):
                out.print(" ".join("." * width if ph.assign[i * table.n + j] < 0
                                   else str(ph.assign[i * table.n + j]).rjust(width) for j in range(table.n)),
                          highlight=False)
    else:
        out.print(f"({table.n} x {table.n} cells: see the heatmap)")
    if args.json:
        planner.save_plan(plan, args.json)
        err.print(f"wrote {args.json}")
    if args.heatmap:
        plot.heatmap(plan, args.heatmap)
        err.print(f"wrote {args.heatmap}")
    if args.timeline:
        plot.timeline(plan, args.timeline)
        err.print(f"wrote {args.timeline}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpattn", description="Exact context-parallel attention.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="time schedules on N local processes against one process")
    b.add_argument("--world", "-P", type=_csv(int), default=[2],
                   help="number of local ranks (default 2); a comma-separated list runs each")
    b.add_argument("--seq", type=_csv(int), default=[4096],
                   help="global sequence length (default 4096); a comma-separated list runs each")
    b.add_argument("--batch", type=int, default=1)
    b.add_argument("--heads", type=int, default=8)
    b.add_argument("--kv-heads", type=int, default=2)
    b.add_argument("--head-dim", type=int, default=64)
    b.add_argument("--mask", type=_masks_arg, default=["causal"],
                   help="causal, full, or both: causal,full; or a JSON mask spec (or list of specs), e.g. "
                        '\'{"kind": "strided", "block_size": 1024, "stride": 4}\'')
    b.add_argument("--topology", type=_topology_arg, default=None,
                   help="NODESxDEVICES given to every schedule (emulated on this machine), e.g. 2x2")
    b.add_argument("--layout", type=_layouts_arg, default=[None],
                   help="comma-separated layouts to compare: default (each schedule's own), balanced, "
                        "contiguous, zigzag; only schedules that accept a layout run under a non-default one")
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    b.add_argument("--schedules", type=_csv(str), default=None,
                   help="comma-separated names (default: every schedule that supports the mask)")
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--iters", type=int, default=3)
    b.add_argument("--threads", type=int, default=0, help="torch threads per rank (default cores / world)")
    b.add_argument("--predict", action="store_true",
                   help="add the cost model's prediction and its error to each row, and the median |error|")
    b.add_argument("--profile", help="calibration profile for --predict (default: the one `cpattn calibrate` wrote)")
    b.add_argument("--json", help="also write the rows as JSON to this path (several configurations: {runs: [...]})")
    b.add_argument("--plot", help="also write a PNG bar chart of efficiency (of the last configuration)")
    b.set_defaults(func=_cmd_bench)

    c = sub.add_parser("calibrate", help="measure this machine's kernels and collectives for the cost model")
    c.add_argument("--profile", help="where to write the profile (default: $CPATTN_PROFILE or "
                                     "~/.cache/cpattn/profile.json)")
    c.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (a smoke test, not a profile "
                                                        "to rely on)")
    c.set_defaults(func=_cmd_calibrate)

    m = sub.add_parser("simulate", help="predict every schedule on a topology preset at many GPU counts")
    m.add_argument("--topology", default="frontier", help="frontier, dgx-h100, dgx-a100 or local (default frontier)")
    m.add_argument("--gpus", type=_csv(int), default=[8, 64, 512, 4096], help="comma-separated GPU counts")
    m.add_argument("--seq", type=int, default=None, help="global sequence length (strong scaling)")
    m.add_argument("--seq-per-gpu", type=int, default=None, help="tokens per GPU (weak scaling)")
    m.add_argument("--mask", default="causal",
                   help='causal, full, or a mask spec (cpattn.masks.from_spec) as JSON, e.g. '
                        '\'{"kind": "star", "block_size": 2048, "sink": 1}\'')
    m.add_argument("--batch", type=int, default=1)
    m.add_argument("--heads", type=int, default=32)
    m.add_argument("--kv-heads", type=int, default=8)
    m.add_argument("--head-dim", type=int, default=128)
    m.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    m.add_argument("--phase", default="forward+backward", choices=["forward", "backward", "forward+backward"])
    m.add_argument("--schedules", type=_csv(str), default=None,
                   help="comma-separated (default: all registered; ultra only for masks other than causal and full)")
    m.add_argument("--profile", help="calibration profile for --topology local")
    m.add_argument("--json", help="also write the rows as JSON to this path")
    m.add_argument("--plot", default="simulate.png", help="scaling plot PNG (default simulate.png; '' for none)")
    m.set_defaults(func=_cmd_simulate)

    v = sub.add_parser("verify", help="run the exactness matrix on local processes")
    v.add_argument("--world", type=_csv(int), default=[1, 2, 3, 4], help="world sizes (default 1,2,3,4)")
    v.add_argument("--schedules", type=_csv(str), default=None, help="comma-separated (default: all)")
    v.add_argument("--masks", type=_csv(str), default=["causal", "full"])
    v.add_argument("--dtypes", type=_csv(str), default=["float32", "bfloat16"])
    v.add_argument("--no-subgroup", action="store_true", help="skip the 2-rank subgroup of a 4-rank world")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    v.add_argument("--json", help="also write the results as JSON to this path")
    v.set_defaults(func=_cmd_verify)

    pl = sub.add_parser("plan", help="build (or load) an UltraAttn plan: print the placement and predicted time, "
                                     "draw a heatmap and a timeline")
    pl.add_argument("--topology", default="dgx-h100",
                    help="a preset (dgx-h100, dgx-a100, frontier, local) or NxD, e.g. 2x4 (default dgx-h100)")
    pl.add_argument("--gpus", "-P", type=int, default=8, help="number of devices (default 8)")
    pl.add_argument("--seq", type=int, default=65536, help="global sequence length (default 65536)")
    pl.add_argument("--mask", default="causal",
                    help="causal, full, or a mask spec (cpattn.masks.from_spec) as JSON")
    pl.add_argument("--batch", type=int, default=1)
    pl.add_argument("--heads", type=int, default=32)
    pl.add_argument("--kv-heads", type=int, default=8)
    pl.add_argument("--head-dim", type=int, default=128)
    pl.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"])
    pl.add_argument("--eps", type=float, default=0.1, help="load tolerance of the partition ILP (default 0.1)")
    pl.add_argument("--time-budget", type=float, default=15.0, help="seconds of CP-SAT solving per plan (default 15)")
    pl.add_argument("--no-solver", action="store_true", help="greedy placement and list schedule only")
    pl.add_argument("--chunks-per-rank", type=int, default=None, help="fix the granularity (default: automatic)")
    pl.add_argument("--owner-map", choices=["auto", "contiguous"], default="auto",
                    help="which rank holds which tokens: ultra's own choice (round-robin pieces when they keep "
                         "clearly more work local) or contiguous (default auto)")
    pl.add_argument("--cache-dir", default=None, help="plan cache (default $CPATTN_CACHE_DIR or ~/.cache/cpattn/plans)")
    pl.add_argument("--no-cache", action="store_true", help="always plan anew; store nothing")
    pl.add_argument("--json", help="also write the plan JSON to this path")
    pl.add_argument("--heatmap", default="plan_heatmap.png", help="PNG of which rank computes each cell ('' for none)")
    pl.add_argument("--timeline", default="plan_timeline.png", help="PNG of every rank's lanes ('' for none)")
    pl.set_defaults(func=_cmd_plan)

    s = sub.add_parser("schedules", help="list schedules and what each supports")
    s.set_defaults(func=_cmd_schedules)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    try:
        return args.func(args)
    except (ValueError, TypeError, NotImplementedError) as exc:
        Console(stderr=True).print(f"[red]error:[/red] {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
