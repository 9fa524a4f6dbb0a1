"""Ring and tree collectives in the cost model, the two-level all-gather, and wire bytes."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

import cpattn
from cpattn import cli, schedules
from cpattn.core.comm import Communicator
from cpattn.core.steps import CommOp, payload, wire
from cpattn.core.topology import Link, Topology
from cpattn.cost import Estimate, Problem, estimate, preset
from cpattn.cost.collectives import (
    algorithm,
    flat_vs_two_level,
    op_time,
    op_times,
    rails_per_nic,
    two_level_crossover,
)
from cpattn.cost.estimate import busiest_bytes_sent, default_candidates, wire_by_rank
from cpattn.cost.presets import LOCAL_ALGORITHM, local
from cpattn.lab.machine_profile import fit_link
from cpattn.launcher import RankError

ALPHA, BW = 4e-6, 20e9


def one_node(g: int, algo: str = "auto") -> Topology:
    return Topology(1, g, intra=Link(ALPHA, BW), algorithm=algo)


def formula(op: str, algo: str, n: int, g: int) -> float:
    steps_up = math.ceil(math.log2(g))
    if op == "all_reduce":
        return 2 * (g - 1) * (ALPHA + n / (g * BW)) if algo == "ring" else 2 * steps_up * ALPHA + 2 * n / BW
    return (g - 1) * ALPHA + n / BW if algo == "ring" else steps_up * ALPHA + n / BW


# ------------------------------------------------------------------------------------------ times
@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "reduce"])
@pytest.mark.parametrize("g", [2, 3, 4, 8, 13, 64])
def test_ring_and_tree_formulas(op, g):
    for algo in ("ring", "tree"):
        for n in (1, 1 << 16, 1 << 26):
            assert op_time(CommOp(op, n), one_node(g, algo)) == pytest.approx(formula(op, algo, n, g), rel=1e-12)


def test_auto_takes_the_faster_all_reduce_and_ring_broadcasts():
    """auto: the faster all_reduce algorithm; broadcast and reduce as NCCL/RCCL run them, rings."""
    for g in (2, 3, 4, 8, 64):
        for n in (1 << 10, 1 << 20, 1 << 24, 1 << 30):
            want = min(formula("all_reduce", "ring", n, g), formula("all_reduce", "tree", n, g))
            assert op_time(CommOp("all_reduce", n), one_node(g)) == pytest.approx(want, rel=1e-12)
            for op in ("broadcast", "reduce"):
                assert op_time(CommOp(op, n), one_node(g)) == pytest.approx(formula(op, "ring", n, g), rel=1e-12)


def test_auto_all_reduce_crossover():
    """Tree while N < g (g - 1 - ceil(log2 g)) alpha B, ring above; the ring at 2 ranks (ties: the ring)."""
    for g in (4, 8, 64, 512):
        cross = g * (g - 1 - math.ceil(math.log2(g))) * ALPHA * BW
        assert algorithm(CommOp("all_reduce", int(cross * 0.99)), one_node(g)) == "tree"
        assert algorithm(CommOp("all_reduce", int(cross * 1.01)), one_node(g)) == "ring"
    assert algorithm(CommOp("all_reduce", 1), one_node(2)) == "ring"
    assert algorithm(CommOp("all_reduce", 1), one_node(3)) == "ring"  # log2: 2 steps, as many as the ring's


def test_auto_broadcast_and_reduce_are_rings_and_a_tree_would_be_faster():
    """NCCL/RCCL have only rings for broadcast and reduce; with these formulas a tree never loses to
    them (same bandwidth term, fewer latency steps), which "tree" prices."""
    for op in ("broadcast", "reduce"):
        for g in (4, 8, 512):
            assert algorithm(CommOp(op, 1 << 30), one_node(g)) == algorithm(CommOp(op, 1), one_node(g)) == "ring"
            assert op_time(CommOp(op, 1), one_node(g, "tree")) < op_time(CommOp(op, 1), one_node(g))


def test_chain_latency_sums_intra_and_inter_hops():
    """A ring broadcast over 4 nodes of 8: 28 hops inside nodes and 3 across them, not 31 across."""
    topo = Topology(4, 8, intra=Link(2e-6, 100e9), inter=Link(10e-6, 25e9), nics_per_node=8)
    n = 1 << 20
    bandwidth = min(100e9, 8 * 25e9)
    assert op_time(CommOp("broadcast", n), topo) == pytest.approx(28 * 2e-6 + 3 * 10e-6 + n / bandwidth)
    rail = CommOp("broadcast", n, group="rail")  # every hop crosses nodes
    assert op_time(rail, topo) == pytest.approx(3 * 10e-6 + n / 25e9)


def test_algorithm_overrides():
    n = 1 << 30  # auto: ring for the all-reduce at this size, rings for broadcast and reduce
    assert [algorithm(CommOp(op, n), one_node(8)) for op in ("all_reduce", "broadcast", "reduce")] == \
        ["ring", "ring", "ring"]
    for algo in ("ring", "tree"):
        assert {algorithm(CommOp(op, n), one_node(8, algo)) for op in ("all_reduce", "broadcast", "reduce")} == {algo}
    per_op = one_node(8, "all_reduce:tree;reduce:tree")
    assert [algorithm(CommOp(op, n), per_op) for op in ("all_reduce", "broadcast", "reduce")] == \
        ["tree", "ring", "tree"]
    assert op_time(CommOp("broadcast", n), per_op) == pytest.approx(formula("broadcast", "ring", n, 8))
    assert [algorithm(CommOp(op, 8), one_node(8)) for op in ("all_gather", "reduce_scatter", "all_to_all",
                                                             "sendrecv")] == ["ring", "ring", "pairwise", "p2p"]
    with pytest.raises(ValueError, match="unknown"):
        Topology(1, 8, algorithm="butterfly")


def test_preset_algorithm_reaches_the_topology():
    assert preset("frontier", 64).algorithm == "auto"
    assert preset("dgx-h100", 64, algorithm="ring").algorithm_for("broadcast") == "ring"
    assert algorithm(CommOp("all_reduce", 64), preset("dgx-h100", 64)) == "tree"  # small, 64 ranks


def test_local_keeps_its_formulas_and_calibration_fits_them():
    topo = local(4)
    assert topo.algorithm == LOCAL_ALGORITHM and local(4, nodes=2).algorithm == LOCAL_ALGORITHM
    assert [algorithm(CommOp(op, 1), topo) for op in ("all_reduce", "broadcast", "reduce")] == ["ring", "tree", "tree"]
    assert algorithm(CommOp("all_reduce", 1), preset("local", 4, algorithm="tree")) == "tree"
    truth = Link(30e-6, 3e9)
    for op in ("sendrecv", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_reduce", "all_to_all"):
        unit = Topology(1, 2, intra=truth, op_links=((op, truth),), algorithm=LOCAL_ALGORITHM)
        points = [(b, op_time(CommOp(op, b), unit)) for b in (1 << 16, 1 << 20, 1 << 22, 1 << 24)]
        fitted = fit_link(op, 2, points)
        assert fitted.latency == pytest.approx(truth.latency, rel=1e-6), op
        assert fitted.bandwidth == pytest.approx(truth.bandwidth, rel=1e-6), op


# ------------------------------------------------------------------------------------------ levels
def test_rail_rings_share_their_nic():
    assert rails_per_nic(preset("frontier", 64)) == 2 and rails_per_nic(preset("dgx-h100", 64)) == 1
    assert rails_per_nic(Topology(2, 3, nics_per_node=2)) == 2  # local 0 and 1 on NIC 0, local 2 on NIC 1
    assert rails_per_nic(Topology(2, 2, nics_per_node=4)) == 1
    topo = preset("frontier", 64)  # 8 nodes: a rail ring of 8 ranks at 25 GB/s shared by 2 rails
    rail = op_time(CommOp("all_gather", 1 << 20, group="rail"), topo)
    assert rail == pytest.approx(7 * (10e-6 + (1 << 20) / 12.5e9))
    # the flat world ring: one ring per NIC, B = min(intra 50 GB/s, 4 x 25 GB/s)
    assert op_time(CommOp("all_gather", 1 << 20), topo) == pytest.approx(63 * (10e-6 + (1 << 20) / 50e9))
    inflight, at_wait = op_times(CommOp("all_gather", 1 << 20, hierarchical=True), topo)
    assert inflight == pytest.approx(rail)
    assert at_wait == pytest.approx(7 * (5e-6 + 8 * (1 << 20) / 50e9))


@pytest.mark.parametrize("name", ["frontier", "dgx-h100"])
def test_two_level_all_gather_wins_small_messages_by_latency(name):
    for world in (16, 64, 512, 4096):
        topo = preset(name, world)
        nodes, d = topo.nodes, topo.devices_per_node
        cross = two_level_crossover(topo)
        # (N-1) + (D-1) latency steps instead of N D - 1; the rail level at a shared NIC, then the node level
        saved = (nodes * d - 1) * topo.inter.latency - (nodes - 1) * topo.inter.latency - (d - 1) * topo.intra.latency
        rail_bw = topo.inter.bandwidth / rails_per_nic(topo)
        flat_bw = min(topo.intra.bandwidth, topo.nics_per_node * topo.inter.bandwidth)
        lost = (nodes - 1) / rail_bw + (d - 1) * nodes / topo.intra.bandwidth - (nodes * d - 1) / flat_bw
        assert cross == pytest.approx(saved / lost, rel=1e-6)
        flat, two = flat_vs_two_level("all_gather", int(cross / 2), topo)
        assert two < flat
        flat, two = flat_vs_two_level("all_gather", int(cross * 2), topo)
        assert two > flat
    assert two_level_crossover(preset("frontier", 8)) == 0.0  # one node: no second level


# ------------------------------------------------------------------------------------------ wire bytes
def test_wire_totals_over_the_group():
    for g in range(1, 18):
        for n in (0, 1, 7, 4096, 1000003):
            for root in {0, g // 2, g - 1}:
                def total(op, algo, size=g, nbytes=n, root=root):
                    return sum(wire(op, nbytes, size, r, root, algo) for r in range(size))

                for algo in ("ring", "tree"):
                    assert total("broadcast", algo) == (g - 1) * n
                    assert total("reduce", algo) == (g - 1) * n
                assert total("all_reduce", "tree") == 2 * (g - 1) * n
                assert total("all_reduce", "ring") == g * (2 * (g - 1) * n // g)
                for op in ("all_gather", "reduce_scatter", "all_to_all", "send", "recv"):
                    assert [wire(op, n, g, r, root) for r in range(g)] == \
                        [payload(op, n, g, r, root)[0] for r in range(g)], op


def test_wire_per_rank():
    n, g = 1000, 8
    ring_bcast = [wire("broadcast", n, g, r, 3, "ring") for r in range(g)]
    assert ring_bcast == [n, n, 0, n, n, n, n, n]  # the chain 3, 4, ..., 2 ends at rank 2
    assert [wire("reduce", n, g, r, 3, a) for r in range(g) for a in ("ring", "tree")] == \
        [0 if r == 3 else n for r in range(g) for _ in range(2)]
    # the root feeds both tops; the 7 others: inner node of one tree (N/2 to each of two children) and
    # leaf of the other, or one child in each, or the top of one with one child
    assert [wire("broadcast", n, g, r, 0, "tree") for r in range(g)] == [n, n, n // 2, n, n, n, n, n // 2]
    # all_reduce: N/2 up each tree (but from its top) and N/2 down to every child
    assert [wire("all_reduce", n, g, r, 0, "tree") for r in range(g)] == [n, *[2 * n] * 6, n]
    assert wire("all_reduce", n, 2, 0, 0, "tree") == wire("all_reduce", n, 2, 1, 0, "tree") == n
    for bad in (lambda: wire("broadcast", n, g, 0, 0, "auto"), lambda: wire("reduce", n, g, g, 0, "ring"),
                lambda: wire("gather", n, g, 0)):
        with pytest.raises(ValueError):
            bad()


def test_wire_by_rank_maps_groups_to_world_ranks():
    topo = Topology(2, 4, algorithm="ring")
    world = wire_by_rank(CommOp("broadcast", 100, root=5), topo)
    assert world.tolist() == [100, 100, 100, 100, 0, 100, 100, 100]  # chain 5, 6, ..., 4
    node = wire_by_rank(CommOp("broadcast", 100, group="node", root=1), topo)
    assert node.tolist() == [0, 100, 100, 100] * 2  # each node's chain 1, 2, 3, 0
    rail = wire_by_rank(CommOp("reduce", 100, group="rail", root=1), topo)
    assert rail.tolist() == [100] * 4 + [0] * 4  # each rail reduces onto node 1


def test_estimate_wire_covers_the_payload():
    topo = preset("dgx-h100", 4)
    seen = 0
    for mask in ("causal", "full"):
        problem = Problem(4096, 4, mask, 1, 8, 2, 64, "float32")
        for name in default_candidates(problem.mask):
            try:
                est = estimate(name, problem, topo)
            except (ValueError, NotImplementedError):
                continue
            seen += 1
            assert est.wire_bytes_per_rank >= est.bytes_per_rank > 0, name
            if not any(op.op in ("broadcast", "reduce", "all_reduce")
                       for ph in ("forward", "backward") for st in schedules.get(name).steps(problem, ph, topo)
                       for op in st.comm):
                assert est.wire_bytes_per_rank == est.bytes_per_rank, name
    assert seen >= 10
    ultra = estimate("ultra", Problem(1024, 4, "full", 1, 8, 2, 64, "float32"), topo)
    assert ultra.wire_bytes_per_rank == ultra.bytes_per_rank > 0  # a plan's transfers are point-to-point
    assert Estimate(1.0, 1.0, 0.0, 0.0, 0, 0).wire_bytes_per_rank == 0


def test_ring_broadcast_wire_at_scale():
    """ringx1: one broadcast per owner. As a chain every rank but one forwards each of them, as a double
    binary tree about as much: the busiest rank's wire bytes agree, the time does not."""
    problem = Problem(1 << 16, 64, "full", 1, 8, 2, 64, "bfloat16")
    ring, tree = (preset("frontier", 64, algorithm=a) for a in ("ring", "tree"))
    steps = schedules.get("ringx1").steps(problem, "forward", ring)
    e_ring, e_tree = (estimate("ringx1", problem, t, "forward") for t in (ring, tree))
    assert e_ring.bytes_per_rank == e_tree.bytes_per_rank == busiest_bytes_sent(steps, ring)
    assert e_ring.wire_bytes_per_rank == pytest.approx(e_tree.wire_bytes_per_rank, rel=1e-3)
    assert e_ring.wire_bytes_per_rank > 1.4 * e_ring.bytes_per_rank
    assert e_ring.total > e_tree.total  # 63 latency steps per broadcast instead of 6


