"""The block table of a mask: the global (Q x KV) matrix cut into ``n x n`` equal chunks
(docs/ultraattn.md, "Ownership").

Cell ``(i, j)`` is query chunk i against key chunk j, each ``chunk`` tokens. Its kind is EMPTY, FULL,
CAUSAL (local row a attends local columns <= a: the diagonal of a causal mask, or a custom table's
causal cell anywhere) or PARTIAL, and its compute weight is EMPTY 0, FULL 1, CAUSAL 0.5, PARTIAL its
allowed fraction. Weights are kept as integers in :data:`WORK_UNIT` units so
the partition ILP has integer coefficients. The table is plain data: it identifies the pattern a plan
was made for (:meth:`BlockTable.digest`), whatever Python object the mask is.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ..core import memo
from ..core.masks import BlockKind, Mask

#: integer work of a FULL cell; CAUSAL is half of it, PARTIAL its allowed fraction of it (at least 1)
WORK_UNIT = 1000
KINDS = tuple(k.value for k in BlockKind)  # "empty", "full", "causal", "partial"


def _area(kind: str, chunk: int) -> int | None:
    """Allowed pairs of an EMPTY, FULL or CAUSAL cell of ``chunk`` tokens a side; None for PARTIAL."""
    return {"empty": 0, "full": chunk * chunk, "causal": chunk * (chunk + 1) // 2}.get(kind)


@dataclass(frozen=True)
class BlockTable:
    """``n x n`` cells of ``chunk`` tokens each. ``kinds`` and ``area`` are row-major, length ``n * n``:
    a cell's kind (a :class:`~cpattn.masks.BlockKind` value) and its allowed (query, key) pairs."""

    n: int
    chunk: int
    kinds: tuple[str, ...]
    area: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.n < 1 or self.chunk < 1:
            raise ValueError(f"a block table needs n >= 1 and chunk >= 1, got n={self.n} chunk={self.chunk}")
        if len(self.kinds) != self.n * self.n or len(self.area) != self.n * self.n:
            raise ValueError(f"a block table of n={self.n} needs {self.n * self.n} kinds and areas, "
                             f"got {len(self.kinds)} and {len(self.area)}")
        full = self.chunk * self.chunk
        for idx, (kind, area) in enumerate(zip(self.kinds, self.area)):
            i, j = divmod(idx, self.n)
            if kind not in KINDS:
                raise ValueError(f"cell ({i}, {j}) has kind {kind!r}; accepted: {', '.join(KINDS)}")
            expected = _area(kind, self.chunk)
            if expected is not None and area != expected:
                raise ValueError(f"cell ({i}, {j}) is {kind} but has area {area}, expected {expected}")
            if kind == "partial" and not 0 < area < full:
                raise ValueError(f"cell ({i}, {j}) is partial with area {area}, outside (0, {full})")

    def kind(self, i: int, j: int) -> str:
        return self.kinds[i * self.n + j]

    def work(self, i: int, j: int) -> int:
        """Compute weight of cell (i, j) in units of ``1 / WORK_UNIT`` FULL cells."""
        kind = self.kind(i, j)
        if kind == "partial":
            return max(1, round(WORK_UNIT * self.area[i * self.n + j] / (self.chunk * self.chunk)))
        return {"empty": 0, "full": WORK_UNIT, "causal": WORK_UNIT // 2}[kind]

    def cells(self) -> list[tuple[int, int]]:
        """Non-empty cells, row-major."""
        return [divmod(idx, self.n) for idx, k in enumerate(self.kinds) if k != "empty"]

    def coarsen(self, r: int) -> BlockTable:
        """The same pattern in chunks ``r`` times larger (``r`` divides ``n``): a cell is FULL or EMPTY
        when all its sub-cells are, CAUSAL when they form a lower triangle (causal sub-cells on its
        diagonal, full below, empty above), else PARTIAL; areas add up."""
        if r < 1 or self.n % r:
            raise ValueError(f"cannot coarsen {self.n} chunks by {r}")
        n = self.n // r
        kinds, areas = [], []
        for big_i in range(n):
            for big_j in range(n):
                subs = [(a, b) for a in range(big_i * r, (big_i + 1) * r) for b in range(big_j * r, (big_j + 1) * r)]
                sub_kinds = {self.kind(a, b) for a, b in subs}
                kinds.append(sub_kinds.pop() if len(sub_kinds) == 1 and sub_kinds <= {"empty", "full"} else
                             "causal" if self.causal_square(big_i * r, big_j * r, r) else "partial")
                areas.append(sum(self.area[a * self.n + b] for a, b in subs))
        return BlockTable(n, self.chunk * r, tuple(kinds), tuple(areas))

    def causal_square(self, i0: int, j0: int, size: int) -> bool:
        """Whether the ``size x size`` cells from (i0, j0) form one lower triangle: causal cells on its
        diagonal, full below, empty above."""
        return all(self.kind(i0 + a, j0 + b) == ("causal" if a == b else "full" if a > b else "empty")
                   for a in range(size) for b in range(size))

    def as_dict(self) -> dict:
        return {"n": self.n, "chunk": self.chunk, "kinds": list(self.kinds), "area": list(self.area)}

    @staticmethod
    def from_dict(data: dict) -> BlockTable:
        return BlockTable(int(data["n"]), int(data["chunk"]), tuple(str(k) for k in data["kinds"]),
                          tuple(int(a) for a in data["area"]))

    def digest(self) -> str:
        """Short hash that identifies the pattern (kinds and areas) at this granularity."""
        text = json.dumps(self.as_dict(), separators=(",", ":"), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def render(self) -> str:
        """One line per query chunk: ``.`` empty, ``#`` full, ``\\`` causal, ``+`` partial."""
        sym = {"empty": ".", "full": "#", "causal": "\\", "partial": "+"}
        return "\n".join("".join(sym[self.kind(i, j)] for j in range(self.n)) for i in range(self.n))


def build(mask: Mask, seq_len: int, n: int, valid_len: int | None = None) -> BlockTable:
    """Classify every cell of ``mask`` over ``seq_len`` tokens cut into ``n`` chunks (``n`` must divide
    ``seq_len``); PARTIAL cells also get their allowed-pair count (``Mask.count``). Positions
    ``>= valid_len`` are padding: they attend nothing and nothing attends them, so a cell they cut
    into is PARTIAL (or EMPTY)."""
    if n < 1 or seq_len % n:
        raise ValueError(f"cannot cut seq_len={seq_len} into n={n} equal chunks")
    valid = seq_len if valid_len is None else valid_len
    if not 0 < valid <= seq_len:
        raise ValueError(f"valid_len={valid_len} must be in [1, seq_len={seq_len}]")
    c = seq_len // n
    kinds, areas = [], []
    for i in range(n):
        for j in range(n):
            q0, k0 = i * c, j * c
            q1, k1 = min(q0 + c, valid), min(k0 + c, valid)
            kind = BlockKind.EMPTY if q0 >= valid or k0 >= valid else mask.classify(q0, q1, k0, k1)
            if kind != BlockKind.EMPTY and (q1, k1) != (q0 + c, k0 + c):
                kind = BlockKind.PARTIAL  # padding cuts into the cell
            area = mask.count(q0, q1, k0, k1) if kind == BlockKind.PARTIAL else _area(kind.value, c)
            if kind == BlockKind.PARTIAL and area == 0:
                kind = BlockKind.EMPTY
            kinds.append(kind.value)
            areas.append(area)
    return BlockTable(n, c, tuple(kinds), tuple(areas))


def build_cached(mask: Mask, seq_len: int, n: int, valid_len: int | None = None) -> BlockTable:
    """:func:`build`, kept in the active ``cpattn.core.memo`` scope (choosing an owner map and resolving
    a plan request classify the same table; tables are immutable)."""
    valid = seq_len if valid_len is None else valid_len
    return memo.cached(("block table", mask, seq_len, n, valid), lambda: build(mask, seq_len, n, valid))


def permute(table: BlockTable, order: tuple[int, ...]) -> BlockTable:
    """``table`` over the sequence reordered piecewise: the reordered sequence is the ``len(order)``
    equal pieces of the original taken in ``order`` (piece ``order[p]`` goes to place p). Each piece
    must be a whole number of the table's chunks (within a piece, chunks keep their order, so a cell's
    kind carries over unchanged)."""
    n0 = len(order)
    if sorted(order) != list(range(n0)) or n0 < 1 or table.n % n0:
        raise ValueError(f"order must be a permutation of range(n0) with n0 dividing the table's {table.n} chunks, "
                         f"got {n0} pieces")
    r = table.n // n0
    src = [order[a // r] * r + a % r for a in range(table.n)]
    cells = [src[a] * table.n + src[b] for a in range(table.n) for b in range(table.n)]
    return BlockTable(table.n, table.chunk, tuple(table.kinds[c] for c in cells), tuple(table.area[c] for c in cells))


def from_pattern(rows: list[str], chunk: int) -> BlockTable:
    """A table from symbols (``.`` empty, ``#`` full, ``\\`` causal); PARTIAL cells need a mask."""
    sym = {".": "empty", "#": "full", "\\": "causal"}
    n = len(rows)
    if any(len(r) != n for r in rows):
        raise ValueError(f"a block pattern must be square, got row lengths {[len(r) for r in rows]}")
    kinds = tuple(sym[ch] for r in rows for ch in r)
    return BlockTable(n, chunk, kinds, tuple(_area(k, chunk) for k in kinds))
