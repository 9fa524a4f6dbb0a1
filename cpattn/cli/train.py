"""``cpattn train``: a reference model trained with data x context parallelism on local processes.

``--cp`` and ``--schedule`` take comma-separated lists: every combination trains in turn (one local
world per number of ranks, each rank with ``cores / ranks`` threads) and the table
(:func:`cpattn.train.results_table`) compares their throughput with ``ring`` on the same mesh and with
the one-context-rank run of the same schedule. Evaluations (``--eval-every``) print as they run. The
same loop runs unchanged under torchrun: ``torchrun --nproc-per-node N -m cpattn.train ...``
(:mod:`cpattn.train`), and ends with the same table.

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

from ..output import show_wide, stderr


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

    from .. import train
    from ..launcher import LocalWorld, RankError, WorldError

    runs = configs(args)
    err, records, stopped = stderr(), [], False
    cores = os.cpu_count() or 1
    for world_size in dict.fromkeys(cfg.world for cfg in runs):
        threads = max(1, cores // world_size)
        err.print(f"starting {world_size} local process(es), {threads} thread(s) each")
        with LocalWorld(world_size, threads=threads) as world:
            for cfg in (c for c in runs if c.world == world_size):
                one = dataclasses.replace(cfg, progress=True, log=None, plot=None)
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
                first = next((r for r in results if isinstance(r, RankError)), None)
                if first is not None:
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
    show_wide(train.results_table(records))
    if args.log:
        Path(args.log).write_text(json.dumps([{k: v for k, v in r.items() if k != "params"} for r in records],
                                             indent=1))
        err.print(f"wrote log {args.log}")
    if args.plot:
        train.plot_losses({train.run_label(r): r for r in records}, args.plot)
        err.print(f"wrote loss curve {args.plot}")
    return 0