# ------------------------------------------------------------------------------------------ measured
def collectives_wire(algo: str | None) -> dict:
    """A broadcast from 1, a reduce onto 2 and an all-reduce of 4,000 bytes; this rank's stats."""
    comm = Communicator()
    topology = Topology(1, comm.world_size, algorithm=algo or "auto")
    comm.set_topology(topology, lambda op, n: algorithm(CommOp(op, n), topology))  # as ContextParallel does
    t = torch.ones(1000)
    comm.broadcast(t, src=1)
    comm.reduce(t, dst=2)
    comm.all_reduce(t)
    try:
        comm.set_topology(Topology(1, comm.world_size + 1))
        mismatch = ""
    except ValueError as exc:
        mismatch = str(exc)
    return {"rank": comm.rank, "stats": comm.stats(), "wire": comm.stats(wire=True), "mismatch": mismatch,
            "algorithms": [comm.algorithm(op, 4000) for op in ("broadcast", "reduce", "all_reduce")]}


@pytest.mark.parametrize("algo", [None, "ring", "tree"])
def test_communicator_counts_wire_bytes(worlds, algo):
    results = worlds.get(4).run(collectives_wire, timeout=60, algo=algo)
    n, g = 4000, 4
    for r in results:
        assert not isinstance(r, RankError), f"{r}\n{getattr(r, 'traceback', '')}"
        rank = r["rank"]
        # default: one node of 4 ranks, auto: rings for broadcast and reduce, a tree all_reduce at 4,000 bytes
        algos = {"broadcast": algo or "ring", "reduce": algo or "ring", "all_reduce": algo or "tree"}
        assert r["algorithms"] == list(algos.values())
        roots = {"broadcast": 1, "reduce": 2, "all_reduce": 0}
        for op, root in roots.items():
            sent, recv = payload(op, n, g, rank, root)
            assert r["stats"][op] == {"calls": 1, "bytes_sent": sent, "bytes_recv": recv}  # volume()'s keys only
            assert r["wire"][op] == {**r["stats"][op], "wire_sent": wire(op, n, g, rank, root, algos[op])}
        assert r["stats"]["total"]["wire_sent"] == sum(r["wire"][op]["wire_sent"] for op in roots)
        assert "5 ranks" in r["mismatch"]
    total = sum(r["stats"]["total"]["wire_sent"] for r in results)
    expected_all_reduce = 2 * (g - 1) * n if (algo or "tree") == "tree" else g * (2 * (g - 1) * n // g)
    assert total == 2 * (g - 1) * n + expected_all_reduce


def schedule_wire(schedule: str, mask: str) -> dict:
    """One forward and backward of ``schedule``; this rank's wire bytes and the problem."""
    p = dist.get_world_size()
    cp = cpattn.ContextParallel(16 * p, mask, schedule)
    q, k, v = (torch.randn(1, 16, h, 8, requires_grad=True) for h in (4, 2, 2))
    cp.reset_comm_stats()
    cp.attention(q, k, v).sum().backward()
    problem = cp.problem(q, k)
    return {"rank": cp.rank, "total": cp.comm_stats()["total"],
            "problem": (problem.seq_len, problem.world, problem.batch, problem.heads, problem.kv_heads,
                        problem.head_dim, problem.dtype)}


@pytest.mark.parametrize("schedule,mask", [("ringx1", "full"), ("ringx2", "causal"), ("ringx4", "causal"),
                                           ("zigzag_ring", "causal")])
def test_comm_stats_wire_matches_the_steps(worlds, schedule, mask):
    """ContextParallel without a topology counts on one node of P ranks, as the cost model would."""
    results = worlds.get(4).run(schedule_wire, timeout=120, schedule=schedule, mask=mask)
    topo = Topology(1, 4)
    for r in results:
        assert not isinstance(r, RankError), f"{r}\n{getattr(r, 'traceback', '')}"
        s, world, b, h, hkv, d, dtype = r["problem"]
        problem = Problem(s, world, mask, b, h, hkv, d, dtype)
        expected = sum(int(wire_by_rank(op, topo)[r["rank"]]) for ph in ("forward", "backward")
                       for st in schedules.get(schedule).steps(problem, ph, topo) for op in st.comm)
        assert r["total"]["wire_sent"] == expected
        assert r["total"]["wire_sent"] >= r["total"]["bytes_sent"]


# ------------------------------------------------------------------------------------------ CLI
def test_simulate_algorithm_flag_and_wire_column(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    base = ["simulate", "--topology", "frontier", "--gpus", "64", "--seq", "65536", "--heads", "8", "--kv-heads",
            "2", "--head-dim", "64", "--schedules", "ring,ringx1", "--mask", "full", "--plot", ""]
    rows = {}
    for algo in ("ring", "tree"):
        assert cli.main([*base, "--algorithm", algo, "--json", f"{algo}.json"]) == 0
        rows[algo] = {r["schedule"]: r["estimate"] for r in json.loads((tmp_path / f"{algo}.json").read_text())}
    assert "wire" in capsys.readouterr().out
    assert rows["ring"]["ring"] == rows["tree"]["ring"]  # point-to-point only
    assert rows["ring"]["ringx1"]["total"] > rows["tree"]["ringx1"]["total"]  # chains of 63 latency steps
    assert rows["ring"]["ringx1"]["wire_bytes_per_rank"] > rows["ring"]["ringx1"]["bytes_per_rank"]
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    assert cli.main([*base, "--json", "env.json"]) == 0
    assert json.loads((tmp_path / "env.json").read_text())[1]["estimate"] == rows["ring"]["ringx1"]
    monkeypatch.setenv("NCCL_ALGO", "Tree")  # as in NCCL: the all-reduce only; broadcasts stay rings
    assert cli.main([*base, "--json", "env_tree.json"]) == 0
    assert cli.main([*base, "--algorithm", "all_reduce:tree", "--json", "ar_tree.json"]) == 0
    assert json.loads((tmp_path / "env_tree.json").read_text()) == json.loads((tmp_path / "ar_tree.json").read_text())
    assert json.loads((tmp_path / "env_tree.json").read_text())[1]["estimate"] != rows["tree"]["ringx1"]
    monkeypatch.setenv("NCCL_ALGO", "Tree,Ring")
    assert cli.main(base) == 2
    assert "NCCL_ALGO" in capsys.readouterr().err
    assert cli.main([*base, "--algorithm", "butterfly"]) == 2
