"""Training end to end: a reference model on a ("dp", "cp") DeviceMesh, one rank's part of the loop.

``python -m cpattn.train ...`` runs it under torchrun (``torchrun --nproc-per-node N -m cpattn.train``);
``cpattn train --nproc N ...`` runs the same function on N local processes (:mod:`cpattn.launcher`).

The world is a 2-D mesh ``(dp, cp)`` from ``init_device_mesh``: each context-parallel group (a row of
the mesh) splits every sequence of its share of the batch across its ranks with
:class:`cpattn.ContextParallel`; the dp groups split the batch.

State. By default the parameters, gradients and AdamW state are sharded with FSDP2
(``torch.distributed.fsdp.fully_shard``, each block and then the root) over the *flattened* dp x cp
mesh, as torchtitan's ``dp_shard_cp``: context-parallel ranks hold different tokens of the same
sequences, so for the weights they are data-parallel ranks like any other, and each rank keeps
1 / (dp x cp) of the state. ``fsdp=False`` keeps a full copy on every rank (replicated), its gradients in
one flat buffer summed in place by one all-reduce: the reference the sharded run is tested against.
``dtype="bfloat16"`` runs the forward under bf16 autocast; parameters, gradients, their reduction and
the optimizer stay float32.

Exactness across meshes. Every rank builds the same global batch for step t (a pure function of the
seed and t for the synthetic tasks; the text packer's position, saved with each checkpoint, for
``data``), keeps its dp rows and its cp tokens, and computes the *sum* of its tokens' losses and their
count. The loss is the mean over every token of the global batch: each rank divides its sum by the
global count (one all-reduce), so that summing every rank's parameter gradients over the whole world
(dp and cp together: a CP rank's gradient covers only its own tokens' share; FSDP2 is told to sum, not
average) gives exactly the gradient of the global mean. So a run at any (dp, cp), sharded or not and
with any schedule, follows the one-process run up to rounding.

Throughput. A step's time runs from its prepared local batch (built, sliced, sharded, on the device)
to the end of the optimizer step, so batch preparation is not counted; MFU is the model FLOPs
(:mod:`cpattn.models.flops`) per second and rank over a peak: the device's data-sheet dense bf16 peak
on a GPU the table knows (:data:`cpattn.models.flops.BF16_PEAK_TFLOPS`), else the matmul rate measured
on every rank at once in the run's dtype (the CPU), else ``peak_tflops``; the record names which.
"""

from __future__ import annotations

import argparse
import contextlib
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
TASKS = {"llama": ("recall", "documents", "text"), "vit": ("fields",)}
DEFAULT_SCHEDULE = {"llama": "zigzag_ring", "vit": "ringx1o"}
#: ``--mask`` -> the task that trains with that mask
MASK_TASKS = {"causal": "recall", "document": "documents", "full": "fields"}
#: compute dtypes: float32, or bfloat16 autocast (parameters, gradients and optimizer state float32)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: rows of the held-out batch each evaluation uses (synthetic tasks; text: one global batch)
EVAL_BATCH = 64
#: trajectories and time steps of the generated fields the ViT trains on
FIELD_SAMPLES, FIELD_STEPS = 16, 12
#: side of the square matmul whose measured rate is the peak where the device has no data-sheet entry
PEAK_MATMUL_N = 1024


