"""Where the ranks of a group run: each rank's (host, CUDA device), exchanged through the group's store.

Two consequences are read off the exchanged list, the same on every rank since every rank holds the
same list:

- :func:`refuse_nccl_sharing`: NCCL refuses two ranks of one communicator on one CUDA device (it fails
  at its first operation with "Duplicate GPU detected"); cpattn says so before that operation and names
  the alternative, a gloo group, whose transfers cpattn stages through host buffers
  (:mod:`cpattn.core.staging`, ``docs/one_gpu.md``).
- :func:`sharers`: how many ranks of the group share this rank's memory (its GPU, or its host's memory
  for CPU tensors), so that the memory pre-check gives each of them its share.

The exchange goes through the process group's key-value store rather than a collective, so it runs
before any NCCL operation, on any backend and on subgroups (each group has its own key prefix).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import Communicator

#: key prefix of the exchange inside the group's store
_KEY = "cpattn/placement"


@dataclass(frozen=True)
class Place:
    """Where one rank runs: ``host`` (its host name) and ``device``, the CUDA device index it works on
    (the group's bound device, else the current device), -1 on a machine without CUDA."""

    host: str
    device: int


def here(comm: Communicator) -> Place:
    """This process's :class:`Place` in ``comm``'s group."""
    device = -1
    if torch.cuda.is_available():
        bound = getattr(comm.group, "bound_device_id", None)
        device = bound.index if bound is not None and bound.index is not None else torch.cuda.current_device()
    return Place(socket.gethostname(), device)


def exchange(comm: Communicator) -> list[Place]:
    """Every rank's :class:`Place`, in group-rank order, on every rank of ``comm``'s group.

    Collective over the group (every rank must call it, in the same order as its other exchanges on the
    group), but through the group's store, not the backend: nothing reaches NCCL. Each rank counts its
    own exchanges on the group (a counter in the store), so the n-th exchange of every rank meets under
    the same keys."""
    mine = here(comm)
    if comm.world_size == 1:
        return [mine]
    store = dist.distributed_c10d._get_process_group_store(comm.group)  # the group's own key prefix
    turn = store.add(f"{_KEY}/turns/{comm.rank}", 1)
    keys = [f"{_KEY}/{turn}/{r}" for r in range(comm.world_size)]
    store.set(keys[comm.rank], json.dumps([mine.host, mine.device]))
    store.wait(keys)
    # one round trip where the store has it (TCPStore); FileStore and HashStore answer key by key
    values = store.multi_get(keys) if store.has_extended_api() else [store.get(k) for k in keys]
    return [Place(*json.loads(v)) for v in values]


def shared_devices(places: Sequence[Place]) -> list[list[int]]:
    """The groups of two or more ranks (indices into ``places``, ascending) on one CUDA device of one
    host, in order of their first rank; ranks without a device (-1) share none."""
    by_device: dict[Place, list[int]] = {}
    for rank, place in enumerate(places):
        if place.device >= 0:
            by_device.setdefault(place, []).append(rank)
    return [ranks for ranks in by_device.values() if len(ranks) > 1]


def sharers(places: Sequence[Place], rank: int, device_type: str) -> int:
    """How many ranks (``rank`` included) share the memory ``rank`` allocates from: for CUDA tensors
    its (host, device), for CPU tensors its host."""
    mine = places[rank]
    if device_type == "cuda":
        return sum(p == mine for p in places)
    return sum(p.host == mine.host for p in places)


def refuse_nccl_sharing(places: Sequence[Place], backends: dict[str, str]) -> None:
    """Raise ``ValueError`` when the group runs CUDA tensors on NCCL (``backends``:
    ``Communicator.backends``) and two of its ranks share a CUDA device; the message names the ranks,
    the device and the gloo alternative. Pure, so every rank raises the same."""
    shared = shared_devices(places) if backends.get("cuda") == "nccl" else []
    if not shared:
        return
    where = "; ".join(f"ranks {', '.join(map(str, ranks))} on cuda:{places[ranks[0]].device} of host "
                      f"{places[ranks[0]].host}" for ranks in shared)
    raise ValueError(
        f"the NCCL group puts two or more ranks on one GPU ({where}): NCCL refuses that ('Duplicate GPU "
        "detected'). To run several ranks on one GPU, use a gloo group instead "
        "(torch.distributed.init_process_group('gloo') or new_group(ranks, backend='gloo')): cpattn stages its "
        "transfers through pinned host buffers there (docs/one_gpu.md); or give each rank its own GPU "
        "(torch.cuda.set_device(local_rank))")


__all__ = ["Place", "exchange", "here", "refuse_nccl_sharing", "shared_devices", "sharers"]
