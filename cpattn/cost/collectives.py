"""Time of each communication op on a topology: alpha-beta models of the usual algorithms (pure).

With g ranks in the op's group, alpha the per-step latency, B the bandwidth one rank gets (bytes/s per
direction) and L = ceil(log2 g):

| op | algorithm | seconds |
|---|---|---|
| all_gather, reduce_scatter (n per rank) | ring | (g-1) (alpha + n / B) |
| broadcast, reduce (N) | ring: pipelined chain | (g-1) alpha + N / B |
| | tree: pipelined double binary tree | L alpha + N / B |
| all_reduce (N) | ring: reduce-scatter + all-gather | 2 (g-1) (alpha + N / (g B)) |
| | tree: double binary tree, reduce then broadcast, pipelined | 2 L alpha + 2 N / B |
| all_to_all (N per rank) | pairwise | (g-1) alpha + the busiest link's bytes / its bandwidth |
| sendrecv (n, to rank + k) | one message per rank | alpha + the busiest link's bytes / its bandwidth |
| send / recv (n, one peer) | one message | alpha + n / B of the node's link, or of the network across nodes |
| hierarchical all_gather | rail ring, then node ring | all_gather(n) on each rail + all_gather(nodes n) in the node |
| hierarchical reduce_scatter | node ring, then rail ring | the same two terms |

:func:`algorithm` resolves the topology's choice (``Topology.algorithm``) for broadcast, reduce and
all_reduce: "ring" or "tree" as asked, or for "auto" what NCCL and RCCL run: their tuners evaluate
ring and tree only for all_reduce (broadcast and reduce are always pipelined rings there), and take
the algorithm with the smaller predicted time for that size and group (ties go to the ring). So an
all_reduce goes to the tree while N < g (g-1-L) alpha B (the tree saves latency steps, the ring sends
2 (g-1) N / g instead of about 2 N per rank); broadcast and reduce go to the ring. "tree" (or
"broadcast:tree;reduce:tree") prices a library that has tree broadcasts and reduces (MPI's binomial
and binary trees).

A pipelined chain's latency is the sum of its hops: a chain over a world that spans nodes has
nodes - 1 inter-node hops (contiguous ranks) and g - nodes hops inside nodes, so its alpha term is
(g - nodes) alpha_intra + (nodes - 1) alpha_inter rather than g - 1 inter-node latencies.

Links. A group inside one node uses the intra-node link (or the op's calibrated link). A *world*
collective that spans nodes runs, as NCCL/RCCL do, one ring (channel) per NIC, each leaving the node
through its own NIC and carrying 1/NICs of the data: a rank's share crosses its intra-node link
(intra B) and the node's NICs together (NICs x NIC B), so B = min(intra bandwidth, NICs x NIC
bandwidth), alpha = the inter-node latency. A *rail* group (one rank per node, same local index) runs
its ring concurrently with the node's other rails; each rank's traffic leaves through its NIC
(``Topology.nic_of``), which the rails on it share: B = NIC bandwidth / (busiest NIC's rails), alpha
= the inter-node latency. Point-to-point flows that leave a node are counted per NIC and a NIC serves
its flows one after another (contention).

Flat or two-level all-gather: the flat world ring takes N D - 1 steps at the inter-node latency; the
two levels take (N-1) + (D-1) steps (N nodes of D devices), but the rail level runs at one NIC's share
and the node level does not overlap it. :func:`flat_vs_two_level` gives both times; the two-level one
wins at small messages and many nodes (:func:`two_level_crossover`).
"""

from __future__ import annotations

import math
from collections import Counter

from ..core import steps
from ..core.steps import CommOp
from ..core.topology import ALGORITHM_OPS, Link, Topology

#: the one algorithm of the ops without a choice
FIXED_ALGORITHMS = {"all_gather": "ring", "reduce_scatter": "ring", "all_to_all": "pairwise", "sendrecv": "p2p",
                    "send": "p2p", "recv": "p2p"}


def rails_per_nic(topo: Topology) -> int:
    """Rails (local device indices) sharing the busiest NIC of a node: devices_per_node / nics_per_node
    when they divide, from ``Topology.nic_of``."""
    return max(Counter(topo.nic_of(local) for local in range(topo.devices_per_node)).values())


def _link(op: CommOp, topo: Topology) -> Link:
    """(alpha, B) of a ring or tree over ``op``'s group."""
    if op.group == "node" or topo.nodes == 1:
        return topo.link_for(op.op)
    if op.group == "rail":
        return Link(topo.inter.latency, topo.inter.bandwidth / rails_per_nic(topo))
    return Link(topo.inter.latency, min(topo.intra.bandwidth, topo.nics_per_node * topo.inter.bandwidth))


def _sendrecv(op: CommOp, topo: Topology) -> float:
    """Every rank of the group sends ``op.bytes`` to the rank ``op.peer`` after it (cyclically)."""
    n = op.bytes
    if op.group != "world" or topo.nodes == 1:  # on rails: every rail at once, devices_per_node flows leave each node
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
        link = _link(op, topo)
        return (g - 1) * link.latency + (g - 1) * n / g / link.bandwidth
    d = topo.devices_per_node
    intra = (d - 1) * n / g / topo.intra.bandwidth
    leaving = d * n * (g - d) / g  # bytes each node sends off-node, spread over its NICs
    inter = leaving / (topo.nics_per_node * topo.inter.bandwidth)
    return (g - 1) * topo.inter.latency + max(intra, inter)


