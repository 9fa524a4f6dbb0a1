"""``hf.generate``: generation with a ``transformers`` model whose key/value cache is sharded over a
context-parallel group (:class:`cpattn.inference.KVCache`).

::

    hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="cpattn")
    cp = cpattn.ContextParallel(seq_len=prompt_len, mask="causal", schedule="zigzag_ring")
    ids = hf.generate(model, input_ids, cp, max_new_tokens=64)        # every rank: [b, prompt_len + 64]

Every rank passes the whole prompt and gets every generated id. The prompt is prefilled sharded by
``cp``'s schedule (each rank keeps its own tokens' keys and values); each new token is decoded by every
rank on its own shard, the partial results merged exactly. A batch whose rows have different lengths
comes left-padded with its ``attention_mask`` (transformers' convention) and is prefilled as one packed
sequence of documents, one per row. ``past_key_values=`` the cache of an earlier call (``return_dict_in_
generate=True`` returns it) continues a conversation: the prompt then holds the whole history, and only
the tokens the cache does not hold are prefilled, attending the cache through ``pass_q`` or ``pass_kv``.

Greedy search and sampling (``do_sample=True``, with transformers' logits processors: temperature,
top-k, top-p, penalties...) and their stopping rules (``max_new_tokens``, ``max_length``, end-of-sequence
tokens) are transformers' own. Sampling draws from one ``torch.Generator`` seeded with ``seed`` (default:
a seed drawn on group rank 0 and broadcast), so every rank draws the same tokens, which are those of
``torch.manual_seed(seed); model.generate(...)`` on one process. Beam search, assisted or contrastive
decoding, static caches, streamers and attention or hidden-state outputs raise ``NotImplementedError``.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.generation import GenerateDecoderOnlyOutput, GenerationMode, LogitsProcessorList, StoppingCriteriaList

from .. import agree
from ..api import ContextParallel
from ..core.masks import CausalMask
from ..core.masks import document as document_mask
from ..inference import KVCache
from . import hf_common

#: keyword arguments of :func:`generate` that are cpattn's own (the rest go to transformers' generation config)
OWN_KWARGS = ("attention_mask", "past_key_values", "seed", "merge", "extend", "generation_config", "logits_processor",
              "stopping_criteria", "use_cache")
#: what transformers' generation config may ask for that this generation does not do
_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


class _ShardLayer(CacheLayerMixin):
    """One layer of :class:`ShardedCache` as transformers sees it: ``update`` keeps this rank's tokens of
    the step in the :class:`KVCache` and hands the step's keys and values back unchanged (the ``"cpattn"``
    attention attends the cache itself)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, kv: KVCache, layer: int) -> None:
        super().__init__()
        self.kv, self.layer = kv, layer
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.kv.write(self.layer, key_states.transpose(1, 2), value_states.transpose(1, 2))
        return key_states, value_states

    def get_seq_length(self) -> int:
        return max(self.kv.row_lengths())

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class ShardedCache(Cache):
    """The ``transformers`` cache of :func:`generate`: one :class:`KVCache` (``.kv``: shape, dtype and
    bytes per rank) and the token ids it holds per row (``.ids``), so a later call can check that its
    prompt continues them. Reordering, cropping and offloading are not supported."""

    def __init__(self, kv: KVCache) -> None:
        super().__init__(layers=[_ShardLayer(kv, i) for i in range(kv.layers)])
        self.kv = kv
        self.ids: list[torch.Tensor] = [torch.empty(0, dtype=torch.long) for _ in range(kv.rows)]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("a sharded cpattn cache cannot be reordered (beam search is not supported)")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a sharded cpattn cache cannot be cropped")


