"""``cpattn train``: a reference model trained with data x context parallelism on local processes.

The same loop runs unchanged under torchrun: ``torchrun --nproc-per-node N -m cpattn.train ...``
(:mod:`cpattn.train`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from .output import stderr, stdout


def add_parser(sub) -> argparse.ArgumentParser:
    from .. import train

    t = sub.add_parser("train", help="train a reference model (llama, vit) with DP x CP on local processes")
    t.add_argument("--nproc", type=int, default=2, help="local processes (= dp x cp)")
    t.add_argument("--timeout", type=float, default=3600.0, help="seconds the whole run may take")
    train.add_arguments(t)
    t.set_defaults(func=run)
    return t


def run(args) -> int:
    from rich.table import Table

    from .. import train
    from ..launcher import LocalWorld, RankError

    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    cfg = train.config_from_args(args, args.nproc)  # every check before any process starts
    if cfg.world != args.nproc:
        raise ValueError(f"--dp {cfg.dp} x --cp {cfg.cp} = {cfg.world} ranks, but --nproc is {args.nproc}")
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    err = stderr()
    err.print(f"starting {args.nproc} local processes ({threads} thread(s) each)")
    with LocalWorld(args.nproc, threads=threads) as world:
        results = world.run(train.run_rank, timeout=args.timeout, name="cpattn train",
                            config=dataclasses.asdict(cfg))
    failed = [r for r in results if isinstance(r, RankError)]
    if failed:
        err.print(f"[red]training failed:[/red] {failed[0]}\n{failed[0].traceback}")
        return 1
    rec = results[0]
    table = Table(title=f"{cfg.model} {cfg.config}, dp {cfg.dp} x cp {cfg.cp}, {rec['schedule']}, {cfg.task}")
    for col in ("steps", "first loss", "last loss", "tokens/s", "TFLOP/s/rank", "MFU"):
        table.add_column(col, justify="right")
    losses = rec["losses"]
    table.add_row(str(len(losses)), f"{losses[0]:.4f}", f"{losses[-1]:.4f}", f"{rec['tokens_per_s']:.0f}",
                  f"{rec['tflops_per_rank']:.4f}", f"{100 * rec['mfu']:.1f}%")
    out = stdout()
    out.print(table)
    for ev in rec["evaluations"]:
        out.print(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in ev.items()))
    for what, path in (("log", cfg.log), ("loss curve", cfg.plot)):
        if path:
            err.print(f"wrote {what} {path}")
    return 0
