"""Seconds of the planner's kernels under the cost model, priced as the executor runs them (pure).

A FULL or CAUSAL kernel is one call over its rows x columns. A PARTIAL kernel (always one cell) runs
the mask's own cover of the cell (``cpattn.schedules.ultra``: :func:`cpattn.core.blocks.rectangles` over
the cell's original token ranges), its equal-shaped pieces stacked into one call per
:func:`cpattn.core.blocks.batches` batch. So it is priced as that cover: every piece at its own kind and
shape, one launch per batch. Pricing the cell as one dense masked rectangle instead overstated a
cell of many short documents or a narrow window band several times over. A mask without a cover of
its own (``mask_mod``, ``&`` / ``|``) keeps that one-rectangle price: its cells run as dense masked
tiles, and classifying them would cost the planner as much as the block table itself.
"""

from __future__ import annotations

from ..core import blocks
from ..core.layout import source_ranges
from ..core.masks import Mask
from ..core.steps import Kernel, Problem
from ..core.topology import Device
from .block_table import BlockTable


class Pricing:
    """Kernel seconds for one problem: ``mask`` over ``seq_len`` tokens (positions ``>= valid_len`` are
    padding), held by the ranks in ``order`` (None: contiguous; see :func:`source_ranges`), on
    ``device``. Covers are memoised per (chunk length, cell)."""

    def __init__(self, mask: Mask, seq_len: int, valid_len: int, order: tuple[int, ...] | None, device: Device,
                 problem: Problem) -> None:
        self.mask, self.seq_len, self.valid_len, self.order = mask, seq_len, valid_len, order
        self.device, self.problem = device, problem
        #: the mask has its own cover (documents, windows, tables...); without one (``mask_mod``,
        #: ``&`` / ``|``) the executor halves a PARTIAL cell into dense masked tiles, about what one
        #: masked rectangle costs, and classifying those tiles would cost the planner O(cell area)
        self.structured = type(mask).cover is not Mask.cover
        self._covers: dict[tuple[int, int, int], tuple[list[Kernel], int]] = {}
        self._seconds: dict[tuple[int, int, int, str], float] = {}

    def seconds(self, table: BlockTable, kind: str, rows: tuple[int, ...], cols: tuple[int, ...],
                phase: str) -> float:
        """One kernel of ``kind`` over ``table``'s chunks ``rows`` x ``cols`` in ``phase``."""
        if kind == "partial":
            if len(rows) != 1 or len(cols) != 1:
                raise ValueError(f"a partial kernel is one cell, got rows {rows} and cols {cols}")
            if self.structured:
                return self.cell(table.chunk, rows[0], cols[0], phase)
        c = table.chunk
        area = sum(table.area[i * table.n + j] for i in rows for j in cols)
        return self.device.kernel_time(Kernel(kind, len(rows) * c, len(cols) * c, area), self.problem, phase)

    def cell(self, chunk: int, i: int, j: int, phase: str) -> float:
        """The cover of cell (i, j) of a table of ``chunk``-token chunks: every piece's kernel time, less
        the launches that stacking saves."""
        key = (chunk, i, j, phase)
        if key not in self._seconds:
            pieces, calls = self._cover(chunk, i, j)
            self._seconds[key] = (sum(self.device.kernel_time(k, self.problem, phase) for k in pieces)
                                  - self.device.launch * (len(pieces) - calls))
        return self._seconds[key]

    def _cover(self, chunk: int, i: int, j: int) -> tuple[list[Kernel], int]:
        """The cover of cell (i, j) as kernels (shapes and pair counts, no masks) and its stacked calls."""
        if (chunk, i, j) not in self._covers:
            rows = source_ranges(i, chunk, self.seq_len, self.order)
            cols = source_ranges(j, chunk, self.seq_len, self.order)
            cover = blocks.rectangles(self.mask, rows, cols, self.valid_len, dense=False)
            pieces = [Kernel(b.kind.value, b.q.stop - b.q.start, b.kv.stop - b.kv.start, b.area) for b in cover]
            self._covers[(chunk, i, j)] = (pieces, len(blocks.batches(cover)))
        return self._covers[(chunk, i, j)]


__all__ = ["Pricing"]
