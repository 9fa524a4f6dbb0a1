"""ring-flash-attn's Hugging Face adapter: a model whose attention implementation is ``"flash_attention_2"``
runs cpattn's ``allgather`` schedule on each rank's contiguous slice of a packed row::

    substitute_hf_flash_attn(process_group, heads_k_stride=1)       # once
    update_ring_flash_attn_params(cu_seqlens, process_group)        # every step: the packed row's global cu_seqlens
    model(input_ids=local_ids, position_ids=local_position_ids)     # this rank's slice [r S/P, (r+1) S/P)

``substitute_hf_flash_attn`` replaces ``transformers.modeling_flash_attention_utils._flash_attention_forward``
(transformers 4.4x to 5.23 signatures) and ``ALL_ATTENTION_FUNCTIONS["flash_attention_2"]``. With the adapter
on, ``attention_mask`` and ``position_ids`` are ignored (the documents come from ``DATA_PARAMS``), as
ring-flash-attn does. transformers imports only when these functions run.

Without the flash-attn package, transformers refuses ``attn_implementation="flash_attention_2"`` when a
model is built or loaded; build it with ``"sdpa"`` (or ``"eager"``) and then set
``model.config._attn_implementation = "flash_attention_2"`` (``docs/compat.md``).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os

import torch
import torch.distributed as dist

from ....core.comm import HeldGroup
from .. import _calls
from ..llama3_flash_attn_varlen import llama3_flash_attn_prepare_cu_seqlens

#: what ``update_ring_flash_attn_params`` prepared for this rank: ``cu_seqlens_q``, ``cu_seqlens_k`` (tensors),
#: ``max_seqlen_q``, ``max_seqlen_k`` (ints), ``local_k_slice`` (a slice of global token indices)
DATA_PARAMS: dict = {}
#: ``use_ring_attn``: whether the substituted attention runs context-parallel (else the function it replaced)
RING_ATTN_SWITCH = True


def check_params(f1, f2) -> bool:
    """Whether ``f1`` and ``f2`` take the same number of parameters (how the adapter picks the signature
    of the transformers version it runs on)."""
    return len(inspect.signature(f1).parameters) == len(inspect.signature(f2).parameters)


def update_ring_flash_attn_params(cu_seqlens: torch.Tensor, process_group: dist.ProcessGroup) -> None:
    """Prepare this step: ``cu_seqlens`` are the packed row's global boundaries (int32, on any device; only
    the total must divide by the group's size); :data:`DATA_PARAMS` gets this rank's values (causal). Without
    torch.distributed, one rank."""
    rank, ranks = _calls.members(process_group)
    values = llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, True, rank, len(ranks))
    DATA_PARAMS.update(zip(("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "local_k_slice"), values))


def use_ring_attn(flag: bool) -> None:
    """Turn the substituted attention on (context-parallel) or off: exact attention of this rank's tensors
    alone, by the function it replaced where the flash-attn package is installed, else by cpattn on a group of
    this process alone, with transformers' meaning of ``attention_mask``, ``cu_seq_lens_q`` and packed
    ``position_ids``."""
    global RING_ATTN_SWITCH
    RING_ATTN_SWITCH = flag


_SELF_GROUP: list = []  # the process group of this process alone, made on first use


def _self_group():
    """A group of this process alone (None without torch.distributed)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    if not _SELF_GROUP:
        _SELF_GROUP.append(dist.new_group([dist.get_rank()], use_local_synchronization=True))
    return _SELF_GROUP[0]


def _runs(flags: list[bool]) -> list[tuple[bool, int]]:
    """``flags`` as (value, length) runs."""
    runs: list[tuple[bool, int]] = []
    for f in flags:
        if runs and runs[-1][0] == f:
            runs[-1] = (f, runs[-1][1] + 1)
        else:
            runs.append((f, 1))
    return runs


