"""Which local sub-blocks a rank computes, and with which kernel kind (pure, no process group).

A rank holds queries at some global positions and receives keys/values at others. ``rectangles``
classifies every (query range, key range) pair with the mask (ranges adjacent in both local order
and position are treated as one), drops EMPTY ones, halves PARTIAL ones with a side longer than
``PARTIAL_TILE`` recursively (the halves of a document or window mask are mostly EMPTY, FULL or CAUSAL,
and the dense mask of what stays PARTIAL is small), densifies the remaining PARTIAL rectangles and
fuses adjacent FULL blocks so that, e.g., zigzag's "all local queries against the first half of a
remote chunk" becomes one kernel call. Slices are in *local* coordinates (rows of the local tensors).

Padding: positions ``>= valid_len`` are padding tokens (added when the sequence does not split evenly).
They are cut out of every range before classification, so no block ever covers a padding row or
column: padding queries end with out 0 and lse -inf, padding keys get zero gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .layout import Layout
from .masks import BlockKind, CausalMask, FullMask, Mask

#: PARTIAL rectangles with a side longer than this are halved and classified again (tokens)
PARTIAL_TILE = 512


@dataclass(frozen=True)
class Block:
    q: slice  # local query rows
    kv: slice  # local key/value rows
    kind: BlockKind  # FULL, CAUSAL or PARTIAL (never EMPTY)
    mask: torch.Tensor | None = None  # bool [q rows, kv rows] for PARTIAL

    @property
    def area(self) -> int:
        """Number of allowed (query, key) pairs."""
        n, m = self.q.stop - self.q.start, self.kv.stop - self.kv.start
        if self.kind == BlockKind.FULL:
            return n * m
        if self.kind == BlockKind.CAUSAL:
            return n * (n + 1) // 2
        return int(self.mask.sum())


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
           out: list[tuple[int, int, int, int, BlockKind]]) -> None:
    """Non-EMPTY rectangles covering ``[a, b) x [c, d)`` (global), PARTIAL ones halved down to ``tile``."""
    kind = mask.classify(a, b, c, d)
    if kind == BlockKind.EMPTY:
        return
    if kind != BlockKind.PARTIAL or max(b - a, d - c) <= tile:
        out.append((a, b, c, d, kind))
        return
    rows = [(a, b)] if b - a <= tile else [(a, (a + b) // 2), ((a + b) // 2, b)]
    cols = [(c, d)] if d - c <= tile else [(c, (c + d) // 2), ((c + d) // 2, d)]
    for r0, r1 in rows:
        for c0, c1 in cols:
            _split(mask, r0, r1, c0, c1, tile, out)


def _fuse_full(blocks: list[Block]) -> list[Block]:
    """Fuse FULL blocks: same rows and adjacent columns, then same columns and adjacent rows."""
    full = sorted((b for b in blocks if b.kind == BlockKind.FULL), key=lambda b: (b.q.start, b.q.stop, b.kv.start))
    rows: list[Block] = []
    for b in full:
        prev = rows[-1] if rows else None
        if prev is not None and prev.q == b.q and prev.kv.stop == b.kv.start:
            rows[-1] = Block(b.q, slice(prev.kv.start, b.kv.stop), BlockKind.FULL)
        else:
            rows.append(b)
    fused: list[Block] = []
    for b in sorted(rows, key=lambda b: (b.kv.start, b.kv.stop, b.q.start)):
        prev = fused[-1] if fused else None
        if prev is not None and prev.kv == b.kv and prev.q.stop == b.q.start:
            fused[-1] = Block(slice(prev.q.start, b.q.stop), b.kv, BlockKind.FULL)
        else:
            fused.append(b)
    rest = [b for b in blocks if b.kind != BlockKind.FULL]
    return sorted(fused + rest, key=lambda b: (b.q.start, b.kv.start))


def rectangles(mask: Mask, q_ranges: Sequence[tuple[int, int]], kv_ranges: Sequence[tuple[int, int]],
               valid_len: int | None = None, tile: int = PARTIAL_TILE) -> list[Block]:
    """Blocks for local queries at global ``q_ranges`` against local keys at ``kv_ranges`` (both in
    local order). Positions ``>= valid_len`` are padding and never covered."""
    out: list[Block] = []
    for qa, qb, qo in _parts(q_ranges, valid_len):
        for ka, kb, ko in _parts(kv_ranges, valid_len):
            rects: list[tuple[int, int, int, int, BlockKind]] = []
            _split(mask, qa, qb, ka, kb, tile, rects)
            for a, b, c, d, kind in rects:
                dense = mask.dense(a, b, c, d) if kind == BlockKind.PARTIAL else None
                out.append(Block(slice(qo + a - qa, qo + b - qa), slice(ko + c - ka, ko + d - ka), kind, dense))
    return _fuse_full(out)


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
              kv_ranks: Sequence[int], valid_len: int | None = None) -> list[Block]:
    """Blocks of the queries of ``q_rank`` (one rank, or several concatenated in that order) against the
    keys of ``kv_ranks`` concatenated in that order. ``seq_len`` is the (padded) length the layout
    splits; positions ``>= valid_len`` are padding."""
    q_ranks = [q_rank] if isinstance(q_rank, int) else list(q_rank)
    if layout.name == "striped":
        if len(kv_ranks) != 1 or len(q_ranks) != 1:
            raise ValueError("striped blocks are planned one query rank and one key rank at a time")
        real = None if valid_len is None else [len(range(r, valid_len, world)) for r in (q_ranks[0], kv_ranks[0])]
        return striped(mask, layout.local_len(seq_len, world), q_ranks[0], kv_ranks[0],
                       *(real if real is not None else (None, None)))
    q_ranges = [r for i in q_ranks for r in layout.ranges(seq_len, world, i)]
    kv_ranges = [r for j in kv_ranks for r in layout.ranges(seq_len, world, j)]
    return rectangles(mask, q_ranges, kv_ranges, valid_len)
