"""Where the ranks of a group run: each rank's host, CUDA device, device name and calibration-profile
digest, exchanged through the group's store.

Three consequences are read off the exchanged list, the same on every rank since every rank holds the
same list:

- :func:`refuse_nccl_sharing`: NCCL refuses two ranks of one communicator on one CUDA device (it fails
  at its first operation with "Duplicate GPU detected"); cpattn says so before that operation and names
  the alternative, a gloo group, whose transfers cpattn stages through host buffers
  (:mod:`cpattn.core.staging`, ``docs/one_gpu.md``).
- :func:`sharers`: how many ranks of the group share this rank's memory (its GPU, or its host's memory
  for CPU tensors), so that the memory pre-check gives each of them its share.
- :func:`node_shape`: nodes x ranks per node, the ranks grouped by host (``ContextParallel``'s
  topology when none is given, ``cpattn.cost.discovery``).

A rank's host is its host name, or ``$CPATTN_HOST`` when set (:data:`HOST_ENV`): containers on different
machines may all be called ``localhost``, and a test emulates two nodes on one machine with it.

The exchange goes through the process group's key-value store rather than a collective, so it runs
before any NCCL operation, on any backend and on subgroups (each group has its own key prefix).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import Communicator

#: key prefix of the exchange inside the group's store
_KEY = "cpattn/placement"
#: environment variable naming this process's host in place of its host name (containers whose host names
#: collide; several emulated nodes on one machine)
HOST_ENV = "CPATTN_HOST"


@dataclass(frozen=True)
class Place:
    """Where one rank runs: ``host`` (its host name, or ``$CPATTN_HOST``) and ``device``, the CUDA device
    index it works on (the group's bound device, else the current device), -1 on a machine without CUDA;
    ``device_name``: that device's name as torch reports it (``"NVIDIA H200"``; ``"cpu"`` without CUDA);
    ``profile``: a digest of the calibration profile the rank would read (empty without one)."""

    host: str
    device: int
    device_name: str = ""
    profile: str = ""


def host_name() -> str:
    """This process's host: ``$CPATTN_HOST`` when set, else its host name."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def here(comm: Communicator, profile: str = "") -> Place:
    """This process's :class:`Place` in ``comm``'s group; ``profile``: its calibration-profile digest."""
    device, name = -1, "cpu"
    if torch.cuda.is_available():
        bound = getattr(comm.group, "bound_device_id", None)
        device = bound.index if bound is not None and bound.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(device)
    return Place(host_name(), device, name, profile)


def exchange(comm: Communicator, profile: str = "") -> list[Place]:
    """Every rank's :class:`Place` (``profile``: this rank's calibration-profile digest), in group-rank
    order, on every rank of ``comm``'s group.

    Collective over the group (every rank must call it, in the same order as its other exchanges on the
    group), but through the group's store, not the backend: nothing reaches NCCL. Each rank counts its
    own exchanges on the group (a counter in the store), so the n-th exchange of every rank meets under
    the same keys."""
    mine = here(comm, profile)
    if comm.world_size == 1:
        return [mine]
    store = dist.distributed_c10d._get_process_group_store(comm.group)  # the group's own key prefix
    turn = store.add(f"{_KEY}/turns/{comm.rank}", 1)
    keys = [f"{_KEY}/{turn}/{r}" for r in range(comm.world_size)]
    store.set(keys[comm.rank], json.dumps([mine.host, mine.device, mine.device_name, mine.profile]))
    store.wait(keys)
    # one round trip where the store has it (TCPStore); FileStore and HashStore answer key by key
    values = store.multi_get(keys) if store.has_extended_api() else [store.get(k) for k in keys]
    return [Place(*json.loads(v)) for v in values]


def shared_devices(places: Sequence[Place]) -> list[list[int]]:
    """The groups of two or more ranks (indices into ``places``, ascending) on one CUDA device of one
    host, in order of their first rank; ranks without a device (-1) share none."""
    by_device: dict[tuple[str, int], list[int]] = {}
    for rank, place in enumerate(places):
        if place.device >= 0:
            by_device.setdefault((place.host, place.device), []).append(rank)
    return [ranks for ranks in by_device.values() if len(ranks) > 1]


def sharers(places: Sequence[Place], rank: int, device_type: str) -> int:
    """How many ranks (``rank`` included) share the memory ``rank`` allocates from: for CUDA tensors
    its (host, device), for CPU tensors its host."""
    mine = places[rank]
    if device_type == "cuda":
        return sum((p.host, p.device) == (mine.host, mine.device) for p in places)
    return sum(p.host == mine.host for p in places)


def _ranks_text(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def hosts_text(places: Sequence[Place]) -> str:
    """Which group ranks run on which host, in order of first rank: ``"node0: ranks 0-1; node1: ranks 2-3"``."""
    by_host: dict[str, list[int]] = {}
    for rank, place in enumerate(places):
        by_host.setdefault(place.host, []).append(rank)
    return "; ".join(f"{host}: rank{'s' if len(ranks) > 1 else ''} {_ranks_text(ranks)}"
                     for host, ranks in by_host.items())


def node_shape(places: Sequence[Place]) -> tuple[int, int, str]:
    """``(nodes, ranks_per_node, why_flat)`` of the group whose ranks run at ``places`` (group-rank
    order), the ranks grouped by host. Group rank r is on node ``r // ranks_per_node`` when every host
    holds the same number of ranks as one block of consecutive group ranks; otherwise the group is one
    flat node, ``(1, P, why)``, ``why`` naming the hosts and their ranks (``""`` when not flat). Pure, so
    every rank derives the same."""
    world = len(places)
    hosts = list(dict.fromkeys(p.host for p in places))
    if len(hosts) <= 1:
        return 1, world, ""
    per_node = world // len(hosts)
    if any(sum(p.host == h for p in places) != per_node for h in hosts):
        return 1, world, f"the hosts hold unequal numbers of ranks ({hosts_text(places)})"
    if any(places[r].host != hosts[r // per_node] for r in range(world)):
        return 1, world, f"the ranks of a host are not consecutive group ranks ({hosts_text(places)})"
    return len(hosts), per_node, ""


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


__all__ = ["HOST_ENV", "Place", "exchange", "here", "host_name", "hosts_text", "node_shape", "refuse_nccl_sharing",
           "shared_devices", "sharers"]
