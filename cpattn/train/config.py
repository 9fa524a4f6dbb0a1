"""The run's configuration: :class:`TrainConfig`, checked as it is built, with the models, tasks, masks and
compute dtypes it accepts, and the model-config lookup its check and the task share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MODELS = ("llama", "vit")
TASKS = {"llama": ("recall", "documents", "text"), "vit": ("fields",)}
DEFAULT_SCHEDULE = {"llama": "zigzag_ring", "vit": "ringx1o"}
#: ``--mask`` -> the task that trains with that mask
MASK_TASKS = {"causal": "recall", "document": "documents", "full": "fields"}
#: compute dtypes: float32, or bfloat16 autocast (parameters, gradients and optimizer state float32)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    (which deletes them). ``peak_tflops``: per rank, for MFU (None: :func:`cpattn.train.world.world_peak`)."""

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


def _model_config(model: str, name: str):
    from ..models import LLAMA_CONFIGS, VIT_CONFIGS

    configs = LLAMA_CONFIGS if model == "llama" else VIT_CONFIGS
    if name not in configs:
        raise ValueError(f"config={name!r} is not a {model} config; accepted: {', '.join(configs)}")
    return configs[name]
