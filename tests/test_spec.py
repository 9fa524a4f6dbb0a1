"""Every registered schedule's run against its own description, ``steps()`` (``ultra``: its plan).

With ``cpattn.core.trace.recording()`` the communicator records each call's issue and wait with its bytes,
and the kernels each call; ``cpattn.exactness`` compares that with the steps: the same messages (kind and
bytes on every rank), issued in step order, and every transfer that a step declares in flight during
its compute is issued before and waited after a kernel call on each rank that computes in the step.
``exactness.run`` does this for every case (with exactness and byte counts); here the matrix is every
registered schedule x (causal, full, a block-sparse mask, as accepted) x P in {2, 3, 4}, and a ring
that waits for each transfer before computing must fail it."""

from __future__ import annotations

import dataclasses

import pytest

from cpattn import exactness, schedules
from cpattn.core.steps import CommOp, Kernel, Step, work
from cpattn.launcher import RankError

#: ultra plans with small solver budgets in tests (the plans are still exact)
FAST_PLANS = {"plan_options": {"time_budget": 1.0, "partition_time_limit": 0.3, "schedule_time_limit": 0.3}}
MASKS = ("causal", "full", "strided")


def _cases() -> list[exactness.Case]:
    cases = []
    for name in schedules.names():
        options = FAST_PLANS if (schedules.get(name).make_plan is not None) else None
        for world in (2, 3, 4):
            for case in exactness.matrix([name], worlds=(world,), subgroup=False, masks=MASKS, dtypes=("bfloat16",),
                                      heads=((12, 4),), seq=48, seed=500 + 10 * world):
                cases.append(dataclasses.replace(case, head_dim=8, options=options))
    return cases


CASES = _cases()


def test_every_registered_schedule_is_in_the_matrix():
    for name in schedules.names():
        worlds = {c.world for c in CASES if c.schedule == name}
        assert worlds == {2, 3, 4}, (name, worlds)
    assert {c.mask for c in CASES} == set(MASKS)


def _marked(case: exactness.Case):
    """Causal and full at P = 3 and 4 run in the slow suite: every exactness case in make test makes the same
    comparison (``exactness.run``) on those masks and worlds, in float32 and float16."""
    slow = case.world > 2 and case.mask in ("causal", "full")
    return pytest.param(case, marks=pytest.mark.slow) if slow else case


@pytest.mark.parametrize("case", [_marked(c) for c in CASES], ids=[c.label for c in CASES])
def test_run_matches_steps(worlds, case):
    result = exactness.run(worlds.get(case.world), case)
    assert result.passed, result.describe()


def _local_first_cases() -> list[exactness.Case]:
    """RingX owner loops under masks whose diagonal blocks outweigh the rest (a window narrower than a
    rank's tokens, short documents), where every rank computes its diagonal before the shared steps."""
    from cpattn.layout import Layout
    from cpattn.masks import from_spec

    from cpattn.core.pairs import pair_work

    cases = []
    specs = [("sliding_window", {"window": 5}), ("sliding_window", {"window": 4, "causal": False}),
             ("document", {"lengths": [6] * 8})]
    for name in ("ringx1", "ringx1o", "ringx2", "ringx2o", "ringx4", "ringx4o"):
        for world in (2, 3, 4):
            for case in exactness.matrix([name], worlds=(world,), subgroup=False, masks=specs, dtypes=("float32",),
                                      heads=((12, 4),), seq=48, seed=900 + 10 * world):
                sched = schedules.get(name)
                mask = from_spec({"kind": case.mask, **(case.mask_args or {})})
                pairs = pair_work(mask, Layout(sched.layout_for(mask)), 48, world)
                if sched._local_first(pairs, "forward") or sched._local_first(pairs, "backward"):
                    cases.append(dataclasses.replace(case, head_dim=8))
    return cases


LOCAL_FIRST = _local_first_cases()


def test_local_first_cases_cover_every_owner_loop():
    assert {c.schedule for c in LOCAL_FIRST} == {"ringx1", "ringx1o", "ringx2", "ringx2o", "ringx4", "ringx4o"}


@pytest.mark.parametrize("case", LOCAL_FIRST, ids=[c.label for c in LOCAL_FIRST])
def test_run_matches_steps_when_diagonals_go_first(worlds, case):
    result = exactness.run(worlds.get(case.world), case)
    assert result.passed, result.describe()


# ---------------------------------------------------------------------------------- a serialising executor
def serialised_ring_case(**fields) -> dict:
    """On every rank: ``exactness.rank_case`` with the executor changed to wait for each transfer as soon
    as it is issued, before the step's compute (exact, same bytes, nothing overlapped)."""
    from cpattn.core import executor

    original = executor._issue

    def issue_and_wait(*args, **kwargs):
        handle = original(*args, **kwargs)
        handle.wait()
        return handle

    executor._issue = issue_and_wait
    try:
        return exactness.rank_case(**fields)
    finally:
        executor._issue = original


@pytest.mark.parametrize("world", [2, 4])
def test_a_serialised_ring_fails(worlds, world):
    """A serialising executor: exact and with the right bytes, but its transfers are not in flight
    during compute; only the comparison with steps() sees it."""
    case = exactness.Case("ring", world, "full", "float32", heads=4, kv_heads=2, head_dim=8, seq=48, seed=42)
    per_rank = worlds.get(world).run(serialised_ring_case, name="serialised ring", **dataclasses.asdict(case))
    assert not any(isinstance(r, RankError) for r in per_rank), per_rank
    result = exactness.check(case, per_rank)
    assert not result.comm_mismatches and all(result.errors[q] <= result.tolerances[q] for q in exactness.QUANTITIES)
    assert not result.passed
    assert any("in flight during a kernel call" in m for m in result.spec_mismatches), result.spec_mismatches
    # the same case, unchanged, passes
    assert exactness.run(worlds.get(world), case).passed