@dataclass(frozen=True)
class TrainConfig:
    """One training run. ``batch``: sequences (or fields) per step over the whole world, divisible by
    ``dp``. ``seq``: tokens per sequence (llama; the ViT's is its patch count). ``task``: ``recall``
    (associative recall, causal mask), ``documents`` (packed synthetic documents, document mask) or
    ``text`` (``data``: local text packed into rows of documents, the document mask of each step) for
    llama; ``fields`` for the ViT. ``data``: a directory, a JSONL file (its ``text`` fields) or a text
    file (:class:`cpattn.data.TextCorpus`), ``tokenizer``: a ``tokenizers`` JSON file (else bytes); the
    model's vocabulary becomes the tokenizer's. ``fsdp``: shard parameters, gradients and optimizer
    state over the dp x cp ranks (FSDP2), else replicate them. ``dtype``: ``float32`` or ``bfloat16``
    (autocast). ``stop_after``: end after this step, as an interrupted run would. ``checkpoint``: a
    directory holding one run (:mod:`cpattn.checkpoint`); saved every ``checkpoint_every`` steps (0: at
    the end only; always at the end and on SIGTERM), resumed from its newest intact step with
    ``resume``; a new run refuses a directory that holds another run's steps unless ``overwrite``
    (which deletes them). ``peak_tflops``: per rank, for MFU (None: see the module docstring)."""

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
    fsdp: bool = True
    dtype: str = "float32"
    data: str | None = None
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r} is unknown; accepted: {', '.join(MODELS)}")
        task = self.task or ("text" if self.data else TASKS[self.model][0])
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
        if self.documents and self.task != "documents":
            raise ValueError(f"document lengths are for task 'documents', not {self.task!r}")
        if (self.task == "text") != bool(self.data):
            raise ValueError("task 'text' trains on --data PATH" if self.task == "text" else
                             f"--data trains task 'text' (llama), not {self.task!r}")
        if self.tokenizer and not self.data:
            raise ValueError("a tokenizer needs --data")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is unknown; accepted: {', '.join(DTYPES)}")
        if not isinstance(self.fsdp, bool):
            raise ValueError(f"fsdp must be a bool, got {self.fsdp!r}")
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
_MESHES: dict[tuple[str, int, int], tuple] = {}


