"""Attention masks over the *global* (query x key) matrix.

A mask answers two questions about any rectangle ``[q0, q1) x [k0, k1)`` of global positions:
``classify`` gives its :class:`BlockKind` without building anything of size S x S, and ``dense``
gives the boolean matrix (True = attend) of one rectangle. Schedules use ``classify`` to skip EMPTY
blocks and pick the fast kernel for FULL and CAUSAL ones; only PARTIAL rectangles are ever densified.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch


class BlockKind(enum.Enum):
    """What a rectangle of the attention matrix looks like."""

    EMPTY = "empty"  # no (q, k) pair attends
    FULL = "full"  # every pair attends
    CAUSAL = "causal"  # square, on the diagonal: local row i attends local columns <= i
    PARTIAL = "partial"  # anything else: needs the dense mask


def _check_rect(q0: int, q1: int, k0: int, k1: int) -> None:
    if not (0 <= q0 < q1 and 0 <= k0 < k1):
        raise ValueError(f"empty or negative rectangle q=[{q0},{q1}) k=[{k0},{k1})")


def _kind_of_dense(allowed: torch.Tensor) -> BlockKind:
    """Classify an explicit boolean rectangle (used by masks that only know their dense form)."""
    if not bool(allowed.any()):
        return BlockKind.EMPTY
    if bool(allowed.all()):
        return BlockKind.FULL
    n, m = allowed.shape
    if n == m and torch.equal(allowed, torch.ones(n, n, dtype=torch.bool, device=allowed.device).tril()):
        return BlockKind.CAUSAL
    return BlockKind.PARTIAL


class Mask:
    """Base class. Subclasses implement ``classify`` and ``dense``; ``name`` identifies the mask."""

    name: str = "mask"
    #: True when query i never attends a key j > i (lets causal-only schedules accept the mask)
    is_causal: bool = False

    def classify(self, q0: int, q1: int, k0: int, k1: int) -> BlockKind:
        raise NotImplementedError

    def dense(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """Boolean ``[q1 - q0, k1 - k0]``; True where query attends key."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@dataclass(frozen=True, repr=False)
class FullMask(Mask):
    name = "full"
    is_causal = False

    def classify(self, q0: int, q1: int, k0: int, k1: int) -> BlockKind:
        _check_rect(q0, q1, k0, k1)
        return BlockKind.FULL

    def dense(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        _check_rect(q0, q1, k0, k1)
        return torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)


@dataclass(frozen=True, repr=False)
class CausalMask(Mask):
    """Query i attends key j when j <= i (global positions)."""

    name = "causal"
    is_causal = True

    def classify(self, q0: int, q1: int, k0: int, k1: int) -> BlockKind:
        _check_rect(q0, q1, k0, k1)
        if k1 - 1 <= q0:
            return BlockKind.FULL
        if k0 > q1 - 1:
            return BlockKind.EMPTY
        if q0 == k0 and q1 == k1:
            return BlockKind.CAUSAL
        return BlockKind.PARTIAL

    def dense(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        _check_rect(q0, q1, k0, k1)
        qi = torch.arange(q0, q1).unsqueeze(1)
        ki = torch.arange(k0, k1).unsqueeze(0)
        return ki <= qi


class MaskModMask(Mask):
    """A mask given by ``fn(q_idx, kv_idx) -> bool tensor`` (FlexAttention convention).

    Classification evaluates ``fn`` on the rectangle only, in row chunks, so memory stays bounded by
    ``chunk_rows * (k1 - k0)`` booleans.
    """

    chunk_rows = 1024

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], name: str = "mask_mod",
                 is_causal: bool = False) -> None:
        if not callable(fn):
            raise TypeError(f"from_mask_mod expects a callable fn(q_idx, kv_idx), got {type(fn).__name__}")
        self.fn = fn
        self.name = name
        self.is_causal = is_causal

    def dense(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        _check_rect(q0, q1, k0, k1)
        out = self.fn(torch.arange(q0, q1).unsqueeze(1), torch.arange(k0, k1).unsqueeze(0))
        out = torch.as_tensor(out, dtype=torch.bool)
        return out.expand(q1 - q0, k1 - k0).contiguous()

    def classify(self, q0: int, q1: int, k0: int, k1: int) -> BlockKind:
        _check_rect(q0, q1, k0, k1)
        any_true, all_true = False, True
        causal_ok = (q1 - q0) == (k1 - k0) and q0 == k0
        for r0 in range(q0, q1, self.chunk_rows):
            r1 = min(q1, r0 + self.chunk_rows)
            part = self.dense(r0, r1, k0, k1)
            any_true = any_true or bool(part.any())
            all_true = all_true and bool(part.all())
            if causal_ok:
                qi = torch.arange(r0, r1).unsqueeze(1)
                ki = torch.arange(k0, k1).unsqueeze(0)
                causal_ok = torch.equal(part, ki <= qi)
        if not any_true:
            return BlockKind.EMPTY
        if all_true:
            return BlockKind.FULL
        return BlockKind.CAUSAL if causal_ok else BlockKind.PARTIAL

    def __repr__(self) -> str:
        return f"MaskModMask(name={self.name!r})"


def allowed_pairs(mask: Mask, seq_len: int, chunk: int = 1024) -> int:
    """Number of (query, key) pairs that attend, summed rectangle by rectangle (no S x S tensor)."""
    total = 0
    for q0 in range(0, seq_len, chunk):
        q1 = min(seq_len, q0 + chunk)
        for k0 in range(0, seq_len, chunk):
            k1 = min(seq_len, k0 + chunk)
            kind = mask.classify(q0, q1, k0, k1)
            if kind == BlockKind.FULL:
                total += (q1 - q0) * (k1 - k0)
            elif kind == BlockKind.CAUSAL:
                total += (q1 - q0) * (q1 - q0 + 1) // 2
            elif kind == BlockKind.PARTIAL:
                total += int(mask.dense(q0, q1, k0, k1).sum())
    return total


def full() -> Mask:
    """Bidirectional attention: every query attends every key."""
    return FullMask()


def causal() -> Mask:
    """Causal attention over global positions: query i attends key j <= i."""
    return CausalMask()


def from_mask_mod(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], name: str = "mask_mod",
                  is_causal: bool = False) -> Mask:
    """Wrap ``fn(q_idx, kv_idx) -> bool tensor`` (broadcasting index tensors) as a :class:`Mask`."""
    return MaskModMask(fn, name=name, is_causal=is_causal)


def resolve(mask: Mask | str) -> Mask:
    """Accept a :class:`Mask` or the strings ``"causal"`` / ``"full"``."""
    if isinstance(mask, Mask):
        return mask
    if mask == "causal":
        return causal()
    if mask == "full":
        return full()
    raise ValueError(f"mask={mask!r} is not a Mask; accepted: a cpattn.masks.Mask, 'causal' or 'full'")
