"""yunchang's process groups: :func:`set_seq_parallel_pg` splits each sequence-parallel block of ranks into
Ulysses groups and ring groups, with yunchang 0.6.4's rank sets, and records them in :data:`PROCESS_GROUP`.

A block of ``sp = ulysses_degree x ring_degree`` consecutive ranks (``world_size / sp`` data-parallel
blocks). ``use_ulysses_low=True``: a Ulysses group is ``ulysses_degree`` consecutive ranks and a ring
group takes every ``ulysses_degree``-th rank; ``False``: a ring group is ``ring_degree`` consecutive ranks and
a Ulysses group takes every ``ring_degree``-th rank. cpattn also records the block's own group and every
member's (ring rank, Ulysses rank), which decide the tokens each rank holds (``docs/compat.md``).
"""

from __future__ import annotations

import torch.distributed as dist

from ...core.comm import HeldGroup


class Singleton:
    """One instance per class: every construction returns it."""

    _instance = None

    def __new__(cls, *args, **kwargs):
        if not cls._instance:
            cls._instance = super().__new__(cls)
        return cls._instance


class Grid:
    """A sequence-parallel block: its process group, its degrees, and each member's (ring rank, Ulysses rank),
    members in the group's rank order (ascending global ranks); this rank's Ulysses and ring groups. The
    groups are held weakly (:class:`cpattn.core.comm.HeldGroup`): torch.distributed owns them."""

    group = HeldGroup()
    ulysses_group = HeldGroup()
    ring_group = HeldGroup()

    def __init__(self, group, ulysses_degree: int, ring_degree: int, coords: tuple[tuple[int, int], ...],
                 ulysses_group=None, ring_group=None) -> None:
        self.group, self.ulysses_group, self.ring_group = group, ulysses_group, ring_group
        self.ulysses_degree, self.ring_degree, self.coords = ulysses_degree, ring_degree, coords


class ProcessGroupSingleton(Singleton):
    """``ULYSSES_PG`` and ``RING_PG`` of this rank (None until :func:`set_seq_parallel_pg`), held weakly."""

    ULYSSES_PG = HeldGroup()
    RING_PG = HeldGroup()

    def __init__(self):
        self.ULYSSES_PG = None
        self.RING_PG = None
        self.grid: Grid | None = None


PROCESS_GROUP = ProcessGroupSingleton()


def coordinates(position: int, sp_ulysses_degree: int, sp_ring_degree: int, use_ulysses_low: bool) -> tuple[int, int]:
    """(ring rank, Ulysses rank) of the rank at ``position`` in its sequence-parallel block."""
    if use_ulysses_low:
        return position // sp_ulysses_degree, position % sp_ulysses_degree
    return position % sp_ring_degree, position // sp_ring_degree


def group_ranks(sp_ulysses_degree: int, sp_ring_degree: int, world_size: int,
                use_ulysses_low: bool = True) -> tuple[list[list[int]], list[list[int]]]:
    """Every Ulysses group's and every ring group's global ranks, in the order the groups are made."""
    sp = sp_ulysses_degree * sp_ring_degree
    ulysses: list[list[int]] = []
    ring: list[list[int]] = []
    for offset in range(0, world_size, sp):
        block = [coordinates(p, sp_ulysses_degree, sp_ring_degree, use_ulysses_low) for p in range(sp)]
        ulysses += [[offset + p for p in range(sp) if block[p][0] == r] for r in range(sp_ring_degree)]
        ring += [[offset + p for p in range(sp) if block[p][1] == u] for u in range(sp_ulysses_degree)]
    return ulysses, ring


def set_seq_parallel_pg(sp_ulysses_degree, sp_ring_degree, rank, world_size, use_ulysses_low=True):
    """Make the Ulysses and ring groups of ``sp_ulysses_degree x sp_ring_degree`` (collective over the world:
    every rank calls it alike) and set :data:`PROCESS_GROUP` to this ``rank``'s."""
    for name, value in (("sp_ulysses_degree", sp_ulysses_degree), ("sp_ring_degree", sp_ring_degree),
                        ("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"set_seq_parallel_pg: {name} must be an int, got {value!r}")
    sp = sp_ulysses_degree * sp_ring_degree
    if sp_ulysses_degree < 1 or sp_ring_degree < 1 or world_size % sp:
        raise ValueError(f"set_seq_parallel_pg: sp_ulysses_degree x sp_ring_degree = {sp_ulysses_degree} x "
                         f"{sp_ring_degree} must divide world_size={world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"set_seq_parallel_pg: rank={rank} must lie in [0, world_size={world_size})")
    ulysses, ring = group_ranks(sp_ulysses_degree, sp_ring_degree, world_size, use_ulysses_low)
    blocks = [list(range(o, o + sp)) for o in range(0, world_size, sp)]
    made = {}
    for kind, sets in (("ulysses", ulysses), ("ring", ring), ("block", blocks)):
        for ranks in sets:  # every rank makes every group, in the same order (new_group is collective)
            group = dist.new_group(ranks)
            if rank in ranks:
                made[kind] = group
    coords = tuple(coordinates(p, sp_ulysses_degree, sp_ring_degree, bool(use_ulysses_low)) for p in range(sp))
    PROCESS_GROUP.ULYSSES_PG = made["ulysses"]
    PROCESS_GROUP.RING_PG = made["ring"]
    PROCESS_GROUP.grid = Grid(made["block"], sp_ulysses_degree, sp_ring_degree, coords, made["ulysses"], made["ring"])