def _local_documents(batch: int, seq: int, attention_mask, position_ids, cu_seq_lens_q) -> tuple[list[int], list]:
    """The documents of a local call's rows flattened into one sequence, as transformers reads them (a padding
    mask first, then ``cu_seq_lens_q``, then packed ``position_ids``, else one document per row), and the
    flattened padding flags (padding tokens become one-token documents whose output is zeroed)."""
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (batch, seq):
            raise NotImplementedError(f"attention_mask of shape {tuple(attention_mask.shape)}: a [batch, seq] = "
                                      f"[{batch}, {seq}] padding mask is supported")
        valid = attention_mask.bool().reshape(-1).tolist()
        lengths: list[int] = []
        for row in range(batch):
            runs = _runs(valid[row * seq:(row + 1) * seq])
            if sum(1 for flag, _n in runs if flag) > 1:
                raise NotImplementedError("attention_mask with gaps inside a row: only left or right padding is "
                                          "supported")
            for flag, n in runs:
                lengths += [n] if flag else [1] * n
        return lengths, valid
    if cu_seq_lens_q is not None:
        bounds = cu_seq_lens_q.tolist()
        return [b - a for a, b in zip(bounds, bounds[1:]) if b > a], []
    if position_ids is not None and batch == 1 and seq > 1:
        flat = position_ids.reshape(-1)
        low = flat.min()
        if not torch.equal(flat, torch.arange(seq, device=flat.device) + low):  # packed: positions restart
            starts = [i for i in (flat == low).nonzero().flatten().tolist() if i > 0]
            bounds = [0, *starts, seq]
            return [b - a for a, b in zip(bounds, bounds[1:])], []
    return [seq] * batch, []


def _causal_and_window(is_causal: bool, use_top_left_mask: bool, query_length: int,
                       sliding_window: int | None) -> tuple[bool, tuple[int, int]]:
    """transformers' ``is_causal`` (off for a one-token query under a top-left mask) and ``sliding_window``
    as flash-attn's ``causal`` and ``window_size``: in 5.23 a window of ``sliding_window`` keys, the query's
    own included (flash-attn's left bound sliding_window - 1); it changes nothing where every document is
    shorter, so it applies at any length."""
    causal = is_causal and not (use_top_left_mask and query_length == 1)
    return causal, (-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1)


def _local_forward(query_states, key_states, value_states, attention_mask, query_length: int, is_causal: bool,
                   dropout: float = 0.0, position_ids=None, softmax_scale=None, sliding_window=None,
                   use_top_left_mask: bool = False, softcap=None, deterministic=None, cu_seq_lens_q=None,
                   s_aux=None, **_ignored):
    """Exact attention of this rank's ``[b, s, h, d]`` tensors alone (``use_ring_attn(False)`` without the
    flash-attn package)."""
    batch, seq = query_states.shape[:2]
    if key_states.shape[1] != seq:
        raise NotImplementedError(f"queries ({seq}) and keys ({key_states.shape[1]}) of different lengths (a KV "
                                  "cache): run generation with attn_implementation='sdpa'")
    causal, window = _causal_and_window(is_causal, use_top_left_mask, query_length, sliding_window)
    _calls.refuse_unsupported(dropout, None, False, query_states.device)
    lengths, valid = _local_documents(batch, seq, attention_mask, position_ids, cu_seq_lens_q)

    def settings():
        return "ring", batch * seq, _calls.document_mask(lengths, causal, window), None

    cp = _calls.context_parallel("use_ring_attn(False)", _self_group(), settings)
    flat = [t.reshape(1, batch * seq, *t.shape[2:]) for t in (query_states, key_states, value_states)]
    out = cp.attention(*flat, softmax_scale=softmax_scale, softcap=softcap, sinks=s_aux)
    if valid:
        out = out * torch.tensor(valid, device=out.device).to(out.dtype)[None, :, None, None]
    return out.reshape(batch, seq, *out.shape[2:])


class _GroupOf:
    """The process group of a replacement, held weakly (:class:`cpattn.core.comm.HeldGroup`): transformers keeps
    the replacement for the life of the process, and the group must end when it is destroyed."""

    group = HeldGroup()

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group