class _Step:
    """What the ``"cpattn"`` attention does in a decoding or multi-turn prefill step of :func:`generate`:
    attend the sharded cache (``hf.attention_forward`` hands every layer here while it is active)."""

    def __init__(self, kv: KVCache, cp: ContextParallel | None) -> None:
        self.kv, self.cp = kv, cp

    def attention(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scaling: float | None, kwargs: dict) -> torch.Tensor:
        layer, q = module.layer_idx, query.transpose(1, 2)
        options = {"window": kwargs.get("sliding_window"), "sinks": kwargs.get("s_aux", kwargs.get("sinks")),
                   "softcap": kwargs.get("softcap")}
        if self.cp is None:  # decoding: one new token per row, replicated
            return self.kv.decode_attention(layer, q, scaling, **options)
        cp = hf_common.layer_context(self.cp, module, kwargs)
        return self.kv.extend_attention(layer, cp, q, key.transpose(1, 2), value.transpose(1, 2), scaling, **options)


@contextlib.contextmanager
def _attending_cache(step: _Step | None) -> Iterator[None]:
    token = hf_common.GENERATION.set(step)
    try:
        yield
    finally:
        hf_common.GENERATION.reset(token)


def _digest(t: torch.Tensor | None) -> str:
    if t is None:
        return "none"
    data = t.detach().cpu().contiguous()
    return f"{tuple(data.shape)} {data.dtype} {hashlib.blake2b(data.numpy().tobytes(), digest_size=8).hexdigest()}"


def _row_lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Real tokens per row of a left-padded batch (all of them without a mask)."""
    b, n = input_ids.shape
    if attention_mask is None:
        return [n] * b
    if tuple(attention_mask.shape) != (b, n):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {(b, n)}")
    mask = attention_mask.detach().cpu().long()
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (real tokens) only")
    lengths = mask.sum(1)
    left = torch.arange(n)[None] >= (n - lengths)[:, None]  # ones exactly at the end of each row
    if not bool((mask.bool() == left).all()) or bool((lengths == 0).any()):
        raise ValueError("hf.generate takes left-padded prompts (transformers' padding_side='left' for decoder-only "
                         "generation): each row's attention_mask must be zeros then at least one 1, up to the end")
    return lengths.tolist()


def _chunk_context(base: ContextParallel, lengths: list[int]) -> ContextParallel:
    """The ContextParallel that shards a packed chunk of ``lengths`` tokens (one document per row): ``base``
    itself, or its view, when its length fits; else one with ``base``'s group, schedule and settings."""
    total = sum(lengths)
    mask = base.mask if len(lengths) == 1 else document_mask(lengths)
    if base.seq_len == total:
        return base if mask == base.mask else base.with_mask(mask)
    return ContextParallel(total, mask=mask, schedule=base.schedule, group=base.comm.group, topology=base.topology,
                           backend=base.backend, layout=base._layout_arg, check=base.check,
                           memory_limit=base.memory_limit)


def _generation_config(model, kwargs: dict):
    """transformers' generation config for ``kwargs`` (its own merge of the model's defaults), checked for
    what this generation supports."""
    config, extra = model._prepare_generation_config(kwargs.pop("generation_config", None), **kwargs)
    extra.pop("use_cache", None)
    if extra:
        raise TypeError(f"hf.generate: unsupported keyword arguments {sorted(extra)} (accepted: transformers' "
                        f"generation options and {', '.join(OWN_KWARGS)})")
    mode = config.get_generation_mode()
    if config.num_beams is not None and config.num_beams > 1:
        raise NotImplementedError(f"hf.generate: beam search (num_beams={config.num_beams}) is not supported on a "
                                  "sharded cache; use greedy search or sampling (num_beams=1)")
    if mode not in _MODES:
        raise NotImplementedError(f"hf.generate: generation mode {mode.value!r} is not supported; greedy search and "
                                  "sampling are")
    for name in ("output_attentions", "output_hidden_states"):
        if getattr(config, name, False):
            raise NotImplementedError(f"hf.generate: {name}=True is not supported (no attention weights or hidden "
                                      "states are gathered)")
    if (config.num_return_sequences or 1) > 1:
        raise NotImplementedError("hf.generate: num_return_sequences > 1 is not supported; repeat the prompt rows")
    if config.cache_implementation is not None:
        raise NotImplementedError(f"hf.generate: cache_implementation={config.cache_implementation!r}: the cache is "
                                  "cpattn's sharded one")
    if config.use_cache is False:
        raise ValueError("hf.generate: use_cache=False is not supported (decoding attends the sharded cache)")
    return config


