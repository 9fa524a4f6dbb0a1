"""Measured timelines (cpattn.core.trace.timeline, cpattn.timeline, `cpattn bench --trace`): stamps leave the
recordings unchanged, spans and lanes, the hidden transfer fraction on hand-made timelines, and the
Chrome trace of a real run and of the command line."""

from __future__ import annotations

import json
import math

import pytest
import timeline_workers
import torch
from cpattn.masks import BlockKind

from cpattn import cli, kernels, timeline
from cpattn.core import trace
from cpattn.launcher import RankError


def _recorded(transfers=(), kernels_=(), marks=(), name: str = "sendrecv") -> dict:
    """A timeline as ``Trace.as_dict`` gives it: ``transfers`` ``(issue, wait start, wait end)``,
    ``kernels_`` ``(start, end)``, ``marks`` ``(name, t)``."""
    ops = [("send", 8, 0), ("recv", 0, 8)] if name == "sendrecv" else [(name, 8, 8)]
    events = [{"ev": "mark", "name": n, "t": t} for n, t in marks]
    for call, (t, w0, w1) in enumerate(transfers):
        events += [{"ev": "issue", "call": call, "t": t, "ops": ops}, {"ev": "wait", "call": call, "t0": w0, "t1": w1}]
    events += [{"ev": "kernel", "phase": "forward", "kind": "full", "q": 4, "kv": 4, "pieces": 1, "t0": a, "t1": b}
               for a, b in kernels_]
    return {"origin": 0, "events": events}


def _fraction(transfers, kernels_) -> float | None:
    return timeline.hidden(timeline.spans(_recorded(transfers, kernels_), 0))["hidden_fraction"]


# ---------------------------------------------------------------------------------- the hidden fraction
def test_hidden_fraction_fully_hidden_not_hidden_and_partial():
    # fully hidden: a kernel call runs for the whole time the transfer is in flight
    assert _fraction([(10, 90, 100)], [(0, 120)]) == 1.0
    # not hidden: the transfer is issued, then waited for, and only then does a kernel run
    assert _fraction([(0, 5, 100)], [(100, 200)]) == 0.0
    # partial: two transfers in flight over [0, 200] (their union, not their sum of 250); kernels cover
    # [0, 40] and [150, 200] of it: 90 / 200
    assert _fraction([(0, 40, 100), (50, 150, 200)], [(0, 40), (150, 210)]) == pytest.approx(0.45)
    # nothing in flight: no fraction
    assert _fraction([], [(0, 10)]) is None


def test_hidden_reports_times_and_the_summary_averages_ranks():
    full = timeline.spans(_recorded([(10, 90, 100)], [(0, 120)], [("forward", 0), ("end", 130)]), 0)
    none = timeline.spans(_recorded([(0, 5, 100)], [(100, 200)]), 1)
    idle = timeline.spans(_recorded([], [(0, 10)]), 2)
    h = timeline.hidden(full)
    assert h == {"rank": 0, "step_ns": 130, "compute_ns": 120, "in_flight_ns": 90, "hidden_ns": 90, "wait_ns": 10,
                 "hidden_fraction": 1.0}
    assert timeline.hidden(none)["wait_ns"] == 95 and timeline.hidden(none)["step_ns"] == 200
    s = timeline.summary([full, none, idle])
    assert s["hidden_fraction"] == 0.5 and s["hidden_min"] == 0.0  # mean over ranks with transfers
    assert [r["rank"] for r in s["ranks"]] == [0, 1, 2] and s["step_s"] == pytest.approx(200e-9)


def test_lanes_separate_transfers_in_flight_together():
    rank = timeline.spans(_recorded([(0, 90, 100), (50, 140, 150), (120, 190, 200)]), 0)
    assert timeline.lanes(rank["transfers"]) == [("transfer sendrecv", [0, 2]), ("transfer sendrecv 2", [1])]
    bcast = timeline.spans(_recorded([(0, 5, 10)], name="broadcast"), 0)["transfers"]
    assert ("transfer broadcast", [3]) in timeline.lanes(rank["transfers"] + bcast)  # a lane of its own kind


def _check_chrome(doc: dict, ranks: int) -> dict:
    """The trace round-trips through JSON, names every process and thread it uses, and no two spans of
    one lane overlap unless one nests inside the other (a wait inside its transfer)."""
    doc = json.loads(json.dumps(doc))
    assert doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    assert all(ev["ph"] in ("X", "M") for ev in events)
    procs = {ev["pid"]: ev["args"]["name"] for ev in events if ev["name"] == "process_name"}
    assert procs == {r: f"rank {r}" for r in range(ranks)}
    names = {(ev["pid"], ev["tid"]): ev["args"]["name"] for ev in events if ev["name"] == "thread_name"}
    spans = [ev for ev in events if ev["ph"] == "X"]
    assert all(isinstance(ev["ts"], int) and ev["dur"] >= 0 for ev in spans)
    assert {(ev["pid"], ev["tid"]) for ev in spans} <= set(names)
    for lane in names:
        mine = sorted((ev["ts"], ev["ts"] + ev["dur"], ev["cat"]) for ev in spans if (ev["pid"], ev["tid"]) == lane)
        tops = [(a, b) for a, b, cat in mine if cat != "wait"]
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(tops, tops[1:])), (names[lane], tops)
        for a, b, cat in mine:
            if cat == "wait":  # inside the one transfer it belongs to
                assert any(x <= a and b <= y for x, y in tops), (names[lane], a, b)
    return {"names": names, "spans": spans}


