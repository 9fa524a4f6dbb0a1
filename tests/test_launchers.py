"""The launcher parser (``cpattn.distributed.launch_env``) on environments given as dicts: torchrun, SLURM's
``srun``, Open MPI's and MPICH's ``mpirun``, partial and contradictory sets, an ``sbatch`` script's own
shell; the missing-process-group error it serves; and ``init()`` joining a world from ``srun``'s variables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cpattn
from cpattn import distributed
from cpattn.core.launch import MPIRUN_PORT, SLURM_PORT_BASE, SLURM_PORT_SPAN, first_host, no_group_error
from cpattn.distributed import Launch, launch_env
from cpattn.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29511", "TORCHELASTIC_RUN_ID": "none"}
#: what ``srun --ntasks 2`` on one host sets for its second task (a selection), inside an ``sbatch`` job of 8
SRUN = {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "gpu07",
        "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "2"}
#: an ``sbatch`` script's own shell: the job, but no step
SBATCH = {"SLURM_JOB_ID": "123456", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_PROCID": "0",
          "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "4(x2)"}
OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"}
SLURM_PORT = SLURM_PORT_BASE + 123456 % SLURM_PORT_SPAN


# ------------------------------------------------------------------ torchrun
def test_torchrun_one_node_and_many():
    assert launch_env(TORCHRUN) == Launch("torchrun", 1, 2, 1, 2, "127.0.0.1", 29511)
    multi = {"RANK": "13", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8",
             "MASTER_ADDR": "node-a.cluster", "MASTER_PORT": "29400"}
    assert launch_env(multi) == Launch("torchrun", 13, 16, 5, 8, "node-a.cluster", 29400)
    assert launch_env({k: v for k, v in multi.items() if k != "LOCAL_WORLD_SIZE"}).local_world_size is None


@pytest.mark.parametrize("env,message", [
    ({"WORLD_SIZE": "2"}, r"a partial torchrun environment: RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not set "
                          r"\(set: WORLD_SIZE=2\)"),
    ({**TORCHRUN, "MASTER_PORT": ""}, r"partial torchrun environment: MASTER_PORT is not set"),
    ({**TORCHRUN, "RANK": "2"}, r"contradictory torchrun variables: RANK=2 is not a rank below WORLD_SIZE=2"),
    ({**TORCHRUN, "LOCAL_RANK": "2"}, r"torchrun variables: LOCAL_RANK=2 is not a local rank below LOCAL_WORLD_SIZE=2"),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "4"}, r"LOCAL_WORLD_SIZE=4 processes on one host, more than WORLD_SIZE=2"),
    ({**TORCHRUN, "WORLD_SIZE": "two"}, r"\$WORLD_SIZE='two' \(torchrun\) must be an integer"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, r"\$MASTER_PORT=70000 is not a TCP port"),
])
def test_a_partial_or_contradictory_torchrun_set_is_one_message(env, message):
    with pytest.raises(ValueError, match=message):
        launch_env(env)


# ------------------------------------------------------------------ SLURM
def test_srun_on_one_host_takes_the_step_and_derives_the_port():
    assert launch_env(SRUN) == Launch("srun", 1, 2, 1, None, "gpu07", SLURM_PORT)
    assert 1024 < SLURM_PORT < 32768  # below Linux's ephemeral ports


def test_srun_counts_the_step_not_the_allocation():
    assert launch_env(SRUN).world_size == 2  # SLURM_STEP_NUM_TASKS=2 over the allocation's SLURM_NTASKS=8
    no_step_count = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_NUM_TASKS"}
    assert launch_env({**no_step_count, "SLURM_NTASKS": "2"}).world_size == 2  # older SLURM: the step's NTASKS


@pytest.mark.parametrize("nodelist,host", [
    ("gpu07", "gpu07"), ("node[01-04,07]", "node01"), ("a,b", "a"), ("gpu-[3,5-6]", "gpu-3"),
    ("node[007-010]", "node007"), ("n[0009]", "n0009"), ("rack[2-3]-n[08-09],login1", "rack2-n08"),
    ("nid[001234-001240]", "nid001234"), (" x1000c0s0b0n[0-1] ", "x1000c0s0b0n0"), ("10.0.0.5", "10.0.0.5"),
])
def test_the_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host
    assert launch_env({**SRUN, "SLURM_STEP_NODELIST": nodelist}).master_addr == host


def test_srun_takes_the_job_node_list_when_the_step_has_none():
    env = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_NODELIST"}
    assert launch_env(env).master_addr == "gpu07"  # gpu[07-08]


@pytest.mark.parametrize("nodelist,message", [("node[01-04", r"'\[' without '\]'"), ("node01]", r"'\]' without"),
                                              ("gpu[a-b]", "not a list of numbers"), (",x", "names no host")])
def test_a_malformed_node_list_names_its_variable(nodelist, message):
    with pytest.raises(ValueError, match=r"\$SLURM_STEP_NODELIST \(srun\): node list .*" + message):
        launch_env({**SRUN, "SLURM_STEP_NODELIST": nodelist})


@pytest.mark.parametrize("env,message", [
    ({"SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_JOB_ID": "7"},
     r"a partial srun environment: SLURM_PROCID, SLURM_LOCALID are not set \(set: SLURM_STEP_NUM_TASKS=4\)"),
    ({**SRUN, "SLURM_PROCID": "2"}, r"contradictory srun variables: SLURM_PROCID=2 is not a rank below "
                                    r"SLURM_STEP_NUM_TASKS=2"),
    ({k: v for k, v in SRUN.items() if k not in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")},
     r"partial srun environment: SLURM_STEP_NUM_TASKS is not set"),
    ({k: v for k, v in SRUN.items() if k not in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")},
     r"SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are not set; set MASTER_ADDR"),
    ({k: v for k, v in SRUN.items() if k != "SLURM_JOB_ID"}, r"srun: no rendezvous port: set MASTER_PORT"),
])
def test_a_partial_or_contradictory_srun_set_is_one_message(env, message):
    with pytest.raises(ValueError, match=message):
        launch_env(env)


def test_an_sbatch_script_is_not_a_launch():
    """The batch script's shell (no srun step, or the batch step's own id) starts nothing: no launch, no
    missing-group error, and init() says how to launch."""
    assert launch_env(SBATCH) is None and no_group_error(SBATCH) is None
    assert launch_env({**SBATCH, "SLURM_STEP_ID": "batch"}) is None
    assert launch_env({**SBATCH, "SLURM_STEP_ID": "4294967294"}) is None


# ------------------------------------------------------------------ mpirun
def test_mpirun_on_one_host_listens_on_localhost():
    assert launch_env(OMPI) == Launch("mpirun", 3, 4, 3, 4, "127.0.0.1", MPIRUN_PORT)
    assert launch_env(MPICH) == Launch("mpirun", 2, 4, 2, 4, "127.0.0.1", MPIRUN_PORT)


def test_mpirun_across_hosts_needs_the_users_address():
    across = {**OMPI, "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "7"}
    with pytest.raises(ValueError, match=r"mpirun \(Open MPI\) across hosts \(OMPI_COMM_WORLD_LOCAL_SIZE=4 of "
                                         r"OMPI_COMM_WORLD_SIZE=8\): set MASTER_ADDR .* mpirun -x MASTER_ADDR"):
        launch_env(across)
    assert launch_env({**across, "MASTER_ADDR": "host0"}) == Launch("mpirun", 7, 8, 3, 4, "host0", MPIRUN_PORT)
    no_local_size = {k: v for k, v in MPICH.items() if k != "MPI_LOCALNRANKS"}
    with pytest.raises(ValueError, match=r"mpirun \(MPICH\) across hosts \(PMI_SIZE=4, and the launcher does not "
                                         r"say .*-genv MASTER_ADDR"):
        launch_env(no_local_size)


@pytest.mark.parametrize("env,message", [
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, r"a partial mpirun \(MPICH\) environment: MPI_LOCALRANKID is not set"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"},
     r"partial mpirun \(Open MPI\) environment: OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE are not set"),
    ({**OMPI, **MPICH}, r"contradictory mpirun variables: OMPI_COMM_WORLD_RANK=3 \(mpirun \(Open MPI\)\) but "
                        r"PMI_RANK=2 \(mpirun \(MPICH\)\)"),
    ({**OMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "4"}, r"contradictory mpirun \(Open MPI\) variables: "
                                                  r"OMPI_COMM_WORLD_LOCAL_RANK=4 is not a local rank below"),
])
def test_a_partial_or_contradictory_mpirun_set_is_one_message(env, message):
    with pytest.raises(ValueError, match=message):
        launch_env(env)


# ------------------------------------------------------------------ several launchers, the user's address
def test_the_innermost_launcher_wins():
    """torchrun started by srun (one agent per node), Open MPI's ranks under an srun-started daemon, and
    srun's own PMI-2 variables (PMI_RANK without MPICH's MPI_LOCALRANKID) under srun."""
    assert launch_env({**SRUN, **TORCHRUN}).launcher == "torchrun"
    assert launch_env({**SRUN, **OMPI}).launcher == "mpirun"
    assert launch_env({**SRUN, "PMI_RANK": "1", "PMI_SIZE": "2"}).launcher == "srun"
    assert launch_env({**SRUN, **MPICH}).launcher == "mpirun"  # MPICH's Hydra inside an srun step


@pytest.mark.parametrize("env", [SRUN, OMPI, MPICH], ids=["srun", "openmpi", "mpich"])
def test_the_users_master_address_and_port_win(env):
    launch = launch_env({**env, "MASTER_ADDR": "login1", "MASTER_PORT": "12345"})
    assert (launch.master_addr, launch.master_port) == ("login1", 12345)


# ------------------------------------------------------------------ no process group
@pytest.mark.parametrize("env,silent", [({}, True), ({"WORLD_SIZE": "1", "RANK": "0"}, True), (SBATCH, True),
                                        ({**SRUN, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}, True),
                                        (TORCHRUN, False), ({"WORLD_SIZE": "2"}, False), (SRUN, False),
                                        (OMPI, False), ({"RANK": "1"}, False)])
def test_the_missing_group_error_is_for_launched_worlds_only(env, silent):
    error = no_group_error(env)
    assert (error is None) == silent, error
    if not silent:
        assert "no process group" in str(error) and "cpattn.distributed.init()" in str(error)


def _launched(monkeypatch, env: dict) -> None:
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_LOCAL")) or name in distributed.TORCHRUN_ENV:
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_contextparallel_and_the_functions_refuse_a_launched_world_without_a_group(monkeypatch):
    """Under torchrun's variables with no process group, ContextParallel and ring_attn_func raise (the same
    message, naming init()); a one-process run (WORLD_SIZE=1) runs."""
    q = torch.randn(1, 8, 2, 8)
    _launched(monkeypatch, TORCHRUN)
    message = r"no process group, but torchrun started this process as one of a world \(WORLD_SIZE=2\): call " \
              r"cpattn.distributed.init\(\)"
    with pytest.raises(RuntimeError, match=message):
        cpattn.ContextParallel(16, "causal", "ring")
    with pytest.raises(RuntimeError, match=message):
        cpattn.ring_attn_func(q, q, q, causal=True)
    _launched(monkeypatch, {**TORCHRUN, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    assert cpattn.ContextParallel(16, "causal", "ring").world_size == 1
    assert cpattn.ring_attn_func(q, q, q, causal=True).shape == q.shape


# ------------------------------------------------------------------ init() from the launchers' variables
@pytest.mark.parametrize("env,method", [(TORCHRUN, "env://"), (SRUN, f"tcp://gpu07:{SLURM_PORT}"),
                                        (OMPI, f"tcp://127.0.0.1:{MPIRUN_PORT}"),
                                        ({**OMPI, "MASTER_ADDR": "fe80::1"}, f"tcp://[fe80::1]:{MPIRUN_PORT}")])
def test_init_builds_the_group_from_the_parsed_launch(monkeypatch, env, method):
    """init() returns the launch's rank, world size and local rank and rendezvous where the launch says:
    torchrun's workers through its agent's store (env://), the others at the derived address."""
    calls = []
    _launched(monkeypatch, env)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(distributed, "_created", True)  # no exit hook for a group that does not exist
    launch = launch_env(env)
    got = distributed.init(backend="gloo", timeout_s=5)
    assert got == (launch.rank, launch.world_size, launch.local_rank, torch.device("cpu"))
    (args, kwargs), = calls
    assert args == ("gloo",) and kwargs["init_method"] == method
    assert (kwargs["rank"], kwargs["world_size"]) == (launch.rank, launch.world_size)


@pytest.mark.slow
def test_init_joins_a_world_from_srun_variables(tmp_path):
    """Two processes with only srun's variables (the address from the node list, the port from the job id:
    here the user's MASTER_PORT) join one gloo world through init() and sum their ranks."""
    code = ("import torch, torch.distributed as dist, cpattn.distributed as d\n"
            "rank, world, local, device = d.init(backend='gloo')\n"
            "t = torch.tensor([rank + 1.0]); dist.all_reduce(t)\n"
            "print(rank, world, local, device, int(t.item()), flush=True)\n")
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_LOCAL")) or k in distributed.TORCHRUN_ENV)}
    env.update({**SRUN, "SLURM_STEP_NODELIST": "127.0.0.[1]", "MASTER_PORT": str(free_port()),
                "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CPATTN_PG_TIMEOUT_S": "60"})
    if sys.platform.startswith("linux"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)})
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err
        assert out.split() == [str(r), "2", str(r), "cpu", "3"], (out, err)
