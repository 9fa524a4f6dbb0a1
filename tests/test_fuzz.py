"""Fuzzing exactness: random cases across ranks against the float64 reference, forward and backward.

Each example draws a place (world sizes 1-4, or a 2- or 3-rank subgroup of the 4-rank world), a length
of 16-300 tokens (most of them not a multiple of the layout's split, so ContextParallel pads), a mask
(every JSON kind with random arguments, ``&`` / ``|`` of two of them, or a predicate through
``from_mask_mod``, alone or combined: tests/fuzz_workers.py), GQA ratios 1, 2 and 4, a dtype (float32,
float64, bfloat16, float16), and one of the registered schedules that accepts the mask and the heads
(``check_mask`` / ``check_shape``), with its options (``usp``'s Ulysses degree, a small planning budget
for planned schedules), a layout ("balanced" where the schedule takes one), a topology and a kernel
backend. The case passes ``verify``'s rule: out, lse, dq, dk, dv within ``2 * e_local + 1e-6`` of the
reference (e_local: one device in the same dtype), communication equal to the schedule's steps, padding
and empty rows exactly 0 (lse -inf).

Every example has a deadline, and each case a timeout on its world, so a hang fails naming the case and
the world is restarted for the next one. The default run is a small derandomized budget with everything
drawn; the slow run (``pytest -m slow tests/test_fuzz.py``) runs every registered schedule at every place
with the rest drawn afresh, at least :data:`SLOW_EXAMPLES` examples in all (environment variable
``CPATTN_FUZZ_EXAMPLES``; 288 for the default 200), and prints the failing one with its
``@reproduce_failure`` blob.
"""

from __future__ import annotations

import math
import os
import random
from datetime import timedelta

import fuzz_workers
import pytest
import torch
from cpattn.layout import Layout
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from cpattn import exactness, masks, schedules

#: (world size, subgroup or None): every world size, and subgroups of the 4-rank world (P=2 and P=3)
PLACES = [(1, None), (2, None), (3, None), (4, None), (4, (1, 3)), (4, (0, 2, 3))]
DTYPES = ["float32", "float64", "bfloat16", "float16"]
HEAD_DIMS = [8, 12, 16, 32]
#: planned schedules solve with a small budget (their plans stay exact, only less tuned)
PLAN_OPTIONS = {"plan_options": {"time_budget": 1.0, "partition_time_limit": 0.3, "schedule_time_limit": 0.3}}
#: seconds a case may take on its world before it counts as a hang (the world is then restarted)
CASE_TIMEOUT = 120.0
#: hypothesis deadline per example: the case, the reference and, at worst, restarting a world
DEADLINE = timedelta(seconds=CASE_TIMEOUT + 60)
DEFAULT_EXAMPLES = 12
SLOW_EXAMPLES = int(os.environ.get("CPATTN_FUZZ_EXAMPLES", "200"))


# ------------------------------------------------------------------ masks (JSON specs, for a length)
def _lengths(seq: int):
    """Document lengths summing to ``seq``: cut points anywhere, one-token documents included."""
    cuts = st.lists(st.integers(1, seq - 1), max_size=6, unique=True).map(sorted)
    return cuts.map(lambda c: [b - a for a, b in zip([0, *c], [*c, seq])])


