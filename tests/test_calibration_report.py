"""The prediction's terms (``Estimate.terms``, ``bench --predict``'s breakdown) and calibration's own
report: every figure it measured, the difference between calibrations, and the busy-machine check."""

from __future__ import annotations

import dataclasses
import io
import math
import statistics
import time

import pytest
from rich.console import Console

from cpattn import bench
from cpattn.core.topology import Link, RatePoint
from cpattn.cost import Problem, estimate, presets, profile
from cpattn.lab import machine_profile


def _profile(scale: float = 1.0, latency: float = 5e-5) -> profile.Profile:
    pts = tuple(RatePoint(ph, kind, n, n, scale * 1e10 * (i + 1)) for i, (ph, kind, n) in enumerate(
        (ph, kind, n) for ph in ("forward", "backward") for kind in ("full", "causal") for n in (256, 1024)))
    return profile.Profile(pts, {"sendrecv": Link(latency, scale * 2e9), "all_gather": Link(1e-4, 5e8)},
                           8e9 * scale, 0.4, 2, 2, 1, 16 * 2**30, {"torch": "x"})


@pytest.mark.parametrize("name", ["ring", "zigzag_ring", "allgather", "ringx4o", "ulysses"])
def test_terms_add_up_to_the_estimate(name):
    topo = presets.local(2, _profile())
    est = estimate(name, Problem(4096, 2, "causal", dtype="float32"), topo)
    terms = est.terms()
    assert sum(terms.values()) == pytest.approx(est.total)
    assert terms["merge"] > 0 and terms["kernels"] > terms["merge"]
    assert terms["launch"] == 0.0  # calibrated CPU devices charge no launch
    # the merges are the epilogue bytes at the memory bandwidth: twice the bandwidth, half the merge time
    faster = dataclasses.replace(_profile(), memory_bandwidth=16e9)
    assert estimate(name, Problem(4096, 2, "causal", dtype="float32"),
                    presets.local(2, faster)).merge == pytest.approx(est.merge / 2)


def test_launch_overheads_are_counted_per_call():
    topo = presets.preset("dgx-h100", 8)
    est = estimate("ring", Problem(1 << 16, 8, "full", dtype="bfloat16"), topo, "forward")
    assert est.launch == pytest.approx(8 * topo.device.launch)  # 8 steps, one kernel call each


def test_calibration_differences_and_median():
    a, b = _profile(1.0, latency=5e-5), _profile(1.1, latency=0.0)
    rates = machine_profile.rates(a)
    assert rates["forward full 256x256"] == 1e10 and rates["sendrecv bandwidth"] == 2e9
    assert rates["memory bandwidth"] == 8e9 and rates["overlap"] == 0.4 and rates["sendrecv latency"] == 5e-5
    spread = machine_profile.spread([a, b])
    assert set(spread) == set(rates)
    assert spread["forward full 256x256"][2] == pytest.approx(0.1)
    assert spread["sendrecv latency"] == (0.0, 5e-5, 5e-5)  # latencies: an absolute difference
    assert spread["overlap"][2] == 0.0
    mid = machine_profile.combine([a, b, _profile(1.05)])
    assert machine_profile.rates(mid)["backward causal 1024x1024"] == pytest.approx(1.05 * 8e10)
    assert mid.links["sendrecv"] == Link(5e-5, 1.05 * 2e9)


def test_calibrations_compared_at_a_common_speed():
    """A machine that ran 7% faster in the second calibration moves every rate by 7%: at a common speed the
    two agree, save the one rate that moved on its own."""
    a = _profile()
    b = machine_profile.at_speed(a, 1.07)
    rates_a, rates_b = machine_profile.rates(a), machine_profile.rates(b)
    assert rates_b["backward causal 256x256"] == pytest.approx(1.07 * rates_a["backward causal 256x256"])
    assert rates_b["sendrecv bandwidth"] == pytest.approx(1.07 * 2e9)
    assert rates_b["sendrecv latency"] == pytest.approx(5e-5 / 1.07) and rates_b["overlap"] == 0.4
    assert rates_b["memory bandwidth"] == pytest.approx(1.07 * 8e9)
    off = dataclasses.replace(b, kernels=tuple(dataclasses.replace(p, flop_per_s=p.flop_per_s * 1.1)
                                               if (p.phase, p.kind, p.q_len) == ("forward", "full", 256) else p
                                               for p in b.kernels))
    speeds = machine_profile.levels([a, off])
    assert speeds == pytest.approx([1.0, 1.07])
    assert machine_profile.spread([a, off])["backward full 1024x1024"][2] == pytest.approx(0.07)
    common = machine_profile.spread([machine_profile.at_speed(p, 1 / v) for p, v in zip([a, off], speeds)])
    assert common["backward full 1024x1024"][2] == pytest.approx(0.0, abs=1e-12)
    assert common["sendrecv bandwidth"][2] == pytest.approx(0.0, abs=1e-12)
    assert common["forward full 256x256"][2] == pytest.approx(0.1)


