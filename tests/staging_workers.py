"""Functions the staging and placement tests run on worker processes (importable by spawned workers)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist

import cpattn
from cpattn import exactness
from cpattn.core import placement
from cpattn.core.comm import Communicator
from cpattn.core.staging import STAGE_ENV, Stager


@contextlib.contextmanager
def forced() -> Iterator[None]:
    """Staging forced on this worker's CPU tensors for the communicators made inside (the variable is read
    when a communicator is made), so the shared 2-rank world serves the staged cases too."""
    before = os.environ.get(STAGE_ENV)
    os.environ[STAGE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(STAGE_ENV)
        else:
            os.environ[STAGE_ENV] = before


def staged_case(**fields) -> dict:
    """``exactness.rank_case`` with the communicator's calls counted: ``staging`` holds how many calls
    started (``calls``) and how many of them went through host buffers (``staged``)."""
    counts = {"calls": 0, "staged": 0}
    start, stage = Communicator._start, Stager.start

    def counted_start(self, launch, *tensors):
        counts["calls"] += 1
        return start(self, launch, *tensors)

    def counted_stage(self, launch, tensors):
        counts["staged"] += 1
        return stage(self, launch, tensors)

    with forced(), mock.patch.object(Communicator, "_start", counted_start), \
            mock.patch.object(Stager, "start", counted_stage):
        result = exactness.rank_case(**fields)
    return {**result, "staging": counts}


def _call(cp: cpattn.ContextParallel, q: torch.Tensor, k: torch.Tensor) -> None:
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    cp.attention(q, k, k).sum().backward()


def steady_state_allocations(schedules: list[str], plan_options: dict, seq: int = 64) -> dict:
    """Per schedule: the staging buffers one ContextParallel allocated in its first forward+backward
    call, and in the second and third identical calls (``[first, later]``), with the buffers still in
    flight after them."""
    out = {}
    for name in schedules:
        sched = cpattn.schedules.get(name)
        if (sched.make_plan is not None):
            sched = cpattn.schedules.get(name, plan_options=cpattn.planner.PlanOptions(**plan_options))
        with forced():
            cp = cpattn.ContextParallel(seq, "causal" if sched.causal else "full", sched)
        torch.manual_seed(3)
        q, k = torch.randn(2, cp.local_len, 4, 16), torch.randn(2, cp.local_len, 2, 16)
        pool = cp.comm.staging
        _call(cp, q, k)
        first = pool.allocations
        _call(cp, q, k)
        _call(cp, q, k)
        out[name] = {"first": first, "later": pool.allocations - first, "in_flight": pool.in_flight,
                     "slots": pool.slots}
    return out


def places(group_ranks: list[int] | None) -> dict:
    """The placement exchanged twice on a group (None: the world; else a subgroup of these global
    ranks), and this rank's group rank; non-members return ``{"member": False}``."""
    group = None if group_ranks is None else dist.new_group(group_ranks)
    if group_ranks is not None and dist.get_rank() not in group_ranks:
        return {"member": False}
    comm = Communicator(group)
    first, second = placement.exchange(comm), placement.exchange(comm)
    return {"member": True, "rank": comm.rank, "first": first, "second": second}


def shared_memory(available: int, seq: int = 64) -> dict:
    """The memory pre-check of CPU ranks on one host with the host's available memory fixed at
    ``available`` bytes: this rank's figure, its call's need, and what the call raised (None: ran)."""
    cp = cpattn.ContextParallel(seq, "causal", "allgather")
    q = torch.randn(1, cp.local_len, 4, 16, requires_grad=True)
    k = torch.randn(1, cp.local_len, 2, 16, requires_grad=True)
    with torch.no_grad():  # as the pre-check inside the attention op sees the call
        need = cp.peak_memory(q, k) - sum(t.numel() * t.element_size() for t in (q, k, k))  # less q, k, v held
    fixed = mock.Mock(available=available)
    with mock.patch("cpattn.api.psutil.virtual_memory", return_value=fixed):
        have, source = cp.available_memory(q.device)
        try:
            cp.attention(q, k, k)
            raised = None
        except MemoryError as exc:
            raised = str(exc)
    return {"have": have, "source": source, "need": need, "raised": raised}


def nccl_on_one_gpu() -> dict:
    """A ContextParallel on a group that looks like NCCL with every rank on cuda:0 of one host: what it
    raised, and how many communicator calls started before (none may)."""
    calls = []
    start = Communicator._start

    def counted_start(self, launch, *tensors):
        calls.append(1)
        return start(self, launch, *tensors)

    with mock.patch("cpattn.core.comm.device_backends", return_value={"cpu": "gloo", "cuda": "nccl"}), \
            mock.patch("cpattn.core.placement.here", return_value=placement.Place("node0", 0)), \
            mock.patch.object(Communicator, "_start", counted_start):
        try:
            cpattn.ContextParallel(64, "causal", "ring")
        except ValueError as exc:
            return {"raised": str(exc), "calls": len(calls)}
    return {"raised": None, "calls": len(calls)}