def _ring_forward(held: _GroupOf, heads_k_stride: int, schedule, query_states, key_states, value_states,
                  query_length: int, is_causal: bool, dropout: float, softmax_scale, sliding_window,
                  use_top_left_mask: bool, softcap, deterministic, sinks=None):
    """The context-parallel attention every signature below runs: ``[b, s_local, h, d]`` in and out, every
    row of the batch holding the documents of :data:`DATA_PARAMS`; ``schedule`` (else ``$CPATTN_SCHEDULE``,
    else ``allgather``) on the contiguous slices."""
    if not DATA_PARAMS:
        raise RuntimeError("ring attention has no documents for this step: call update_ring_flash_attn_params("
                           "cu_seqlens, process_group) before the model's forward")
    causal, window = _causal_and_window(is_causal, use_top_left_mask, query_length, sliding_window)
    if deterministic is None:
        deterministic = os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
    _calls.refuse_unsupported(dropout, None, deterministic, query_states.device)
    cp = _calls.llama3_object(query_states, key_states, DATA_PARAMS["cu_seqlens_q"], DATA_PARAMS["cu_seqlens_k"],
                              DATA_PARAMS["max_seqlen_q"], DATA_PARAMS["max_seqlen_k"], heads_k_stride,
                              DATA_PARAMS["local_k_slice"], causal, window, held.group, schedule)
    return cp.attention(query_states, key_states, value_states, softmax_scale=softmax_scale, softcap=softcap,
                        sinks=sinks)


def create_ring_flash_attention_forward(process_group: dist.ProcessGroup, heads_k_stride: int,
                                        schedule: str | None = None) -> list:
    """Replacements for ``_flash_attention_forward``, one per transformers signature (before 4.47, 4.47,
    4.48 to 4.52, 4.53 to 4.57, 5.x), each running cpattn on ``process_group``; ``schedule`` as
    :func:`substitute_hf_flash_attn` takes it."""
    run = functools.partial(_ring_forward, _GroupOf(process_group), heads_k_stride, schedule)

    def _flash_attention_forward(query_states, key_states, value_states, attention_mask, query_length, is_causal,
                                 dropout=0.0, position_ids=None, softmax_scale=None, sliding_window=None,
                                 use_top_left_mask=False, softcap=None, deterministic=None):
        return run(query_states, key_states, value_states, query_length, is_causal, dropout, softmax_scale,
                   sliding_window, use_top_left_mask, softcap, deterministic)

    def _flash_attention_forward_v1(query_states, key_states, value_states, attention_mask, query_length, is_causal,
                                    dropout=0.0, position_ids=None, softmax_scale=None, sliding_window=None,
                                    use_top_left_mask=False, softcap=None, deterministic=None, cu_seq_lens_q=None,
                                    cu_seq_lens_k=None, max_length_q=None, max_length_k=None, target_dtype=None):
        return run(query_states, key_states, value_states, query_length, is_causal, dropout, softmax_scale,
                   sliding_window, use_top_left_mask, softcap, deterministic)

    def _flash_attention_forward_v2(query_states, key_states, value_states, attention_mask, query_length, is_causal,
                                    dropout=0.0, position_ids=None, softmax_scale=None, sliding_window=None,
                                    use_top_left_mask=False, softcap=None, deterministic=None, cu_seq_lens_q=None,
                                    cu_seq_lens_k=None, max_length_q=None, max_length_k=None, target_dtype=None,
                                    **kwargs):
        return run(query_states, key_states, value_states, query_length, is_causal, dropout, softmax_scale,
                   sliding_window, use_top_left_mask, softcap, deterministic, kwargs.get("s_aux"))

    def _flash_attention_forward_v3(query_states, key_states, value_states, attention_mask, query_length, is_causal,
                                    dropout=0.0, position_ids=None, softmax_scale=None, sliding_window=None,
                                    use_top_left_mask=False, softcap=None, deterministic=None, cu_seq_lens_q=None,
                                    cu_seq_lens_k=None, max_length_q=None, max_length_k=None, target_dtype=None,
                                    attn_implementation=None, **kwargs):
        return run(query_states, key_states, value_states, query_length, is_causal, dropout, softmax_scale,
                   sliding_window, use_top_left_mask, softcap, deterministic, kwargs.get("s_aux"))

    def _flash_attention_forward_v4(query_states, key_states, value_states, attention_mask, query_length, is_causal,
                                    dropout=0.0, position_ids=None, softmax_scale=None, sliding_window=None,
                                    use_top_left_mask=False, softcap=None, deterministic=None, cu_seq_lens_q=None,
                                    cu_seq_lens_k=None, max_length_q=None, max_length_k=None, target_dtype=None,
                                    attn_implementation=None, block_table=None, k_cache=None, v_cache=None,
                                    **kwargs):
        if block_table is not None or k_cache is not None:
            raise NotImplementedError("ring attention does not run transformers' paged KV cache (block_table, "
                                      "k_cache, v_cache); generate without context parallelism")
        return run(query_states, key_states, value_states, query_length, is_causal, dropout, softmax_scale,
                   sliding_window, use_top_left_mask, softcap, deterministic, kwargs.get("s_aux"))

    return [_flash_attention_forward, _flash_attention_forward_v1, _flash_attention_forward_v2,
            _flash_attention_forward_v3, _flash_attention_forward_v4]


