"""Striped ring attention: the ring of ``ring.py`` on the striped layout (token t on rank t mod P).

Under a causal mask, queries of rank r attend the keys of rank j <= r as a causal block and those of
rank j > r as a causal block shifted by one (local query i sees local keys < i), so every step is
balanced. ``cpattn.core.blocks.striped`` states that rule for the causal and full masks.

Every other mask runs too (:func:`striped_blocks`). A rank's tokens are not contiguous in global
positions, so its blocks are found by tiling the local (query, key) square: local rows ``[a, b)`` of
any rank lie inside the global span ``[a P, b P)``, so the mask's kind on the spans of a tile bounds
the tile. EMPTY tiles are skipped, FULL ones run the full kernel; a CAUSAL span (the mask equals the
causal one there, e.g. inside one long document) gives the striped causal rule on the tile; PARTIAL
tiles are halved down to ``PARTIAL_TILE`` local rows and then run the masked kernel on the tile's
dense mask, evaluated at the tokens' own positions. A window or many short documents therefore cost a
dense mask per tile near the diagonal: the striped layout balances causal work, not local masks.

Block-sparse masks (:data:`BLOCK_MASKS`: one kind per cell of ``block_size`` tokens) whose blocks
split evenly over the ranks are tiled by their cells instead: the ``block_size / P`` local rows of a
rank that fall in one block form one tile, whose kind is the cell's (the same for every rank pair,
classified once per mask), and a row of consecutive FULL cells is one kernel. So no tile straddles
two cells and nothing runs densely unless a cell itself is PARTIAL.
"""

from __future__ import annotations

import torch

from ..core import blocks, memo
from ..core.blocks import PARTIAL_TILE, Block
from ..core.layout import Layout
from ..core.masks import (
    BlockKind,
    BlockTableMask,
    CausalMask,
    FullMask,
    GlobalLocalMask,
    Mask,
    StreamingMask,
    StridedMask,
    has_intervals,
)
from ..core.pairs import PairWork
from ..core.steps import Kernel, Problem, Work, work
from .base import Runtime
from .ring import RingSchedule

STRIPED = Layout("striped")
#: masks with one kind per cell of ``block_size`` x ``block_size`` tokens (CAUSAL on the diagonal when causal)
BLOCK_MASKS = (StreamingMask, GlobalLocalMask, StridedMask, BlockTableMask)
#: fewest local rows per cell for the cell tiling (below it, halving into bigger dense tiles is cheaper)
MIN_CELL_ROWS = 32


def _cell_kinds(mask: Mask, block: int, cells: int) -> tuple[tuple[BlockKind, ...], ...]:
    """The kind of every ``block x block`` cell, kept in the active ``cpattn.core.memo`` scope."""
    return memo.cached(("stripe cell kinds", mask, block, cells), lambda: tuple(
        tuple(mask.classify(qb * block, (qb + 1) * block, kb * block, (kb + 1) * block) for kb in range(cells))
        for qb in range(cells)))


