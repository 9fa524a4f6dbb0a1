"""The flash-attn style entry points, one per registered schedule (``ring_attn_func``, ...,
``ultra_attn_func``): this rank's tokens in, attention out, with a :class:`cpattn.ContextParallel` kept
per (schedule, group, length, mask) behind them.

Their errors speak the entry point's terms: its own name, the arguments as the user passed them (``q``,
``k``, ``v`` as this rank's ``[batch, seq, heads, head_dim]`` tokens, never the global length derived from
them), the schedule layout's rule for the local length, and a ``[batch, heads, seq, head_dim]`` tensor named
as such. The first call with each signature (shapes, dtypes, scale) checks the inputs and agrees on them
with the other ranks (one small exchange), so every rank raises the same error, e.g. when the ranks hold
different local lengths."""

from __future__ import annotations

import contextlib

import torch

from . import agree, schedules
from .api import ContextParallel, _exchange_device
from .core.comm import Communicator
from .core.layout import Layout
from .core.masks import Mask, causal, full, sliding_window
from .core.memo import BoundedCache

#: ContextParallel objects of the functional entry points, keyed by value (schedule, the group's global
#: ranks, sequence length, mask), at most :data:`FUNCTIONAL_KEPT`
FUNCTIONAL_KEPT = 32
_CACHE = BoundedCache(FUNCTIONAL_KEPT)
#: the call signatures already checked and agreed on (the first call with each), at most 4 x FUNCTIONAL_KEPT
_CHECKED = BoundedCache(4 * FUNCTIONAL_KEPT)


def _functional(schedule_name: str):
    name = f"{schedule_name}_attn_func"

    def attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
        refuse_dropout_and_alibi(dropout_p, alibi_slopes, f"{name}: ")
        try:
            mask = _window_mask(bool(causal), window_size)
        except (ValueError, NotImplementedError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
        _check_tensors(name, q, k, v)
        refuse_nondeterministic_device(deterministic, q.device, f"{name}: ")
        # while torch.compile traces the call (which cannot trace a ContextVar) errors name ContextParallel
        naming = agree.entry_point(name) if not torch.compiler.is_compiling() else contextlib.nullcontext()
        with naming:
            members = Communicator(group, record=False)
            local = q.shape[1]
            seq_len = local * members.world_size
            ranks = tuple(members.global_rank(r) for r in range(members.world_size))
            key = (schedule_name, ranks, seq_len, mask)
            signature = (key, agree.signature_key(q, k, v, softmax_scale))
            if signature not in _CHECKED:
                _check_and_agree(name, schedule_name, mask, members, q, k, v)
                _CHECKED.put(signature, True)
            cp = _CACHE.get(key, lambda: ContextParallel(seq_len, mask=mask, schedule=schedule_name, group=group))
            if cp.local_len != local:  # a schedule that lays out (and pads) the sequence its own way
                raise ValueError(f"{name}: q holds {local} tokens at dim 1; schedule {schedule_name!r} lays out "
                                 f"{cp.local_len} per rank for this length over {members.world_size} ranks: use "
                                 f"ContextParallel(seq_len=..., schedule={schedule_name!r}), whose shard() pads")
            out, lse = cp.attention(q, k, v, softmax_scale=softmax_scale, return_lse=True)
        return (out, lse, None) if return_attn_probs else out

    attn_func.__name__ = name
    attn_func.__doc__ = (f"``{schedule_name}`` context-parallel attention with the flash-attn signature. Inputs are "
                         f"this rank's tokens in the schedule's layout; returns ``out`` or ``(out, lse, None)``. "
                         f"``window_size=(left, right)``: the sliding-window mask (causal or symmetric). "
                         f"``deterministic=True``: bitwise-reproducible results, guaranteed on the CPU "
                         f"(NotImplementedError on other devices).")
    return attn_func


def refuse_dropout_and_alibi(dropout_p, alibi_slopes, prefix: str = "") -> None:
    """flash-attn's arguments cpattn refuses rather than ignores: dropout > 0 and ALiBi slopes (``prefix``
    opens the message, e.g. the entry point's name)."""
    if dropout_p:
        raise NotImplementedError(f"{prefix}dropout_p={dropout_p}: dropout is not supported; pass 0.0")
    if alibi_slopes is not None:
        raise NotImplementedError(f"{prefix}alibi_slopes is not supported; pass None")


def refuse_nondeterministic_device(deterministic, device: torch.device, prefix: str = "") -> None:
    """``deterministic=True`` is guaranteed on the CPU only."""
    if deterministic and device.type != "cpu":
        raise NotImplementedError(f"{prefix}deterministic=True is guaranteed on the CPU only, not on {device.type}: "
                                  "the GPU kernels' backward may accumulate in any order")


_LAYOUT_HINT = ("pass q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2) (out comes back as [batch, seq, "
                "heads, head_dim]), or call ContextParallel.attention(..., qkv_format='bhsd'), which takes them as "
                "they are")


def _check_tensors(name: str, q, k, v) -> None:
    """q, k, v are 4-D tensors (the same on every rank for the same call: no exchange needed)."""
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: {arg} must be this rank's tokens as [batch, seq, heads, head_dim], got "
                             f"shape {tuple(t.shape)}")


