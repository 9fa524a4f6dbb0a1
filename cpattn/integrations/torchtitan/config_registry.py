"""Config functions for torchtitan's ``--module`` (``--module cpattn.integrations.torchtitan --config
llama3_debugmodel``): torchtitan's own model configs with every inner attention on cpattn, the cpattn
parallelize function, the byte tokenizer and generated text. Other flags pass through to torchtitan
(``--training.steps 5``, ``--parallelism.context_parallel_degree 2``, ``--cpattn.schedule ringx4o``)."""

from __future__ import annotations

import dataclasses

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models import llama3, qwen3
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.protocols.model_spec import ModelSpec

from .attention import use_cpattn
from .data import ByteTokenizer, GeneratedTextLoader
from .parallelize import parallelize_decoder
from .trainer import Trainer


def on_cpattn(model_spec: ModelSpec) -> ModelSpec:
    """``model_spec`` with its attention on cpattn and the cpattn parallelize function (no pipelining)."""
    use_cpattn(model_spec.model)
    return dataclasses.replace(model_spec, parallelize_fn=parallelize_decoder, pipelining_fn=None)


def trainer_config(model_spec: ModelSpec, lr: float = 8e-4) -> Trainer.Config:
    """The settings of torchtitan's debug configs on ``model_spec`` (on cpattn), with the byte tokenizer,
    generated text, 2 rows of 256 tokens per step, selective activation checkpointing and no validation."""
    model_spec = on_cpattn(model_spec)
    return Trainer.Config(
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec))),
        hf_assets_path=".",  # nothing is read from it: the tokenizer is bytes
        model_spec=model_spec,
        tokenizer=ByteTokenizer.Config(),
        dataloader=GeneratedTextLoader.Config(),
        optimizer=default_adamw(lr=lr),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                  min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=2, seq_len=256, steps=10, disable_cuda_graphs=True),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(interval=10, last_save_model_only=False),
        activation_checkpoint=SelectiveAC.Config(),
        validator=Validator.Config(enable=False),
    )


def llama3_debugmodel() -> Trainer.Config:
    """torchtitan's Llama 3 debug model (6 layers, dim 256, 16 heads) on cpattn."""
    return trainer_config(llama3.model_registry("debugmodel"))


def qwen3_debugmodel() -> Trainer.Config:
    """torchtitan's Qwen3 debug model (8 layers, 16 query and 8 key/value heads of 128, q/k norms, tied
    embeddings) on cpattn."""
    return trainer_config(qwen3.model_registry("debugmodel"))
