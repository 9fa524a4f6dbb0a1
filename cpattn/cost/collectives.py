"""Time of each communication op on a topology: alpha-beta models of the usual algorithms (pure).

With g ranks in the op's group, alpha the per-step latency and B the bandwidth one rank gets
(bytes/s per direction):

| op | algorithm | seconds |
|---|---|---|
| all_gather, reduce_scatter (n per rank) | ring | (g-1) (alpha + n / B) |
| broadcast, reduce (N) | pipelined tree | ceil(log2 g) alpha + N / B |
| all_reduce (N) | ring (reduce-scatter + all-gather) | 2 (g-1) (alpha + N / (g B)) |
| all_to_all (N per rank) | pairwise | (g-1) alpha + the busiest link's bytes / its bandwidth |
| sendrecv (n, to rank + k) | one message per rank | alpha + the busiest link's bytes / its bandwidth |
| hierarchical all_gather | rail level, then node level | all_gather(n) on each rail + all_gather(nodes n) in the node |
| hierarchical reduce_scatter | node level, then rail level | the same two terms |

A group inside one node uses the intra-node link. A *world* collective that spans nodes runs, as
NCCL/RCCL do, one ring per NIC, each leaving the node through its own NIC: B = min(intra bandwidth,
NICs x NIC bandwidth), alpha = the inter-node latency. A *rail* group (one rank per node, same local
index) runs concurrently with the node's other rails, which share the NICs: B = NIC bandwidth x
min(1, NICs / devices per node). Point-to-point flows that leave a node are counted per NIC and a NIC
serves its flows one after another (contention).
"""

from __future__ import annotations

import math

from .. import steps
from ..steps import CommOp
from ..topology import Link, Topology


def group_size(op: CommOp, topo: Topology) -> int:
    """Ranks in ``op``'s group on ``topo``."""
    return steps.group_size(op.group, topo.world, topo)


def _link(op: CommOp, topo: Topology) -> Link:
    """(alpha, B) of a ring or tree over ``op``'s group."""
    if op.group == "node" or topo.nodes == 1:
        return topo.link_for(op.op)
    if op.group == "rail":
        share = min(1.0, topo.nics_per_node / topo.devices_per_node)
        return Link(topo.inter.latency, topo.inter.bandwidth * share)
    return Link(topo.inter.latency, min(topo.intra.bandwidth, topo.nics_per_node * topo.inter.bandwidth))


def _sendrecv(op: CommOp, topo: Topology) -> float:
    """Every rank of the group sends ``op.bytes`` to the rank ``op.peer`` after it (cyclically)."""
    n = op.bytes
    if op.group == "node" or topo.nodes == 1:
        return topo.link_for("sendrecv").time(n)
    if op.group == "rail":  # every rail at once: devices_per_node flows leave each node
        return _link(op, topo).time(n)
    p, d = topo.world, topo.devices_per_node
    flows_per_nic = [0] * topo.nics_per_node
    intra = False
    for local in range(d):  # node 0 stands for every node: the rank-to-node map is uniform
        dst = (local + op.peer) % p
        if dst // d == 0:
            intra = intra or dst != local
        else:
            flows_per_nic[topo.nic_of(local)] += 1
    busiest = max(flows_per_nic)
    inter_time = topo.inter.latency + busiest * n / topo.inter.bandwidth if busiest else 0.0
    intra_time = topo.intra.time(n) if intra else 0.0
    return max(inter_time, intra_time)


def _all_to_all(op: CommOp, topo: Topology, g: int) -> float:
    n = op.bytes
    if op.group != "world" or topo.nodes == 1:
        link = topo.link_for("all_to_all") if op.group == "node" or topo.nodes == 1 else _link(op, topo)
        return (g - 1) * link.latency + (g - 1) * n / g / link.bandwidth
    d = topo.devices_per_node
    intra = (d - 1) * n / g / topo.intra.bandwidth
    leaving = d * n * (g - d) / g  # bytes each node sends off-node, spread over its NICs
    inter = leaving / (topo.nics_per_node * topo.inter.bandwidth)
    return (g - 1) * topo.inter.latency + max(intra, inter)


def op_times(op: CommOp, topo: Topology) -> tuple[float, float]:
    """``(in flight, at the wait)``: seconds of ``op`` that run asynchronously (and may overlap compute)
    and seconds that run only when it is waited for. A hierarchical collective (``cpattn.comm``) keeps
    only its first level in flight (all-gather: the rail level; reduce-scatter: the node level) and runs
    the second inside ``wait()``; every other op is entirely in flight."""
    if op.hierarchical and op.group == "world" and topo.nodes > 1 and topo.devices_per_node > 1:
        rail = op_time(CommOp(op.op, op.bytes, group="rail"), topo)
        node = op_time(CommOp(op.op, op.bytes * topo.nodes, group="node"), topo)
        return (rail, node) if op.op == "all_gather" else (node, rail)
    return op_time(op, topo), 0.0


def op_time(op: CommOp, topo: Topology) -> float:
    """Seconds ``op`` takes on ``topo`` (every rank of its group takes part)."""
    g = group_size(op, topo)
    if g == 1 or (op.bytes == 0 and op.op != "sendrecv"):
        return 0.0
    if op.hierarchical and op.group == "world" and topo.nodes > 1 and topo.devices_per_node > 1:
        return sum(op_times(op, topo))
    if op.op == "sendrecv":
        return _sendrecv(op, topo)
    if op.op == "all_to_all":
        return _all_to_all(op, topo, g)
    link = _link(op, topo)
    if op.op in ("all_gather", "reduce_scatter"):
        return (g - 1) * link.time(op.bytes)
    if op.op in ("broadcast", "reduce"):
        return math.ceil(math.log2(g)) * link.latency + op.bytes / link.bandwidth
    return 2 * (g - 1) * (link.latency + op.bytes / g / link.bandwidth)  # all_reduce


__all__ = ["group_size", "op_time", "op_times"]
