"""FlexAttention block masks from a mask's own structure, never from a dense ``[s_q, s_kv]`` matrix.

A :class:`Region` is the masked work of one kernel call: local query rows ``[0, s_q)`` against local key
rows ``[0, s_kv)`` of the tensors the call reads, each side a concatenation of global ranges (a zigzag
rank's two chunks, the keys of several ranks; positions outside every range, such as padding, attend
nothing). A mask that lists each query row's key intervals (:func:`cpattn.masks.has_intervals`) gives
every row's allowed local columns as a few intervals, and from them every ``tile x tile`` cell at once: a
cell is EMPTY when no row of its query tile meets its keys, FULL when every row covers all of them (and
both its sides are whole tiles), PARTIAL otherwise. Those counts are FlexAttention's block-sparse
metadata (``kv_num_blocks`` / ``kv_indices`` for the partial cells, ``full_kv_*`` for the full ones).
Cost: O(rows x intervals per row), so memory and time grow with the number of rows and tiles, never with
``s_q * s_kv``.

The pairs of the partial cells come from a ``mask_mod`` that reads the rows' intervals from tensors on the
device (:func:`interval_mod`): one function for every region of a width, so a compiled kernel sees new
data, not new code, when the documents or the offsets change. Masks with many intervals per row (strided,
block tables), and masks with none (``from_mask_mod``), use the mask's own rule on global positions looked
up from tensors; the latter's block mask comes from FlexAttention's ``create_block_mask``, which evaluates
every pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .masks import Mask, _row_chunks, has_intervals

#: FlexAttention's default tile (query and key rows per block of its kernels)
TILE = 128
EMPTY_TILE, PARTIAL_TILE, FULL_TILE = 0, 1, 2
#: most intervals per row that the ``mask_mod`` reads from tensors; wider masks use their own rule
MOD_INTERVALS = 4
#: block masks built so far in this process (tests count them: a steady-state call builds none)
STATS = {"block_masks": 0}

#: ``(global start, global stop, local offset)`` of one range of a region's side
Part = tuple[int, int, int]


def _merged(starts: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of intervals ``[n, w]`` (any order, overlapping, empty ones allowed) -> the same shape with each
    row's union as disjoint intervals: overlapping or touching intervals merged into the last of their
    group, the others of the group emptied (start = end)."""
    live = ends > starts
    big = torch.iinfo(torch.long).max
    s = torch.where(live, starts, big)
    s, order = s.sort(dim=1)
    e = torch.where(live, ends, -1).gather(1, order)
    reach = e.cummax(dim=1).values  # furthest end so far, by start order
    before = torch.cat([torch.full_like(reach[:, :1], -1), reach[:, :-1]], dim=1)
    new_group = s > before  # a gap before this interval: it opens a group
    group_start = torch.where(new_group, s, -1).cummax(dim=1).values
    last = torch.cat([new_group[:, 1:], torch.ones_like(new_group[:, :1])], dim=1) & (s != big)
    return torch.where(last, group_start, 0), torch.where(last, reach, 0)


