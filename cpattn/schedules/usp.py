"""USP (unified sequence parallelism): Ulysses inside groups of D ranks, a ring across the groups.

The P ranks form R = P / D Ulysses groups of consecutive ranks: rank r = i*D + u is member u of group
i. Forward: inside each group, the Ulysses all-to-all (``ulysses.py``) gives every member the group's
whole token span (its members' local tokens, in order) for h/D of the heads; then the ranks with the
same u across the groups (u, D + u, 2D + u, ...) run the ring of ``ring.py`` on those head-split
tensors, so each attends its group's queries to every group's keys under the mask; the all-to-all
back restores the sequence split. Backward mirrors it: dout to the head split, the backward ring
(dk/dv travel with their kv), dq and dk/dv back.

Degree D: the ``ulysses_degree`` given to the constructor, else, with a topology, the largest divisor
of the devices per node that divides the heads (Ulysses inside a node, the ring across nodes), else
the largest divisor of P that divides the heads. D = P is Ulysses, D = 1 the ring. Everything runs
on the schedule's own process group: a group's all-to-all is batched point-to-point among its members
(no sub-groups to create), and the ring sends point-to-point to ring neighbours.

Per rank: the Ulysses exchanges of degree D (see ``ulysses.py``; point-to-point when D < P) plus the
ring of R ranks carrying the head-split kv (2 b D s K d elements, K kv heads per member) and float32
dk/dv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.steps import Problem, Step
from ..core.topology import Topology
from .base import Runtime, Schedule
from .ulysses import KEEPS, check_heads, divisors, head_split_steps, saved_like, transforms


@dataclass(frozen=True, eq=False)
class USPSchedule(Schedule):
    """``ulysses_degree``: the Ulysses group size D (None: chosen per problem, see the module doc)."""

    ulysses_degree: int | None = None
    name = "usp"
    layout = "contiguous"
    masks = "any"
    custom_layout = True
    balances_documents = True
    memory = "O(local), 2 kv buffers, head-split q, kv, out kept for the backward"
    summary = "Ulysses all-to-all inside groups (a node with a topology) x ring across them"

    def __post_init__(self) -> None:
        d = self.ulysses_degree
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"ulysses_degree must be a positive int or None, got {d!r}")

    def degree(self, heads: int, world: int, topology: Topology | None = None) -> int:
        """The Ulysses degree D for ``heads`` query heads on ``world`` ranks (see the module doc)."""
        if self.ulysses_degree is not None:
            return self.ulysses_degree
        span = topology.devices_per_node if topology is not None and topology.world == world else world
        return max(d for d in divisors(heads, span) if span % d == 0)

    def check_shape(self, q: torch.Tensor, k: torch.Tensor, world: int) -> None:
        d = self.ulysses_degree
        if d is not None:
            if world % d:
                raise ValueError(f"{self.name}: ulysses_degree={d} must divide the group size {world}")
            check_heads(self.name, q.shape[2], d, world)

    keeps = KEEPS

    def saved_like(self, q, k, world, topology=None):
        return saved_like(q, k, self.degree(q.shape[2], world, topology))

    def local_fns(self, rt: Runtime, q, k):
        d = self.degree(q.shape[2], rt.world, rt.topology)
        return transforms(q, k, d, rt.sinks, rt.rank % d)

    def steps(self, problem: Problem, phase: str, topology: Topology | None = None) -> list[Step]:
        """The Ulysses exchanges of degree D, the ring across the P / D groups, the exchanges back
        (:func:`~cpattn.schedules.ulysses.head_split_steps`). With ``topology``, D comes from its devices
        per node and the point-to-point exchanges of a strict subset run inside a node when D divides
        the devices per node."""
        d = self.degree(problem.heads, problem.world, topology)
        group = "node" if topology is not None and topology.devices_per_node % d == 0 else "world"
        return head_split_steps(problem, phase, d, self.name, group)
