"""Cluster topology: how ranks map to nodes, and the links, NICs and device they run on (pure data).

``Topology(nodes, devices_per_node)`` alone is a valid topology (rank r lives on node
r // devices_per_node, at local index r % devices_per_node) with generic, deliberately modest link and
device figures; the presets in :mod:`cpattn.cost.presets` fill in published ones.

Links are full duplex. ``intra`` is what one device gets to any other device of its node (per
direction); ``inter`` is one NIC (per direction). The node's ``nics_per_node`` NICs are shared by its
devices in rails: local device l uses NIC ``l * nics_per_node // devices_per_node``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .device import Device


@dataclass(frozen=True)
class Link:
    """``latency`` alpha (seconds per message or per collective step) and ``bandwidth`` 1/beta
    (bytes/s per direction)."""

    latency: float
    bandwidth: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"Link.latency must be >= 0 seconds, got {self.latency!r}")
        if not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"Link.bandwidth must be a positive number of bytes/s, got {self.bandwidth!r}")

    def time(self, nbytes: float) -> float:
        """alpha + bytes * beta (seconds)."""
        return self.latency + nbytes / self.bandwidth


#: generic figures for a bare ``Topology(nodes, devices_per_node)``: PCIe-4-class links inside a node
#: (~25 GB/s per direction) and one 100 Gb/s NIC per node; a mid-range accelerator.
GENERIC_INTRA = Link(latency=10e-6, bandwidth=25e9)
GENERIC_INTER = Link(latency=20e-6, bandwidth=12.5e9)
GENERIC_DEVICE = Device("generic", forward_flops=100e12, backward_flops=75e12, memory_bandwidth=1e12,
                        memory=40 * 2**30)


@dataclass(frozen=True)
class Topology:
    """``nodes`` x ``devices_per_node`` ranks; rank r lives on node r // devices_per_node.

    ``intra``/``inter``: :class:`Link` inside a node (per device) and per NIC. ``nics_per_node``: NICs
    shared by a node's devices in rails. ``device``: the :class:`Device` every rank runs on.
    ``overlap``: fraction of the communication a schedule overlaps with compute that actually hides
    (1 on GPUs with separate streams; lower where compute and communication share cores).
    ``op_links``: measured per-op links (``(op, Link)`` pairs, from calibration) that replace ``intra``
    for that op inside a node. ``name``: the preset it came from.
    """

    nodes: int
    devices_per_node: int
    intra: Link = GENERIC_INTRA
    inter: Link = GENERIC_INTER
    nics_per_node: int = 1
    device: Device = GENERIC_DEVICE
    overlap: float = 1.0
    op_links: tuple[tuple[str, Link], ...] = ()
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        for field_name in ("nodes", "devices_per_node", "nics_per_node"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Topology.{field_name} must be a positive int, got {value!r}")
        if not (0.0 <= self.overlap <= 1.0):
            raise ValueError(f"Topology.overlap must be in [0, 1], got {self.overlap!r}")

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def local_index(self, rank: int) -> int:
        return rank % self.devices_per_node

    def nic_of(self, rank: int) -> int:
        """The NIC (0 .. nics_per_node - 1 on its node) that ``rank``'s inter-node traffic uses."""
        return self.local_index(rank) * self.nics_per_node // self.devices_per_node

    def link_for(self, op: str) -> Link:
        """The intra-node link for ``op`` (a measured one when calibration provided it)."""
        return dict(self.op_links).get(op, self.intra)


__all__ = ["GENERIC_DEVICE", "GENERIC_INTER", "GENERIC_INTRA", "Link", "Topology"]
