"""The :class:`Mask` and :class:`IntervalMask` base classes and their combinations ``a & b``
(:class:`AndMask`) and ``a | b`` (:class:`OrMask`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from .base import BlockKind, Piece, _check_rect, _row_chunks


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
        """JSON-able description (``{"kind": ..., **arguments}``); :func:`from_spec` rebuilds the mask. A
        dataclass mask's arguments are its fields (those of its constructor, in :func:`from_spec`)."""
        if not dataclasses.is_dataclass(self):
            raise TypeError(f"mask {self.name!r} ({type(self).__name__}) has no JSON description")
        return {"kind": self.name, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}}

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
