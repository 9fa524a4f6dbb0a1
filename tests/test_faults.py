"""Faults: corrupt or foreign files on disk, a rank that dies in the middle of a call (under the local
launcher and under torchrun), and non-finite inputs and empty mask rows."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import fault_workers
import pytest
import torch

from cpattn import distributed
from cpattn.core.topology import Link, RatePoint, Topology
from cpattn.cost import presets, profile
from cpattn.cost.presets import this_machine as _local_topology
from cpattn.launcher import LocalWorld, RankError, WorldError, free_port
from cpattn.planner import PlanOptions, PlanVersionError, get_plan, load_plan, request, save_plan
from cpattn.planner.model import SCHEMA_VERSION

FAST = PlanOptions(time_budget=1.0, partition_time_limit=0.5, schedule_time_limit=0.5)
#: what a corrupt file may hold: cut short, empty, not text, JSON of the wrong shape, a broken field
CORRUPT = {"truncated": None, "empty": "", "binary": b"\x80\xff\x00garbage", "list": "[1, 2]",
           "broken_field": "field"}


def _write(path: Path, content, valid_text: str, broken_field) -> None:
    if content is None:
        path.write_text(valid_text[: len(valid_text) // 2])
    elif content == "field":
        path.write_text(json.dumps(broken_field(json.loads(valid_text))))
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)


# ------------------------------------------------------------------------------------ plan cache
def _req():
    return request("causal", 64, Topology(1, 2), 1, 4, 4, 8, "float32", FAST)


def _break_plan(data: dict) -> dict:
    data["owner"] = "nobody"
    return data


@pytest.mark.parametrize("kind", sorted(CORRUPT))
def test_a_corrupt_cached_plan_is_rebuilt_with_a_warning(tmp_path, caplog, kind):
    req = _req()
    good = get_plan(req, directory=tmp_path)
    path = tmp_path / f"{req.digest()}.json"
    _write(path, CORRUPT[kind], good.to_json(), _break_plan)
    with caplog.at_level(logging.WARNING, logger="cpattn.planner.cache"):
        rebuilt = get_plan(req, directory=tmp_path)
    assert "rebuilding the cached plan" in caplog.text and str(path) in caplog.text
    assert rebuilt.key == good.key and load_plan(path) == rebuilt  # the file was written again
    with pytest.raises(ValueError, match=re.escape(str(path))):  # named by load_plan, never a crash
        _write(path, CORRUPT[kind], good.to_json(), _break_plan)
        load_plan(path)


def test_a_cached_plan_of_another_version_is_rebuilt_naming_the_versions(tmp_path, caplog):
    req = _req()
    good = get_plan(req, directory=tmp_path)
    path = tmp_path / f"{req.digest()}.json"
    path.write_text(good.to_json().replace(f'"version":{SCHEMA_VERSION}', '"version":2', 1))
    with caplog.at_level(logging.WARNING, logger="cpattn.planner.cache"):
        rebuilt = get_plan(req, directory=tmp_path)
    assert f"format version 2, this cpattn reads version {SCHEMA_VERSION}" in caplog.text
    assert rebuilt.key == good.key and load_plan(path) == rebuilt


@pytest.mark.parametrize("found", [2, SCHEMA_VERSION + 1])
def test_load_plan_refuses_another_version_and_says_what_to_do(tmp_path, found):
    path = tmp_path / "mine.json"
    save_plan(get_plan(_req(), cache=False), path)
    path.write_text(path.read_text().replace(f'"version":{SCHEMA_VERSION}', f'"version":{found}', 1))
    with pytest.raises(PlanVersionError) as info:
        load_plan(path)
    message = str(info.value)
    assert str(path) in message and f"format version {found}" in message
    assert f"reads version {SCHEMA_VERSION}" in message and "delete the file" in message
    assert (info.value.found, info.value.expected) == (found, SCHEMA_VERSION)


# ----------------------------------------------------------------------------- calibration profile
def _profile() -> profile.Profile:
    pts = tuple(RatePoint(ph, kind, 256, 256, 1e10) for ph in ("forward", "backward") for kind in ("full", "causal"))
    return profile.Profile(pts, {"sendrecv": Link(5e-5, 2e9)}, 8e9, 0.4, 2, 2, 1, 16 * 2**30, {"torch": "x"})


def _break_profile(data: dict) -> dict:
    data["links"]["sendrecv"]["bandwidth"] = -1.0
    return data


@pytest.fixture
def default_profile(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "profile.json"
    monkeypatch.setenv(profile.PROFILE_ENV, str(path))
    return path


@pytest.mark.parametrize("kind", sorted(CORRUPT))
def test_a_corrupt_default_profile_is_ignored_with_a_warning(default_profile, caplog, kind):
    _write(default_profile, CORRUPT[kind], json.dumps(_profile().to_json()), _break_profile)
    with caplog.at_level(logging.WARNING, logger="cpattn.cost.profile"):
        assert profile.load_default() is None
        topo = presets.preset("local", 2)
    assert "ignoring the calibration profile" in caplog.text and "corrupt" in caplog.text
    assert str(default_profile) in caplog.text and "cpattn calibrate" in caplog.text
    assert topo == presets.local(2)  # the conservative defaults
    with pytest.raises(profile.ProfileError, match=re.escape(str(default_profile))):
        profile.load(default_profile)  # a file named explicitly is refused, not ignored


def _other_version(path: Path, found) -> None:
    data = _profile().to_json()
    data["version"] = found
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("found", [0, profile.VERSION + 1])
def test_a_profile_of_another_version_is_refused_and_says_what_to_do(default_profile, tmp_path, found):
    """Explicitly (load), at the default location (load_default) and through the local preset."""
    explicit = tmp_path / "explicit.json"
    for path in (explicit, default_profile):
        _other_version(path, found)
    for path, load in ((explicit, lambda: profile.load(explicit)), (default_profile, profile.load_default),
                       (default_profile, lambda: presets.preset("local", 2))):
        with pytest.raises(profile.ProfileVersionError) as info:
            load()
        message = str(info.value)
        assert str(path) in message, message
        assert f"format version {found}" in message and f"reads version {profile.VERSION}" in message
        assert "delete it or run `cpattn calibrate`" in message
        assert (info.value.found, info.value.expected) == (found, profile.VERSION)


def test_context_parallel_falls_back_from_a_stale_profile_with_a_warning(default_profile, caplog):
    """What ContextParallel plans with (cpattn.api): a stale default profile does not stop a run."""
    _other_version(default_profile, profile.VERSION + 1)
    with caplog.at_level(logging.WARNING, logger="cpattn.api"):
        topo = _local_topology(2, "ContextParallel")
    assert topo == presets.local(2) and "format version" in caplog.text and "cpattn calibrate" in caplog.text


# ------------------------------------------------------------------------ a rank dies: LocalWorld
def test_a_rank_that_dies_mid_call_ends_the_world_naming_it():
    """Rank 1 exits after issuing the forward; rank 0 is in the backward's ring exchange with it. The
    parent ends rank 0 and raises WorldError naming rank 1 well inside the 30 s bound."""
    world = LocalWorld(2, threads=1)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorldError, match="rank 1 exited with code 3") as info:
            world.run(fault_workers.exit_mid_call, timeout=60, name="dies mid-call", rank=1)
        elapsed = time.monotonic() - t0
        print(f"local launcher: WorldError {elapsed:.2f} s after the call began: {info.value}")
        assert "dies mid-call" in str(info.value) and "rank 0 exited" not in str(info.value)
        assert elapsed < 10.0
        assert not world.alive and not any(p.is_alive() for p in world._procs)
    finally:
        world.close()


@pytest.mark.slow  # waits out a timeout on its own world
def test_the_process_group_timeout_bounds_a_blocked_collective():
    """With pg_timeout=2 a rank whose peer never joins an all-reduce fails in about 2 s (gloo's own
    default would wait 30 minutes); a dead rank then ends the world within stop_grace."""
    world = LocalWorld(2, threads=1, pg_timeout=2.0, stop_grace=0.5)
    try:
        results = world.run(fault_workers.stall_collective, timeout=60, rank=1, seconds=3.0)
        assert not isinstance(results[0], RankError), results
        print(f"pg_timeout=2: rank 0's all_reduce failed after {results[0]['elapsed']:.2f} s: {results[0]['error']}")
        assert results[0]["error"] and 1.5 < results[0]["elapsed"] < 2.9
        t0 = time.monotonic()
        with pytest.raises(WorldError, match="rank 1 exited with code 3"):
            world.run(fault_workers.exit_while_others_sleep, timeout=60, rank=1, seconds=60)
        assert time.monotonic() - t0 < 5.0  # rank 0 sleeps outside gloo: killed after stop_grace
    finally:
        world.close()


def test_local_world_rejects_bad_timeouts():
    with pytest.raises(ValueError, match="pg_timeout"):
        LocalWorld(2, pg_timeout=0)


# --------------------------------------------------------------------------- a rank dies: torchrun
SCRIPT = Path(__file__).with_name("torchrun_fault.py")
EXACT = re.compile(r"rank (\d) exact (\S+) local (\S+) finite (True|False)")


def _torchrun(mode: str, timeout: float = 120.0) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", distributed.TIMEOUT_ENV: "30"}
    if not sys.platform.startswith("linux"):
        env.pop("GLOO_SOCKET_IFNAME")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), "--monitor-interval", "0.1", str(SCRIPT), mode]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    return proc, time.time()


def _check_exact(output: str) -> None:
    found = {int(r): (float(e), float(loc), ok == "True") for r, e, loc, ok in EXACT.findall(output)}
    assert set(found) == {0, 1}, output
    for err, e_local, finite in found.values():
        assert finite and err <= 2 * e_local + 1e-6, output


@pytest.mark.slow  # a torchrun world; make test keeps the local world case
def test_torchrun_a_rank_that_dies_mid_call_ends_the_run_naming_it():
    """Under torchrun (cpattn.distributed.init, gloo): an exact first call, then rank 1 exits in the
    middle of the second; the run ends with a nonzero status within seconds, and torchrun's report
    names global rank 1 / local rank 1 and its exit code as the root cause."""
    proc, end = _torchrun("fault")
    output = proc.stdout + proc.stderr
    if len(set(EXACT.findall(output))) < 2:  # the launch itself failed (e.g. a port taken meanwhile): once more
        print(f"torchrun launch did not reach the first call; retrying once. Its output:\n{output[-3000:]}")
        proc, end = _torchrun("fault")
        output = proc.stdout + proc.stderr
    _check_exact(output)
    died = float(re.search(r"rank 1 exits at (\S+)", output).group(1))
    print(f"torchrun: the run ended {end - died:.2f} s after rank 1 exited (status {proc.returncode})")
    assert proc.returncode != 0
    root = output[output.index("Root Cause"):]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", root) and re.search(r"exitcode\s*: 3", root), output
    assert end - died < 30.0


@pytest.mark.slow
def test_torchrun_happy_path_is_exact():
    proc, _ = _torchrun("exact")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_exact(proc.stdout)


def test_distributed_init_outside_torchrun_says_how_to_launch(monkeypatch):
    for name in distributed.TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE.*torchrun.*cpattn.launcher.LocalWorld"):
        distributed.init()


def test_distributed_timeout_default_and_override(monkeypatch):
    monkeypatch.delenv(distributed.TIMEOUT_ENV, raising=False)
    assert distributed.timeout_seconds() == distributed.DEFAULT_TIMEOUT_S == 120.0
    assert distributed.timeout_seconds(5) == 5.0
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "45")
    assert distributed.timeout_seconds() == 45.0 and distributed.timeout_seconds(7) == 7.0
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="CPATTN_PG_TIMEOUT_S must be a number"):
        distributed.timeout_seconds()
    with pytest.raises(ValueError, match="timeout_s must be a finite number"):
        distributed.timeout_seconds(0)


# ------------------------------------------------------------------- non-finite inputs, empty rows
def _allowed(mask: str) -> torch.Tensor:
    """The mask as a dense [q, k] bool, built here (not by cpattn.masks)."""
    s = fault_workers.SEQ
    qi, ki = torch.arange(s)[:, None], torch.arange(s)[None, :]
    if mask == "full":
        return torch.ones(s, s, dtype=torch.bool)
    if mask == "causal":
        return ki <= qi
    assert mask == "empty_rows"
    return (ki <= qi) & (qi >= 3) & (qi % 5 != 2)


def reference(q, k, v, dout, allowed) -> dict:
    """float64 attention with autograd in which a masked (query, key) pair takes no part at all,
    forward or backward (each product of a pair is selected by the mask before it is formed, so a NaN
    in a masked key never reaches the row). A row with no key gets out 0 and lse -inf."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    zero = torch.zeros((), dtype=torch.float64)
    pair = allowed[None, None, :, :, None]  # [1, 1, q, k, 1]
    qe = q.transpose(1, 2)[:, :, :, None]  # [b, h, q, 1, d]
    ke, ve = (t.repeat_interleave(g, 2).transpose(1, 2)[:, :, None] for t in (k, v))  # [b, h, 1, k, d]
    s = (torch.where(pair, qe, zero) * torch.where(pair, ke, zero)).sum(-1) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(-1)[:, None]
    lse = torch.logsumexp(s, -1)
    p = torch.where(allowed, torch.softmax(s.masked_fill(empty, 0.0), -1), zero)
    out = (torch.where(pair, p[..., None], zero) * torch.where(pair, ve, zero)).sum(3).transpose(1, 2)
    out.backward(dout.double())
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _close(got: torch.Tensor, ref: torch.Tensor, where: str) -> None:
    assert got.isfinite().all() and ref.isfinite().all(), where
    err = float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))
    assert err < 2e-5, f"{where}: relative error {err:.2e}"