def mesh(dp: int, cp: int, device_type: str = "cpu"):
    """``(grid, flat)``: the ("dp", "cp") DeviceMesh of the default world and its flattened 1-D
    ``"dp_cp"`` mesh, the one FSDP2 shards over (torchtitan's ``dp_shard_cp``); built once per shape
    and process (collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if dp * cp != world:
        raise ValueError(f"dp={dp} x cp={cp} = {dp * cp} ranks, but the world has {world}")
    key = (device_type, dp, cp)
    if key not in _MESHES:
        grid = init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))
        _MESHES[key] = grid, grid["dp", "cp"]._flatten("dp_cp")
    return _MESHES[key]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def world_peak(dtype: str = "float32", seconds: float = 0.5) -> tuple[float, str]:
    """``(FLOP/s per rank, what it is)``: the peak MFU is taken against (collective). On a GPU the
    :data:`cpattn.models.flops.BF16_PEAK_TFLOPS` table knows, its data-sheet dense bf16 peak; otherwise
    the ``dtype`` matmul rate measured on every rank at once (as they compute during training: ranks
    that share cores share them here too), averaged over the world."""
    from .models.flops import datasheet_peak

    device = _device()
    if device.type == "cuda":
        found = datasheet_peak(torch.cuda.get_device_name(device))
        if found is not None:
            return found[1], f"{found[0]} data-sheet dense bf16 peak"
    rate = torch.tensor([matmul_peak(device, DTYPES[dtype], seconds)], dtype=torch.float64, device=device)
    dist.all_reduce(rate)
    return float(rate) / dist.get_world_size(), (f"measured {dtype} matmul peak ({PEAK_MATMUL_N}^2, every rank "
                                                 f"at once)")


def matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32, seconds: float = 0.2) -> float:
    """Measured rate of a :data:`PEAK_MATMUL_N`-square matmul in ``dtype`` on this rank (FLOP/s)."""
    n = PEAK_MATMUL_N
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
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
    """Model, data and loss of one run, on this rank. The synthetic tasks' batches are pure functions
    of (seed, step); the text task's come from a packer whose position is saved with each checkpoint."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        from . import data
        from .models import flops

        self.cfg, self.device, self.data, self.flops = cfg, device, data, flops
        self.corpus = self.packer = None
        if cfg.model == "llama":
            from .models.llama import LLAMA_CONFIGS, Llama

            self.mconf = _pick(LLAMA_CONFIGS, cfg.config, "llama")
            self.seq = cfg.seq
            if cfg.task == "text":
                self.corpus = data.TextCorpus(cfg.data, cfg.tokenizer)
                self.mconf = dataclasses.replace(self.mconf, vocab=self.corpus.vocab)
                train_docs, self.held_out = self.corpus.split()
                self.packer = data.TextPacker(self.corpus, train_docs, self.seq)
            torch.manual_seed(cfg.seed)  # the same initial parameters on every rank
            self.model = Llama(self.mconf).to(device)
            self.mask = document(list(cfg.document_lengths())) if cfg.task == "documents" else "causal"
        else:
            from .models.vit import VIT_CONFIGS, ViT

            self.mconf = _pick(VIT_CONFIGS, cfg.config, "vit")
            torch.manual_seed(cfg.seed)
            self.model = ViT(self.mconf).to(device)
            self.seq = (self.mconf.height // self.mconf.patch) * (self.mconf.width // self.mconf.patch)
            self.mask = "full"
            m = self.mconf  # the training and held-out fields: trajectories from two seeds
            self.fields = [data.advection_diffusion(samples, m.channels, m.height, m.width, FIELD_STEPS,
                                                    generator=self.generator(0, stream=2 + i))
                           for i, samples in enumerate((FIELD_SAMPLES, EVAL_BATCH))]

    @property
    def cp_len(self) -> int:
        """The sequence one ContextParallel spans: a row, or (text) a dp rank's rows flattened."""
        return self.seq * (self.cfg.batch // self.cfg.dp) if self.cfg.task == "text" else self.seq

    def generator(self, step: int, stream: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + 7919 * stream + step)

    def batch(self, step: int) -> dict:
        """Step ``step``'s global batch (identical on every rank; text: the packer moves on)."""
        if self.packer is not None:
            return self.packer.next_batch(self.cfg.batch)
        return self._synthetic(self.cfg.batch, self.generator(step))

    def held_out_batch(self) -> dict:
        """The fixed held-out batch of every evaluation."""
        cfg = self.cfg
        if self.packer is not None:
            if not self.held_out:
                raise ValueError(f"evaluation needs held-out documents: --data holds {len(self.corpus)}, fewer "
                                 f"than {self.data.HOLD_OUT_EVERY} (one in {self.data.HOLD_OUT_EVERY} is held out)")
            return self.data.TextPacker(self.corpus, self.held_out, self.seq).next_batch(cfg.batch)
        rows = max(cfg.dp, EVAL_BATCH // cfg.dp * cfg.dp)
        return self._synthetic(rows, self.generator(0, stream=1), held_out=True)

    def _synthetic(self, rows: int, gen: torch.Generator, held_out: bool = False) -> dict:
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

    def local(self, full: dict, dp_rank: int, cp: ContextParallel) -> tuple[dict, ContextParallel]:
        """This rank's inputs for its dp rows of ``full``, sharded by ``cp`` (text: by the view of the
        rows' document mask) and on the device; and the ContextParallel (or view) they run on."""
        rows = len(full["labels" if "labels" in full else "y"]) // self.cfg.dp
        mine = {k: v[dp_rank * rows:(dp_rank + 1) * rows] for k, v in full.items()}
        dev = self.device
        if self.cfg.model == "vit":
            from .models.vit import patchify

            p = self.mconf.patch
            return {"x": cp.shard(patchify(mine["x"], p), dim=1).to(dev),
                    "y": cp.shard(patchify(mine["y"], p), dim=1).to(dev)}, cp
        if self.cfg.task == "text":  # the rows flattened into one packed sequence
            cp = cp.with_mask(document([n for row in mine["lengths"] for n in row]))
            mine = {k: mine[k].reshape(1, -1) for k in ("tokens", "labels", "position_ids")}
        out = {"tokens": cp.shard(mine["tokens"], dim=1).to(dev),
               "labels": self.data.shard_labels(cp, mine["labels"]).to(dev)}
        out["positions"] = cp.shard(mine["position_ids"], dim=1).to(dev) if "position_ids" in mine \
            else cp.positions().to(dev)
        return out, cp

    def sums(self, inputs: dict, cp: ContextParallel) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's loss sum and count for ``inputs`` (from :meth:`local`), plus evaluation sums."""
        if self.cfg.model == "vit":
            valid = cp.positions() >= 0
            pred = self.model(inputs["x"], cp.positions().to(self.device), cp)
            err, count = self.data.mse_sums(pred, inputs["y"], valid=valid)
            persistence, _ = self.data.mse_sums(inputs["x"], inputs["y"], valid=valid)
            return err, count, {"persistence": persistence.detach()}
        logits = self.model(inputs["tokens"], inputs["positions"], cp)
        loss_sum, count = self.data.lm_loss_sums(logits, inputs["labels"])
        correct, _ = self.data.accuracy_sums(logits.detach(), inputs["labels"])
        return loss_sum, count, {"correct": correct}

    def step_flops(self, full: dict) -> float:
        """Model FLOPs of one training step on the global batch ``full`` (forward and backward)."""
        f, cfg = self.flops, self.cfg
        if cfg.model == "vit":
            return f.vit_flops_per_token(self.mconf, self.seq) * self.seq * cfg.batch
        if cfg.task == "text":
            return sum(f.llama_flops_per_token(self.mconf, self.seq, sum(n * (n + 1) // 2 for n in row)) * self.seq
                       for row in full["lengths"])
        pairs = sum(n * (n + 1) // 2 for n in cfg.document_lengths()) if cfg.task == "documents" else None
        return f.llama_flops_per_token(self.mconf, self.seq, pairs) * self.seq * cfg.batch

    def chance(self) -> float | None:
        """Chance accuracy of the recall answers (None for other tasks)."""
        if self.cfg.task != "recall":
            return None
        return 1 / len(self.data.recall_ranges(self.mconf.vocab)[2])


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


# ---------------------------------------------------------------------------------- sharded or replicated state
def parallelize(model: torch.nn.Module, cfg: TrainConfig, flat) -> torch.nn.Module:
    """Shard ``model`` with FSDP2 over the flattened dp x cp mesh (``cfg.fsdp``): each block, then the
    root (embedding, final norm, head); every FSDP module sums its gradients over the ranks instead of
    averaging them (the loss is already each rank's share of the global mean) with plain SUM
    collectives (gloo has no pre-multiplied sum). Returns the model (unchanged when not ``cfg.fsdp``)."""
    if not cfg.fsdp:
        return model
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for block in model.layers:
        fully_shard(block, mesh=flat)
    fully_shard(model, mesh=flat)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local shard), or ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


class _ShardedGrads:
    """FSDP2 gradients: already summed and sharded by the backward's reduce-scatters."""

    def __init__(self, params: list[torch.nn.Parameter], optim: torch.optim.Optimizer) -> None:
        self.params, self.optim = params, optim

    def sync(self) -> float:
        """The norm of the summed gradient (the same on every rank): one all-reduce of the shards'
        squared norms."""
        sq = sum((_local(p.grad).double().pow(2).sum() for p in self.params if p.grad is not None),
                 torch.zeros((), dtype=torch.float64, device=self.params[0].device))
        dist.all_reduce(sq)
        return float(sq.sqrt())

    def zero(self) -> None:
        self.optim.zero_grad(set_to_none=True)


class _ReplicatedGrads:
    """Replicated gradients: each ``p.grad`` is a view into one flat float32 buffer that the backward
    accumulates into in place, summed over the whole world by one all-reduce (no copies)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            p.grad = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def sync(self) -> float:
        dist.all_reduce(self.flat)
        return float(self.flat.norm())

    def zero(self) -> None:
        self.flat.zero_()


def state_bytes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for the parameters, their gradients and the optimizer state (each storage
    counted once: FSDP2's padded shards, the replicated gradient buffer)."""
    def held(tensors) -> int:
        storages = {}
        for t in tensors:
            if isinstance(t, torch.Tensor):
                s = _local(t).untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        return sum(storages.values())

    params = list(model.parameters())
    return {"params": held(params), "grads": held(p.grad for p in params if p.grad is not None),
            "optimizer": held(v for state in optim.state.values() for v in state.values())}


# ---------------------------------------------------------------------------------- checks before start-up
def _mask_of(cfg: TrainConfig):
    from .core import masks

    if cfg.model == "vit":
        return masks.resolve("full")
    if cfg.task == "documents":
        return document(list(cfg.document_lengths()))
    if cfg.task == "text":  # a typical step's mask: rows of documents
        half = cfg.seq // 2
        return document([n for _ in range(cfg.batch // cfg.dp) for n in (half, cfg.seq - half) if n])
    return masks.resolve("causal")


def check_schedule(cfg: TrainConfig) -> None:
    """Raise ValueError (one line) unless ``cfg.schedule`` can run the run's mask and head shapes on
    ``cfg.cp`` ranks; nothing communicates."""
    from . import schedules
    from .core import masks

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
        from .data import HOLD_OUT_EVERY, TextCorpus

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
    ckpt._agree(error)
    if not cfg.resume:
        ids = [ckpt.new_run_id()]
        dist.broadcast_object_list(ids, src=0)
        return 0, [], ids[0], []
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole of parameter ``p`` (a sharded one is gathered: collective)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


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


def evaluation_line(ev: dict, chance: float | None = None) -> str:
    """One evaluation as a line: ``step 50: held-out loss 1.234, accuracy 0.412 (chance 0.042)``."""
    if "mse" in ev:
        return (f"step {ev['step']}: held-out MSE {ev['mse']:.4g} (persistence {ev['persistence_mse']:.4g}, "
                f"ratio {ev['mse'] / ev['persistence_mse']:.3f})")
    note = f" (chance {chance:.3f})" if chance else ""
    return f"step {ev['step']}: held-out loss {ev['loss']:.4f}, accuracy {ev['accuracy']:.3f}{note}"


class _Progress:
    """Rich progress on rank 0: step, loss, tokens/s, MFU."""

    def __init__(self, cfg: TrainConfig, last: int, first: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        mode = "fsdp" if cfg.fsdp else "replicated"
        self.bar = Progress(TextColumn(f"[bold]{cfg.model} dp{cfg.dp} x cp{cfg.cp} {cfg.schedule} {mode} "
                                       f"{cfg.dtype}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeElapsedColumn())
        self.bar.start()
        self.task = self.bar.add_task("train", total=last, completed=first, info="")

    def update(self, step: int, loss: float, rate: dict) -> None:
        info = f"loss {loss:.4f}  {rate['tokens_per_s']:.0f} tok/s  MFU {100 * rate['mfu']:.1f}%"
        self.bar.update(self.task, completed=step, info=info)

    def print(self, line: str) -> None:
        self.bar.console.print(line, markup=False, highlight=False)

    def close(self) -> None:
        self.bar.stop()


def _write_outputs(cfg: TrainConfig, record: dict) -> None:
    if cfg.log:
        saved = {k: v for k, v in record.items() if k != "params"}
        Path(cfg.log).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.log).write_text(json.dumps(saved, indent=1))
    if cfg.plot:
        plot_losses({run_label(record): record}, cfg.plot)


def run_label(rec: dict) -> str:
    c = rec["config"]
    extra = "".join([" replicated" if not c.get("fsdp", True) else "",
                     " bf16" if c.get("dtype") == "bfloat16" else ""])
    return f"dp{c['dp']} x cp{c['cp']} {rec['schedule']}{extra}"


def results_table(records: list[dict]):
    """A rich Table of runs: losses, the last held-out evaluation, throughput and MFU, against ``ring``
    on the same mesh and the cp=1 run of the same schedule (columns no run has a value for are left
    out); its caption says what MFU is taken against."""
    from rich.table import Table

    first = records[0]["config"]
    what = first["task"] if first["task"] != "text" else f"text {first['data']}"
    peaks = {}  # what MFU is taken against, per number of ranks (a measured peak is measured per world)
    for rec in records:
        c = rec["config"]
        peaks.setdefault(rec["peak_source"], {})[c["dp"] * c["cp"]] = rec["peak_tflops_per_rank"]
    parts = []
    for source, by in peaks.items():
        each = [f"{tf:.3g} TFLOP/s per rank" + (f" at {n} rank{'s' * (n > 1)}" if len(by) > 1 else "")
                for n, tf in sorted(by.items())]
        parts.append(f"{source}: {', '.join(each)}")
    against = "; ".join(parts)
    chance = records[0].get("chance")
    evaluated = any(rec["evaluations"] for rec in records)
    held = f"held-out acc: the recall answers' accuracy (chance {chance:.3f}); " if chance and evaluated else ""
    table = Table(title=f"{first['model']} {first['config']}, {what}, seq {first['seq']}, batch {first['batch']}",
                  caption=f"{held}MFU: model FLOPs per second and rank over the {against}; step time excludes "
                          f"batch preparation")
    def key(rec: dict) -> tuple:
        c = rec["config"]
        return c["dp"], c["cp"], rec["schedule"], c.get("fsdp", True), c.get("dtype")

    by_key = {key(r): r for r in records}

    def ratio(rec: dict, other: dict | None) -> str:
        if other is None or other is rec or not other["tokens_per_s"]:
            return "-"
        return f"{rec['tokens_per_s'] / other['tokens_per_s']:.2f}"

    rows = []
    for rec in records:
        dp, cp, schedule, fsdp, dtype = key(rec)
        ring = by_key.get((dp, cp, "ring", fsdp, dtype))
        single = by_key.get((dp, 1, schedule, fsdp, dtype)) or next(
            (r for k, r in by_key.items() if k[0] == dp and k[1] == 1 and k[3:] == (fsdp, dtype)), None)
        losses = rec["losses"][rec["first_step"] - 1:]  # the steps this run trained (a resumed run: the rest)
        rows.append([run_label(rec), f"{rec['first_step']}-{rec['first_step'] + len(losses) - 1}",
                     f"{losses[0]:.4f}" if losses else "-", f"{losses[-1]:.4f}" if losses else "-",
                     _held_out(rec), f"{rec['tokens_per_s']:.0f}", f"{100 * rec['mfu']:.1f}%", ratio(rec, ring),
                     ratio(rec, single)])
    header = ("run", "steps", "first loss", "last loss", "held-out", "tokens/s", "MFU", "x ring", "x cp=1")
    optional = {"held-out", "x ring", "x cp=1"}  # left out when no run has a value
    keep = [i for i, col in enumerate(header) if col not in optional or any(r[i] != "-" for r in rows)]
    for i in keep:
        table.add_column(header[i], justify="right")
    for row in rows:
        table.add_row(*(row[i] for i in keep))
    return table


def _held_out(rec: dict) -> str:
    """The last evaluation, in a table cell."""
    if not rec["evaluations"]:
        return "-"
    ev = rec["evaluations"][-1]
    if "mse" in ev:
        return f"MSE {ev['mse'] / ev['persistence_mse']:.3f} x persistence"
    return f"acc {ev['accuracy']:.3f}"


def plot_losses(runs: dict[str, dict], path: str) -> None:
    """A PNG of the training-loss curves of ``runs`` (label -> record), with each run's held-out
    evaluations (accuracy, or the ViT's MSE over persistence's) as markers on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    right = None
    for i, (label, rec) in enumerate(runs.items()):
        color = f"C{i % 10}"
        steps = list(range(1, len(rec["losses"]) + 1))
        ax.plot(steps, rec["losses"], label=label, color=color, linestyle=("-", "--", ":", "-.")[i // 10 % 4])
        evals = rec.get("evaluations") or []
        if evals:
            right = right or ax.twinx()
            vit = "mse" in evals[0]
            values = [e["mse"] / e["persistence_mse"] if vit else e["accuracy"] for e in evals]
            right.plot([e["step"] for e in evals], values, marker="o", color=color, linestyle="none",
                       label=f"{label}: held-out")
            right.set_ylabel("held-out MSE / persistence's (markers)" if vit else "held-out accuracy (markers)")
            right.set_ylim(0, max(1.0 if vit else 0.0, *values) * 1.1)
            if rec.get("chance"):
                right.axhline(rec["chance"], color="grey", linestyle=":", linewidth=1)
                right.annotate("chance", (1, rec["chance"]), textcoords="offset points", xytext=(0, 3), fontsize=7,
                               color="grey")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over the global batch)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.2g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.2g"))
    ax.legend(fontsize=8, loc="upper center")
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
    return TrainConfig(model=args.model, config=args.config, dp=args.dp, cp=cp, schedule=schedule or args.schedule,
                       steps=args.steps, seq=args.seq, batch=args.batch, task=task, lr=args.lr, seed=args.seed,
                       stop_after=args.stop_after, checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every,
                       resume=args.resume, overwrite=args.overwrite, eval_every=args.eval_every,
                       peak_tflops=args.peak_tflops, progress=True, log=args.log, plot=args.plot, documents=docs,
                       fsdp=args.fsdp, dtype=args.dtype, data=args.data, tokenizer=args.tokenizer)


def main(argv: list[str] | None = None) -> int:
    """torchrun entry. Argument and configuration errors are found before the process group starts
    (one line, exit 2, alike on every rank); rank 0 prints each evaluation as it runs and ends with the
    results table (``--json`` for the whole record); a non-finite loss ends with one line (exit 1);
    SIGTERM ends after the step in progress, saved, with exit 0; a worker whose launcher died exits."""
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
            from .cli.output import show_wide  # the commands' width rules: the terminal's, else the table's own

            show_wide(results_table([record]))
    except (TrainingStopped, ValueError) as exc:
        if dist.get_rank() == 0:
            _say(f"error: {exc}")
        return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
