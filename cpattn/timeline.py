"""Measured timelines: spans per rank, the Chrome trace, and how much transfer time compute hides.

A rank's timeline (``cpattn.core.trace.timeline()``, returned by :meth:`cpattn.core.trace.Trace.as_dict`) is a
list of stamped events. :func:`spans` turns it into three kinds of span, in nanoseconds:

- **compute**: one kernel call, from its start to its return (a stacked call of several blocks is one
  span);
- **transfer**: one communicator call, from its issue to the return of its wait; ``wait`` is when the
  wait began, so ``t1 - wait`` is the time this rank spent blocked on it. The end is when the wait
  returned, not when the bytes arrived (which the process cannot see): a transfer that finished early
  and was waited for late counts as in flight until the wait;
- **phase**: the stretch between two marks (``Trace.mark``), e.g. a step's forward and backward.

:func:`align` puts several ranks on one origin, :func:`hidden` measures the overlap of transfers with
compute on one rank, :func:`summary` over ranks, :func:`chrome_trace` writes the Trace Event Format
that Perfetto (ui.perfetto.dev) and chrome://tracing open, and :func:`draw` a per-rank panel on a
matplotlib axis (docs/bench.md).
"""

from __future__ import annotations

import math


def _op_label(ops) -> str:
    """A call's messages as one name: a send and a receive batched together are ``sendrecv``."""
    kinds = sorted({op for op, _, _ in ops})
    return "sendrecv" if kinds == ["recv", "send"] else "+".join(kinds)


def spans(recorded: dict, rank: int) -> dict:
    """One rank's timeline as spans (nanoseconds on the rank's clock): ``{"rank", "origin", "compute":
    [{"t0", "t1", "name", "args"}], "transfers": [{"t0", "wait", "t1", "name", "args"}], "phases":
    [{"t0", "t1", "name"}]}``. Kernel calls that never returned and calls never waited for are left
    out; each mark but the last opens a phase that the next one closes."""
    issues: dict[int, dict] = {}
    compute, transfers, marks = [], [], []
    for ev in recorded["events"]:
        kind = ev["ev"]
        if kind == "issue":
            issues[ev["call"]] = ev
        elif kind == "wait":
            iss = issues.get(ev["call"])
            if iss is None:
                continue
            ops = [tuple(o) for o in iss["ops"]]
            transfers.append({"t0": iss["t"], "wait": max(ev["t0"], iss["t"]), "t1": ev["t1"],
                              "name": _op_label(ops),
                              "args": {"call": ev["call"], "messages": len(ops),
                                       "bytes_sent": sum(s for _, s, _ in ops), "bytes_recv": sum(r for _, _, r in ops),
                                       "ops": [list(o) for o in ops]}})
        elif kind == "kernel":
            if ev["t1"] is None:
                continue
            name = f"{ev['phase']} {ev['kind']}" + (f" x{ev['pieces']}" if ev["pieces"] > 1 else "")
            compute.append({"t0": ev["t0"], "t1": ev["t1"], "name": name,
                            "args": {k: ev[k] for k in ("phase", "kind", "q", "kv", "pieces")}})
        elif kind == "mark":
            marks.append(ev)
    phases = [{"t0": a["t"], "t1": b["t"], "name": a["name"]} for a, b in zip(marks, marks[1:])]
    transfers.sort(key=lambda s: s["t0"])
    return {"rank": rank, "origin": recorded["origin"], "compute": compute, "transfers": transfers, "phases": phases}


def align(ranks: list[dict]) -> list[dict]:
    """``ranks`` (from :func:`spans`) shifted so that the earliest ``origin`` is 0.

    The ranks of a local world are processes of one host, whose ``perf_counter_ns`` is the one
    system-wide monotonic clock, so their stamps are comparable as they are: subtracting one common
    zero keeps the true offsets between ranks (a rank that leaves the barrier later starts later)."""
    zero = min(r["origin"] for r in ranks)

    def shift(items: list[dict]) -> list[dict]:
        return [{**s, **{k: s[k] - zero for k in ("t0", "wait", "t1") if k in s}} for s in items]

    return [{**r, "origin": r["origin"] - zero, "compute": shift(r["compute"]), "transfers": shift(r["transfers"]),
             "phases": shift(r["phases"])} for r in ranks]


