"""Running on a cluster with nothing to configure: the topology found where the ranks run
(``cpattn.core.placement.node_shape``, ``cpattn.cost.discovery``), its figures and its one log line;
two emulated nodes on this machine (``$CPATTN_HOST`` per rank) on a LocalWorld and under two torchrun
agents: cpattn finds 2 x 2, ``ringx3`` runs its two levels, every schedule is exact, and ``auto`` says
what it chose and why."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import cluster_run
import pytest

import cpattn
from cpattn import distributed
from cpattn.api import _auto_schedule
from cpattn.core.launch import SLURM_PORT_BASE, SLURM_PORT_SPAN
from cpattn.core.masks import resolve
from cpattn.core.placement import HOST_ENV, Place, host_name, hosts_text, node_shape
from cpattn.cost import discovery, presets
from cpattn.cost.discovery import TOPOLOGY_ENV, discover
from cpattn.launcher import RankError, free_port


def _places(*hosts: str, name: str = "cpu", digest: str = "") -> list[Place]:
    return [Place(h, -1 if name == "cpu" else i % 8, name, digest) for i, h in enumerate(hosts)]


@pytest.fixture
def no_preset(monkeypatch):
    monkeypatch.delenv(TOPOLOGY_ENV, raising=False)


# ------------------------------------------------------------------------------------------ the shape
def test_ranks_grouped_by_host_give_nodes_by_ranks_per_node():
    assert node_shape(_places("a", "a", "b", "b")) == (2, 2, "")
    assert node_shape(_places("a", "a", "a", "b", "b", "b")) == (2, 3, "")
    assert node_shape(_places("a", "b", "c")) == (3, 1, "")  # one rank per host
    assert node_shape(_places("a", "a", "a")) == (1, 3, "")
    assert node_shape(_places("a")) == (1, 1, "")


@pytest.mark.parametrize("hosts,why", [
    (("a", "b", "a", "b"), "the ranks of a host are not consecutive group ranks (a: ranks 0, 2; b: ranks 1, 3)"),
    (("a", "a", "a", "b"), "the hosts hold unequal numbers of ranks (a: ranks 0-2; b: rank 3)"),
], ids=["interleaved", "unequal"])
def test_irregular_hosts_are_one_flat_node_naming_them(hosts, why):
    assert node_shape(_places(*hosts)) == (1, 4, why)


def test_host_override_and_hosts_text(monkeypatch):
    monkeypatch.setenv(HOST_ENV, "rack7-node3")
    assert host_name() == "rack7-node3"
    monkeypatch.delenv(HOST_ENV)
    assert host_name() and host_name() != "rack7-node3"
    assert hosts_text(_places("n0", "n0", "n0", "n1", "n1", "n1")) == "n0: ranks 0-2; n1: ranks 3-5"


# ------------------------------------------------------------------------------------------ the figures
def test_two_hosts_are_found_with_generic_cpu_figures_said_so(no_preset):
    found = discover(_places("node0", "node0", "node1", "node1"), 4)
    topo = found.topology
    assert (topo.nodes, topo.devices_per_node) == (2, 2) and not found.flat and not found.named
    assert topo == presets.local(4, nodes=2)
    assert found.line == ("topology: 2 nodes x 2 ranks per node (node0: ranks 0-1; node1: ranks 2-3); figures: "
                          "conservative local CPU defaults (no calibration profile)")


def test_one_host_is_what_auto_always_used(no_preset):
    """On one host the topology equals this machine's (the calibration profile, or the conservative
    defaults), so schedule='auto' chooses as it always did."""
    found = discover(_places("h", "h", "h", "h"), 4)
    assert found.topology == presets.this_machine(4, "test") and found.topology.nodes == 1
    assert found.line.startswith("topology: one node of 4 ranks (host h); figures: ")
    off = discover(None, 4)  # check="off": nothing exchanged
    assert off.topology == found.topology and "check='off': no placement exchange" in off.line


def test_a_preset_names_the_figures_on_the_shape_found(monkeypatch):
    monkeypatch.setenv(TOPOLOGY_ENV, "DGX_H200")
    found = discover(_places("node0", "node0", "node1", "node1"), 4)
    topo = found.topology
    assert (topo.nodes, topo.devices_per_node, topo.name, topo.nics_per_node) == (2, 2, "dgx-h200", 2)
    assert (topo.intra, topo.inter, topo.device) == (presets.preset("dgx-h200", 8).intra,
                                                     presets.preset("dgx-h200", 8).inter,
                                                     presets.preset("dgx-h200", 8).device)
    assert found.named and "figures: preset dgx-h200 ($CPATTN_TOPOLOGY=DGX_H200)" in found.line
    given = discover(_places("node0", "node0", "node1", "node1"), 4, given="frontier")  # topology= wins
    assert given.topology.name == "frontier" and "preset frontier (topology='frontier')" in given.line
    monkeypatch.setenv(TOPOLOGY_ENV, "dgx-h900")
    with pytest.raises(ValueError, match=r"\$CPATTN_TOPOLOGY=dgx-h900: topology preset 'dgx-h900' is unknown; "
                                         r"accepted: frontier, dgx-h100, dgx-h200, dgx-a100, local"):
        discover(_places("a", "b"), 2)


def test_a_gpu_without_a_common_calibration_takes_its_shipped_profile(no_preset):
    found = discover(_places("a", "a", "b", "b", name="NVIDIA H200"), 4)
    assert found.topology.device == presets.preset("dgx-h200", 8).device
    assert "shipped profile h200-2026-12-04-cudnn (matched NVIDIA H200" in found.line and "generic links" in found.line
    other = discover(_places("a", "a", "b", "b", name="NVIDIA A100-SXM4-80GB"), 4)
    assert other.topology.name == "generic" and "generic figures" in other.line


def test_a_strict_subgroup_across_hosts_runs_flat_and_names_the_mesh(no_preset):
    found = discover(_places("node0", "node0", "node1", "node1"), 4, whole_world=False)
    assert (found.topology.nodes, found.topology.devices_per_node) == (1, 4) and found.flat
    assert "strict subgroup of the world across 2 hosts" in found.line and "2-D DeviceMesh" in found.line
    # a strict subgroup inside one host is one node as always, nothing to say
    assert not discover(_places("node0", "node0"), 2, whole_world=False).flat


def test_the_line_is_said_once_per_process(caplog):
    found = discover(_places("x0", "x1", "x0", "x1"), 4)
    with caplog.at_level(logging.INFO, logger="cpattn.cost.discovery"):
        discovery.announce(found)
        discovery.announce(found)
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "not consecutive" in caplog.text


def test_dgx_figures_on_the_two_nodes_found_change_what_auto_chooses(monkeypatch):
    """The same preset's figures on 2 nodes x 2 and on one node of 4: NVLink inside a node, InfiniBand
    across, so auto moves from Ulysses (every rank's all-to-all inside one node) to ringx3's two levels."""
    monkeypatch.setenv(TOPOLOGY_ENV, "dgx-h200")
    two = discover(_places("node0", "node0", "node1", "node1"), 4).topology
    flat = discover(_places("node0", "node0", "node0", "node0"), 4).topology
    chose_two, why_two = _auto_schedule(resolve("causal"), 16384, 4, two)
    chose_flat, why_flat = _auto_schedule(resolve("causal"), 16384, 4, flat)
    print(f"2 x 2: {chose_two}: {why_two}\n1 x 4: {chose_flat}: {why_flat}")
    assert (chose_two, chose_flat) == ("ringx3", "ulysses")


# ------------------------------------------------------------------------------------------ on a world
def _reports(results) -> list[dict]:
    for r in results:
        assert not isinstance(r, RankError), f"{r}\n{getattr(r, 'traceback', '')}"
    return results


def _check_run(reports: list[dict], schedules: list[str]) -> None:
    """Every schedule exact on every rank, on the 2 x 2 found; ringx3's two levels carried what its
    collectives count."""
    for r in reports:
        for name in schedules:
            got = r["schedules"][name]
            assert got["finite"] and got["error"] <= 2 * got["e_local"] + 1e-6, (name, r["rank"], got)
            assert got["topology"][:2] == [2, 2], (name, got["topology"])
        if "ringx3" in schedules:
            levels, stats = r["schedules"]["ringx3"]["levels"], r["schedules"]["ringx3"]["stats"]
            assert levels["inter_node"]["bytes_sent"] > 0 and levels["intra_node"]["bytes_sent"] > 0, levels
            flat = sum(stats[op]["bytes_sent"] for op in ("all_gather", "reduce_scatter"))
            assert levels["inter_node"]["bytes_sent"] + levels["intra_node"]["bytes_sent"] == flat, (levels, stats)


def test_two_emulated_nodes_on_a_local_world(worlds):
    """Four ranks that name their hosts node0, node0, node1, node1: cpattn finds 2 x 2 with no topology
    given, ringx3 and ringx3b build their rail and node groups from it and are exact."""
    schedules = ["ringx3", "ringx3b"]
    reports = _reports(worlds.get(4).run(cluster_run.on_local_world, timeout=120, schedules=schedules))
    _check_run(reports, schedules)
    assert len({json.dumps(r["auto"]) for r in reports}) == 1  # every rank chose the same
    chose = [line for line in reports[0]["log"] if line.startswith("schedule='auto' chose")]
    assert chose and chose[0].startswith(f"schedule='auto' chose {reports[0]['auto']['schedule']}: "), chose
    print(chose[0])
    preset = _reports(worlds.get(4).run(cluster_run.on_local_world, timeout=120, schedules=[], preset="dgx-h200"))
    assert preset[0]["auto"]["topology"] == [2, 2, "dgx-h200"]


def subgroup_across_nodes() -> dict:
    """ringx3 on the group ranks 1 and 2 of a world whose ranks say they run on node0, node0, node1,
    node1: a strict subgroup across two hosts without a mesh, so it runs flat (no group is created)."""
    import torch.distributed as dist

    group = dist.new_group([1, 2])
    os.environ[HOST_ENV] = f"node{dist.get_rank() // 2}"
    try:
        if dist.get_rank() not in (1, 2):
            return {"member": False}
        cp = cpattn.ContextParallel(32, "causal", "ringx3", group=group)
        x = cp.shard(cluster_run.torch.randn(1, 32, 2, 8, generator=cluster_run.torch.Generator().manual_seed(3)))
        cp.attention(x, x, x)
        return {"member": True, "shape": [cp.topology.nodes, cp.topology.devices_per_node],
                "levels": cp.comm_stats().get("levels", {})}
    finally:
        os.environ.pop(HOST_ENV, None)


def test_a_strict_subgroup_across_emulated_nodes_runs_flat(worlds):
    got = [r for r in _reports(worlds.get(4).run(subgroup_across_nodes, timeout=60)) if r["member"]]
    assert len(got) == 2 and all(r["shape"] == [1, 2] and r["levels"] == {} for r in got), got


# ------------------------------------------------------------------------------------------ two torchrun agents
SCRIPT = Path(__file__).with_name("cluster_run.py")
REPORT = re.compile(r"cluster-run rank (\d+) (\{.*\})")


def _environment() -> dict[str, str]:
    """This process's environment without any launcher's variables or a preset, for the runs below."""
    base = {k: v for k, v in os.environ.items() if not (k.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_LOCAL"))
                                                         or k in distributed.TORCHRUN_ENV or k == TOPOLOGY_ENV)}
    base.update({"OMP_NUM_THREADS": "1", distributed.TIMEOUT_ENV: "60"})
    if sys.platform.startswith("linux"):
        base["GLOO_SOCKET_IFNAME"] = "lo"
    return base


def _agents(schedules: list[str]) -> tuple[list[dict], str]:
    """Two torchrun agents on this machine (static rendezvous on 127.0.0.1), two ranks each, told
    apart as hosts node0 and node1 by $CPATTN_HOST; every rank's report and the agents' output."""
    port, base = free_port(), _environment()
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--master-addr",
            "127.0.0.1", "--master-port", str(port), "--monitor-interval", "0.1"]
    return _wait([subprocess.Popen([*argv, "--node-rank", str(node), str(SCRIPT), *schedules], text=True,
                                   env={**base, HOST_ENV: f"node{node}"}, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT) for node in range(2)])


def _slurm_job_id() -> int:
    """A job id whose derived rendezvous port (cpattn.core.launch) is free on 127.0.0.1 now."""
    for job in range(int(time.time()) % SLURM_PORT_SPAN, SLURM_PORT_SPAN * 2):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", SLURM_PORT_BASE + job % SLURM_PORT_SPAN))
            except OSError:
                continue
        return job
    raise RuntimeError("no free port in the SLURM range")


def _launched(launcher: str, schedules: list[str]) -> tuple[list[dict], str]:
    """Four processes started with what ``srun`` (two nodes of two tasks in one step of a job of 8 tasks:
    the address from the step's node list, the port from the job id) or Open MPI's ``mpirun`` (two hosts
    of two: the user's MASTER_ADDR and MASTER_PORT) would set, ranks 0-1 on node0 and 2-3 on node1."""
    base, job, port = _environment(), _slurm_job_id(), free_port()
    procs = []
    for rank in range(4):
        if launcher == "srun":
            env = {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
                   "SLURM_LOCALID": str(rank % 2), "SLURM_NODEID": str(rank // 2), "SLURM_STEP_NUM_TASKS": "4",
                   "SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "127.0.0.[1-2]", "SLURM_JOB_NODELIST": "127.0.0.[1-4]"}
        else:
            env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "4",
                   "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % 2), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), *schedules], text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, env={**base, **env, HOST_ENV: f"node{rank // 2}"}))
    return _wait(procs)


def _wait(procs: list[subprocess.Popen], timeout: float = 240.0) -> tuple[list[dict], str]:
    """The reports of every rank of ``procs`` and their output, once all exited 0."""
    outputs = []
    deadline = time.time() + timeout
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.time()))[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, "\n".join(outputs)
    output = "\n".join(outputs)
    return [json.loads(m.group(2)) for m in REPORT.finditer(output)], output


def _check_launched(reports: list[dict], output: str, schedules: list[str]) -> None:
    """Four ranks, each found 2 x 2 (its log line), every schedule exact, ringx3's two levels, one
    ``auto`` choice, whose reason is printed."""
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3], output
    _check_run(reports, schedules)
    for r in reports:
        found = [line for line in r["log"] if line.startswith("topology: ")]
        assert found and found[0].startswith("topology: 2 nodes x 2 ranks per node (node0: ranks 0-1; node1: ranks "
                                             "2-3); figures: "), r["log"]
    chose = [line for line in reports[0]["log"] if line.startswith("schedule='auto' chose")]
    assert chose and len({json.dumps(r["auto"]) for r in reports}) == 1
    print(f"{found[0]}\n{chose[0]}\nringx3 levels on rank 0: {reports[0]['schedules']['ringx3']['levels']}")


@pytest.mark.slow
def test_two_torchrun_agents_make_two_nodes_and_every_schedule_is_exact():
    schedules = [s["name"] for s in cpattn.schedules.available()]
    _check_launched(*_agents(schedules), schedules)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_srun_and_mpirun_variables_make_the_same_two_nodes(launcher):
    """The same through ``cpattn.distributed.init()`` from simulated srun and Open MPI mpirun variables
    (ringx3's two levels, ringx3b, and the ring as a point-to-point schedule)."""
    schedules = ["ringx3", "ringx3b", "zigzag_ring"]
    _check_launched(*_launched(launcher, schedules), schedules)