def test_chrome_trace_of_hand_made_ranks():
    ranks = timeline.align([timeline.spans(_recorded([(1000, 5000, 9000), (3000, 9000, 12000)], [(2000, 4000)],
                                                     [("forward", 1000), ("end", 13000)]), 0),
                            timeline.spans(_recorded([(4000, 4100, 6000)], [(4500, 5500)]), 1)])
    doc = timeline.chrome_trace(ranks, {"schedule": "x"})
    got = _check_chrome(doc, 2)
    assert doc["otherData"] == {"schedule": "x"}
    assert set(got["names"].values()) == {"step", "compute", "transfer sendrecv", "transfer sendrecv 2"}
    r0 = {(ev["name"], ev["tid"]): (ev["ts"], ev["dur"]) for ev in got["spans"] if ev["pid"] == 0}
    assert r0[("forward", timeline.STEP_TID)] == (1, 12) and r0[("forward full", timeline.COMPUTE_TID)] == (2, 2)
    waits = sorted(ev["ts"] for ev in got["spans"] if ev["name"] == "wait")
    assert waits == [4, 5, 9]  # microseconds from the earliest origin (0)


# ---------------------------------------------------------------------------------- the runtime's stamps
def test_stamps_cost_nothing_when_inactive_and_one_span_per_stacked_call():
    assert trace.now() is None and trace.issue([("send", 1, 0)]) is None
    assert trace.compute("forward", "full", 4, 4) is None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 8, 2, 16, generator=g) for _ in range(3))
    with trace.recording() as events, trace.timeline() as tl:
        kernels.forward_stacked(q, k, v, BlockKind.FULL, 0.25, 3)
        with pytest.raises(RuntimeError, match="already active"):
            with trace.timeline():
                pass
    assert [ev["ev"] for ev in events] == ["compute"] * 3  # the recording counts blocks, as before
    (span,) = tl.events
    assert span["ev"] == "kernel" and span["pieces"] == 3 and span["t0"] <= span["t1"]
    assert tl.origin <= span["t0"] and not trace.active() and trace.now() is None


def _renumbered(events: list[dict]) -> list[dict]:
    ids: dict[int, int] = {}
    return [{**ev, "call": ids.setdefault(ev["call"], len(ids))} if "call" in ev else ev for ev in events]


def test_a_two_rank_run_keeps_its_recording_and_gives_a_chrome_trace(worlds):
    per_rank = worlds.get(2).run(timeline_workers.ring_step, timeout=60)
    assert not any(isinstance(r, RankError) for r in per_rank), per_rank
    for r in per_rank:
        # the timeline adds no event to, and changes none of, the recording
        assert _renumbered(r["both"]) == _renumbered(r["plain"])
        evs = r["timeline"]["events"]
        issued = {ev["call"] for ev in r["both"] if ev["ev"] == "issue"}
        assert {ev["call"] for ev in evs if ev["ev"] == "issue"} == issued
        assert {ev["call"] for ev in evs if ev["ev"] == "wait"} == issued
        assert all(ev["t0"] <= ev["t1"] for ev in evs if ev["ev"] in ("wait", "kernel"))
        kernel_blocks = sum(ev["pieces"] for ev in evs if ev["ev"] == "kernel")
        assert kernel_blocks == sum(ev["ev"] == "compute" for ev in r["both"]) > 0
    ranks = timeline.align([timeline.spans(r["timeline"], r["rank"]) for r in per_rank])
    assert min(r["origin"] for r in ranks) == 0
    got = _check_chrome(timeline.chrome_trace(ranks), 2)
    assert {"step", "compute", "transfer sendrecv"} <= set(got["names"].values())
    s = timeline.summary(ranks)
    assert 0.0 <= s["hidden_fraction"] <= 1.0 and all(r["in_flight_ns"] > 0 for r in s["ranks"])


@pytest.mark.slow  # the 2-rank recording test above keeps the chrome trace in make test
def test_bench_cli_writes_a_chrome_trace_and_the_hidden_column(tmp_path, capsys):
    rc = cli.main(["bench", "--world", "2", "--seq", "256", "--schedules", "ring", "--iters", "1", "--warmup", "1",
                   "--trace", str(tmp_path / "traces"), "--json", str(tmp_path / "b.json")])
    assert rc == 0
    path = tmp_path / "traces" / "ring_causal_P2_S256.trace.json"
    doc = json.loads(path.read_text())
    got = _check_chrome(doc, 2)
    assert any(ev["cat"] == "compute" for ev in got["spans"]) and any(ev["cat"] == "transfer" for ev in got["spans"])
    assert doc["otherData"]["schedule"] == "ring" and len(doc["otherData"]["per_rank"]) == 2
    (row,) = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert 0.0 <= row["hidden_fraction"] <= 1.0 and row["extra"]["timeline"]["file"] == str(path)
    assert math.isclose(row["hidden_fraction"], doc["otherData"]["hidden_fraction"])
    assert "hidden" in capsys.readouterr().out
