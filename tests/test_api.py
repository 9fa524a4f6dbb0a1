"""The front door's contract for schedule objects and caches: schedules with options, stateless
registry objects, caches owned by ContextParallel (bounded, keyed by value), deterministic=."""

from __future__ import annotations

import pytest
import torch

import cpattn
from cpattn import exactness, schedules
from cpattn.api import PLANS_KEPT, ContextParallel
from cpattn.core.memo import BoundedCache
from cpattn.functional import _CACHE, FUNCTIONAL_KEPT
from cpattn.launcher import RankError


def test_schedule_objects_are_values_and_the_registry_hands_out_new_ones():
    assert schedules.get("usp") is not schedules.get("usp")
    assert schedules.get("usp") == schedules.USP() and schedules.USP(ulysses_degree=2) != schedules.USP()
    assert hash(schedules.USP(ulysses_degree=2)) == hash(schedules.USP(ulysses_degree=2))
    assert schedules.USP(ulysses_degree=2).spec() == "usp(ulysses_degree=2)" and schedules.get("ring").spec() == "ring"
    assert schedules.get("ring") != schedules.get("zigzag_ring")
    with pytest.raises(ValueError, match="ulysses_degree"):
        schedules.USP(ulysses_degree=0)
    with pytest.raises(TypeError, match="schedule must be a name"):
        cpattn.ContextParallel(64, "causal", schedule=3)
    with pytest.raises(TypeError):
        schedules.get("ring", ulysses_degree=2)  # plain schedules take no options


def test_bounded_cache_evicts_the_least_recently_used():
    cache, built = BoundedCache(2), []
    for key in ("a", "b", "a", "c", "b"):
        cache.get(key, lambda k=key: built.append(k) or k)
    assert built == ["a", "b", "c", "b"] and len(cache) == 2  # "b" was evicted by "c", "a" by "b"


def test_single_process_plans_and_blocks_are_kept_per_context():
    opts = cpattn.planner.PlanOptions(time_budget=1.0, partition_time_limit=0.3, schedule_time_limit=0.3)
    cp = cpattn.ContextParallel(64, {"kind": "strided", "block_size": 8, "stride": 2}, schedules.Ultra(opts))
    q = torch.randn(1, 64, 4, 8)
    k = torch.randn(1, 64, 2, 8)
    first = cp.plan(q, k)
    assert cp.plan(q, k) is first and cp.plan(q.double(), k.double()) is not first
    assert len(cp._plans) == 2 and cp._plans.maxsize == PLANS_KEPT
    other = cpattn.ContextParallel(64, {"kind": "strided", "block_size": 8, "stride": 2}, schedules.Ultra(opts))
    assert other.plan(q, k) is not first and other.plan(q, k).to_json() == first.to_json()


# ---------------------------------------------------------------------------------- worker side
def usp_with_degree(degree: int) -> dict:
    """One USP call with an explicit Ulysses degree; what it sent, and whether results match usp(auto)."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(5 + dist.get_rank())
    q, kv = torch.randn(1, 8, 4, 8, generator=g), torch.randn(1, 8, 2, 8, generator=g)
    cp = cpattn.ContextParallel(8 * dist.get_world_size(), "causal", schedules.USP(ulysses_degree=degree))
    out = cp.attention(q, kv, kv)
    auto = cpattn.ContextParallel(8 * dist.get_world_size(), "causal", "usp").attention(q, kv, kv)
    return {"stats": {op: v["calls"] for op, v in cp.comm_stats().items() if op != "total"},
            "close": torch.allclose(out, auto, atol=1e-6), "spec": cp.schedule.spec()}


def functional_twice(deterministic: bool) -> dict:
    """The functional entry point twice on the same inputs; bitwise equal? And how many cached objects."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(9 + dist.get_rank())
    q, kv = torch.randn(1, 8, 4, 8, generator=g, requires_grad=True), torch.randn(1, 8, 2, 8, generator=g)
    runs = []
    for _ in range(2):
        out = cpattn.ring_attn_func(q, kv, kv, causal=True, deterministic=deterministic)
        (grad,) = torch.autograd.grad(out.square().sum(), q)
        runs.append((out.detach(), grad))
    return {"equal": all(torch.equal(a, b) for a, b in zip(*runs)), "cached": len(_CACHE)}


# ---------------------------------------------------------------------------------- parent side
def test_usp_degree_reaches_the_run(worlds):
    """USP(ulysses_degree=2) on 4 ranks: point-to-point exchanges inside pairs plus a 2-rank ring; the
    default degree (4 heads on 4 ranks) is plain Ulysses, all-to-all only."""
    for r in worlds.get(4).run(usp_with_degree, degree=2, timeout=60):
        assert not isinstance(r, RankError), r
        assert r["close"] and r["spec"] == "usp(ulysses_degree=2)"
        assert "all_to_all" not in r["stats"] and r["stats"]["send"] > 0
    case = exactness.Case("usp", 4, "causal", "float32", heads=4, kv_heads=2, seq=64, options={"ulysses_degree": 2})
    result = exactness.run(worlds.get(4), case)
    assert result.passed, result.describe()


def test_deterministic_runs_are_bitwise_equal_and_the_functional_cache_is_shared(worlds):
    for r in worlds.get(2).run(functional_twice, deterministic=True, timeout=60):
        assert not isinstance(r, RankError), r
        assert r["equal"] and 1 <= r["cached"] <= FUNCTIONAL_KEPT


def test_deterministic_off_the_cpu_raises():
    q = torch.empty(1, 8, 4, 8, device="meta")
    with pytest.raises(NotImplementedError, match="deterministic=True is guaranteed on the CPU only"):
        cpattn.ring_attn_func(q, q, q, deterministic=True)


def test_a_wrong_layout_or_a_missing_shard_is_named():
    cp = cpattn.ContextParallel(128, "causal", schedule="ring")
    bhsd = torch.randn(1, 8, 128, 16)
    with pytest.raises(ValueError, match=r"looks like \[batch, heads, seq, head_dim\].*q.transpose\(1, 2\)"):
        cp.attention(bhsd, bhsd, bhsd)


def test_a_views_first_call_runs_its_own_checks(monkeypatch):
    """A view (``with_mask``) keeps its own record of the signatures it checked: its first call runs the
    memory pre-check even when its base already ran that shape."""
    checked = []
    real = ContextParallel.check_memory
    monkeypatch.setattr(ContextParallel, "check_memory",
                        lambda self, q, k, v: checked.append(self) or real(self, q, k, v))
    cp = ContextParallel(64, "causal", "ring")
    q = torch.randn(1, 64, 2, 8)
    cp.attention(q, q, q)
    cp.attention(q, q, q)
    view = cp.with_mask({"kind": "document", "lengths": [30, 34]})
    view.attention(q, q, q)
    view.attention(q, q, q)
    assert checked == [cp, view]
