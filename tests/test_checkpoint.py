"""Checkpoints that commit atomically, resume that checks, NaN guards, preemption (docs/robustness.md).

Saves are cut short by fault injection (``$CPATTN_CHECKPOINT_FAULT``, at a chosen point of a chosen
step), not by timing luck; the two signal cases (SIGTERM under torchrun, SIGKILL of the launcher) wait
for a step reported by the workers' status files (``$CPATTN_TRAIN_STATUS``) before they signal."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import checkpoint_workers
import pytest
import torch

from cpattn import checkpoint as ckpt
from cpattn import cli, train
from cpattn.launcher import RankError, free_port

ROOT = Path(__file__).resolve().parent.parent
BASE = dict(model="llama", config="tiny", dp=1, cp=2, schedule="zigzag_ring", steps=4, seq=64, batch=4, lr=3e-3,
            seed=3, peak_tflops=1.0)


def _cfg(**kw) -> train.TrainConfig:
    return train.TrainConfig(**{**BASE, **kw})


def _go(worlds, cfg: train.TrainConfig, env: dict[str, str] | None = None) -> list:
    """Every rank's result (a record or a RankError) of ``cfg`` on a local world."""
    config = dataclasses.asdict(cfg) | {"documents": list(cfg.documents)}
    return worlds.get(cfg.world).run(checkpoint_workers.run_with_env, timeout=300, name=f"checkpoint {cfg}",
                                     config=config, env=env or {})


def _ok(worlds, cfg: train.TrainConfig, env: dict[str, str] | None = None) -> dict:
    results = _go(worlds, cfg, env)
    bad = [r for r in results if isinstance(r, RankError)]
    assert not bad, f"{bad[0]}\n{bad[0].traceback}"
    return results[0]


def _errors(worlds, cfg: train.TrainConfig, env: dict[str, str] | None = None) -> list[RankError]:
    results = _go(worlds, cfg, env)
    assert all(isinstance(r, RankError) for r in results), results
    assert len({r.message for r in results}) == 1, [r.message for r in results]  # the same on every rank
    return results


@pytest.fixture(scope="module")
def uninterrupted(worlds):
    """Seed 3's and seed 5's losses over 4 steps, nothing saved."""
    return {seed: _ok(worlds, _cfg(seed=seed))["losses"] for seed in (3, 5)}


# ---------------------------------------------------------------------------------- no workers
def test_resume_refuses_each_result_changing_field_and_accepts_the_rest():
    saved = dataclasses.asdict(_cfg(checkpoint="/c"))
    changed = {"model": "vit", "config": "small", "task": "documents", "seed": 4, "seq": 128, "batch": 8,
               "lr": 1e-3, "documents": (32, 32), "dtype": "bfloat16", "data": "corpus", "tokenizer": "tok.json"}
    assert set(changed) == set(ckpt.RESULT_FIELDS)
    for name, value in changed.items():
        with pytest.raises(ckpt.CheckpointError, match=rf"\b{name} .* -> "):
            ckpt.check_resume(saved, saved | {name: value})
    with pytest.raises(ckpt.CheckpointError, match="seed 3 -> 4; seq 64 -> 128"):
        ckpt.check_resume(saved, saved | {"seed": 4, "seq": 128})
    notes = ckpt.check_resume(saved, saved | {"schedule": "ring", "dp": 2, "cp": 1, "steps": 40,
                                              "checkpoint_every": 5, "fsdp": False})
    assert notes == ["dp: 1 -> 2", "cp: 2 -> 1", "fsdp: True -> False", "schedule: 'zigzag_ring' -> 'ring'",
                     "steps: 4 -> 40", "checkpoint_every: 0 -> 5"]


def test_damaged_records_are_refused_naming_the_file(tmp_path):
    step = tmp_path / "step-000002"
    step.mkdir()
    (step / "__0_0.distcp").write_bytes(b"x" * 10)
    good = {"format": ckpt.FORMAT, "step": 2, "data_position": 2, "run_id": "r", "cpattn": "0", "torch": "0",
            "config": {}, "losses": [1.0, 2.0], "params": {},
            "files": {"__0_0.distcp": {"bytes": 10, "sha256": ckpt._hash_file(step / "__0_0.distcp")["sha256"]}}}
    (step / "record.json").write_text(json.dumps(good))
    assert ckpt.verify_step(step)["step"] == 2
    for bad, match in [(json.dumps(good)[:40], "not valid JSON"), (json.dumps(good | {"format": 9}), "format 9"),
                       (json.dumps(good | {"step": 3}), "directory is step 2"),
                       (json.dumps({k: v for k, v in good.items() if k != "files"}), "'files'")]:
        (step / "record.json").write_text(bad)
        with pytest.raises(ckpt.CheckpointError, match=match) as info:
            ckpt.verify_step(step)
        assert str(step / "record.json") in str(info.value)
    (step / "record.json").write_text(json.dumps(good))
    (step / "__0_0.distcp").write_bytes(b"y" * 10)
    with pytest.raises(ckpt.CheckpointError, match="SHA-256 differs"):
        ckpt.verify_step(step)
    (step / "__1_0.distcp").write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError, match="does not list"):
        ckpt.verify_step(step)


