"""``cpattn train``: a reference model trained with data x context parallelism on local processes.

``--cp`` and ``--schedule`` take comma-separated lists: every combination trains in turn (one local
world per number of ranks, each rank with ``cores / ranks`` threads) and the table compares their
throughput with ``ring`` on the same mesh and with the one-context-rank run of the same schedule. The
same loop runs unchanged under torchrun: ``torchrun --nproc-per-node N -m cpattn.train ...``
(:mod:`cpattn.train`).

Everything that can be checked before the workers start is (arguments, the model config, the schedule
against the mask, the checkpoint directory: :func:`cpattn.train.preflight`), each failure one line.
SIGTERM is forwarded to the workers, which finish their step, save, and stop (exit 0, with the line to
resume); a lost worker ends with one line naming it and how to resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
from pathlib import Path

from .output import stderr, stdout


def add_parser(sub) -> argparse.ArgumentParser:
    from .. import train

    t = sub.add_parser("train", help="train a reference model (llama, vit) with DP x CP on local processes")
    t.add_argument("--nproc", type=int, default=None, help="local processes (= dp x cp; default: dp x cp)")
    t.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    train.add_arguments(t, compare=True)
    t.set_defaults(func=run)
    return t


def configs(args) -> list:
    """Every run the arguments ask for, checked before any process starts."""
    from .. import schedules, train

    cps = args.cp or ([args.nproc // max(1, args.dp)] if args.nproc else [1])
    if args.nproc is not None and (len(cps) > 1 or args.dp * cps[0] != args.nproc):
        raise ValueError(f"--nproc {args.nproc} must equal --dp {args.dp} x --cp {','.join(map(str, cps))}")
    names = [s for s in (args.schedule or "").split(",") if s.strip()] or [None]
    for name in names:
        if name is not None:
            schedules.get(name)  # an unknown name fails here
    runs = [train.config_from_args(args, args.dp * cp, cp=cp, schedule=name) for cp in cps for name in names]
    if len(runs) > 1 and args.checkpoint:
        raise ValueError("--checkpoint takes one run: give one --cp and one --schedule")
    for cfg in runs:
        train.preflight(cfg)  # rank 0 prints what a resume passes over and changes, checksums verified
    return runs


#: what a case raised on the workers that is the user's to fix: one line, no traceback
_USER_ERRORS = ("ValueError", "CheckpointError", "TrainingStopped", "RanksDisagreeError", "MemoryError")


def _resume_hint(cfg) -> str:
    from .. import train

    if not cfg.checkpoint:
        return "no --checkpoint was given, so nothing can be resumed"
    latest = train.latest_checkpoint(cfg.checkpoint)
    if latest is None:
        return f"{cfg.checkpoint} holds no intact step yet; start again (with --overwrite)"
    return f"resume from {latest[1]} with the same arguments and --resume"


def run(args) -> int:
    from rich.markup import escape
    from rich.table import Table

    from .. import train
    from ..launcher import LocalWorld, RankError, WorldError

    runs = configs(args)
    err, records, stopped = stderr(), [], False
    cores = os.cpu_count() or 1
    for world_size in dict.fromkeys(cfg.world for cfg in runs):
        threads = max(1, cores // world_size)
        err.print(f"starting {world_size} local process(es), {threads} thread(s) each")
        with LocalWorld(world_size, threads=threads) as world:
            peak = args.peak_tflops
            if peak is None:  # one measured peak per world, so MFU compares the runs on it
                peak = world.run(train.world_matmul_peak, timeout=120)[0] / 1e12
                err.print(f"measured matmul peak: {peak * 1e3:.1f} GFLOP/s per rank")
            for cfg in (c for c in runs if c.world == world_size):
                one = dataclasses.replace(cfg, progress=True, log=None, plot=None, peak_tflops=peak)
                previous = signal.signal(signal.SIGTERM, lambda signum, frame, w=world: w.signal(signum))
                try:
                    results = world.run(train.run_rank, timeout=args.timeout, name=f"cpattn train {cfg.schedule}",
                                        config=dataclasses.asdict(one))
                except WorldError as exc:
                    err.print(f"[red]training failed:[/red] {escape(str(exc))}; {escape(_resume_hint(cfg))}",
                              soft_wrap=True, highlight=False)
                    return 1
                finally:
                    signal.signal(signal.SIGTERM, previous)
                failed = [r for r in results if isinstance(r, RankError)]
                if failed:
                    first = failed[0]
                    if first.type in _USER_ERRORS:
                        err.print(f"[red]training stopped:[/red] {escape(str(first))}", soft_wrap=True,
                                  highlight=False)
                    else:
                        err.print(f"[red]training failed:[/red] {escape(str(first))}\n{escape(first.traceback)}")
                    return 1
                records.append(results[0])
                if results[0]["stopped"] is not None:
                    err.print(f"stopped by SIGTERM after step {results[0]['stopped']}; "
                              + (f"resume with the same arguments and --resume (checkpoint {cfg.checkpoint})"
                                 if cfg.checkpoint else "nothing saved (no --checkpoint)"),
                              soft_wrap=True, markup=False)
                    stopped = True
                    break
            if stopped:
                break
    stdout().print(_table(Table, records))
    for rec in records:
        for ev in rec["evaluations"]:
            stdout().print(f"{_label(rec)} step {ev['step']}: " + ", ".join(
                f"{k} {v:.4g}" for k, v in ev.items() if k != "step"))
    if args.log:
        Path(args.log).write_text(json.dumps([{k: v for k, v in r.items() if k != "params"} for r in records],
                                             indent=1))
        err.print(f"wrote log {args.log}")
    if args.plot:
        train.plot_losses({_label(r): r for r in records}, args.plot)
        err.print(f"wrote loss curve {args.plot}")
    return 0


def _label(rec: dict) -> str:
    c = rec["config"]
    return f"dp{c['dp']} x cp{c['cp']} {rec['schedule']}"


def _table(table_cls, records: list[dict]):
    """Throughput per run, against ``ring`` on the same mesh and the cp=1 run of the same schedule."""
    first = records[0]["config"]
    table = table_cls(title=f"{first['model']} {first['config']}, {first['task']}, {first['steps']} steps, "
                            f"batch {first['batch']}")
    for col in ("schedule", "dp x cp", "first loss", "last loss", "tokens/s", "MFU", "x ring", "x cp=1"):
        table.add_column(col, justify="right")
    by_key = {(r["config"]["dp"], r["config"]["cp"], r["schedule"]): r for r in records}

    def ratio(rec: dict, other: dict | None) -> str:
        return f"{rec['tokens_per_s'] / other['tokens_per_s']:.2f}" if other and other["tokens_per_s"] else "-"

    for rec in records:
        dp, cp = rec["config"]["dp"], rec["config"]["cp"]
        ring = by_key.get((dp, cp, "ring"))
        single = by_key.get((dp, 1, rec["schedule"])) or next(
            (r for (d, c, _), r in by_key.items() if d == dp and c == 1), None)
        table.add_row(rec["schedule"], f"{dp} x {cp}", f"{rec['losses'][0]:.4f}", f"{rec['losses'][-1]:.4f}",
                      f"{rec['tokens_per_s']:.0f}", f"{100 * rec['mfu']:.1f}%", ratio(rec, ring), ratio(rec, single))
    return table
