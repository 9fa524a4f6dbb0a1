"""Bad input fails fast and identically on every rank; the harness never blocks on a hang or crash."""

from __future__ import annotations

import time

import pytest
import worker_fns

from cpattn.launcher import LocalWorld, RankError, WorldError


@pytest.mark.parametrize("problem", sorted(worker_fns.BAD_INPUTS))
def test_bad_input_raises_before_communication_on_every_rank(worlds, problem):
    results = worlds.get(3).run(worker_fns.bad_input, timeout=60, problem=problem)
    assert all(not isinstance(r, RankError) for r in results), results
    assert {r["type"] for r in results} <= {"ValueError", "TypeError", "NotImplementedError"}
    assert len({(r["type"], r["message"]) for r in results}) == 1, "ranks disagree"
    assert worker_fns.BAD_INPUTS[problem] in results[0]["message"]
    assert all(r["calls"] == 0 for r in results)


@pytest.mark.parametrize("window,error", [((-2, 0), ValueError), ((4,), ValueError), (("a", 1), ValueError),
                                          ((4, 2), NotImplementedError), ((-1, 3), NotImplementedError)])
def test_bad_window_size_raises_before_anything(window, error):
    """No process group exists here: the check runs before the functional entry point looks for one."""
    import torch

    import cpattn

    x = torch.zeros(1, 4, 2, 8)
    with pytest.raises(error, match="window_size"):
        cpattn.ring_attn_func(x, x, x, window_size=window)


def test_bidirectional_only_rejection_is_clear():
    import cpattn
    from cpattn.schedules.base import Schedule

    class BidirOnly(Schedule):
        name = "bidir"
        causal = False

    with pytest.raises(ValueError, match="bidirectional-only"):
        BidirOnly().check_mask(cpattn.masks.causal())


def test_world_survives_an_exception(worlds):
    w = worlds.get(2)
    results = w.run(worker_fns.raise_on, timeout=30, rank=1)
    assert results[0] == 0 and isinstance(results[1], RankError) and results[1].type == "KeyError"
    assert w.run(worker_fns.raise_on, timeout=30, rank=5) == [0, 1]


@pytest.mark.slow  # waits out a case timeout on its own world
def test_a_hung_case_times_out_with_its_name():
    with LocalWorld(2, stop_grace=0.5) as w:
        t0 = time.monotonic()
        with pytest.raises(WorldError, match="case 'sleepy'.*timed out"):
            w.run(worker_fns.sleep_on, timeout=2, name="sleepy", rank=1, seconds=60)
        assert time.monotonic() - t0 < 15
        assert not w.alive


def test_a_crashed_worker_is_reported():
    with LocalWorld(2) as w:
        with pytest.raises(WorldError, match="rank 0 exited with code 3"):
            w.run(worker_fns.exit_on, timeout=30, rank=0)


@pytest.mark.parametrize("schedule", ["ring", "zigzag_ring", "stripe_ring", "allgather"])
def test_shard_unshard_positions_and_functional(worlds, schedule):
    results = worlds.get(2).run(worker_fns.api_roundtrip, timeout=60, schedule=schedule)
    for r in results:
        assert not isinstance(r, RankError), r
        assert r["roundtrip"] and r["shard_matches"] and r["functional_matches"]
        assert r["lse_shape"] == (2, 4, 8) and r["third"] is None
        assert r["attention_counted"] and r["unshard_not_counted"]
    assert sorted(results[0]["positions"] + results[1]["positions"]) == list(range(16))


def test_world_size_one_without_torch_distributed():
    import torch

    import cpattn

    torch.manual_seed(0)
    cp = cpattn.ContextParallel(32, "causal", "zigzag_ring")
    q = torch.randn(1, 32, 2, 8, requires_grad=True)
    out = cp.attention(q, q, q)
    ref = torch.nn.functional.scaled_dot_product_attention(*(q.transpose(1, 2),) * 3, is_causal=True)
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-5)
    assert cp.schedule_name == "zigzag_ring"


def auto_choice(seq: int, mask) -> str:
    """Runs on the worker ranks: the schedule that schedule="auto" (the default) takes there."""
    import cpattn

    return cpattn.ContextParallel(seq, mask).schedule_name


def _fastest(name: str, seq: int, world: int, mask) -> None:
    """``name`` runs ``mask`` and its estimate is the lowest in ``cost.rank_schedules`` for the problem
    schedule="auto" estimates (the model has ties, e.g. every schedule at P = 1: any of the tied is right)."""
    import torch

    import cpattn
    from cpattn.api import AUTO_SHAPE
    from cpattn.cost import Estimate, Problem, rank_schedules
    from cpattn.cost.presets import this_machine as _local_topology

    problem = Problem(seq, world, cpattn.masks.resolve(mask), dtype="bfloat16" if torch.cuda.is_available() else
                      "float32", **AUTO_SHAPE)
    ranked = dict(rank_schedules(problem, _local_topology(world, "test")))
    best = min(e.total for e in ranked.values() if isinstance(e, Estimate))
    assert isinstance(ranked.get(name), Estimate), (mask, world, name, ranked.get(name))
    assert ranked[name].total <= best * (1 + 1e-9), (mask, world, name, ranked[name].total, best)
    cpattn.schedules.get(name).check_mask(problem.mask)


def test_auto_picks_a_fastest_estimate_for_the_problem(worlds):
    """schedule="auto" takes a schedule whose estimate is the lowest for the same problem (no fixed name):
    in this process (P = 1, where every schedule that runs the mask ties) and on 4 ranks (where they differ)."""
    import cpattn

    for mask in ("full", "causal", {"kind": "sliding_window", "window": 5, "causal": False}):
        _fastest(cpattn.ContextParallel(32, mask).schedule_name, 32, 1, mask)
    for mask in ("full", "causal"):
        names = worlds.get(4).run(auto_choice, timeout=60, seq=1024, mask=mask)
        assert len(set(names)) == 1, names  # every rank chooses alike, without communicating
        _fastest(names[0], 1024, 4, mask)


@pytest.mark.parametrize("owner", [0, 2])
def test_distributed_merge_is_exact(worlds, owner):
    results = worlds.get(3).run(worker_fns.distributed_merge_check, timeout=60, owner=owner)
    owners = [r for r in results if r["owner"]]
    assert [r["rank"] for r in owners] == [owner]
    r = owners[0]
    assert not r["nan"] and r["lse_ok"] and r["out_err"] < 1e-12 and r["lse_err"] < 1e-12
