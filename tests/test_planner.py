"""UltraAttn planner (pure, no process group): block tables, the partition ILP and its greedy fallback,
tiling at node / device / kernel level, routing, the kernel graph and its schedule, plans as JSON and
their cache, and the ``cpattn plan`` command."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import sys

import pytest

from cpattn import cli, masks
from cpattn.core.steps import Kernel
from cpattn.cost import Problem, Topology, simulate
from cpattn.planner import PlanOptions, build_plan, get_plan, load_plan, request, save_plan, validate
from cpattn.planner import block_table as bt
from cpattn.planner.kernel_graph import build as build_graph
from cpattn.planner.kernel_graph import route
from cpattn.planner.messages import Sizes
from cpattn.planner.model import SCHEMA_VERSION, Plan, PlanVersionError
from cpattn.planner.partition_ilp import (
    MessageUnits,
    PartitionProblem,
    check,
    greedy,
    load_bound,
    loads,
    solve,
    traffic,
)
from cpattn.planner.pricing import Pricing
from cpattn.planner.schedule_ilp import schedule
from cpattn.planner.tiling import allocate, fuse, fuse_all, owners

FAST = PlanOptions(time_budget=1.0, partition_time_limit=0.5, schedule_time_limit=0.5)


def _level(table: bt.BlockTable, devices: int, phase: str = "forward", heads: int = 4, kv_heads: int = 4,
           eps: float = 0.1) -> PartitionProblem:
    """The flat (one level) partition problem of ``table`` with contiguous ownership."""
    owner = dict(enumerate(owners(table.n, devices)))
    cells = table.cells()
    pinned = {c: owner[i] for c, (i, j) in enumerate(cells) if i == j}
    return PartitionProblem(devices, tuple(cells), tuple(table.work(i, j) for i, j in cells), owner, owner, pinned,
                            MessageUnits.for_phase(phase, heads, kv_heads), eps)


def _random_table(rng: random.Random, n: int, chunk: int = 4) -> bt.BlockTable:
    """Causal diagonal plus random full / empty cells elsewhere (a custom block table)."""
    rows = ["".join("\\" if i == j else ("#" if rng.random() < 0.4 else ".") for j in range(n)) for i in range(n)]
    return bt.from_pattern(rows, chunk)


# ------------------------------------------------------------------------------------ block table
def test_block_table_kinds_weights_and_digest():
    table = bt.build(masks.causal(), 64, 4)
    assert table.render().splitlines() == ["\\...", "#\\..", "##\\.", "###\\"]
    assert table.work(1, 0) == bt.WORK_UNIT and table.work(1, 1) == bt.WORK_UNIT // 2 and table.work(0, 1) == 0
    assert sum(table.work(i, j) for i, j in table.cells()) == 6 * bt.WORK_UNIT + 4 * bt.WORK_UNIT // 2
    assert bt.BlockTable.from_dict(json.loads(json.dumps(table.as_dict()))) == table
    assert table.digest() == bt.build(masks.causal(), 64, 4).digest() != bt.build(masks.full(), 64, 4).digest()


def test_block_table_partial_cells_count_allowed_pairs():
    mask = masks.sliding_window(9)
    table = bt.build(mask, 32, 4)
    dense = mask.dense(0, 32, 0, 32)
    for i, j in table.cells():
        assert table.area[i * 4 + j] == int(dense[i * 8:(i + 1) * 8, j * 8:(j + 1) * 8].sum())
    assert {table.kind(i, j) for i, j in table.cells()} == {"causal", "partial"}
    assert table.work(1, 0) == round(bt.WORK_UNIT * table.area[4] / 64)


@pytest.mark.parametrize("mask", [masks.causal(), masks.full(), masks.sliding_window(20), masks.strided(8, 3),
                                  masks.global_local(8, 1, 2), masks.star(16, 1), masks.block_table(
                                      [[2, 0, 0, 0], [2, 2, 0, 0], [1, 0, 2, 0], [0, 1, 1, 2]], 16)])
def test_coarsened_table_equals_the_table_built_coarse(mask):
    fine = bt.build(mask, 64, 16, valid_len=60)
    for r in (1, 2, 4):
        assert fine.coarsen(r) == bt.build(mask, 64, 16 // r, valid_len=60)


def test_block_table_padding_and_errors():
    padded = bt.build(masks.causal(), 64, 4, valid_len=56)  # 16-token chunks; the last 8 positions pad
    assert padded.kind(3, 3) == "partial" and padded.area[15] == 8 * 9 // 2
    assert padded.kind(3, 0) == "partial" and padded.area[12] == 8 * 16
    with pytest.raises(ValueError, match="equal chunks"):
        bt.build(masks.causal(), 30, 4)
    with pytest.raises(ValueError, match="area"):
        bt.BlockTable(2, 4, ("full", "empty", "full", "full"), (15, 0, 16, 16))


# ------------------------------------------------------------------------------------ partition ILP
def test_traffic_counts_the_message_units():
    """Two devices, cell (0, 1) on device 0: it fetches column 1 (KV, 2 units x h_kv/h) and device 1
    sends it; forward in = A + C + 2B, out = A + C + 2D."""
    table = bt.from_pattern(["##", ".#"], 4)
    problem = _level(table, 2, heads=4, kv_heads=2)
    ins, outs = traffic(problem, [0, 0, 1])  # cells (0,0), (0,1), (1,1)
    assert ins == [2 * 2, 0] and outs == [0, 2 * 2]
    back = dataclasses.replace(problem, units=MessageUnits.for_phase("backward", 4, 2))
    ins, outs = traffic(back, [0, 0, 1])  # backward: in = 2A + 2B + C + 2D, out = A + 2B + 2C + 2D
    assert ins == [4, 4] and outs == [4, 4]


@pytest.mark.parametrize("seed", range(4))
def test_ilp_meets_its_constraints_and_beats_greedy(seed):
    rng = random.Random(seed)
    table = _random_table(rng, 8)
    for phase, devices in (("forward", 4), ("backward", 2)):
        problem = _level(table, devices, phase, heads=8, kv_heads=rng.choice([2, 8]))
        g = greedy(problem)
        s = solve(problem, time_limit=1.0, seed=seed)
        for part in (g, s):
            check(problem, part)  # every cell once, pins kept, load bound met
            assert len(part.assign) == len(problem.cells)
            assert max(loads(problem, part.assign)) <= load_bound(problem) == part.bound
            assert part.v == max(traffic(problem, part.assign)[0] + traffic(problem, part.assign)[1])
        assert s.method == "cp-sat" and s.v <= g.v == s.greedy_v


def test_ilp_finds_the_grid_optimum_for_full_attention():
    """P = 4, full mask, 2 chunks per rank: the ILP's optimum equals the best 2-D grid's traffic."""
    table = bt.build(masks.full(), 64, 8)
    problem = _level(table, 4)
    best = solve(problem, time_limit=5.0)
    levels = allocate(table, Topology(1, 4), problem.units, node_chunk=8)
    assert best.status == "OPTIMAL"
    assert levels.reports[0]["method"] == "closed-form" and levels.reports[0]["v"] == best.v


def test_solver_is_deterministic_and_reports_fallbacks():
    problem = _level(_random_table(random.Random(7), 8), 4)
    a, b = solve(problem, time_limit=0.5), solve(problem, time_limit=0.5)
    assert a.assign == b.assign
    trivial = _level(bt.from_pattern(["\\.", ".\\"], 4), 2)
    assert solve(trivial).status.startswith("trivial")


def test_greedy_fallback_without_ortools_is_reported(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)  # the import fails as if not installed
    problem = _level(_random_table(random.Random(3), 8), 4)
    with caplog.at_level(logging.WARNING):
        part = solve(problem, time_limit=0.5)
        plan = _plan("causal", Topology(1, 4))
    assert part.method == "greedy" and part.status == "greedy: OR-Tools is not installed"
    assert "OR-Tools is not installed" in caplog.text
    assert plan.forward.levels[0]["status"] == "greedy: OR-Tools is not installed"
    assert plan.forward.scheduler["method"] == "greedy" and "OR-Tools" in plan.forward.scheduler["status"]


def test_load_bound_relaxes_to_a_feasible_placement():
    """Causal, 4 chunks over 4 devices: cells are too coarse for a 10 % bound; the LPT makespan is used."""
    problem = _level(bt.build(masks.causal(), 64, 4), 4)
    total = sum(problem.work)
    assert load_bound(problem) > 1.1 * total / 4
    check(problem, solve(problem, time_limit=0.5))


# ------------------------------------------------------------------------------------ tiling
def test_hierarchy_places_every_cell_and_pins_the_diagonal():
    table = bt.build(masks.causal(), 128, 16)
    topo = Topology(2, 4)
    levels = allocate(table, topo, MessageUnits.for_phase("forward", 4, 4), node_chunk=4, time_limit=0.3)
    assert set(levels.assign) == set(table.cells())
    assert all(levels.assign[(i, i)] == i // 2 for i in range(16))
    assert [r["level"] for r in levels.reports] == ["node", "device", "device"]


def test_grid_for_full_attention_at_both_levels():
    table = bt.build(masks.full(), 128, 8)
    levels = allocate(table, Topology(2, 4), MessageUnits.for_phase("forward", 8, 2), node_chunk=4)
    assert all(r["method"] == "closed-form" for r in levels.reports)
    per_rank = [sum(1 for g in levels.assign.values() if g == r) for r in range(8)]
    assert per_rank == [8] * 8


def test_kernel_fusion_covers_each_cell_once_under_the_bound():
    table = bt.build(masks.causal(), 64, 8)
    assign = {(i, j): i // 4 for i, j in table.cells()}  # two ranks, each its own rows
    for bound in (1, 2, 4, 64):
        kernels = fuse_all(table, assign, 2, bound)
        cells = [c for kn in kernels for c in kn.cells(table)]
        assert sorted(cells) == sorted(table.cells())
        assert all(kn.kind == "causal" or len(kn.rows) * len(kn.cols) <= bound for kn in kernels)
    big = fuse(table, assign, 1, 64)
    assert (big[0].rows, big[0].cols, big[0].kind) == ((4, 5, 6, 7), (0, 1, 2, 3), "full")
    assert any(kn.kind == "causal" and kn.rows == (4, 5, 6, 7) for kn in big)


def test_routing_is_rail_aligned_and_returns_partials_home():
    topo = Topology(2, 2)
    table = bt.build(masks.full(), 32, 4)
    owner = owners(4, 4)
    assign = {(i, j): (i + 2) % 4 for i, j in table.cells()}  # every row computed on the other node
    kernels = fuse_all(table, assign, 4, 1)
    transfers = route("forward", kernels, owner, topo)
    for t in transfers:  # across nodes only between devices of the same local index (one rail)
        if topo.node_of(t.src) != topo.node_of(t.dst):
            assert topo.local_index(t.src) == topo.local_index(t.dst)
    for kn in kernels:  # every partial output reaches its owner, hop by hop
        for i in kn.rows:
            at = kn.device
            while at != owner[i]:
                (hop,) = [t for t in transfers if t.item == "o" and t.chunk == i and t.src == at]
                at = hop.dst
    q_in = [t for t in transfers if t.item == "q"]
    assert len(q_in) == len({(t.chunk, t.dst) for t in q_in})  # a row arrives once per device


# ------------------------------------------------------------------------------------ plans
def _plan(mask, topo: Topology, seq: int = 64, options: PlanOptions = FAST) -> Plan:
    """A plan for batch 2, 4 query heads, 2 key/value heads, head_dim 8, float32."""
    return build_plan(request(mask, seq, topo, 2, 4, 2, 8, "float32", options))


@pytest.mark.parametrize("mask", ["causal", "full", {"kind": "star", "block_size": 8, "sink": 1},
                                  {"kind": "strided", "block_size": 4, "stride": 3}])
def test_plan_is_valid_and_round_trips(mask):
    plan = _plan(mask, Topology(2, 2), 64)
    validate(plan)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    sizes = plan.sizes(2, 4, 2, 8, 4, 4)
    for phase in ("forward", "backward"):
        ph = plan.phase(phase)
        sent = sum(plan.volume(r, sizes)[phase].get("send", {}).get("bytes_sent", 0) for r in range(4))
        recv = sum(plan.volume(r, sizes)[phase].get("recv", {}).get("bytes_recv", 0) for r in range(4))
        assert sent == recv == sum(sizes.item_bytes(t.item) for t in ph.transfers)
        assert ph.predicted > 0


def _without_timings(plan: Plan) -> dict:
    data = json.loads(plan.to_json())
    data["seconds"] = 0
    for ph in data["phases"].values():
        for report in ph["levels"]:
            report["seconds"] = 0
        ph["scheduler"]["seconds"] = 0
    return data


def test_plans_are_identical_when_rebuilt():
    """Deterministic solver settings: every rank could rebuild the same plan (they also get rank 0's)."""
    assert _without_timings(_plan("causal", Topology(1, 4))) == _without_timings(_plan("causal", Topology(1, 4)))


def test_validation_rejects_broken_plans():
    plan = _plan("causal", Topology(1, 2))
    data = json.loads(plan.to_json())
    twice = json.loads(plan.to_json())
    twice["phases"]["forward"]["kernels"].append(twice["phases"]["forward"]["kernels"][0])
    with pytest.raises(ValueError, match="computed 2 times|computes cell"):
        Plan.from_json(json.dumps(twice))
    reversed_ops = json.loads(plan.to_json())
    reversed_ops["phases"]["forward"]["ops"] = [ops[::-1] for ops in data["phases"]["forward"]["ops"]]
    with pytest.raises(ValueError, match="before"):
        Plan.from_json(json.dumps(reversed_ops))
    with pytest.raises(PlanVersionError, match=f"format version {SCHEMA_VERSION + 1}, this cpattn reads"):
        Plan.from_json(json.dumps(dict(data, version=SCHEMA_VERSION + 1)))
    with pytest.raises(ValueError, match="not JSON"):
        Plan.from_json(plan.to_json()[:-5])


def test_deadlock_check_catches_crossed_waits():
    """Every rank computes (waiting for the other's message) before posting its own sends."""
    plan = _plan("full", Topology(1, 2))
    ph = plan.forward
    assert any(op.kind == "compute" and op.deps for op in ph.ops[0])
    ops = tuple(tuple([o for o in r if o.kind != "send"] + [o for o in r if o.kind == "send"]) for r in ph.ops)
    with pytest.raises(ValueError, match="forever"):
        validate(dataclasses.replace(plan, forward=dataclasses.replace(ph, ops=ops)))


def test_cache_rebuilds_corrupt_and_stale_files(tmp_path, caplog):
    req = request("causal", 64, Topology(1, 2), 1, 4, 4, 8, "float32", FAST)
    first = get_plan(req, directory=tmp_path)
    path = tmp_path / f"{req.digest()}.json"
    assert path.exists() and load_plan(path) == first
    assert get_plan(req, directory=tmp_path) == first  # from the cache
    path.write_text(path.read_text()[:-20])  # truncated
    with caplog.at_level(logging.WARNING, logger="cpattn.planner.cache"):
        rebuilt = get_plan(req, directory=tmp_path)
    assert "rebuilding" in caplog.text and load_plan(path) == rebuilt
    other = request("full", 64, Topology(1, 2), 1, 4, 4, 8, "float32", FAST)
    save_plan(get_plan(other, cache=False), path)  # a valid plan, but for another problem
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cpattn.planner.cache"):
        assert get_plan(req, directory=tmp_path).key == req.key()
    assert "stale" in caplog.text


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    from cpattn.planner import cache_dir

    monkeypatch.setenv("CPATTN_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("CPATTN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "cpattn" / "plans"


def test_greedy_only_plans_say_so():
    plan = _plan("causal", Topology(2, 2), options=dataclasses.replace(FAST, use_solver=False))
    assert plan.forward.scheduler["method"] == "greedy"
    assert all(r["method"] in ("greedy", "closed-form") for r in plan.forward.levels)


def test_request_errors_name_the_argument():
    with pytest.raises(ValueError, match="multiple of the world"):
        request("causal", 30, Topology(1, 4))
    with pytest.raises(ValueError, match="kv_heads"):
        request("causal", 32, Topology(1, 4), heads=6, kv_heads=4)
    with pytest.raises(ValueError, match="dtype"):
        request("causal", 32, Topology(1, 4), dtype="int8")


# ------------------------------------------------------------------------------------ schedule
def test_cpsat_schedule_is_no_longer_than_greedy():
    req = request("causal", 64, Topology(2, 2), 2, 4, 2, 8, "float32", FAST)
    plan = build_plan(req)
    problem = Problem(64, 4, "causal", 2, 4, 2, 8, "float32")
    pricing = Pricing(req.mask, 64, req.valid_len, req.order, req.topology.device, problem)
    graph = build_graph("forward", req.table, list(plan.forward.kernels), list(plan.owner), req.topology,
                        Sizes(2, req.table.chunk, 4, 2, 8, 4, 4), pricing)
    greedy_makespan = simulate(graph.tasks).makespan
    result = schedule(graph.tasks, time_limit=1.0)
    assert result.timeline.makespan <= greedy_makespan + 1e-12
    assert result.greedy_makespan == pytest.approx(greedy_makespan)


# ------------------------------------------------------------------------------------ CLI
def test_plan_command_prints_and_draws(tmp_path, capsys):
    heat, line, js = tmp_path / "heat.png", tmp_path / "line.png", tmp_path / "plan.json"
    rc = cli.main(["plan", "--topology", "2x2", "--gpus", "4", "--seq", "256", "--heads", "4", "--kv-heads", "2",
                   "--head-dim", "16", "--mask", '{"kind": "streaming", "sink": 16, "window": 2, "block_size": 16}',
                   "--time-budget", "1", "--cache-dir", str(tmp_path), "--heatmap", str(heat), "--timeline",
                   str(line), "--json", str(js)])
    out = capsys.readouterr().out
    assert rc == 0 and "predicted ms" in out and "forward placement" in out
    assert heat.stat().st_size > 1000 and line.stat().st_size > 1000
    assert load_plan(js).world == 4
    assert "owner map: contiguous" in out


@pytest.mark.parametrize("owner_map,expected", [("auto", "owner map: round-robin, 4 pieces"),
                                                ("contiguous", "owner map: contiguous")])
def test_plan_command_shows_the_owner_map(tmp_path, capsys, owner_map, expected):
    rc = cli.main(["plan", "--topology", "2x2", "--gpus", "4", "--seq", "256", "--heads", "4", "--kv-heads", "2",
                   "--head-dim", "16", "--mask", '{"kind": "strided", "block_size": 16, "stride": 4}',
                   "--time-budget", "1", "--no-cache", "--heatmap", "", "--timeline", "", "--owner-map", owner_map])
    assert rc == 0 and expected in capsys.readouterr().out


# ---------------------------------------------------------------------------------- owner maps
@pytest.mark.parametrize("spec", [
    {"kind": "strided", "block_size": 8, "stride": 3}, {"kind": "document", "lengths": [5, 40, 19]},
    {"kind": "global_local", "block_size": 8, "global_blocks": 1, "local_blocks": 2}, "causal",
    {"kind": "sliding_window", "window": 13, "causal": False},
])
def test_permuted_table_equals_the_mask_read_in_the_ranks_order(spec):
    """Permuting a block table piecewise agrees with classifying, pair by pair, the mask over the
    reordered sequence (an independent path: a mask_mod on gathered positions, classified densely)."""
    import torch
    from cpattn.layout import Layout, from_pieces, pieces

    base, seq, world = masks.resolve(spec), 64, 4
    rng = random.Random(str(spec))
    order = list(range(8))
    rng.shuffle(order)
    layout = from_pieces(tuple(order), seq, world, "shuffled")
    piece, got_order = pieces(layout, seq, world)
    assert (piece, got_order) == (8, tuple(order))
    pos = torch.cat([layout.positions(seq, world, r) for r in range(world)])
    reordered = masks.from_mask_mod(lambda q, k: base.mask_mod(pos[q], pos[k]), name="reordered")
    for n in (8, 16):
        assert bt.permute(bt.build(base, seq, n), tuple(order)) == bt.build(reordered, seq, n)
    assert pieces(Layout("zigzag"), seq, world) == (8, (0, 7, 1, 6, 2, 5, 3, 4))
    assert pieces(Layout("contiguous"), seq, world) == (16, (0, 1, 2, 3))


def test_owner_map_choice():
    from cpattn.planner import choose_order

    rr = (0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)
    assert choose_order({"kind": "strided", "block_size": 1024, "stride": 4}, 16384, 4) == rr
    for spec in ("causal", "full", {"kind": "sliding_window", "window": 3000},
                 {"kind": "global_local", "block_size": 1024, "global_blocks": 1, "local_blocks": 2},
                 {"kind": "streaming", "block_size": 1024, "sink": 1, "window": 3}):
        assert choose_order(spec, 16384, 4) is None, spec
    assert choose_order({"kind": "strided", "block_size": 1024, "stride": 4}, 16384, 1) is None
    assert choose_order("causal", 64, 4) is None  # pieces would be under min_chunk_tokens


def test_plans_on_owner_maps_map_back_and_validate():
    mask = {"kind": "strided", "block_size": 16, "stride": 4}
    order = (0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)
    plan = build_plan(request(mask, 256, Topology(2, 2), 1, 4, 2, 8, "float32", FAST, order=order))
    assert plan.order == order and not plan.forward.transfers and not plan.backward.transfers
    chunk = plan.table.chunk
    covered = sorted(r for i in range(plan.table.n) for r in plan.source_ranges(i))
    assert covered[0][0] == 0 and covered[-1][1] == 256 and all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    # plan chunk 1 holds the ranks' second piece onwards: original pieces 4, 8, ... in that order
    first = plan.source_ranges(1)[0]
    assert first == (16 * order[chunk // 16], 16 * order[chunk // 16] + 16)
    assert sum(b - a for a, b in plan.source_ranges(1)) == chunk
    assert Plan.from_json(plan.to_json()).order == order
    for bad in ([1, 1, 2, 3], list(range(16))):  # not a permutation; the identity is stored as None
        data = json.loads(plan.to_json())
        data["key"]["order"] = bad
        with pytest.raises(ValueError, match="order"):
            Plan.from_json(json.dumps(data))
    with pytest.raises(ValueError, match="order must be a permutation"):
        request(mask, 256, Topology(2, 2), order=(0, 1, 2))
    assert request(mask, 256, Topology(2, 2), order=tuple(range(8))).order is None


def test_validation_requires_one_order_per_pair_of_ranks():
    """Directed orders alone are not enough on NCCL: a rank that posts a send to a peer before a receive
    from it, where the peer posts them the other way round, is rejected."""
    mask = {"kind": "global_local", "block_size": 16, "global_blocks": 1, "local_blocks": 2}
    plan = build_plan(request(mask, 128, Topology(1, 2), 1, 4, 2, 8, "float32", FAST))
    for name in ("forward", "backward"):
        for r in (0, 1):
            data = json.loads(plan.to_json())
            ops = data["phases"][name]["ops"][r]
            for y, op in enumerate(ops):  # a send that waits on nothing, after a receive from the same peer
                if op[0] != "send" or op[4]:
                    continue
                before = [x for x in range(y) if ops[x][0] in ("send", "recv")]
                if before and ops[before[-1]][0] == "recv":
                    ops.insert(before[-1], ops.pop(y))  # the send moves just ahead of that receive
                    with pytest.raises(ValueError, match="different orders"):
                        Plan.from_json(json.dumps(data))
                    return
    pytest.fail("no receive followed by an independent send in this plan")


# ------------------------------------------------------------------------------------ pricing
def test_a_partial_cell_is_priced_as_the_cover_the_executor_runs():
    """A 512-token cell holding four 128-token documents runs as four causal 128-token pieces in one
    stacked call: four piece times, one launch. The dense masked rectangle would cost far more."""
    topo = Topology(1, 2)
    mask = masks.document([128] * 8)
    problem = Problem(1024, 2, mask, 1, 8, 2, 64, "float32")
    pricing = Pricing(mask, 1024, 1024, None, topo.device, problem)
    table = bt.build(mask, 1024, 2)
    assert table.kind(0, 0) == "partial"
    dev = topo.device
    for phase in ("forward", "backward"):
        piece = dev.kernel_time(Kernel("causal", 128, 128, 128 * 129 // 2), problem, phase)
        assert pricing.seconds(table, "partial", (0,), (0,), phase) == pytest.approx(4 * piece - 3 * dev.launch)
        dense = dev.kernel_time(Kernel("partial", 512, 512, table.area[0]), problem, phase)
        assert pricing.seconds(table, "partial", (0,), (0,), phase) < dense / 2
    with pytest.raises(ValueError, match="one cell"):
        pricing.seconds(table, "partial", (0, 1), (0,), "forward")
    # a mask without a cover of its own keeps the one masked rectangle's price
    unstructured = masks.from_mask_mod(lambda q, k: (q >= k) & ((q - k) % 3 == 0))
    table = bt.build(unstructured, 1024, 2)
    plain = Pricing(unstructured, 1024, 1024, None, topo.device, problem)
    assert table.kind(0, 0) == "partial" and not plain.structured and pricing.structured
    assert plain.seconds(table, "partial", (0,), (0,), "forward") == pytest.approx(
        dev.kernel_time(Kernel("partial", 512, 512, table.area[0]), problem, "forward"))


def test_a_partial_cell_of_a_reordered_table_is_priced_at_its_original_tokens():
    """Under a piece order the table's chunk i is other tokens: the cover is taken over them."""
    mask = masks.document([24, 40, 64])
    order = (1, 0)  # the second half of the sequence first
    topo = Topology(1, 2)
    problem = Problem(128, 2, mask, 1, 8, 2, 64, "float32")
    table = bt.permute(bt.build(mask, 128, 2), order)
    reordered = Pricing(mask, 128, 128, order, topo.device, problem)
    plain = Pricing(mask, 128, 128, None, topo.device, problem)
    # the second chunk of the reordered table is tokens 0..64 (documents 24 and 40): partial there
    assert table.kind(1, 1) == "partial"
    assert reordered.seconds(table, "partial", (1,), (1,), "forward") == pytest.approx(
        plain.cell(64, 0, 0, "forward"))
