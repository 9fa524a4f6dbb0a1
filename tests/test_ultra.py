"""The ``ultra`` schedule on real gloo worlds: exact forward and backward (out, lse, dq, dk, dv against
float64) for every mask kind, at P = 2, 4 (2 nodes x 2 devices) and 8 (2 x 4), MHA and GQA; measured
communication equal to the plan's volume; on every rank, the plan of its problem.

The functions at the top run on the workers (the spawned ranks import this module)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from cpattn import exactness

#: planner settings for the tests: small solver budgets (plans are still exact, only less tuned)
TEST_OPTIONS = {"time_budget": 1.0, "partition_time_limit": 0.3, "schedule_time_limit": 0.3}
MASKS = ("causal", "full", "sliding_window", "document", "strided", "global_local", "star", "streaming",
         "block_table")
PLACES = ((2, None), (4, (2, 2)), (8, (2, 4)))  # (world, (nodes, devices per node))


# ---------------------------------------------------------------------------------- worker side
def _ultra():
    """The schedule object the tests run: ``ultra`` with :data:`TEST_OPTIONS`."""
    from cpattn.planner import PlanOptions
    from cpattn.schedules import Ultra

    return Ultra(plan_options=PlanOptions(**TEST_OPTIONS))


def plan_received(seq: int, mask: dict, topology: tuple[int, int]) -> dict:
    """The plan this rank runs for the problem (q: 4 heads, k: 2, head dim 8, float32), as a dict."""
    import cpattn
    from cpattn.core.topology import Topology

    cp = cpattn.ContextParallel(seq, mask, _ultra(), topology=Topology(*topology), layout="contiguous")
    q = torch.zeros(1, cp.local_len, 4, 8)
    return cp.plan(q, q[:, :, :2]).as_dict()


def fitted_layout_run(seq: int, mask: dict, topology: tuple[int, int] | None) -> dict:
    """This rank's layout name and bytes sent in one forward + backward of ``ultra`` with the layout it
    picks itself."""
    import cpattn
    from cpattn.core.topology import Topology

    cp = cpattn.ContextParallel(seq, mask, _ultra(), topology=None if topology is None else Topology(*topology))
    q, k, v = (torch.randn(1, cp.local_len, h, 8, requires_grad=True) for h in (4, 2, 2))
    cp.attention(q, k, v).sum().backward()
    return {"layout": cp.layout.name, "sent": cp.comm_stats()["total"]["bytes_sent"]}


# ---------------------------------------------------------------------------------- parent side
@pytest.fixture(scope="module")
def ultra_worlds(worlds):
    """The session's worlds (plans go to the session's throw-away cache, see conftest)."""
    return worlds


def _case(*args, **kwargs) -> exactness.Case:
    return exactness.Case("ultra", *args, options={"plan_options": TEST_OPTIONS}, **kwargs)


def _random_table(seed: int, n: int) -> list[list[int]]:
    """A custom block table: causal diagonal, random full (1), causal (2) and empty (0) cells below."""
    rng = random.Random(seed)
    return [[2 if i == j else rng.choice([0, 0, 1, 2]) if j < i else 0 for j in range(n)] for i in range(n)]


def _cases() -> list[exactness.Case]:
    cases = []
    heads = ((4, 4), (8, 2))
    for n, (world, topo) in enumerate(PLACES):
        for m, mask in enumerate(MASKS):
            h, hkv = heads[(n + m) % 2]
            cases.append(_case(world, mask, "float32", heads=h, kv_heads=hkv, head_dim=8, seq=64,
                                     topology=topo, mask_args=exactness.example_mask_args(mask, 64), seed=n * 10 + m))
        table = _random_table(world, 16)
        cases.append(_case(world, "block_table", "float32", heads=8, kv_heads=2, head_dim=8, seq=128,
                                 topology=topo, mask_args={"table": table, "block_size": 8}, seed=100 + world))
    return cases


CASES = _cases()


#: 8 ranks: the first mask in ``make test``, the others in the slow suite
FAST = [c for c in CASES if c.world < 8] + [next(c for c in CASES if c.world == 8)]


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CASES],
                         ids=[c.label[:90] for c in CASES])
def test_ultra_is_exact(ultra_worlds, case):
    result = exactness.run(ultra_worlds.get(case.world), case)
    assert result.passed, result.describe()


@pytest.mark.parametrize("case", [
    _case(4, "causal", "bfloat16", heads=8, kv_heads=2, seq=64, topology=(2, 2), seed=201),
    _case(4, "streaming", "float32", heads=4, kv_heads=4, seq=62, topology=(2, 2), seed=202,
                mask_args={"sink": 3, "window": 10}),  # 62 tokens: padded to 64 inside ContextParallel
    _case(2, "causal", "float32", seq=64, backend="math", seed=203),
], ids=lambda c: c.label[:90])
def test_ultra_dtypes_padding_and_backends(ultra_worlds, case):
    result = exactness.run(ultra_worlds.get(case.world), case)
    assert result.passed, result.describe()


def _without_timings(x):
    """A plan's dict without the wall-clock seconds the planner records (the rest is deterministic)."""
    if isinstance(x, dict):
        return {k: _without_timings(v) for k, v in x.items() if k != "seconds"}
    if isinstance(x, (list, tuple)):
        return [_without_timings(v) for v in x]
    return x


