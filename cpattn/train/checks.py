"""Checks a run makes before any worker starts, each failure one ValueError line: the schedule against
the run's mask and head shapes (:func:`check_schedule`), the checkpoint directory and the text data
(:func:`preflight`); and the checkpoint look-ups the loop and the launchers share (the saved text
position, the steps a resume leaves, the newest intact step)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .. import checkpoint as ckpt
from .. import schedules
from ..core import masks
from .config import TrainConfig, _model_config


def _mask_of(cfg: TrainConfig):
    if cfg.model == "vit":
        return masks.resolve("full")
    if cfg.task == "documents":
        return masks.document(list(cfg.document_lengths()))
    if cfg.task == "text":  # a typical step's mask: rows of documents
        half = cfg.seq // 2
        return masks.document([n for _ in range(cfg.batch // cfg.dp) for n in (half, cfg.seq - half) if n])
    return masks.resolve("causal")


def check_schedule(cfg: TrainConfig) -> None:
    """Raise ValueError (one line) unless ``cfg.schedule`` can run the run's mask and head shapes on
    ``cfg.cp`` ranks; nothing communicates."""
    if cfg.schedule == "auto":
        return
    sched = schedules.get(cfg.schedule)  # an unknown name fails here
    mask = _mask_of(cfg)
    m = _model_config(cfg.model, cfg.config)
    seq = cfg.seq if cfg.model == "llama" else m.n_patches
    rows = cfg.batch // cfg.dp
    if cfg.task == "text":  # a dp rank's rows are one packed sequence
        seq, rows = seq * rows, 1
    local = -(-seq // cfg.cp)
    q = torch.empty((rows, local, m.heads, m.dim // m.heads), device="meta")
    k = torch.empty((rows, local, m.kv_heads, m.dim // m.heads), device="meta")
    try:
        if cfg.task == "text":
            sched.check_mask(masks.resolve("causal"))
        sched.check_mask(mask)
        sched.check_shape(q, k, cfg.cp)
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise ValueError(f"schedule {cfg.schedule!r} cannot train this run ({cfg.model} {cfg.config}, task "
                         f"{cfg.task}, mask {mask.name!r}, cp {cfg.cp}): {exc}") from None


def preflight(cfg: TrainConfig, checksums: bool = False) -> list[str]:
    """Every check a run can make before any worker starts (ValueError, one line, when one fails): the
    schedule against the mask, and the checkpoint directory: a new run refuses one that holds another
    run (unless ``overwrite``); a resume needs an intact step whose configuration may be continued and
    that leaves steps to train, and (text) a data position in the same corpus; the text data: files
    that read as documents, the tokenizer, held-out documents when evaluating. Returns notes to show
    (steps passed over, fields a resume changes)."""
    check_schedule(cfg)
    corpus = None
    if cfg.task == "text":
        from ..data import HOLD_OUT_EVERY, TextCorpus

        corpus = TextCorpus(cfg.data, cfg.tokenizer)
        if cfg.eval_every and not corpus.split()[1]:
            raise ValueError(f"--eval-every needs held-out documents: {cfg.data} holds {len(corpus)}, fewer than "
                             f"{HOLD_OUT_EVERY} (one in {HOLD_OUT_EVERY} is held out); drop --eval-every")
    if not cfg.checkpoint:
        return []
    if not cfg.resume:
        if not cfg.overwrite:
            ckpt.check_new_run(cfg.checkpoint)
        return []
    step, path, rec, passed = ckpt.find_latest(cfg.checkpoint, checksums=checksums)
    notes = [f"passed over {p}" for p in passed]
    notes += [f"resume changes {n}" for n in ckpt.check_resume(rec["config"], dataclasses.asdict(cfg))]
    _check_steps_left(cfg, step, path)
    if corpus is not None:
        text_position(rec, corpus, path)
    return notes


def text_position(rec: dict, corpus, path) -> dict:
    """The text data position saved in the checkpoint record ``rec`` (of step ``path``), after checking
    that it belongs to ``corpus`` (CheckpointError otherwise)."""
    saved = rec.get("data")
    if not isinstance(saved, dict) or not isinstance(saved.get("position"), dict):
        raise ckpt.CheckpointError(f"resume: {path} holds no text data position (saved by a run without --data)")
    if saved.get("fingerprint") != corpus.fingerprint:
        raise ckpt.CheckpointError(f"resume: the text under {corpus.path} (or the tokenizer) is not what {path} was "
                                   f"trained on (their SHA-256 differ); resume with the same files")
    return saved["position"]


def _check_steps_left(cfg: TrainConfig, step: int, path) -> None:
    last = cfg.stop_after or cfg.steps
    if step >= last:
        what = f"--stop-after {cfg.stop_after}" if cfg.stop_after else f"--steps {cfg.steps}"
        raise ckpt.CheckpointError(f"resume: {path} is at step {step}, so {what} leaves nothing to train; "
                                   f"give --steps beyond {step}")


def latest_checkpoint(root: str) -> tuple[int, Path] | None:
    """The newest intact step saved under ``root`` (checksums verified), or None."""
    try:
        step, path, _, _ = ckpt.find_latest(root)
    except ckpt.CheckpointError:
        return None
    return step, path