def _run(worlds, schedule: str, mask: str, seed: int, poison: dict | None = None) -> tuple[dict, dict]:
    results = worlds.get(2).run(fault_workers.attention_case, timeout=60, schedule=schedule, mask=mask, seed=seed,
                                poison=poison)
    assert not any(isinstance(r, RankError) for r in results), results
    got = results[0]
    return got, reference(got["q"], got["k"], got["v"], got["dout"], _allowed(mask))


NAN, INF = float("nan"), float("inf")
#: one element of one query row (row 37, head 1: kv head 0) or one key row (row 40, kv head 0)
POISONS = {"q_nan": ("q", [0, 37, 1, 3], NAN), "k_nan": ("k", [0, 40, 0, 3], NAN),
           "q_inf": ("q", [0, 37, 1, 3], INF), "k_inf": ("k", [0, 40, 0, 3], INF)}
NONFINITE_SCHEDULES = {"ring": "causal", "allgather": "causal", "ringx4o": "causal", "ulysses": "causal",
                       "ringx1o": "full"}


def _nonfinite_cases():
    for i, (schedule, mask) in enumerate(NONFINITE_SCHEDULES.items()):
        for j, name in enumerate(POISONS):
            yield pytest.param(schedule, mask, name, 100 + 10 * i + j, id=f"{schedule}-{name}")