def _cli(capsys, *args: str) -> tuple[int, str]:
    code = cli.main(["train", "--nproc", "2", "--cp", "2", "--seq", "64", "--peak-tflops", "1", *args])
    return code, capsys.readouterr().err.strip()


def test_bad_arguments_are_one_line_before_any_worker_starts(capsys, tmp_path, monkeypatch):
    import cpattn.launcher

    def no_world(*a, **k):
        raise AssertionError("a world was started")

    monkeypatch.setattr(cpattn.launcher, "LocalWorld", no_world)
    (tmp_path / "old" / "step-000003").mkdir(parents=True)
    cases = [(["--config", "huge"], "config='huge' is not a llama config"),
             (["--schedule", "ringx1o"], "schedule 'ringx1o' cannot train this run"),
             (["--checkpoint-every", "-1", "--checkpoint", str(tmp_path / "a")], "checkpoint_every must be"),
             (["--resume", "--checkpoint", str(tmp_path / "missing")], "does not exist"),
             (["--checkpoint", str(tmp_path / "old")], "already holds a run (step 3); continue it with --resume"),
             (["--resume", "--overwrite", "--checkpoint", str(tmp_path / "old")], "contradict")]
    for args, message in cases:
        code, err = _cli(capsys, *args)
        assert code == 2 and message in err and len(err.splitlines()) == 1, (args, err)


# ---------------------------------------------------------------------------------- with workers
def test_a_save_cut_short_in_a_reused_directory_never_mixes_runs(worlds, uninterrupted, tmp_path):
    root = tmp_path / "ck"
    _ok(worlds, _cfg(checkpoint=str(root), checkpoint_every=1))  # the old run: steps 1-4, seed 3
    new = _cfg(seed=5, checkpoint=str(root), checkpoint_every=1)
    assert "already holds a run" in _errors(worlds, new)[0].message  # the workers refuse it too
    # the new run, clearing the old one, dies while publishing step 3 (after every shard and the record)
    errs = _errors(worlds, dataclasses.replace(new, overwrite=True), {ckpt.FAULT_ENV: "record:3::raise"})
    assert "injected checkpoint fault at record of step 3" in errs[0].message
    assert ckpt.list_steps(root) == [1, 2] and (root / ".tmp-step-000003" / "record.json").exists()
    for step in (1, 2):
        assert ckpt.verify_step(ckpt.step_dir(root, step))["config"]["seed"] == 5
    # ... and when every shard is written but not the record
    resumed = dataclasses.replace(new, resume=True)
    errs = _errors(worlds, resumed, {ckpt.FAULT_ENV: "shards:4::raise"})
    assert ckpt.list_steps(root) == [1, 2, 3]
    got = _ok(worlds, resumed)
    assert got["first_step"] == 4 and got["losses"] == uninterrupted[5]
    assert ckpt.list_steps(root) == [1, 2, 3, 4] and not list(root.glob(".tmp-*"))
    assert {ckpt.verify_step(ckpt.step_dir(root, s))["run_id"] for s in (1, 2, 3, 4)} == {
        ckpt.read_record(ckpt.step_dir(root, 1))["run_id"]}


