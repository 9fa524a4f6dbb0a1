"""Runs end cleanly: a process group ends when it is destroyed (by cpattn's exit hook or by the script),
even while a script keeps its ``ContextParallel``, outputs and autograd graph in globals, so no gloo
thread is left to abort the interpreter's teardown. ``make test`` checks the group's end directly on
two processes (the condition every abort needed, and true of every run, whatever the timing); the slow
suite runs the quick start, the Hugging Face example and a raising script 20 times each under torchrun
and requires each run's own exit status every time."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cpattn.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
RUNS = 20
ABORTED = ("terminate called", "Aborted", "Fatal Python error", "SIGABRT", "exitcode  : -6")


def _two_ranks(script: Path, *args: str, cwd: Path) -> list[tuple[int, str]]:
    """``script`` on two processes with the torchrun environment (gloo): ``(status, stderr)`` per rank."""
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "CPATTN_PG_TIMEOUT_S": "60", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(script), *args], cwd=cwd,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, err) for p, (_, err) in zip(procs, outs)]


def test_the_exit_hook_ends_the_group_while_the_script_holds_its_results(tmp_path):
    """The group's gloo threads are gone by the time the script's last exit hook runs, though the script
    still holds the ContextParallel, its output and the backward's graph (they held the group before:
    through the communicator, and through torch.distributed.nn.functional's default arguments, which
    torch imports lazily on the first call of a custom op and which then bound the live default group)."""
    for rank, (status, err) in enumerate(_two_ranks(ROOT / "tests" / "exit_hold_script.py", cwd=tmp_path)):
        assert status == 0, err[-3000:]
        assert re.search(rf"rank {rank}: attention done, gloo threads running: [1-9]", err), err[-3000:]
        assert f"rank {rank}: gloo threads after the exit hook: 0" in err, err[-3000:]
        assert not any(word in err for word in ABORTED), err[-3000:]


def test_a_failing_script_exits_with_its_own_error_and_status(tmp_path):
    """tests/exit_script.py: rank 0 raises, rank 1 calls sys.exit(3), neither destroys the group. Each exits
    with its own status and error, the group is gone by the time the script's last exit hook runs, and
    nothing aborts."""
    (status0, err0), (status1, err1) = _two_ranks(ROOT / "tests" / "exit_script.py", cwd=tmp_path)
    assert status0 == 1, err0
    assert status1 == 3, err1
    assert "RuntimeError: the user's own error on rank 0" in err0
    for rank, err in enumerate((err0, err1)):
        assert f"rank {rank}: attention done" in err
        assert f"rank {rank}: group alive at exit: False" in err, err
        assert not any(word in err for word in ABORTED), err


def _torchrun(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _hf_example(tmp_path: Path) -> Path:
    """The code block of docs/huggingface.md's "Example" section, as a script file."""
    text = (ROOT / "docs" / "huggingface.md").read_text()
    section = text[text.index("## Example"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    path = tmp_path / "example.py"
    path.write_text(code)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("which", ["quickstart", "hf_example"])
def test_every_run_exits_cleanly(which, tmp_path):
    """The README's quick start and docs/huggingface.md's example under torchrun, 20 times each: status 0
    and no abort in every run."""
    if which == "quickstart":
        script, args, done = ROOT / "examples" / "quickstart.py", ("--seq", "256"), "relative error vs one process"
    else:
        pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]')")
        script, args, done = _hf_example(tmp_path), (), "loss "
    failed = []
    for run in range(RUNS):
        proc = _torchrun(script, *args, cwd=tmp_path)
        output = proc.stdout + proc.stderr
        if proc.returncode != 0 or done not in proc.stdout or any(word in output for word in ABORTED):
            failed.append(f"run {run}: status {proc.returncode}\n{output[-2000:]}")
    assert not failed, f"{len(failed)} of {RUNS} runs failed:\n" + "\n".join(failed)


@pytest.mark.slow
def test_a_raising_script_exits_with_its_own_status_every_time(tmp_path):
    """tests/exit_script.py (rank 0 raises, rank 1 calls sys.exit(3), neither destroys the group), 20
    times: statuses 1 and 3 and the script's own error every time, never an abort."""
    failed = []
    for run in range(RUNS):
        (s0, err0), (s1, err1) = _two_ranks(ROOT / "tests" / "exit_script.py", cwd=tmp_path)
        ok = (s0, s1) == (1, 3) and "RuntimeError: the user's own error on rank 0" in err0 \
            and not any(word in err0 + err1 for word in ABORTED)
        if not ok:
            failed.append(f"run {run}: statuses {s0}, {s1}\n{err0[-1500:]}\n{err1[-1500:]}")
    assert not failed, f"{len(failed)} of {RUNS} runs failed:\n" + "\n".join(failed)
