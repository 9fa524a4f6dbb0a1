"""Rich consoles for the commands (rich is imported when a command prints, not with ``cpattn.cli``)."""

from __future__ import annotations

import sys


def stdout():
    """Wide enough for the tables even when stdout is not a terminal (CI logs, pipes)."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160)


def show_wide(renderable) -> None:
    """Print ``renderable`` (a wide table) to stdout: in a terminal at its width (long headers fold);
    elsewhere (CI logs, pipes, files) as wide as the table's natural width, so no column is folded or
    cropped."""
    from rich.measure import Measurement

    out = stdout()
    if not sys.stdout.isatty():
        out.width = max(out.width, Measurement.get(out, out.options.update(width=10_000), renderable).maximum)
    out.print(renderable)


def stderr():
    """Progress, status lines, "wrote ..." and errors."""
    from rich.console import Console

    return Console(stderr=True)


__all__ = ["show_wide", "stderr", "stdout"]
