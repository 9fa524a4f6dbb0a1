"""`cpattn bench` end to end on tiny shapes: rows are checked for exactness, timed, and rendered; the
rendered table and the JSON file say what the timings say."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import statistics

import pytest
import torch

from cpattn import bench, cli, masks


def _columns(result: dict) -> dict[str, list[str]]:
    """The rendered table of ``result`` as ``{header: cells}`` (rich's public column API)."""
    return {col.header: [str(c) for c in col.cells] for col in bench.render(result).columns}


def _synthetic(predicted: bool = False, masked: bool = False, flex: dict | None = None) -> dict:
    """A bench result with chosen timings (no processes): three timed rows and one wrong row."""
    cfg = bench.BenchConfig(world=4, seq=256, mask={"kind": "sliding_window", "window": 8})
    rows = [bench.BenchRow("ring", fwd_s=0.1, fwd_bwd_s=0.4, tflops_per_rank=0.5, speedup=0.5, bytes_sent=3_000_000,
                           bytes_recv=2_000_000, wire_sent=4_000_000, peak_mem_bytes=7_000_000, error=1.5e-7,
                           extra={"work": {"imbalance": 1.75}}),
            bench.BenchRow("zigzag_ring", fwd_s=0.05, fwd_bwd_s=0.2, tflops_per_rank=1.0, speedup=1.0,
                           extra={"work": {"imbalance": 1.0}}),
            bench.BenchRow("wrong_one", ok=False, note="WRONG: relative error 3.00e-01 vs one process"),
            bench.BenchRow("allgather", fwd_s=0.2, fwd_bwd_s=0.8, tflops_per_rank=0.25, speedup=0.25)]
    result = {"config": dataclasses.asdict(cfg), "rows": [dataclasses.asdict(r) for r in rows],
              "baseline": {"fwd_s": 0.05, "fwd_bwd_s": 0.2},
              "environment": {"cores": 2, "threads_per_rank": 1, "torch": "x", "backend": "gloo"}}
    if masked:
        result["baseline"] |= {"causal_fwd_s": 0.02, "causal_fwd_bwd_s": 0.1, "mask_efficiency": 0.5}
        for row, eff in zip(result["rows"], (0.25, 0.5, math.nan, 0.125)):
            row["mask_efficiency"] = eff
        result["baseline"]["flex"] = flex
    if predicted:
        for row, (fwd, both) in zip(result["rows"], [(0.1, 0.5), (0.04, 0.1), (0, 0), (math.nan, math.nan)]):
            if row["ok"]:
                row["pred_fwd_s"], row["pred_fwd_bwd_s"] = fwd, both
                row["pred_error"] = (both - row["fwd_bwd_s"]) / row["fwd_bwd_s"]
        result["prediction"] = {"topology": "local", "rows": 2}
    return result


def test_render_shows_the_rows_and_the_ratios_of_their_timings():
    cols = _columns(_synthetic())
    assert cols["schedule"] == ["ring", "zigzag_ring", "wrong_one", "allgather"]
    assert cols["fwd ms"] == ["100.0", "50.0", "", "200.0"]
    assert cols["fwd+bwd ms"] == ["400.0", "200.0", "[red]failed (1)[/red]", "800.0"]
    # the whole error heads the caption, where it wraps at spaces and is never cut short
    assert str(bench.render(_synthetic()).caption).startswith(
        "(1) wrong_one failed: WRONG: relative error 3.00e-01 vs one process; ")
    # vs X = T(X) / T(row), forward + backward: 0.4 / 0.2, 0.2 / 0.8, ...
    assert cols["vs ring"] == ["1.00x", "2.00x", "", "0.50x"]
    assert cols["vs zigzag_ring"] == ["0.50x", "1.00x", "", "0.25x"]
    assert cols["vs 1 proc"] == ["0.50x", "1.00x", "", "0.25x"]
    assert cols["sent MB/rank"][0] == "3.0" and cols["recv MB/rank"][0] == "2.0" and cols["peak MB/rank"][0] == "7.0"
    assert cols["wire MB/rank"][0] == "4.0"
    assert cols["layout work max/mean"] == ["1.75", "1.00", "", "-"]
    assert cols["max rel err"][0] == "1.5e-07"
    assert not any(h.startswith("pred") for h in cols)
    assert "mask eff" not in cols and "flex fwd ms" not in cols  # only for masked configurations
    table = bench.render(_synthetic())
    assert "P=4" in table.title and '{"kind":"sliding_window","window":8}' in table.title


def test_render_adds_the_predictions():
    cols = _columns(_synthetic(predicted=True))
    assert cols["pred fwd ms"] == ["100.0", "40.0", "", "-"]
    assert cols["pred fwd+bwd ms"] == ["500.0", "100.0", "", "-"]
    assert cols["pred err"] == ["+25%", "-50%", "", "not modelled"]  # (predicted - measured) / measured
    # without ring among the timed rows, only the zigzag_ring ratio is shown
    result = _synthetic()
    result["rows"] = result["rows"][1:]
    assert "vs ring" not in _columns(result) and "vs zigzag_ring" in _columns(result)


def test_render_adds_mask_efficiency_and_the_flex_peer():
    flex = {"fwd_s": 0.03, "compile_s": 12.0, "mask_mod": "arithmetic", "error": 2e-7, "fwd_mask_efficiency": 0.9}
    result = _synthetic(masked=True, flex=flex)
    cols = _columns(result)
    assert cols["mask eff"] == ["0.25", "0.50", "", "0.12"]
    assert cols["flex fwd ms"] == ["30.0", "30.0", "", "30.0"]
    caption = str(bench.render(result).caption)
    assert "mask eff = T(dense causal" in caption and "compiled in 12.0 s" in caption and "forward only" in caption
    # flex that could not run: a dash in the column and the reason in the caption, never silence
    result = _synthetic(masked=True, flex={"note": "torch.compile(flex_attention) failed here: no compiler"})
    assert _columns(result)["flex fwd ms"] == ["-", "-", "", "-"]
    assert "not run (torch.compile(flex_attention) failed here: no compiler)" in str(bench.render(result).caption)


def test_mask_efficiency_is_causal_time_scaled_by_the_allowed_pairs():
    assert not bench.is_masked("causal") and not bench.is_masked("full")
    assert bench.is_masked({"kind": "document", "lengths": [3, 5]})
    # two documents of 4: 2 x 10 allowed pairs of the 36 causal ones
    eff = bench.mask_efficiency(0.9, {"kind": "document", "lengths": [4, 4]}, 8, 0.5)
    assert math.isclose(eff, 0.9 * 20 / 36 / 0.5)


MASKS = [masks.document([5, 17, 10]), masks.document([8, 24], causal=False), masks.sliding_window(6),
         masks.strided(4, 3), masks.streaming(1, 2, 4), masks.global_local(4), masks.star(8),
         masks.sliding_window(5) | masks.document([16, 16]), masks.block_table([[1, 0], [2, 1]], 16),
         masks.from_mask_mod(lambda q, k: (q + k) % 3 == 0)]


@pytest.mark.parametrize("mask", MASKS, ids=[repr(m) for m in MASKS])
def test_flex_mask_mod_allows_exactly_the_pairs_of_the_mask(mask):
    fn, how = bench.flex_mask_mod(mask, 32)
    q, k = torch.arange(32).unsqueeze(1), torch.arange(32).unsqueeze(0)
    assert torch.equal(fn(0, 0, q, k).expand(32, 32), mask.dense(0, 32, 0, 32))
    expect = "document ids" if isinstance(mask, masks.DocumentMask) else \
        "dense S x S table" if isinstance(mask, (masks.BlockTableMask, masks.MaskModMask)) else None
    assert expect is None or how == expect


def test_flex_mask_mod_refuses_a_dense_table_past_the_limit():
    with pytest.raises(ValueError, match="too large"):
        bench.flex_mask_mod(masks.from_mask_mod(lambda q, k: k <= q), bench.FLEX_DENSE_MAX_SEQ + 1)


@pytest.mark.slow
def test_bench_flex_peer_runs_compiled_and_checked():
    """FlexAttention compiles (tens of seconds on two cores), runs and matches the one-process output."""
    cfg = bench.BenchConfig(world=2, seq=256, heads=4, kv_heads=2, head_dim=16, warmup=0, iters=1,
                            mask={"kind": "document", "lengths": [100, 156]})
    result = bench.run(cfg, ["ring"], flex=True)
    flex = result["baseline"]["flex"]
    if "note" in flex:  # no compiler here: the reason is stated
        assert "flex" in flex["note"].lower()
    else:
        assert flex["fwd_s"] > 0 and flex["error"] < 1e-4 and flex["mask_mod"] == "document ids"
        assert "flex fwd ms" in _columns(result)


def test_bench_runs_checks_and_renders(tmp_path):
    cfg = bench.BenchConfig(world=2, seq=128, heads=4, kv_heads=2, head_dim=16, warmup=0, iters=1)
    result = bench.run(cfg, ["ring", "zigzag_ring", "allgather"], speed_probe=True)
    rows = {r["schedule"]: r for r in result["rows"]}
    assert list(rows) == ["ring", "zigzag_ring", "allgather"]
    assert all(r["ok"] for r in rows.values()), rows
    for r in rows.values():  # a probe sample before each timed iteration of each phase, blocks cut to a rank's share
        probe = r["extra"]["speed_probe"]
        assert probe["blocks"] == [("full", 64), ("causal", 64)]
        assert len(probe["seconds"]) == cfg.iters * cfg.repeats and all(sec > 0 for sec in probe["seconds"])
    base = result["baseline"]["rounds"]["fwd_bwd_s"]
    assert len(base) == cfg.repeats == 3
    for r in rows.values():
        assert r["error"] < 1e-5 and r["fwd_bwd_s"] > 0 and r["bytes_sent"] > 0
        assert r["wire_sent"] == r["bytes_sent"]  # rings and gathers forward nothing for others
        # every round times the one process and then each schedule; the ratio is taken within each round
        mine = r["extra"]["rounds"]["fwd_bwd_s"]
        assert len(mine) == cfg.repeats and r["fwd_bwd_s"] == statistics.median(mine)
        assert tuple(r["fwd_bwd_range"]) == (min(mine), max(mine))
        assert math.isclose(r["speedup"], statistics.median(b / t for b, t in zip(base, mine)))
        assert r["speedup_range"][0] <= r["speedup"] <= r["speedup_range"][1]
        assert r["noise"] == (r["speedup_range"][1] > result["environment"]["parallel_limit"])
    assert rows["ring"]["extra"]["work"]["imbalance"] > rows["zigzag_ring"]["extra"]["work"]["imbalance"] == 1.0
    cols = _columns(result)
    assert cols["schedule"] == list(rows)
    assert cols["vs ring"] == [f"{rows['ring']['fwd_bwd_s'] / r['fwd_bwd_s']:.2f}x" for r in rows.values()]
    assert [c.split(" (")[0] for c in cols["fwd+bwd ms"]] == [f"{r['fwd_bwd_s'] * 1e3:.1f}" for r in rows.values()]
    assert all(" (" in c and c.endswith(")") for c in cols["fwd+bwd ms"] + cols["vs 1 proc"])  # the range
    assert cols["sent MB/rank"] == [f"{r['bytes_sent'] / 1e6:.1f}" for r in rows.values()]
    path = tmp_path / "bench.json"
    bench.save_json(result, str(path))
    saved = json.loads(path.read_text())
    assert saved["config"] == json.loads(json.dumps(result["config"])) and saved["config"]["seq"] == 128
    assert [(r["schedule"], r["fwd_bwd_s"], r["bytes_sent"], r["wire_sent"]) for r in saved["rows"]] == \
        [(r["schedule"], r["fwd_bwd_s"], r["bytes_sent"], r["wire_sent"]) for r in rows.values()]
    assert saved["baseline"] == result["baseline"]
    assert "sharing" not in result["environment"] and result["environment"]["gpus"] == torch.cuda.device_count()
    shared = {**result, "environment": {**result["environment"], "gpus": 1, "sharing": bench.sharing(2, 1)}}
    tab = bench.render(shared, width=400)
    assert "1 GPU shared by 2 ranks" in str(tab.title) and "NOTE: 2 ranks shared 1 GPU" in str(tab.caption)


@pytest.mark.slow
def test_bench_cli_with_mask_spec_topology_and_plot(tmp_path, capsys):
    spec = '{"kind": "sliding_window", "window": 24}'
    rc = cli.main(["bench", "--world", "2", "--topology", "1x2", "--seq", "96", "--heads", "4", "--kv-heads", "2",
                   "--head-dim", "16", "--mask", spec, "--schedules", "ring,allgather", "--warmup", "0",
                   "--iters", "1", "--no-flex", "--plot", str(tmp_path / "b.png"), "--json", str(tmp_path / "b.json")])
    assert rc == 0
    assert (tmp_path / "b.png").stat().st_size > 0
    saved = json.loads((tmp_path / "b.json").read_text())
    base = saved["baseline"]
    assert "flex" not in base and base["causal_fwd_bwd_s"] > 0  # a masked configuration: the causal reference
    for r in saved["rows"]:
        assert math.isclose(r["mask_efficiency"], bench.mask_efficiency(base["causal_fwd_bwd_s"], json.loads(spec), 96,
                                                                       r["fwd_bwd_s"]))
        assert r["peak_mem_bytes"] > 0  # live tensor bytes: never 0 after warm-up
    assert saved["config"]["mask"] == json.loads(spec) and saved["config"]["topology"] == [1, 2]
    assert [(r["schedule"], r["ok"]) for r in saved["rows"]] == [("ring", True), ("allgather", True)]
    out = capsys.readouterr().out
    assert "sliding_window" in out and "vs ring" in out and "allgather" in out and "mask eff" in out


def test_spread_is_the_median_and_the_range_of_the_rounds():
    assert bench.spread([0.3, 0.1, 0.2]) == (0.2, (0.1, 0.3))
    assert bench.spread([0.5]) == (0.5, (0.5, 0.5))
    mid, (lo, hi) = bench.spread([])
    assert math.isnan(mid) and math.isnan(lo) and math.isnan(hi)


def test_the_parallel_limit_is_the_processors_the_ranks_compute_on():
    assert bench.parallel_limit(2, 1, cores=2) == 2
    assert bench.parallel_limit(4, 1, cores=2) == 2  # four ranks on two cores: still two at a time
    assert bench.parallel_limit(2, 4, cores=16) == 8
    assert bench.parallel_limit(8, 1, cores=2, gpus=8) == 8 and bench.parallel_limit(4, 1, cores=64, gpus=1) == 1


def test_a_ratio_above_the_limit_is_noise_and_the_ratio_is_taken_within_each_round():
    """Each round's ratio pairs the one process and the schedule of that round; a round that measured more
    than two cores allow (the one process ran while the machine was busy) makes the row noise, whatever
    its median says."""
    base = [(0.1, 1.0), (0.1, 1.5), (0.1, 1.0)]
    fig = bench.round_figures(base, [(0.05, 1.1), (0.05, 1.0), (0.05, 0.9)], limit=2)
    assert fig["fwd_bwd_s"] == 1.0 and fig["fwd_bwd_range"] == (0.9, 1.1)
    assert math.isclose(fig["speedup"], 1 / 0.9) and fig["speedup_range"] == (1 / 1.1, 1.5)
    assert fig["fwd_speedup"] == 2.0 and not fig["noise"]
    busy = [(0.1, 1.0), (0.1, 3.0), (0.1, 1.0)]
    noisy = bench.round_figures(busy, [(0.05, 1.1), (0.05, 1.0), (0.05, 0.9)], limit=2)
    assert noisy["noise"] and noisy["speedup"] < 2 and noisy["speedup_range"][1] == 3.0


def test_render_shows_each_range_and_prints_noise_as_noise():
    result = _synthetic()
    result["environment"]["parallel_limit"] = 2
    result["config"]["repeats"] = 3
    ring, zigzag = result["rows"][0], result["rows"][1]
    ring |= {"fwd_range": (0.09, 0.12), "fwd_bwd_range": (0.38, 0.45), "speedup_range": (0.4, 0.6)}
    zigzag |= {"speedup": 2.73, "speedup_range": (0.91, 3.1), "noise": True}
    result["baseline"] |= {"fwd_range": (0.04, 0.06), "fwd_bwd_range": (0.19, 0.25)}
    cols = _columns(result)
    assert cols["fwd ms"][0] == "100.0 (90-120)" and cols["fwd+bwd ms"][0] == "400.0 (380-450)"
    assert cols["vs 1 proc"][:2] == ["0.50x (0.40-0.60)", "noise (0.91-3.10x)"]  # never "2.73x"
    assert cols["vs 1 proc"][3] == "0.25x"  # no rounds recorded: the value alone
    caption = str(bench.render(result).caption)
    assert caption.startswith("(1) wrong_one failed") and "NOISE: zigzag_ring measured above 2x" in caption
    assert "fwd 50.0 (40-60) ms, fwd+bwd 200.0 (190-250) ms" in caption
    assert "median (lowest-highest) over 3 rounds" in caption and "above 2x noise" in caption
    result["rows"][1]["noise"] = False
    assert "NOISE" not in str(bench.render(result).caption)


def test_bench_rejects_bad_arguments_before_starting(capsys):
    assert cli.main(["bench", "--mask", "diagonal"]) == 2
    assert "diagonal" in capsys.readouterr().err


def test_a_wide_table_keeps_every_schedule_name_and_header_whole(capsys, monkeypatch):
    """Outside a terminal the table prints at its natural width (nothing folded or cropped); in a
    narrow terminal the long headers fold, but a schedule name is never shortened."""
    from rich.console import Console

    from cpattn import output

    flex = {"fwd_s": 0.03, "compile_s": 12.0, "mask_mod": "arithmetic", "error": 2e-7, "fwd_mask_efficiency": 0.9}
    result = _synthetic(predicted=True, masked=True, flex=flex)
    output.show_wide(bench.render(result))  # pytest's captured stdout is not a terminal
    out = capsys.readouterr().out
    for text in ("zigzag_ring", "allgather", "TFLOP/s/rank", "vs zigzag_ring", "layout work max/mean", "pred err",
                 "+25%", "not modelled"):
        assert text in out, text
    assert "…" not in out
    narrow = Console(width=100, file=io.StringIO(), color_system=None)
    narrow.print(bench.render(result, width=100))
    text = narrow.file.getvalue()
    assert "zigzag_ring " in text and "allgather" in text and max(map(len, text.splitlines())) <= 100


def test_a_table_of_ranks_sharing_a_gpu_says_so():
    """P ranks on fewer GPUs: time-sliced compute and staged transfers, said in the title and the caption,
    so nobody reads the times as a cluster's; a GPU per rank or the CPU says nothing."""
    from cpattn import bench

    assert bench.sharing(2, 0) is None and bench.sharing(2, 2) is None and bench.sharing(8, 8) is None
    note = bench.sharing(4, 1)
    assert "4 ranks shared 1 GPU" in note and "staged" in note and "not a cluster's" in note
    assert "up to 2 per GPU" in bench.sharing(3, 2)
    assert bench.rank_device() == torch.device("cpu") or torch.cuda.is_available()
