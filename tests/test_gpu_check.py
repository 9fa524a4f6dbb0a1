"""scripts/gpu_check.py's harness on the CPU (``--device cpu``, tiny shapes): the sections run in this
process before they ever meet a GPU. What only a GPU can show (its times, CUDA graphs, host-to-device
copies, NCCL) is checked by running the script on one."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
import time
from pathlib import Path

import pytest
import torch
from cpattn.masks import from_spec

from cpattn import schedules
from cpattn.exactness import example_mask_args

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


# imported by name from scripts/, so that the multirank section's spawned ranks import it too
sys.path.insert(0, str(ROOT / "scripts"))
gpu_check = importlib.import_module("gpu_check")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """As the script's CPU runs: one thread, so that a busy machine does not stall OpenMP workers."""
    with gpu_check._one_thread_on_cpu(CPU):
        yield


def _main(*argv: str) -> tuple[int, str]:
    """Exit status and printed output of one in-process run."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = gpu_check.main(list(argv))
    return rc, buf.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One CPU run of the context_parallel and parity sections: (exit status, report, printed output)."""
    out = tmp_path_factory.mktemp("gpu_check") / "report.json"
    rc, printed = _main("--device", "cpu", "--sections", "context_parallel,parity", "--reps", "1",
                        "--out", str(out))
    return rc, json.loads(out.read_text()), printed


def _refuses(schedule: str, mask: str) -> bool:
    spec = {"kind": mask, **(example_mask_args(mask, 64) or {})}
    try:
        schedules.get(schedule).check_mask(from_spec(spec))
    except (ValueError, NotImplementedError):
        return True
    return False


def test_context_parallel_runs_every_accepted_pair_and_skips_exactly_the_refused(run):
    rc, report, _ = run
    cases = report["context_parallel"]
    assert rc == 0 and report["failures"] == []
    pairs = {(c["schedule"], c["mask"]) for c in cases}
    assert len(pairs) == 6 * 4  # the CPU's schedules x causal, full, sliding_window, document
    for case in cases:
        refused = _refuses(case["schedule"], case["mask"])
        if refused:
            assert case.get("skipped") == gpu_check.REFUSED, case
        else:
            assert "skipped" not in case and case["ok"], case
    by_pair = {(c["schedule"], c["mask"], c["dtype"]): c for c in cases}
    assert by_pair[("ringx1o", "causal", "bfloat16")]["skipped"] == gpu_check.REFUSED
    assert by_pair[("ringx4o", "full", "float32")]["skipped"] == gpu_check.REFUSED
    ring_doc = by_pair[("ring", "document", "bfloat16")]
    assert ring_doc["ok"] and set(ring_doc["errors"]) == {"out", "lse", "dq", "dk", "dv"}


def test_parity_rows_and_the_table_with_every_column(run):
    rc, report, printed = run
    rows = report["parity"]
    assert [r["mask"]["kind"] for r in rows] == ["causal", "full", "causal", "causal", "document",
                                                 "sliding_window", "streaming"]
    for row in rows:
        assert row["ok"] and row["exact"] is True, row
        assert row["cp"]["fwd_ms"] > 0 and row["cp"]["fwd_bwd_ms"] > 0 and row["ratio_fwd"] > 0
        assert row["flops_fwd"] == 4 * row["h"] * row["d"] * row["allowed_pairs"]
        if row["mask"]["kind"] in ("causal", "full"):
            # the CPU has SDPA's flash backend, not the efficient one: its refusal is recorded, not fatal
            assert row["winner"] == {"fwd": "flash", "fwd_bwd": "flash"}
            assert "error" in row["backends"]["efficient"] and row["backends"]["flash"]["gqa"] == "native"
            assert set(row["errors"]) == {"out", "dq", "dk", "dv"} and row["ratio_fwd_bwd"] > 0
        else:
            assert row["baseline"].startswith("flex") and set(row["errors"]) == {"out"}
            assert row["kernel"].startswith("math+")  # masked blocks on the CPU's masked path
    headers = [h for h, _ in gpu_check.PARITY_COLUMNS]
    for header in headers:
        assert header in printed, header
    for row in rows:
        assert row["row"] in printed


def test_parity_table_in_plain_text_without_rich(run, monkeypatch):
    _, report, _ = run
    monkeypatch.setitem(sys.modules, "rich.console", None)  # import fails: the plain-text table
    buf = io.StringIO()
    gpu_check.print_parity(report["parity"], file=buf)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1 + len(report["parity"])
    assert all(h in lines[0] for h, _ in gpu_check.PARITY_COLUMNS)


