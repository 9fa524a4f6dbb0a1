"""``cpattn schedules``: list the registered schedules and what each supports."""

from __future__ import annotations

import argparse

from .output import stdout

COLUMNS = ("name", "layout", "masks", "causal", "bidirectional", "gqa", "memory", "summary")


def add_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("schedules", help="list schedules and what each supports")
    s.set_defaults(func=run)
    return s


def run(args) -> int:
    from rich.table import Table

    from .. import schedules as registry

    t = Table(title="cpattn schedules")
    for col in COLUMNS:
        t.add_column(col)
    for row in registry.available():
        t.add_row(*[str(row[c]) for c in COLUMNS])
    stdout().print(t)
    return 0
