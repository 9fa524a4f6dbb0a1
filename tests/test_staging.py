"""Transfers staged through host buffers (``cpattn.core.staging``), the path P ranks sharing one GPU
take on a gloo group, forced here on CPU tensors (``CPATTN_STAGE=1``) so that it runs without a GPU:
the pool's slots, the order of the copies, poison after release, every registered schedule exact at
P=2 through it, and no allocation in a steady-state call."""

from __future__ import annotations

import dataclasses

import pytest
import staging_workers
import torch

from cpattn import exactness, schedules
from cpattn.core import staging
from cpattn.core.staging import STAGE_ENV, Stager, StagingPool
from cpattn.launcher import WorldError

#: planned schedules solve with small budgets here (their plans stay exact, only less tuned)
PLAN_OPTIONS = {"time_budget": 1.0, "partition_time_limit": 0.3, "schedule_time_limit": 0.3}
SEQ = 64


# ---------------------------------------------------------------------------------- the pool
def test_each_in_flight_transfer_gets_its_own_slot():
    """Two transfers of one shape in flight together (a ring's kv and dkv) never share a buffer."""
    pool = StagingPool()
    a, kv = pool.acquire((2, 8), torch.float32, pinned=False)
    b, dkv = pool.acquire((2, 8), torch.float32, pinned=False)
    assert a != b and kv.data_ptr() != dkv.data_ptr()
    assert (pool.slots, pool.in_flight, pool.allocations) == (2, 2, 2)
    pool.release(a)
    pool.release(b)
    assert pool.in_flight == 0


def test_slots_are_reused_and_grown_once():
    """A slot serves transfers of any shape and dtype: it grows to the largest, then never allocates."""
    pool = StagingPool()
    i, small = pool.acquire((4,), torch.float32, pinned=False)
    pool.release(i)
    i, large = pool.acquire((3, 8), torch.float64, pinned=False)
    assert (i, pool.allocations, pool.allocated_bytes) == (0, 2, 16 + 192)
    assert large.shape == (3, 8) and large.dtype == torch.float64 and large.is_contiguous()
    pool.release(i)
    for shape, dtype in [((4,), torch.float32), ((3, 8), torch.float64), ((5, 2), torch.bfloat16)]:
        i, buf = pool.acquire(shape, dtype, pinned=False)
        assert (i, buf.shape, buf.dtype) == (0, shape, dtype)
        pool.release(i)
    assert pool.allocations == 2


