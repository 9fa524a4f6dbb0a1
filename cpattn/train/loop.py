"""One rank's part of the training loop (:func:`run_rank`): the checkpoint set-up and resume, each step
(forward, the global loss, backward, gradient sync, the non-finite guards, the optimizer), evaluations,
saves, SIGTERM (every rank stops after the step in progress, saved) and the run's record.

Throughput. A step's time runs from its prepared local batch (built, sliced, sharded, on the device)
to the end of the optimizer step, so batch preparation is not counted; MFU is the model FLOPs
(:mod:`cpattn.models.flops`) per second and rank over a peak (:func:`cpattn.train.world.world_peak`, else
``peak_tflops``); the record names which."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import checkpoint as ckpt
from ..api import ContextParallel
from .checks import _check_steps_left, check_schedule, text_position
from .config import TrainConfig
from .report import _Progress, _write_outputs, evaluation_line
from .sharding import _full, _ReplicatedGrads, _ShardedGrads, parallelize, state_bytes
from .tasks import _Task
from .world import _device, _sync, mesh, world_peak

#: set by the SIGTERM handler run_rank installs; every rank learns of it at the end of the step
_STOP = {"signal": None}


class TrainingStopped(RuntimeError):
    """The run cannot go on (a non-finite loss or gradient norm); every rank raises it alike."""


def _on_sigterm(signum, frame) -> None:
    if _STOP["signal"] is None:
        _STOP["signal"] = signum
        rank = dist.get_rank() if dist.is_initialized() else 0
        _say(f"rank {rank}: SIGTERM received; finishing this step, then saving")


def _say(line: str) -> None:
    """One line to stderr in one write (ranks share the launcher's stderr)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


def _install_sigterm():
    """SIGTERM sets the stop flag (when this is the main thread); returns what to restore."""
    _STOP["signal"] = None
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _on_sigterm)


#: test hook: each rank writes ``{"pid", "step", "phase"}`` to ``$CPATTN_TRAIN_STATUS.<rank>`` as it goes
STATUS_ENV = "CPATTN_TRAIN_STATUS"


def _status(step: int, phase: str) -> None:
    base = os.environ.get(STATUS_ENV)
    if base:
        path = Path(f"{base}.{dist.get_rank()}")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "step": step, "phase": phase}))
        os.replace(tmp, path)


def _guard(step: int, what: str, value: float, cfg: TrainConfig, saved: int | None) -> None:
    if math.isfinite(value):
        return
    last = f"the last checkpoint is {ckpt.step_dir(cfg.checkpoint, saved)}" if saved else \
        "no checkpoint of this run was saved"
    raise TrainingStopped(f"step {step}: the {what} is {value} (not finite); stopped before the optimizer step, "
                          f"so no non-finite weights were saved ({last}); lower --lr (now {cfg.lr:g})")


def run_rank(config: dict | TrainConfig, return_params: bool = False) -> dict:
    """Train on this rank of an initialised default process group of ``dp * cp`` ranks; returns the
    run's record (losses per step, throughput, evaluations; the final parameters with
    ``return_params``; ``stopped``: the step a SIGTERM stopped it after, else None;
    ``checkpoint_notes``: the steps a resume passed over, and what it changed) on every rank.

    A non-finite loss or gradient norm raises :class:`TrainingStopped` on every rank before the
    optimizer step. SIGTERM (on any rank) ends the run after the step in progress, saved when a
    checkpoint directory is given."""
    cfg = config if isinstance(config, TrainConfig) else TrainConfig(**config)
    previous = _install_sigterm()
    try:
        return _train(cfg, return_params)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _setup_checkpoint(cfg: TrainConfig, model, optim, task: _Task) -> tuple[int, list[float], str | None, list[str]]:
    """Prepare the checkpoint directory (collective): ``(start_step, losses, run_id, notes)``; a resumed
    text run's packer continues at the saved position."""
    if not cfg.checkpoint:
        return 0, [], None, []
    error = None
    if dist.get_rank() == 0:
        try:
            if cfg.resume:
                ckpt.remove_unfinished(cfg.checkpoint)
            else:
                ckpt.prepare_new_run(cfg.checkpoint, cfg.overwrite)
        except (ckpt.CheckpointError, OSError) as exc:
            error = str(exc)
    run_id = ckpt._agree(error, ckpt.new_run_id())[0]  # every rank takes rank 0's new run id
    if not cfg.resume:
        return 0, [], run_id, []
    step, rec, notes = ckpt.load(cfg.checkpoint, model, optim, cfg)
    path = ckpt.step_dir(cfg.checkpoint, step)
    _check_steps_left(cfg, step, path)
    if task.packer is not None:
        task.packer.load_state_dict(text_position(rec, task.corpus, path))
    return step, list(rec["losses"])[:step], rec["run_id"], notes


def _data_state(task: _Task) -> dict | None:
    """What a checkpoint records of the data beyond the step: the text packer's position."""
    if task.packer is None:
        return None
    return {"fingerprint": task.corpus.fingerprint, "position": task.packer.state_dict()}