def flash_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            sliding_window: int | None = None, softcap: float | None = None, **kwargs
                            ) -> tuple[torch.Tensor, None]:
    """``ALL_ATTENTION_FUNCTIONS["flash_attention_2"]``: ``query [b, h, s, d]``, ``key, value [b, h_kv, s, d]``
    (a model's layout) -> ``(out [b, s, h, d], None)`` through ``_flash_attention_forward``, looked up in
    ``transformers.modeling_flash_attention_utils`` at every call (so a framework's own wrapper of it runs)."""
    import transformers.modeling_flash_attention_utils as fa_utils

    seq_len = query.shape[2]
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    target_dtype = None  # as transformers: float32 activations (PEFT's float32 norms) go back to the weights' dtype
    if query.dtype == torch.float32:
        if torch.is_autocast_enabled(query.device.type):
            target_dtype = torch.get_autocast_dtype(query.device.type)
        elif hasattr(module.config, "_is_quantized"):
            target_dtype = module.config.dtype
        else:
            target_dtype = next(m for m in module.modules() if isinstance(m, torch.nn.Linear)).weight.dtype
    is_causal = kwargs.pop("is_causal", None)
    is_causal = module.is_causal if is_causal is None else is_causal
    original_dtype = query.dtype
    if target_dtype is not None:
        query, key, value = (t.to(target_dtype) for t in (query, key, value))
    out = fa_utils._flash_attention_forward(query, key, value, attention_mask, query_length=seq_len,
                                            is_causal=is_causal, dropout=dropout, softmax_scale=scaling,
                                            sliding_window=sliding_window, softcap=softcap, use_top_left_mask=False,
                                            target_dtype=target_dtype, **kwargs)
    return out.to(original_dtype), None


def substitute_hf_flash_attn(process_group: dist.ProcessGroup, heads_k_stride: int,
                             schedule: str | None = None) -> None:
    """Make transformers' flash-attention path context-parallel over ``process_group``: replaces
    ``transformers.modeling_flash_attention_utils._flash_attention_forward`` with the function of
    :func:`create_ring_flash_attention_forward` that matches its signature (the replaced one still runs
    when :func:`use_ring_attn` is off) and ``ALL_ATTENTION_FUNCTIONS["flash_attention_2"]`` with
    :func:`flash_attention_forward`. ``heads_k_stride`` must divide the model's key/value heads.

    ``schedule`` (cpattn's extension; None: ``$CPATTN_SCHEDULE``, else ``allgather``): the schedule behind the
    attention, a name, a schedule object or ``"auto"`` (the cost model's choice among the schedules that run
    on each rank's contiguous slice); one that needs another layout raises ``ValueError`` at the first call."""
    import transformers
    import transformers.modeling_flash_attention_utils as fa_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    old = fa_utils._flash_attention_forward
    new = next((f for f in create_ring_flash_attention_forward(process_group, heads_k_stride, schedule)
                if check_params(old, f)), None)
    if new is None:
        raise ValueError(f"transformers {transformers.__version__}: its _flash_attention_forward takes "
                         f"{len(inspect.signature(old).parameters)} parameters, which no signature of this adapter "
                         "matches (transformers 4.4x to 5.23 are supported)")

    local = old if importlib.util.find_spec("flash_attn") is not None else None

    @functools.wraps(new)  # its signature is new's, so code that checks it (check_params) sees transformers'
    def switched(*args, **kwargs):
        if RING_ATTN_SWITCH:
            return new(*args, **kwargs)
        if local is not None:
            return local(*args, **kwargs)
        bound = inspect.signature(new).bind(*args, **kwargs).arguments
        extra = bound.pop("kwargs", {})
        return _local_forward(**bound, **extra)

    fa_utils._flash_attention_forward = switched
    ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = flash_attention_forward
