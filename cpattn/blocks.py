"""Which local sub-blocks a rank computes, and with which kernel kind (pure, no process group).

A rank holds queries at some global positions and receives keys/values at others. ``rectangles``
classifies every (query chunk, key chunk) pair with the mask, drops EMPTY ones, densifies PARTIAL ones
and fuses adjacent FULL ones so that, e.g., zigzag's "all local queries against the first half of a
remote chunk" becomes one kernel call. Slices are in *local* coordinates (rows of the local tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import Layout
from .masks import BlockKind, CausalMask, FullMask, Mask


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


def _offsets(ranges: list[tuple[int, int]]) -> list[int]:
    offs, acc = [], 0
    for a, b in ranges:
        offs.append(acc)
        acc += b - a
    return offs


def rectangles(mask: Mask, q_ranges: list[tuple[int, int]], kv_ranges: list[tuple[int, int]]) -> list[Block]:
    """Blocks for local queries at global ``q_ranges`` against local keys at ``kv_ranges`` (both in
    local order)."""
    q_off, kv_off = _offsets(q_ranges), _offsets(kv_ranges)
    rows: list[list[Block]] = []
    for i, (qa, qb) in enumerate(q_ranges):
        row: list[Block] = []
        qs = slice(q_off[i], q_off[i] + qb - qa)
        for j, (ka, kb) in enumerate(kv_ranges):
            kind = mask.classify(qa, qb, ka, kb)
            if kind == BlockKind.EMPTY:
                continue
            ks = slice(kv_off[j], kv_off[j] + kb - ka)
            dense = mask.dense(qa, qb, ka, kb) if kind == BlockKind.PARTIAL else None
            prev = row[-1] if row else None
            if (kind == BlockKind.FULL and prev is not None and prev.kind == BlockKind.FULL
                    and prev.kv.stop == ks.start):
                row[-1] = Block(qs, slice(prev.kv.start, ks.stop), BlockKind.FULL)
            else:
                row.append(Block(qs, ks, kind, dense))
        rows.append(row)
    # fuse FULL blocks with the same key slice in vertically adjacent query chunks
    out: list[Block] = []
    for row in rows:
        for blk in row:
            fused = False
            if blk.kind == BlockKind.FULL:
                for n, prev in enumerate(out):
                    if prev.kind == BlockKind.FULL and prev.kv == blk.kv and prev.q.stop == blk.q.start:
                        out[n] = Block(slice(prev.q.start, blk.q.stop), blk.kv, BlockKind.FULL)
                        fused = True
                        break
            if not fused:
                out.append(blk)
    return out


def striped(mask: Mask, local_len: int, q_rank: int, kv_rank: int) -> list[Block]:
    """Blocks for the striped layout (token t on rank t mod P). Under a causal mask, queries of rank r
    against keys of rank j <= r form a causal block; for j > r every query strictly follows the keys
    of its own stripe, so local query i attends local keys < i: causal on q[1:] x kv[:-1]."""
    s = local_len
    if isinstance(mask, FullMask):
        return [Block(slice(0, s), slice(0, s), BlockKind.FULL)]
    if not isinstance(mask, CausalMask):
        raise NotImplementedError(f"the striped layout supports the causal and full masks, not {mask.name!r}")
    if kv_rank <= q_rank:
        return [Block(slice(0, s), slice(0, s), BlockKind.CAUSAL)]
    if s == 1:
        return []
    return [Block(slice(1, s), slice(0, s - 1), BlockKind.CAUSAL)]


def for_ranks(mask: Mask, layout: Layout, seq_len: int, world: int, q_rank: int,
              kv_ranks: list[int]) -> list[Block]:
    """Blocks of ``q_rank``'s queries against the keys of ``kv_ranks`` concatenated in that order."""
    if layout.name == "striped":
        if len(kv_ranks) != 1:
            raise ValueError("striped blocks are planned one key rank at a time")
        return striped(mask, layout.local_len(seq_len, world), q_rank, kv_ranks[0])
    kv_ranges = [r for j in kv_ranks for r in layout.ranges(seq_len, world, j)]
    return rectangles(mask, layout.ranges(seq_len, world, q_rank), kv_ranges)
