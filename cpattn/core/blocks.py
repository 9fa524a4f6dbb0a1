"""Which local sub-blocks a rank computes, and with which kernel kind (pure, no process group).

A rank holds queries at some global positions and receives keys/values at others. ``rectangles``
classifies every (query range, key range) pair with the mask (ranges adjacent in both local order
and position are treated as one) and drops EMPTY ones. A PARTIAL rectangle is covered by the mask's own
pieces where it has them (:meth:`~cpattn.masks.Mask.cover`: one CAUSAL square per document, a window's
band as CAUSAL and flipped CAUSAL squares, a table's cells), else halved recursively while a side is
longer than ``PARTIAL_TILE`` (the halves are mostly EMPTY, FULL or CAUSAL, and the dense mask of what
stays PARTIAL is small). Remaining PARTIAL rectangles are densified, and adjacent FULL blocks fused so
that, e.g., zigzag's "all local queries against the first half of a remote chunk" becomes one kernel
call. Slices are in *local* coordinates (rows of the local tensors).

:func:`batches` groups blocks of one kind and shape into stacked kernel calls (docs/masks_speed.md), so a
thousand 4-token documents cost a few kernel calls, not a thousand; PARTIAL blocks of one shape stack
with their masks.

Padding: positions ``>= valid_len`` are padding tokens (added when the sequence does not split evenly).
They are cut out of every range before classification, so no block ever covers a padding row or
column: padding queries end with out 0 and lse -inf, padding keys get zero gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .flex_masks import Region
from .layout import Layout
from .masks import BlockKind, CausalMask, FullMask, Mask

#: PARTIAL rectangles with a side longer than this are halved and classified again (tokens)
PARTIAL_TILE = 512
#: most query (and key) rows one stacked kernel call gathers: bounds the copies :func:`batches` implies
BATCH_ROWS = 16384
#: most mask elements one stacked call of PARTIAL blocks carries (its additive mask is as many floats)
BATCH_MASK = 1 << 22


@dataclass(frozen=True)
class Block:
    q: slice  # local query rows
    kv: slice  # local key/value rows
    kind: BlockKind  # FULL, CAUSAL or PARTIAL (never EMPTY)
    mask: torch.Tensor | Region | None = None  # bool [q rows, kv rows] for PARTIAL, or its structure
    flip: bool = False  # CAUSAL on reversed rows and keys: local row i attends local columns >= i
    pairs: int | None = None  # PARTIAL without its mask (a shape to price): its allowed pairs

    def dense(self) -> torch.Tensor:
        """Boolean ``[q rows, kv rows]``: which local pairs this block computes."""
        n, m = self.q.stop - self.q.start, self.kv.stop - self.kv.start
        if self.kind == BlockKind.PARTIAL:
            return self.mask.dense() if isinstance(self.mask, Region) else self.mask
        ones = torch.ones(n, m, dtype=torch.bool)
        if self.kind == BlockKind.FULL:
            return ones
        return ones.triu() if self.flip else ones.tril()

    @property
    def area(self) -> int:
        """Number of allowed (query, key) pairs."""
        n, m = self.q.stop - self.q.start, self.kv.stop - self.kv.start
        if self.kind == BlockKind.FULL:
            return n * m
        if self.kind == BlockKind.CAUSAL:
            return n * (n + 1) // 2
        if isinstance(self.mask, Region):
            return self.mask.area
        return int(self.mask.sum()) if self.mask is not None else int(self.pairs)


def _parts(ranges: Sequence[tuple[int, int]], valid_len: int | None) -> list[tuple[int, int, int]]:
    """``(start, stop, local offset)`` of the real (non-padding) part of each global range; a range that
    continues the previous one both locally and globally is merged into it."""
    out: list[tuple[int, int, int]] = []
    acc = 0
    for a, b in ranges:
        stop = b if valid_len is None else min(b, valid_len)
        if stop > a:
            if out and out[-1][1] == a and out[-1][2] + out[-1][1] - out[-1][0] == acc:
                out[-1] = (out[-1][0], stop, out[-1][2])
            else:
                out.append((a, stop, acc))
        acc += b - a
    return out


def _split(mask: Mask, a: int, b: int, c: int, d: int, tile: int,
           out: list[tuple[int, int, int, int, BlockKind, bool]]) -> None:
    """Non-EMPTY rectangles covering ``[a, b) x [c, d)`` (global): a PARTIAL one by the mask's cover, or
    halved down to ``tile`` when the mask has none."""
    kind = mask.classify(a, b, c, d)
    if kind == BlockKind.EMPTY:
        return
    if kind == BlockKind.PARTIAL:
        pieces = mask.cover(a, b, c, d)
        if pieces is not None:
            out.extend(pieces)
            return
    if kind != BlockKind.PARTIAL or max(b - a, d - c) <= tile:
        out.append((a, b, c, d, kind, False))
        return
    rows = [(a, b)] if b - a <= tile else [(a, (a + b) // 2), ((a + b) // 2, b)]
    cols = [(c, d)] if d - c <= tile else [(c, (c + d) // 2), ((c + d) // 2, d)]
    for r0, r1 in rows:
        for c0, c1 in cols:
            _split(mask, r0, r1, c0, c1, tile, out)


def _fuse_runs(spans: list[tuple[slice, slice]]) -> list[tuple[slice, slice]]:
    """``(same, along)`` slice pairs, sorted, each fused into the previous one when it has the same ``same``
    and its ``along`` continues the previous one's."""
    out: list[tuple[slice, slice]] = []
    for same, along in sorted(spans, key=lambda s: (s[0].start, s[0].stop, s[1].start)):
        if out and out[-1][0] == same and out[-1][1].stop == along.start:
            out[-1] = (same, slice(out[-1][1].start, along.stop))
        else:
            out.append((same, along))
    return out