def test_a_serialised_plan_fails(worlds):
    """The same for a schedule that plans: each rank's compiled program declares which of its messages
    are in flight across its kernel calls, and the serialising executor breaks that."""
    case = exactness.Case("ultra", 2, "sliding_window", "float32", heads=4, kv_heads=2, head_dim=8, seq=64, seed=3,
                       mask_args={"window": 12}, options=FAST_PLANS)
    per_rank = worlds.get(2).run(serialised_ring_case, name="serialised ultra", **dataclasses.asdict(case))
    result = exactness.check(case, per_rank)
    assert not result.comm_mismatches and all(result.errors[q] <= result.tolerances[q] for q in exactness.QUANTITIES)
    assert any("in flight during a kernel call" in m for m in result.spec_mismatches), result.spec_mismatches
    assert exactness.run(worlds.get(2), case).passed


# ---------------------------------------------------------------------------------- the comparison itself
K = Kernel("full", 4, 4, 16)
STEPS = [Step((CommOp("sendrecv", 64),), work=((work([(K, 1)]), 2),)), Step(work=((work([(K, 1)]), 2),))]


def _events(*items) -> list[dict]:
    """``("issue", call, op, sent, recv)``, ``("wait", call)`` or ``("compute",)`` as trace events."""
    out = []
    for it in items:
        if it[0] == "issue":
            out.append({"ev": "issue", "call": it[1], "op": it[2], "sent": it[3], "recv": it[4]})
        elif it[0] == "wait":
            out.append({"ev": "wait", "call": it[1]})
        else:
            out.append({"ev": "compute", "phase": "forward", "kind": "full", "q": 4, "kv": 4})
    return out


def test_check_steps_counts_overlap():
    overlapped = _events(("issue", 0, "send", 64, 0), ("issue", 0, "recv", 0, 64), ("compute",), ("wait", 0),
                         ("compute",))
    rep = exactness.check_steps(STEPS, overlapped, rank=0, world=2)
    assert rep == {"problems": [], "overlapped": 1, "computes": 2}
    assert exactness.expected_overlap(STEPS) == (2, 4)  # one transfer per rank in flight; 2 kernels per rank
    serial = _events(("issue", 0, "send", 64, 0), ("issue", 0, "recv", 0, 64), ("wait", 0), ("compute",),
                     ("compute",))
    assert exactness.check_steps(STEPS, serial, rank=0, world=2)["overlapped"] == 0


def test_check_steps_names_undeclared_missing_and_unwaited_messages():
    wrong_size = _events(("issue", 0, "send", 32, 0), ("issue", 0, "recv", 0, 32), ("wait", 0))
    problems = exactness.check_steps(STEPS, wrong_size, rank=1, world=2)["problems"]
    assert any("does not declare" in p for p in problems) and any("never ran" in p for p in problems)
    unwaited = _events(("issue", 0, "send", 64, 0), ("issue", 0, "recv", 0, 64), ("compute",))
    assert any("never waited" in p for p in exactness.check_steps(STEPS, unwaited, rank=0, world=2)["problems"])
    late = [Step((CommOp("broadcast", 8, root=0),)), Step((CommOp("all_reduce", 8),))]
    swapped = _events(("issue", 0, "all_reduce", 8, 8), ("wait", 0), ("issue", 1, "broadcast", 0, 8), ("wait", 1))
    assert any("after an op of step" in p for p in exactness.check_steps(late, swapped, rank=1, world=2)["problems"])


def test_a_plan_compiles_into_each_ranks_executor_steps(tmp_path, monkeypatch):
    """``ultra``'s plan becomes executor steps per rank: one ``send`` / ``recv`` per transfer of that
    rank, in plan order, with the plan's peer and size; a receive stays in flight until the first step
    that reads it (a kernel, a merge or the relay that forwards it); sends are waited for at the end."""

    from cpattn import masks
    from cpattn.core.steps import Problem
    from cpattn.cost import presets
    from cpattn.planner import get_plan, request
    from cpattn.schedules.ultra import compile_steps, plan_sizes

    monkeypatch.setenv("CPATTN_CACHE_DIR", str(tmp_path))
    plan = get_plan(request(masks.sliding_window(64), 1024, presets.local(4), 1, 4, 2, 16, "float32",
                            schedules.get("ultra").plan_options))
    sizes = plan_sizes(plan, Problem(1024, 4, masks.sliding_window(64), 1, 4, 2, 16, "float32"))
    moved = 0
    for phase in ("forward", "backward"):
        ph = plan.phase(phase)
        for rank in range(4):
            steps = compile_steps(plan, phase, rank, sizes)
            ops = [(i, op) for i, st in enumerate(steps) for op in st.comm]
            mine = [op for op in ph.ops[rank] if op.kind in ("send", "recv")]
            assert [op.op for _, op in ops] == [op.kind for op in mine]
            for (i, op), planned in zip(ops, mine):
                t = ph.transfers[planned.id]
                assert op.bytes == sizes.item_bytes(t.item)
                assert op.root == (t.src if op.op == "recv" else t.dst)
                if op.op == "send":
                    assert op.wait == len(steps) - 1
                    continue
                assert op.wait > i
                reads = [getattr(a, "src", ()) for a in steps[op.wait].run]
                reads = [r if isinstance(r, tuple) else (r,) for r in reads]
                relays = [o for o in steps[op.wait].comm if o.send == op.recv]
                assert any(op.recv in r for r in reads) or relays, (phase, rank, i, op)
            moved += len(ops)
    assert moved > 0