@pytest.mark.slow  # two calibrations; the comparison itself is tested on data above
def test_calibrate_repeat_prints_the_differences_as_measured_and_at_a_common_speed(tmp_path, capsys):
    from cpattn import cli

    path = tmp_path / "profile.json"
    assert cli.main(["calibrate", "--quick", "--repeat", "2", "--profile", str(path)]) == 0
    out = capsys.readouterr().out
    assert "at a common speed" in out and "overall speed of each calibration against the first" in out
    assert "largest difference between the calibrations:" in out and path.exists()
    first = out.split("overall speed of each calibration against the first (median kernel rate): ")[1].split()[0]
    assert first.rstrip(",") == "1.000"


def test_a_busy_machine_is_reported():
    watch = machine_profile.Interference()
    watch.start()
    sum(i * i for i in range(200_000))
    watch.stop()
    assert 0.0 <= watch.share < float("inf")
    watch.share = 0.0
    assert not watch.busy and watch.warning() is None
    watch.share = 0.5
    assert watch.busy and "50% of the cores" in watch.warning() and "idle machine" in watch.warning()


def test_bench_breakdown_shows_every_term_next_to_the_measured_time(tmp_path, monkeypatch):
    monkeypatch.setenv(profile.PROFILE_ENV, str(tmp_path / "none.json"))
    cfg = bench.BenchConfig(world=2, seq=2048, mask="causal")
    rows = [dataclasses.asdict(bench.BenchRow(n, fwd_s=0.1, fwd_bwd_s=0.3)) for n in ("ring", "zigzag_ring")]
    result = bench.predict({"config": dataclasses.asdict(cfg), "rows": rows, "baseline": {},
                            "environment": {"cores": 2, "threads_per_rank": 1}})
    terms = result["rows"][0]["extra"]["prediction_terms"]["forward+backward"]
    assert sum(terms.values()) == pytest.approx(result["rows"][0]["pred_fwd_bwd_s"])
    text = io.StringIO()
    Console(file=text, width=100).print(bench.render_breakdown(result, width=100))
    shown = text.getvalue()
    for header in ("kernels", "merges", "exposed comm", "predicted", "measured", "pred err"):
        assert header in shown
    assert f"{terms['kernels'] * 1e3:.1f}" in shown and "300.0" in shown
    narrow = io.StringIO()
    Console(file=narrow, width=60).print(bench.render_breakdown(result, width=60))
    assert max(len(line) for line in narrow.getvalue().splitlines()) <= 60


