"""Functions the Hugging Face tests run on worker processes: a tiny random transformers model with
``attn_implementation="cpattn"`` on every rank against the same weights with ``"eager"`` on the whole
sequence in one process."""

from __future__ import annotations

import copy
import threading

import torch
import torch.distributed as dist

import cpattn
from cpattn.integrations import hf

VOCAB = 128


def tiny_config(kind: str = "llama", sliding_window: int | None = None):
    """A small random config (no download): 2 layers, 4 query heads and 2 key/value heads (llama, mistral)
    or 12 and 6 of 8 dimensions (the other families, so that 2 and 3 ranks split them). ``gemma3`` has 3
    layers that alternate sliding-window (``sliding_window`` tokens, default 8) and full attention."""
    import transformers

    sizes = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=256)
    if kind == "llama":
        return transformers.LlamaConfig(**sizes)
    if kind == "mistral":
        return transformers.MistralConfig(sliding_window=sliding_window, **sizes)
    sizes.update(hidden_size=96, num_attention_heads=12, num_key_value_heads=6)  # heads 2 and 3 ranks split
    if kind == "qwen3":
        return transformers.Qwen3Config(head_dim=8, **sizes)
    if kind == "gemma3":
        sizes["num_hidden_layers"] = 3
        return transformers.Gemma3TextConfig(head_dim=8, query_pre_attn_scalar=8, sliding_window=sliding_window or 8,
                                             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                             **sizes)
    if kind == "gemma2":  # soft-capped scores (a small cap, so that it matters), window and full layers
        return transformers.Gemma2Config(head_dim=8, query_pre_attn_scalar=8, sliding_window=sliding_window or 8,
                                         attn_logit_softcapping=0.5,
                                         layer_types=["sliding_attention", "full_attention"], **sizes)
    if kind == "gpt_oss":  # sinks, window and full layers, a mixture of experts
        return transformers.GptOssConfig(head_dim=8, sliding_window=sliding_window or 8, num_local_experts=4,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                         num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                                         **sizes)
    raise ValueError(f"unknown model kind {kind!r}")


