"""Cost model: topologies, collectives, schedule steps and estimates, simulator, profiles, "auto"."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import re

import pytest
import torch
from cpattn.layout import Layout
from hypothesis import given, settings
from hypothesis import strategies as st

import cpattn
from cpattn import bench, cli, masks, schedules
from cpattn.api import AUTO_SHAPE, _auto_schedule
from cpattn.core import memo
from cpattn.core.pairs import EnumeratedPairs, TriangularPairs, closed_form, head_split
from cpattn.core.steps import COMM_OPS
from cpattn.core.topology import RatePoint
from cpattn.cost import (
    CommOp,
    Device,
    Estimate,
    Link,
    Problem,
    Task,
    Topology,
    check_supports,
    choose,
    declares_steps,
    default_candidates,
    estimable,
    estimate,
    lane,
    op_time,
    pair_work,
    preset,
    presets,
    profile,
    rank_schedules,
    simulate,
    transfer,
)
from cpattn.lab import machine_profile
from cpattn.planner import get_plan, request
from cpattn.schedules.base import Schedule
from cpattn.schedules.usp import USPSchedule

BASELINES = ("ring", "zigzag_ring", "stripe_ring", "allgather")
RINGX = ("ringx1", "ringx1o", "ringx2", "ringx2o", "ringx3", "ringx3b", "ringx4", "ringx4o")
HEAD_SPLIT = ("ulysses", "usp")


def _faster(topo: Topology, factor: float) -> Topology:
    """``topo`` with every link ``factor`` times the bandwidth."""
    scale = lambda ln: Link(ln.latency, ln.bandwidth * factor)  # noqa: E731
    return dataclasses.replace(topo, intra=scale(topo.intra), inter=scale(topo.inter),
                               op_links=tuple((op, scale(ln)) for op, ln in topo.op_links))


def _modelled(mask_name: str) -> list[str]:
    """Every registered schedule that runs ``mask_name`` and declares its steps."""
    out = []
    for name in schedules.names():
        try:
            schedules.get(name).check_mask(masks.resolve(mask_name))
        except (ValueError, NotImplementedError):
            continue
        if declares_steps(name):
            out.append(name)
    return out


# ------------------------------------------------------------------ topology and presets
def test_topology_keeps_its_two_argument_form():
    topo = Topology(2, 4)
    assert topo.world == 8 and topo.node_of(5) == 1 and topo.local_index(5) == 1
    assert Topology(2, 4) == Topology(2, 4)  # hashable value, as comm.py keys groups by it
    with pytest.raises(ValueError, match="devices_per_node"):
        Topology(2, 0)


def test_presets_map_worlds_to_nodes():
    frontier = preset("frontier", 64)
    assert (frontier.nodes, frontier.devices_per_node, frontier.nics_per_node) == (8, 8, 4)
    assert [frontier.nic_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # one NIC per MI250X
    small = preset("dgx-h100", 4)
    assert (small.nodes, small.devices_per_node) == (1, 4)
    with pytest.raises(ValueError, match="multiple of it"):
        preset("frontier", 12)
    with pytest.raises(ValueError, match="accepted"):
        preset("summit", 8)


# ------------------------------------------------------------------ collectives
@settings(max_examples=150, deadline=None)
@given(op=st.sampled_from(COMM_OPS), nbytes=st.integers(0, 1 << 30), nodes=st.sampled_from([1, 2, 3, 8]),
       per_node=st.sampled_from([1, 2, 8]), nics=st.sampled_from([1, 4, 8]), group=st.sampled_from(["world", "node",
                                                                                                    "rail"]),
       peer=st.integers(1, 9), factor=st.floats(1.0, 100.0), hier=st.booleans())
def test_more_bandwidth_is_never_slower(op, nbytes, nodes, per_node, nics, group, peer, factor, hier):
    topo = Topology(nodes, per_node, intra=Link(5e-6, 50e9), inter=Link(1e-5, 25e9), nics_per_node=nics)
    comm = CommOp(op, nbytes, group=group, peer=peer,
                  hierarchical=hier and op in ("all_gather", "reduce_scatter"))
    t = op_time(comm, topo)
    assert t >= 0 and math.isfinite(t)
    assert op_time(comm, _faster(topo, factor)) <= t * (1 + 1e-12)
    slower = dataclasses.replace(topo, intra=Link(1e-4, 50e9), inter=Link(1e-4, 25e9))
    assert op_time(comm, slower) >= t * (1 - 1e-12)


def test_collective_formulas():
    link = Link(2e-6, 10e9)
    node = Topology(1, 8, intra=link)
    n = 1 << 20
    assert op_time(CommOp("all_gather", n), node) == pytest.approx(7 * (2e-6 + n / 10e9))
    assert op_time(CommOp("broadcast", n), node) == pytest.approx(7 * 2e-6 + n / 10e9)  # NCCL's ring
    tree = dataclasses.replace(node, algorithm="tree")
    assert op_time(CommOp("broadcast", n), tree) == pytest.approx(3 * 2e-6 + n / 10e9)
    assert op_time(CommOp("all_reduce", n), node) == pytest.approx(14 * (2e-6 + n / 8 / 10e9))
    multi = Topology(4, 8, intra=Link(1e-6, 400e9), inter=Link(5e-6, 50e9), nics_per_node=8)
    flat, hier = CommOp("all_gather", n), CommOp("all_gather", n, hierarchical=True)
    rail, inner = op_time(CommOp("all_gather", n, group="rail"), multi), op_time(CommOp("all_gather", 4 * n,
                                                                                         group="node"), multi)
    assert op_time(hier, multi) == pytest.approx(rail + inner)  # two levels, summed
    assert op_time(flat, multi) == pytest.approx(31 * (5e-6 + n / 400e9))  # one ring per NIC: 8 x 50 GB/s


def test_ring_shift_uses_one_nic_and_rails_share_them():
    n = 1 << 24
    topo = Topology(4, 8, intra=Link(1e-6, 400e9), inter=Link(5e-6, 50e9), nics_per_node=8)
    # a ring step: only the last device of each node sends off-node, through one NIC
    assert op_time(CommOp("sendrecv", n), topo) == pytest.approx(topo.inter.time(n))
    shared = dataclasses.replace(topo, nics_per_node=2)
    rail = CommOp("all_gather", n, group="rail")
    assert op_time(rail, shared) == pytest.approx(3 * (5e-6 + n / 12.5e9))  # 8 rails on 2 NICs: a quarter each
    # a shift by a whole node: every device leaves the node, 4 flows per NIC
    assert op_time(CommOp("sendrecv", n, peer=8), shared) == pytest.approx(5e-6 + 4 * n / 50e9)


# ------------------------------------------------------------------ block pairs and steps
@pytest.mark.parametrize("layout_name", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("mask_name", ["causal", "full"])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_closed_forms_equal_the_run_time_blocks(layout_name, mask_name, world):
    mask, layout, seq = masks.resolve(mask_name), Layout(layout_name), 2 * world * 6
    closed = pair_work(mask, layout, seq, world)
    enumerated = EnumeratedPairs(mask, layout, seq, world)
    assert type(closed).__name__ == ("TriangularPairs" if world > 1 else "EnumeratedPairs")
    for i in range(world):
        assert closed.by_q_rank(i) == enumerated.by_q_rank(i)
        assert closed.by_kv_rank(i) == enumerated.by_kv_rank(i)
        for j in range(world):
            assert closed.pair(i, j) == enumerated.pair(i, j)
    for t in range(world):
        assert closed.by_offset(t) == enumerated.by_offset(t)
    assert closed.remote_rows() == enumerated.remote_rows()
    total = sum(k.area * calls * ranks for t in range(world) for w, ranks in closed.by_offset(t) for k, calls in w)
    assert total == Problem(seq, world, mask_name).allowed_pairs()


def _accounting(steps, world: int, rank: int) -> dict:
    out: dict[str, list[int]] = {}
    for step in steps:
        for op in step.comm:
            for kind, (calls, sent, recv) in op.accounting(rank, world).items():
                acc = out.setdefault(kind, [0, 0, 0])
                acc[0], acc[1], acc[2] = acc[0] + calls, acc[1] + sent, acc[2] + recv
    return {k: {"calls": v[0], "bytes_sent": v[1], "bytes_recv": v[2]} for k, v in out.items()}


def _check_volume(sched: Schedule, problem: Problem) -> None:
    """``sched``'s steps on ``problem`` cover every rank in each step, and its volume() on every rank
    is their ops counted by the communicator's rule (the runtime is checked against the same steps by
    the recording tests in test_spec.py)."""
    world = problem.world
    for phase in ("forward", "backward"):
        steps = sched.program(problem, phase)
        for step in steps:
            assert sum(n for _, n in step.work) in (0, world), (sched.name, phase)
        for rank in range(world):
            expected = {op: v for op, v in sched.volume(problem, rank)[phase].items() if v["calls"]}
            assert _accounting(steps, world, rank) == expected, (sched.name, phase, rank)


def _check_pairs(sched: Schedule, problem: Problem) -> None:
    """``sched``'s steps compute every allowed (query, key) pair exactly once for every query head."""
    for phase in ("forward", "backward"):
        steps = sched.program(problem, phase)
        done = sum(k.area * (k.heads or problem.heads) * calls * ranks
                   for st_ in steps for w, ranks in st_.work for k, calls in w)
        assert done == problem.allowed_pairs() * problem.heads, (sched.name, phase)