def test_every_rank_runs_the_plan_of_its_problem(ultra_worlds):
    """Each rank's plan equals one built here, independently, from the same inputs (the planner is
    deterministic): rank 0 planned the right problem and every rank received it whole. A plan text that
    arrives cut short or altered is rejected, not run."""
    from cpattn.core.topology import Topology
    from cpattn.planner import Plan, PlanOptions, build_plan, request

    mask = {"kind": "strided", "block_size": 8, "stride": 3}
    got = ultra_worlds.get(4).run(plan_received, seq=128, mask=mask, topology=(2, 2))
    want = build_plan(request(mask, 128, Topology(2, 2), batch=1, heads=4, kv_heads=2, head_dim=8, dtype="float32",
                              options=PlanOptions(**TEST_OPTIONS), valid_len=128))
    assert want.forward.transfers and want.backward.transfers  # a plan with traffic, not a trivial one
    assert [_without_timings(r) for r in got] == [_without_timings(want.as_dict())] * 4
    text = want.to_json()
    bad = json.loads(text)
    bad["phases"]["forward"]["transfers"].pop()
    for corrupt in (text[: len(text) // 2], json.dumps(bad)):
        with pytest.raises(ValueError):
            Plan.from_json(corrupt)


# ---------------------------------------------------------------------------------- owner maps
def _strided_for(world: int) -> tuple[int, dict]:
    """A strided mask whose stride is the world size, on blocks of one round-robin piece (4 per rank)."""
    seq = 64 * world
    return seq, {"kind": "strided", "block_size": 16, "stride": world}


@pytest.mark.parametrize("world,topology", PLACES)
def test_strided_by_the_world_size_runs_locally_and_exactly(ultra_worlds, world, topology):
    """ultra deals the pieces round-robin, so every allowed pair is local: nothing is sent, and the
    result is still exact (in the permuted plan, PARTIAL cells and causal squares map back to the
    original positions)."""
    seq, mask = _strided_for(world)
    runs = ultra_worlds.get(world).run(fitted_layout_run, seq=seq, mask=mask, topology=topology)
    assert {r["layout"] for r in runs} == {"ultra-round-robin-4"} and all(r["sent"] == 0 for r in runs), runs
    case = _case(world, "strided", "float32", heads=4, kv_heads=2, head_dim=8, seq=seq,
                       topology=topology, mask_args={k: v for k, v in mask.items() if k != "kind"}, seed=300 + world)
    result = exactness.run(ultra_worlds.get(world), case)
    assert result.passed, result.describe()


@pytest.mark.parametrize("case", [
    _case(4, "causal", "float32", heads=4, kv_heads=2, head_dim=8, seq=64, topology=(2, 2),
                layout="zigzag", seed=310),
    _case(4, "document", "float32", heads=8, kv_heads=2, head_dim=8, seq=128, topology=(2, 2),
                layout="balanced", mask_args=exactness.example_mask_args("document", 128), seed=311),
    _case(2, "sliding_window", "float32", heads=4, kv_heads=4, head_dim=8, seq=96,
                layout="balanced", mask_args={"window": 11}, seed=312),
    _case(2, "strided", "bfloat16", heads=4, kv_heads=2, head_dim=8, seq=250,
                mask_args={"block_size": 16, "stride": 2}, seed=313),  # padded to 256, then round-robin
    _case(8, "global_local", "float32", heads=4, kv_heads=4, head_dim=8, seq=128, topology=(2, 4),
                layout="zigzag", mask_args=exactness.example_mask_args("global_local", 128), seed=314),
], ids=lambda c: c.label[:90])
def test_ultra_runs_on_other_owner_maps(ultra_worlds, case):
    """Layouts given by the user (zigzag, balanced) and the round-robin one with padding: the plan holds
    the sequence reordered and the executor maps every cell back."""
    result = exactness.run(ultra_worlds.get(case.world), case)
    assert result.passed, result.describe()
