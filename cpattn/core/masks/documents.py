"""Packed variable-length documents: :class:`DocumentMask` and its constructors."""

from __future__ import annotations

import operator
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from .base import MAX_COVER_STEPS, BlockKind, _check_rect, _col, _full_in, _positive, _triangle_in
from .mask import IntervalMask, Mask


@dataclass(frozen=True, repr=False)
class DocumentMask(IntervalMask):
    """Packed variable-length documents: ``lengths[i]`` consecutive tokens form document i; a query
    attends only keys of its own document (and, when ``causal``, only keys at or before it). The
    lengths must sum to the sequence length. Lookups are ``searchsorted`` over the document ends, so
    any number of documents costs O(log D) per row."""

    lengths: tuple[int, ...]
    causal: bool = True
    name = "document"
    _ends: torch.Tensor = field(init=False, repr=False, compare=False)
    _end_list: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lengths = tuple(self.lengths)
        if not lengths:
            raise ValueError("document lengths must not be empty")
        for n in lengths:
            _positive("every document length", n)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "_ends", torch.tensor(lengths, dtype=torch.long).cumsum(0))
        object.__setattr__(self, "_end_list", tuple(accumulate(lengths)))

    @property
    def is_causal(self) -> bool:
        return self.causal

    @property
    def total(self) -> int:
        return int(self._ends[-1])

    def _doc(self, idx: torch.Tensor) -> torch.Tensor:
        """Document index of each position (``len(lengths)`` past the last document)."""
        return torch.searchsorted(self._ends, idx, right=True)

    def mask_mod(self, q_idx, kv_idx):
        same = (self._doc(q_idx) == self._doc(kv_idx)) & (q_idx < self.total)
        return same & (kv_idx <= q_idx) if self.causal else same

    def intervals(self, q, k0, k1):
        d = self._doc(q)
        inside = q < self.total
        ends = torch.cat([self._ends, self._ends[-1:]])
        start = torch.where(d > 0, ends[(d - 1).clamp(min=0)], 0)
        end = q + 1 if self.causal else ends[d]
        return _col(torch.where(inside, start, 0)), _col(torch.where(inside, end, 0))

    def classify(self, q0: int, q1: int, k0: int, k1: int) -> BlockKind:
        """A rectangle whose rows and keys lie in different documents is EMPTY, one inside a single document
        is decided by its corners (O(log D): explicit per-document layouts classify thousands of rectangles
        per new mask); any other goes through the interval sweep."""
        _check_rect(q0, q1, k0, k1)
        ends = self._end_list
        if q1 <= ends[-1] and k1 <= ends[-1]:
            first_q, last_q = bisect_right(ends, q0), bisect_right(ends, q1 - 1)
            first_k, last_k = bisect_right(ends, k0), bisect_right(ends, k1 - 1)
            if last_q < first_k or last_k < first_q:
                return BlockKind.EMPTY
            if first_q == last_q == first_k == last_k:
                if not self.causal or k1 - 1 <= q0:
                    return BlockKind.FULL
                if k0 > q1 - 1:
                    return BlockKind.EMPTY
                return BlockKind.CAUSAL if (q0, q1) == (k0, k1) else BlockKind.PARTIAL
        return self._classify_intervals(q0, q1, k0, k1)

    def cover(self, q0, q1, k0, k1):
        """Per document meeting both ranges: its rows x its keys, FULL (bidirectional) or the causal
        triangle (one CAUSAL square on the diagonal plus FULL rectangles where the ranges differ). Tiny
        documents stay squares: stacked by length they run faster than band tiles (docs/masks_speed.md)."""
        ends = self._end_list
        first = max(bisect_right(ends, q0), bisect_right(ends, k0))
        last = min(bisect_right(ends, q1 - 1), bisect_right(ends, k1 - 1), len(ends) - 1)
        if last - first >= MAX_COVER_STEPS:
            return None
        rect, out = (q0, q1, k0, k1), []
        for d in range(first, last + 1):
            a, b = (ends[d - 1] if d else 0), ends[d]
            out += _triangle_in(rect, a, b, a, b, 0) if self.causal else _full_in(rect, a, b, a, b)
        return out

    def check_seq_len(self, seq_len: int) -> None:
        if self.total != seq_len:
            raise ValueError(f"document lengths sum to {self.total}, but seq_len is {seq_len}; "
                             "they must be equal")

    def spec(self) -> dict:
        return {"kind": "document", "lengths": list(self.lengths), "causal": self.causal}

    def __repr__(self) -> str:
        return f"DocumentMask({len(self.lengths)} documents, total={self.total}, causal={self.causal})"


def document(lengths: Sequence[int], causal: bool = True) -> Mask:
    """See :class:`DocumentMask`: packed documents of ``lengths`` tokens attend only inside themselves."""
    return DocumentMask(tuple(operator.index(n) for n in lengths), causal)


def from_cu_seqlens(cu_seqlens, causal: bool = True) -> Mask:
    """The :func:`document` mask of packed documents given by their cumulative boundaries ``cu_seqlens``
    (flash-attn's varlen convention: ``[0, l0, l0 + l1, ..., total]``, a list or a 1-D integer tensor,
    read on the host once). Several rows of a batch, each packed, are one packed sequence: concatenate
    their documents (rows flattened into the sequence, so no document crosses a row)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} of shape "
                             f"{tuple(cu_seqlens.shape)}")
        bounds = cu_seqlens.tolist()
    else:
        bounds = [operator.index(b) for b in cu_seqlens]
    if len(bounds) < 2 or bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and hold at least one document, got {bounds[:8]}")
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    if any(n <= 0 for n in lengths):
        raise ValueError("cu_seqlens must be strictly increasing (every document at least one token), got "
                         f"{bounds[:8]}{'...' if len(bounds) > 8 else ''}")
    return document(lengths, causal)
