"""``cpattn reproduce ringx`` / ``ultraattn`` at their smallest settings, and the pure pieces behind them
(``cpattn.lab.papers``): the variant lists, the patterns, and the bandwidth search that explains
a speedup."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from cpattn.masks import resolve

from cpattn import cli
from cpattn.cost import estimate
from cpattn.lab import papers as r

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in ``tmp_path`` with a private plan cache (estimates remember nothing between commands:
    ``cpattn.core.memo``)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CPATTN_CACHE_DIR", str(tmp_path / "plans"))
    return tmp_path


def test_ringx_variants_follow_the_registry_and_masks():
    assert r.ringx_variants("full") == ["ringx1", "ringx1o", "ringx3b"]
    assert r.ringx_variants("causal") == ["ringx2", "ringx2o", "ringx3", "ringx4", "ringx4o"]
    assert r.ringx_schedules("causal") == ["ring", "zigzag_ring", "stripe_ring", *r.ringx_variants("causal")]
    assert r.ringx_schedules("full") == ["ring", *r.ringx_variants("full")]


def test_ringx_command_smallest_grid(in_tmp, capsys):
    argv = ["reproduce", "ringx", "--gcds", "8,16", "--batch", "32", "--tokens-per-gcd", "1024", "--json", "r.json",
            "--plot", "r.png"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "full attention" in out and "causal attention" in out and "3.4x faster than ring" in out
    data = json.loads((in_tmp / "r.json").read_text())
    assert {(c["mask"]["kind"], c["world"]) for c in data["cases"]} == {(m, p) for m in ("full", "causal")
                                                                        for p in (8, 16)}
    for c in data["cases"]:
        variants = r.ringx_variants(c["mask"]["kind"])
        assert set(variants) <= set(c["estimates"]) and c["speedups"]["ring"] == pytest.approx(1.0)
        assert c["seq_len"] == 1024 * c["world"] and c["batch"] == 32 and c["heads"] == c["kv_heads"] == 32
        fitting = [n for n in variants if c["estimates"][n]["fits"]]
        assert c["best"] == min(fitting, key=lambda n: c["estimates"][n]["total"])
    # one search per variant and ring overlap assumption, at the largest GCD count
    assert len(data["gaps"]) == 2 * (3 + 5) and {g["gcds"] for g in data["gaps"]} == {16}
    for g in data["gaps"]:
        assert g["factor"] is not None and g["speedup"] == pytest.approx(3.4, rel=2e-3)
        assert g["link"] == "inter" and g["bandwidth"] == pytest.approx(g["factor"] * 25e9)
    assert (in_tmp / "r.png").read_bytes()[:8] == PNG


def test_ringx_command_rejects_unpaired_shapes(in_tmp, capsys):
    assert cli.main(["reproduce", "ringx", "--gcds", "8", "--batch", "32,64,128", "--tokens-per-gcd", "1024,2048",
                     "--plot", ""]) == 2
    assert "--batch and --tokens-per-gcd" in capsys.readouterr().err


@pytest.mark.parametrize("overlap", [None, 0.0])
def test_ring_bandwidth_search_gives_the_target(overlap):
    case = r.ringx_case("causal", 16, 32, 1024)
    topo = r.ringx_topology(16)
    variant = case.estimates["ringx4o"]
    gap = r.ring_bandwidth_for_speedup(variant, case.problem, topo, 3.4, overlap=overlap)
    assert gap.found and gap.variant == "ringx4o" and gap.reason == ""
    priced = topo if overlap is None else replace(topo, overlap=overlap)
    ring = estimate("ring", case.problem, r.scale_links(priced, gap.factor)).total
    assert ring / variant.total == pytest.approx(3.4, rel=2e-3)
    assert gap.bandwidth == pytest.approx(gap.factor * topo.inter.bandwidth)
    assert gap.at_preset == pytest.approx(case.speedup("ringx4o", "ring"))  # the model as preset, either way
    assert gap.evaluations < 20


def test_ring_bandwidth_search_says_none_when_no_bandwidth_does_it():
    case = r.ringx_case("full", 8, 32, 1024)
    topo = r.ringx_topology(8)
    # the ring cannot be 10x faster than ringx1o at any bandwidth: it computes as much
    gap = r.ring_bandwidth_for_speedup(case.estimates["ringx1o"], case.problem, topo, 0.1)
    assert not gap.found and gap.bandwidth is None and "at any bandwidth" in gap.reason
    # and 3.4x needs far less bandwidth than half the preset's
    gap = r.ring_bandwidth_for_speedup(case.estimates["ringx1o"], case.problem, topo, 3.4, lo=0.5)
    assert not gap.found and "not 3.4x faster at any bandwidth in range" in gap.reason


def test_ultra_patterns_read_the_papers_parameters():
    s = 1 << 16
    assert resolve(r.ultra_pattern("strided", s)).spec() == {"kind": "strided", "block_size": s // 16, "stride": 4,
                                                            "local": 3, "causal": True}
    assert resolve(r.ultra_pattern("streaming", s)).spec()["window"] == 3
    assert resolve(r.ultra_pattern("star", s)).spec() == {"kind": "star", "block_size": s // 16, "sink": 1}
    assert not resolve(r.ultra_pattern("global_local", s)).is_causal
    with pytest.raises(ValueError, match="unknown"):
        r.ultra_pattern("dilated", s)


@pytest.mark.slow  # the README's `cpattn reproduce ultraattn` command runs in make test (tests/test_cli.py)
def test_ultraattn_command_smallest_grid_and_plan_cache(in_tmp, capsys):
    argv = ["reproduce", "ultraattn", "--seq", "2048", "--gpus", "8", "--heads", "1", "--time-budget", "0.5",
            "--json", "u.json", "--plot", "u.png"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "Average over patterns" in out and "5.5x" in out
    data = json.loads((in_tmp / "u.json").read_text())
    assert [c["pattern"] for c in data["cases"]] == list(r.ULTRA_PATTERNS)
    for c in data["cases"]:
        assert {"ultra", "ring", "zigzag_ring", "allgather"} <= set(c["estimates"])
        best = min(("ring", "zigzag_ring"), key=lambda n: c["estimates"][n]["total"])
        assert c["best_ring"] == best
        assert c["vs_ring"] == pytest.approx(c["estimates"][best]["total"] / c["estimates"]["ultra"]["total"])
    (avg,) = data["averages"]
    assert avg["mean_vs_ring_family"] == pytest.approx(sum(c["vs_ring"] for c in data["cases"]) / 4)
    assert (in_tmp / "u.png").read_bytes()[:8] == PNG
    plans = sorted((in_tmp / "plans").iterdir())
    assert len(plans) == 4
    stamps = [p.stat().st_mtime_ns for p in plans]
    assert cli.main([*argv[:-4], "--plot", ""]) == 0  # the second run reads every plan from the cache
    assert [p.stat().st_mtime_ns for p in sorted((in_tmp / "plans").iterdir())] == stamps


def test_ultraattn_command_rejects_an_unknown_pattern(in_tmp, capsys):
    assert cli.main(["reproduce", "ultraattn", "--patterns", "dilated", "--seq", "2048", "--gpus", "8"]) == 2
    assert "unknown" in capsys.readouterr().err
