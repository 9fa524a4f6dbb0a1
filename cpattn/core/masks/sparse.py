"""Block-sparse masks: streaming (sink plus window), star, global+local, strided and custom block
tables."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import (
    BAND_MAX_WINDOW,
    MAX_COVER_STEPS,
    BlockKind,
    _block_cover,
    _cell_cover,
    _col,
    _full_in,
    _positive,
    _triangle_in,
    band,
)
from .basic import SlidingWindowMask
from .mask import IntervalMask


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class GlobalLocalMask(IntervalMask):
    """UltraAttn "global+local" (bidirectional), on blocks of ``block_size`` tokens: query q attends key k
    when q's block is one of the first ``global_blocks`` (global rows), or k's block is (global
    columns), or ``|block(q) - block(k)| < local_blocks`` (a band around the diagonal)."""

    block_size: int
    global_blocks: int = 1
    local_blocks: int = 1
    name = "global_local"

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
        return _block_cover((q0, q1, k0, k1), self.block_size, self.mask_mod)


@dataclass(frozen=True)
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
        return _block_cover((q0, q1, k0, k1), self.block_size, self.mask_mod, self.causal)


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
        codes = torch.tensor(self.table, dtype=torch.long)[q0 // bs:(q1 - 1) // bs + 1, k0 // bs:(k1 - 1) // bs + 1]
        return _cell_cover((q0, q1, k0, k1), bs, codes)

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