def _fuse_full(blocks: list[Block]) -> list[Block]:
    """Fuse FULL blocks: same rows and adjacent columns, then same columns and adjacent rows."""
    rows = _fuse_runs([(b.q, b.kv) for b in blocks if b.kind == BlockKind.FULL])
    fused = [Block(q, kv, BlockKind.FULL) for kv, q in _fuse_runs([(kv, q) for q, kv in rows])]
    rest = [b for b in blocks if b.kind != BlockKind.FULL]
    return sorted(fused + rest, key=lambda b: (b.q.start, b.kv.start))


def rectangles(mask: Mask, q_ranges: Sequence[tuple[int, int]], kv_ranges: Sequence[tuple[int, int]],
               valid_len: int | None = None, tile: int = PARTIAL_TILE, dense: bool = True,
               regions: bool = False) -> list[Block]:
    """Blocks for local queries at global ``q_ranges`` against local keys at ``kv_ranges`` (both in
    local order). Positions ``>= valid_len`` are padding and never covered. ``dense=False``: the same
    blocks with PARTIAL ones carrying their pair count instead of their mask (shapes to price, several
    times cheaper to make). ``regions``: where that would take more than one block, or a PARTIAL one,
    one PARTIAL block over all the rows and columns instead, its mask a
    :class:`~cpattn.core.flex_masks.Region` (one FlexAttention call, its block mask built from the mask's
    structure)."""
    q_parts, kv_parts = _parts(q_ranges, valid_len), _parts(kv_ranges, valid_len)
    out = _rectangles(mask, q_parts, kv_parts, tile, dense and not regions)
    if regions and (len(out) > 1 or any(b.kind == BlockKind.PARTIAL for b in out)):
        region = Region(mask, tuple(q_parts), tuple(kv_parts), sum(b - a for a, b in q_ranges),
                        sum(b - a for a, b in kv_ranges))
        return [Block(slice(0, region.s_q), slice(0, region.s_kv), BlockKind.PARTIAL, region)]
    return out