class _Generation:
    """One :func:`generate` call: checks, agreement, prefill, the decoding loop."""

    def __init__(self, model, input_ids: torch.Tensor, cp: ContextParallel, kwargs: dict) -> None:
        self.model, self.input_ids = model, input_ids
        self.base = cp.base if isinstance(cp, ContextParallel) else cp
        self.kwargs = dict(kwargs)

    def check(self) -> None:
        """Everything that can be checked on this rank alone (raises before any communication)."""
        model, input_ids, kwargs = self.model, self.input_ids, self.kwargs
        if not isinstance(self.base, ContextParallel):
            raise TypeError(f"hf.generate takes a cpattn.ContextParallel, got {type(self.base).__name__}")
        if not isinstance(self.base.mask, CausalMask):
            raise ValueError(f"hf.generate needs a ContextParallel with mask='causal' (got {self.base.mask.name!r}); "
                             "each layer's window comes from the model")
        config = getattr(model, "config", None)
        if getattr(config, "_attn_implementation", None) != hf_common.NAME:
            raise ValueError(f"hf.generate: build the model with attn_implementation={hf_common.NAME!r} "
                             "(after hf.register())")
        if getattr(config, "is_encoder_decoder", False):
            raise NotImplementedError("hf.generate: encoder-decoder models are not supported")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError("hf.generate: input_ids must be a [batch, prompt_len] LongTensor (the whole prompt, on "
                             "every rank)")
        self.attention_mask = kwargs.pop("attention_mask", None)
        self.cache = kwargs.pop("past_key_values", None)
        self.seed = kwargs.pop("seed", None)
        self.cache_options = {"merge": kwargs.pop("merge", "auto"), "extend": kwargs.pop("extend", "auto")}
        self.processors = kwargs.pop("logits_processor", None) or LogitsProcessorList()
        self.criteria = kwargs.pop("stopping_criteria", None) or StoppingCriteriaList()
        self.lengths = _row_lengths(input_ids, self.attention_mask)
        rows = input_ids.shape[0]
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TypeError(f"hf.generate: seed must be an int or None, got {self.seed!r}")
        self.config = _generation_config(model, kwargs)
        if self.cache is None:
            self.cached = [0] * rows
        else:
            if not isinstance(self.cache, ShardedCache):
                raise TypeError("hf.generate: past_key_values must be the cache an earlier hf.generate returned "
                                f"(return_dict_in_generate=True), got {type(self.cache).__name__}")
            if self.cache.kv.rows != rows or self.cache.kv.world_size != self.base.world_size:
                raise ValueError(f"hf.generate: the cache holds {self.cache.kv.rows} rows over "
                                 f"{self.cache.kv.world_size} ranks; the prompt has {rows} rows, the group "
                                 f"{self.base.world_size} ranks")
            self.cached = self.cache.kv.row_lengths()
            for b, (n, held) in enumerate(zip(self.lengths, self.cache.ids)):
                real = input_ids[b, input_ids.shape[1] - n:].cpu()
                if n <= held.numel() or not torch.equal(real[:held.numel()], held):
                    raise ValueError(f"hf.generate: row {b} of the prompt does not continue the cache (it holds "
                                     f"{held.numel()} tokens; the prompt must start with them and add at least one)")

    def agree(self, error: BaseException | None) -> None:
        base = self.base
        fields = {"input_ids": _digest(self.input_ids) if isinstance(self.input_ids, torch.Tensor) else "?",
                  "attention_mask": _digest(getattr(self, "attention_mask", None)),
                  "generation config": self.config.to_json_string(use_diff=True) if hasattr(self, "config") else "?",
                  "seed": repr(getattr(self, "seed", "?")),
                  "cached tokens per row": repr(getattr(self, "cached", "?"))}
        agree.agree(base._setup, "hf.generate", fields, error, base._exchange_device)

    def run(self):
        error = None
        try:
            self.check()
        except Exception as exc:  # any check's error reaches every rank (agree), or the others would wait
            error = exc
        if not isinstance(self.base, ContextParallel):
            raise error
        self.agree(error)
        with torch.no_grad():
            return self._generate()

    # ------------------------------------------------------------------ the loop
    def _generate(self):
        model, config, input_ids = self.model, self.config, self.input_ids
        rows, prompt_len = input_ids.shape
        device = input_ids.device
        comm = self.base.comm.view()  # logits and seed exchanges, apart from the attention traffic
        if config.max_new_tokens is not None:
            config.max_length = config.max_new_tokens + prompt_len
        if config.min_new_tokens is not None:
            config.min_length = config.min_new_tokens + prompt_len
        model._prepare_special_tokens(config, self.attention_mask is not None, device=device, batch_size=rows)
        processors = model._get_logits_processor(generation_config=config, input_ids_seq_length=prompt_len,
                                                 encoder_input_ids=input_ids, prefix_allowed_tokens_fn=None,
                                                 logits_processor=self.processors, device=str(device),
                                                 model_kwargs={"attention_mask": self.attention_mask})
        criteria = model._get_stopping_criteria(generation_config=config, stopping_criteria=self.criteria)
        generator = self._generator(comm) if config.do_sample else None
        pad = config._pad_token_tensor
        has_eos = any(hasattr(c, "eos_token_id") for c in criteria)

        logits, cache, cp = self._prefill(comm)
        scores_out = () if config.return_dict_in_generate and config.output_scores else None
        logits_out = () if config.return_dict_in_generate and config.output_logits else None
        unfinished = torch.ones(rows, dtype=torch.long, device=device)
        ids = input_ids
        while True:
            scores = processors(ids, logits)
            if scores_out is not None:
                scores_out += (scores,)
            if logits_out is not None:
                logits_out += (logits,)
            if generator is not None:
                probs = torch.nn.functional.softmax(scores, dim=-1)
                tokens = torch.multinomial(probs.cpu(), num_samples=1, generator=generator).squeeze(1).to(device)
            else:
                tokens = torch.argmax(scores, dim=-1)
            if has_eos:
                tokens = tokens * unfinished + pad * (1 - unfinished)
            ids = torch.cat([ids, tokens[:, None]], dim=-1)
            unfinished = unfinished & ~criteria(ids, scores_out)
            if int(unfinished.max()) == 0:
                break
            logits = self._decode(cache, cp, tokens)
        agree.agree(self.base._setup, "hf.generate (result)", {"generated ids": _digest(ids)}, None,
                    self.base._exchange_device)
        if config.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(sequences=ids, scores=scores_out, logits=logits_out, past_key_values=cache)
        return ids

    def _generator(self, comm) -> torch.Generator:
        seed = self.seed
        if seed is None:  # group rank 0 draws it, every rank uses it
            drawn = torch.randint(0, 2 ** 62, (1,)) if comm.rank == 0 else torch.zeros(1, dtype=torch.long)
            drawn = drawn.to(self.base._exchange_device)
            comm.broadcast(drawn, src=0)
            seed = int(drawn.item())
        return torch.Generator().manual_seed(seed)

    def _new_cache(self, cp: ContextParallel) -> ShardedCache:
        model, config = self.model, self.model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        total = sum(self.lengths) + self.input_ids.shape[0] * (self.config.max_length - self.input_ids.shape[1])
        kv = KVCache(cp, text.num_hidden_layers, kv_heads, head_dim, rows=self.input_ids.shape[0], dtype=model.dtype,
                     device=self.input_ids.device, capacity=math.ceil(total / cp.world_size) + 1, **self.cache_options)
        return ShardedCache(kv)

    def _prefill(self, comm) -> tuple[torch.Tensor, ShardedCache, ContextParallel]:
        """The prompt tokens the cache does not hold, sharded; returns each row's next-token logits (float32,
        every rank), the cache and the chunk's ContextParallel."""
        input_ids = self.input_ids
        rows, n = input_ids.shape
        new = [input_ids[b, n - length + held:] for b, (length, held) in enumerate(zip(self.lengths, self.cached))]
        new_lengths = [t.numel() for t in new]
        cp = _chunk_context(self.base, new_lengths)
        cache = self.cache if self.cache is not None else self._new_cache(cp)
        kv = cache.kv
        fresh = max(kv.tokens_per_rank()) == 0
        placement = kv.place_prompt(cp, new_lengths)
        local_ids = cp.shard(torch.cat(new)[None], dim=1)
        ends = torch.tensor(kv.row_lengths())
        real = placement.rows >= 0
        last = (real & (placement.positions == ends[placement.rows.clamp(min=0)] - 1)).nonzero().flatten()
        with hf_common.use(cp), _attending_cache(None if fresh else _Step(kv, cp)):
            out = self.model(input_ids=local_ids, position_ids=placement.positions[None].to(input_ids.device),
                             past_key_values=cache, use_cache=True, logits_to_keep=last.to(input_ids.device))
        cache.ids = [torch.cat([held, t.cpu()]) for held, t in zip(cache.ids, new)]
        logits = torch.zeros(rows, out.logits.shape[-1], dtype=torch.float32, device=input_ids.device)
        logits[placement.rows[last].to(input_ids.device)] = out.logits[0].float()
        comm.all_reduce(logits)  # each row's logits live on the rank holding its last token; the others add 0
        return logits, cache, cp

    def _decode(self, cache: ShardedCache, cp: ContextParallel, tokens: torch.Tensor) -> torch.Tensor:
        """One new token per row (every rank): its logits ``[rows, vocab]`` (float32)."""
        placement = cache.kv.place_decode()
        with hf_common.use(cp), _attending_cache(_Step(cache.kv, None)):
            out = self.model(input_ids=tokens[:, None], position_ids=placement.positions[:, None].to(tokens.device),
                             past_key_values=cache, use_cache=True)
        cache.ids = [torch.cat([held, t.cpu()]) for held, t in zip(cache.ids, tokens[:, None])]
        return out.logits[:, -1].to(dtype=torch.float32)