# ---------------------------------------------------------------------------------- overlap
def _union(intervals) -> list[tuple[int, int]]:
    """Sorted disjoint intervals covering the same time as ``intervals`` (empty ones dropped)."""
    out: list[list[int]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> int:
    return sum(b - a for a, b in intervals)


def _intersection(x: list[tuple[int, int]], y: list[tuple[int, int]]) -> int:
    """Length of the overlap of two sorted disjoint interval lists."""
    i = j = total = 0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def hidden(rank: dict) -> dict:
    """How much of one rank's transfer time its kernel calls hide.

    ``in_flight_ns``: the time at least one transfer is in flight (the union of the transfer spans,
    issue to end of wait); ``hidden_ns``: the part of it during which a kernel call runs (intersection
    with the union of the compute spans); ``hidden_fraction`` = hidden / in flight (None without
    transfers). Also ``compute_ns`` (union of compute spans), ``wait_ns`` (union of the waits, the
    time this rank was blocked) and ``step_ns`` (first phase start to last phase end, else first to
    last stamp)."""
    xfer = _union((s["t0"], s["t1"]) for s in rank["transfers"])
    comp = _union((s["t0"], s["t1"]) for s in rank["compute"])
    waits = _union((s["wait"], s["t1"]) for s in rank["transfers"])
    in_flight, covered = _length(xfer), _intersection(xfer, comp)
    if rank["phases"]:
        step = rank["phases"][-1]["t1"] - rank["phases"][0]["t0"]
    else:
        stamps = [t for s in (*rank["compute"], *rank["transfers"]) for t in (s["t0"], s["t1"])]
        step = max(stamps) - min(stamps) if stamps else 0
    return {"rank": rank["rank"], "step_ns": step, "compute_ns": _length(comp), "in_flight_ns": in_flight,
            "hidden_ns": covered, "wait_ns": _length(waits),
            "hidden_fraction": covered / in_flight if in_flight > 0 else None}


def summary(ranks: list[dict]) -> dict:
    """:func:`hidden` of every rank, and over ranks: ``hidden_fraction`` (the mean of the ranks'
    fractions, ranks without transfers left out; None when no rank has any), ``hidden_min`` (the least
    hidden rank's), ``step_s`` (the longest rank's step)."""
    per = [hidden(r) for r in ranks]
    fr = [p["hidden_fraction"] for p in per if p["hidden_fraction"] is not None]
    return {"hidden_fraction": sum(fr) / len(fr) if fr else None, "hidden_min": min(fr) if fr else None,
            "step_s": max((p["step_ns"] for p in per), default=0) / 1e9, "ranks": per}


# ---------------------------------------------------------------------------------- Chrome trace
def lanes(transfers: list[dict]) -> list[tuple[str, list[int]]]:
    """Transfer lanes of one rank: ``[(label, indices into transfers)]``, one lane per op kind, and more
    for a kind whose transfers are in flight together (greedily, in issue order: a transfer joins the
    first lane of its kind that is free by its issue), so spans never overlap within a lane."""
    out: list[tuple[str, list[int]]] = []
    ends: list[int] = []
    count: dict[str, int] = {}
    for i in sorted(range(len(transfers)), key=lambda i: transfers[i]["t0"]):
        s = transfers[i]
        for k, (_, idx) in enumerate(out):
            if transfers[idx[0]]["name"] == s["name"] and ends[k] <= s["t0"]:
                idx.append(i)
                ends[k] = s["t1"]
                break
        else:
            count[s["name"]] = count.get(s["name"], 0) + 1
            n = count[s["name"]]
            out.append((f"transfer {s['name']}" + (f" {n}" if n > 1 else ""), [i]))
            ends.append(s["t1"])
    return out


def _us(ns: int) -> int:
    """Whole microseconds: every endpoint is rounded the same way, so spans that share an end (a wait
    inside its transfer) nest exactly, and spans of one lane never overlap after rounding."""
    return round(ns / 1000)


def _complete(name: str, cat: str, pid: int, tid: int, t0: int, t1: int, args: dict | None = None) -> dict:
    a, b = _us(t0), _us(t1)
    ev = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": a, "dur": b - a}
    if args:
        ev["args"] = args
    return ev


def _meta(name: str, pid: int, tid: int | None, args: dict) -> dict:
    ev = {"name": name, "ph": "M", "pid": pid, "args": args}
    if tid is not None:
        ev["tid"] = tid
    return ev


STEP_TID, COMPUTE_TID = 0, 1


def chrome_trace(ranks: list[dict], meta: dict | None = None) -> dict:
    """The Trace Event Format (``{"traceEvents": [...], "displayTimeUnit": "ms"}``) of aligned ranks
    (:func:`align`): one process per rank ("rank N"); thread 0 "step" (the phases), 1 "compute" (the
    kernel calls), then one "transfer <op>" thread per transfer lane (:func:`lanes`), each transfer a
    span with its wait ("wait") nested at its end. Times in whole microseconds. ``meta`` goes to
    ``otherData``."""
    events: list[dict] = []
    for r in ranks:
        pid = r["rank"]
        events += [_meta("process_name", pid, None, {"name": f"rank {pid}"}),
                   _meta("process_sort_index", pid, None, {"sort_index": pid})]
        threads = [(STEP_TID, "step"), (COMPUTE_TID, "compute")]
        events += [_complete(s["name"], "step", pid, STEP_TID, s["t0"], s["t1"]) for s in r["phases"]]
        events += [_complete(s["name"], "compute", pid, COMPUTE_TID, s["t0"], s["t1"], s["args"]) for s in r["compute"]]
        for k, (label, idx) in enumerate(lanes(r["transfers"])):
            tid = COMPUTE_TID + 1 + k
            threads.append((tid, label))
            for i in idx:
                s = r["transfers"][i]
                events.append(_complete(s["name"], "transfer", pid, tid, s["t0"], s["t1"], s["args"]))
                if s["t1"] > s["wait"]:
                    events.append(_complete("wait", "wait", pid, tid, s["wait"], s["t1"]))
        for tid, label in threads:
            events += [_meta("thread_name", pid, tid, {"name": label}),
                       _meta("thread_sort_index", pid, tid, {"sort_index": tid})]
    out = {"traceEvents": events, "displayTimeUnit": "ms"}
    if meta:
        out["otherData"] = meta
    return out


# ---------------------------------------------------------------------------------- plot
COLOURS = {"compute": "#4477aa", "transfer": "#ee9944", "wait": "#cc3311"}


def draw(ax, ranks: list[dict], title: str = "") -> None:
    """Per-rank horizontal bars of aligned ranks on a matplotlib axis: for each rank a compute row and
    one row per transfer lane (in flight light, the wait dark), milliseconds from the common origin."""
    from matplotlib.patches import Patch

    y, ticks, labels = 0.0, [], []
    for r in ranks:
        top = y
        rows = [("compute", [(s["t0"], s["t1"]) for s in r["compute"]], COLOURS["compute"])]
        for label, idx in lanes(r["transfers"]):
            rows.append((label.removeprefix("transfer "), [(r["transfers"][i]["t0"], r["transfers"][i]["t1"])
                                                            for i in idx], COLOURS["transfer"]))
            rows.append((None, [(r["transfers"][i]["wait"], r["transfers"][i]["t1"]) for i in idx], COLOURS["wait"]))
        for label, spans_, colour in rows:
            bars = [(a / 1e6, max(b - a, 0) / 1e6) for a, b in spans_]
            if label is None:  # the waits, drawn over their transfers' row
                ax.broken_barh(bars, (y - 0.8 + 0.1, 0.6), color=colour, linewidth=0)
                continue
            ax.broken_barh(bars, (y + 0.1, 0.6), facecolor=colour, edgecolor="#222222", linewidth=0.3)
            ticks.append(y + 0.4)
            labels.append(f"rank {r['rank']} {label}")
            y += 0.8
        for s in r["phases"][1:]:  # where the next phase (e.g. the backward) begins
            ax.plot([s["t0"] / 1e6] * 2, [top, y], color="grey", lw=0.8, ls=":")
        y += 0.4
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step start (earliest rank)")
    ax.set_title(title, fontsize=9)
    ax.legend(handles=[Patch(color=COLOURS["compute"], label="kernel call"),
                       Patch(color=COLOURS["transfer"], label="transfer in flight"),
                       Patch(color=COLOURS["wait"], label="waiting for it")], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)


def fraction_text(value: float | None) -> str:
    """A hidden fraction as the table shows it: a percentage, or "-" when nothing was in flight."""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.0%}"


__all__ = ["align", "chrome_trace", "draw", "fraction_text", "hidden", "lanes", "spans", "summary"]
