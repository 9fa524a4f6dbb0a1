"""``examples/quickstart.py`` runs as the README shows it: under torchrun on 2 processes (gloo), it checks
itself against one-process float64 attention and prints the errors; the run ends with status 0 and no
abort. (At 256 tokens, so it stays a few seconds; the script's default is 2048.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from cpattn.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "quickstart.py"
LAUNCH = "torchrun --nproc-per-node 2 examples/quickstart.py"


def test_the_readme_shows_the_quickstart_with_its_launch_line():
    readme = (ROOT / "README.md").read_text()
    use = readme[readme.index("## Use"):]
    assert LAUNCH in use and "examples/quickstart.py" in use
    assert LAUNCH in SCRIPT.read_text()


def test_quickstart_under_torchrun_matches_one_process(tmp_path):
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), str(SCRIPT), "--seq", "256"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "terminate called" not in output and "Aborted" not in output, output[-3000:]
    line = re.search(r"relative error vs one process \(float64\): (.*)", proc.stdout)
    assert line, proc.stdout
    errors = dict(item.split() for item in line.group(1).split(", "))
    assert set(errors) == {"out", "lse", "dq", "dk", "dv"}
    assert all(float(e) < 1e-5 for e in errors.values()), errors
    assert "zigzag_ring on 2 ranks (cpu)" in proc.stdout
