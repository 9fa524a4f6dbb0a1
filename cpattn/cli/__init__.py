"""Command line: ``cpattn bench``, ``train``, ``verify``, ``schedules``, ``calibrate``, ``simulate``, ``plan``.

One module per command (``add_parser(sub)`` and ``run(args)``); :mod:`cpattn.cli.args` holds the
argument parsing they share. Importing this package imports neither rich nor matplotlib nor ortools:
each command imports what it prints and draws with when it runs.
"""

from __future__ import annotations

import argparse
import logging

from ..core import memo
from . import bench, calibrate, plan, reproduce, schedules, simulate, train, verify

#: the commands, in the order ``cpattn --help`` lists them
COMMANDS = (bench, train, calibrate, simulate, reproduce, verify, plan, schedules)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpattn", description="Exact context-parallel attention.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status. Usage problems (argparse's errors, and the ValueError a
    command raises for input it cannot take: a bad mask, topology, size or combination) print one line
    and return 2; any other exception is a bug and propagates with its traceback."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse has printed the usage error (status 2) or the help (0)
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    try:
        with memo.scope():  # what the command's estimates and plans compute is remembered while it runs
            return args.func(args)
    except ValueError as exc:
        from rich.markup import escape

        from ..output import stderr

        stderr().print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        return 2


__all__ = ["build_parser", "main"]
