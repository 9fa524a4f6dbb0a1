"""Rich consoles for the commands (rich is imported when a command prints, not with ``cpattn.cli``)."""

from __future__ import annotations

import sys


def stdout():
    """Wide enough for the tables even when stdout is not a terminal (CI logs, pipes)."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160)


def stderr():
    """Progress, status lines, "wrote ..." and errors."""
    from rich.console import Console

    return Console(stderr=True)


__all__ = ["stderr", "stdout"]
