"""Ulysses and USP: exact forward and backward under every mask, on world sizes 2-4, subgroups, a 2-D
split with and without a topology, GQA/MQA with key/value heads replicated; communication equal to the
formulas; the head-count errors and the degree choice. Module-level functions taking keyword arguments
run on the worker ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cpattn
from cpattn import exactness
from cpattn.core.steps import Problem
from cpattn.cost import Topology
from cpattn.launcher import RankError
from cpattn.schedules.ulysses import UlyssesSchedule, kv_plan
from cpattn.schedules.usp import USPSchedule

KINDS = ["causal", "full", "sliding_window", "document", "strided", "global_local", "star", "streaming",
         "block_table", ("and", {"masks": [{"kind": "document", "lengths": [13, 1, 20, 14]},
                                           {"kind": "sliding_window", "window": 6, "causal": False}]})]
# 6 query heads, 3 kv heads: Ulysses degree 3 splits kv heads, degree 2 gives each rank one kv head per
# query head (3 kv heads do not split over 2 ranks, nor 2 ranks over 3 kv heads)
CASES = exactness.matrix(["ulysses", "usp"], worlds=(2, 3), subgroup=False, masks=tuple(KINDS), dtypes=("float32",),
                      heads=((6, 3),), seed=2000)
EXTRA = [
    # 2-D USP: a 2 x 2 topology puts Ulysses inside each node and the ring across the nodes
    *[exactness.Case("usp", 4, m, heads=8, kv_heads=2, topology=(2, 2), mask_args=exactness.example_mask_args(m, 48),
                  seed=2100 + i) for i, m in enumerate(["causal", "document", "block_table", "global_local"])],
    # 2-D USP without a topology: the largest degree dividing 6 heads and 4 ranks is 2
    *[exactness.Case("usp", 4, m, heads=6, kv_heads=2, mask_args=exactness.example_mask_args(m, 48), seed=2110 + i)
      for i, m in enumerate(["sliding_window", "streaming"])],
    # P > h_kv: every kv head goes to P / h_kv ranks (GQA 8:2 and MQA 4:1 on 4 ranks)
    exactness.Case("ulysses", 4, "causal", heads=8, kv_heads=2, seed=2120),
    exactness.Case("ulysses", 4, "strided", heads=4, kv_heads=1, mask_args=exactness.example_mask_args("strided", 48),
                seed=2121),
    # subgroups of a 4-rank world
    *[exactness.Case(s, 4, m, heads=4, kv_heads=2, group=(1, 3), mask_args=exactness.example_mask_args(m, 48),
                  seed=2130 + i) for i, (s, m) in enumerate([("ulysses", "document"), ("usp", "causal"),
                                                             ("ulysses", "star"), ("usp", "global_local")])],
    # low precision
    exactness.Case("ulysses", 2, "document", "bfloat16", heads=4, kv_heads=2,
                mask_args=exactness.example_mask_args("document", 48), seed=2140),
    exactness.Case("usp", 4, "causal", "bfloat16", heads=8, kv_heads=2, topology=(2, 2), seed=2141),
    exactness.Case("usp", 3, "sliding_window", "float16", heads=6, kv_heads=6, head_dim=32, seq=64,
                mask_args={"window": 9}, seed=2142),
    # world size 1
    exactness.Case("ulysses", 1, "causal", seed=2150),
    exactness.Case("usp", 1, "document", mask_args=exactness.example_mask_args("document", 48), seed=2151),
]


def test_matrix_covers_every_mask_and_world():
    assert {(c.schedule, c.world) for c in CASES} == {(s, w) for s in ("ulysses", "usp") for w in (2, 3)}
    assert len({c.mask for c in CASES}) == len(KINDS)


@pytest.mark.parametrize("case", CASES + EXTRA, ids=[c.label for c in CASES + EXTRA])
def test_is_exact(worlds, case):
    result = exactness.run(worlds.get(case.world), case)
    assert result.passed, result.describe()


# ------------------------------------------------------------------ pure: plans, degrees, volumes, errors
@pytest.mark.parametrize("heads, kv_heads, degree, per_rank", [
    (8, 4, 2, [[0, 1], [2, 3]]),  # kv heads split
    (8, 2, 4, [[0], [0], [1], [1]]),  # each kv head to 2 ranks
    (4, 1, 4, [[0], [0], [0], [0]]),  # MQA
    (6, 3, 2, [[0, 0, 1], [1, 2, 2]]),  # one kv head per query head
])
def test_kv_plan(heads, kv_heads, degree, per_rank):
    plan = kv_plan(heads, kv_heads, degree)
    assert plan == per_rank
    hp, k = heads // degree, len(plan[0])
    for j, heads_j in enumerate(plan):  # local query head t uses local kv head t // (hp / k): plain GQA
        assert all(heads_j[t // (hp // k)] == (j * hp + t) // (heads // kv_heads) for t in range(hp))


def test_usp_degree_choice():
    usp = USPSchedule()
    assert usp.degree(8, 8) == 8 and usp.degree(6, 4) == 2 and usp.degree(5, 4) == 1 and usp.degree(12, 6) == 6
    assert usp.degree(8, 8, Topology(2, 4)) == 4  # Ulysses inside a node
    assert usp.degree(6, 8, Topology(2, 4)) == 2
    assert USPSchedule(ulysses_degree=2).degree(8, 8) == 2


def test_head_errors_name_the_valid_degrees():
    q, k = torch.empty(1, 4, 6, 8), torch.empty(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"degrees <= 4 that divide 6: 1, 2, 3 \(largest: 3\)"):
        UlyssesSchedule().check_shape(q, k, 4)
    with pytest.raises(ValueError, match="ulysses_degree=3 must divide the group size 4"):
        USPSchedule(ulysses_degree=3).check_shape(q, k, 4)
    with pytest.raises(ValueError, match="ulysses_degree"):
        USPSchedule(ulysses_degree=0)


def test_volume_formulas():
    shape = Problem(64, 4, "causal", batch=2, heads=8, kv_heads=2, head_dim=4, dtype="bfloat16")
    vol = UlyssesSchedule().volume(shape, 0)
    seq = 2 * 16 * 8 * 4 * 2
    assert vol["forward"]["all_to_all"]["calls"] == 4 and vol["backward"]["all_to_all"]["calls"] == 3
    kv = 2 * 2 * 16 * 4 * 1 * 4 * 2  # 4 destinations x 1 kv head each
    lse = 2 * 8 * 16 * 4
    assert vol["forward"]["all_to_all"]["bytes_sent"] == 3 * (2 * seq + kv + lse) // 4
    assert vol["backward"]["all_to_all"]["bytes_recv"] == 3 * (2 * seq + 2 * kv) // 4  # dk/dv summed: float32
    one = Problem(16, 1, "causal", batch=2, heads=8, kv_heads=2, head_dim=4, dtype="bfloat16")
    assert UlyssesSchedule().volume(one, 0) == {"forward": {}, "backward": {}}
    two_d = USPSchedule().volume(shape, 0, Topology(2, 2))
    assert set(two_d["forward"]) == {"send", "recv"}  # group exchanges and the ring are point-to-point


# ------------------------------------------------------------------ worker side: the functional entry point
def functional_matches() -> dict:
    g = torch.Generator().manual_seed(11 + dist.get_rank())
    q = torch.randn(1, 8, 4, 8, generator=g)
    kv = torch.randn(1, 8, 2, 8, generator=g)
    cp = cpattn.ContextParallel(8 * dist.get_world_size(), "causal", "ulysses")
    out, lse, none = cpattn.ulysses_attn_func(q, kv, kv, causal=True, return_attn_probs=True)
    ref_out, ref_lse = cp.attention(q, kv, kv, return_lse=True)
    return {"out": torch.equal(out, ref_out), "lse": torch.equal(lse, ref_lse), "none": none is None}


def test_functional_entry_point(worlds):
    for r in worlds.get(2).run(functional_matches, timeout=60):
        assert not isinstance(r, RankError), r
        assert r == {"out": True, "lse": True, "none": True}
