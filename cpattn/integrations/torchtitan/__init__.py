"""cpattn inside torchtitan (``pip install 'cpattn[titan]'``, torchtitan 0.3.0; see docs/torchtitan.md)::

    torchrun --nproc-per-node 2 -m cpattn.integrations.torchtitan \\
        --parallelism.context_parallel_degree 2 --cpattn.schedule zigzag_ring --training.steps 5

runs torchtitan's trainer on ``--module cpattn.integrations.torchtitan`` (the config functions of
:mod:`.config_registry`; ``--config llama3_debugmodel`` unless another is given): torchtitan's models with
:class:`CpattnAttention` as their inner attention, :class:`Trainer` sharding each step over the
context-parallel ranks, :func:`parallelize_decoder` (activation checkpointing that saves the attention op,
per-block compile, FSDP2), and a byte tokenizer with generated text. Importing this package applies the
shims torch 2.13 needs (:mod:`.shims`)."""

from __future__ import annotations

try:
    import torchtitan  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("cpattn.integrations.torchtitan needs torchtitan 0.3.0 and triton: "
                      "pip install 'cpattn[titan]' triton (or `make test-titan`)") from exc

from . import shims

shims.apply()

from .attention import CpattnAttention, use_cpattn  # noqa: E402
from .data import ByteTokenizer, GeneratedTextLoader  # noqa: E402
from .parallelize import SelectiveCpattnAC, parallelize_decoder  # noqa: E402
from .trainer import CpattnConfig, Trainer, document_mask  # noqa: E402

__all__ = ["ByteTokenizer", "CpattnAttention", "CpattnConfig", "GeneratedTextLoader", "SelectiveCpattnAC",
           "Trainer", "document_mask", "parallelize_decoder", "use_cpattn"]
