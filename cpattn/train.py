"""Training end to end: a reference model on a ("dp", "cp") DeviceMesh, one rank's part of the loop.

``python -m cpattn.train ...`` runs it under torchrun (``torchrun --nproc-per-node N -m cpattn.train``);
``cpattn train --nproc N ...`` runs the same function on N local processes (:mod:`cpattn.launcher`).

The world is a 2-D mesh ``(dp, cp)`` from ``init_device_mesh``: each context-parallel group (a row of
the mesh) holds one replica of the model and splits every sequence of its share of the batch across
its ranks with :class:`cpattn.ContextParallel`; the dp groups split the batch.

Exactness across meshes. Every rank draws the same global batch for step t (a pure function of the
seed and t, which is also why a resumed run sees the same data), keeps its dp rows and its cp tokens,
and computes the *sum* of its tokens' losses and their count. The loss is the mean over every token of
the global batch: each rank divides its sum by the global count (one all-reduce), so that summing
every rank's parameter gradients (one all-reduce over the whole world, dp and cp together: a CP rank's
gradient covers only its own tokens' share) gives exactly the gradient of the global mean. So a run at
any (dp, cp) and with any schedule follows the one-process run up to rounding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from .api import ContextParallel
from .core.masks import document

MODELS = ("llama", "vit")
TASKS = {"llama": ("recall", "documents"), "vit": ("fields",)}
DEFAULT_SCHEDULE = {"llama": "zigzag_ring", "vit": "ringx1o"}
#: ``--mask`` -> the task that trains with that mask
MASK_TASKS = {"causal": "recall", "document": "documents", "full": "fields"}
#: rows of the held-out batch each evaluation uses
EVAL_BATCH = 64
#: trajectories and time steps of the generated fields the ViT trains on
FIELD_SAMPLES, FIELD_STEPS = 16, 12


@dataclass(frozen=True)
class TrainConfig:
    """One training run. ``batch``: sequences (or fields) per step over the whole world, divisible by
    ``dp``. ``seq``: tokens per sequence (llama; the ViT's is its patch count). ``task``: ``recall``
    (associative recall, causal mask) or ``documents`` (packed documents, document mask) for llama;
    ``fields`` for the ViT. ``stop_after``: end after this step, as an interrupted run would.
    ``checkpoint``: a directory holding one run (:mod:`cpattn.checkpoint`); saved every
    ``checkpoint_every`` steps (0: at the end only; always at the end and on SIGTERM), resumed from its
    newest intact step with ``resume``; a new run refuses a directory that holds another run's steps
    unless ``overwrite`` (which deletes them). ``peak_tflops``: per rank, for MFU (None: the matmul rate
    measured on every rank at once, :func:`world_matmul_peak`)."""

    model: str = "llama"
    config: str = "tiny"
    dp: int = 1
    cp: int = 1
    schedule: str | None = None
    steps: int = 10
    seq: int = 128
    batch: int = 4
    task: str | None = None
    lr: float = 3e-3
    seed: int = 0
    stop_after: int | None = None
    checkpoint: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    overwrite: bool = False
    eval_every: int = 0
    peak_tflops: float | None = None
    progress: bool = False
    log: str | None = None
    plot: str | None = None
    documents: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r} is unknown; accepted: {', '.join(MODELS)}")
        task = self.task or TASKS[self.model][0]
        if task not in TASKS[self.model]:
            raise ValueError(f"task={task!r} is not a {self.model} task; accepted: {', '.join(TASKS[self.model])}")
        object.__setattr__(self, "task", task)
        object.__setattr__(self, "schedule", self.schedule or DEFAULT_SCHEDULE[self.model])
        object.__setattr__(self, "documents", tuple(self.documents))
        for name in ("dp", "cp", "steps", "seq", "batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.batch % self.dp:
            raise ValueError(f"batch={self.batch} must be a multiple of dp={self.dp} (each dp rank takes "
                             f"batch / dp sequences)")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"stop_after must be in [1, steps={self.steps}], got {self.stop_after!r}")
        for name in ("checkpoint_every", "eval_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.resume and not self.checkpoint:
            raise ValueError("resume needs a checkpoint directory")
        if self.overwrite and not self.checkpoint:
            raise ValueError("overwrite needs a checkpoint directory")
        if self.overwrite and self.resume:
            raise ValueError("overwrite and resume contradict each other: --overwrite deletes the run --resume "
                             "would continue")
        _model_config(self.model, self.config)  # an unknown config name fails here
        if self.task == "documents" and self.documents and sum(self.documents) != self.seq:
            raise ValueError(f"document lengths {list(self.documents)} sum to {sum(self.documents)}, "
                             f"not seq={self.seq}")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"peak_tflops must be > 0, got {self.peak_tflops!r}")

    @property
    def world(self) -> int:
        return self.dp * self.cp

    def document_lengths(self) -> tuple[int, ...]:
        """The packed documents of every row (the ``documents`` given, else a fixed mixed-length split)."""
        if self.documents:
            return self.documents
        parts, left = [], self.seq
        for share in (0.3, 0.15, 0.35):  # mixed lengths, the rest in a fourth document
            n = max(1, int(self.seq * share))
            if n >= left:
                break
            parts.append(n)
            left -= n
        return (*parts, left)


# ---------------------------------------------------------------------------------- the mesh
_MESHES: dict[tuple[str, int, int], object] = {}


def mesh(dp: int, cp: int, device_type: str = "cpu"):
    """The ("dp", "cp") DeviceMesh of the default world (built once per shape and process: collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if dp * cp != world:
        raise ValueError(f"dp={dp} x cp={cp} = {dp * cp} ranks, but the world has {world}")
    key = (device_type, dp, cp)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))
    return _MESHES[key]


