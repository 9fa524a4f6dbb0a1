"""Ranks that disagree get one clear error, the same on every rank, in seconds; DeviceMesh groups and
two-level collectives inside data x context parallel worlds; the memory pre-check."""

from __future__ import annotations

import pytest
import worker_fns

from cpattn import exactness
from cpattn.launcher import RankError


def _same_error_everywhere(results: list[dict]) -> dict:
    assert all(not isinstance(r, RankError) for r in results), results
    assert len({(r["type"], r["message"]) for r in results}) == 1, f"ranks raised different errors: {results}"
    assert results[0]["type"] is not None, "nothing was raised"
    return results[0]


@pytest.mark.parametrize("problem", sorted(worker_fns.MISMATCHES))
def test_a_rank_given_something_else_makes_every_rank_raise_the_same_error(worlds, problem):
    results = worlds.get(3).run(worker_fns.mismatch, timeout=60, name=f"mismatch {problem}", problem=problem)
    first = _same_error_everywhere(results)
    assert worker_fns.MISMATCHES[problem][1] in first["message"], first
    assert "rank 1" in first["message"], first
    assert max(r["seconds"] for r in results) < 10, results
    if not problem.startswith("invalid"):
        assert first["type"] == "RanksDisagreeError"
        assert "ranks 0, 2" in first["message"], first  # who holds the other value


def test_the_mask_mismatch_that_used_to_return_wrong_results_is_caught(worlds):
    """causal on one rank, full on the others, on allgather: both finished silently before."""
    first = _same_error_everywhere(worlds.get(2).run(worker_fns.mismatch, timeout=60, problem="mask"))
    assert '"kind": "causal"' in first["message"] and '"kind": "full"' in first["message"]


def test_check_always_catches_a_call_that_diverges_later(worlds):
    first = _same_error_everywhere(worlds.get(2).run(worker_fns.diverge_later, timeout=60, check="always"))
    assert "q differs" in first["message"] and "(3, 16, 4, 16)" in first["message"], first


def test_the_cost_of_checking(worlds):
    """Measured, not asserted as a speed: the check must not fail a call, and "first" costs one
    exchange per new signature only."""
    per_call = worlds.get(2).run(worker_fns.check_cost, timeout=120, calls=50)
    for r in per_call:
        assert set(r) == {"off", "first", "always"} and all(t > 0 for t in r.values())


def test_an_oversized_call_is_refused_on_every_rank_with_a_leaner_schedule_named(worlds):
    """allgather holds every rank's kv: with a budget under its peak (on rank 0 only) every rank
    refuses, naming both figures and a leaner schedule."""
    probe = worlds.get(2).run(worker_fns.memory_refusal, timeout=60, schedule="allgather", limit=2**40)
    assert all(r["type"] is None for r in probe), probe
    need = probe[0]["need"]
    first = _same_error_everywhere(worlds.get(2).run(worker_fns.memory_refusal, timeout=60, schedule="allgather",
                                                     limit=need // 4))
    assert first["type"] == "MemoryError" and "rank 0" in first["message"]
    assert "GiB is available (memory_limit)" in first["message"]
    assert "leanest schedule for mask 'causal' is" in first["message"] and "'allgather'" in first["message"]


@pytest.mark.parametrize("schedule", ["ringx3", pytest.param("ringx3b", marks=pytest.mark.slow)])
def test_a_topology_on_a_subgroup_is_refused_not_silently_flat(worlds, schedule):
    results = [r for r in worlds.get(8).run(worker_fns.topology_on_subgroup, timeout=60, schedule=schedule)
               if not isinstance(r, RankError) and r["member"]]
    assert len(results) == 4
    first = _same_error_everywhere(results)
    assert first["type"] == "ValueError" and "DeviceMesh" in first["message"], first


def test_a_one_dimensional_mesh_is_the_flat_group(worlds):
    results = worlds.get(2).run(worker_fns.one_dim_mesh, timeout=60)
    assert all(r["same"] for r in results), results


def test_a_mesh_and_a_topology_of_other_shapes_are_refused(worlds):
    first = _same_error_everywhere(worlds.get(4).run(worker_fns.mesh_shape_mismatch, timeout=60))
    assert "device mesh is 2 x 2" in first["message"] and "topology is 1 x 4" in first["message"]


# slow: make test runs two-level ringx3 in a dp x cp mesh through tests/test_train.py's loss parity and
# on topologies through tests/test_ringx.py
@pytest.mark.parametrize("schedule,mask", [pytest.param("ringx3", "causal", marks=pytest.mark.slow),
                                           pytest.param("ringx3b", "full", marks=pytest.mark.slow),
                                           pytest.param("ringx3b", "window", marks=pytest.mark.slow)])
def test_two_level_ringx3_inside_dp2_x_cp4_is_exact_with_bytes_per_level(worlds, schedule, mask):
    """World 8 = dp 2 x (2 nodes x 2 devices): each dp replica's context-parallel mesh runs the
    two-level collectives; verify checks exactness, the volume and each level's bytes."""
    for replica in (0, 1):
        args = {"mask": "sliding_window", "mask_args": {"window": 12, "causal": False}} if mask == "window" \
            else {"mask": mask}
        case = exactness.Case(schedule, 8, **args, seq=64, heads=4, kv_heads=2, mesh=(2, 2, 2), replica=replica,
                           seed=replica)
        result = exactness.run(worlds.get(8), case)
        assert result.passed, result.describe()
        for phase in ("forward", "backward"):
            for rank, levels in result.levels.items():
                assert levels[phase]["inter_node"]["bytes_sent"] > 0, (rank, levels)
                assert levels[phase]["intra_node"]["bytes_sent"] > 0, (rank, levels)


def test_unshard_of_a_wrong_tensor_on_one_rank_fails_everywhere(worlds):
    first = _same_error_everywhere(worlds.get(2).run(worker_fns.bad_unshard, timeout=60))
    assert "ContextParallel.unshard: rank 1 of 2 raised ValueError" in first["message"], first


def test_check_off_exchanges_nothing(worlds):
    results = worlds.get(2).run(worker_fns.check_off_stays_local, timeout=60)
    assert results[0]["type"] is None and results[1]["type"] == "ValueError", results
