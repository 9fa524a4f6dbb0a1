"""Command line: ``cpattn bench``, ``cpattn verify``, ``cpattn schedules``."""

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


def _supporting(names: list[str] | None, mask_name: str) -> list[str]:
    from . import schedules
    from .masks import resolve

    mask = resolve(mask_name)
    if names:
        return names
    out = []
    for name in schedules.names():
        try:
            schedules.get(name).check_mask(mask)
        except (ValueError, NotImplementedError):
            continue
        out.append(name)
    return out


def _cmd_bench(args) -> int:
    from . import bench

    console = Console(stderr=True)
    cfg = bench.BenchConfig(world=args.world, seq=args.seq, batch=args.batch, heads=args.heads,
                            kv_heads=args.kv_heads, head_dim=args.head_dim, mask=args.mask, dtype=args.dtype,
                            warmup=args.warmup, iters=args.iters, threads=args.threads)
    names = _supporting(args.schedules, args.mask)
    with console.status("starting") as status:
        result = bench.run(cfg, names, progress=lambda msg: status.update(f"bench: {msg}"))
    _stdout().print(bench.render(result))
    if args.json:
        bench.save_json(result, args.json)
        console.print(f"wrote {args.json}")
    if args.plot:
        bench.plot(result, args.plot)
        console.print(f"wrote {args.plot}")
    return 0 if all(r["ok"] for r in result["rows"]) else 1


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpattn", description="Exact context-parallel attention.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="time schedules on N local processes against one process")
    b.add_argument("--world", "-P", type=int, default=2, help="number of local ranks (default 2)")
    b.add_argument("--seq", type=int, default=4096, help="global sequence length (default 4096)")
    b.add_argument("--batch", type=int, default=1)
    b.add_argument("--heads", type=int, default=8)
    b.add_argument("--kv-heads", type=int, default=2)
    b.add_argument("--head-dim", type=int, default=64)
    b.add_argument("--mask", default="causal", choices=["causal", "full"])
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    b.add_argument("--schedules", type=_csv(str), default=None,
                   help="comma-separated names (default: every schedule that supports the mask)")
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--iters", type=int, default=3)
    b.add_argument("--threads", type=int, default=0, help="torch threads per rank (default cores / world)")
    b.add_argument("--json", help="also write the rows as JSON to this path")
    b.add_argument("--plot", help="also write a PNG bar chart of efficiency to this path")
    b.set_defaults(func=_cmd_bench)

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
