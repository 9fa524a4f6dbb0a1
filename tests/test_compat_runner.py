"""``python -m cpattn.compat --as NAMES (-m MODULE | SCRIPT) ARGS``: the stand-ins installed, the target run as
``__main__`` with its own arguments, its exit status passed through (in this process, and under torchrun with an
unmodified script that imports ring_flash_attn and yunchang itself)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpattn.compat.__main__ import main, split

HERE = Path(__file__).resolve().parent
TARGET = '''
import sys
import ring_flash_attn, yunchang
RESULT = (__name__, list(sys.argv), ring_flash_attn.__name__, yunchang.__name__)
sys.modules["runner_result"] = type(sys)("runner_result")
sys.modules["runner_result"].value = RESULT
if "--exit" in sys.argv:
    sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
if "--raise" in sys.argv:
    raise KeyError("from the target")
'''


def test_split_reads_only_the_runners_own_options():
    assert split(["--as", "ring_flash_attn,yunchang", "-m", "pkg.train", "--as", "x", "-m"]) == \
        (["ring_flash_attn", "yunchang"], "pkg.train", None, ["--as", "x", "-m"])
    assert split(["--as=yunchang", "train.py", "-v"]) == (["yunchang"], None, "train.py", ["-v"])
    for bad in (["--as", "yunchang"], ["--as", "yunchang", "--bogus", "x.py"], ["-m"], []):
        with pytest.raises(SystemExit) as exc:
            main(bad)
        assert exc.value.code == 2, bad
    with pytest.raises(SystemExit) as exc:
        main(["--as", "nothing", "x.py"])
    assert exc.value.code == 2


@pytest.mark.parametrize("form", ["module", "script"])
def test_the_target_runs_as_main_with_its_arguments_and_exit_status(tmp_path, monkeypatch, form):
    (tmp_path / "runner_target.py").write_text(TARGET)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    target = ["-m", "runner_target"] if form == "module" else [str(tmp_path / "runner_target.py")]
    main(["--as", "ring_flash_attn,yunchang", *target, "--flag", "1"])
    name, argv, rfa, yc = sys.modules.pop("runner_result").value
    assert name == "__main__" and argv[1:] == ["--flag", "1"] and argv[0].endswith("runner_target.py")
    assert (rfa, yc) == ("cpattn.compat.ring_flash_attn", "cpattn.compat.yunchang")
    for code in (0, 3):
        with pytest.raises(SystemExit) as exc:
            main(["--as", "yunchang", *target, "--exit", str(code)])
        assert exc.value.code == code
    with pytest.raises(KeyError, match="from the target"):  # uncaught: the interpreter prints it and exits 1
        main(["--as", "yunchang", *target, "--raise"])


def _torchrun(nproc: int, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "cpattn.compat", "--as", "ring_flash_attn,yunchang", *args]
    return subprocess.Popen(command, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_an_unmodified_script_runs_under_torchrun_with_its_exit_status_passed_through():
    runs = {"ok": _torchrun(2, "compat_runner_script.py", "--tag", "t1"),
            "exit": _torchrun(1, "compat_runner_script.py", "--exit", "3")}  # one rank: the status is all it shows
    outputs = {}
    for name, run in runs.items():
        try:
            outputs[name] = (run.communicate(timeout=180)[0], run.returncode)
        except subprocess.TimeoutExpired:
            run.kill()
            pytest.fail(f"the {name} run timed out: {run.communicate()[0][-3000:]}")
    text, rc = outputs["ok"]
    assert rc == 0, text[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: ok cpattn.compat.ring_flash_attn cpattn.compat.yunchang ['--tag', 't1']" in text, text
    text, rc = outputs["exit"]
    assert rc != 0 and "exitcode  : 3" in text, (rc, text[-3000:])


@pytest.mark.slow
def test_an_uncaught_exception_exits_with_1_and_its_traceback(tmp_path):
    raising = tmp_path / "raising.py"
    raising.write_text("import yunchang\nraise RuntimeError('target failed')\n")
    run = subprocess.run([sys.executable, "-m", "cpattn.compat", "--as", "yunchang", str(raising)], capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 1 and "Traceback" in run.stderr and "RuntimeError: target failed" in run.stderr, run