def _train(cfg: TrainConfig, return_params: bool) -> dict:
    device = _device()
    check_schedule(cfg)
    grid, flat = mesh(cfg.dp, cfg.cp, device.type)
    dp_rank = grid.get_local_rank("dp")
    task = _Task(cfg, device)
    cp = ContextParallel(task.cp_len, task.mask, cfg.schedule, group=grid["cp"])
    model = parallelize(task.model, cfg, flat)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    start_step, losses, run_id, notes = _setup_checkpoint(cfg, model, optim, task)
    grads = _ShardedGrads(params, optim) if cfg.fsdp else _ReplicatedGrads(params)  # after a load: it sets .grad
    if dist.get_rank() == 0:
        for note in notes:
            _say(f"checkpoint: {note}")
        if cfg.resume:
            _say(f"checkpoint: resuming {ckpt.step_dir(cfg.checkpoint, start_step)}")
    saved = start_step or None
    peak, peak_source = (cfg.peak_tflops * 1e12, "--peak-tflops") if cfg.peak_tflops else world_peak(cfg.dtype)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.dtype == "bfloat16"
                else contextlib.nullcontext())
    last = cfg.stop_after or cfg.steps
    times, step_flops, evals, held = [], [], [], None
    documents = []  # the corpus document each step's first row begins with (text)
    stopped = None
    _status(start_step, "train")
    progress = _Progress(cfg, last, start_step) if cfg.progress and dist.get_rank() == 0 else None
    for step in range(start_step + 1, last + 1):
        full = task.batch(step)
        inputs, view = task.local(full, dp_rank, cp)
        _sync(device)
        t0 = time.perf_counter()  # batch preparation (generation, packing, sharding, the copy) is not timed
        with autocast:
            loss_sum, count, _ = task.sums(inputs, view)
        totals = torch.stack([count.detach().to(torch.float64), loss_sum.detach().to(torch.float64),
                              torch.tensor(float(_STOP["signal"] is not None), dtype=torch.float64,
                                           device=count.device)])
        dist.all_reduce(totals)  # the global token count and loss sum, and whether any rank was told to stop
        loss, stop = float(totals[1] / totals[0]), bool(totals[2] > 0)
        _guard(step, "loss", loss, cfg, saved)  # the same value, so the same decision, on every rank
        (loss_sum / totals[0].to(loss_sum.dtype)).backward()
        norm = grads.sync()
        _guard(step, "gradient norm", norm, cfg, saved)
        optim.step()
        if held is None:
            held = state_bytes(model, optim)
        grads.zero()
        _sync(device)
        times.append(time.perf_counter() - t0)
        step_flops.append(task.step_flops(full))
        losses.append(loss)
        if "documents" in full:
            documents.append(full["documents"][0])
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == last):
            evals.append({"step": step, **evaluate(task, cp, dp_rank, autocast)})
            if dist.get_rank() == 0:
                line = evaluation_line(evals[-1], task.chance())
                progress.print(line) if progress is not None else print(line, flush=True)
        if cfg.checkpoint and ((cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == last or stop):
            _status(step, "save")
            ckpt.save(cfg.checkpoint, step, model, optim, cfg, losses, run_id, data=_data_state(task))
            saved = step
        _status(step, "train")
        if progress is not None:
            progress.update(step, losses[-1], _rate(cfg, task, times, step_flops, peak))
        if stop and step < last:
            stopped = step
            break
    if progress is not None:
        progress.close()
    if stopped is not None:
        where = (f"saved {ckpt.step_dir(cfg.checkpoint, stopped)}; resume with --resume --checkpoint "
                 f"{cfg.checkpoint}") if cfg.checkpoint else "no --checkpoint was given, so nothing was saved"
        _say(f"rank {dist.get_rank()}: stopped by SIGTERM after step {stopped}; {where}")
    record = {"config": dataclasses.asdict(cfg), "losses": losses, "first_step": start_step + 1,
              "evaluations": evals, "schedule": cp.schedule_name, "rank": dist.get_rank(), "stopped": stopped,
              "checkpoint_notes": notes, "state_bytes": held, "chance": task.chance(),
              "documents": documents, "data_position": task.packer.state_dict() if task.packer else None,
              "params": [_full(p).detach().cpu().clone() for p in params] if return_params else None,
              **_rate(cfg, task, times, step_flops, peak), "peak_source": peak_source}
    if dist.get_rank() == 0:
        _write_outputs(cfg, record)
    return record


def _rate(cfg: TrainConfig, task: _Task, times: list[float], step_flops: list[float], peak: float) -> dict:
    """Throughput over the steps after the first (warm-up), or the first alone."""
    timed = slice(1, None) if len(times) > 1 else slice(None)
    seconds, flops = sum(times[timed]), sum(step_flops[timed])
    if not seconds:
        return {"tokens_per_s": 0.0, "tflops_per_rank": 0.0, "mfu": 0.0, "step_seconds": 0.0,
                "peak_tflops_per_rank": peak / 1e12}
    steps = len(times[timed])
    per_rank = flops / seconds / cfg.world
    return {"tokens_per_s": cfg.batch * task.seq * steps / seconds, "tflops_per_rank": per_rank / 1e12,
            "mfu": per_rank / peak, "step_seconds": seconds / steps, "peak_tflops_per_rank": peak / 1e12}


@torch.no_grad()
def evaluate(task: _Task, cp: ContextParallel, dp_rank: int, autocast=None) -> dict:
    """Held-out evaluation over the world: the loss and the accuracy of the next-token predictions
    (llama; on recall only the answers count), or the ViT's MSE against persistence (repeating the last
    field)."""
    cfg = task.cfg
    inputs, view = task.local(task.held_out_batch(), dp_rank, cp)
    with autocast or contextlib.nullcontext():
        loss_sum, count, extra = task.sums(inputs, view)
    key = "persistence" if cfg.model == "vit" else "correct"
    sums = torch.stack([loss_sum.to(torch.float64), count.to(torch.float64), extra[key].to(torch.float64)])
    dist.all_reduce(sums)
    if cfg.model == "vit":
        return {"mse": float(sums[0] / sums[1]), "persistence_mse": float(sums[2] / sums[1])}
    return {"loss": float(sums[0] / sums[1]), "accuracy": float(sums[2] / sums[1])}