@pytest.mark.parametrize("mask_name", ["causal", "full"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_steps_add_up_to_the_declared_volume(mask_name, world):
    """Every schedule that declares steps: their ops, summed, are exactly its volume() on every rank."""
    for name in _modelled(mask_name):
        _check_volume(schedules.get(name), Problem(4 * world * 8, world, mask_name, batch=2, heads=12, kv_heads=2,
                                                   head_dim=8))


@pytest.mark.parametrize("mask", ["causal", "full", masks.sliding_window(10)])
@pytest.mark.parametrize("world, degree", [(4, 1), (4, 2), (6, 2), (6, 3), (6, 6)])
@pytest.mark.parametrize("kv_heads", [2, 3, 12])
def test_usp_steps_match_its_volume_and_pairs_at_every_degree(mask, world, degree, kv_heads):
    """USP of any Ulysses degree (point-to-point exchanges inside groups, ring across them), every kv
    head plan (one kv head per member, kv heads replicated, one per query head)."""
    problem = Problem(4 * world * 6, world, mask, heads=12, kv_heads=kv_heads, head_dim=8)
    sched = USPSchedule(ulysses_degree=degree)
    _check_volume(sched, problem)
    _check_pairs(sched, problem)


def test_baselines_declare_steps_and_later_schedules_need_not():
    assert all(declares_steps(n) for n in (*BASELINES, *RINGX, *HEAD_SPLIT))
    # volumes cross-checked above
    assert set(RINGX) | set(HEAD_SPLIT) <= set(_modelled("causal")) | set(_modelled("full"))
    assert estimable("ultra") and not declares_steps("ultra")  # estimated from its plan

    class Unmodelled(Schedule):
        name = "unmodelled"

    problem = Problem(64, 2, "causal")
    with pytest.raises(NotImplementedError, match="'unmodelled'.*steps"):
        estimate(Unmodelled(), problem, preset("dgx-h100", 2))


# ------------------------------------------------------------------ estimates
@pytest.mark.parametrize("mask_name", ["causal", "full"])
@pytest.mark.parametrize("world", [8, 64])
def test_estimates_are_monotone_in_bandwidth(mask_name, world):
    problem = Problem(world * 4096, world, mask_name)
    topo = preset("frontier", world)
    for name in _modelled(mask_name):
        try:
            check_supports(name, problem)
        except ValueError:  # ulysses splits 32 heads over at most 32 ranks
            continue
        base = estimate(name, problem, topo)
        fast = estimate(name, problem, _faster(topo, 4.0))
        assert fast.total <= base.total * (1 + 1e-12), name
        assert fast.compute == pytest.approx(base.compute), name
        assert base.compute <= base.total <= base.compute + base.comm + 1e-12, name
        assert base.exposed_comm == pytest.approx(base.total - base.compute), name


@pytest.mark.parametrize("name", ["ring", "zigzag_ring"])
def test_ring_traffic_grows_with_ranks_at_fixed_work_per_rank(name):
    previous = None
    for world in (2, 4, 8, 16, 64, 256):
        e = estimate(name, Problem(world * 2048, world, "causal"), preset("frontier", world))
        if previous is not None:
            assert e.bytes_per_rank >= previous.bytes_per_rank and e.comm >= previous.comm
        previous = e


def test_no_overlap_means_compute_plus_communication():
    topo = dataclasses.replace(preset("dgx-h100", 8), overlap=0.0)
    e = estimate("ring", Problem(8 * 1024, 8, "full"), topo)
    assert e.total == pytest.approx(e.compute + e.comm)


def test_estimate_rejects_mismatched_worlds_and_masks():
    with pytest.raises(ValueError, match="world=8"):
        estimate("ring", Problem(1024, 8), preset("dgx-h100", 4))
    with pytest.raises(ValueError, match="causal-only"):
        estimate("ringx4", Problem(1024, 4, masks.from_mask_mod(lambda q, k: k >= q)), preset("dgx-h100", 4))


def _assert_closed_form(sched: Schedule, problem: Problem) -> None:
    """What makes estimates at thousands of ranks cheap: ``sched``'s pair work on ``problem`` is the closed
    form (O(P) per step, not P^2 classified rank pairs), built once per memo scope and then reused, keyed
    by value; outside any scope it is built anew."""
    layout = Layout(sched.layout_for(problem.mask))
    assert closed_form(problem.mask, layout, problem.seq_len, problem.world) is not None, sched.name
    same = Problem(problem.seq_len, problem.world, masks.resolve(problem.mask.name))  # an equal problem, new objects
    with memo.scope():
        work = sched.pairs(problem)
        assert isinstance(work, TriangularPairs), (sched.name, type(work).__name__)
        assert schedules.get(sched.name).pairs(same) is work, sched.name
    assert schedules.get(sched.name).pairs(same) is not work, sched.name


@pytest.mark.slow  # estimates at thousands of ranks
def test_thousands_of_ranks_estimate_from_closed_forms():
    for mask_name in ("causal", "full"):
        problem = Problem(1 << 20, 4096, mask_name)
        for name in BASELINES:
            e = estimate(name, problem, preset("frontier", 4096))
            assert math.isfinite(e.total) and 0 < e.compute <= e.total, name
            _assert_closed_form(schedules.get(name), problem)



def _mask_of(name: str) -> str:
    """A mask ``name`` runs: causal when it can, else full."""
    return "causal" if schedules.get(name).causal else "full"


@pytest.mark.parametrize("name", [*BASELINES, *RINGX, *HEAD_SPLIT])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_steps_compute_every_allowed_pair_once(name, world):
    _check_pairs(schedules.get(name), Problem(2 * world * 6, world, _mask_of(name), heads=60, kv_heads=2, head_dim=8))


def test_head_split_tags_kernels_and_counts_ranks():
    pairs = pair_work(masks.causal(), Layout("contiguous"), 64, 2)
    split = head_split(pairs.by_offset(1), 4, 2, 1)
    assert sum(n for _, n in split) == 8  # 2 groups of 4 ranks
    assert all(k.heads == 2 and k.kv_heads == 1 for w, _ in split for k, _ in w)
    problem = Problem(64, 8, "causal", heads=8, kv_heads=2)
    [full] = [w for w, _ in split if w]  # query group 1 against key group 0; group 0 against 1 is empty
    [(kernel, _)] = full
    assert kernel.flops(problem, "forward") == pytest.approx(4.0 * 2 * 128 * kernel.area)  # 2 of the 8 heads


def test_ulysses_splits_the_work_evenly_over_heads():
    problem = Problem(8 * 512, 8, "causal", heads=32, kv_heads=8)
    steps = schedules.get("ulysses").program(problem, "forward")
    [(w, ranks)] = [wr for st_ in steps for wr in st_.work if wr[0]]
    assert ranks == 8 and [(k.heads, k.kv_heads, k.q_len, k.kv_len) for k, _ in w] == [(4, 1, 4096, 4096)]
    flops = sum(k.flops(problem, "forward") * n for k, n in w)
    assert flops == pytest.approx(problem.flops("forward") / 8)  # the whole sequence, 1/P of the heads
    topo = preset("dgx-h100", 8)
    uly, zigzag = estimate("ulysses", problem, topo), estimate("zigzag_ring", problem, topo)
    assert uly.comm > 0 and uly.total == pytest.approx(uly.compute + uly.comm)  # the all-to-alls block
    assert uly.compute < 1.1 * zigzag.compute  # balanced, like zigzag


def test_usp_takes_its_degree_from_the_topology():
    problem = Problem(16 * 1024, 16, "causal", heads=32, kv_heads=8)
    usp, topo = schedules.get("usp"), preset("dgx-h100", 16)  # 2 nodes of 8
    assert usp.degree(32, 16) == 16 and usp.degree(32, 16, topo) == 8
    ops = [op for st_ in usp.steps(problem, "forward", topo) for op in st_.comm]
    assert {op.group for op in ops if op.peer < 8} == {"node"}  # the exchanges stay inside a node
    assert sum(op.peer == 8 for op in ops) == 1  # one ring step between the two groups
    # without a topology (or on one node) USP is Ulysses
    local = presets.local(16)
    assert estimate("usp", problem, local).total == pytest.approx(estimate("ulysses", problem, local).total)
    e = estimate("usp", problem, topo)
    assert e.bytes_per_rank != estimate("ulysses", problem, topo).bytes_per_rank


def test_ultra_is_estimated_from_its_plan():
    mask = masks.sliding_window(64)
    problem = Problem(1024, 4, mask, heads=4, kv_heads=2, head_dim=16, dtype="float32")
    topo = presets.local(4)
    both, fwd = estimate("ultra", problem, topo), estimate("ultra", problem, topo, "forward")
    plan = get_plan(request(mask, 1024, topo, 1, 4, 2, 16, "float32", schedules.get("ultra").plan_options))
    assert fwd.total == plan.forward.predicted
    assert both.total == pytest.approx(plan.forward.predicted + plan.backward.predicted)
    sizes = plan.sizes(1, 4, 2, 16, 4, 4)
    sent = [plan.volume(r, sizes) for r in range(4)]
    assert fwd.bytes_per_rank == max(v["forward"].get("send", {}).get("bytes_sent", 0) for v in sent)
    assert 0 < both.compute <= both.total and both.flops == problem.flops("forward+backward")
    assert estimate("ultra", problem, topo) == both  # deterministic
    # "auto" plans ultra only for masks other than causal and full
    assert "ultra" in default_candidates(mask) and "ultra" not in default_candidates(masks.causal())
    assert "ultra" in dict(rank_schedules(problem, topo))


#: the overlapped variants and ringx4 estimate at scale in the slow suite (ringx2 and ringx1 cover their owner loops)
AT_SCALE_SLOW = ("ringx1o", "ringx2o", "ringx4", "ringx4o")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in AT_SCALE_SLOW else n
                                  for n in RINGX])
