"""What the commands print and draw: consoles fitted to the terminal, tables that leave out columns by a
stated priority when they do not fit, JSON for machines, and line styles for plots.

Width: ``$COLUMNS`` when set, else the terminal's; when stdout is not a terminal (a pipe, a file, a CI
log) and ``$COLUMNS`` is not set, tables print at their full natural width. A table built with
:func:`table` whose narrowest layout (headers folded at spaces, every cell word whole) is still wider
than that leaves out its columns in their stated order (``Column.drop``: 1 first) and says in its
caption which it left out. Text wraps at spaces only, so an error inside a table is never cut mid-word.

rich and matplotlib are imported when a command prints or draws, not with ``cpattn``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass

#: the console width when stdout is not a terminal and $COLUMNS is not set: wider than any table
FULL_WIDTH = 10_000


def columns() -> int | None:
    """The width output is fitted to: ``$COLUMNS`` when it is a positive integer, else the terminal's
    when stdout is one; None (full width) otherwise."""
    text = os.environ.get("COLUMNS", "").strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


def stdout(quiet: bool = False):
    """The console for tables and results, :func:`columns` wide (``quiet``: one that prints nothing,
    for a command whose JSON goes to stdout instead)."""
    from rich.console import Console

    if quiet:
        return Console(file=io.StringIO(), width=FULL_WIDTH)
    return Console(width=columns() or FULL_WIDTH)


def show_wide(renderable) -> None:
    """Print ``renderable`` (a wide table) on stdout, :func:`columns` wide: folded to the terminal's
    width, at its full natural width outside a terminal."""
    stdout().print(renderable)


def stderr():
    """Progress, status lines, notes, "wrote ..." and errors."""
    from rich.console import Console

    return Console(stderr=True)


# ----------------------------------------------------------------------------------- tables
@dataclass(frozen=True)
class Column:
    """A table column: ``header``; ``justify``; ``drop``: 0 for a column that is always shown, else its
    place in the order in which columns are left out of a table too wide for the terminal (1 goes
    first); ``wrap``: whether its cells are text that may wrap at spaces (notes, summaries; a cell of
    any other column keeps its lines whole, only the header folds); ``min_width``: the narrowest a
    column of wrapped text may get."""

    header: str
    justify: str = "right"
    drop: int = 0
    wrap: bool = False
    min_width: int | None = None


def _plain(cell: str) -> str:
    from rich.text import Text

    return Text.from_markup(cell).plain


def _extent(col: Column, cells: Sequence[str]) -> tuple[int, int]:
    """``(narrowest, widest)`` width of a column: the longest word of its header (folded at spaces) and
    the longest line of its cells (for a ``wrap`` column, their longest word, and at least
    ``min_width``); and its longest line."""
    from rich.cells import cell_len

    def lines(text: str) -> list[str]:
        return text.splitlines() or [""]

    cells = [ln for cell in cells for ln in lines(_plain(cell))]
    header = lines(col.header)
    widest = max(map(cell_len, header + cells))
    pieces = [w for ln in header + (cells if col.wrap else []) for w in ln.split()]
    narrowest = max(max(map(cell_len, pieces), default=1), 0 if col.wrap else max(map(cell_len, cells), default=0))
    if col.wrap:
        narrowest = max(narrowest, min(col.min_width or 0, widest))
    return narrowest, widest


def _frame(n: int) -> int:
    """Columns a rich table of ``n`` columns spends on borders and padding (one space each side)."""
    return 3 * n + 1


def _widths(cols, rows, keep, width: int | None) -> list[int] | None:
    """Column widths that fit ``width``: each column's longest line when they all fit (None: rich's
    natural layout), else its longest word plus a share of what is left, in proportion to what it
    would take to show its longest line. Never below the longest word, so no word is cut."""
    extents = [_extent(cols[i], [r[i] for r in rows]) for i in keep]
    if width is None or sum(w for _, w in extents) + _frame(len(keep)) <= width:
        return None
    out = [n for n, _ in extents]
    spare = width - _frame(len(keep)) - sum(out)
    want = [w - n for n, w in extents]
    total = sum(want)
    if spare > 0 and total:
        out = [n + spare * x // total for n, x in zip(out, want)]
    return out


def narrowest(cols: Sequence[Column], rows: Sequence[Sequence[str]], keep: Sequence[int] | None = None) -> int:
    """The width of a table of ``rows`` under ``cols`` (those at ``keep``, default all) with every
    header folded at its spaces and every cell wrapped at its longest word."""
    keep = range(len(cols)) if keep is None else keep
    return sum(_extent(cols[i], [r[i] for r in rows])[0] for i in keep) + _frame(len(keep))


def table(cols: Sequence[Column], rows: Sequence[Sequence[str]], *, title: str = "", caption: str = "",
          width: int | None = None, everything: str = "--json has every column"):
    """A rich table of ``rows`` (cell strings, rich markup allowed) under ``cols``, fitted to ``width``
    (default :func:`columns`; None: full width): while its :func:`narrowest` layout is wider, the column
    with the lowest nonzero ``drop`` is left out; the columns kept wrap at spaces only. The caption
    then starts with the columns left out, the ``COLUMNS`` that would show them all and
    ``everything`` (where else to find them)."""
    from rich.table import Table

    if any(len(r) != len(cols) for r in rows):
        raise ValueError(f"every row needs {len(cols)} cells, one per column")
    width = columns() if width is None else width
    keep = list(range(len(cols)))
    if width is not None:
        order = sorted((c.drop, i) for i, c in enumerate(cols) if c.drop)
        while order and narrowest(cols, rows, keep) > width:
            keep.remove(order.pop(0)[1])
    left_out = [cols[i].header for i in range(len(cols)) if i not in keep]
    if left_out:
        note = (f"not shown at {width} columns: {', '.join(left_out)} (COLUMNS={narrowest(cols, rows)} shows every "
                f"column; {everything})")
        caption = f"{note}; {caption}" if caption else note
    widths = _widths(cols, rows, keep, width)
    t = Table(title=title or None, caption=caption or None, caption_justify="left")
    for k, i in enumerate(keep):
        t.add_column(cols[i].header, justify=cols[i].justify, overflow="fold",
                     width=None if widths is None else widths[k])
    for row in rows:
        t.add_row(*(row[i] for i in keep))
    return t


def footnotes(notes: Sequence[str]) -> tuple[list[str], list[str]]:
    """Long notes as footnotes: ``(marks, texts)``, where ``marks[i]`` is ``"(n)"`` for ``notes[i]``
    (equal notes share a number; an empty note has an empty mark) and ``texts`` the numbered notes to
    print under the table, each once."""
    numbers: dict[str, int] = {}
    marks = [f"({numbers.setdefault(note, len(numbers) + 1)})" if note else "" for note in notes]
    return marks, [f"({n}) {note}" for note, n in numbers.items()]


# ----------------------------------------------------------------------------------- JSON
def to_stdout(path: str | None) -> bool:
    """Whether ``--json PATH`` asks for the JSON on stdout (``-``) in place of the tables."""
    return path == "-"


def save_json(data, path: str) -> None:
    """``data`` as JSON to ``path``, or to stdout when ``path`` is ``-`` (then the command prints no
    table); a file is announced on stderr."""
    text = json.dumps(data, indent=2)
    if to_stdout(path):
        sys.stdout.write(text + "\n")
        return
    with open(path, "w") as f:
        f.write(text + "\n")
    stderr().print(f"wrote {path}", highlight=False)


# ----------------------------------------------------------------------------------- plots
_MARKERS = "osD^vP*Xh<>"  # 11 markers against 10 colours: colour and marker pairs repeat only after 110 lines
_DASHES = ("-", "--", "-.", ":")


def line_style(index: int) -> dict:
    """Matplotlib keywords for line ``index`` of a plot: a colour of the ten-colour cycle, a marker and
    a dash pattern, so that no two of the first 110 lines look alike (colour alone repeats after 10)."""
    return {"color": f"C{index % 10}", "marker": _MARKERS[index % len(_MARKERS)],
            "linestyle": _DASHES[(index // 10) % len(_DASHES)]}


def schedule_style(name: str) -> dict:
    """:func:`line_style` of a schedule by its place in the registry, so a schedule looks the same in
    every plot; a line that is not a schedule gets a style after the registry's."""
    from . import schedules

    names = schedules.names()
    return line_style(names.index(name) if name in names else len(names) + sum(map(ord, name)) % 50)


__all__ = ["FULL_WIDTH", "Column", "columns", "footnotes", "line_style", "narrowest", "save_json", "schedule_style",
           "show_wide", "stderr", "stdout", "table", "to_stdout"]
