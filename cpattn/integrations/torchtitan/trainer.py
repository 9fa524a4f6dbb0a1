"""torchtitan's Trainer with cpattn's context parallelism: its config gains ``--cpattn.schedule`` (and the
local kernel backend and the ranks' agreement checks), and ``post_dataloading_process`` shards each step's
inputs, labels and positions over the context-parallel ranks.

A step's ``[b, L]`` batch is one packed sequence of ``b * L`` tokens (rows flattened; cpattn's convention
for batches), over which the documents that torchtitan's per-document positions mark (a document starts
where its position is 0, and at every row's start) become the step's document mask, causal inside each
document: block-causal as torchtitan's FlexAttention means it. The model then runs on ``[1, b * L / cp]``
tokens of this rank, with the step's ``ContextParallel`` view as its ``attention_masks``.

Each step writes two numbers to torchtitan's structured log (``metric_value`` records):
``cpattn_bytes_sent``, what this rank's attention sent, and ``cpattn_bytes_expected``, what the
schedule declares for one forward and one backward of every attention layer. They are equal unless
something runs an attention twice (activation checkpointing that recomputes it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.models.common.attention import BaseAttention
from torchtitan.observability import structured_logger as sl
from torchtitan.trainer import Trainer as TitanTrainer

from ... import masks
from ...api import ContextParallel
from ...core.masks import Mask
from ...schedules import get as get_schedule
from ...schedules import names as schedule_names
from .attention import CpattnAttention


@dataclass(kw_only=True, slots=True)
class CpattnConfig:
    schedule: str = "zigzag_ring"
    """cpattn schedule that splits each sequence over --parallelism.context_parallel_degree ranks (one
    accepting causal masks; `cpattn schedules` lists them), or "auto" """

    backend: Literal["auto", "aten", "flash_attn", "flash_attn3", "flash_attn4", "flex", "math"] = "auto"
    """cpattn's local attention kernels"""

    check: Literal["first", "always", "off"] = "first"
    """When the context-parallel ranks compare their settings and inputs (all raise alike when they differ)"""


def check_config(config: TitanTrainer.Config, options: CpattnConfig) -> None:
    """Refuse what the integration does not run, when the command line is parsed (every rank alike,
    before any communication)."""
    p = config.parallelism
    if options.schedule != "auto":
        if options.schedule not in schedule_names():
            raise ValueError(f"--cpattn.schedule {options.schedule!r} is unknown; accepted: 'auto', "
                             f"{', '.join(schedule_names())}")
        if not get_schedule(options.schedule).causal:
            raise ValueError(f"--cpattn.schedule {options.schedule!r} runs bidirectional masks only; a language "
                             "model needs one that accepts causal masks (`cpattn schedules` lists them)")
    for name, degree in (("tensor_parallel_degree", p.tensor_parallel_degree),
                         ("pipeline_parallel_degree", p.pipeline_parallel_degree),
                         ("expert_parallel_degree", p.expert_parallel_degree)):
        if degree != 1:
            raise ValueError(f"--parallelism.{name} {degree}: the cpattn integration runs data (FSDP2, HSDP) x "
                             "context parallelism only; set it to 1")
    if config.validator.enable:
        raise ValueError("--validator.enable: torchtitan's validator feeds the model unsharded batches without "
                         "the step's ContextParallel view; the cpattn integration does not run it")
    if p.spmd_backend != "partial_dtensor":
        raise ValueError(f"--parallelism.spmd_backend {p.spmd_backend!r}: the cpattn integration needs "
                         "'partial_dtensor' (DTensor for FSDP only; cpattn's attention takes local tensors)")
    if config.model_spec is not None:
        inner = {type(a.inner_attention).__qualname__
                 for _, a, _, _ in config.model_spec.model.traverse(BaseAttention.Config)}
        if inner != {CpattnAttention.Config.__qualname__}:
            raise ValueError("the model's inner attention must be CpattnAttention (cpattn.integrations.torchtitan."
                             f"use_cpattn(model_config)), got {sorted(inner)}")