def _local_rule(name: str, schedule_name: str, mask: Mask, local: int, world: int) -> None:
    """This rank's ``local`` tokens fit the schedule's layout: a zigzag layout holds two chunks per rank,
    so an even number."""
    try:
        layout = Layout(schedules.get(schedule_name).layout_for(mask))
    except ValueError:
        return  # a layout of the schedule's own making: ContextParallel checks it
    per_rank = layout.multiple(world) // world
    if local % per_rank == 0:
        return
    if layout.name == "zigzag":
        why = (f"needs an even local length: the zigzag layout cuts the sequence into 2 x world_size = "
               f"{2 * world} chunks and each rank holds two of them (chunks r and {2 * world - 1} - r)")
    else:
        why = f"needs a local length that is a multiple of {per_rank} (the {layout.name} layout)"
    raise ValueError(f"{name} {why}, but q holds {local} tokens at dim 1. Pad the sequence to a multiple of "
                     f"{per_rank * world} tokens, or use ContextParallel(seq_len=..., schedule={schedule_name!r}), "
                     "whose shard() pads with tokens that are masked out")


def _check_local(name: str, schedule_name: str, mask: Mask, q, k, v, world: int) -> None:
    """This rank's inputs, in the entry point's terms: q, k, v hold the same local length, which fits the
    schedule's layout; a [batch, heads, seq, head_dim] tensor is named as such."""
    local = q.shape[1]
    for arg, t in (("k", k), ("v", v)):
        if t.shape[1] != local:
            message = (f"{name}: q holds {local} tokens at dim 1 but {arg} holds {t.shape[1]} (q {tuple(q.shape)}, "
                       f"{arg} {tuple(t.shape)}): q, k, v are this rank's tokens as [batch, seq, heads, head_dim], "
                       "each with the same local length")
            if t.shape[2] == q.shape[2] and t.shape[1] >= 1 and local % t.shape[1] == 0:
                message += f"; they look like [batch, heads, seq, head_dim]: {_LAYOUT_HINT}"
            raise ValueError(message)
    _local_rule(name, schedule_name, mask, local, world)


def _check_and_agree(name: str, schedule_name: str, mask: Mask, members: Communicator, q, k, v) -> None:
    """:func:`_check_local` on this rank, then one exchange: every rank raises the same error when any
    rank's inputs fail, or when the ranks hold different local lengths."""
    error = None
    try:
        _check_local(name, schedule_name, mask, q, k, v, members.world_size)
    except Exception as exc:  # reaches every rank (agree)
        error = exc
    try:
        agree.agree(members, name, {"local length": str(q.shape[1])}, error, _exchange_device(members))
    except agree.RanksDisagreeError as exc:
        if "local length" not in exc.differing:
            raise
        held = agree.holders_text(exc.differing["local length"])
        raise agree.RanksDisagreeError(
            f"{name}: ranks hold different local lengths at dim 1 of q ({held}): every rank passes the same "
            "number of tokens, its part of the sequence in the schedule's layout",
            exc.differing) from None


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
