"""Cluster topology: how ranks map to nodes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """``nodes`` x ``devices_per_node`` ranks; rank r lives on node r // devices_per_node."""

    nodes: int
    devices_per_node: int

    def __post_init__(self) -> None:
        for field_name in ("nodes", "devices_per_node"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology.{field_name} must be a positive int, got {value!r}")

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def local_index(self, rank: int) -> int:
        return rank % self.devices_per_node