def model_pair(config, seed: int):
    """``(cpattn model, eager model)`` with the same random weights. Each gets its own copy of the config:
    ``from_config`` writes the implementation into the config object it is given."""
    from transformers import AutoModelForCausalLM

    hf.register()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="cpattn")
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    ref.load_state_dict(model.state_dict())
    return model, ref


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` (inf when ``a`` is not finite)."""
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def summed(loss: torch.Tensor, model, cp) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's loss share and parameter gradients, each summed over the group's ranks (the global
    mean loss and its gradient, as data parallelism's all-reduce would give them)."""
    total = loss.detach().clone()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if cp.world_size > 1:
        dist.all_reduce(total)
        for g in grads.values():
            dist.all_reduce(g)
    return total, grads


def parity(schedule: str, seq_len: int, seed: int, kind: str = "llama", window: int | None = None,
           documents: list[int] | None = None, batch: int = 2, checkpoint: str | None = None,
           backward_thread: bool = False) -> dict[str, float]:
    """Forward and backward of the model at CP = the world size against the sdpa model on one process.

    ``documents``: lengths of packed documents (mask ``cpattn.masks.document``, positions restart in each
    document); the reference runs each document on its own. ``window``: a Mistral sliding window. Returns
    the relative errors of the logits, the loss and the parameter gradients (the worst parameter).
    ``checkpoint``: "reentrant" or "non_reentrant" gradient checkpointing of the cpattn model's layers;
    ``backward_thread``: run its backward on a new thread, outside ``hf.use`` (the recomputed layers must
    still find their ContextParallel)."""
    model, ref = model_pair(tiny_config(kind, window), seed)
    if checkpoint is not None:
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpoint == "reentrant"})
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed + 1))
    mask = "causal"
    if window is not None and kind == "mistral":  # every layer has the window: the mask says it
        mask = cpattn.masks.sliding_window(window)
    if documents is not None:
        mask = cpattn.masks.document(documents)
    cp = cpattn.ContextParallel(seq_len, mask=mask, schedule=schedule)
    positions, labels = cp.positions(), ids
    if documents is not None:  # no loss for predicting a document's first token from the previous one
        labels = ids.clone()
        labels[:, torch.tensor(documents[:-1]).cumsum(0)] = hf.IGNORE_INDEX
    if documents is not None:  # each document's positions start at 0
        starts = torch.tensor([0, *documents]).cumsum(0)[:-1]
        doc = torch.searchsorted(torch.tensor(documents).cumsum(0), positions.clamp(min=0), right=True)
        positions = torch.where(positions >= 0, positions - starts[doc.clamp(max=len(documents) - 1)], -1)

    with hf.use(cp):
        logits = model(cp.shard(ids, dim=1), position_ids=positions[None], use_cache=False).logits
        loss = hf.causal_lm_loss(logits, labels, cp)
        if not backward_thread:
            loss.backward()
    if backward_thread:
        failed: list[BaseException] = []

        def run() -> None:
            try:
                loss.backward()
            except BaseException as exc:  # noqa: BLE001 (re-raised on the caller's thread)
                failed.append(exc)

        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
        if failed:
            raise failed[0]
    total, grads = summed(loss, model, cp)
    logits_full = cp.unshard(logits.detach(), dim=1)

    if documents is None:
        out = ref(ids, labels=ids, use_cache=False)
        ref_logits, ref_loss = out.logits, out.loss
    else:  # each document alone; the loss is the mean over every document's shifted tokens
        parts = list(torch.split(ids, documents, dim=1))
        outs = [ref(p, use_cache=False).logits for p in parts]
        ref_logits = torch.cat(outs, dim=1)
        labels = torch.cat([hf.shift_labels(p) for p in parts], dim=1)
        ref_loss = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(),
                                                     ignore_index=hf.IGNORE_INDEX)
    ref_loss.backward()
    return {
        "logits": rel(logits_full, ref_logits.detach()),
        "loss": rel(total, ref_loss.detach()),
        "grads": max(rel(grads[n], p.grad) for n, p in ref.named_parameters()),
    }


def packed_parity(schedule: str, lengths: list[int], seq_len: int, seed: int) -> dict[str, float]:
    """A ``DataCollatorWithFlattening`` batch of documents of ``lengths`` (with the flash-attn keyword
    arguments) through the model at CP = the world size, via ``hf.packed``, against each document run
    alone through the sdpa model: its logits, the token-weighted mean loss and its gradients."""
    from transformers import DataCollatorWithFlattening

    model, ref = model_pair(tiny_config("llama"), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    docs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d.tolist()} for d in docs])
    cp = cpattn.ContextParallel(seq_len, mask="causal", schedule=schedule)
    view, full = hf.packed(cp, batch)
    extra = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    with hf.use(view):
        logits = model(view.shard(full["input_ids"], dim=1), position_ids=view.shard(full["position_ids"], dim=1),
                       use_cache=False, **extra).logits
        loss = hf.causal_lm_loss(logits, full["labels"], view)
        loss.backward()
    total, grads = summed(loss, model, cp)
    logits_full = view.unshard(logits.detach(), dim=1)[:, :sum(lengths)]
    outs = [ref(d[None], use_cache=False).logits for d in docs]
    ref_logits = torch.cat(outs, dim=1)
    labels = torch.cat([hf.shift_labels(d[None]) for d in docs], dim=1)
    ref_loss = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(),
                                                 ignore_index=hf.IGNORE_INDEX)
    ref_loss.backward()
    return {"logits": rel(logits_full, ref_logits.detach()), "loss": rel(total, ref_loss.detach()),
            "grads": max(rel(grads[n], p.grad) for n, p in ref.named_parameters())}