def test_every_ringx_variant_estimates_at_scale(name):
    """Each RingX variant is estimable at 8 and 4,096 GCDs, from closed forms; the broadcast-based ones keep
    O(local) memory."""
    results = {}
    for world in (8, 4096):
        problem = Problem(world * 1024, world, _mask_of(name))
        e = estimate(name, problem, preset("frontier", world))
        assert math.isfinite(e.total) and 0 < e.compute <= e.total <= (e.compute + e.comm) * (1 + 1e-12)
        assert e.bytes_per_rank > 0 and e.flops == problem.flops("forward+backward")
        results[world] = e
        _assert_closed_form(schedules.get(name), problem)
    if name not in ("ringx3", "ringx3b"):
        assert results[4096].peak_memory == results[8].peak_memory
    else:
        assert results[4096].peak_memory > 100 * results[8].peak_memory


@pytest.mark.parametrize("plain", ["ringx1", "ringx2", "ringx4"])
@pytest.mark.parametrize("world", [4, 8, 64])  # (at 2 ranks X2 has one shared step: nothing to pipeline)
def test_pipelined_ringx_hides_communication_with_a_second_buffer(plain, world):
    problem = Problem(world * 2048, world, _mask_of(plain))
    topo = preset("frontier", world)
    base, piped = estimate(plain, problem, topo), estimate(plain + "o", problem, topo)
    assert piped.compute == pytest.approx(base.compute) and piped.bytes_per_rank == base.bytes_per_rank
    assert base.total == pytest.approx(base.compute + base.comm)  # every op waited before the next compute
    assert piped.total < base.total and piped.peak_memory > base.peak_memory


