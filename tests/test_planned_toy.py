"""A planned schedule defined in a test file (``planned_toy``: its own planner and plan) runs unmodified
through ``ContextParallel``, the cost estimate and ``verify``: everything a schedule that plans needs is
reached through its hooks."""

from __future__ import annotations

import dataclasses

import planned_toy
import pytest
import torch

from cpattn import ContextParallel, cost, exactness
from cpattn.core.steps import Local, Problem, Step


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mask", ["causal", "document"])
def test_toy_planned_schedule_is_exact_through_verify(worlds, world, mask):
    case = exactness.Case(planned_toy.NAME, world, mask, "float32", batch=1, seq=48, heads=4, kv_heads=2,
                       mask_args=exactness.example_mask_args(mask, 48))
    per_rank = worlds.get(world).run(planned_toy.toy_case, timeout=120, **dataclasses.asdict(case))
    result = exactness.check(case, per_rank)
    assert result.passed, result.describe()
    assert not result.spec_mismatches and not result.comm_mismatches


def test_toy_planned_schedule_in_one_process_and_in_the_cost_model():
    sched = planned_toy.ToyPlanned()
    sched.made.clear()
    cp = ContextParallel(64, "causal", sched)
    q, k, v = (torch.randn(1, 64, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = cp.attention(q, k, v)
    out.sum().backward()
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.detach().transpose(1, 2) for t in (q, k, v)),
                                                           is_causal=True).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-10)
    assert len(sched.made) == 1 and sched.made[0][1] is False  # made once, with the solver's care
    cp.with_mask({"kind": "document", "lengths": [20, 44]}).attention(q, k, v)
    assert len(sched.made) == 2 and sched.made[1][1] is True  # a per-step view's plan is a fast one
    problem = Problem(4096, 4, "causal", heads=8, kv_heads=2, head_dim=64, dtype="float32")
    est = cost.estimate(sched, problem, cost.Topology(1, 4))
    plan = sched.make_plan(problem, cost.Topology(1, 4))
    want = sum(plan.predict(problem, ph).total for ph in ("forward", "backward"))
    assert est.total == pytest.approx(want) and est.bytes_per_rank == 2 * 3 * problem.kv_bytes
    assert est.peak_memory > problem.kv_bytes


def test_a_program_naming_an_undeclared_role_is_refused_before_it_runs():
    from cpattn.core.executor import START_ROLES, check_program

    good = [Step(run=(Local("pack", "q", "q_out"),)), Step(run=(Local("unpack", "q_out", "q2"),))]
    assert check_program(good, START_ROLES["forward"]) is good
    with pytest.raises(ValueError, match="'nowhere'"):
        check_program([Step(run=(Local("pack", "nowhere", "x"),))], START_ROLES["forward"])
    with pytest.raises(ValueError, match="'dout'"):  # a backward role in a forward program
        check_program([Step(run=(Local("f", "dout", "x"),))], START_ROLES["forward"])


def test_a_role_of_the_wrong_kind_is_refused_before_it_runs():
    """Roles are typed: an attention reads queries, key/values (one of several by its index) and output
    accumulators, and a program that hands it something else is refused before anything runs."""
    from cpattn.core.executor import START_ROLES, check_program
    from cpattn.core.steps import Attend, AttendBack, CommOp, Zeros

    start = START_ROLES["forward"]
    gather = CommOp("all_gather", 8, send="kv0", recv="kv_all")
    good = [Step((gather,), run=(Zeros("out", "q", output=True), Attend("kv_all", ("other", 1), index=1)))]
    assert check_program(good, start) is good
    with pytest.raises(ValueError, match=r"takes role 'kv_all' as kv, but it holds kv\*"):  # stacked, and no index
        check_program([Step((gather,), run=(Zeros("out", "q", output=True), Attend("kv_all", ("own",))))], start)
    with pytest.raises(ValueError, match="takes role 'dq' as acc, but it holds rows"):
        check_program([Step(run=(Zeros("dq", "q"), Attend("kv0", ("own",), into="dq")))], start)
    with pytest.raises(ValueError, match="takes role 'kv0' as rows"):  # key/values where queries go
        check_program([Step(run=(Zeros("g", "kv0"), Zeros("dq", "q"),
                                 AttendBack("kv0", ("own",), "g", q="kv0")))], START_ROLES["backward"])


def test_every_registered_schedule_has_a_functional_entry_point():
    import cpattn
    from cpattn import schedules

    names = [f"{n}_attn_func" for n in schedules.names()]
    assert set(names) <= set(cpattn.__all__) and {"usp_attn_func", "ultra_attn_func"} <= set(names)
    q, k, v = (torch.randn(1, 32, 4, 8, dtype=torch.float64) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                           is_causal=True).transpose(1, 2)
    for name in ("usp_attn_func", "ultra_attn_func"):
        assert torch.allclose(getattr(cpattn, name)(q, k, v, causal=True), ref, atol=1e-10), name


def test_a_time_budget_reaches_a_schedule_that_plans_by_its_hooks_not_its_name():
    from cpattn.cli.args import planned_schedule

    assert planned_schedule("ring", 2.0) == "ring"  # plans nothing
    assert planned_schedule("ultra", None) == "ultra"  # no budget given: the planner's own
    assert planned_schedule("ultra", 2.0).plan_options.time_budget == 2.0
    remove = planned_toy.registered()
    try:  # plans, but takes no plan options: left as it is
        assert planned_schedule(planned_toy.NAME, 2.0) == planned_toy.NAME
    finally:
        remove()
