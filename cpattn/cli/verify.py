"""``cpattn verify``: the exactness matrix on local processes."""

from __future__ import annotations

import argparse

from ..output import Column, save_json, stderr, stdout, table, to_stdout
from . import args as a


def add_parser(sub) -> argparse.ArgumentParser:
    v = sub.add_parser("verify", help="run the exactness matrix on local processes")
    v.add_argument("--world", type=a.csv(a.positive), default=[1, 2, 3, 4], help="world sizes (default 1,2,3,4)")
    v.add_argument("--schedules", type=a.csv(str), default=None, help="comma-separated (default: all)")
    v.add_argument("--masks", type=a.masks, default=["causal", "full"],
                   help="comma-separated mask kinds (cpattn.masks.KINDS; example arguments for each), or a JSON "
                        "mask spec or list of specs (default causal,full)")
    v.add_argument("--dtypes", type=a.csv(str), default=["float32", "bfloat16"])
    v.add_argument("--no-subgroup", action="store_true", help="skip the 2-rank subgroup of a 4-rank world")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    v.add_argument("--json", metavar="PATH",
                   help="also write the results as JSON to PATH ('-': to stdout, in place of the table)")
    v.set_defaults(func=run)
    return v


def _matrix_mask(spec: str | dict):
    """A ``--masks`` item as ``exactness.matrix`` takes it: a kind name, or ``(kind, arguments)``."""
    from ..core.masks import KINDS

    kind = spec if isinstance(spec, str) else spec.get("kind") if isinstance(spec, dict) else None
    if kind not in KINDS:
        raise ValueError(f"--masks: mask kind {kind!r} is unknown; accepted: {', '.join(KINDS)}")
    if isinstance(spec, str):
        return spec
    return kind, {k: v for k, v in spec.items() if k != "kind"} or None


def cases(args) -> list:
    """The ``exactness.Case`` list the arguments ask for (a ValueError for an unknown schedule, mask kind or
    dtype), built before any process starts."""
    from .. import exactness
    from .. import schedules as registry

    names = args.schedules or registry.names()
    unknown = [d for d in args.dtypes if d not in exactness.DTYPES]
    if unknown:
        raise ValueError(f"--dtypes {','.join(unknown)}: accepted: {', '.join(exactness.DTYPES)}")
    return exactness.matrix(names, worlds=tuple(args.world), subgroup=not args.no_subgroup and 4 in args.world,
                         masks=tuple(_matrix_mask(m) for m in args.masks), dtypes=tuple(args.dtypes), seed=args.seed)


def run(args) -> int:
    from rich.progress import Progress

    from .. import exactness
    from ..core.comm import POISON_ENV
    from ..launcher import LocalWorld

    todo = cases(args)
    worlds: dict[int, LocalWorld] = {}
    results = []
    try:
        with Progress(console=stderr(), transient=True) as progress:
            task = progress.add_task("verify", total=len(todo))
            for case in todo:
                progress.update(task, description=case.label)
                w = worlds.get(case.world)
                if w is None or not w.alive:
                    w = worlds[case.world] = LocalWorld(case.world, env={POISON_ENV: "1"})
                results.append(exactness.run(w, case, timeout=args.timeout))
                progress.advance(task)
    finally:
        for w in worlds.values():
            w.close()
    cols = [Column("case", "left", wrap=True, min_width=24), Column("result", "left"),
            *[Column(q, drop=len(exactness.QUANTITIES) - k) for k, q in enumerate(exactness.QUANTITIES)],
            Column("max err/tol"), Column("comm")]
    rows = []
    for r in results:
        cells = [f"{r.errors[q]:.1e}" if q in r.errors else "-" for q in exactness.QUANTITIES]
        comm = "[red]differs[/red]" if r.comm_mismatches else ("-" if r.failure else "ok")
        verdict = "[green]pass[/green]" if r.passed else "[red]FAIL[/red]"
        ratio = max((r.errors[q] / r.tolerances[q] for q in r.errors), default=float("nan"))
        rows.append([r.case.label, verdict, *cells, f"{ratio:.2f}", comm])
    console = stdout(to_stdout(args.json))
    console.print(table(cols, rows, title="cpattn verify: relative error vs float64 (tolerance 2 x single-device "
                                          "error + 1e-6)", everything="--json PATH has every error"))
    failed = [r for r in results if not r.passed]
    for r in failed:
        console.print(f"[red]FAIL[/red] {r.describe()}", markup=True, highlight=False)
    console.print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    if args.json:
        save_json([r.as_dict() for r in results], args.json)
    return 1 if failed else 0
