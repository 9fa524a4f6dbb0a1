"""Where the ranks of a group run (``cpattn.core.placement``): the (host, device) exchange through the
group's store, on the world and on a subgroup; NCCL with two ranks on one GPU refused before its first
operation; and the memory pre-check giving ranks that share a host (or a GPU) their share of it."""

from __future__ import annotations

import pytest
import staging_workers

from cpattn.core.placement import Place, refuse_nccl_sharing, shared_devices, sharers

GLOO = {"cpu": "gloo", "cuda": "gloo"}
NCCL = {"cuda": "nccl"}


def test_shared_devices_groups_the_ranks_of_one_gpu():
    places = [Place("a", 0), Place("a", 1), Place("a", 0), Place("b", 0), Place("b", 0), Place("b", 1),
              Place("a", 0)]
    assert shared_devices(places) == [[0, 2, 6], [3, 4]]
    assert shared_devices([Place("a", 0), Place("a", 1), Place("b", 0)]) == []
    assert shared_devices([Place("a", -1), Place("a", -1)]) == []  # CPU ranks share no device


def test_sharers_of_a_gpu_and_of_a_host():
    places = [Place("a", 0), Place("a", 0), Place("a", 1), Place("b", 0)]
    assert [sharers(places, r, "cuda") for r in range(4)] == [2, 2, 1, 1]
    assert [sharers(places, r, "cpu") for r in range(4)] == [3, 3, 3, 1]
    assert sharers([Place("a", -1)] * 3, 1, "cpu") == 3


def test_nccl_on_a_shared_gpu_is_refused_naming_gloo():
    places = [Place("n0", 0), Place("n0", 1), Place("n0", 0), Place("n1", 3), Place("n1", 3)]
    with pytest.raises(ValueError) as err:
        refuse_nccl_sharing(places, NCCL)
    message = str(err.value)
    assert "ranks 0, 2 on cuda:0 of host n0" in message and "ranks 3, 4 on cuda:3 of host n1" in message
    assert "Duplicate GPU" in message and "gloo" in message and "docs/one_gpu.md" in message
    refuse_nccl_sharing(places, GLOO)  # gloo shares a GPU through staged transfers
    refuse_nccl_sharing(places, {"cpu": "gloo"})
    refuse_nccl_sharing([Place("n0", 0), Place("n0", 1)], NCCL)  # one GPU each


def test_construction_refuses_before_any_communicator_call(worlds):
    got = worlds.get(2).run(staging_workers.nccl_on_one_gpu, timeout=60)
    assert got[0] == got[1], got
    assert got[0]["calls"] == 0 and "ranks 0, 1 on cuda:0 of host node0" in got[0]["raised"], got[0]


@pytest.mark.parametrize("size,group", [(2, None), (4, [1, 3])], ids=["world", "subgroup"])
def test_every_rank_learns_every_place(worlds, size, group):
    """The exchange runs on the group's own store keys: on a subgroup, in group-rank order; twice in a
    row (a second ContextParallel) it meets under new keys and agrees again."""
    got = [r for r in worlds.get(size).run(staging_workers.places, timeout=60, group_ranks=group) if r["member"]]
    assert sorted(r["rank"] for r in got) == list(range(len(group or range(size))))
    first = got[0]["first"]
    assert len(first) == len(got) and all(isinstance(p, Place) for p in first)
    assert all(r["first"] == first and r["second"] == first for r in got)
    assert len({p.host for p in first}) == 1  # one machine


def test_ranks_on_one_host_share_its_memory(worlds):
    """Two CPU ranks on one host each get half of its available memory: a call that fits in the whole
    but not in half is refused, on both ranks alike."""
    probe = worlds.get(2).run(staging_workers.shared_memory, timeout=60, available=2**40)
    need = max(r["need"] for r in probe)
    for r in probe:
        assert r["have"] == 2**39 and r["raised"] is None, r
        assert r["source"] == "1/2 of the host memory available: 2 ranks of the group on this host"
    tight = worlds.get(2).run(staging_workers.shared_memory, timeout=60, available=3 * need // 2)
    assert tight[0]["raised"] is not None and tight[0]["raised"] == tight[1]["raised"], tight
    assert "1/2 of the host memory available" in tight[0]["raised"]