def test_ringx2_skips_the_steps_nobody_shares():
    problem = Problem(4 * 64, 4, "causal", heads=4, kv_heads=2, head_dim=8)
    sched = schedules.get("ringx2")
    forward, backward = sched.program(problem, "forward"), sched.program(problem, "backward")
    # the unshared diagonal, then P - 1 owners (without overlap, an owner's broadcast, compute, lse maximum
    # and reduces are steps one after the other)
    assert [sum(op.op == "broadcast" for st_ in steps for op in st_.comm) for steps in (forward, backward)] == [3, 3]
    assert len(forward) == 1 + 3 * 4 and len(backward) == 1 + 3 * 3
    assert not forward[0].comm and [n for _, n in forward[0].work] == [3, 1]  # only rank 0 computes
    assert [op.root for st_ in forward[1:] for op in st_.comm if op.op == "broadcast"] == [1, 2, 3]
    assert [op.root for st_ in backward[1:] for op in st_.comm if op.op == "broadcast"] == [0, 1, 2]


def test_causal_imbalance_of_the_contiguous_ring():
    problem = Problem(8 * 8192, 8, "causal")
    ring, zigzag = (estimate(n, problem, preset("dgx-h100", 8)) for n in ("ring", "zigzag_ring"))
    assert 1.6 < ring.compute / zigzag.compute < 2.1  # the busiest rank does about twice the balanced work