def test_the_speed_probe_puts_predictions_at_the_speed_the_machine_ran(tmp_path, monkeypatch):
    """A row whose probe ran 1.25 times faster than the model gives its kernels is predicted at 1/1.25 of
    the model's time; the model's own prediction and error stay in the row, and the breakdown shows both.
    The speed of a row is the median of its samples and those of its neighbours in the window."""
    monkeypatch.setenv(profile.PROFILE_ENV, str(tmp_path / "none.json"))
    cfg = bench.BenchConfig(world=2, seq=4096, mask="causal")
    blocks = bench.probe_blocks(cfg)
    assert blocks == list(bench.SPEED_PROBE) and bench.probe_blocks(dataclasses.replace(cfg, seq=512)) == \
        [("full", 256), ("causal", 256)]
    device = bench.emulated_topology(2, 1, 1, 2, profile=None).device
    expected = 0.0
    for kind, n in blocks:  # the probe's calls at the device's rates (no epilogue: calibration timed calls alone)
        for phase in ("forward", "backward"):
            pairs = n * (n + 1) // 2 if kind == "causal" else n * n
            flops = 4 * cfg.batch * cfg.heads * cfg.head_dim * pairs * (2.5 if phase == "backward" else 1.0)
            expected += device.launch + flops / device.rate(phase, kind, n, n)

    def result(window):
        rows = [dataclasses.asdict(bench.BenchRow(n, fwd_s=0.1, fwd_bwd_s=0.3))
                for n in ("ring", "zigzag_ring", "allgather")]
        rows[0]["extra"]["speed_probe"] = {"blocks": blocks, "seconds": [expected / x for x in (1.2, 1.25, 1.3)]}
        rows[1]["extra"]["speed_probe"] = {"blocks": blocks, "seconds": [expected] * 3}
        return bench.predict({"config": dataclasses.asdict(cfg), "rows": rows, "baseline": {},
                              "environment": {"cores": 2, "threads_per_rank": 1}}, speed_window=window)

    alone = result(0)
    probed, steady, plain = alone["rows"]
    assert probed["speed"] == pytest.approx(1.25) and steady["speed"] == pytest.approx(1.0)
    assert [r["speed"] for r in result(None)["rows"][:2]] == pytest.approx([1.1, 1.1])  # median of all six
    assert [r["speed"] for r in result(1)["rows"][:2]] == pytest.approx([1.1, 1.1])
    model = probed["extra"]["at_profile_speed"]
    assert probed["pred_fwd_bwd_s"] == pytest.approx(model["fwd_bwd_s"] / probed["speed"])
    assert model["error"] == pytest.approx(model["fwd_bwd_s"] / 0.3 - 1)
    assert math.isnan(plain["speed"]) and plain["pred_fwd_bwd_s"] == plain["extra"]["at_profile_speed"]["fwd_bwd_s"]
    summary = alone["prediction"]
    assert summary["speed"] == pytest.approx([1.0, 1.125, 1.25])
    assert summary["median_abs_error_at_profile_speed"] == pytest.approx(
        statistics.median(abs(r["extra"]["at_profile_speed"]["error"]) for r in alone["rows"]))
    text = io.StringIO()
    Console(file=text, width=200).print(bench.render_breakdown(alone, width=200))
    shown = text.getvalue()
    assert "speed" in shown and "model err" in shown and f"{probed['speed']:.3f}" in shown


def test_a_pass_spreads_the_samples_of_every_figure():
    """One pass times every figure; the noisy ones come several times, each repetition after all the
    others of its group, so the samples of one figure are spread over the pass, not timed in a burst."""
    s = machine_profile.Settings()
    keys = machine_profile.probes(s)
    counts = {key: keys.count(key) for key in keys}
    assert max(s.sizes) >= 8192  # the blocks of a 2-rank run at 16K tokens, ulysses' 8K sequence
    assert counts[("kernel", "full", 2048, 1, "forward")] == counts[("kernel", "causal", 8192, 1, "backward")] == 1
    later = machine_profile.probes(s, 1)  # the large blocks come in every large_every-th pass
    assert s.large_every == 2 and ("kernel", "full", 8192, 1, "forward") not in later
    assert ("kernel", "full", 2048, 1, "forward") in later and len(machine_profile.probes(s, 2)) == len(keys)
    assert counts[("kernel", "causal", 512, 1, "backward")] == s.small_samples > 1
    assert counts[("kernel", "full", 16, s.stacked_rows // 16, "forward")] == s.small_samples
    assert counts[("op", "all_gather", 1 << 24)] == counts[("merge", max(s.sizes))] == s.comm_samples > 1
    assert counts[("overlap", "both")] == s.comm_samples
    assert {key[1] for key in keys if key[0] == "op"} == set(machine_profile.CALIBRATED_OPS)
    where = [i for i, key in enumerate(keys) if key == ("op", "sendrecv", 1 << 16)]
    between = {keys[i] for i in range(where[0] + 1, where[1])}
    assert ("op", "all_to_all", 1 << 24) in between and ("merge", max(s.sizes)) in between


def test_a_sample_times_several_calls_after_the_barrier():
    calls, barriers = [], []
    seconds = machine_profile.sample(lambda: calls.append(time.perf_counter()), 4, lambda: barriers.append(1))
    assert len(calls) == 4 and barriers == [1] and 0 <= seconds < 0.01


def test_the_speed_of_each_pass_shows_the_drift():
    a, b = ("kernel", "full", 256, 1, "forward"), ("op", "sendrecv", 1 << 16)
    per_pass = [[(a, 1.0), (b, 2.0), (b, 2.0)], [(a, 1.1), (b, 2.2)], [(a, 0.9), (b, 1.8)]]
    seconds = {a: 1.0, b: 2.0}
    speeds = machine_profile.pass_speeds(per_pass, seconds)
    assert speeds == pytest.approx([1.0, 1 / 1.1, 1 / 0.9])
