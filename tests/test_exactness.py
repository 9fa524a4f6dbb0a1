"""The core exactness matrix, driven by the schedule registry: every registered schedule against the
float64 reference, forward and backward, with communication equal to its steps.

The baselines run the full matrix (world sizes 1-4 and a subgroup of a 4-rank world; causal and full;
MHA and GQA 8:2; float32 and bfloat16). Every other registered schedule (today the RingX variants,
Ulysses, USP and ``ultra``; a newly registered one joins with no edit here) runs a slice: one float32
GQA case per place (world sizes 1-4 and the subgroup), the masks it accepts among causal and full
taken in turn, plus one bfloat16 MHA case at P=3. Every schedule that takes causal masks also runs
the masks contained in the causal one that training uses most (packed documents, a causal sliding
window, streaming), one float32 GQA case each, spread over P=1, P=4 and the subgroup (each place once;
test_masks.py runs every mask kind at P=2 and 3). Per-family files add what is particular to each
(masks, topologies, padding, defects)."""

from __future__ import annotations

import dataclasses

import pytest

from cpattn import exactness, schedules

BASELINES = ["ring", "zigzag_ring", "stripe_ring", "allgather"]
#: world sizes of the matrix, and the subgroup (global ranks 1 and 3 of a 4-rank world)
WORLDS = (1, 2, 3, 4)
SUBGROUP = (1, 3)
#: planned schedules solve with small budgets here (their plans stay exact, only less tuned)
PLAN_OPTIONS = {"plan_options": {"time_budget": 1.0, "partition_time_limit": 0.3, "schedule_time_limit": 0.3}}
#: head counts tried in order for a slice case; the first the schedule accepts at that size is used
#: (e.g. Ulysses cannot split 8 query heads over 3 ranks)
GQA = ((8, 2), (6, 3), (12, 4))
MHA = ((4, 4), (6, 6), (12, 12))


def _with_options(case: exactness.Case) -> exactness.Case:
    if (schedules.get(case.schedule).make_plan is not None):
        return dataclasses.replace(case, options=PLAN_OPTIONS)
    return case


def _first(name: str, world: int, group: tuple[int, ...] | None, mask: str, dtype: str,
           heads: tuple[tuple[int, int], ...], seed: int) -> list[exactness.Case]:
    """The first case of ``exactness.matrix`` for one place, mask and dtype (none if all are rejected)."""
    places = {"worlds": (world,), "subgroup": False} if group is None else {"worlds": (), "subgroup": True}
    found = [c for c in exactness.matrix([name], masks=(mask,), dtypes=(dtype,), heads=heads, seed=seed, **places)
             if c.group == group]
    return found[:1]


def _slice(name: str, seed: int) -> list[exactness.Case]:
    accepted = [m for m in ("causal", "full") if exactness.matrix([name], worlds=(2,), subgroup=False, masks=(m,),
                                                               dtypes=("float32",), heads=GQA)]
    if not accepted:
        return []
    places = [(w, None) for w in WORLDS] + [(4, SUBGROUP)]
    cases = []
    for i, (world, group) in enumerate(places):
        cases += _first(name, world, group, accepted[i % len(accepted)], "float32", GQA, seed + i)
    cases += _first(name, 3, None, accepted[-1], "bfloat16", MHA, seed + len(places))
    return cases


#: masks contained in the causal one that every causal schedule runs at CAUSAL_PLACES
CAUSAL_MASKS = ("document", "sliding_window", "streaming")
CAUSAL_PLACES = ((1, None), (4, None), (4, SUBGROUP))


def _causal_masks(name: str, turn: int, seed: int) -> list[exactness.Case]:
    """Each of CAUSAL_MASKS at one of CAUSAL_PLACES, every place once (rotated by ``turn`` so that over
    the registry every mask meets every place)."""
    if not schedules.get(name).causal:
        return []
    cases = []
    for i, mask in enumerate(CAUSAL_MASKS):
        world, group = CAUSAL_PLACES[(i + turn) % len(CAUSAL_PLACES)]
        cases += _first(name, world, group, mask, "float32", GQA, seed + i)
    return cases


