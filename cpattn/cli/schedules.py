"""``cpattn schedules``: list the registered schedules and what each runs."""

from __future__ import annotations

import argparse

from ..output import Column, save_json, stdout, table, to_stdout

#: the table's columns; ``drop`` is the order in which they are left out of a narrow terminal
COLUMNS = (Column("name", "left"), Column("masks it runs", "left", wrap=True, min_width=14),
           Column("layout", "left", drop=2, wrap=True, min_width=10),
           Column("memory", "left", drop=1, wrap=True, min_width=14),
           Column("summary", "left", drop=3, wrap=True, min_width=24))


def add_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("schedules", help="list schedules and what each runs")
    s.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH ('-': to stdout, no table)")
    s.set_defaults(func=run)
    return s


def runs(row: dict) -> str:
    """What masks a schedule runs, in one phrase: "every mask", "causal masks only" (those with
    ``is_causal``: causal, causal windows, documents, ...) or "bidirectional masks only", and the mask
    kinds when it names them."""
    if row["causal"] and row["bidirectional"]:
        which = "every mask"
    elif row["causal"]:
        which = "causal masks only"
    elif row["bidirectional"]:
        which = "bidirectional masks only"
    else:
        which = "no mask"
    if row["masks"] != "any":
        which += f" of kind {row['masks']}"
    return which


def run(args) -> int:
    from .. import schedules as registry

    rows = [{**row, "runs": runs(row)} for row in registry.available()]
    quiet = to_stdout(args.json)
    t = table(COLUMNS, [[r["name"], r["runs"], r["layout"], r["memory"], r["summary"]] for r in rows],
              title="cpattn schedules",
              caption="causal masks: those with is_causal (causal, causal windows and documents, strided, star, "
                      "streaming); bidirectional: the others (full, symmetric windows, global_local); every "
                      "schedule takes fewer key/value heads than query heads (GQA)")
    stdout(quiet).print(t)
    if args.json:
        save_json(rows, args.json)
    return 0