def test_device_rates_grow_with_block_size_and_follow_measurements():
    dev = preset("dgx-h100", 8).device
    rates = [dev.rate("forward", "full", n, n) for n in (64, 256, 1024, 8192)]
    assert rates == sorted(rates) and rates[-1] <= dev.forward_flops
    pts = (RatePoint("forward", "full", 256, 256, 1e9), RatePoint("forward", "full", 1024, 1024,
                                                                                        4e9))
    measured = dataclasses.replace(dev, table=pts)
    assert measured.rate("forward", "full", 64, 64) == 1e9 and measured.rate("forward", "full", 4096, 4096) == 4e9
    assert measured.rate("forward", "full", 512, 512) == pytest.approx(2e9)  # log-log midpoint
    assert measured.rate("forward", "causal", 512, 512) == pytest.approx(2e9 * dev.causal_efficiency)


# ------------------------------------------------------------------ simulator
def test_simulator_respects_lanes_dependencies_and_order():
    topo = Topology(2, 2, intra=Link(0.0, 1.0), inter=Link(1.0, 1.0))
    tasks = [
        Task("a", 2.0, (lane(0, "compute"),)),
        Task("b", 1.0, (lane(0, "compute"),)),
        transfer("t", 0, 2, 3.0, topo, deps=["a"]),  # across nodes: 1 + 3 seconds
        Task("c", 1.0, (lane(2, "compute"),), deps=("t",)),
        Task("d", 5.0, (lane(1, "compute"),)),
    ]
    tl = simulate(tasks)
    assert (tl.start["a"], tl.start["b"]) == (0.0, 2.0)  # one lane, in the given order
    assert tl.start["t"] == 2.0 and tl.end["t"] == 6.0 and tl.start["c"] == 6.0
    assert tl.makespan == 7.0 and tl.busy(lane(0, "compute")) == 3.0
    assert [iv.task for iv in tl.lanes[lane(0, "send")]] == ["t"]
    reordered = simulate(tasks, order={lane(0, "compute"): ["b", "a"]})
    assert reordered.start["b"] == 0.0 and reordered.start["a"] == 1.0 and reordered.makespan == 8.0


def test_simulator_rejects_bad_graphs():
    with pytest.raises(ValueError, match="unknown task 'x'"):
        simulate([Task("a", 1.0, ("l",), deps=("x",))])
    with pytest.raises(ValueError, match="cycle"):
        simulate([Task("a", 1.0, ("l",), deps=("b",)), Task("b", 1.0, ("m",), deps=("a",))])
    with pytest.raises(ValueError, match="duration"):
        simulate([Task("a", -1.0, ("l",))])


# ------------------------------------------------------------------ profiles
def _profile() -> profile.Profile:
    pts = tuple(RatePoint(ph, kind, n, n, 1e10 * (i + 1)) for i, (ph, kind, n) in enumerate(
        (ph, kind, n) for ph in ("forward", "backward") for kind in ("full", "causal") for n in (256, 1024)))
    return profile.Profile(pts, {"sendrecv": Link(5e-5, 2e9), "all_gather": Link(1e-4, 5e8)}, 8e9, 0.4, 2, 2, 1,
                           16 * 2**30, {"torch": "x"})