def _cases() -> list[exactness.Case]:
    cases = exactness.matrix(BASELINES)
    for i, name in enumerate(schedules.names()):
        if name not in BASELINES:
            cases += _slice(name, seed=1000 + 10 * i)
        cases += _causal_masks(name, turn=i, seed=3000 + 10 * i)
    return [_with_options(c) for c in cases]


CASES = _cases()


def test_matrix_covers_every_registered_schedule():
    """exactness.matrix leaves out what a schedule rejects, so a schedule could silently drop out of a
    world size: each registered one must have a case at every world size and on the subgroup, with each
    of causal and full it accepts, and every causal one each of CAUSAL_MASKS at each of CAUSAL_PLACES;
    the baselines the whole product."""
    for name in schedules.names():
        mine = [c for c in CASES if c.schedule == name]
        assert {c.world for c in mine if c.group is None} == set(WORLDS), name
        assert any(c.group == SUBGROUP for c in mine), name
        sched = schedules.get(name)
        basic = {m for m, ok in (("causal", sched.causal), ("full", sched.bidirectional)) if ok}
        assert {c.mask for c in mine} == basic | (set(CAUSAL_MASKS) if sched.causal else set()), name
        assert {c.dtype for c in mine} == {"float32", "bfloat16"}, name
        if sched.causal:
            assert {(c.world, c.group) for c in mine if c.mask in CAUSAL_MASKS} == set(CAUSAL_PLACES), name
    causal = [c for c in CASES if c.mask in CAUSAL_MASKS]
    assert {(c.mask, c.world, c.group) for c in causal} == {(m, w, g) for m in CAUSAL_MASKS for w, g in CAUSAL_PLACES}
    for name in BASELINES:
        mine = {(c.world, c.group, c.mask, c.dtype, c.heads, c.kv_heads) for c in CASES
                if c.schedule == name and c.mask not in CAUSAL_MASKS}
        assert len(mine) == 5 * 2 * 2 * 2, name
    assert all(c.options for c in CASES if (schedules.get(c.schedule).make_plan is not None))


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_schedule_is_exact(worlds, case):
    result = exactness.run(worlds.get(case.world), case)
    assert result.passed, result.describe()


@pytest.mark.parametrize("schedule", BASELINES)
def test_float16_and_uneven_heads(worlds, schedule):
    case = exactness.Case(schedule, 2, "causal", "float16", heads=6, kv_heads=3, head_dim=32, seq=64, seed=7)
    result = exactness.run(worlds.get(2), case)
    assert result.passed, result.describe()


@pytest.mark.parametrize("schedule", ["ring", "allgather"])
def test_math_backend_matches(worlds, schedule):
    case = exactness.Case(schedule, 3, "causal", "float32", backend="math", seed=11)
    result = exactness.run(worlds.get(3), case)
    assert result.passed, result.describe()


def test_checker_catches_a_wrong_answer():
    """The judge itself must be able to fail: feed it a result with one corrupted row."""
    import numpy as np

    case = exactness.Case("ring", 1, "causal", "float32")
    x = exactness.make_inputs(case)
    scale = 1 / case.head_dim ** 0.5
    loc = exactness.local_kernel(x["q"], x["k"], x["v"], x["dout"], "causal", scale)
    row = {"member": True, "rank": 0, "positions": np.arange(case.seq),
           **{q: loc[q].double().numpy().copy() for q in exactness.QUANTITIES},
           "measured": {"forward": {}, "backward": {}}, "expected": {"forward": {}, "backward": {}},
           "spec": {ph: {"problems": [], "overlapped": 0, "computes": 0, "expected": (0, 0)}
                    for ph in ("forward", "backward")}}
    assert exactness.check(case, [row]).passed
    row["out"][0, 5] += 1e-2
    bad = exactness.check(case, [row])
    assert not bad.passed and bad.errors["out"] > bad.tolerances["out"]
    row["out"][0, 5] = float("nan")
    assert exactness.check(case, [row]).errors["out"] == float("inf")
