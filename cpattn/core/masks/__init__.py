"""Attention masks over the *global* (query x key) matrix.

A mask answers two questions about any rectangle ``[q0, q1) x [k0, k1)`` of global positions:
``classify`` gives its :class:`BlockKind` without building anything of size S x S, and ``dense``
gives the boolean matrix (True = attend) of one rectangle. Schedules use ``classify`` to skip EMPTY
blocks and pick the fast kernel for FULL and CAUSAL ones; only PARTIAL rectangles are ever densified.

Two independent descriptions back every built-in mask:

- ``mask_mod(q_idx, kv_idx)``, the per-pair definition (FlexAttention convention, broadcasting index
  tensors). ``dense`` evaluates it on the rectangle's grid.
- ``intervals(q, k0, k1)``, the keys each query row attends as a union of a few ``[start, end)``
  intervals (:class:`IntervalMask`; document boundaries by ``searchsorted``, windows and blocks by
  arithmetic). ``classify``, ``count`` and ``row_counts`` sweep these intervals, vectorised over rows
  (in bounded chunks), so a rectangle of n rows costs O(n * intervals per row) and nothing of size
  n x m is built: a 1M-token sequence classifies in milliseconds to a fraction of a second.

Tests check the two against each other on random rectangles, and ``cpattn.exactness`` has a third,
pair-by-pair definition of every kind for its reference. Masks combine with ``a & b`` (pairs both
allow) and ``a | b`` (pairs either allows). ``spec()`` / :func:`from_spec` turn a built-in mask into
JSON-able data and back. :func:`from_mask_mod` wraps any predicate (classified from its dense form,
O(rows x columns)).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import torch

from .base import (
    BAND_MAX_WINDOW,
    BAND_TILE,
    CHUNK_ELEMS,
    MAX_COVER_STEPS,
    WINDOW_TILE,
    BlockKind,
    Piece,
    band,
    triangle,
)
from .base import _kind_of_dense as _kind_of_dense
from .base import _row_chunks as _row_chunks
from .basic import CausalMask, FullMask, SlidingWindowMask
from .custom import MaskModMask
from .documents import DocumentMask, document, from_cu_seqlens
from .mask import AndMask, IntervalMask, Mask, OrMask, _Combination
from .sparse import BlockTableMask, GlobalLocalMask, StarMask, StreamingMask, StridedMask

__all__ = [
    "BAND_MAX_WINDOW", "BAND_TILE", "CHUNK_ELEMS", "KINDS", "MAX_COVER_STEPS", "WINDOW_TILE", "AndMask",
    "BlockKind", "BlockTableMask", "CausalMask", "DocumentMask", "FullMask", "GlobalLocalMask", "IntervalMask",
    "Mask", "MaskModMask", "OrMask", "Piece", "SlidingWindowMask", "StarMask", "StreamingMask", "StridedMask",
    "allowed_pairs", "band", "block_table", "causal", "document", "from_cu_seqlens", "from_mask_mod",
    "from_spec", "full", "global_local", "has_documents", "has_intervals", "resolve", "sliding_window", "star",
    "streaming", "strided", "triangle",
]


def has_intervals(mask: Mask) -> bool:
    """Whether ``mask`` lists the key intervals of each row (``IntervalMask.intervals``): an interval
    mask, or a combination (``&``, ``|``) of two of them; a ``from_mask_mod`` mask anywhere in it does
    not."""
    return isinstance(mask, IntervalMask) and getattr(mask, "_by_intervals", True)


def allowed_pairs(mask: Mask, seq_len: int) -> int:
    """Number of (query, key) pairs that attend over a sequence of ``seq_len`` (no S x S tensor)."""
    return mask.count(0, seq_len, 0, seq_len)


# ---------------------------------------------------------------------------------- constructors
def full() -> Mask:
    """Bidirectional attention: every query attends every key."""
    return FullMask()


def causal() -> Mask:
    """Causal attention over global positions: query i attends key j <= i."""
    return CausalMask()


def sliding_window(window: int, causal: bool = True) -> Mask:
    """See :class:`SlidingWindowMask`: the last ``window`` keys (causal) or ``|q - k| < window``."""
    return SlidingWindowMask(window, causal)


def strided(block_size: int, stride: int, local: int = 1, causal: bool = True) -> Mask:
    """See :class:`StridedMask`: a diagonal band of ``local`` blocks plus a band every ``stride`` blocks."""
    return StridedMask(block_size, stride, local, causal)


def global_local(block_size: int, global_blocks: int = 1, local_blocks: int = 1) -> Mask:
    """See :class:`GlobalLocalMask`: global first rows and columns plus a diagonal band (bidirectional)."""
    return GlobalLocalMask(block_size, global_blocks, local_blocks)


def star(block_size: int, sink: int = 1) -> Mask:
    """See :class:`StarMask`: the first ``sink`` blocks plus the causal diagonal block."""
    return StarMask(sink, 1, block_size)


def streaming(sink: int, window: int, block_size: int = 1) -> Mask:
    """See :class:`StreamingMask`: ``sink`` first blocks plus the last ``window`` blocks, causally."""
    return StreamingMask(sink, window, block_size)


def block_table(table, block_size: int) -> Mask:
    """See :class:`BlockTableMask`: ``table[i][j]`` in {0/"empty", 1/"full", 2/"causal"} per block pair."""
    return BlockTableMask(tuple(tuple(r) for r in table), block_size)


def from_mask_mod(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], name: str = "mask_mod",
                  is_causal: bool = False) -> Mask:
    """Wrap ``fn(q_idx, kv_idx) -> bool tensor`` (broadcasting index tensors) as a :class:`Mask`."""
    return MaskModMask(fn, name=name, is_causal=is_causal)


_KINDS: dict[str, Callable[..., Mask]] = {
    "full": full, "causal": causal, "sliding_window": sliding_window, "document": document,
    "strided": strided, "global_local": global_local, "star": star, "streaming": streaming,
    "block_table": block_table,
}
#: every ``kind`` :func:`from_spec` accepts
KINDS = (*_KINDS, "and", "or")


def from_spec(spec: dict | str) -> Mask:
    """Rebuild a mask from :meth:`Mask.spec` data: ``{"kind": name, **arguments}`` (or just the name of
    a mask without arguments); ``{"kind": "and" | "or", "masks": [spec, spec, ...]}`` combines."""
    if isinstance(spec, str):
        spec = {"kind": spec}
    if not isinstance(spec, dict) or spec.get("kind") not in KINDS:
        got = spec.get("kind") if isinstance(spec, dict) else spec
        raise ValueError(f"mask kind {got!r} is unknown; accepted: {', '.join(KINDS)}")
    args = {k: v for k, v in spec.items() if k != "kind"}
    kind = spec["kind"]
    if kind in ("and", "or"):
        parts = [from_spec(s) for s in args.get("masks", [])]
        if len(parts) < 2 or set(args) != {"masks"}:
            raise ValueError(f"a {kind!r} mask spec needs 'masks': a list of at least two mask specs")
        return functools.reduce(operator.and_ if kind == "and" else operator.or_, parts)
    try:
        return _KINDS[kind](**args)
    except TypeError as exc:
        raise ValueError(f"bad arguments for mask {kind!r}: {exc}") from None


def has_documents(mask: Mask) -> bool:
    """Whether ``mask`` packs documents: a :class:`DocumentMask`, or a combination with one."""
    if isinstance(mask, DocumentMask):
        return True
    return isinstance(mask, _Combination) and (has_documents(mask.a) or has_documents(mask.b))


def resolve(mask: Mask | str | dict) -> Mask:
    """Accept a :class:`Mask`, the strings ``"causal"`` / ``"full"``, or a :func:`from_spec` dict."""
    if isinstance(mask, Mask):
        return mask
    if mask in ("causal", "full") or isinstance(mask, dict):
        return from_spec(mask)
    raise ValueError(f"mask={mask!r} is not a Mask; accepted: a cpattn.masks.Mask, 'causal', 'full' or a "
                     "mask spec dict (cpattn.masks.from_spec)")