def world_matmul_peak(seconds: float = 0.5) -> float:
    """:func:`matmul_peak` measured on every rank at once (as they compute during training: ranks that
    share cores share them here too), averaged over the world (FLOP/s per rank; collective)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    rate = torch.tensor([matmul_peak(device, seconds)], dtype=torch.float64, device=device)
    dist.all_reduce(rate)
    return float(rate) / dist.get_world_size()


def matmul_peak(device: torch.device, seconds: float = 0.2) -> float:
    """Measured float32 matmul rate of this rank (FLOP/s): the peak MFU is taken against by default."""
    n = 512
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        calls += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n**3 * calls / (time.perf_counter() - start)


# ---------------------------------------------------------------------------------- one task
class _Task:
    """Model, data and loss of one run, on this rank (every method is deterministic in (seed, step))."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        from . import data
        from .models import flops

        self.cfg, self.device, self.data = cfg, device, data
        torch.manual_seed(cfg.seed)  # the same initial parameters on every rank
        if cfg.model == "llama":
            from .models.llama import LLAMA_CONFIGS, Llama

            self.mconf = _pick(LLAMA_CONFIGS, cfg.config, "llama")
            self.model = Llama(self.mconf).to(device)
            self.seq = cfg.seq
            self.mask = document(list(cfg.document_lengths())) if cfg.task == "documents" else "causal"
            pairs = self._allowed_pairs()
            self.flops_per_token = flops.llama_flops_per_token(self.mconf, self.seq, pairs)
        else:
            from .models.vit import VIT_CONFIGS, ViT

            self.mconf = _pick(VIT_CONFIGS, cfg.config, "vit")
            self.model = ViT(self.mconf).to(device)
            self.seq = (self.mconf.height // self.mconf.patch) * (self.mconf.width // self.mconf.patch)
            self.mask = "full"
            self.flops_per_token = flops.vit_flops_per_token(self.mconf, self.seq)
            m = self.mconf  # the training and held-out fields: trajectories from two seeds
            self.fields = [data.advection_diffusion(samples, m.channels, m.height, m.width, FIELD_STEPS,
                                                    generator=self.generator(0, stream=2 + i))
                           for i, samples in enumerate((FIELD_SAMPLES, EVAL_BATCH))]

    def _allowed_pairs(self) -> int:
        if self.cfg.task == "documents":
            return sum(n * (n + 1) // 2 for n in self.cfg.document_lengths())
        return self.seq * (self.seq + 1) // 2

    def generator(self, step: int, stream: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + 7919 * stream + step)

    def batch(self, rows: int, gen: torch.Generator, held_out: bool = False) -> dict[str, torch.Tensor]:
        """A global batch of ``rows`` (identical on every rank); ``held_out``: from the evaluation fields."""
        cfg, m = self.cfg, self.mconf
        if cfg.model == "vit":
            x, y = self.data.field_pairs(self.fields[held_out], rows, gen)
            return {"x": x, "y": y}
        if cfg.task == "recall":
            tokens, labels = self.data.recall_batch(rows, self.seq, m.vocab, pairs=_recall_pairs(self.seq),
                                                    generator=gen)
            return {"tokens": tokens, "labels": labels}
        tokens, labels, position_ids = self.data.packed_documents(rows, self.seq, m.vocab,
                                                                  list(cfg.document_lengths()), gen)
        return {"tokens": tokens, "labels": labels, "position_ids": position_ids}

    def local_sums(self, b: dict[str, torch.Tensor], cp: ContextParallel) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   dict[str, torch.Tensor]]:
        """This rank's loss sum and count for its rows of ``b``, plus evaluation sums."""
        pad = cp.positions() < 0
        dev = self.device
        if self.cfg.model == "vit":
            from .models.vit import patchify

            p = self.mconf.patch
            x = cp.shard(patchify(b["x"], p), dim=1).to(dev)
            y = cp.shard(patchify(b["y"], p), dim=1).to(dev)
            pred = self.model(x, cp.positions().to(dev), cp)
            err, count = self.data.mse_sums(pred, y, valid=~pad)
            persistence, _ = self.data.mse_sums(x, y, valid=~pad)
            return err, count, {"persistence": persistence.detach()}
        tokens = cp.shard(b["tokens"], dim=1).to(dev)
        labels = self.data.shard_labels(cp, b["labels"]).to(dev)
        positions = cp.shard(b["position_ids"], dim=1).to(dev) if "position_ids" in b else cp.positions().to(dev)
        logits = self.model(tokens, positions, cp)
        loss_sum, count = self.data.lm_loss_sums(logits, labels)
        correct, _ = self.data.accuracy_sums(logits.detach(), labels)
        return loss_sum, count, {"correct": correct}


def _pick(configs: dict, name: str, model: str):
    if name not in configs:
        raise ValueError(f"config={name!r} is not a {model} config; accepted: {', '.join(configs)}")
    return configs[name]


def _model_config(model: str, name: str):
    if model == "llama":
        from .models.llama import LLAMA_CONFIGS

        return _pick(LLAMA_CONFIGS, name, "llama")
    from .models.vit import VIT_CONFIGS

    return _pick(VIT_CONFIGS, name, "vit")


def _recall_pairs(seq: int) -> int:
    return max(2, min(8, seq // 16))


# ---------------------------------------------------------------------------------- checks before start-up
def _mask_of(cfg: TrainConfig):
    from .core import masks

    if cfg.model == "vit":
        return masks.resolve("full")
    if cfg.task == "documents":
        return document(list(cfg.document_lengths()))
    return masks.resolve("causal")


def check_schedule(cfg: TrainConfig) -> None:
    """Raise ValueError (one line) unless ``cfg.schedule`` can run the run's mask and head shapes on
    ``cfg.cp`` ranks; nothing communicates."""
    from . import schedules

    if cfg.schedule == "auto":
        return
    sched = schedules.get(cfg.schedule)  # an unknown name fails here
    mask = _mask_of(cfg)
    m = _model_config(cfg.model, cfg.config)
    seq = cfg.seq if cfg.model == "llama" else m.n_patches
    local = -(-seq // cfg.cp)
    q = torch.empty((cfg.batch // cfg.dp, local, m.heads, m.dim // m.heads), device="meta")
    k = torch.empty((cfg.batch // cfg.dp, local, m.kv_heads, m.dim // m.heads), device="meta")
    try:
        sched.check_mask(mask)
        sched.check_shape(q, k, cfg.cp)
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise ValueError(f"schedule {cfg.schedule!r} cannot train this run ({cfg.model} {cfg.config}, task "
                         f"{cfg.task}, mask {mask.name!r}, cp {cfg.cp}): {exc}") from None


def preflight(cfg: TrainConfig, checksums: bool = False) -> list[str]:
    """Every check a run can make before any worker starts (ValueError, one line, when one fails): the
    schedule against the mask, and the checkpoint directory: a new run refuses one that holds another
    run (unless ``overwrite``); a resume needs an intact step whose configuration may be continued and
    that leaves steps to train. Returns notes to show (steps passed over, fields a resume changes)."""
    check_schedule(cfg)
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
    return notes


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


# ---------------------------------------------------------------------------------- stopping
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


# ---------------------------------------------------------------------------------- the loop
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


def _setup_checkpoint(cfg: TrainConfig, model, optim) -> tuple[int, list[float], str | None, list[str]]:
    """Prepare the checkpoint directory (collective): ``(start_step, losses, run_id, notes)``."""
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
    ckpt._agree(error)
    if not cfg.resume:
        ids = [ckpt.new_run_id()]
        dist.broadcast_object_list(ids, src=0)
        return 0, [], ids[0], []
    step, rec, notes = ckpt.load(cfg.checkpoint, model, optim, cfg)
    _check_steps_left(cfg, step, ckpt.step_dir(cfg.checkpoint, step))
    return step, list(rec["losses"])[:step], rec["run_id"], notes


def _train(cfg: TrainConfig, return_params: bool) -> dict:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    check_schedule(cfg)
    grid = mesh(cfg.dp, cfg.cp, device.type)
    dp_rank = grid.get_local_rank("dp")
    task = _Task(cfg, device)
    cp = ContextParallel(task.seq, task.mask, cfg.schedule, group=grid["cp"])
    model = task.model
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    rows = cfg.batch // cfg.dp
    start_step, losses, run_id, notes = _setup_checkpoint(cfg, model, optim)
    if dist.get_rank() == 0:
        for note in notes:
            _say(f"checkpoint: {note}")
        if cfg.resume:
            _say(f"checkpoint: resuming {ckpt.step_dir(cfg.checkpoint, start_step)}")
    saved = start_step or None
    peak = cfg.peak_tflops * 1e12 if cfg.peak_tflops else world_matmul_peak()
    last = cfg.stop_after or cfg.steps
    times, evals = [], []
    stopped = None
    _status(start_step, "train")
    progress = _Progress(cfg, last, start_step) if cfg.progress and dist.get_rank() == 0 else None
    for step in range(start_step + 1, last + 1):
        t0 = time.perf_counter()
        full = task.batch(cfg.batch, task.generator(step))
        mine = {k: v[dp_rank * rows:(dp_rank + 1) * rows] for k, v in full.items()}
        loss_sum, count, _ = task.local_sums(mine, cp)
        totals = torch.stack([count.detach().to(torch.float64), loss_sum.detach().to(torch.float64)])
        dist.all_reduce(totals)  # the global token count, and the global loss sum for the log
        loss = float(totals[1] / totals[0])
        _guard(step, "loss", loss, cfg, saved)  # the same value, so the same decision, on every rank
        (loss_sum / totals[0].to(loss_sum.dtype)).backward()
        stop, norm = _all_reduce_grads(params, _STOP["signal"] is not None)
        _guard(step, "gradient norm", norm, cfg, saved)
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss)
        times.append(time.perf_counter() - t0)
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == last):
            evals.append({"step": step, **evaluate(task, cp, dp_rank)})
        if cfg.checkpoint and ((cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == last or stop):
            _status(step, "save")
            ckpt.save(cfg.checkpoint, step, model, optim, cfg, losses, run_id)
            saved = step
        _status(step, "train")
        if progress is not None:
            progress.update(step, losses[-1], _rate(cfg, task, times, peak))
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
              "checkpoint_notes": notes,
              "params": [p.detach().cpu().clone() for p in params] if return_params else None,
              **_rate(cfg, task, times, peak)}
    if dist.get_rank() == 0:
        _write_outputs(cfg, record)
    return record


def _all_reduce_grads(params: list[torch.nn.Parameter], stop: bool = False) -> tuple[bool, float]:
    """Sum every parameter's gradient over the whole world (dp and cp) in one flat all-reduce, which
    also carries each rank's ``stop`` flag; returns whether any rank asked to stop, and the norm of
    the summed gradient (the same on every rank)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flag = torch.tensor([1.0 if stop else 0.0], dtype=grads[0].dtype, device=grads[0].device)
    flat = torch.cat([g.reshape(-1) for g in grads] + [flag])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n
    return bool(flat[-1] > 0), float(flat[:-1].norm())


def _rate(cfg: TrainConfig, task: _Task, times: list[float], peak: float) -> dict:
    """Throughput over the steps after the first (warm-up), or the first alone."""
    timed = times[1:] or times
    if not timed:
        return {"tokens_per_s": 0.0, "tflops_per_rank": 0.0, "mfu": 0.0, "step_seconds": 0.0}
    step_s = sum(timed) / len(timed)
    tokens = cfg.batch * task.seq / step_s
    per_rank = task.flops_per_token * tokens / cfg.world
    return {"tokens_per_s": tokens, "tflops_per_rank": per_rank / 1e12, "mfu": per_rank / peak,
            "step_seconds": step_s, "peak_tflops_per_rank": peak / 1e12}


@torch.no_grad()
def evaluate(task: _Task, cp: ContextParallel, dp_rank: int) -> dict:
    """Held-out evaluation over the world: recall accuracy on the answers (llama), or the ViT's MSE
    against persistence (repeating the last field)."""
    cfg = task.cfg
    rows = max(cfg.dp, EVAL_BATCH // cfg.dp * cfg.dp)
    full = task.batch(rows, task.generator(0, stream=1), held_out=True)
    per = rows // cfg.dp
    mine = {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in full.items()}
    loss_sum, count, extra = task.local_sums(mine, cp)
    key = "persistence" if cfg.model == "vit" else "correct"
    sums = torch.stack([loss_sum.to(torch.float64), count.to(torch.float64), extra[key].to(torch.float64)])
    dist.all_reduce(sums)
    if cfg.model == "vit":
        return {"mse": float(sums[0] / sums[1]), "persistence_mse": float(sums[2] / sums[1])}
    return {"loss": float(sums[0] / sums[1]), "accuracy": float(sums[2] / sums[1])}


class _Progress:
    """Rich progress on rank 0: step, loss, tokens/s, MFU."""

    def __init__(self, cfg: TrainConfig, last: int, first: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn(f"[bold]{cfg.model} dp{cfg.dp} x cp{cfg.cp} {cfg.schedule}"), BarColumn(),
                            MofNCompleteColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn())
        self.bar.start()
        self.task = self.bar.add_task("train", total=last, completed=first, info="")

    def update(self, step: int, loss: float, rate: dict) -> None:
        info = f"loss {loss:.4f}  {rate['tokens_per_s']:.0f} tok/s  MFU {100 * rate['mfu']:.1f}%"
        self.bar.update(self.task, completed=step, info=info)

    def close(self) -> None:
        self.bar.stop()


def _write_outputs(cfg: TrainConfig, record: dict) -> None:
    if cfg.log:
        saved = {k: v for k, v in record.items() if k != "params"}
        Path(cfg.log).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.log).write_text(json.dumps(saved, indent=1))
    if cfg.plot:
        plot_losses({f"dp{cfg.dp} x cp{cfg.cp} {cfg.schedule}": record}, cfg.plot)


def plot_losses(runs: dict[str, dict], path: str) -> None:
    """A PNG of the loss curves of ``runs`` (label -> record)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, rec in runs.items():
        steps = list(range(1, len(rec["losses"]) + 1))
        ax.plot(steps, rec["losses"], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over the global batch)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------- torchrun entry
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
    p.add_argument("--task", default=None, help="recall or documents (llama), fields (vit)")
    p.add_argument("--mask", choices=sorted(MASK_TASKS), default=None,
                   help="the attention mask, naming the task that trains with it: causal (recall), document "
                        "(packed documents), full (the vit's fields)")
    p.add_argument("--documents", default="", help="comma-separated document lengths (task documents)")
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
    p.add_argument("--peak-tflops", type=float, default=None, help="per-rank peak for MFU (default: measured "
                                                                   "matmul rate)")
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
    return TrainConfig(model=args.model, config=args.config, dp=args.dp, cp=cp, schedule=schedule or args.schedule,
                       steps=args.steps, seq=args.seq, batch=args.batch, task=task, lr=args.lr, seed=args.seed,
                       stop_after=args.stop_after, checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every,
                       resume=args.resume, overwrite=args.overwrite, eval_every=args.eval_every,
                       peak_tflops=args.peak_tflops, progress=True, log=args.log, plot=args.plot, documents=docs)


def main(argv: list[str] | None = None) -> int:
    """torchrun entry. Argument and configuration errors are found before the process group starts
    (one line, exit 2, alike on every rank); a non-finite loss ends with one line (exit 1); SIGTERM
    ends after the step in progress, saved, with exit 0; a worker whose launcher died exits."""
    from . import distributed
    from .launcher import watch_parent

    watch_parent(os.getppid(), "torchrun")
    args = build_parser().parse_args(argv)
    rank = os.environ.get("RANK", "0")
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        cfg = config_from_args(args, world)
        if cfg.world != world:
            raise ValueError(f"dp={cfg.dp} x cp={cfg.cp} = {cfg.world} ranks, but torchrun started {world}")
        preflight(cfg)  # rank 0 prints what a resume passes over and changes, checksums verified
    except ValueError as exc:
        if rank == "0":
            _say(f"error: {exc}")
        return 2
    distributed.init()
    try:
        record = run_rank(cfg)
        if dist.get_rank() == 0:
            print(json.dumps({k: record[k] for k in ("losses", "tokens_per_s", "mfu", "schedule", "stopped")}),
                  flush=True)
    except (TrainingStopped, ValueError) as exc:
        if dist.get_rank() == 0:
            _say(f"error: {exc}")
        return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
