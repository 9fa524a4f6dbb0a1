"""The flash-attn style entry points, one per registered schedule (``ring_attn_func``, ...,
``ultra_attn_func``): this rank's tokens in, attention out, with a :class:`cpattn.ContextParallel` kept
per (schedule, group, length, mask) behind them."""

from __future__ import annotations

import torch

from . import schedules
from .api import ContextParallel
from .core.comm import Communicator
from .core.masks import Mask, causal, full, sliding_window
from .core.memo import BoundedCache

#: ContextParallel objects of the functional entry points, keyed by value (schedule, the group's global
#: ranks, sequence length, mask), at most :data:`FUNCTIONAL_KEPT`
FUNCTIONAL_KEPT = 32
_CACHE = BoundedCache(FUNCTIONAL_KEPT)


def _functional(schedule_name: str):
    def attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
        if dropout_p:
            raise NotImplementedError(f"dropout_p={dropout_p}: dropout is not supported; pass 0.0")
        if alibi_slopes is not None:
            raise NotImplementedError("alibi_slopes is not supported; pass None")
        mask = _window_mask(bool(causal), window_size)
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise ValueError("q must be a [batch, seq, heads, head_dim] tensor")
        if deterministic and q.device.type != "cpu":
            raise NotImplementedError(f"deterministic=True is guaranteed on the CPU only, not on {q.device.type}: "
                                      "the GPU kernels' backward may accumulate in any order")
        members = Communicator(group, record=False)
        seq_len = q.shape[1] * members.world_size
        ranks = tuple(members.global_rank(r) for r in range(members.world_size))
        key = (schedule_name, ranks, seq_len, mask)
        cp = _CACHE.get(key, lambda: ContextParallel(seq_len, mask=mask, schedule=schedule_name, group=group))
        out, lse = cp.attention(q, k, v, softmax_scale=softmax_scale, return_lse=True)
        return (out, lse, None) if return_attn_probs else out

    attn_func.__name__ = f"{schedule_name}_attn_func"
    attn_func.__doc__ = (f"``{schedule_name}`` context-parallel attention with the flash-attn signature. Inputs are "
                         f"this rank's tokens in the schedule's layout; returns ``out`` or ``(out, lse, None)``. "
                         f"``window_size=(left, right)``: the sliding-window mask (causal or symmetric). "
                         f"``deterministic=True``: bitwise-reproducible results, guaranteed on the CPU "
                         f"(NotImplementedError on other devices).")
    return attn_func


def _window_mask(is_causal: bool, window_size) -> Mask:
    """flash-attn's ``causal`` and ``window_size=(left, right)`` as a mask: query i attends keys
    ``i - left .. i + right`` (-1: unbounded; ``causal`` forces right = 0). Causal windows and symmetric
    ones are supported; other asymmetric windows raise."""
    try:
        left, right = (int(w) for w in window_size)
        if (left, right) != tuple(window_size):
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair of integers (left, right), got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size={window_size!r}: each side is -1 (unbounded) or a number of tokens >= 0")
    if is_causal or right == 0:
        return causal() if left == -1 else sliding_window(left + 1, causal=True)
    if (left, right) == (-1, -1):
        return full()
    if left == right:
        return sliding_window(left + 1, causal=False)
    raise NotImplementedError(f"window_size={(left, right)} with causal=False: only symmetric windows (w, w), "
                              "(w, 0), (-1, 0) and (-1, -1) are supported; for other shapes build a mask "
                              "(cpattn.masks.from_mask_mod) and use ContextParallel")


#: the flash-attn style entry point of every registered schedule: ``ring_attn_func``, ``ultra_attn_func``, ...
ATTN_FUNCS = {f"{name}_attn_func": _functional(name) for name in schedules.names()}
globals().update(ATTN_FUNCS)
