"""Attention masks over the *global* (query x key) matrix.

A mask answers two questions about any rectangle ``[q0, q1) x [k0, k1)`` of global positions:
``classify`` gives its :class:`BlockKind` without building anything of size S x S, and ``dense``
gives the boolean matrix (True = attend) of one rectangle. Schedules use ``classify`` to skip EMPTY
blocks and pick the fast kernel for FULL and CAUSAL ones; only PARTIAL rectangles are ever densified.

Two independent descriptions back every built-in mask:

- ``mask_mod(q_idx, kv_idx)``, the per-pair definition (FlexAttention convention, broadcasting index
  tensors). ``dense`` evaluates it on the rectangle's grid.
- ``intervals(q, k0, k1)``, the keys each query row attends as a union of a few ``[start, end)``
  intervals (:class:`IntervalMask`; document boundaries by ``searchsorted``, windows and blocks by
  arithmetic). ``classify``, ``count`` and ``row_counts`` sweep these intervals, vectorised over rows
  (in bounded chunks), so a rectangle of n rows costs O(n * intervals per row) and nothing of size
  n x m is built: a 1M-token sequence classifies in milliseconds to a fraction of a second.

Tests check the two against each other on random rectangles, and ``cpattn.verify`` has a third,
pair-by-pair definition of every kind for its reference. Masks combine with ``a & b`` (pairs both
allow) and ``a | b`` (pairs either allows). ``spec()`` / :func:`from_spec` turn a built-in mask into
JSON-able data and back. :func:`from_mask_mod` wraps any predicate (classified from its dense form,
O(rows x columns)).
"""

from __future__ import annotations

import enum
import operator
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import NamedTuple

import torch


class BlockKind(enum.Enum):
    """What a rectangle of the attention matrix looks like."""

    EMPTY = "empty"  # no (q, k) pair attends
    FULL = "full"  # every pair attends
    CAUSAL = "causal"  # square; local row i attends exactly local columns <= i
    PARTIAL = "partial"  # anything else: needs the dense mask


#: stands for "no upper bound" in key intervals (clamped to the rectangle before use)
_UNBOUNDED = 1 << 62
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


def _cell_cover(rect: tuple[int, int, int, int], bs: int, qb0: int, kb0: int,
                codes: torch.Tensor) -> list[Piece] | None:
    """Cover from block cells: ``codes[i, j]`` (0 empty, 1 full, 2 causal on the cell's own corner) of
    query block ``qb0 + i`` against key block ``kb0 + j``, each cell of ``bs`` tokens a side."""
    nz = codes.nonzero()
    if nz.shape[0] > MAX_COVER_STEPS:
        return None
    out: list[Piece] = []
    for (i, j), code in zip(nz.tolist(), codes[nz[:, 0], nz[:, 1]].tolist()):
        qb, kb = qb0 + i, kb0 + j
        region = (qb * bs, (qb + 1) * bs, kb * bs, (kb + 1) * bs)
        out += _full_in(rect, *region) if code == 1 else _triangle_in(rect, *region, (kb - qb) * bs)
    return out


