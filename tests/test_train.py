"""Training end to end: loss parity across (dp, cp) meshes and schedules, resume, torchrun, learning.

Every run trains the same tiny model on the same global batches; a run on a (dp, cp) mesh must follow
the one-process run's losses (1e-5 relative) and end at its parameters (1e-4 relative norm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpattn import train
from cpattn.launcher import RankError, free_port

MESHES = [(1, 2), (1, 4), (2, 2)]
LLAMA_SCHEDULES = ["ring", "zigzag_ring", "ringx3", "ringx4o", "ulysses"]
VIT_SCHEDULES = ["ringx1o", "ringx3b"]


def _matrix(schedules: list[str]) -> list:
    """Every (schedule, mesh): in the default run each schedule on one mesh, the meshes taken in turn (so
    every schedule and every mesh runs), the rest behind the slow marker (``make test-all``)."""
    cases = []
    for i, schedule in enumerate(schedules):
        for j, (dp, cp) in enumerate(MESHES):
            marks = () if j == i % len(MESHES) else (pytest.mark.slow,)
            cases.append(pytest.param(schedule, dp, cp, marks=marks))
    return cases


def _run(worlds, cfg: train.TrainConfig, return_params: bool = True) -> dict:
    results = worlds.get(cfg.world).run(train.run_rank, timeout=300, name=f"train {cfg}",
                                        config=cfg.__dict__ | {"documents": list(cfg.documents)},
                                        return_params=return_params)
    bad = [r for r in results if isinstance(r, RankError)]
    assert not bad, f"{bad[0]}\n{bad[0].traceback}"
    assert all(r["losses"] == results[0]["losses"] for r in results), "ranks logged different losses"
    return results[0]


def _assert_same_run(got: dict, ref: dict, what: str) -> None:
    a, b = torch.tensor(got["losses"], dtype=torch.float64), torch.tensor(ref["losses"], dtype=torch.float64)
    assert a.shape == b.shape and a.numel() > 0
    rel = ((a - b).abs() / b.abs()).max().item()
    assert rel <= 1e-5, f"{what}: losses differ by {rel:.2e} relative\n{got['losses']}\n{ref['losses']}"
    for i, (p, q) in enumerate(zip(got["params"], ref["params"])):
        err = ((p - q).norm() / q.norm().clamp_min(1e-30)).item()
        assert err <= 1e-4, f"{what}: parameter {i} differs by {err:.2e} (relative norm)"


def _base(model: str, **kw) -> train.TrainConfig:
    if model == "llama":
        return train.TrainConfig(**{"model": "llama", "config": "tiny", "steps": 10, "seq": 64, "batch": 4,
                                    "lr": 3e-3, "seed": 3, **kw})
    return train.TrainConfig(**{"model": "vit", "config": "tiny", "steps": 10, "batch": 4, "lr": 1e-3, "seed": 4,
                                **kw})


@pytest.fixture(scope="module")
def references(worlds):
    """The one-process runs every mesh must follow."""
    return {"llama": _run(worlds, _base("llama", dp=1, cp=1, schedule="ring")),
            "vit": _run(worlds, _base("vit", dp=1, cp=1, schedule="ring")),
            "documents": _run(worlds, _base("llama", dp=1, cp=1, schedule="ring", task="documents"))}


@pytest.mark.parametrize("schedule,dp,cp", _matrix(LLAMA_SCHEDULES))
def test_llama_loss_parity(worlds, references, dp, cp, schedule):
    got = _run(worlds, _base("llama", dp=dp, cp=cp, schedule=schedule))
    _assert_same_run(got, references["llama"], f"llama dp{dp} x cp{cp} {schedule}")
    assert got["losses"][-1] < got["losses"][0]


@pytest.mark.parametrize("schedule,dp,cp", _matrix(VIT_SCHEDULES))
def test_vit_loss_parity(worlds, references, dp, cp, schedule):
    got = _run(worlds, _base("vit", dp=dp, cp=cp, schedule=schedule))
    _assert_same_run(got, references["vit"], f"vit dp{dp} x cp{cp} {schedule}")


def test_packed_documents_loss_parity(worlds, references):
    got = _run(worlds, _base("llama", dp=1, cp=2, schedule="zigzag_ring", task="documents"))
    _assert_same_run(got, references["documents"], "documents cp2")


@pytest.mark.slow  # three training runs; test_checkpoint keeps resume in make test
def test_resume_gives_the_uninterrupted_losses(worlds, tmp_path):
    whole = _run(worlds, _base("llama", dp=1, cp=2, schedule="zigzag_ring"), return_params=False)
    ckpt = str(tmp_path / "ckpt")
    first = _run(worlds, _base("llama", dp=1, cp=2, schedule="zigzag_ring", stop_after=5, checkpoint=ckpt),
                 return_params=False)
    assert len(first["losses"]) == 5 and train.latest_checkpoint(ckpt)[0] == 5
    resumed = _run(worlds, _base("llama", dp=1, cp=2, schedule="zigzag_ring", checkpoint=ckpt, resume=True),
                   return_params=False)
    assert resumed["first_step"] == 6
    assert resumed["losses"][5:] == whole["losses"][5:], (resumed["losses"], whole["losses"])


def test_bad_configs_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="multiple of dp"):
        train.TrainConfig(dp=2, batch=3)
    with pytest.raises(ValueError, match="not a vit task"):
        train.TrainConfig(model="vit", task="recall")
    with pytest.raises(ValueError, match="resume needs"):
        train.TrainConfig(resume=True)


@pytest.mark.slow  # torchrun launches stay in make test through test_faults and test_checkpoint
def test_torchrun_gives_the_local_launchers_losses(worlds, tmp_path):
    local = _run(worlds, _base("llama", dp=1, cp=2, schedule="zigzag_ring", steps=4), return_params=False)
    log = tmp_path / "log.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "cpattn.train", "--model", "llama", "--config", "tiny", "--dp", "1", "--cp", "2",
           "--schedule", "zigzag_ring", "--steps", "4", "--seq", "64", "--batch", "4", "--lr", "3e-3", "--seed", "3",
           "--eval-every", "2", "--json", str(log)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(Path(log).read_text())
    assert record["losses"] == local["losses"]
    # evaluation lines as they run, then the results table (not a JSON dump)
    lines = done.stdout.splitlines()
    evals = [line for line in lines if "held-out loss" in line]
    assert [line.split(":")[0] for line in evals] == ["step 2", "step 4"], done.stdout
    assert f"accuracy {record['evaluations'][1]['accuracy']:.3f} (chance 0.042)" in evals[1]
    table = "\n".join(lines[lines.index(evals[-1]) + 1:])
    assert "first loss" in table and "last loss" in table and "MFU" in table and "{" not in table, done.stdout
    assert f"{local['losses'][-1]:.4f}" in table and "dp1 x cp2 zigzag_ring" in table


# ---------------------------------------------------------------------------------- FSDP2, bf16
def _state_per_rank(rec: dict) -> int:
    return sum(rec["state_bytes"].values())


@pytest.mark.parametrize("dp,cp", [pytest.param(2, 2), pytest.param(1, 4, marks=pytest.mark.slow)])
def test_fsdp_follows_the_replicated_run_and_holds_a_share_of_its_state(worlds, dp, cp):
    """FSDP2 over the flattened dp x cp mesh against every rank holding the whole model: the same losses
    (1e-5) and parameters, with 1 / (dp x cp) of the parameter, gradient and AdamW bytes per rank."""
    steps = 4 if (dp, cp) == (2, 2) else 10
    replicated = _run(worlds, _base("llama", dp=dp, cp=cp, steps=steps, fsdp=False, peak_tflops=1.0))
    sharded = _run(worlds, _base("llama", dp=dp, cp=cp, steps=steps, peak_tflops=1.0))
    _assert_same_run(sharded, replicated, f"fsdp dp{dp} x cp{cp}")
    full, share = replicated["state_bytes"], sharded["state_bytes"]
    assert full["params"] == full["grads"] > 0 and full["optimizer"] >= 2 * full["params"]
    for kind in ("params", "grads", "optimizer"):  # the tiny config's dims divide 4: no padding
        per_rank = full[kind] / (dp * cp)
        slack = 4 * len(sharded["params"]) if kind == "optimizer" else 0  # AdamW's step counters stay whole
        assert per_rank <= share[kind] <= per_rank + slack, (kind, share[kind], full[kind])


def test_bf16_autocast_tracks_float32(worlds, references):
    """bf16 autocast (parameters, gradients, their reduction and AdamW float32) against the float32
    one-process run: every loss within 5e-3 relative (measured on this machine: at most 5e-4 over 20 steps)."""
    got = _run(worlds, _base("llama", dp=1, cp=2, dtype="bfloat16", peak_tflops=1.0))
    a, b = torch.tensor(got["losses"]), torch.tensor(references["llama"]["losses"])
    rel = ((a - b).abs() / b).max().item()
    assert 0 < rel <= 5e-3, (rel, got["losses"], references["llama"]["losses"])
    assert got["losses"][-1] < got["losses"][0]


def test_mfu_peaks_come_from_the_data_sheet_table():
    from cpattn.models.flops import BF16_PEAK_TFLOPS, datasheet_peak

    assert datasheet_peak("NVIDIA H100 80GB HBM3") == ("H100 SXM5", 989.5e12)
    assert datasheet_peak("NVIDIA H100 PCIe")[1] == 756.5e12
    assert datasheet_peak("NVIDIA A100-SXM4-80GB")[1] == 312e12
    assert datasheet_peak("AMD Instinct MI250X/MI250") == ("MI250X (one GCD)", 191.5e12)
    assert datasheet_peak("NVIDIA L40S") is None and datasheet_peak("Tesla V100-SXM2-16GB") is None
    docs = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
    for _, device, tflops in BF16_PEAK_TFLOPS:  # the table in docs/models.md is this one
        assert f"| {device} | {tflops:g} |" in docs, device


def test_the_results_table_shows_what_each_run_trained():
    from rich.console import Console

    def rec(schedule: str, cp: int, first_step: int, evaluations: list) -> dict:
        return {"config": {"model": "llama", "config": "tiny", "task": "recall", "seq": 64, "batch": 4, "dp": 1,
                           "cp": cp, "fsdp": True, "dtype": "float32"},
                "losses": [4.0, 3.5, 3.0, 2.5], "first_step": first_step, "evaluations": evaluations,
                "schedule": schedule, "tokens_per_s": 100.0 * cp + (schedule == "ring"), "mfu": 0.1,
                "peak_source": "measured float32 matmul peak", "peak_tflops_per_rank": 0.05, "chance": 1 / 24}

    def text(records: list[dict]) -> str:
        console = Console(width=200, record=True)
        console.print(train.results_table(records))
        return console.export_text()

    resumed = text([rec("zigzag_ring", 2, 3, [])])  # resumed at step 3: its steps and losses
    assert "3-4" in resumed and "3.0000" in resumed and "4.0000" not in resumed
    assert "held-out" not in resumed and "x ring" not in resumed and "x cp=1" not in resumed
    both = text([rec("ring", 1, 1, []), rec("zigzag_ring", 2, 1, [{"step": 4, "loss": 2.0, "accuracy": 0.25}]),
                 rec("ring", 2, 1, [])])
    assert "x ring" in both and "x cp=1" in both and "acc 0.250" in both and "chance 0.042" in both
    assert "1-4" in both and "4.0000" in both and "0.05 TFLOP/s per rank at 1 rank, 0.05 TFLOP/s per rank at 2" in both