def test_resume_passes_over_damaged_steps_and_checks_the_configuration(worlds, uninterrupted, tmp_path):
    root = tmp_path / "ck"
    _ok(worlds, _cfg(checkpoint=str(root), checkpoint_every=1))
    again = _cfg(checkpoint=str(root), resume=True, schedule="ring")  # another schedule: accepted
    record = ckpt.step_dir(root, 4) / "record.json"
    record.write_text(record.read_text()[:100])  # truncated
    got = _ok(worlds, again)
    assert got["first_step"] == 4 and got["losses"] == uninterrupted[3]
    assert "step-000004/record.json: not valid JSON" in got["checkpoint_notes"][0]  # named and passed over
    assert "resume changes schedule: 'zigzag_ring' -> 'ring'" in got["checkpoint_notes"]
    shard = sorted(ckpt.step_dir(root, 4).glob("*.distcp"))[-1]  # 4 KB overwritten inside a shard
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(bytes(4096))
    with pytest.raises(ckpt.CheckpointError, match="SHA-256 differs"):
        ckpt.verify_step(shard.parent)
    got = _ok(worlds, again)
    assert got["first_step"] == 4 and got["losses"] == uninterrupted[3]
    assert f"{shard}: SHA-256 differs" in got["checkpoint_notes"][0]
    ckpt.verify_step(shard.parent)  # published again, intact
    for field, value in (("seed", 4), ("seq", 128), ("batch", 8), ("task", "documents"), ("lr", 1e-3)):
        bad = dataclasses.replace(again, steps=6, **{field: value})
        with pytest.raises(ckpt.CheckpointError, match=rf"{field} "):
            train.preflight(bad)
        assert f"{field} " in _errors(worlds, bad)[0].message
    assert "leaves nothing to train" in _errors(worlds, dataclasses.replace(again, steps=3))[0].message
    for step in ckpt.list_steps(root):
        (ckpt.step_dir(root, step) / "record.json").unlink()
    assert "no intact step" in _errors(worlds, dataclasses.replace(again, steps=6))[0].message


def test_a_non_finite_loss_stops_the_run_and_nothing_non_finite_is_saved(worlds, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root = tmp_path / "ck"
    errs = _errors(worlds, _cfg(lr=1e20, checkpoint=str(root), checkpoint_every=1))
    assert errs[0].type == "TrainingStopped" and "step 2: the loss is nan" in errs[0].message
    assert ckpt.list_steps(root) == [1]
    dcp_to_torch_save(ckpt.step_dir(root, 1), tmp_path / "one.pt")
    state = torch.load(tmp_path / "one.pt", weights_only=True)
    tensors = [t for t in state["model"].values()]
    assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors)


@pytest.mark.slow  # a world lost and restarted
def test_a_worker_lost_inside_a_save_ends_in_one_line_and_resume_completes(worlds, uninterrupted, tmp_path,
                                                                            capsys, monkeypatch):
    root = tmp_path / "ck"
    monkeypatch.setenv(ckpt.FAULT_ENV, "shards:2:1")  # rank 1 dies once its shards of step 2 are written
    code, err = _cli(capsys, "--steps", "4", "--seed", "3", "--checkpoint", str(root), "--checkpoint-every", "1")
    assert code == 1
    line = err.splitlines()[-1]
    assert "worker rank 1 exited with code 9" in line and f"resume from {ckpt.step_dir(root, 1)}" in line, err
    assert ckpt.list_steps(root) == [1]
    got = _ok(worlds, _cfg(checkpoint=str(root), resume=True))
    assert got["first_step"] == 2 and got["losses"] == uninterrupted[3]


