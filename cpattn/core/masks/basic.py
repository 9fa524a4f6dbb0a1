"""Masks that depend on q - k alone: full, causal and sliding-window attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import (
    BAND_MAX_WINDOW,
    MAX_COVER_STEPS,
    WINDOW_TILE,
    BlockKind,
    Piece,
    _check_rect,
    _col,
    _full_in,
    _positive,
    _triangle_in,
    band,
    triangle,
)
from .mask import IntervalMask


@dataclass(frozen=True, repr=False)
class FullMask(IntervalMask):
    name = "full"
    shift_invariant = True

    def classify(self, q0: int, q1: int, k0: int, k1: int) -> BlockKind:
        _check_rect(q0, q1, k0, k1)
        return BlockKind.FULL

    def mask_mod(self, q_idx, kv_idx):
        return torch.ones(torch.broadcast_shapes(q_idx.shape, kv_idx.shape), dtype=torch.bool)

    def intervals(self, q, k0, k1):
        return _col(torch.full_like(q, k0)), _col(torch.full_like(q, k1))


@dataclass(frozen=True, repr=False)
class CausalMask(IntervalMask):
    """Query i attends key j when j <= i (global positions)."""

    name = "causal"
    is_causal = True
    shift_invariant = True

    def classify(self, q0: int, q1: int, k0: int, k1: int) -> BlockKind:
        _check_rect(q0, q1, k0, k1)
        if k1 - 1 <= q0:
            return BlockKind.FULL
        if k0 > q1 - 1:
            return BlockKind.EMPTY
        if q0 == k0 and q1 == k1:
            return BlockKind.CAUSAL
        return BlockKind.PARTIAL

    def mask_mod(self, q_idx, kv_idx):
        return kv_idx <= q_idx

    def cover(self, q0, q1, k0, k1):
        return triangle(q0, q1, k0, k1, 0)

    def intervals(self, q, k0, k1):
        return _col(torch.zeros_like(q)), _col(q + 1)


@dataclass(frozen=True)
class SlidingWindowMask(IntervalMask):
    """Causal: query q attends key k when ``q - window < k <= q`` (``window`` keys, itself included;
    flash-attn's ``window_size=(window - 1, 0)``). Bidirectional: when ``|q - k| < window``
    (``window_size=(window - 1, window - 1)``)."""

    window: int
    causal: bool = True
    name = "sliding_window"
    shift_invariant = True

    def __post_init__(self) -> None:
        _positive("sliding_window window", self.window)

    @property
    def is_causal(self) -> bool:
        return self.causal

    def mask_mod(self, q_idx, kv_idx):
        d = q_idx - kv_idx
        return (d >= 0) & (d < self.window) if self.causal else d.abs() < self.window

    def intervals(self, q, k0, k1):
        end = q + 1 if self.causal else q + self.window
        return _col(q - self.window + 1), _col(end)

    def cover(self, q0, q1, k0, k1):
        """Windows narrower than :data:`BAND_MAX_WINDOW`: band tiles (:func:`band`). Wider ones: row
        tiles ``[a, a + t)`` at multiples of ``t = min(w, WINDOW_TILE)`` for the window ``w``: the
        tile's own keys are one CAUSAL square (FULL when bidirectional), the keys every row of the tile
        sees one FULL rectangle, the far edge (keys ``[a - w + 1, a + t - w)``) one flipped CAUSAL square,
        and bidirectionally the near edge (keys ``[a + w, a + t + w - 1)``) a CAUSAL square shifted by
        ``w - 1``: every pair once, nothing dense."""
        w, rect = self.window, (q0, q1, k0, k1)
        if w < BAND_MAX_WINDOW:
            return band(rect, q0, q1, k0, k1, w - 1, 0 if self.causal else w - 1)
        t = min(w, WINDOW_TILE)
        tiles = range(q0 // t, (q1 - 1) // t + 1)
        if len(tiles) > MAX_COVER_STEPS:
            return None
        out: list[Piece] = []
        for i in tiles:
            a = i * t
            out += _triangle_in(rect, a, a + t, a - w + 1, a + t - w, 1 - w, flip=True)
            if self.causal:
                out += _full_in(rect, a, a + t, a + t - w, a)
                out += _triangle_in(rect, a, a + t, a, a + t, 0)
            else:
                out += _full_in(rect, a, a + t, a + t - w, a + w)
                out += _triangle_in(rect, a, a + t, a + w, a + t + w - 1, w - 1)
        return out
