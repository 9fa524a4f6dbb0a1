"""``cpattn calibrate``: measure this machine's kernels and collectives into a cost-model profile."""

from __future__ import annotations

import argparse

from .output import stderr, stdout


def add_parser(sub) -> argparse.ArgumentParser:
    c = sub.add_parser("calibrate", help="measure this machine's kernels and collectives for the cost model")
    c.add_argument("--profile", help="where to write the profile (default: $CPATTN_PROFILE or "
                                     "~/.cache/cpattn/profile.json)")
    c.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (a smoke test, not a profile "
                                                        "to rely on)")
    c.set_defaults(func=run)
    return c


def run(args) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from ..cost import profile
    from ..lab import calibrate

    settings = calibrate.QUICK if args.quick else calibrate.Settings()
    with Progress(TextColumn("calibrate: {task.description}"), BarColumn(), TimeElapsedColumn(), console=stderr(),
                  transient=True) as progress:
        task = progress.add_task("starting a local world", total=None)

        def update(what: str, done: int, total: int) -> None:
            progress.update(task, description=what, completed=done, total=total)

        prof = calibrate.calibrate(settings, progress=update)
    path = profile.save(prof, args.profile)
    out = stdout()
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