def test_json_report_holds_only_the_selected_sections(run):
    _, report, _ = run
    assert report["sections"] == ["context_parallel", "parity"]
    assert {"context_parallel", "parity"} <= set(report)
    assert not {"exactness", "bench", "steady", "model", "multirank"} & set(report)
    assert set(report["seconds"]) == {"context_parallel", "parity", "total"}
    # the first section's share of the two; the second gets the rest of the budget, what the first left included
    share = gpu_check.SHARES
    assert report["allotted_s"]["context_parallel"] <= 0.05 + report["budget_s"] * share["context_parallel"] / (
        share["context_parallel"] + share["parity"])
    assert report["allotted_s"]["parity"] <= report["budget_s"]
    assert report["env"]["device_type"] == "cpu"


def test_sections_order_skip_and_unknown_names():
    parse, select = gpu_check.parse_args, gpu_check.selected_sections
    assert select(parse([])) == ["exactness", "context_parallel", "parity", "steady", "model", "multirank"]
    assert abs(sum(gpu_check.SHARES.values()) - 1.0) < 1e-9 and gpu_check.SHARES["multirank"] == 0.16
    assert select(parse(["--sections", "multirank,bench,exactness"])) == ["exactness", "bench", "multirank"]
    assert select(parse(["--skip", "model,multirank"]))[-1] == "steady"
    assert parse([]).budget == 300.0
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parse(["--sections", "parity,nonsense"])


def test_no_time_left_records_every_case_as_skipped(tmp_path):
    out = tmp_path / "r.json"
    rc, printed = _main("--device", "cpu", "--sections", "context_parallel,parity", "--budget", "0",
                        "--out", str(out))
    report = json.loads(out.read_text())
    assert rc == 0 and report["failures"] == []
    assert all(c["skipped"] in (gpu_check.REFUSED, gpu_check.SKIPPED_TIME) for c in report["context_parallel"])
    assert any(c["skipped"] == gpu_check.SKIPPED_TIME for c in report["context_parallel"])
    assert report["parity"] and all(r["skipped"] == gpu_check.SKIPPED_TIME for r in report["parity"])
    assert "time budget" in printed  # the skipped rows are in the table, with their reason


def test_parity_skips_rows_predicted_not_to_fit(monkeypatch):
    """Dense rows are predicted in proportion to FLOPs, masked ones by the masked rows before them; each row
    here takes 10 s of a clock the test holds, with 25 s in the share."""
    import types

    clock = [1000.0]
    monkeypatch.setattr(gpu_check, "time", types.SimpleNamespace(time=lambda: clock[0], strftime=time.strftime))

    def row(spec, s, d, sizes, device, reps):
        clock[0] += 10
        pairs = s * s if spec["kind"] == "full" else s * (s + 1) // 2
        return {"row": spec["kind"], "flops_fwd": 4 * sizes["heads"] * d * pairs, "exact": True}

    monkeypatch.setattr(gpu_check, "_parity_row", row)
    rows = gpu_check.parity(CPU, deadline=clock[0] + 25, reps=1)
    ran = [("skipped" not in r) for r in rows]
    # causal d16 runs; full d16 (twice its FLOPs: 20 s > 15 s left) is skipped; causal d8 (5 s) runs; causal
    # d32 (20 s > 5 s) is skipped; the first masked row runs on what is left; then none is left
    assert ran == [True, False, True, False, True, False, False]
    assert rows[1]["skipped"].startswith("predicted 20 s, 15 s left")
    assert rows[5]["skipped"] == gpu_check.SKIPPED_TIME


def test_failures_name_every_failed_check():
    report = {
        "context_parallel": [{"schedule": "ring", "mask": "document", "ok": False, "error": "boom"},
                             {"schedule": "ringx1o", "mask": "causal", "skipped": gpu_check.REFUSED}],
        "parity": [{"row": "32K document d128", "ok": False, "exact": False, "errors": {"out": 0.5}},
                   {"row": "64K full d128", "skipped": gpu_check.SKIPPED_TIME}],
        "steady": {"cases": [{"mask": {"kind": "document"}, "ok": False, "problems": ["3 host-to-device copies"]}],
                   "graph": {"ok": True}, "compile": {"ok": False, "error": "graph break"}},
        "model": {"train_step": {"cpattn": {"ok": False, "error": "OOM", "trace": "..."}},
                  "generate": {"tokens_agree": False, "first_difference": 7}},
        "multirank": {"nccl": {"ok": False, "error": "NCCL ran two ranks on one GPU"},
                      "gloo2": {"ok": True, "ran": 2, "passed": 1},
                      "cases": [{"world": 2, "schedule": "usp", "mask": "full", "ok": False, "problems": ["dk"]},
                                {"world": 2, "schedule": "ring", "mask": "full", "ok": True},
                                {"world": 2, "schedule": "ringx4o", "mask": "full", "skipped": gpu_check.REFUSED}]},
    }
    failed, notes = gpu_check.failures(report)
    text = "\n".join(failed)
    assert len(failed) == 7
    for name in ("context_parallel", "parity 32K document d128", "steady document", "steady compile",
                 "model train_step cpattn", "multirank nccl", '"schedule": "usp"'):
        assert name in text
    assert "64K full" not in text and "ringx1o" not in text and "ringx4o" not in text
    assert any("position 7" in n for n in notes)


