"""A training step of a decoder at scale: step time and MFU from the attention estimate (pure).

One step trains one sequence of ``seq_len`` tokens per data-parallel replica; each replica is a
context-parallel group of ``cp`` devices, and ``dp`` replicas make the world. Per device:

    dense      = 6 * matmul_params * (seq_len / cp) / (peak * matmul_efficiency)
    attention  = layers * estimate(schedule, Problem(seq_len, cp, mask, 1, heads, kv_heads, head_dim)).total
    grad_sync  = ring all-reduce of the gradients (``grad_bytes`` per parameter) over the dp replicas,
                 each device on its share of its node's NICs; hidden behind the backward (two thirds of
                 dense + attention) up to that time, the rest exposed
    step       = dense + attention + exposed grad_sync
    MFU        = model FLOPs per device / (step * peak)

with model FLOPs per token = 6 N + 12 layers heads head_dim pairs / seq_len (``pairs``: what the mask
computes), the accounting of ``cpattn.models.flops``. Data loading, the optimizer step, activation
recomputation and pipeline or tensor parallelism are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..masks import Mask, resolve
from ..steps import Problem
from ..topology import Topology
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


def step_estimate(shape: DecoderShape, seq_len: int, cp: int, dp: int, mask: Mask | str, schedule: str,
                  topology: Topology, peak_flops: float, matmul_efficiency: float, dp_link_bandwidth: float,
                  dp_link_latency: float, dtype: str = "bfloat16", grad_bytes: int = 2) -> StepEstimate:
    """The step of :mod:`this model <cpattn.cost.training>` on a ``topology`` of ``cp`` devices (one
    context-parallel group; every replica is alike). ``dp_link_*``: what one device gets across nodes
    for the gradient all-reduce (bytes/s, seconds per step of the ring)."""
    if not 0 < matmul_efficiency <= 1:
        raise ValueError(f"matmul_efficiency must be in (0, 1], got {matmul_efficiency!r}")
    if topology.world != cp:
        raise ValueError(f"the topology has {topology.world} devices, cp={cp}")
    mask = resolve(mask)
    problem = Problem(seq_len, cp, mask, 1, shape.heads, shape.kv_heads, shape.head_dim, dtype)
    attention = shape.layers * estimate(schedule, problem, topology, "forward+backward").total
    tokens = seq_len // cp
    dense = 6 * shape.matmul_params * tokens / (peak_flops * matmul_efficiency)
    sync = 0.0
    if dp > 1:
        size = shape.params * grad_bytes
        sync = 2 * (dp - 1) / dp * size / dp_link_bandwidth + 2 * (dp - 1) * dp_link_latency
    exposed = max(0.0, sync - BACKWARD_SHARE * (dense + attention))
    step = dense + attention + exposed
    pairs = mask.count(0, seq_len, 0, seq_len)
    per_token = 6 * shape.matmul_params + 12 * shape.layers * shape.heads * shape.head_dim * pairs / seq_len
    flops = per_token * tokens
    return StepEstimate(schedule, step, dense, attention, sync, exposed, flops, flops / (step * peak_flops),
                        seq_len * dp / step)


__all__ = ["BACKWARD_SHARE", "DecoderShape", "StepEstimate", "step_estimate"]
