"""A training step of a decoder at scale: step time and MFU from the attention estimate (pure).

One step trains one sequence of ``seq_len`` tokens per data-parallel replica; each replica is a
context-parallel group of ``cp`` devices, and ``dp`` replicas make the world. Per device:

    dense      = 6 * matmul_params * (seq_len / cp) / (peak * matmul_efficiency)
    attention  = layers * estimate(schedule, Problem(seq_len, cp, mask, 1, heads, kv_heads, head_dim)).total
    grad_sync  = all-reduce of the gradients (``grad_bytes`` per parameter) over the dp replicas, priced
                 by ``cost.collectives.op_time`` on the topology of one data-parallel group
                 (:func:`dp_group`: its devices on their nodes, each node's NICs shared by the groups
                 that run at the same time); hidden behind the backward (two thirds of dense +
                 attention) up to that time, the rest exposed
    step       = dense + attention + exposed grad_sync
    MFU        = model FLOPs per device / (step * peak)

with model FLOPs per token = 6 N + 12 layers heads head_dim pairs / seq_len (``pairs``: what the mask
computes), the accounting of ``cpattn.models.flops``. Data loading, the optimizer step, activation
recomputation and pipeline or tensor parallelism are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.masks import Mask, resolve
from ..core.steps import CommOp, Problem
from ..core.topology import Link, Topology
from .collectives import op_time
from .estimate import estimate

#: fraction of the step's compute that is backward (2 of 3 matmul FLOPs), behind which grad sync hides
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class DecoderShape:
    """What the step model needs of a decoder: ``matmul_params`` (weights of its matmuls, N in 6N),
    ``params`` (every parameter, for the gradient all-reduce)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    matmul_params: int
    params: int


@dataclass(frozen=True)
class StepEstimate:
    """Seconds per step and their parts, model FLOPs per device and MFU."""

    schedule: str
    step: float
    dense: float
    attention: float
    grad_sync: float
    grad_sync_exposed: float
    model_flops_per_device: float
    mfu: float
    tokens_per_s: float


def dp_group(world: Topology, cp: int) -> Topology:
    """The topology one gradient all-reduce runs on: the ``world.world // cp`` devices that hold the same
    context-parallel rank of every replica (ranks r, r + cp, r + 2 cp, ... of ``world``, replicas being
    contiguous), placed on their nodes. Every node runs the all-reduces of all its groups at once, so each
    group gets the node's NIC bandwidth divided by the groups on it; inside a node it uses ``world.intra``.
    ``world``: the topology of all cp x dp devices (e.g. ``preset(name, cp * dp)``)."""
    if not isinstance(cp, int) or cp < 1 or world.world % cp:
        raise ValueError(f"cp must be a positive int dividing the world of {world.world} devices, got {cp!r}")
    dp, per_node = world.world // cp, world.devices_per_node
    if cp % per_node and per_node % cp:
        raise ValueError(f"cp={cp} must divide, or be a multiple of, the {per_node} devices per node")
    members = max(1, per_node // cp)  # devices of one group on a node
    groups = per_node // members  # groups sharing a node's NICs
    share = world.inter.bandwidth * world.nics_per_node / groups
    return Topology(max(1, dp // members), min(members, dp), intra=world.intra,
                    inter=Link(world.inter.latency, share), nics_per_node=1, device=world.device,
                    overlap=world.overlap, op_links=world.op_links, algorithm=world.algorithm,
                    name=f"{world.name} dp group")


def step_estimate(shape: DecoderShape, seq_len: int, cp: int, dp: int, mask: Mask | str, schedule: str,
                  topology: Topology, peak_flops: float, matmul_efficiency: float,
                  dp_topology: Topology | None = None, dtype: str = "bfloat16", grad_bytes: int = 2) -> StepEstimate:
    """The step of :mod:`this model <cpattn.cost.training>` on a ``topology`` of ``cp`` devices (one
    context-parallel group; every replica is alike). ``dp_topology``: the ``dp`` devices of one gradient
    all-reduce (:func:`dp_group` of the whole world's topology); by default ``dp_group`` of ``dp``
    copies of ``topology``'s nodes, i.e. each replica on nodes of its own."""
    if not 0 < matmul_efficiency <= 1:
        raise ValueError(f"matmul_efficiency must be in (0, 1], got {matmul_efficiency!r}")
    if topology.world != cp:
        raise ValueError(f"the topology has {topology.world} devices, cp={cp}")
    if dp_topology is None:
        dp_topology = dp_group(replace(topology, nodes=topology.nodes * dp), cp)
    if dp_topology.world != dp:
        raise ValueError(f"dp_topology has {dp_topology.world} devices, dp={dp}")
    mask = resolve(mask)
    problem = Problem(seq_len, cp, mask, 1, shape.heads, shape.kv_heads, shape.head_dim, dtype)
    attention = shape.layers * estimate(schedule, problem, topology, "forward+backward").total
    tokens = seq_len // cp
    dense = 6 * shape.matmul_params * tokens / (peak_flops * matmul_efficiency)
    sync = op_time(CommOp("all_reduce", shape.params * grad_bytes), dp_topology) if dp > 1 else 0.0
    exposed = max(0.0, sync - BACKWARD_SHARE * (dense + attention))
    step = dense + attention + exposed
    pairs = mask.count(0, seq_len, 0, seq_len)
    per_token = 6 * shape.matmul_params + 12 * shape.layers * shape.heads * shape.head_dim * pairs / seq_len
    flops = per_token * tokens
    return StepEstimate(schedule, step, dense, attention, sync, exposed, flops, flops / (step * peak_flops),
                        seq_len * dp / step)


__all__ = ["BACKWARD_SHARE", "DecoderShape", "StepEstimate", "dp_group", "step_estimate"]
