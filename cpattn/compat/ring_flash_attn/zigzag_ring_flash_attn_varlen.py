"""``zigzag_ring_flash_attn_varlen_func`` and its packed forms: packed ``[total_local, h, d]`` tensors whose
documents (``cu_seqlens``, local: the global ones divided by P, every local length even) are each split into 2P
equal chunks, rank r holding chunks r and 2P-1-r of every document; cpattn's ``zigzag_ring`` schedule on that
layout, as an explicit layout."""

from __future__ import annotations

from ._calls import varlen_call


def zigzag_ring_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                                 causal=False, window_size=(-1, -1), alibi_slopes=None,
                                                 deterministic=False, return_attn_probs=False, group=None):
    """``qkv [total_local, 3, h, d]``: see :func:`zigzag_ring_flash_attn_varlen_func`."""
    return varlen_call(True, qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, max_seqlen, dropout_p, softmax_scale,
                       causal, window_size, alibi_slopes, deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                                causal=False, window_size=(-1, -1), alibi_slopes=None,
                                                deterministic=False, return_attn_probs=False, group=None):
    """``kv [total_local, 2, h_kv, d]``: see :func:`zigzag_ring_flash_attn_varlen_func`."""
    return varlen_call(True, q, kv[:, 0], kv[:, 1], cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                       window_size, alibi_slopes, deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                       causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                       return_attn_probs=False, group=None):
    """``q [total_local, h, d]``, ``k, v [total_local, h_kv, d]`` with the local ``cu_seqlens`` (int32, the same on
    every rank, every document of even length) -> ``out``, or ``(out, lse [h, total_local], None)`` with
    ``return_attn_probs``. ``max_seqlen`` is not needed (accepted for the signature). Exact, differentiable in
    q, k, v."""
    return varlen_call(True, q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                       alibi_slopes, deterministic, return_attn_probs, group)