def _block_range(a: int, b: int, bs: int) -> torch.Tensor:
    return torch.arange(a // bs, (b - 1) // bs + 1)


class Mask:
    """Base class. ``name`` identifies the kind of mask; ``is_causal`` is True when query i never
    attends a key j > i (lets causal-only schedules accept the mask); ``shift_invariant`` is True when
    whether query i attends key j depends on i - j alone (full, causal, sliding windows), so layouts
    that interleave ranks may share the classification of rank pairs at equal offsets.

    Subclasses give ``mask_mod`` (and so ``dense``) and ``classify``; the defaults of ``classify`` and
    ``row_counts`` evaluate ``dense`` in row chunks, which is exact but O(rows x columns).
    """

    name: str = "mask"
    is_causal: bool = False
    shift_invariant: bool = False

    def mask_mod(self, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """Per-pair definition: bool tensor, broadcasting ``q_idx`` against ``kv_idx`` (global positions)."""
        raise NotImplementedError

    def dense(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """Boolean ``[q1 - q0, k1 - k0]``; True where query attends key."""
        _check_rect(q0, q1, k0, k1)
        out = self.mask_mod(torch.arange(q0, q1).unsqueeze(1), torch.arange(k0, k1).unsqueeze(0))
        return torch.as_tensor(out, dtype=torch.bool).expand(q1 - q0, k1 - k0).contiguous()

    def classify(self, q0: int, q1: int, k0: int, k1: int) -> BlockKind:
        _check_rect(q0, q1, k0, k1)
        return _classify_dense(self, q0, q1, k0, k1)

    def cover(self, q0: int, q1: int, k0: int, k1: int) -> list[Piece] | None:
        """Pieces that cover exactly the allowed pairs of the rectangle, each pair once, as few FULL and
        CAUSAL :class:`Piece` s as the mask's own structure gives (document squares, window bands, table
        cells); None when the mask has none to offer (the caller then halves the rectangle)."""
        return None

    def row_counts(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """LongTensor ``[q1 - q0]``: how many keys of ``[k0, k1)`` each query row attends."""
        _check_rect(q0, q1, k0, k1)
        return torch.cat([self.dense(r0, r1, k0, k1).sum(1) for r0, r1 in _row_chunks(q0, q1, k1 - k0)])

    def count(self, q0: int, q1: int, k0: int, k1: int) -> int:
        """Number of allowed (query, key) pairs in the rectangle."""
        return int(self.row_counts(q0, q1, k0, k1).sum())

    def check_seq_len(self, seq_len: int) -> None:
        """Raise ``ValueError`` if the mask cannot describe a sequence of ``seq_len`` tokens."""

    def spec(self) -> dict:
        """JSON-able description (``{"kind": ..., **arguments}``); :func:`from_spec` rebuilds the mask."""
        raise TypeError(f"mask {self.name!r} ({type(self).__name__}) has no JSON description")

    def __and__(self, other: Mask) -> Mask:
        return AndMask(self, _as_mask(other))

    def __or__(self, other: Mask) -> Mask:
        return OrMask(self, _as_mask(other))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _as_mask(m) -> Mask:
    if not isinstance(m, Mask):
        raise TypeError(f"masks combine with masks, got {type(m).__name__}")
    return m


def _classify_dense(mask: Mask, q0: int, q1: int, k0: int, k1: int) -> BlockKind:
    """Exact classification from ``mask.dense`` in row chunks (memory bounded, time O(rows x cols))."""
    any_true, all_true = False, True
    causal_ok = (q1 - q0) == (k1 - k0)
    for r0, r1 in _row_chunks(q0, q1, k1 - k0):
        part = mask.dense(r0, r1, k0, k1)
        any_true = any_true or bool(part.any())
        all_true = all_true and bool(part.all())
        if causal_ok:
            local_q = torch.arange(r0 - q0, r1 - q0).unsqueeze(1)
            causal_ok = torch.equal(part, torch.arange(k1 - k0).unsqueeze(0) <= local_q)
        if any_true and not all_true and not causal_ok:
            return BlockKind.PARTIAL
    if not any_true:
        return BlockKind.EMPTY
    if all_true:
        return BlockKind.FULL
    return BlockKind.CAUSAL if causal_ok else BlockKind.PARTIAL


def _sweep_intervals(starts: torch.Tensor, ends: torch.Tensor, k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of key intervals ``[n, width]`` -> (allowed keys of ``[k0, k1)`` per row, largest allowed key
    + 1 per row, or k0 when the row attends nothing there)."""
    s, e = starts.clamp(k0, k1), ends.clamp(k0, k1)
    live = e > s
    s, e = torch.where(live, s, k0), torch.where(live, e, k0)
    if s.shape[1] == 1:
        return (e - s)[:, 0], e[:, 0]
    s, order = s.sort(dim=1)
    e = e.gather(1, order)
    reach = torch.full((s.shape[0],), k0, dtype=torch.long)
    counts = torch.zeros(s.shape[0], dtype=torch.long)
    for j in range(s.shape[1]):  # sorted by start: what lies beyond the reach so far is new
        counts += (e[:, j] - torch.maximum(s[:, j], reach)).clamp(min=0)
        reach = torch.maximum(reach, e[:, j])
    return counts, reach


class IntervalMask(Mask):
    """A mask whose query row q attends a union of key intervals ``[start, end)``.

    ``intervals(q, k0, k1)`` maps a LongTensor of query positions ``[n]`` to ``(starts, ends)``, each
    ``[n, width(k0, k1)]``; it must list every interval that meets ``[k0, k1)`` and may list others.
    Empty intervals (``end <= start``) pad rows; intervals may overlap and be unsorted. Per rectangle,
    the intervals are clamped to ``[k0, k1)``, sorted and swept once per row chunk: the size of the
    union per row (``row_counts``) and its largest end decide the kind exactly: EMPTY (every row 0),
    FULL (every row ``k1 - k0``), CAUSAL (square, row i covers exactly ``[k0, k0 + i + 1)``), else
    PARTIAL.
    """

    def width(self, k0: int, k1: int) -> int:
        """Upper bound on the intervals per row that ``intervals(q, k0, k1)`` returns."""
        return 1

    def intervals(self, q: torch.Tensor, k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _sweep(self, q0: int, q1: int, k0: int, k1: int) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        for r0, r1 in _row_chunks(q0, q1, self.width(k0, k1)):
            yield (r0, r1, *_sweep_intervals(*self.intervals(torch.arange(r0, r1), k0, k1), k0, k1))

    def classify(self, q0: int, q1: int, k0: int, k1: int) -> BlockKind:
        _check_rect(q0, q1, k0, k1)
        return self._classify_intervals(q0, q1, k0, k1)

    def _classify_intervals(self, q0: int, q1: int, k0: int, k1: int) -> BlockKind:
        m = k1 - k0
        any_true, all_full, causal_ok = False, True, (q1 - q0) == m
        for r0, r1, counts, reach in self._sweep(q0, q1, k0, k1):
            any_true = any_true or bool((counts > 0).any())
            all_full = all_full and bool((counts == m).all())
            if causal_ok:
                want = torch.arange(r0 - q0 + 1, r1 - q0 + 1)  # row i: i + 1 keys, none past k0 + i
                causal_ok = bool((counts == want).all()) and bool((reach == k0 + want).all())
            if any_true and not all_full and not causal_ok:
                return BlockKind.PARTIAL
        if not any_true:
            return BlockKind.EMPTY
        if all_full:
            return BlockKind.FULL
        return BlockKind.CAUSAL if causal_ok else BlockKind.PARTIAL

    def row_counts(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        _check_rect(q0, q1, k0, k1)
        return torch.cat([counts for _, _, counts, _ in self._sweep(q0, q1, k0, k1)])


def _col(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(1)


def _positive(name: str, value, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


# ---------------------------------------------------------------------------------- built-in masks
@dataclass(frozen=True, repr=False)
class FullMask(IntervalMask):
    name = "full"
    is_causal = False
    shift_invariant = True

    def classify(self, q0: int, q1: int, k0: int, k1: int) -> BlockKind:
        _check_rect(q0, q1, k0, k1)
        return BlockKind.FULL

    def mask_mod(self, q_idx, kv_idx):
        return torch.ones(torch.broadcast_shapes(q_idx.shape, kv_idx.shape), dtype=torch.bool)

    def intervals(self, q, k0, k1):
        return _col(torch.full_like(q, k0)), _col(torch.full_like(q, k1))

    def spec(self) -> dict:
        return {"kind": "full"}


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

    def spec(self) -> dict:
        return {"kind": "causal"}


@dataclass(frozen=True, repr=False)
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

    def spec(self) -> dict:
        return {"kind": "sliding_window", "window": self.window, "causal": self.causal}

    def __repr__(self) -> str:
        return f"SlidingWindowMask(window={self.window}, causal={self.causal})"


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


@dataclass(frozen=True, repr=False)
class StreamingMask(IntervalMask):
    """StreamingLLM / UltraAttn "stream": positions grouped in blocks of ``block_size`` tokens (the block
    of position p is ``p // block_size``). Query q attends key k when ``k <= q`` and either k's block is
    one of the first ``sink`` blocks (the sink column) or ``block(q) - block(k) < window`` (the query's
    own block, causally, and the ``window - 1`` blocks before it). ``block_size=1`` is the token form:
    the first ``sink`` tokens plus the last ``window`` tokens."""

    sink: int
    window: int
    block_size: int = 1
    name = "streaming"
    is_causal = True

    def __post_init__(self) -> None:
        _positive(f"{self.name} sink", self.sink, minimum=0)
        _positive(f"{self.name} window", self.window)
        _positive(f"{self.name} block_size", self.block_size)

    def width(self, k0: int, k1: int) -> int:
        return 2

    def mask_mod(self, q_idx, kv_idx):
        qb, kb = q_idx // self.block_size, kv_idx // self.block_size
        return (kv_idx <= q_idx) & ((kb < self.sink) | (qb - kb < self.window))

    def intervals(self, q, k0, k1):
        bs = self.block_size
        sink_end = torch.minimum(torch.full_like(q, self.sink * bs), q + 1)
        local_start = ((q // bs - self.window + 1) * bs).clamp(min=0)
        return torch.stack([torch.zeros_like(q), local_start], 1), torch.stack([sink_end, q + 1], 1)

    def cover(self, q0, q1, k0, k1):
        """Token form: the causal sliding window's cover plus the sink keys before the window (pairs
        ``k < sink``, ``k <= q - window``: a shifted triangle); for a window narrower than
        :data:`BAND_MAX_WINDOW`, band tiles over the keys from ``sink`` on plus every causal pair of the
        sink keys (the tiles' masks then hold only window pairs). Block form: per query block, the sink keys
        before its window and its window's earlier blocks FULL, its own block CAUSAL."""
        bs, w, rect = self.block_size, self.window, (q0, q1, k0, k1)
        if bs == 1:
            if w < BAND_MAX_WINDOW:  # band tiles over the keys past the sink, every causal pair before it
                tiles = band(rect, q0, q1, max(k0, self.sink), k1, w - 1, 0)
                return None if tiles is None else tiles + _triangle_in(rect, 0, q1, 0, self.sink, 0)
            out = SlidingWindowMask(w).cover(q0, q1, k0, k1)
            return None if out is None else out + _triangle_in(rect, 0, q1, 0, self.sink, -w)
        qbs = range(q0 // bs, (q1 - 1) // bs + 1)
        if len(qbs) > MAX_COVER_STEPS:
            return None
        out = []
        for qb in qbs:
            a, b = qb * bs, (qb + 1) * bs
            local = max(0, qb - w + 1) * bs
            out += _full_in(rect, a, b, 0, min(self.sink * bs, local))
            out += _full_in(rect, a, b, local, a)
            out += _triangle_in(rect, a, b, a, b, 0)
        return out

    def spec(self) -> dict:
        return {"kind": "streaming", "sink": self.sink, "window": self.window, "block_size": self.block_size}

    def __repr__(self) -> str:
        return f"StreamingMask(sink={self.sink}, window={self.window}, block_size={self.block_size})"


@dataclass(frozen=True, repr=False)
class StarMask(StreamingMask):
    """UltraAttn "star": the sink column plus the causal diagonal block, i.e. :class:`StreamingMask` with
    ``window=1``: query q attends key k when ``k <= q`` and (``block(k) < sink`` or
    ``block(k) == block(q)``)."""

    name = "star"

    def spec(self) -> dict:
        return {"kind": "star", "block_size": self.block_size, "sink": self.sink}

    def __repr__(self) -> str:
        return f"StarMask(block_size={self.block_size}, sink={self.sink})"


@dataclass(frozen=True, repr=False)
class GlobalLocalMask(IntervalMask):
    """UltraAttn "global+local" (bidirectional), on blocks of ``block_size`` tokens: query q attends key k
    when q's block is one of the first ``global_blocks`` (global rows), or k's block is (global
    columns), or ``|block(q) - block(k)| < local_blocks`` (a band around the diagonal)."""

    block_size: int
    global_blocks: int = 1
    local_blocks: int = 1
    name = "global_local"
    is_causal = False

    def __post_init__(self) -> None:
        _positive("global_local block_size", self.block_size)
        _positive("global_local global_blocks", self.global_blocks, minimum=0)
        _positive("global_local local_blocks", self.local_blocks)

    def width(self, k0: int, k1: int) -> int:
        return 2

    def mask_mod(self, q_idx, kv_idx):
        qb, kb = q_idx // self.block_size, kv_idx // self.block_size
        g = self.global_blocks
        return (qb < g) | (kb < g) | ((qb - kb).abs() < self.local_blocks)

    def intervals(self, q, k0, k1):
        bs, g, w = self.block_size, self.global_blocks, self.local_blocks
        qb = q // bs
        is_global = qb < g
        band_start = torch.where(is_global, k0, ((qb - w + 1) * bs).clamp(min=0))
        band_end = torch.where(is_global, k1, (qb + w) * bs)
        return (torch.stack([torch.zeros_like(q), band_start], 1),
                torch.stack([torch.full_like(q, g * bs), band_end], 1))

    def cover(self, q0, q1, k0, k1):
        qb, kb = _block_range(q0, q1, self.block_size).unsqueeze(1), _block_range(k0, k1, self.block_size)
        g = self.global_blocks
        ok = (qb < g) | (kb < g) | ((qb - kb).abs() < self.local_blocks)
        return _cell_cover((q0, q1, k0, k1), self.block_size, int(qb[0]), int(kb[0]), ok.long())

    def spec(self) -> dict:
        return {"kind": "global_local", "block_size": self.block_size, "global_blocks": self.global_blocks,
                "local_blocks": self.local_blocks}

    def __repr__(self) -> str:
        return (f"GlobalLocalMask(block_size={self.block_size}, global_blocks={self.global_blocks}, "
                f"local_blocks={self.local_blocks})")


@dataclass(frozen=True, repr=False)
class StridedMask(IntervalMask):
    """Strided (banded groups), on blocks of ``block_size`` tokens, with ``dq = block(q) - block(k)``:
    query q attends key k when ``|dq| < local`` (a band of ``local`` blocks each side of the diagonal,
    the diagonal included) or ``dq`` is a multiple of ``stride`` (a band every ``stride`` blocks).
    When ``causal``, only keys ``k <= q`` (the diagonal block is causal).

    A row meets one band block per ``stride`` blocks of a rectangle, so a rectangle of n rows and m
    columns costs O(n x (1 + m / (block_size * stride))).
    """

    block_size: int
    stride: int
    local: int = 1
    causal: bool = True
    name = "strided"

    def __post_init__(self) -> None:
        _positive("strided block_size", self.block_size)
        _positive("strided stride", self.stride, minimum=2)
        _positive("strided local", self.local)

    @property
    def is_causal(self) -> bool:
        return self.causal

    def _span(self, k0: int, k1: int) -> int:
        """Candidate band blocks per side that can meet ``[k0, k1)``."""
        return ((k1 - 1) // self.block_size - k0 // self.block_size) // self.stride + 2

    def width(self, k0: int, k1: int) -> int:
        return 1 + (1 if self.causal else 2) * self._span(k0, k1)

    def mask_mod(self, q_idx, kv_idx):
        dq = q_idx // self.block_size - kv_idx // self.block_size
        ok = (dq.abs() < self.local) | (dq % self.stride == 0)
        return ok & (kv_idx <= q_idx) if self.causal else ok

    def intervals(self, q, k0, k1):
        bs, st = self.block_size, self.stride
        qb = q // bs
        lo_b, hi_b = k0 // bs, (k1 - 1) // bs
        steps = torch.arange(self._span(k0, k1)).unsqueeze(0)
        m_below = torch.div(qb - hi_b + st - 1, st, rounding_mode="floor").clamp(min=1)
        blocks = [_col(qb) - (_col(m_below) + steps) * st]  # qb - m * stride, m >= 1, from hi_b down
        if not self.causal:
            m_above = torch.div(lo_b - qb + st - 1, st, rounding_mode="floor").clamp(min=1)
            blocks.append(_col(qb) + (_col(m_above) + steps) * st)
        b = torch.cat(blocks, 1)
        keep = (b >= lo_b) & (b <= hi_b)
        band_start = ((qb - self.local + 1) * bs).clamp(min=0)
        band_end = q + 1 if self.causal else (qb + self.local) * bs
        return (torch.cat([_col(band_start), torch.where(keep, b * bs, 0)], 1),
                torch.cat([_col(band_end), torch.where(keep, (b + 1) * bs, 0)], 1))

    def cover(self, q0, q1, k0, k1):
        qb, kb = _block_range(q0, q1, self.block_size).unsqueeze(1), _block_range(k0, k1, self.block_size)
        dq = qb - kb
        codes = ((dq.abs() < self.local) | (dq % self.stride == 0)).long()
        if self.causal:
            codes = torch.where(dq < 0, 0, torch.where(dq == 0, 2 * codes, codes))
        return _cell_cover((q0, q1, k0, k1), self.block_size, int(qb[0]), int(kb[0]), codes)

    def spec(self) -> dict:
        return {"kind": "strided", "block_size": self.block_size, "stride": self.stride, "local": self.local,
                "causal": self.causal}

    def __repr__(self) -> str:
        return (f"StridedMask(block_size={self.block_size}, stride={self.stride}, local={self.local}, "
                f"causal={self.causal})")


_CELL_CODES = {0: 0, 1: 1, 2: 2, "empty": 0, "full": 1, "causal": 2,
               BlockKind.EMPTY: 0, BlockKind.FULL: 1, BlockKind.CAUSAL: 2}


@dataclass(frozen=True, repr=False)
class BlockTableMask(IntervalMask):
    """A custom block pattern: ``table[i][j]`` (0 / "empty", 1 / "full", 2 / "causal") says how the query
    block i (positions ``[i * block_size, (i + 1) * block_size)``) attends the key block j. A causal cell
    is the lower triangle aligned on the cell's own corner: local row a attends local columns <= a.
    Positions outside the table attend nothing and are attended by nothing.

    Each table row is stored as runs (consecutive full cells fused, causal cells on their own), so a
    row costs one interval per run.
    """

    table: tuple[tuple[int, ...], ...]
    block_size: int
    name = "block_table"
    _runs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _positive("block_table block_size", self.block_size)
        rows = [list(r) for r in self.table]
        if not rows or not rows[0] or any(len(r) != len(rows[0]) for r in rows):
            raise ValueError("block_table table must be a non-empty rectangular list of rows")
        try:
            codes = tuple(tuple(_CELL_CODES[c if not isinstance(c, str) else c.lower()] for c in r) for r in rows)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"block_table cells must be 0/'empty', 1/'full' or 2/'causal'; got {exc}") from None
        object.__setattr__(self, "table", codes)
        t = torch.tensor(codes, dtype=torch.int8)
        full, causal = t == 1, t == 2
        starts = full & ~torch.nn.functional.pad(full, (1, 0))[:, :-1]
        ends = full & ~torch.nn.functional.pad(full, (0, 1))[:, 1:]
        fr, fc = starts.nonzero(as_tuple=True)
        _, fe = ends.nonzero(as_tuple=True)  # row-major order: the i-th end closes the i-th run
        cr, cc = causal.nonzero(as_tuple=True)
        row = torch.cat([fr, cr])
        row, order = row.sort(stable=True)
        first = torch.cat([fc, cc])[order]
        last = torch.cat([fe + 1, cc + 1])[order]
        is_causal_run = (torch.arange(row.numel()) >= fc.numel())[order]
        per_row = torch.bincount(row, minlength=t.shape[0])
        width = max(1, int(per_row.max()) if row.numel() else 1)
        slot = torch.arange(row.numel()) - (per_row.cumsum(0) - per_row)[row]
        sb = torch.zeros(t.shape[0], width, dtype=torch.long)
        eb = torch.zeros(t.shape[0], width, dtype=torch.long)
        cz = torch.zeros(t.shape[0], width, dtype=torch.bool)
        sb[row, slot], eb[row, slot], cz[row, slot] = first, last, is_causal_run
        object.__setattr__(self, "_runs", (sb, eb, cz))

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.table), len(self.table[0])

    @property
    def is_causal(self) -> bool:
        t = torch.tensor(self.table)
        above = torch.ones_like(t, dtype=torch.bool).triu(1)
        diag_full = (t.diagonal() == 1).any() and self.block_size > 1
        return not bool((t[above] != 0).any()) and not bool(diag_full)

    def width(self, k0: int, k1: int) -> int:
        return self._runs[0].shape[1]

    def mask_mod(self, q_idx, kv_idx):
        bs = self.block_size
        n, m = self.shape
        qb, kb = q_idx // bs, kv_idx // bs
        inside = (qb < n) & (kb < m)
        cell = torch.tensor(self.table, dtype=torch.int8)[qb.clamp(max=n - 1), kb.clamp(max=m - 1)]
        cell = torch.where(inside, cell, 0)
        return (cell == 1) | ((cell == 2) & (q_idx - qb * bs >= kv_idx - kb * bs))

    def intervals(self, q, k0, k1):
        bs = self.block_size
        sb, eb, cz = self._runs
        qb = q // bs
        inside = _col(qb < sb.shape[0])
        rows = qb.clamp(max=sb.shape[0] - 1)
        s, e, c = sb[rows] * bs, eb[rows] * bs, cz[rows]
        e = torch.where(c, s + _col(q - qb * bs) + 1, e)
        return torch.where(inside, s, 0), torch.where(inside, e, 0)

    def cover(self, q0, q1, k0, k1):
        bs = self.block_size
        qb0, kb0 = q0 // bs, k0 // bs
        codes = torch.tensor(self.table, dtype=torch.long)[qb0:(q1 - 1) // bs + 1, kb0:(k1 - 1) // bs + 1]
        return _cell_cover((q0, q1, k0, k1), bs, qb0, kb0, codes)

    def check_seq_len(self, seq_len: int) -> None:
        n, m = self.shape
        if min(n, m) * self.block_size < seq_len:
            raise ValueError(f"block_table is {n} x {m} blocks of {self.block_size} tokens; it covers "
                             f"{min(n, m) * self.block_size} tokens, but seq_len is {seq_len}")

    def spec(self) -> dict:
        return {"kind": "block_table", "table": [list(r) for r in self.table], "block_size": self.block_size}

    def __repr__(self) -> str:
        n, m = self.shape
        return f"BlockTableMask({n} x {m} blocks of {self.block_size})"


class _Combination(IntervalMask):
    """``a & b`` / ``a | b``. Interval masks combine interval by interval (intersections of their
    intervals, or all of them), so the result classifies exactly and fast; with any other mask the
    combination classifies from its dense form (exact, O(rows x columns)). Either way the kinds of the
    two sides settle most rectangles first (EMPTY & x = EMPTY, FULL | x = FULL, ...)."""

    symbol = "&"

    def __init__(self, a: Mask, b: Mask) -> None:
        self.a, self.b = a, b
        self.name = f"{a.name}{self.symbol}{b.name}"
        self._by_intervals = isinstance(a, IntervalMask) and isinstance(b, IntervalMask)

    def __eq__(self, other: object) -> bool:  # by value, as every mask: caches key on masks
        return type(other) is type(self) and (other.a, other.b) == (self.a, self.b)

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.a, self.b))

    def _shortcut(self, ka: BlockKind, kb: BlockKind) -> BlockKind | None:
        raise NotImplementedError

    def classify(self, q0: int, q1: int, k0: int, k1: int) -> BlockKind:
        _check_rect(q0, q1, k0, k1)
        kind = self._shortcut(self.a.classify(q0, q1, k0, k1), self.b.classify(q0, q1, k0, k1))
        if kind is not None:
            return kind
        if self._by_intervals:
            return self._classify_intervals(q0, q1, k0, k1)
        return _classify_dense(self, q0, q1, k0, k1)

    def row_counts(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        if self._by_intervals:
            return IntervalMask.row_counts(self, q0, q1, k0, k1)
        return Mask.row_counts(self, q0, q1, k0, k1)

    def check_seq_len(self, seq_len: int) -> None:
        self.a.check_seq_len(seq_len)
        self.b.check_seq_len(seq_len)

    def spec(self) -> dict:
        return {"kind": "and" if self.symbol == "&" else "or", "masks": [self.a.spec(), self.b.spec()]}

    def __repr__(self) -> str:
        return f"({self.a!r} {self.symbol} {self.b!r})"


class AndMask(_Combination):
    """Pairs both masks allow."""

    symbol = "&"

    @property
    def is_causal(self) -> bool:
        return self.a.is_causal or self.b.is_causal

    def _shortcut(self, ka, kb):
        if BlockKind.EMPTY in (ka, kb):
            return BlockKind.EMPTY
        if ka == BlockKind.FULL:
            return kb
        if kb == BlockKind.FULL or ka == kb == BlockKind.CAUSAL:
            return ka
        return None

    def mask_mod(self, q_idx, kv_idx):
        return self.a.mask_mod(q_idx, kv_idx) & self.b.mask_mod(q_idx, kv_idx)

    def width(self, k0, k1):
        return self.a.width(k0, k1) * self.b.width(k0, k1)

    def intervals(self, q, k0, k1):
        sa, ea = self.a.intervals(q, k0, k1)
        sb, eb = self.b.intervals(q, k0, k1)
        n = q.shape[0]
        return (torch.maximum(sa.unsqueeze(2), sb.unsqueeze(1)).reshape(n, -1),
                torch.minimum(ea.unsqueeze(2), eb.unsqueeze(1)).reshape(n, -1))


class OrMask(_Combination):
    """Pairs either mask allows."""

    symbol = "|"

    @property
    def is_causal(self) -> bool:
        return self.a.is_causal and self.b.is_causal

    def _shortcut(self, ka, kb):
        if BlockKind.FULL in (ka, kb):
            return BlockKind.FULL
        if ka == BlockKind.EMPTY:
            return kb
        if kb == BlockKind.EMPTY or ka == kb == BlockKind.CAUSAL:
            return ka
        return None

    def mask_mod(self, q_idx, kv_idx):
        return self.a.mask_mod(q_idx, kv_idx) | self.b.mask_mod(q_idx, kv_idx)

    def width(self, k0, k1):
        return self.a.width(k0, k1) + self.b.width(k0, k1)

    def intervals(self, q, k0, k1):
        sa, ea = self.a.intervals(q, k0, k1)
        sb, eb = self.b.intervals(q, k0, k1)
        return torch.cat([sa, sb], 1), torch.cat([ea, eb], 1)


def has_intervals(mask: Mask) -> bool:
    """Whether ``mask`` lists the key intervals of each row (``IntervalMask.intervals``): an interval
    mask, or a combination (``&``, ``|``) of two of them; a ``from_mask_mod`` mask anywhere in it does
    not."""
    return isinstance(mask, IntervalMask) and getattr(mask, "_by_intervals", True)


class MaskModMask(Mask):
    """A mask given by ``fn(q_idx, kv_idx) -> bool tensor`` (FlexAttention convention).

    Classification evaluates ``fn`` on the rectangle only, in row chunks, so memory stays bounded; time
    is O(rows x columns), so prefer a built-in mask (or a combination of them) at long sequence lengths.
    """

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], name: str = "mask_mod",
                 is_causal: bool = False) -> None:
        if not callable(fn):
            raise TypeError(f"from_mask_mod expects a callable fn(q_idx, kv_idx), got {type(fn).__name__}")
        self.fn = fn
        self.name = name
        self.is_causal = is_causal

    def mask_mod(self, q_idx, kv_idx):
        return self.fn(q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"MaskModMask(name={self.name!r})"


def allowed_pairs(mask: Mask, seq_len: int) -> int:
    """Number of (query, key) pairs that attend over a sequence of ``seq_len`` (no S x S tensor)."""
    return mask.count(0, seq_len, 0, seq_len)


# ---------------------------------------------------------------------------------- constructors
def full() -> Mask:
    """Bidirectional attention: every query attends every key."""
    return FullMask()


def causal() -> Mask:
    """Causal attention over global positions: query i attends key j <= i."""
    return CausalMask()


def sliding_window(window: int, causal: bool = True) -> Mask:
    """See :class:`SlidingWindowMask`: the last ``window`` keys (causal) or ``|q - k| < window``."""
    return SlidingWindowMask(window, causal)


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


def strided(block_size: int, stride: int, local: int = 1, causal: bool = True) -> Mask:
    """See :class:`StridedMask`: a diagonal band of ``local`` blocks plus a band every ``stride`` blocks."""
    return StridedMask(block_size, stride, local, causal)


def global_local(block_size: int, global_blocks: int = 1, local_blocks: int = 1) -> Mask:
    """See :class:`GlobalLocalMask`: global first rows and columns plus a diagonal band (bidirectional)."""
    return GlobalLocalMask(block_size, global_blocks, local_blocks)


def star(block_size: int, sink: int = 1) -> Mask:
    """See :class:`StarMask`: the first ``sink`` blocks plus the causal diagonal block."""
    return StarMask(sink, 1, block_size)


def streaming(sink: int, window: int, block_size: int = 1) -> Mask:
    """See :class:`StreamingMask`: ``sink`` first blocks plus the last ``window`` blocks, causally."""
    return StreamingMask(sink, window, block_size)


def block_table(table, block_size: int) -> Mask:
    """See :class:`BlockTableMask`: ``table[i][j]`` in {0/"empty", 1/"full", 2/"causal"} per block pair."""
    return BlockTableMask(tuple(tuple(r) for r in table), block_size)


def from_mask_mod(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], name: str = "mask_mod",
                  is_causal: bool = False) -> Mask:
    """Wrap ``fn(q_idx, kv_idx) -> bool tensor`` (broadcasting index tensors) as a :class:`Mask`."""
    return MaskModMask(fn, name=name, is_causal=is_causal)


_KINDS: dict[str, Callable[..., Mask]] = {
    "full": full, "causal": causal, "sliding_window": sliding_window, "document": document,
    "strided": strided, "global_local": global_local, "star": star, "streaming": streaming,
    "block_table": block_table,
}
#: every ``kind`` :func:`from_spec` accepts
KINDS = (*_KINDS, "and", "or")


def from_spec(spec: dict | str) -> Mask:
    """Rebuild a mask from :meth:`Mask.spec` data: ``{"kind": name, **arguments}`` (or just the name of
    a mask without arguments); ``{"kind": "and" | "or", "masks": [spec, spec, ...]}`` combines."""
    if isinstance(spec, str):
        spec = {"kind": spec}
    if not isinstance(spec, dict) or spec.get("kind") not in KINDS:
        got = spec.get("kind") if isinstance(spec, dict) else spec
        raise ValueError(f"mask kind {got!r} is unknown; accepted: {', '.join(KINDS)}")
    args = {k: v for k, v in spec.items() if k != "kind"}
    kind = spec["kind"]
    if kind in ("and", "or"):
        parts = [from_spec(s) for s in args.get("masks", [])]
        if len(parts) < 2 or set(args) != {"masks"}:
            raise ValueError(f"a {kind!r} mask spec needs 'masks': a list of at least two mask specs")
        out = parts[0]
        for p in parts[1:]:
            out = (out & p) if kind == "and" else (out | p)
        return out
    try:
        return _KINDS[kind](**args)
    except TypeError as exc:
        raise ValueError(f"bad arguments for mask {kind!r}: {exc}") from None


def has_documents(mask: Mask) -> bool:
    """Whether ``mask`` packs documents: a :class:`DocumentMask`, or a combination with one."""
    if isinstance(mask, DocumentMask):
        return True
    return isinstance(mask, _Combination) and (has_documents(mask.a) or has_documents(mask.b))


def resolve(mask: Mask | str | dict) -> Mask:
    """Accept a :class:`Mask`, the strings ``"causal"`` / ``"full"``, or a :func:`from_spec` dict."""
    if isinstance(mask, Mask):
        return mask
    if mask == "causal":
        return causal()
    if mask == "full":
        return full()
    if isinstance(mask, dict):
        return from_spec(mask)
    raise ValueError(f"mask={mask!r} is not a Mask; accepted: a cpattn.masks.Mask, 'causal', 'full' or a "
                     "mask spec dict (cpattn.masks.from_spec)")