def op_times(op: CommOp, topo: Topology) -> tuple[float, float]:
    """``(in flight, at the wait)``: seconds of ``op`` that run asynchronously (and may overlap compute)
    and seconds that run only when it is waited for. A hierarchical collective (``cpattn.core.comm``) keeps
    only its first level in flight (all-gather: the rail level; reduce-scatter: the node level) and runs
    the second inside ``wait()``; every other op is entirely in flight."""
    if op.hierarchical and op.group == "world" and topo.nodes > 1 and topo.devices_per_node > 1:
        rail = op_time(CommOp(op.op, op.bytes, group="rail"), topo)
        node = op_time(CommOp(op.op, op.bytes * topo.nodes, group="node"), topo)
        return (rail, node) if op.op == "all_gather" else (node, rail)
    return op_time(op, topo), 0.0


def op_time(op: CommOp, topo: Topology) -> float:
    """Seconds ``op`` takes on ``topo`` (every rank of its group takes part)."""
    g = steps.group_size(op.group, topo.world, topo)
    if g == 1 or (op.bytes == 0 and op.op != "sendrecv"):
        return 0.0
    if op.hierarchical and op.group == "world" and topo.nodes > 1 and topo.devices_per_node > 1:
        return sum(op_times(op, topo))
    if op.op == "sendrecv":
        return _sendrecv(op, topo)
    if op.op in ("send", "recv"):  # one message to or from one rank: across nodes when there are several
        return (topo.link_for("sendrecv") if topo.nodes == 1 else topo.inter).time(op.bytes)
    if op.op == "all_to_all":
        return _all_to_all(op, topo, g)
    link = _link(op, topo)
    if op.op in ("all_gather", "reduce_scatter"):
        return (g - 1) * link.time(op.bytes)
    return _collective(op.op, algorithm(op, topo), op.bytes, g, link, _chain_latency(op, topo, g))


def _chain_latency(op: CommOp, topo: Topology, g: int) -> float:
    """Sum of the hop latencies of a pipelined chain over ``op``'s group: inside a node (or on a rail)
    every hop has the group link's latency; over a world that spans nodes, nodes - 1 hops cross nodes
    and the others stay inside one."""
    if op.group != "world" or topo.nodes == 1:
        return (g - 1) * _link(op, topo).latency
    return (g - topo.nodes) * topo.link_for(op.op).latency + (topo.nodes - 1) * topo.inter.latency


def _collective(op: str, algo: str, nbytes: int, g: int, link: Link, chain: float | None = None) -> float:
    """Seconds of a broadcast, reduce or all_reduce of ``nbytes`` over ``g`` ranks as a ring or a tree.
    ``chain``: the summed hop latencies of a pipelined chain (default (g-1) alpha)."""
    steps_up = math.ceil(math.log2(g))
    if op == "all_reduce":
        if algo == "ring":
            return 2 * (g - 1) * (link.latency + nbytes / g / link.bandwidth)
        return 2 * steps_up * link.latency + 2 * nbytes / link.bandwidth
    if algo == "ring":
        return ((g - 1) * link.latency if chain is None else chain) + nbytes / link.bandwidth
    return steps_up * link.latency + nbytes / link.bandwidth


def algorithm(op: CommOp, topo: Topology) -> str:
    """The algorithm ``op`` runs on ``topo``, resolved ("ring" or "tree"; never "auto"): the topology's
    choice for broadcast, reduce and all_reduce (``Topology.algorithm_for``); for "auto", what NCCL and
    RCCL run: the ring for broadcast and reduce, and for all_reduce the faster of the two for this size
    and group (ties: the ring). Ops without a choice give their one algorithm (:data:`FIXED_ALGORITHMS`)."""
    if op.op not in ALGORITHM_OPS:
        return FIXED_ALGORITHMS[op.op]
    chosen = topo.algorithm_for(op.op)
    if chosen != "auto":
        return chosen
    g = steps.group_size(op.group, topo.world, topo)
    if g == 1 or op.op != "all_reduce":
        return "ring"
    link = _link(op, topo)
    ring, tree = (_collective(op.op, a, op.bytes, g, link) for a in ("ring", "tree"))
    return "tree" if tree < ring else "ring"


def flat_vs_two_level(op: str, nbytes: int, topo: Topology) -> tuple[float, float]:
    """``(flat, two-level)`` seconds of a world all_gather or reduce_scatter of ``nbytes`` per rank on
    ``topo``: the flat ring over every rank, and the hierarchical collective (both of its levels)."""
    flat = op_time(CommOp(op, nbytes), topo)
    return flat, op_time(CommOp(op, nbytes, hierarchical=True), topo)


def two_level_crossover(topo: Topology, op: str = "all_gather") -> float:
    """The message size per rank (bytes) below which the two-level ``op`` beats the flat ring on
    ``topo``: both times are alpha terms plus bytes over bandwidths (linear in the size), so the two
    lines cross once. 0 when the two-level one never wins (or ``topo`` has one level), ``inf`` when it
    always does."""
    if topo.nodes == 1 or topo.devices_per_node == 1:
        return 0.0
    sizes = (1 << 20, 1 << 21)
    (f1, h1), (f2, h2) = (flat_vs_two_level(op, n, topo) for n in sizes)
    per_byte = ((h2 - h1) - (f2 - f1)) / (sizes[1] - sizes[0])  # what the two levels lose per byte
    saved = (f1 - h1) + per_byte * sizes[0]  # what they save at zero bytes (latency steps)
    if saved <= 0:
        return 0.0
    return math.inf if per_byte <= 0 else saved / per_byte


__all__ = ["FIXED_ALGORITHMS", "algorithm", "flat_vs_two_level", "op_time", "op_times",
           "rails_per_nic", "two_level_crossover"]