# ---------------------------------------------------------------------------------- signals
def _wait_status(base: Path, ranks: int, step: int, proc: subprocess.Popen, timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            status = [json.loads(Path(f"{base}.{r}").read_text()) for r in range(ranks)]
        except (FileNotFoundError, json.JSONDecodeError):
            status = []
        if status and min(s["step"] for s in status) >= step:
            return status
        time.sleep(0.05)
    raise AssertionError(f"the workers did not reach step {step} in {timeout} s")


def _env(status: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", train.STATUS_ENV: str(status),
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


@pytest.mark.slow  # a torchrun world and two training runs; make test keeps the in-world save and resume cases
def test_sigterm_under_torchrun_saves_every_rank_and_resume_continues(worlds, tmp_path):
    root, status = tmp_path / "ck", tmp_path / "status"
    args = ["--model", "llama", "--config", "tiny", "--dp", "1", "--cp", "2", "--schedule", "zigzag_ring", "--seq",
            "64", "--batch", "4", "--lr", "3e-3", "--seed", "3", "--peak-tflops", "1", "--checkpoint", str(root)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "cpattn.train", *args, "--steps", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(status),
                            cwd=tmp_path)
    _wait_status(status, 2, 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    stopped = [line for line in err.splitlines() if "stopped by SIGTERM after step" in line]
    assert len(stopped) == 2, err[-3000:]  # each rank's last line: it saved, and returns (exit 0)
    assert "exitcode" not in err, err[-3000:]  # torchrun reports no worker failure
    step = ckpt.find_latest(root)[0]
    assert all(f"after step {step}; saved {ckpt.step_dir(root, step)}; resume with --resume" in line
               for line in stopped)
    resumed = _ok(worlds, _cfg(steps=step + 2, checkpoint=str(root), resume=True))
    reference = _ok(worlds, _cfg(steps=step + 2))
    assert resumed["first_step"] == step + 1 and resumed["losses"] == reference["losses"]


@pytest.mark.slow  # starts and kills its own launcher
def test_workers_exit_when_their_launcher_is_killed(tmp_path):
    status = tmp_path / "status"
    cmd = [sys.executable, "-m", "cpattn.cli", "train", "--nproc", "2", "--cp", "2", "--seq", "64",
           "--peak-tflops", "1", "--steps", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(status),
                            cwd=tmp_path)
    pids = [s["pid"] for s in _wait_status(status, 2, 1, proc)]
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), "workers outlived their launcher by 10 s"


# ---------------------------------------------------------------------------------- the soak
@pytest.mark.slow
def test_kill_and_resume_soak(tmp_path):
    """30 random SIGKILLs (the whole group, or one worker; during start-up, training or a save) of one
    40-step run saving every step, each followed by ``--resume``: the final losses are bit-identical to
    an uninterrupted run's. Prints how many kills landed inside a save."""
    rng = random.Random(24)
    common = ["train", "--nproc", "2", "--cp", "2", "--seq", "64", "--peak-tflops", "1", "--steps", "40"]
    ref_log = tmp_path / "ref.json"
    done = subprocess.run([sys.executable, "-m", "cpattn.cli", *common, "--json", str(ref_log)], cwd=tmp_path,
                          env=_env(tmp_path / "ref-status"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reference = json.loads(ref_log.read_text())[0]["losses"]
    root, status, log = tmp_path / "ck", tmp_path / "status", tmp_path / "log.json"
    kills, in_save, group, at_start = 0, 0, 0, 0

    def latest() -> int:
        found = train.latest_checkpoint(str(root))
        return found[0] if found else 0

    while kills < 30:
        saved = latest()
        assert saved < 40, f"the run finished after {kills} kills"
        for r in range(2):
            Path(f"{status}.{r}").unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "cpattn.cli", *common, "--checkpoint", str(root), "--checkpoint-every", "1",
               "--resume" if saved else "--overwrite"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env=_env(status), cwd=tmp_path, start_new_session=True)
        states: list[dict] = []
        if saved >= 35 or rng.random() < 0.15:  # during start-up (the world, the resume): before any step
            deadline = time.monotonic() + rng.uniform(0.5, 4.0)
            while time.monotonic() < deadline and not Path(f"{status}.0").exists():
                time.sleep(0.005)
            at_start += 1
        else:
            _wait_status(status, 2, saved + rng.randint(1, 3), proc)  # the kills spread over the run
            if rng.random() < 0.5:  # aim at a save
                deadline = time.monotonic() + 2.0
                while time.monotonic() < deadline and not any(
                        '"save"' in (Path(f"{status}.{r}").read_text() if Path(f"{status}.{r}").exists() else "")
                        for r in range(2)):
                    time.sleep(0.002)
            time.sleep(rng.uniform(0.0, 0.03))
        for r in range(2):
            try:
                states.append(json.loads(Path(f"{status}.{r}").read_text()))
            except (FileNotFoundError, json.JSONDecodeError):
                pass
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if len(states) < 2 or rng.random() < 0.5:
            os.killpg(proc.pid, signal.SIGKILL)
            group += 1
        else:
            os.kill(rng.choice(states)["pid"], signal.SIGKILL)
        proc.communicate(timeout=60)
        kills += 1
        in_save += any(s["phase"] == "save" for s in states)
    saved = latest()
    cmd = [sys.executable, "-m", "cpattn.cli", *common, "--checkpoint", str(root), "--json", str(log),
           "--resume" if saved else "--overwrite"]
    done = subprocess.run(cmd, cwd=tmp_path, env=_env(status), capture_output=True, text=True, timeout=600)
    print(f"soak: {kills} kills ({group} of the whole group, {kills - group} of one worker, {at_start} during "
          f"start-up), {in_save} inside a save; resumed at last from step {saved}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(log.read_text())[0]["losses"] == reference