def test_local_errors_builds_its_masks_where_the_given_mask_is(monkeypatch):
    """The fast kernel's reference mask is built on ``allowed``'s device (a CUDA run once met a CPU mask
    there), and the masked kernel gets its mask where q is; the meta device stands in for a GPU."""
    from cpattn import exactness

    built = []
    real = exactness.dense_mask
    monkeypatch.setattr(exactness, "dense_mask", lambda *a, **kw: built.append(kw.get("device")) or real(*a, **kw))
    args = example_mask_args("document", 16)
    allowed = real("document", 16, args)
    g = torch.Generator().manual_seed(0)
    x = {n: torch.randn(1, 16, h, 8, generator=g) for n, h in (("q", 4), ("k", 2), ("v", 2), ("dout", 4))}
    ref = exactness.reference(x["q"], x["k"], x["v"], x["dout"], allowed, 0.3)
    errors = exactness.local_errors(x, "document", 0.3, allowed, ref)
    assert built == [allowed.device] and max(errors.values()) < 1e-5
    assert real("causal", 4, device="meta").device.type == "meta"
    meta = {n: t.to("meta") for n, t in x.items()}
    got = exactness.local_kernel(meta["q"], meta["k"], meta["v"], meta["dout"], "document", 0.3, allowed)
    assert {t.device.type for t in got.values()} == {"meta"}


@pytest.mark.slow  # compiles a model
def test_steady_counts_graph_and_compile_on_the_cpu():
    res = gpu_check.steady(CPU, time.time() + 60, reps=1)
    assert [c["mask"]["kind"] for c in res["cases"]] == ["causal", "document", "sliding_window"]
    for case in res["cases"]:
        assert case["ok"] and case["htod_copies"] == 0 and case["host_syncs"] == 0, case
        assert set(case["compiled"]) == {"unique_graphs", "frames", "recompiles"}
        assert case["profiled_events"] > 0  # the profiler ran and saw the call
    assert res["graph"]["ok"] and "stand-in" in res["graph"]["how"]
    assert res["compile"]["ok"] and res["compile"]["backend"] == "aot_eager"


def test_steady_counts_a_recompile_and_a_host_sync_warning(monkeypatch):
    """The counting machinery sees what it must fail on: a compile inside the counted call and a warning
    about a synchronising operation (what set_sync_debug_mode("warn") raises on CUDA)."""
    import warnings

    compiled = torch.compile(lambda x: x * 2, backend="eager")
    before = gpu_check._dynamo_counts()
    compiled(torch.ones(3, dtype=torch.float64))
    after = gpu_check._dynamo_counts()
    assert after["frames"] > before["frames"] and after["unique_graphs"] > before["unique_graphs"]
    with gpu_check._host_syncs(CPU) as syncs:
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert len(syncs) == 1


def test_model_section_on_the_cpu():
    res = gpu_check.model(CPU, time.time() + 120)
    step = res["train_step"]
    assert step["cpattn"]["step_ms"] > 0 and step["sdpa flash"]["step_ms"] > 0
    assert step["cpattn"]["tflops"] > 0 and step["fused_adamw"] in (True, False)
    gen = res["generate"]
    if "skipped" in gen:
        assert "transformers" in gen["skipped"]
    else:
        assert gen["tokens_agree"] and gen["cpattn"]["seconds"] > 0 and gen["sdpa"]["seconds"] > 0
    assert gpu_check.failures({"model": res})[0] == []


@pytest.mark.slow
def test_exactness_bench_and_multirank_sections_on_the_cpu(tmp_path):
    out = tmp_path / "r.json"
    rc, _ = _main("--device", "cpu", "--sections", "exactness,bench,multirank", "--reps", "1", "--out", str(out),
                  "--multirank-schedules", "ring,ulysses,ringx1o", "--budget", "400")
    report = json.loads(out.read_text())
    assert rc == 0 and report["failures"] == []
    ran = [c for c in report["exactness"] if "skipped" not in c]
    assert ran and all(c["ok"] for c in ran)
    assert {r["kind"] for r in report["bench"]} == {"causal", "full"}
    mr = report["multirank"]
    assert mr["gloo2"]["ok"] and mr["gloo4"]["ok"] and "nccl" not in mr
    ran = {(c["world"], c["schedule"], c["mask"], c["dtype"]) for c in mr["cases"] if "skipped" not in c}
    assert (4, "ulysses", "document", "float32") in ran and all(c["ok"] for c in mr["cases"] if "skipped" not in c)
    assert {(c["schedule"], c["mask"]) for c in mr["cases"] if c.get("skipped") == gpu_check.REFUSED} == \
        {("ringx1o", "causal"), ("ringx1o", "document")}