@pytest.mark.parametrize("schedule,mask,poison,seed", list(_nonfinite_cases()))
def test_nonfinite_inputs_propagate_as_on_one_device(worlds, schedule, mask, poison, seed):
    """One NaN or +Inf element in a query row or a key row: out and lse are non-finite exactly where the
    float64 reference is (NaN where NaN, Inf where Inf) and close to it elsewhere. The gradients of the
    key/value head group the poison does not touch are finite and close; in the poisoned group a NaN
    input leaves a gradient NaN at least wherever the reference's is (never silently finite). Inside
    one kernel call a masked pair may still multiply a NaN by 0, as a single-device flash kernel does,
    so a gradient may hold more NaN than the reference, never fewer. The gradient of softmax at an
    infinite logit has no defined value, so for +Inf inputs only the untouched group is compared."""
    tensor, index, value = POISONS[poison]
    got, ref = _run(worlds, schedule, mask, seed, {"tensor": tensor, "index": index, "value": value})
    case = f"{schedule} {mask} {poison} seed={seed}"
    assert ref["out"].isnan().any(), f"{case}: the poison must reach the output"
    for name in ("out", "lse"):
        a, b = got[name], ref[name]
        assert torch.equal(a.isnan(), b.isnan()), f"{case}: NaN positions of {name} differ from the reference"
        assert torch.equal(a.isinf(), b.isinf()), f"{case}: Inf positions of {name} differ from the reference"
        assert torch.equal(a[a.isinf()].double(), b[b.isinf()]), f"{case}: signs of Inf in {name} differ"
        fin = b.isfinite()
        _close(a[fin], b[fin], f"{case}: finite part of {name}")
    group = index[2] if tensor != "q" else index[2] // (fault_workers.HEADS // fault_workers.KV_HEADS)
    heads_per_group = fault_workers.HEADS // fault_workers.KV_HEADS
    other_q = [h for h in range(fault_workers.HEADS) if h // heads_per_group != group]
    other_kv = [n for n in range(fault_workers.KV_HEADS) if n != group]
    for name in ("dq", "dk", "dv"):
        a, b = got[name], ref[name]
        lost = a.isfinite() & b.isnan() & math.isnan(value)
        assert not lost.any(), f"{case}: {name} is finite at {lost.nonzero().tolist()[:4]} where the reference is NaN"
        heads = other_q if name == "dq" else other_kv
        _close(a[:, :, heads], b[:, :, heads], f"{case}: {name} of the untouched head group")


@pytest.mark.parametrize("schedule", ["ring", "allgather", "ringx1o", "ulysses"])
def test_fully_masked_rows_give_out_zero_lse_minus_inf_and_zero_grads(worlds, schedule):
    """Rows 0-2 (rank 0's first rows) and every row = 2 (mod 5) attend nothing: their out is 0, lse
    -inf, dq 0, everything finite and the rest as the reference."""
    got, ref = _run(worlds, schedule, "empty_rows", seed=7)
    empty = ~_allowed("empty_rows").any(-1)
    assert empty.sum() >= 10
    case = f"{schedule} empty_rows seed=7"
    assert torch.equal(got["out"][:, empty], torch.zeros_like(got["out"][:, empty])), case
    assert bool((got["lse"][..., empty] == -INF).all()), case
    assert torch.equal(got["dq"][:, empty], torch.zeros_like(got["dq"][:, empty])), case
    assert bool(got["lse"][..., ~empty].isfinite().all()), case
    for name in ("out", "dq", "dk", "dv"):
        _close(got[name], ref[name], f"{case}: {name}")