@dataclass(frozen=True)
class Region:
    """Queries at global ranges ``q_parts`` against keys at ``kv_parts`` under ``mask``, as local rows
    ``[0, s_q)`` x ``[0, s_kv)`` (rows and columns outside every part attend nothing)."""

    mask: Mask
    q_parts: tuple[Part, ...]
    kv_parts: tuple[Part, ...]
    s_q: int
    s_kv: int

    @classmethod
    def rect(cls, mask: Mask, q0: int, q1: int, k0: int, k1: int) -> Region:
        """Queries ``[q0, q1)`` against keys ``[k0, k1)``, local rows counted from ``(q0, k0)``."""
        return cls(mask, ((q0, q1, 0),), ((k0, k1, 0),), q1 - q0, k1 - k0)

    def _rows(self):
        """``(local rows [n], local interval starts [n, w], ends [n, w])`` in row chunks: each row's allowed
        local columns as disjoint intervals (emptied ones start = end = 0)."""
        mask = self.mask
        width = sum(mask.width(ka, kb) for ka, kb, _ in self.kv_parts)
        for qa, qb, qo in self.q_parts:
            for r0, r1 in _row_chunks(qa, qb, width):
                rows = torch.arange(r0, r1)
                starts, ends = [], []
                for ka, kb, ko in self.kv_parts:
                    s, e = mask.intervals(rows, ka, kb)
                    starts.append(s.clamp(ka, kb) - ka + ko)
                    ends.append(e.clamp(ka, kb) - ka + ko)
                yield rows - qa + qo, *_merged(torch.cat(starts, 1), torch.cat(ends, 1))

    def scan(self, tile: int = TILE) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """One pass over the rows: ``(tile kinds int8 [ceil(s_q / tile), ceil(s_kv / tile)], empty rows bool
        [s_q], intervals)``; ``intervals``: ``(starts, ends)`` int32 ``[ceil(s_q / tile) * tile, w]`` for
        the ``mask_mod`` (:func:`interval_mod`; ``w`` = :data:`MOD_INTERVALS` always, so its code never
        changes) when no row has more, else None.
        A tile cut short by the region's edge is never FULL (FlexAttention pads it with masked pairs)."""
        if not has_intervals(self.mask):
            raise ValueError(f"mask {self.mask!r} lists no key intervals; its block mask comes from its mask_mod")
        nq, nk = -(-self.s_q // tile), -(-self.s_kv // tile)
        touched = torch.zeros(nq * (nk + 1), dtype=torch.int32)
        covered = torch.zeros(nq * (nk + 1), dtype=torch.int32)
        empty = torch.ones(self.s_q, dtype=torch.bool)
        kept = torch.zeros(2, nq * tile, MOD_INTERVALS, dtype=torch.int32)
        narrow = True
        for rows, s, e in self._rows():
            live = e > s
            count = live.sum(1)
            empty[rows] = count == 0
            if narrow and int(count.max()) <= MOD_INTERVALS:
                order = torch.argsort(live.to(torch.int8), dim=1, descending=True, stable=True)[:, :MOD_INTERVALS]
                w = order.shape[1]
                kept[0, rows, :w] = s.gather(1, order).to(torch.int32)
                kept[1, rows, :w] = e.gather(1, order).to(torch.int32)
            else:
                narrow = False
            cell_row = (rows // tile).unsqueeze(1).expand_as(s) * (nk + 1)
            # cells each interval meets: [s // tile, ceil(e / tile)); cells it covers whole: [ceil(s / tile), e // tile)
            for counts, lo, hi in ((touched, s // tile, -(-e // tile)), (covered, -(-s // tile), e // tile)):
                ok = live & (hi > lo)
                n = int(ok.sum())
                counts.index_add_(0, (cell_row + lo)[ok], torch.ones(n, dtype=torch.int32))
                counts.index_add_(0, (cell_row + hi)[ok], torch.full((n,), -1, dtype=torch.int32))
        # a row covers a cell at most once (its intervals are disjoint): the cell is FULL when all ``tile``
        # rows do; a short last query tile has fewer rows, and no interval covers a short last key tile whole
        touched = touched.view(nq, nk + 1).cumsum(1)[:, :nk]
        covered = covered.view(nq, nk + 1).cumsum(1)[:, :nk]
        kinds = torch.where(touched > 0, PARTIAL_TILE, EMPTY_TILE).to(torch.int8)
        kinds = kinds.masked_fill(covered == tile, FULL_TILE)
        return kinds, empty, (kept[0], kept[1]) if narrow else None

    def tile_kinds(self, tile: int = TILE) -> torch.Tensor:
        """:data:`EMPTY_TILE`, :data:`PARTIAL_TILE` or :data:`FULL_TILE` per ``tile x tile`` cell (:meth:`scan`)."""
        return self.scan(tile)[0]

    def positions(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Global positions of the local rows and columns (int64, -1 outside every part)."""
        out = []
        for parts, n in ((self.q_parts, self.s_q), (self.kv_parts, self.s_kv)):
            pos = torch.full((n,), -1, dtype=torch.long)
            for a, b, o in parts:
                pos[o:o + b - a] = torch.arange(a, b)
            out.append(pos.to(device))
        return out[0], out[1]

    def dense(self) -> torch.Tensor:
        """Bool ``[s_q, s_kv]`` of the allowed local pairs: for paths that take a dense mask (the CPU and
        ``math`` ones; O(s_q * s_kv), small blocks only)."""
        out = torch.zeros(self.s_q, self.s_kv, dtype=torch.bool)
        for qa, qb, qo in self.q_parts:
            for ka, kb, ko in self.kv_parts:
                out[qo:qo + qb - qa, ko:ko + kb - ka] = self.mask.dense(qa, qb, ka, kb)
        return out

    def _empty_rows(self) -> torch.Tensor:
        """Bool ``[s_q]``: local rows with no allowed key, from the mask's row counts (taken in row chunks:
        no ``s_q x s_kv`` tensor)."""
        empty = torch.ones(self.s_q, dtype=torch.bool)
        for qa, qb, qo in self.q_parts:
            counts = sum(self.mask.row_counts(qa, qb, ka, kb) for ka, kb, _ in self.kv_parts)
            empty[qo:qo + qb - qa] = torch.as_tensor(counts) == 0
        return empty

    @property
    def area(self) -> int:
        """Allowed (query, key) pairs."""
        return sum(self.mask.count(qa, qb, ka, kb) for qa, qb, _ in self.q_parts for ka, kb, _ in self.kv_parts)

    def block_mask(self, device: torch.device | str, tile: int = TILE):
        """``(empty rows bool [s_q], FlexAttention BlockMask)`` on ``device``, from :meth:`scan` (no
        ``s_q x s_kv`` tensor) for a mask with intervals, else ``create_block_mask`` on the mask's rule."""
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask

        STATS["block_masks"] += 1
        if not has_intervals(self.mask):
            mod = position_mod(self.mask, *self.positions(device))
            bm = create_block_mask(mod, None, None, self.s_q, self.s_kv, device=device, BLOCK_SIZE=tile)
            return self._empty_rows().to(device), bm
        kinds, empty, intervals = self.scan(tile)
        mod = (position_mod(self.mask, *self.positions(device)) if intervals is None
               else interval_mod(*(x.to(device) for x in intervals)))
        num, idx = _indices(kinds == PARTIAL_TILE)
        full_num, full_idx = _indices(kinds == FULL_TILE)
        meta = [t[None, None].to(device) for t in (num, idx, full_num, full_idx)]
        return empty.to(device), BlockMask.from_kv_blocks(*meta, BLOCK_SIZE=tile, mask_mod=mod,
                                                          seq_lengths=(self.s_q, self.s_kv), compute_q_blocks=True)


def _indices(cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num [nq], indices [nq, nk])`` of the True cells of each query tile, in ascending key order
    first (FlexAttention's layout)."""
    num = cells.sum(1, dtype=torch.int32)
    idx = torch.argsort(cells.to(torch.int8), dim=1, descending=True, stable=True).to(torch.int32)
    return num, idx


def interval_mod(starts: torch.Tensor, ends: torch.Tensor):
    """A FlexAttention ``mask_mod``: local row q attends local column k when ``starts[q, i] <= k <
    ends[q, i]`` for one of the row's intervals i (``int32 [rows, w]`` on the kernel's device). The same
    code for every region of width ``w``; only the tensors change."""
    columns = tuple(zip(starts.unbind(1), ends.unbind(1)))

    def mask_mod(b, h, q_idx, kv_idx):
        s, e = columns[0]
        ok = (kv_idx >= s[q_idx]) & (kv_idx < e[q_idx])
        for s, e in columns[1:]:
            ok = ok | ((kv_idx >= s[q_idx]) & (kv_idx < e[q_idx]))
        return ok

    return mask_mod


def position_mod(mask: Mask, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """A FlexAttention ``mask_mod`` of ``mask``'s own rule on the global positions of local rows and columns
    (``q_pos``, ``k_pos``: -1 outside the region's parts, which attend nothing)."""

    def mask_mod(b, h, q_idx, kv_idx):
        qp, kp = q_pos[q_idx], k_pos[kv_idx]
        return (qp >= 0) & (kp >= 0) & mask.mask_mod(qp.clamp(min=0), kp.clamp(min=0))

    return mask_mod