def _rectangles(mask: Mask, q_parts: list[tuple[int, int, int]], kv_parts: list[tuple[int, int, int]], tile: int,
                dense: bool) -> list[Block]:
    out: list[Block] = []
    for qa, qb, qo in q_parts:
        for ka, kb, ko in kv_parts:
            rects: list[tuple[int, int, int, int, BlockKind, bool]] = []
            _split(mask, qa, qb, ka, kb, tile, rects)
            for a, b, c, d, kind, flip in rects:
                allowed, pairs = None, None
                if kind == BlockKind.PARTIAL:  # a cover's band tile may be cut down to nothing, or to all
                    allowed = mask.dense(a, b, c, d) if dense else None
                    count = int(allowed.sum()) if dense else mask.count(a, b, c, d)
                    if count == 0:
                        continue
                    if count == (b - a) * (d - c):
                        kind, allowed = BlockKind.FULL, None
                    elif not dense:
                        pairs = count
                out.append(Block(slice(qo + a - qa, qo + b - qa), slice(ko + c - ka, ko + d - ka), kind, allowed,
                                 flip, pairs))
    return _fuse_full(out)


@dataclass(frozen=True)
class Batch:
    """Blocks of one kind and one shape that run as one kernel call, stacked along the batch dimension
    (PARTIAL ones with their masks stacked). Their query rows are disjoint, so their outputs scatter
    back without merging each other."""

    kind: BlockKind
    blocks: tuple[Block, ...]

    @property
    def stacked(self) -> bool:
        """False for a lone unflipped block, which runs on slices of the local tensors (no copy, a
        PARTIAL one with its own 2-D mask)."""
        return len(self.blocks) > 1 or self.blocks[0].flip

    def _span(self, side: str) -> slice | None:
        spans = [getattr(b, side) for b in self.blocks]
        if any(b.flip for b in self.blocks) or any(a.stop != b.start for a, b in zip(spans, spans[1:])):
            return None
        return slice(spans[0].start, spans[-1].stop)

    def row_span(self) -> slice | None:
        """The local query rows as one slice when the blocks' rows follow each other unflipped, else None
        (then :meth:`rows` gathers them)."""
        return self._span("q")

    def col_span(self) -> slice | None:
        """The local key rows as one slice, as :meth:`row_span`."""
        return self._span("kv")

    def _index(self, side: str) -> np.ndarray:
        spans = [getattr(b, side) for b in self.blocks]
        n = spans[0].stop - spans[0].start
        step = np.arange(n)
        start = np.array([s.start for s in spans])[:, None]
        flip = np.array([b.flip for b in self.blocks])[:, None]
        return (start + np.where(flip, n - 1 - step, step)).reshape(-1)

    def row_index(self) -> np.ndarray:
        """``[blocks x q rows]`` int64 on the host: local query rows, block after block (reversed when
        flipped)."""
        return self._index("q")

    def rows(self) -> torch.Tensor:
        """LongTensor ``[blocks x q rows]``: :meth:`row_index` as a tensor."""
        return torch.from_numpy(self.row_index())

    def cols(self) -> torch.Tensor:
        """LongTensor ``[blocks x kv rows]``: local key rows, as :meth:`rows`."""
        return torch.from_numpy(self._index("kv"))

    def masks(self) -> torch.Tensor | None:
        """PARTIAL: the blocks' masks stacked, bool ``[blocks, q rows, kv rows]``; else None."""
        return torch.stack([b.mask for b in self.blocks]) if self.kind == BlockKind.PARTIAL else None