def _table(seq: int, block_size: int, extra: int, seed: int, causal: bool) -> list[list[int]]:
    """A square block table covering ``seq`` (plus ``extra`` blocks), cells drawn from ``seed``; causal:
    nothing above the diagonal and no full diagonal cell."""
    rng = random.Random(seed)
    n = -(-seq // block_size) + extra
    table = [[rng.choice((0, 0, 1, 2)) for _ in range(n)] for _ in range(n)]
    if causal:
        table = [[c if j < i else (rng.choice((0, 2)) if j == i else 0) for j, c in enumerate(row)]
                 for i, row in enumerate(table)]
    return table


def simple_specs(seq: int):
    """Every JSON mask kind with random arguments fitting ``seq`` tokens."""
    bs = st.sampled_from([1, 2, 3, 4, 8, 16, 32])
    return st.one_of(
        st.just({"kind": "causal"}),
        st.just({"kind": "full"}),
        st.builds(lambda w, c: {"kind": "sliding_window", "window": w, "causal": c},
                  st.integers(1, seq + 4), st.booleans()),
        st.builds(lambda ls, c: {"kind": "document", "lengths": ls, "causal": c}, _lengths(seq), st.booleans()),
        st.builds(lambda b, s, lo, c: {"kind": "strided", "block_size": b, "stride": s, "local": lo, "causal": c},
                  bs, st.integers(2, 5), st.integers(1, 3), st.booleans()),
        st.builds(lambda b, g, lo: {"kind": "global_local", "block_size": b, "global_blocks": g, "local_blocks": lo},
                  bs, st.integers(0, 2), st.integers(1, 3)),
        st.builds(lambda b, s: {"kind": "star", "block_size": b, "sink": s}, bs, st.integers(0, 3)),
        st.builds(lambda s, w, b: {"kind": "streaming", "sink": s, "window": w, "block_size": b},
                  st.integers(0, 8), st.integers(1, 8), st.sampled_from([1, 2, 4, 8, 16])),
        st.builds(lambda b, extra, seed, c: {"kind": "block_table", "block_size": b,
                                             "table": _table(seq, b, extra, seed, c)},
                  st.sampled_from([4, 8, 16, 32, 64]), st.integers(0, 1), st.integers(0, 2**16), st.booleans()),
    )


def specs(seq: int):
    """A simple mask, or ``&`` / ``|`` of two."""
    simple = simple_specs(seq)
    combined = st.builds(lambda a, b, op: {"kind": op, "masks": [a, b]}, simple, simple,
                         st.sampled_from(["and", "or"]))
    return st.one_of(simple, simple, combined)


def mods(seq: int):
    """A predicate for ``from_mask_mod`` (see :data:`fuzz_workers.MODS`) and how it combines."""
    combine = st.sampled_from([None, "and", "or"])
    return st.one_of(
        st.builds(lambda p, c: {"kind": "prefix_lm", "prefix": p, "combine": c}, st.integers(0, seq), combine),
        st.builds(lambda d, c: {"kind": "dilated", "dilation": d, "combine": c}, st.integers(1, 7), combine),
        st.builds(lambda b, d, s, causal, c: {"kind": "random_blocks", "block_size": b, "density": d, "seed": s,
                                               "causal": causal, "combine": c},
                  st.sampled_from([1, 4, 8, 16, 32]), st.integers(0, 1000), st.integers(0, 10_000), st.booleans(),
                  combine),
        st.builds(lambda p, ph, c: {"kind": "empty_rows", "period": p, "phase": ph % p, "combine": c},
                  st.integers(2, 9), st.integers(0, 8), combine),
    )


def _kind(spec: dict) -> str:
    if spec["kind"] in ("and", "or"):
        return f"{spec['kind']}({','.join(_kind(m) for m in spec['masks'])})"
    return spec["kind"]


# ------------------------------------------------------------------ whole cases
def _accepts(name: str, mask: masks.Mask, heads: int, kv_heads: int, p: int) -> bool:
    sched = schedules.get(name)
    try:
        sched.check_mask(mask)
        sched.check_shape(torch.empty(1, 1, heads, 1), torch.empty(1, 1, kv_heads, 1), p)
    except (ValueError, NotImplementedError):
        return False
    return True


#: (heads, kv_heads) with 2-8 query heads and GQA ratios 1, 2 and 4
HEADS = [(kv * r, kv) for r in (1, 2, 4) for kv in range(1, 9) if 2 <= kv * r <= 8]


@st.composite
def fuzz_cases(draw, place: tuple[int, tuple[int, ...] | None] | None = None, name: str | None = None
               ) -> tuple[exactness.Case, dict | None]:
    """A ``exactness.Case`` and, for a predicate mask, its ``mod`` (else None), at ``place`` with schedule
    ``name`` (both drawn when None). The schedule comes first, then a mask it accepts: one of its named
    masks for a schedule that lists them, else any mask, rejected (``assume``) when the schedule is
    causal-only or bidirectional-only and the mask is not."""
    world, group = place if place is not None else draw(st.sampled_from(PLACES))
    p = world if group is None else len(group)
    name = name if name is not None else draw(st.sampled_from(schedules.names()))
    sched = schedules.get(name)
    seq = draw(st.integers(16, 300))
    mod = None
    if sched.masks != "any":
        spec = draw(st.sampled_from([{"kind": m} for m in sched.masks]))
    else:
        spec = draw(specs(seq))
        mod = draw(st.one_of(st.none(), st.none(), mods(seq)))
        if mod is not None and mod["combine"] is None:
            spec = {"kind": "full"}  # unused: the predicate alone is the mask
    kind, args = spec["kind"], {k: v for k, v in spec.items() if k != "kind"} or None
    base = exactness.Case(name, world, kind, seq=seq, mask_args=args)
    mask = masks.from_spec(spec) if mod is None else fuzz_workers.build_mask(base, mod)
    heads_ok = [hk for hk in HEADS if _accepts(name, mask, *hk, p)]
    assume(heads_ok)  # the mask is causal for a bidirectional-only schedule, or the reverse
    heads, kv_heads = draw(st.sampled_from(heads_ok))
    options = dict(PLAN_OPTIONS) if (sched.make_plan is not None) else None
    if name == "usp":
        degrees = [d for d in range(1, p + 1) if p % d == 0 and heads % d == 0]
        degree = draw(st.sampled_from([None, *degrees]))
        options = None if degree is None else {"ulysses_degree": degree}
    layout = draw(st.sampled_from([None, "balanced"])) if sched.custom_layout else None
    topologies = [None, None, None] + [(a, p // a) for a in (2, p) if a > 1 and p % a == 0]
    topology = draw(st.sampled_from(topologies))
    case = exactness.Case(
        name, world, kind, dtype=draw(st.sampled_from(DTYPES)), batch=draw(st.integers(1, 2)), seq=seq,
        heads=heads, kv_heads=kv_heads, head_dim=draw(st.sampled_from(HEAD_DIMS)), seed=draw(st.integers(0, 2**20)),
        group=group, backend=draw(st.sampled_from(["auto", "auto", "math"])), topology=topology, mask_args=args,
        layout=layout, options=options)
    event(f"P={p}{'' if group is None else ' subgroup'}")
    event(f"schedule={name}")
    if mod is None:
        event(f"mask={_kind(spec)}")
    else:
        event(f"mask=mask_mod:{mod['kind']}" + ("" if mod["combine"] is None else f" {mod['combine']} {_kind(spec)}"))
    event(f"dtype={case.dtype}")
    event(f"GQA {heads // kv_heads}")
    padded = Layout(sched.layout_for(mask)).padded_len(seq, p) != seq
    event("padded" if padded else "no padding")
    event(f"seq {'16-63' if seq < 64 else '64-159' if seq < 160 else '160-300'}")
    return case, mod


def _check(worlds, drawn: tuple[exactness.Case, dict | None]) -> None:
    case, mod = drawn
    result = fuzz_workers.run(worlds.get(case.world), case, mod, timeout=CASE_TIMEOUT)
    assert result.passed, f"{fuzz_workers.label(case, mod)}: {result.describe()}"
    assert all(math.isfinite(e) for e in result.errors.values())


_COMMON = {"deadline": DEADLINE, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                                                           HealthCheck.filter_too_much]}


@settings(max_examples=DEFAULT_EXAMPLES, derandomize=True, database=None, **_COMMON)
@given(drawn=fuzz_cases())
def test_fuzz_exactness(worlds, drawn):
    _check(worlds, drawn)


#: the slow run: every registered schedule at every place, the rest drawn. A schedule that takes any
#: mask gets twice the examples of one limited to named masks (causal, full), which varies less; the
#: first example of each is hypothesis's simplest (16 tokens, causal or the first named mask).
SLOW_GRID = [(name, place) for name in schedules.names() for place in PLACES]
_WEIGHTS = {name: 2 if schedules.get(name).masks == "any" else 1 for name in schedules.names()}
PER_WEIGHT = max(2, -(-SLOW_EXAMPLES // (len(PLACES) * sum(_WEIGHTS.values()))))


def _grid_id(name: str, place: tuple[int, tuple[int, ...] | None]) -> str:
    world, group = place
    return f"{name}-P{world}" + ("" if group is None else f"-group{''.join(map(str, group))}")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "place"), SLOW_GRID,
                         ids=[_grid_id(*x) for x in SLOW_GRID])
def test_fuzz_exactness_many(worlds, name, place):
    @settings(max_examples=PER_WEIGHT * _WEIGHTS[name], print_blob=True, **_COMMON)
    @given(drawn=fuzz_cases(place, name))
    def fuzz(drawn):
        _check(worlds, drawn)

    fuzz()


# ------------------------------------------------------------------ the predicate masks themselves
@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_predicate_masks_agree_with_their_reference(data):
    """The library form of each predicate mask (``from_mask_mod``, combined with a JSON mask through
    ``&`` / ``|``) equals the reference's pair-by-pair form, so a fuzz failure is the schedule's."""
    seq = data.draw(st.integers(16, 80))
    mod = data.draw(mods(seq))
    spec = data.draw(specs(seq))
    case = exactness.Case("ring", 1, spec["kind"], seq=seq, mask_args={k: v for k, v in spec.items() if k != "kind"})
    assert torch.equal(fuzz_workers.build_mask(case, mod).dense(0, seq, 0, seq), fuzz_workers.reference_mask(case, mod))


def test_predicate_checker_catches_a_wrong_answer():
    """The predicate path's judge can fail: one corrupted row, or a result of another mask."""
    import numpy as np

    case = exactness.Case("ring", 1, "causal", seq=40)
    mod = {"kind": "empty_rows", "period": 5, "phase": 2, "combine": "or"}
    x = exactness.make_inputs(case)
    allowed = fuzz_workers.reference_mask(case, mod)
    loc = exactness.local_kernel(x["q"], x["k"], x["v"], x["dout"], "mask_mod", 1 / case.head_dim ** 0.5, allowed)
    row = {"member": True, "rank": 0, "positions": np.arange(case.seq),
           **{q: loc[q].double().numpy().copy() for q in exactness.QUANTITIES},
           "measured": {"forward": {}, "backward": {}}, "expected": {"forward": {}, "backward": {}},
           "spec": {ph: {"problems": [], "overlapped": 0, "computes": 0, "expected": (0, 0)}
                    for ph in ("forward", "backward")}}
    assert fuzz_workers.check(case, mod, [row]).passed
    assert not fuzz_workers.check(case, {**mod, "combine": "and"}, [row]).passed
    row["dk"][0, 7] += 1e-2
    assert not fuzz_workers.check(case, mod, [row]).passed