def test_profile_round_trips(tmp_path):
    path = profile.save(_profile(), tmp_path / "p.json")
    assert profile.load(path) == _profile()
    topo = presets.local(4, profile.load(path))
    assert topo.name == "local" and topo.world == 4 and topo.link_for("all_gather") == Link(1e-4, 5e8)
    # 4 ranks on 2 cores get half the core each rank had at calibration
    assert topo.device.rate("forward", "full", 256, 256) == pytest.approx(0.5e10)
    # emulated nodes: the same figures, the loopback link across "nodes" too
    split = presets.local(4, profile.load(path), nodes=2)
    assert (split.nodes, split.devices_per_node, split.name) == (2, 2, "local 2x2")
    assert split.device == topo.device and split.inter == split.intra == topo.intra
    assert presets.local(6, nodes=3).devices_per_node == 2
    for bad in (0, 5, 1.5):
        with pytest.raises(ValueError, match="nodes must be"):
            presets.local(4, nodes=bad)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d.pop("links"), "missing links"),
    (lambda d: d["links"]["sendrecv"].update(bandwidth=-1.0), "links.sendrecv.bandwidth must be > 0"),
    (lambda d: d["kernels"][0].update(kind="sparse"), r"kernels\[0\].*unknown"),
    (lambda d: d.update(overlap=2.0), "overlap must be in"),
    (lambda d: d.update(schema="other"), "schema"),
])
def test_bad_profiles_are_rejected_clearly(tmp_path, edit, message):
    data = _profile().to_json()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(profile.ProfileError, match=message) as info:
        profile.load(path)
    assert str(path) in str(info.value)