def batches(blocks: Sequence[Block], max_rows: int = BATCH_ROWS, max_mask: int = BATCH_MASK) -> list[Batch]:
    """Group blocks of one kind and shape (FULL and CAUSAL flipped or not; PARTIAL with their own masks)
    into stacked calls whose blocks have disjoint query rows and at most ``max_rows`` rows on either
    side; a PARTIAL group also at most ``max_mask`` mask elements in all."""
    groups: dict[tuple, list[Block]] = {}
    out: list[Batch] = []
    for b in blocks:
        if isinstance(b.mask, Region):  # one call of its own
            out.append(Batch(b.kind, (b,)))
        else:
            groups.setdefault((b.kind, b.q.stop - b.q.start, b.kv.stop - b.kv.start), []).append(b)
    for (kind, n_q, n_kv), group in groups.items():
        cap = max(1, max_rows // max(n_q, n_kv))
        if kind == BlockKind.PARTIAL:
            cap = min(cap, max(1, max_mask // (n_q * n_kv)))
        lanes: list[list[Block]] = []  # sorted by start, each block joins the first lane it follows
        for b in sorted(group, key=lambda b: (b.q.start, b.kv.start)):
            lane = next((ln for ln in lanes if ln[-1].q.stop <= b.q.start and len(ln) < cap), None)
            if lane is None:
                lanes.append([b])
            else:
                lane.append(b)
        out.extend(Batch(kind, tuple(ln)) for ln in lanes)
    return sorted(out, key=lambda bt: (bt.blocks[0].q.start, bt.blocks[0].kv.start))


def _clip(blocks: list[Block], q_real: int, kv_real: int) -> list[Block]:
    """FULL / CAUSAL blocks restricted to local rows < ``q_real`` and columns < ``kv_real``. A clipped
    causal block keeps its square top-left corner as CAUSAL; rows below it see every kept column."""
    out = []
    for b in blocks:
        qa, ka = b.q.start, b.kv.start
        q1, k1 = min(b.q.stop, q_real), min(b.kv.stop, kv_real)
        if q1 <= qa or k1 <= ka:
            continue
        if b.kind == BlockKind.FULL:
            out.append(Block(slice(qa, q1), slice(ka, k1), BlockKind.FULL))
            continue
        side = min(q1 - qa, k1 - ka)
        out.append(Block(slice(qa, qa + side), slice(ka, ka + side), BlockKind.CAUSAL))
        if q1 - qa > side:
            out.append(Block(slice(qa + side, q1), slice(ka, k1), BlockKind.FULL))
    return out


def striped(mask: Mask, local_len: int, q_rank: int, kv_rank: int, q_real: int | None = None,
            kv_real: int | None = None) -> list[Block]:
    """Blocks for the striped layout (token t on rank t mod P). Under a causal mask, queries of rank r
    against keys of rank j <= r form a causal block; for j > r every query strictly follows the keys
    of its own stripe, so local query i attends local keys < i: causal on q[1:] x kv[:-1].
    ``q_real`` / ``kv_real``: how many leading local tokens are real (the rest is padding)."""
    s = local_len
    if isinstance(mask, FullMask):
        blocks = [Block(slice(0, s), slice(0, s), BlockKind.FULL)]
    elif not isinstance(mask, CausalMask):
        raise NotImplementedError(f"the striped layout supports the causal and full masks, not {mask.name!r}")
    elif kv_rank <= q_rank:
        blocks = [Block(slice(0, s), slice(0, s), BlockKind.CAUSAL)]
    else:
        blocks = [Block(slice(1, s), slice(0, s - 1), BlockKind.CAUSAL)] if s > 1 else []
    return _clip(blocks, s if q_real is None else q_real, s if kv_real is None else kv_real)


def for_ranks(mask: Mask, layout: Layout, seq_len: int, world: int, q_rank: int | Sequence[int],
              kv_ranks: Sequence[int], valid_len: int | None = None, regions: bool = False) -> list[Block]:
    """Blocks of the queries of ``q_rank`` (one rank, or several concatenated in that order) against the
    keys of ``kv_ranks`` concatenated in that order. ``seq_len`` is the (padded) length the layout
    splits; positions ``>= valid_len`` are padding; ``regions`` as in :func:`rectangles`."""
    q_ranks = [q_rank] if isinstance(q_rank, int) else list(q_rank)
    if layout.name == "striped":
        if len(kv_ranks) != 1 or len(q_ranks) != 1:
            raise ValueError("striped blocks are planned one query rank and one key rank at a time")
        pair = (q_ranks[0], kv_ranks[0])
        real = (None, None) if valid_len is None else [len(range(r, valid_len, world)) for r in pair]
        return striped(mask, layout.local_len(seq_len, world), *pair, *real)
    q_ranges = [r for i in q_ranks for r in layout.ranges(seq_len, world, i)]
    kv_ranges = [r for j in kv_ranks for r in layout.ranges(seq_len, world, j)]
    return rectangles(mask, q_ranges, kv_ranges, valid_len, regions=regions)
