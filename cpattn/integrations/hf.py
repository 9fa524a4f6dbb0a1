"""Hugging Face ``transformers`` (5.x) models with context-parallel attention.

:func:`register` adds an attention implementation named ``"cpattn"`` to ``transformers``; a model built
with ``attn_implementation="cpattn"`` then runs every attention layer through the
:class:`cpattn.ContextParallel` made active by :func:`use`::

    hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="cpattn")
    cp = cpattn.ContextParallel(seq_len=S, mask="causal", schedule="zigzag_ring")
    with hf.use(cp):
        logits = model(cp.shard(input_ids, dim=1), position_ids=cp.positions()[None], use_cache=False).logits
        hf.causal_lm_loss(logits, input_ids, cp).backward()

The mask is the ContextParallel's: the model's own masks are never built (the mask hook of ``"cpattn"``
returns None), and what cpattn cannot honour raises instead of being dropped: a padding
``attention_mask``, a custom 4-D mask, a model's extra mask functions, attention dropout, soft-capping
on a backend other than "auto" or "math", packed-sequence keyword arguments that are not the mask's
documents (:func:`packed` makes the view that matches them), a key/value cache, a causal setting or a
window that the mask disagrees with, and ``position_ids`` that are not the tokens' global positions.

Each layer runs on the mask it asks for: a sliding-window layer on the view of the ContextParallel
with its window added (Gemma 2 and 3, gpt-oss, Mistral-style hybrids). Attention sinks (gpt-oss's
``s_aux``) are merged exactly, Gemma 2's soft-capped scores run on a kernel path that applies a score
modification, and a layer recomputed by gradient checkpointing finds its ContextParallel on any thread.

``transformers`` is imported by :func:`register` only, never by ``import cpattn``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..api import ContextParallel
from .hf_common import IGNORE_INDEX, NAME, active, attention_forward, mask_hook, packed, register, shift_labels, use


def causal_lm_loss(logits_local: torch.Tensor, labels_full: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Mean next-token cross-entropy over every token of the ContextParallel group.

    ``logits_local [b, local_len, vocab]``: this rank's logits (inputs sharded with ``cp.shard``).
    ``labels_full [b, seq_len]``: the unshifted labels of the full sequence (usually ``input_ids``;
    :data:`IGNORE_INDEX` where no loss is wanted), as transformers takes them. They are shifted on the
    full sequence (:func:`shift_labels`), so a token whose successor lives on another rank still gets its
    label, then sharded; padding tokens are ignored.

    Returns this rank's share: the sum of its tokens' losses divided by the number of labelled tokens
    of the whole group (all-reduced). The shares add up to the global mean, and so do their gradients:
    summing the parameter gradients over the ranks (as data parallelism's all-reduce does) gives the
    gradient of the global mean. To log the global mean, all-reduce (SUM) the detached value.
    """
    labels = cp.shard(shift_labels(labels_full), dim=1).to(logits_local.device)
    labels = labels.masked_fill(cp.positions().to(labels.device) < 0, IGNORE_INDEX)
    if logits_local.shape[:2] != labels.shape:
        raise ValueError(f"logits_local has shape {tuple(logits_local.shape)}, expected [b, local_len, vocab] with "
                         f"[b, local_len] = {list(labels.shape)}")
    total = F.cross_entropy(logits_local.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                            reduction="sum")
    count = (labels != IGNORE_INDEX).sum()
    if cp.world_size > 1:
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=cp.comm.group)
    return total / count.clamp(min=1)


def __getattr__(name: str):
    """``hf.Trainer`` and ``hf.context_parallel`` (:mod:`cpattn.integrations.hf_trainer`) and ``hf.generate``
    (:mod:`cpattn.integrations.hf_generate`), imported on first use."""
    if name in ("Trainer", "context_parallel"):
        from . import hf_trainer

        return getattr(hf_trainer, name)
    if name == "generate":
        from .hf_generate import generate

        return generate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["IGNORE_INDEX", "NAME", "active", "attention_forward", "causal_lm_loss", "mask_hook", "packed", "register",
           "shift_labels", "use"]