def generate(model, input_ids: torch.Tensor, cp: ContextParallel, **generate_kwargs):
    """Generate with ``model`` (built with ``attn_implementation="cpattn"``) over ``cp``'s group: every rank
    passes the whole prompt ``input_ids [batch, prompt_len]`` (left-padded with ``attention_mask`` when rows
    differ in length) and gets the whole result, ``[batch, prompt_len + new]`` ids, or with
    ``return_dict_in_generate=True`` transformers' ``GenerateDecoderOnlyOutput`` (``sequences``, ``scores``
    / ``logits`` when asked for, ``past_key_values``: the :class:`ShardedCache`). ``cp`` gives the group,
    schedule and settings of the prefill (its mask must be causal; a ContextParallel of the prompt's
    length is made from it when its ``seq_len`` differs). Keyword arguments: transformers' generation
    options (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``eos_token_id``...,
    ``generation_config``, ``logits_processor``, ``stopping_criteria``); ``past_key_values`` (continue a
    conversation), ``seed`` (sampling), ``merge`` and ``extend`` (the cache's decode merge and multi-turn
    prefill: "auto", the cost model's choice, or a name; see :class:`cpattn.inference.KVCache`).
    Collective: every rank of the group calls it with the same arguments (they agree first, and every
    rank raises the same error otherwise)."""
    return _Generation(model, input_ids, cp, generate_kwargs).run()


__all__ = ["OWN_KWARGS", "ShardedCache", "generate"]