def test_a_buffer_is_never_handed_out_twice_or_released_twice():
    pool = StagingPool()
    i, _ = pool.acquire((4,), torch.float32, pinned=False)
    pool.release(i)
    with pytest.raises(RuntimeError, match="released while not in flight"):
        pool.release(i)
    i, _ = pool.acquire((4,), torch.float32, pinned=False)
    pool._slots[i].busy = False  # a bookkeeping slip: the slot looks free while its buffer is in flight
    with pytest.raises(RuntimeError, match="handed out twice"):
        pool.acquire((4,), torch.float32, pinned=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
def test_a_released_buffer_is_poisoned(dtype):
    """With the poison switch, a buffer given back reads NaN (floating) or -1 (integers)."""
    pool = StagingPool(poison=True)
    i, buf = pool.acquire((3, 5), dtype, pinned=False)
    buf.fill_(7)
    pool.release(i)
    if dtype.is_floating_point:
        assert bool(buf.isnan().all())
    else:
        assert bool((buf == -1).all())


# ---------------------------------------------------------------------------------- the stager
class _Exchange:
    """A stand-in for gloo: at start it snapshots the host buffers it reads; at ``wait`` it writes the
    sum of them into the buffer it writes."""

    def __init__(self, reads: list[torch.Tensor], writes: torch.Tensor) -> None:
        self.seen = [r.clone() for r in reads]
        self.writes = writes

    def wait(self) -> None:
        self.writes.copy_(sum(self.seen))


def test_reads_are_copied_in_at_issue_and_writes_copied_out_at_wait():
    pool = StagingPool(poison=True)
    stager = Stager({"cpu": "gloo", "cuda": "gloo"}, stage=True, pool=pool)
    a, b, out = torch.arange(6.0).view(2, 3), torch.ones(2, 3), torch.full((2, 3), -5.0)
    started = []

    def launch(host_a, host_b, host_out):
        assert all(h.data_ptr() != t.data_ptr() for h, t in ((host_a, a), (host_b, b), (host_out, out)))
        started.append(_Exchange([host_a, host_b], host_out))
        return started[0]

    handle = stager.start(launch, [(a, "in"), (b, "in"), (out, "out")])
    assert torch.equal(started[0].seen[0], a) and torch.equal(started[0].seen[1], b)
    a.fill_(100.0)  # the call read its own copy: changing the tensor after issue does not matter
    assert bool((out == -5.0).all()) and pool.in_flight == 3  # nothing lands before wait
    handle.wait()
    assert torch.equal(out, torch.arange(6.0).view(2, 3) + 1)
    assert pool.in_flight == 0
    handle.wait()  # a second wait does nothing
    assert torch.equal(out, torch.arange(6.0).view(2, 3) + 1)


def test_a_call_that_fails_to_start_gives_its_buffers_back():
    pool = StagingPool()
    stager = Stager({"cpu": "gloo"}, stage=True, pool=pool)

    def launch(*hosts):
        raise RuntimeError("peer gone")

    with pytest.raises(RuntimeError, match="peer gone"):
        stager.start(launch, [(torch.ones(3), "in"), (torch.ones(3), "out")])
    assert pool.in_flight == 0


@pytest.mark.parametrize("config,backends", [
    ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
    ("cpu:gloo,cuda:gloo", {"cpu": "gloo", "cuda": "gloo"}),
    ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
    ("cuda:nccl", {"cuda": "nccl"}),
])
def test_device_backends_reads_the_group_config(monkeypatch, config, backends):
    monkeypatch.setattr(staging.dist, "get_backend_config", lambda group: config)
    assert staging.device_backends(None) == backends


def test_which_tensors_are_staged(monkeypatch):
    """CUDA tensors on gloo always (unless stage=False); CPU tensors when forced; never on NCCL."""
    gloo, nccl, mixed = {"cpu": "gloo", "cuda": "gloo"}, {"cuda": "nccl"}, {"cpu": "gloo", "cuda": "nccl"}
    monkeypatch.delenv(STAGE_ENV, raising=False)
    assert Stager(gloo, None, StagingPool()).devices == {"cuda"}
    assert Stager(gloo, True, StagingPool()).devices == {"cpu", "cuda"}
    assert Stager(gloo, False, StagingPool()).devices == set()
    assert Stager(mixed, None, StagingPool()).devices == set()
    assert Stager(nccl, None, StagingPool()).devices == set()
    with pytest.raises(ValueError, match="gloo groups"):
        Stager(nccl, True, StagingPool())
    monkeypatch.setenv(STAGE_ENV, "1")
    assert Stager(gloo, None, StagingPool()).devices == {"cpu", "cuda"}
    assert Stager(mixed, None, StagingPool()).devices == {"cpu"}
    assert Stager(gloo, False, StagingPool()).devices == set()


# ---------------------------------------------------------------------------------- every schedule, staged
def _cases() -> list[exactness.Case]:
    """Every registered schedule at P=2, GQA 4:2: causal and packed documents (the full mask for the
    bidirectional-only ones)."""
    cases = []
    for name in schedules.names():
        sched = schedules.get(name)
        options = {"plan_options": PLAN_OPTIONS} if (sched.make_plan is not None) else None
        for mask in ("causal", "document") if sched.causal else ("full",):
            found = exactness.matrix([name], worlds=(2,), subgroup=False, masks=(mask,), dtypes=("float32",),
                                  heads=((4, 2),), seq=SEQ)
            cases += [dataclasses.replace(c, seed=100 + len(cases), options=options) for c in found]
    return cases


CASES = _cases()


def test_cases_cover_every_schedule():
    """exactness.matrix leaves out what a schedule rejects: none may drop out silently."""
    causal = {n for n in schedules.names() if schedules.get(n).causal}
    assert {(c.schedule, c.mask) for c in CASES} == ({(n, m) for n in causal for m in ("causal", "document")}
                                                     | {(n, "full") for n in set(schedules.names()) - causal})


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_schedule_is_exact_through_staged_transfers(worlds, case):
    """The exactness judge of the matrix (float64 reference, volume and steps checks), every call of
    the communicator staged through the pool, with poisoned released buffers."""
    try:
        per_rank = worlds.get(2).run(staging_workers.staged_case, timeout=120, name=case.label,
                                             **dataclasses.asdict(case))
    except WorldError as exc:
        pytest.fail(str(exc))
    result = exactness.check(case, per_rank)
    assert result.passed, result.describe()
    for r in per_rank:
        assert r["staging"]["calls"] > 0 and r["staging"]["staged"] == r["staging"]["calls"], r["staging"]


def test_a_steady_state_call_allocates_no_staging_buffer(worlds):
    """The second and third identical forward+backward calls take every buffer from the pool: the
    slots the first call grew serve the same transfers again; none stays in flight."""
    got = worlds.get(2).run(staging_workers.steady_state_allocations, timeout=120,
                                    schedules=schedules.names(), plan_options=PLAN_OPTIONS)
    for rank, per_schedule in enumerate(got):
        assert isinstance(per_schedule, dict), f"rank {rank}: {per_schedule}"
        assert set(per_schedule) == set(schedules.names())
        for name, counts in per_schedule.items():
            assert counts["first"] > 0, (rank, name, counts)
            assert counts["later"] == 0 and counts["in_flight"] == 0, (rank, name, counts)
