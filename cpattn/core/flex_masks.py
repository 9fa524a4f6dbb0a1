"""FlexAttention block masks from a mask's own structure, never from a dense ``[s_q, s_kv]`` matrix.

A mask that lists each query row's key intervals (:func:`cpattn.masks.has_intervals`) classifies every
``tile x tile`` cell of a rectangle at once: a cell is EMPTY when no row of its query tile meets its
keys, FULL when every row covers all of them (and both its sides are whole tiles), PARTIAL otherwise.
Those counts are FlexAttention's block-sparse metadata (``kv_num_blocks`` / ``kv_indices`` for the
partial cells, ``full_kv_*`` for the full ones), and the mask's ``mask_mod`` on global positions decides
the pairs of the partial cells. Cost: O(rows x intervals per row) to scatter the interval ends plus
O(cells) to sum them, so memory and time grow with the number of tiles, not with ``s_q * s_kv``.

A mask with no intervals (``from_mask_mod``) keeps FlexAttention's own ``create_block_mask`` over its
``mask_mod``, which evaluates every pair.
"""

from __future__ import annotations

import torch

from .masks import Mask, _row_chunks, has_intervals

#: FlexAttention's default tile (query and key rows per block of its kernels)
TILE = 128
EMPTY_TILE, PARTIAL_TILE, FULL_TILE = 0, 1, 2


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


def tile_kinds(mask: Mask, q0: int, q1: int, k0: int, k1: int, tile: int = TILE) -> torch.Tensor:
    """``int8 [ceil((q1 - q0) / tile), ceil((k1 - k0) / tile)]``: :data:`EMPTY_TILE`, :data:`PARTIAL_TILE`
    or :data:`FULL_TILE` per cell of the rectangle, tiles counted from ``(q0, k0)``. A tile cut short by
    the rectangle's edge is never FULL (FlexAttention pads it with masked pairs)."""
    if not has_intervals(mask):
        raise ValueError(f"mask {mask!r} lists no key intervals; its block mask comes from its mask_mod")
    nq, nk = -(-(q1 - q0) // tile), -(-(k1 - k0) // tile)
    touched = torch.zeros(nq, nk + 1, dtype=torch.int32)
    covered = torch.zeros(nq, nk + 1, dtype=torch.int32)
    for r0, r1 in _row_chunks(q0, q1, mask.width(k0, k1)):
        starts, ends = mask.intervals(torch.arange(r0, r1), k0, k1)
        s, e = _merged(starts.clamp(k0, k1) - k0, ends.clamp(k0, k1) - k0)
        live = e > s
        rows = ((torch.arange(r0, r1) - q0) // tile).unsqueeze(1).expand_as(s)
        # cells each interval meets: [s // tile, ceil(e / tile)); cells it covers whole: [ceil(s / tile), e // tile)
        for counts, lo, hi in ((touched, s // tile, -(-e // tile)), (covered, -(-s // tile), e // tile)):
            ok = live & (hi > lo)
            flat = counts.view(-1)
            width = nk + 1
            flat.index_add_(0, (rows * width + lo)[ok], torch.ones(int(ok.sum()), dtype=torch.int32))
            flat.index_add_(0, (rows * width + hi)[ok], torch.full((int(ok.sum()),), -1, dtype=torch.int32))
    # a row covers a cell at most once (its intervals are disjoint): the cell is FULL when all ``tile`` rows
    # do; a short last query tile has fewer rows, and no interval covers a short last key tile whole
    touched = touched.cumsum(1)[:, :nk]
    covered = covered.cumsum(1)[:, :nk]
    kinds = torch.where(touched > 0, PARTIAL_TILE, EMPTY_TILE).to(torch.int8)
    return kinds.masked_fill(covered == tile, FULL_TILE)


def _indices(cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num [nq], indices [nq, nk])`` of the True cells of each query tile, in ascending key order
    first (FlexAttention's layout)."""
    num = cells.sum(1, dtype=torch.int32)
    idx = torch.argsort(cells.to(torch.int8), dim=1, descending=True, stable=True).to(torch.int32)
    return num, idx


def shifted_mask_mod(mask: Mask, q0: int, k0: int, device: torch.device):
    """A FlexAttention ``mask_mod`` for the rectangle at ``(q0, k0)``: the mask's rule on global
    positions, the offsets held as tensors on ``device``, so a new rectangle changes data, not code."""
    q_off = torch.tensor(q0, dtype=torch.long, device=device)
    k_off = torch.tensor(k0, dtype=torch.long, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        return mask.mask_mod(q_idx + q_off, kv_idx + k_off)

    return mask_mod


def block_mask(mask: Mask, q0: int, q1: int, k0: int, k1: int, device: torch.device, tile: int = TILE):
    """FlexAttention's ``BlockMask`` for queries ``[q0, q1)`` against keys ``[k0, k1)`` of ``mask`` on
    ``device``, from :func:`tile_kinds` (no ``s_q x s_kv`` tensor); a mask with no intervals goes through
    ``create_block_mask`` on its ``mask_mod``."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    mod = shifted_mask_mod(mask, q0, k0, device)
    if not has_intervals(mask):
        return create_block_mask(mod, None, None, q1 - q0, k1 - k0, device=device, BLOCK_SIZE=tile)
    kinds = tile_kinds(mask, q0, q1, k0, k1, tile)
    num, idx = _indices(kinds == PARTIAL_TILE)
    full_num, full_idx = _indices(kinds == FULL_TILE)
    to = {"device": device}
    return BlockMask.from_kv_blocks(num[None, None].to(**to), idx[None, None].to(**to),
                                    full_num[None, None].to(**to), full_idx[None, None].to(**to),
                                    BLOCK_SIZE=tile, mask_mod=mod, seq_lengths=(q1 - q0, k1 - k0),
                                    compute_q_blocks=True)
