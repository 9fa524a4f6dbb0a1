"""The Llama-3 style all-gather varlen functions: each rank holds the contiguous slice ``[r S/P, (r+1) S/P)`` of
a packed row of documents of any length (only the total divides by P); cpattn's ``allgather`` schedule on the
contiguous layout, with the packed row's documents as the mask.

``llama3_flash_attn_prepare_cu_seqlens`` returns ring-flash-attn's values for the slice and remembers the
global documents behind them, so the attention calls that pass those values know the whole row without any
communication."""

from __future__ import annotations

from ._calls import llama3_call, prepare


def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, world_size):
    """The global ``cu_seqlens`` (int32 tensor, on any device; it may repeat its last boundary, and padding may
    be merged into the last document) -> ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    local_k_slice)`` for ``rank``: the documents of this rank's query slice, those of the keys it needs
    (``local_k_slice``, global token indices: from the start of the first document the slice meets to the
    slice's end, or when not ``causal`` to the end of the last document it meets), their longest lengths as
    ints. Raises ValueError unless the total is a positive multiple of ``world_size``."""
    return prepare(cu_seqlens, causal, rank, world_size)


def llama3_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                            causal=False, window_size=(-1, -1), alibi_slopes=None,
                                            deterministic=False, return_attn_probs=False, group=None):
    """``qkv [total_local, 3, h, d]``: see :func:`llama3_flash_attn_varlen_func`."""
    return llama3_call(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       heads_k_stride, local_k_slice, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                       deterministic, return_attn_probs, group)


def llama3_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                           causal=False, window_size=(-1, -1), alibi_slopes=None,
                                           deterministic=False, return_attn_probs=False, group=None):
    """``kv [total_local, 2, h_kv, d]``: see :func:`llama3_flash_attn_varlen_func`."""
    return llama3_call(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       heads_k_stride, local_k_slice, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                       deterministic, return_attn_probs, group)


def llama3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                                  local_k_slice, dropout_p=0.0, softmax_scale=None, causal=False,
                                  window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                  return_attn_probs=False, group=None):
    """``q [total_local, h, d]``, ``k, v [total_local, h_kv, d]``: this rank's contiguous slice of the packed row,
    with the values :func:`llama3_flash_attn_prepare_cu_seqlens` returned for it (checked against them) ->
    ``out``, or ``(out, lse [h, total_local], None)`` with ``return_attn_probs``. ``heads_k_stride`` must divide
    the key/value heads; it never changes the result (cpattn gathers all heads at once). Exact, differentiable in
    q, k, v."""
    return llama3_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                       local_k_slice, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                       return_attn_probs, group)