def striped_blocks(mask: Mask, seq_len: int, world: int, q_rank: int, kv_rank: int, valid_len: int | None = None,
                   tile: int = PARTIAL_TILE, spans: dict | None = None, dense: bool = True) -> list[Block]:
    """Blocks of ``q_rank``'s queries against ``kv_rank``'s keys on the striped layout, where local row i
    of rank r is global position ``i P + r``. ``seq_len``: the (padded) length the layout splits;
    positions ``>= valid_len`` are padding and never covered. ``spans``: a dict that keeps the
    classification of global spans across calls for the same (mask, seq_len, world, valid_len); the
    spans do not depend on the ranks, so classifying every rank pair asks the same ones P^2 times.
    ``dense=False``: PARTIAL blocks carry their pair count instead of their mask (shapes to price),
    counted from the mask's key intervals when it has one per row."""
    if isinstance(mask, CausalMask | FullMask):
        return blocks.for_ranks(mask, STRIPED, seq_len, world, q_rank, [kv_rank], valid_len)
    p = world
    valid = seq_len if valid_len is None else valid_len
    out: list[Block] = []

    def leaf(a: int, b: int, c: int, d: int) -> None:
        """A tile of local rows [a, b) x local columns [c, d) that is not split further: FULL, PARTIAL
        (its mask, or only its pair count when not ``dense``) or nothing. Without ``dense``, a mask with
        one key interval [lo, hi) per row counts the local columns j with lo <= j P + kv_rank < hi,
        j in [ceil((lo - kv_rank) / P), ceil((hi - kv_rank) / P)), instead of building the tile."""
        k0, k1 = c * p + kv_rank, (d - 1) * p + kv_rank + 1
        qp = torch.arange(a, b) * p + q_rank
        allowed = None
        if not dense and has_intervals(mask) and mask.width(k0, k1) == 1:
            lo, hi = (t[:, 0] for t in mask.intervals(qp, k0, k1))
            first = -torch.div(kv_rank - lo, p, rounding_mode="floor")
            stop = -torch.div(kv_rank - hi, p, rounding_mode="floor")
            pairs = int((stop.clamp(max=d) - first.clamp(min=c)).clamp(min=0).sum())
        else:
            kp = torch.arange(c, d) * p + kv_rank
            allowed = torch.as_tensor(mask.mask_mod(qp[:, None], kp[None, :]), dtype=torch.bool).expand(b - a, d - c)
            pairs = int(allowed.sum())
        if pairs == (b - a) * (d - c):
            out.append(Block(slice(a, b), slice(c, d), BlockKind.FULL))
        elif pairs and dense:
            out.append(Block(slice(a, b), slice(c, d), BlockKind.PARTIAL, allowed.contiguous()))
        elif pairs:
            out.append(Block(slice(a, b), slice(c, d), BlockKind.PARTIAL, pairs=pairs))

    def causal(a: int, b: int, c: int, d: int) -> None:
        """A square tile whose global span is causal: global key k - c P <= query q - a P means local key
        <= local query when kv_rank <= q_rank, strictly below it otherwise (relative to the tile)."""
        if kv_rank <= q_rank:
            out.append(Block(slice(a, b), slice(c, d), BlockKind.CAUSAL))
        elif b - a > 1:
            out.append(Block(slice(a + 1, b), slice(c, d - 1), BlockKind.CAUSAL))

    def split(a: int, b: int, c: int, d: int) -> None:
        """Local rows [a, b) x local columns [c, d), inside the real tokens of both ranks."""
        span = (a * p, min(b * p, valid), c * p, min(d * p, valid))
        if spans is None:
            kind = mask.classify(*span)
        elif (kind := spans.get(span)) is None:
            kind = spans[span] = mask.classify(*span)
        if kind == BlockKind.EMPTY:
            return
        if kind == BlockKind.FULL:
            out.append(Block(slice(a, b), slice(c, d), BlockKind.FULL))
            return
        if kind == BlockKind.CAUSAL and b - a == d - c:
            causal(a, b, c, d)
            return
        if max(b - a, d - c) <= tile:
            leaf(a, b, c, d)
            return
        rows = [(a, b)] if b - a <= tile else [(a, (a + b) // 2), ((a + b) // 2, b)]
        cols = [(c, d)] if d - c <= tile else [(c, (c + d) // 2), ((c + d) // 2, d)]
        for r0, r1 in rows:
            for c0, c1 in cols:
                split(r0, r1, c0, c1)

    block = mask.block_size if isinstance(mask, BLOCK_MASKS) else 0
    if block and block % p == 0 and block // p >= MIN_CELL_ROWS and valid == seq_len and seq_len % block == 0:
        cells, n = seq_len // block, block // p
        for qb, row in enumerate(_cell_kinds(mask, block, cells)):
            run = None  # first cell of the current row of FULL cells
            for kb, kind in enumerate((*row, BlockKind.EMPTY)):  # a sentinel closes the last run
                if kind == BlockKind.FULL:
                    run = kb if run is None else run
                    continue
                if run is not None:
                    out.append(Block(slice(qb * n, (qb + 1) * n), slice(run * n, kb * n), BlockKind.FULL))
                    run = None
                if kind == BlockKind.CAUSAL:
                    causal(qb * n, (qb + 1) * n, kb * n, (kb + 1) * n)
                elif kind == BlockKind.PARTIAL:
                    split(qb * n, (qb + 1) * n, kb * n, (kb + 1) * n)
    else:
        q_real, kv_real = len(range(q_rank, valid, p)), len(range(kv_rank, valid, p))
        if q_real and kv_real:
            split(0, q_real, 0, kv_real)
    return sorted(out, key=lambda blk: (blk.q.start, blk.kv.start))


class StripedPairs(PairWork):
    """The kernel calls of every (query rank, key rank) pair on the striped layout, from
    :func:`striped_blocks` (classified once per pair). Under a shift-invariant mask (full, causal, a
    sliding window) local row i of rank r is global ``i P + r``, so a pair's blocks depend only on
    ``q_rank - kv_rank``: 2P - 1 classifications instead of P^2 (a sliding window at 64 ranks and 1M
    tokens took minutes)."""

    def __init__(self, mask: Mask, seq_len: int, world: int, valid_len: int | None = None) -> None:
        super().__init__(world)
        self.mask, self.seq_len, self.valid_len = mask, seq_len, valid_len
        # padding at the end cuts ranks differently: then a pair depends on both ranks
        self._by_offset = mask.shift_invariant and valid_len in (None, seq_len)
        self._cache: dict[tuple[int, ...], Work] = {}
        self._spans: dict[tuple[int, int, int, int], BlockKind] = {}

    def pair(self, q_rank: int, kv_rank: int) -> Work:
        key = (q_rank - kv_rank,) if self._by_offset else (q_rank, kv_rank)
        if key not in self._cache:
            self._cache[key] = work(
                (Kernel(b.kind.value, b.q.stop - b.q.start, b.kv.stop - b.kv.start, b.area), 1)
                for b in striped_blocks(self.mask, self.seq_len, self.world, q_rank, kv_rank, self.valid_len,
                                        spans=self._spans, dense=False))
        return self._cache[key]


class StripeRingSchedule(RingSchedule):
    name = "stripe_ring"
    layout = "striped"
    custom_layout = False
    balances_documents = False
    summary = "p2p ring on the striped layout: balanced causal work"

    def pair_blocks(self, rt: Runtime, q_rank: int, kv_rank: int) -> list[Block]:
        return rt.block_cache.get(("striped", q_rank, kv_rank), lambda: striped_blocks(
            rt.mask, rt.padded_len, rt.world, q_rank, kv_rank, rt.seq_len))

    def pairs(self, problem: Problem) -> PairWork:
        """The closed form for the causal and full masks without padding, else :class:`StripedPairs`
        (kept in the active ``cpattn.core.memo`` scope)."""
        if isinstance(problem.mask, CausalMask | FullMask) and not problem.padded:
            return super().pairs(problem)
        args = (problem.mask, problem.padded_len, problem.world, problem.seq_len)
        return memo.cached(("striped pairs", *args), lambda: StripedPairs(*args))
