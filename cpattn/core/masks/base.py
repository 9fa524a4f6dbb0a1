"""What every mask family shares: :class:`BlockKind`, the :class:`Piece` s of a rectangle's cover and
the helpers that build covers (:func:`triangle`, :func:`band`, block cells), with small argument and
shape helpers."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import NamedTuple

import torch


class BlockKind(enum.Enum):
    """What a rectangle of the attention matrix looks like."""

    EMPTY = "empty"  # no (q, k) pair attends
    FULL = "full"  # every pair attends
    CAUSAL = "causal"  # square; local row i attends exactly local columns <= i
    PARTIAL = "partial"  # anything else: needs the dense mask


#: rows x intervals evaluated at once when sweeping intervals or densifying (bounds memory)
CHUNK_ELEMS = 1 << 22


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


def _row_chunks(q0: int, q1: int, per_row: int) -> Iterator[tuple[int, int]]:
    step = max(1, CHUNK_ELEMS // max(1, per_row))
    for r0 in range(q0, q1, step):
        yield r0, min(q1, r0 + step)


class Piece(NamedTuple):
    """One piece of a rectangle's cover (:meth:`Mask.cover`): query rows ``[q0, q1)`` x keys ``[k0, k1)``
    (global positions), FULL or CAUSAL. A CAUSAL piece is square; with ``flip`` its local row i attends
    local columns >= i (the causal triangle of the reversed rows and keys), else columns <= i."""

    q0: int
    q1: int
    k0: int
    k1: int
    kind: BlockKind
    flip: bool = False


#: row tile of a sliding window's cover (tokens): past it, a tile's band is a FULL rectangle between two
#: triangles, which the fused kernels run at full-block efficiency
WINDOW_TILE = 256
#: rows per band tile: a PARTIAL piece of this many rows against every key its rows can reach
#: (:func:`band`); tiles of one shape run as one stacked call with a mask each
BAND_TILE = 128
#: windows narrower than this are covered by band tiles rather than by triangles: on rows this short,
#: the kernels' fixed cost per (query tile, key tile) dominates, and one masked call per shape runs the
#: forward as fast and the backward faster (docs/masks_speed.md)
BAND_MAX_WINDOW = 512
#: a structured cover gives up (the caller halves the rectangle instead) past this many row tiles or cells
MAX_COVER_STEPS = 1 << 15


def _lower(a: int, b: int, c: int, d: int) -> list[Piece]:
    """Cover of the pairs ``k <= q`` of ``[a, b) x [c, d)``: one CAUSAL square on the diagonal and up to
    two FULL rectangles (left of it, below it)."""
    if d - 1 <= a:
        return [Piece(a, b, c, d, BlockKind.FULL)]
    if c >= b:
        return []
    lo, hi = max(a, c), min(b, d)
    out = [Piece(lo, hi, lo, hi, BlockKind.CAUSAL)]
    if c < lo:
        out.append(Piece(lo, b, c, lo, BlockKind.FULL))
    if hi < b:
        out.append(Piece(hi, b, lo, hi, BlockKind.FULL))
    return out


def triangle(q0: int, q1: int, k0: int, k1: int, delta: int, flip: bool = False) -> list[Piece]:
    """Cover of the pairs of ``[q0, q1) x [k0, k1)`` with ``k - q <= delta`` (``>= delta`` when ``flip``):
    at most one CAUSAL square (flipped when ``flip``) and two FULL rectangles; [] when none attends."""
    if q0 >= q1 or k0 >= k1:
        return []
    if flip:  # u = -1 - q, t = -1 - k turns k - q >= delta into t - u <= -delta
        return [Piece(-p.q1, -p.q0, -p.k1, -p.k0, p.kind, p.kind == BlockKind.CAUSAL)
                for p in triangle(-q1, -q0, -k1, -k0, -delta)]
    return [Piece(p.q0, p.q1, p.k0 + delta, p.k1 + delta, p.kind) for p in _lower(q0, q1, k0 - delta, k1 - delta)]


def band(rect: tuple[int, int, int, int], r0: int, r1: int, c0: int, c1: int, lo: int, hi: int,
         tile: int = BAND_TILE) -> list[Piece] | None:
    """PARTIAL tiles covering pairs of rows ``[r0, r1)`` whose keys lie within ``[q - lo, q + hi]`` and
    ``[c0, c1)``: rows ``[a, a + tile)`` for ``a`` from ``r0`` in steps of ``tile``, against keys ``[a - lo,
    a + tile + hi)``, all cut by ``rect``. Each tile's dense mask says which of its pairs attend
    (``blocks.rectangles`` drops tiles cut down to nothing); interior tiles share one shape, so they run
    as one stacked call. None past :data:`MAX_COVER_STEPS` tiles."""
    q0, q1, k0, k1 = rect
    lo_row, hi_row = max(r0, q0), min(r1, q1)
    if lo_row >= hi_row:
        return []
    first = r0 + (lo_row - r0) // tile * tile
    if (hi_row - first) // tile >= MAX_COVER_STEPS:
        return None
    out = []
    for a in range(first, hi_row, tile):
        rows = (max(a, q0), min(a + tile, hi_row))
        keys = (max(a - lo, c0, k0), min(a + tile + hi, c1, k1))
        if rows[0] < rows[1] and keys[0] < keys[1]:
            out.append(Piece(*rows, *keys, BlockKind.PARTIAL))
    return out


def _within(rect: tuple[int, int, int, int], r0: int, r1: int, c0: int, c1: int) -> tuple[int, int, int, int]:
    q0, q1, k0, k1 = rect
    return max(q0, r0), min(q1, r1), max(k0, c0), min(k1, c1)


def _full_in(rect: tuple[int, int, int, int], r0: int, r1: int, c0: int, c1: int) -> list[Piece]:
    a, b, c, d = _within(rect, r0, r1, c0, c1)
    return [Piece(a, b, c, d, BlockKind.FULL)] if a < b and c < d else []


def _triangle_in(rect: tuple[int, int, int, int], r0: int, r1: int, c0: int, c1: int, delta: int,
                 flip: bool = False) -> list[Piece]:
    return triangle(*_within(rect, r0, r1, c0, c1), delta, flip)


def _cell_cover(rect: tuple[int, int, int, int], bs: int, codes: torch.Tensor) -> list[Piece] | None:
    """Cover from block cells: ``codes[i, j]`` (0 empty, 1 full, 2 causal on the cell's own corner) of
    the i-th query block against the j-th key block that ``rect`` meets, each cell of ``bs`` tokens a side."""
    nz = codes.nonzero()
    if nz.shape[0] > MAX_COVER_STEPS:
        return None
    qb0, kb0 = rect[0] // bs, rect[2] // bs
    out: list[Piece] = []
    for (i, j), code in zip(nz.tolist(), codes[nz[:, 0], nz[:, 1]].tolist()):
        qb, kb = qb0 + i, kb0 + j
        region = (qb * bs, (qb + 1) * bs, kb * bs, (kb + 1) * bs)
        out += _full_in(rect, *region) if code == 1 else _triangle_in(rect, *region, (kb - qb) * bs)
    return out


def _block_cover(rect: tuple[int, int, int, int], bs: int, mask_mod, causal: bool = False) -> list[Piece] | None:
    """Cover of a mask on blocks of ``bs`` tokens: ``mask_mod`` at the blocks' first tokens says which
    block pairs of ``rect`` attend (FULL); with ``causal``, those on the diagonal are CAUSAL."""
    q0, q1, k0, k1 = rect
    qb, kb = torch.arange(q0 // bs, (q1 - 1) // bs + 1).unsqueeze(1), torch.arange(k0 // bs, (k1 - 1) // bs + 1)
    codes = mask_mod(qb * bs, kb * bs).long()
    return _cell_cover(rect, bs, torch.where(qb == kb, 2 * codes, codes) if causal else codes)


def _col(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(1)


def _positive(name: str, value, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value

