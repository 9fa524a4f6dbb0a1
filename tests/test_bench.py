"""`cpattn bench` end to end on tiny shapes: rows are checked for exactness, timed, and rendered."""

from __future__ import annotations

import json

from cpattn import bench, cli


def test_bench_runs_checks_and_renders(tmp_path):
    cfg = bench.BenchConfig(world=2, seq=128, heads=4, kv_heads=2, head_dim=16, warmup=0, iters=1)
    result = bench.run(cfg, ["ring", "zigzag_ring", "allgather"])
    rows = {r["schedule"]: r for r in result["rows"]}
    assert all(r["ok"] for r in rows.values()), rows
    for r in rows.values():
        assert r["error"] < 1e-5 and r["fwd_bwd_s"] > 0 and r["bytes_sent"] > 0
    assert rows["ring"]["extra"]["work"]["imbalance"] > rows["zigzag_ring"]["extra"]["work"]["imbalance"] == 1.0
    bench.render(result)
    path = tmp_path / "bench.json"
    bench.save_json(result, str(path))
    assert json.loads(path.read_text())["config"]["seq"] == 128


def test_bench_cli_with_mask_spec_topology_and_plot(tmp_path, capsys):
    spec = '{"kind": "sliding_window", "window": 24}'
    rc = cli.main(["bench", "--world", "2", "--topology", "1x2", "--seq", "96", "--heads", "4", "--kv-heads", "2",
                   "--head-dim", "16", "--mask", spec, "--schedules", "ring,allgather", "--warmup", "0",
                   "--iters", "1", "--plot", str(tmp_path / "b.png"), "--json", str(tmp_path / "b.json")])
    assert rc == 0
    assert (tmp_path / "b.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "sliding_window" in out and "vs ring" in out


def test_bench_rejects_bad_arguments_before_starting(capsys):
    assert cli.main(["bench", "--mask", "diagonal"]) == 2
    assert "diagonal" in capsys.readouterr().err
