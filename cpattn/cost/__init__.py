"""Cost model: topologies (and, later, device models, estimates and the simulator)."""

from .topology import Topology

__all__ = ["Topology"]