def document_mask(positions: torch.Tensor) -> Mask:
    """The mask of a ``[b, L]`` batch of per-document positions as one packed sequence of ``b * L``
    tokens: a document starts at every row's first token and wherever a position is 0; causal inside
    each. One row holding one document is plain causal. Reads the positions on the host."""
    lengths = []
    for row in positions.tolist():
        starts = [0] + [j for j, p in enumerate(row) if j and p == 0]
        lengths += [end - start for start, end in zip(starts, [*starts[1:], len(row)])]
    return masks.causal() if len(lengths) == 1 else masks.document(lengths)


class Trainer(TitanTrainer):
    """``torchtitan.trainer.Trainer`` whose context-parallel ranks split each sequence with cpattn."""

    @dataclass(kw_only=True, slots=True)
    class Config(TitanTrainer.Config):
        cpattn: CpattnConfig = field(default_factory=CpattnConfig)

        def __post_init__(self) -> None:
            TitanTrainer.Config.__post_init__(self)
            check_config(self, self.cpattn)

    config: Config
    cp: ContextParallel

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        group = self.parallel_dims.get_optional_mesh("cp", include_singleton_axes=True)
        tokens = config.training.local_batch_size * config.training.seq_len
        self.cp = ContextParallel(tokens, mask="causal", schedule=config.cpattn.schedule, group=group,
                                  backend=config.cpattn.backend, check=config.cpattn.check)
        self.attention_shapes = [(a.n_heads, getattr(a, "n_kv_heads", None) or a.n_heads,
                                  getattr(a, "head_dim", None) or a.dim // a.n_heads)
                                 for _, a, _, _ in self.model_config.traverse(BaseAttention.Config)]
        self.bytes_expected = 0

    def expected_bytes(self, view: ContextParallel) -> int:
        """Bytes this rank's attention sends in one forward and backward of every attention layer on
        ``view``, by the schedule's declared steps (activations in the mixed-precision parameter dtype)."""
        dtype = TORCH_DTYPE_MAP[self.config.training.mixed_precision_param]
        total = 0
        for heads, kv_heads, head_dim in self.attention_shapes:
            q = torch.empty(1, view.local_len, heads, head_dim, dtype=dtype, device="meta")
            k = torch.empty(1, view.local_len, kv_heads, head_dim, dtype=dtype, device="meta")
            total += sum(op["bytes_sent"] for phase in view.expected_volume(q, k).values() for op in phase.values())
        return total

    def train_step(self, data_iterator) -> None:
        self.cp.reset_comm_stats()
        self.bytes_expected = 0
        super().train_step(data_iterator)
        sl.log_trace_scalar({"cpattn_bytes_sent": self.cp.comm_stats()["total"]["bytes_sent"],
                             "cpattn_bytes_expected": self.bytes_expected})

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """``({"input": [b, L], "positions": [b, L]}, labels [b, L])`` -> this rank's ``[1, b * L / cp]``
        inputs and labels (padding, if the layout needs any, labelled ``IGNORE_INDEX``), and the model's
        keyword arguments: the local positions (RoPE) and the step's view (``attention_masks``)."""
        inputs = input_dict["input"]
        extra = set(input_dict) - {"input", "positions"}
        if extra:
            raise ValueError(f"the cpattn Trainer shards 'input', 'positions' and the labels; the batch also has "
                             f"{sorted(extra)}, which it cannot split")
        b, length = inputs.shape
        positions = input_dict.get("positions")
        if positions is None:  # one document per row
            positions = torch.arange(length, device=inputs.device).expand(b, length)
        view = self.cp.with_mask(document_mask(positions))
        self.bytes_expected += self.expected_bytes(view)
        local_inputs, local_labels, local_positions = (view.shard(t.reshape(1, b * length), dim=1)
                                                        for t in (inputs, labels, positions))
        padding = view.positions() < 0  # on the host
        self.ntokens_seen += int((~padding).sum())
        local_labels[:, padding.to(local_labels.device)] = IGNORE_INDEX
        return local_inputs, local_labels, {"positions": local_positions, "attention_masks": view}
