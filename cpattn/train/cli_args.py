"""The command line of a training run: the options ``cpattn train`` and ``python -m cpattn.train`` share
(:func:`add_arguments`), the run they ask for (:func:`config_from_args`), and :func:`main`, the torchrun
entry."""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch.distributed as dist

from ..output import show_wide
from .checks import preflight
from .config import DTYPES, MASK_TASKS, MODELS, TrainConfig
from .loop import TrainingStopped, _say, run_rank
from .report import results_table


def build_parser():
    p = argparse.ArgumentParser(prog="python -m cpattn.train",
                                description="Train a reference model with context parallelism (run under torchrun).")
    add_arguments(p)
    return p


def _csv_ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(p, compare: bool = False) -> None:
    """The options ``cpattn train`` and ``python -m cpattn.train`` share. ``compare``: ``--cp`` and
    ``--schedule`` take comma-separated lists (``cpattn train`` runs each combination)."""
    d = TrainConfig()
    p.add_argument("--model", choices=MODELS, default=d.model)
    p.add_argument("--config", default=d.config, help="model config name (tiny, small, ...)")
    p.add_argument("--dp", type=int, default=d.dp, help="data-parallel degree")
    if compare:
        p.add_argument("--cp", type=_csv_ints, default=None,
                       help="context-parallel degree(s), comma-separated (default: --nproc / --dp)")
        p.add_argument("--schedule", default=None, help="context-parallel schedule(s), comma-separated (default: "
                                                        "zigzag_ring for llama, ringx1o for vit)")
    else:
        p.add_argument("--cp", type=int, default=None, help="context-parallel degree (default: world / dp)")
        p.add_argument("--schedule", default=None, help="context-parallel schedule (default: zigzag_ring for "
                                                        "llama, ringx1o for vit)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--seq", type=int, default=d.seq, help="tokens per sequence (llama)")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per step over the whole world")
    p.add_argument("--task", default=None, help="recall, documents or text (llama; text: --data), fields (vit)")
    p.add_argument("--mask", choices=sorted(MASK_TASKS), default=None,
                   help="the attention mask, naming the task that trains with it: causal (recall), document "
                        "(packed documents), full (the vit's fields)")
    p.add_argument("--documents", default="", help="comma-separated document lengths (task documents)")
    p.add_argument("--data", default=None, help="train on local text: a directory (one document per file, one per "
                                                "line of *.jsonl), a JSONL file (its 'text' fields) or a text file")
    p.add_argument("--tokenizer", default=None, help="a tokenizers JSON file for --data (default: bytes, vocab 256)")
    p.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=d.fsdp,
                   help="shard parameters, gradients and optimizer state over the dp x cp ranks with FSDP2 "
                        "(--no-fsdp: a full copy on every rank)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype,
                   help="compute dtype (bfloat16: autocast; parameters, gradients, their reduction and the "
                        "optimizer stay float32)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--stop-after", type=int, default=None, help="stop after this step (as if interrupted)")
    p.add_argument("--checkpoint", default=None, help="checkpoint directory")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="save every N steps (0: at the end only; a SIGTERM also saves)")
    p.add_argument("--resume", action="store_true", help="resume from the newest intact step of --checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in a --checkpoint directory that holds another run, deleting its steps")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="per-rank peak for MFU (default: the GPU's data-sheet bf16 peak, else the measured matmul "
                        "rate)")
    p.add_argument("--json", dest="log", default=None, help="JSON log path")
    p.add_argument("--plot", default=None, help="loss-curve PNG path")


def config_from_args(args, world: int, cp: int | None = None, schedule: str | None = None) -> TrainConfig:
    """The run the arguments ask for on ``world`` ranks (``cp``, ``schedule``: one of a comparison's)."""
    if cp is None:
        cp = args.cp if args.cp is not None else world // max(1, args.dp)
    docs = tuple(int(x) for x in args.documents.split(",") if x.strip()) if args.documents else ()
    task = args.task
    if args.mask is not None:
        implied = MASK_TASKS[args.mask]
        if task is not None and task != implied:
            raise ValueError(f"--mask {args.mask} trains task {implied!r}, but --task is {task!r}")
        task = implied
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name)}
    return TrainConfig(**{**given, "cp": cp, "schedule": schedule or args.schedule, "task": task, "documents": docs,
                          "progress": True})


def main(argv: list[str] | None = None) -> int:
    """torchrun entry. Argument and configuration errors are found before the process group starts
    (one line, exit 2, alike on every rank); rank 0 prints each evaluation as it runs and ends with the
    results table (``--json`` for the whole record); a non-finite loss ends with one line (exit 1);
    SIGTERM ends after the step in progress, saved, with exit 0; a worker whose launcher died exits."""
    from .. import distributed
    from ..launcher import watch_parent

    watch_parent(os.getppid(), "torchrun")
    args = build_parser().parse_args(argv)
    rank = 0  # a partial launcher environment is reported by every rank
    try:
        launch = distributed.launch_env(os.environ)  # torchrun, srun or mpirun
        rank, world = (launch.rank, launch.world_size) if launch is not None else (0, 1)
        cfg = config_from_args(args, world)
        if cfg.world != world:
            raise ValueError(f"dp={cfg.dp} x cp={cfg.cp} = {cfg.world} ranks, but the launcher started {world}")
        preflight(cfg)  # rank 0 prints what a resume passes over and changes, checksums verified
    except ValueError as exc:
        if rank == 0:
            _say(f"error: {exc}")
        return 2
    distributed.init()
    try:
        record = run_rank(cfg)
        if dist.get_rank() == 0:
            show_wide(results_table([record]))
    except (TrainingStopped, ValueError) as exc:
        if dist.get_rank() == 0:
            _say(f"error: {exc}")
        return 1
    finally:
        dist.destroy_process_group()
    return 0

