"""``stripe_flash_attn_func`` and its packed forms: cpattn's ``stripe_ring`` schedule on the striped layout (token t
lives on rank t mod P), ``[b, s_local, h, d]`` in and out."""

from __future__ import annotations

from ...functional import ATTN_FUNCS

_stripe = ATTN_FUNCS["stripe_ring_attn_func"]


def stripe_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
        window_size=(-1, -1), alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """``qkv [b, s_local, 3, h, d]``: see :func:`stripe_flash_attn_func`."""
    return _stripe(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, deterministic, return_attn_probs, group)


def stripe_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
        window_size=(-1, -1), alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """``kv [b, s_local, 2, h_kv, d]``: see :func:`stripe_flash_attn_func`."""
    return _stripe(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   deterministic, return_attn_probs, group)


def stripe_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
        window_size=(-1, -1), alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """``q [b, s_local, h, d]``, ``k, v [b, s_local, h_kv, d]`` (this rank's stripe) -> ``out``, or
    ``(out, lse [b, h, s_local], None)`` with ``return_attn_probs``. Exact, differentiable in q, k, v."""
    return _stripe(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                   return_attn_probs, group)