def test_unreadable_profiles_name_the_fix(tmp_path):
    with pytest.raises(profile.ProfileError, match="cpattn calibrate"):
        profile.load(tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(profile.ProfileError, match="not valid JSON"):
        profile.load(tmp_path / "junk.json")


def test_default_profile_location_is_configurable(tmp_path, monkeypatch):
    monkeypatch.setenv(profile.PROFILE_ENV, str(tmp_path / "mine.json"))
    assert profile.default_path() == tmp_path / "mine.json"
    assert profile.load_default() is None
    monkeypatch.delenv(profile.PROFILE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert profile.default_path() == tmp_path / "cpattn" / "profile.json"


@pytest.mark.slow  # runs the calibration
def test_calibration_smoke(tmp_path):
    """A tiny calibration on a real 2-rank gloo world gives a valid, usable profile."""
    prof = machine_profile.calibrate(machine_profile.QUICK)
    path = profile.save(prof, tmp_path / "p.json")
    loaded = profile.load(path)
    assert set(loaded.links) == set(machine_profile.CALIBRATED_OPS) and 0.0 <= loaded.overlap <= 1.0
    assert {(p.phase, p.kind) for p in loaded.kernels} == {(ph, k) for ph in ("forward", "backward")
                                                           for k in ("full", "causal", "partial")}
    assert estimate("ring", Problem(1024, 2, "causal", dtype="float32"), presets.local(2, loaded)).total > 0


# ------------------------------------------------------------------ schedule="auto"
@pytest.fixture
def no_profile(tmp_path, monkeypatch):
    monkeypatch.setenv(profile.PROFILE_ENV, str(tmp_path / "none.json"))


@pytest.mark.parametrize("mask", ["causal", "full", masks.sliding_window(100)])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_auto_is_deterministic_and_picks_a_supporting_schedule(no_profile, mask, world):
    mask = masks.resolve(mask)
    seq = 512 * world
    picks = {_auto_schedule(mask, seq, world, None)[0] for _ in range(3)}
    topo_picks = {_auto_schedule(mask, seq, world, preset("frontier", world))[0] for _ in range(2)}
    assert len(picks) == 1 and len(topo_picks) == 1
    for name in picks | topo_picks:
        sched = schedules.get(name)
        sched.check_mask(mask)
        Layout(sched.layout_for(mask)).check(seq, world)
        assert estimable(name)


def test_auto_skips_layouts_that_cannot_split_and_memory_hogs(no_profile):
    odd = Problem(3 * 4, 4, "causal", heads=4, kv_heads=2, head_dim=8)  # 12 tokens: no zigzag over 4 ranks
    ranked = dict(rank_schedules(odd, presets.local(4)))
    assert isinstance(ranked["zigzag_ring"], str) and "multiple of 8" in ranked["zigzag_ring"]
    problem = Problem(8 * 4096, 8, "full", heads=8, kv_heads=8, head_dim=64)
    topo = preset("dgx-h100", 8)
    ring, gather = (estimate(n, problem, topo).peak_memory for n in ("ring", "allgather"))
    assert ring < gather
    tiny = dataclasses.replace(topo, device=Device("tiny", 1e12, 1e12, 1e12, memory=(ring + gather) // 2))
    ranked = dict(rank_schedules(problem, tiny))
    assert "GiB per rank" in ranked["allgather"] and choose(problem, tiny)[0] != "allgather"


def _auto_problem(seq: int, world: int, mask) -> Problem:
    """The problem schedule="auto" estimates: the nominal shape, in the dtype of this machine's kernels."""
    return Problem(seq, world, masks.resolve(mask), dtype="bfloat16" if torch.cuda.is_available() else "float32",
                   **AUTO_SHAPE)


def test_context_parallel_auto_reports_and_logs_its_choice(no_profile, caplog):
    with caplog.at_level(logging.DEBUG, logger="cpattn.api"):
        cp = cpattn.ContextParallel(1024, "causal", schedule="auto")
    said = [re.match(r"schedule='auto' chose (\S+): (.*)", r.getMessage()) for r in caplog.records]
    said = [m for m in said if m]
    assert len(said) == 1 and said[0].group(1) == cp.schedule_name, [r.getMessage() for r in caplog.records]
    # no profile: the uncalibrated local topology; the first feasible schedule of its ranking, which runs the mask
    ranked = rank_schedules(_auto_problem(1024, 1, "causal"), presets.local(1))
    first, est = ranked[0]
    assert isinstance(est, Estimate) and cp.schedule_name == first
    assert f"{est.total * 1e3:.3g} ms" in said[0].group(2) and "(uncalibrated)" in said[0].group(2)
    schedules.get(cp.schedule_name).check_mask(masks.causal())


def test_auto_survives_a_broken_profile(tmp_path, monkeypatch, caplog):
    bad = tmp_path / "broken.json"
    bad.write_text("{}")
    monkeypatch.setenv(profile.PROFILE_ENV, str(bad))
    with caplog.at_level(logging.WARNING, logger="cpattn.api"):
        name, why = _auto_schedule(masks.causal(), 1024, 2, None)
    assert any("ignoring the calibration profile" in r.message for r in caplog.records)
    # the choice is the one on the conservative defaults, as if there were no profile at all
    first, est = rank_schedules(_auto_problem(1024, 2, "causal"), presets.local(2))[0]
    assert isinstance(est, Estimate) and name == first and "'local (uncalibrated)'" in why


# ------------------------------------------------------------------ bench --predict and simulate
def _bench_result(world: int = 2, seq: int = 2048) -> dict:
    cfg = bench.BenchConfig(world=world, seq=seq, mask="causal")
    rows = [dataclasses.asdict(bench.BenchRow(n, fwd_s=0.1 * (i + 1), fwd_bwd_s=0.3 * (i + 1)))
            for i, n in enumerate(BASELINES)]
    rows.append(dataclasses.asdict(bench.BenchRow("broken", ok=False, note="WRONG")))
    return {"config": dataclasses.asdict(cfg), "rows": rows, "baseline": {},
            "environment": {"cores": 2, "threads_per_rank": 1}}


def test_bench_predict_adds_predictions_and_the_median_error(no_profile):
    result = bench.predict(_bench_result())
    for row in result["rows"][:-1]:
        assert row["pred_fwd_bwd_s"] > 0 and row["pred_fwd_s"] > 0
        assert row["pred_error"] == pytest.approx((row["pred_fwd_bwd_s"] - row["fwd_bwd_s"]) / row["fwd_bwd_s"])
    summary = result["prediction"]
    assert summary["rows"] == len(BASELINES) and summary["median_abs_error"] >= 0
    assert bench.prediction_summary([result, bench.predict(_bench_result(4, 4096))])["rows"] == 2 * len(BASELINES)


def test_bench_predict_estimates_every_schedule_the_same_way(no_profile):
    result = _bench_result()
    result["rows"] = [dataclasses.asdict(bench.BenchRow(n, fwd_s=0.1, fwd_bwd_s=0.3)) for n in ("ultra", *HEAD_SPLIT)]
    bench.predict(result)
    assert all(r["pred_fwd_bwd_s"] > r["pred_fwd_s"] > 0 for r in result["rows"])
    assert result["prediction"]["rows"] == 3


def test_simulate_command_prints_and_plots(tmp_path, capsys):
    plot, out = tmp_path / "s.png", tmp_path / "s.json"
    rc = cli.main(["simulate", "--topology", "dgx-h100", "--gpus", "8,64", "--seq", "65536", "--mask", "causal",
                   "--heads", "8", "--kv-heads", "2", "--head-dim", "64", "--plot", str(plot), "--json", str(out)])
    assert rc == 0 and plot.stat().st_size > 1000
    rows = json.loads(out.read_text())
    assert {r["schedule"] for r in rows} >= {"ring", "zigzag_ring"}
    missing = [(r["gpus"], r["schedule"]) for r in rows if not r["estimate"]]
    assert missing == [(64, "ulysses")]  # 8 heads cannot split over 64 ranks (usp takes 8 of them)
    assert "zigzag_ring" in capsys.readouterr().out


def test_simulate_says_why_a_schedule_is_far_slower_than_ring(capsys):
    """A schedule predicted hundreds of times ring's time (RingX's per-owner collectives over thousands
    of GPUs) prints its ratio with two significant digits, never "0.00x", and a note with the reason:
    its exposed communication and the collectives its steps() issue over the whole group."""
    from dataclasses import replace

    from rich.console import Console

    from cpattn.cli import simulate

    problem, topo = Problem(4096, 8, "causal", 1, 8, 2, 64), presets.preset("frontier", 8)
    ring = estimate("ring", problem, topo)
    slow = replace(estimate("ringx4", problem, topo), total=250 * ring.total, exposed_comm=249 * ring.total)
    rows = [{"gpus": 8, "seq": 4096, "schedule": "ring", "estimate": ring, "note": ""},
            {"gpus": 8, "seq": 4096, "schedule": "ringx4", "estimate": slow, "note": ""}]
    simulate._explain_slow(rows, problem, topo, "forward+backward", 1.0)
    assert rows[0]["note"] == ""
    note = rows[1]["note"]
    assert "ringx4 predicts 250x ring's time at 8 GPUs (vs ring 0.004x, not zero): 99.6% of" in note
    assert "broadcast" in note and "reduce" in note and "over the 8 GPUs" in note and "--algorithm tree" in note
    console = Console(width=400, file=io.StringIO(), color_system=None)
    simulate._print_times(console, rows, "title")
    text = console.file.getvalue()
    assert "0.004x" in text and "0.00x" not in text and "ringx4 predicts 250x" in text


def test_auto_with_a_nominal_shape_does_not_refuse_for_memory():
    """schedule="auto" sees only a stand-in shape: when nothing fits for it, it takes the leanest
    schedule (the user's real shape may fit) instead of raising; an explicit problem still raises."""
    big = Problem(1 << 20, 1, masks.causal(), heads=32, kv_heads=8, head_dim=128)
    topo = presets.local(1)
    with pytest.raises(ValueError, match="no registered schedule"):
        choose(big, topo)
    name, why = choose(big, topo, nominal_shape=True)
    ranked = rank_schedules(big, topo)
    over = [n for n, r in ranked if isinstance(r, str) and "GiB per rank" in r]
    assert over and not any(isinstance(r, Estimate) for _, r in ranked)  # every candidate is over the memory
    peaks = {n: estimate(n, big, topo).peak_memory for n in over}
    assert name in over and peaks[name] == min(peaks.values()), (name, peaks)
    assert f"{name} needs the least" in why
    schedules.get(name).check_mask(big.mask)


def test_shared_cores_time_steps_by_processor_sharing():
    """Ranks sharing CPU cores: a balanced step takes the device's time, an unbalanced one less than its
    busiest rank at the all-busy share, because idle ranks leave their cores to the busy ones."""
    from cpattn.cost.estimate import shared_compute
    shared = Topology(1, 4, cores=2.0, threads_per_rank=1)
    assert shared_compute([(1.0, 4)], shared) == pytest.approx(1.0)
    assert shared_compute([(2.0, 1), (0.0, 3)], shared) == pytest.approx(1.0)  # alone: a whole core, not half
    assert shared_compute([(2.0, 3), (0.0, 1)], shared) == pytest.approx(1.5)  # 3 ranks on 2 cores
    assert shared_compute([(2.0, 1), (1.0, 3)], shared) == pytest.approx(1.5)  # 1.0 all busy, then 0.5 alone
    assert shared_compute([(2.0, 1), (1.0, 3)], Topology(1, 4)) == 2.0  # a device per rank: the busiest
    assert shared_compute([], shared) == 0.0
    two_threads = Topology(1, 2, cores=2.0, threads_per_rank=1)
    assert shared_compute([(2.0, 1), (0.0, 1)], two_threads) == 2.0  # one thread per rank: no speed-up alone
    with pytest.raises(ValueError, match="cores"):
        Topology(1, 2, cores=-1.0)
    with pytest.raises(ValueError, match="threads_per_rank"):
        Topology(1, 2, cores=2.0, threads_per_rank=0)
    local4 = presets.local(4, _profile(), cores=2)
    assert (local4.cores, local4.threads_per_rank) == (2.0, 1)
    assert presets.local(1, _profile(), cores=2).threads_per_rank == 2


class _Rank:
    """A communicator stand-in with only what block lists read: this rank and the world size."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size = rank, world


PRICED_MASKS = {"causal": masks.causal(), "full": masks.full(), "document": masks.document([50, 101, 1, 88]),
                "window": masks.sliding_window(37), "bidirectional": masks.document([120, 120], causal=False)}


def _accepts(sched: Schedule, mask) -> bool:
    try:
        sched.check_mask(mask)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("name,mask", [(n, m) for n in schedules.names() if schedules.get(n).make_plan is None
                                       for m in PRICED_MASKS if _accepts(schedules.get(n), PRICED_MASKS[m])])
def test_priced_work_is_what_the_executor_runs(name, mask):
    """One declaration of compute: each step's ``work`` (what the cost model times) is priced from its
    compute actions' sources, and equals, rank by rank, the kernels of the blocks those sources name on
    that rank through ``blocks_of``, the executor's own resolution (closed forms or not)."""
    from cpattn.core.executor import Runtime
    from cpattn.core.steps import Kernel, distribution, sources, work

    sched, the_mask = schedules.get(name), PRICED_MASKS[mask]
    for world, seq in ((1, 240), (2, 240), (3, 234), (4, 240)):
        problem = Problem(seq, world, the_mask, heads=8, kv_heads=2, head_dim=8, padded_len=240 + -240 % (2 * world))
        if name in HEAD_SPLIT and 8 % world:
            continue
        layout = problem.layout_or(sched.layout_for(the_mask))
        runtimes = [Runtime(_Rank(r, world), the_mask, layout, problem.padded_len, seq_len=seq) for r in range(world)]
        for phase in ("forward", "backward"):
            for step in sched.program(problem, phase):
                def kernels(rt, step=step):
                    for src in sources(step):
                        heads = (src[3], src[4]) if src[0] == "groups" else (0, 0)
                        for b in sched.blocks_of(rt, src) or ():
                            yield Kernel(b.kind.value, b.q.stop - b.q.start, b.kv.stop - b.kv.start, b.area,
                                         *heads), 1
                want = distribution(work(kernels(rt)) for rt in runtimes) if sources(step) else ()
                assert step.work == want, (name, world, phase)
