"""Inference over a key/value cache sharded across a context-parallel group: the two choices the runtime
makes (``cpattn.inference``) and the prefill / decode predictions of ``cpattn simulate --inference``
(pure: data in, data out).

**Decode merge.** Each of the P ranks attends the new tokens' queries (``b`` rows of ``h`` heads,
replicated on every rank) to its own cache shard; the partials ``(out, lse)`` merge exactly by
log-sum-exp in one of two ways (``a`` = 4 bytes per float32 accumulator element; payloads in
``cpattn.core.comm`` units):

- ``all_reduce``: an all-reduce (max) of the lse, ``b h a`` bytes, then one (sum) of the rescaled
  numerator and denominator packed, ``b h (d + 1) a``; each counts ``2 (P-1) / P`` of its bytes both ways.
- ``all_gather``: one all-gather of ``(out, lse)`` packed, ``b h (d + 1) a`` per rank, then every rank
  merges the P partials; ``(P-1) b h (d + 1) a`` both ways.

:func:`choose_decode_merge` takes the one with the smaller predicted time on the topology
(``collectives.op_time``): the all-gather makes one call of P-1 latency steps, the all-reduces two
calls whose latency grows as log P under a tree algorithm, so small groups gather and large ones
reduce.

**Multi-turn prefill** (new prompt tokens on top of a cache): the new tokens are sharded like a fresh
prompt; their attention among themselves runs on the ContextParallel's schedule, and their attention
to the cache by one of (``s`` new tokens per rank, ``n`` cached tokens on the fullest rank, ``e`` bytes
per element):

- ``pass_q``: an all-gather of the new queries (``s h d e`` per rank); every rank attends them to its
  shard; an all-reduce (max) of their lse (``P s h a``); a reduce-scatter of the packed numerator and
  denominator back to the queries' owners (``s h (d + 1) a`` each); sends ``(P-1) s h d e + 2 (P-1) s h
  a + (P-1) s h (d + 1) a``.
- ``pass_kv``: an all-gather of the cached keys and values (``2 n h_kv d e``, padded to the fullest
  rank); every rank attends its own new queries to the whole cache; sends ``(P-1) 2 n h_kv d e``.

Both compute the same pairs, so :func:`choose_extend` compares the communication only: queries move
when the cache is large next to the new tokens (``s h < 2 n h_kv`` roughly), keys and values when it
is not (Meta's context-parallel inference study, 2024, picks between its pass-Q and pass-KV rings by
the same ratio).

**Simulated inference** (:func:`prefill_estimate`, :func:`decode_estimate`): a decoder on ``cp x tp``
devices, tensor parallelism (``tp``) inside each context-parallel rank (heads and weights split
``tp`` ways), the context-parallel group one device per TP group (:func:`cp_group`). Prefill per
device: ``layers x estimate(schedule, forward)`` of the attention (the schedule's steps on the CP
group, ``heads / tp`` heads), the dense layers at ``2 N tokens / cp / tp / (peak x efficiency)``, and
two all-reduces of the activations per layer across the TP group (not overlapped). Decode per token:
the weights read once (``N e_w / tp / memory bandwidth``, memory-bound), each layer's cache shard read
once (``n / cp`` tokens), the layer's merge (above) on the CP group and the TP all-reduces of one
token's activations. Not modelled: sampling, the embedding lookup, kernel fusion, speculative decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.steps import CommOp, Problem, payload
from ..core.topology import Topology
from .collectives import op_time
from .estimate import estimate
from .training import dp_group

#: the two ways partial decode results merge (``cpattn.inference``)
MERGES = ("all_reduce", "all_gather")
#: the two ways new prompt tokens attend an existing cache
EXTENDS = ("pass_q", "pass_kv")
#: bytes of a float32 accumulator element (partial outputs, lse)
ACC = 4


def decode_merge_ops(merge: str, rows: int, heads: int, head_dim: int) -> list[CommOp]:
    """The collectives one layer's decode merge issues for ``rows`` query rows (new tokens) of ``heads``
    heads (see the module docstring)."""
    per_row = rows * heads * ACC
    if merge == "all_reduce":
        return [CommOp("all_reduce", per_row), CommOp("all_reduce", per_row * (head_dim + 1))]
    if merge == "all_gather":
        return [CommOp("all_gather", per_row * (head_dim + 1))]
    raise ValueError(f"merge={merge!r} is unknown; accepted: {', '.join(MERGES)}")


def _payload(ops: list[CommOp], world: int) -> int:
    """Bytes one rank sends for ``ops`` (``cpattn.core.comm`` accounting)."""
    return sum(payload(op.op, op.bytes, world, 0)[0] for op in ops)


def _faster(ops: dict[str, list[CommOp]], topology: Topology) -> tuple[str, str]:
    """``(best, why)``: of two ways (``{name: the collectives of one layer}``, ties to the first), the one
    with the smaller predicted time on ``topology`` (its world is the group); ``why`` gives both
    predictions and payloads."""
    world = topology.world
    times = {name: sum(op_time(op, topology) for op in way) for name, way in ops.items()}
    best = min(ops, key=lambda name: times[name])
    other = next(name for name in ops if name != best)
    return best, (f"{best}: {times[best] * 1e6:.3g} us per layer (sends {_payload(ops[best], world)} B) against "
                  f"{other} {times[other] * 1e6:.3g} us ({_payload(ops[other], world)} B) on {topology.name}, "
                  f"{world} ranks")


def choose_decode_merge(topology: Topology, rows: int, heads: int, head_dim: int) -> tuple[str, str]:
    """``(merge, why)``: the decode merge with the smaller predicted time per layer on ``topology`` (its
    world is the group), ties to ``all_reduce``; ``why`` gives both predictions and payloads."""
    if topology.world == 1:
        return "all_reduce", "one rank: nothing to merge"
    best, why = _faster({m: decode_merge_ops(m, rows, heads, head_dim) for m in MERGES}, topology)
    return best, f"{why}, {rows} x {heads} query rows"


def extend_ops(how: str, world: int, new_per_rank: int, cached_per_rank: int, heads: int, kv_heads: int,
               head_dim: int, elem: int) -> list[CommOp]:
    """The collectives one layer of a multi-turn prefill issues to attend the cache (see the module
    docstring). ``new_per_rank``: new tokens per rank (padding included); ``cached_per_rank``: cached
    tokens on the fullest rank."""
    s, n, p = new_per_rank, cached_per_rank, world
    if how == "pass_q":
        return [CommOp("all_gather", s * heads * head_dim * elem), CommOp("all_reduce", p * s * heads * ACC),
                CommOp("reduce_scatter", s * heads * (head_dim + 1) * ACC)]
    if how == "pass_kv":
        return [CommOp("all_gather", 2 * n * kv_heads * head_dim * elem)]
    raise ValueError(f"extend={how!r} is unknown; accepted: {', '.join(EXTENDS)}")


def choose_extend(topology: Topology, new_per_rank: int, cached_per_rank: int, heads: int, kv_heads: int,
                  head_dim: int, elem: int) -> tuple[str, str]:
    """``(how, why)``: ``pass_q`` or ``pass_kv``, whichever moves its bytes faster on ``topology`` (both
    compute the same pairs); ties to ``pass_q``."""
    world = topology.world
    if world == 1:
        return "pass_q", "one rank: the cache is local"
    ops = {h: extend_ops(h, world, new_per_rank, cached_per_rank, heads, kv_heads, head_dim, elem) for h in EXTENDS}
    best, why = _faster(ops, topology)
    return best, (f"{why}: {new_per_rank} new tokens of {heads} query heads per rank against {cached_per_rank} "
                  f"cached tokens of {kv_heads} key/value heads")


# ---------------------------------------------------------------------- simulated inference
@dataclass(frozen=True)
class ModelShape:
    """What the inference model needs of a decoder: ``matmul_params`` (N: weights that multiply
    activations), ``hidden`` (the residual width, for the TP all-reduces)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    matmul_params: int


@dataclass(frozen=True)
class PrefillEstimate:
    """Seconds of one prefill of ``seq_len`` tokens and its parts; ``flops`` of the whole prefill (2 N per
    token plus the causal attention pairs); ``mfu`` against the dense peak of all devices;
    ``kv_bytes`` of cache per device."""

    schedule: str
    cp: int
    tp: int
    total: float
    attention: float
    dense: float
    tp_comm: float
    flops: float
    mfu: float
    kv_bytes: int
    note: str = ""


@dataclass(frozen=True)
class DecodeEstimate:
    """Seconds per generated token (batch ``rows``) at a context of ``context`` tokens and its parts."""

    merge: str
    cp: int
    tp: int
    total: float
    weights: float
    attention: float
    merge_comm: float
    tp_comm: float
    bytes_per_layer: int
    chosen: bool


def cp_group(world: Topology, tp: int) -> Topology:
    """The topology of one context-parallel group when ``world`` holds ``cp x tp`` devices, tensor
    parallelism innermost: ranks ``t, t + tp, t + 2 tp, ...`` (the groups of every ``t`` run at once and
    share their nodes' NICs), as :func:`cpattn.cost.training.dp_group` places them."""
    per_node = world.devices_per_node
    if tp % per_node and per_node % tp:
        raise ValueError(f"tp={tp} must divide, or be a multiple of, the {per_node} devices per node")
    return dp_group(world, tp)


def _tp_comm(shape: ModelShape, world: Topology, tp: int, tokens: int, elem: int) -> float:
    """Seconds of a layer's two all-reduces of ``tokens`` tokens' activations across one TP group, ``tp``
    devices of a node (NVLink-class link); 0 without tensor parallelism."""
    if tp == 1:
        return 0.0
    if tp > world.devices_per_node:
        raise ValueError(f"tp={tp} spans more than the {world.devices_per_node} devices of a node")
    group = Topology(1, tp, intra=world.intra, inter=world.inter, device=world.device, algorithm=world.algorithm,
                     name=f"{world.name} tp group")
    return 2 * shape.layers * op_time(CommOp("all_reduce", tokens * shape.hidden * elem), group)


def _cp_group(cp: int, tp: int, shape: ModelShape, world: Topology) -> Topology:
    """:func:`cp_group` of ``world``, once ``cp`` and ``tp`` fit ``shape`` and ``world``."""
    for name, value in (("cp", cp), ("tp", tp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if shape.heads % tp or shape.kv_heads % tp and tp % shape.kv_heads:
        raise ValueError(f"tp={tp} must divide heads={shape.heads} and divide or be a multiple of "
                         f"kv_heads={shape.kv_heads}")
    if world.world != cp * tp:
        raise ValueError(f"the topology has {world.world} devices, cp x tp = {cp * tp}")
    return cp_group(world, tp)


def kv_bytes_per_device(shape: ModelShape, context: int, cp: int, tp: int, elem: int = 2) -> int:
    """Cache bytes per device: ``layers x 2 x context / cp x max(1, kv_heads / tp) x head_dim x elem``
    (a key/value head is replicated when tp exceeds kv_heads)."""
    return shape.layers * 2 * math.ceil(context / cp) * max(1, shape.kv_heads // tp) * shape.head_dim * elem


def prefill_estimate(shape: ModelShape, seq_len: int, cp: int, tp: int, schedule: str, world: Topology,
                     peak_flops: float, matmul_efficiency: float, dtype: str = "bfloat16") -> PrefillEstimate:
    """One prefill of ``seq_len`` tokens (causal) on ``world``, a topology of ``cp x tp`` devices (see the
    module docstring)."""
    group = _cp_group(cp, tp, shape, world)
    heads, kv_heads = shape.heads // tp, max(1, shape.kv_heads // tp)
    problem = Problem(seq_len, cp, "causal", 1, heads, kv_heads, shape.head_dim, dtype,
                      padded_len=math.ceil(seq_len / (2 * cp)) * 2 * cp)
    attention = shape.layers * estimate(schedule, problem, group, "forward").total
    tokens = problem.padded_len // cp
    dense = 2 * shape.matmul_params * tokens / tp / (peak_flops * matmul_efficiency)
    elem = problem.elem
    tp_comm = _tp_comm(shape, world, tp, tokens, elem)
    total = attention + dense + tp_comm
    pairs = seq_len * (seq_len + 1) // 2
    flops = 2 * shape.matmul_params * seq_len + 4 * shape.layers * shape.heads * shape.head_dim * pairs
    return PrefillEstimate(schedule, cp, tp, total, attention, dense, tp_comm, flops,
                           flops / (total * cp * tp * peak_flops), kv_bytes_per_device(shape, seq_len, cp, tp, elem))


def decode_estimate(shape: ModelShape, context: int, cp: int, tp: int, world: Topology, rows: int = 1,
                    weight_bytes: int = 2, elem: int = 2) -> list[DecodeEstimate]:
    """Per-token decode latency at ``context`` cached tokens, one estimate per merge (``chosen``: the one
    :func:`choose_decode_merge` picks)."""
    group = _cp_group(cp, tp, shape, world)
    dev = world.device
    heads, kv_heads = shape.heads // tp, max(1, shape.kv_heads // tp)
    weights = shape.matmul_params * weight_bytes / tp / dev.memory_bandwidth
    shard = math.ceil(context / cp) * 2 * kv_heads * shape.head_dim * elem
    attention = shape.layers * (shard / dev.memory_bandwidth + dev.launch)
    tp_comm = _tp_comm(shape, world, tp, rows, elem)
    chosen, _ = choose_decode_merge(group, rows, heads, shape.head_dim)
    out = []
    for merge in MERGES:
        ops = decode_merge_ops(merge, rows, heads, shape.head_dim)
        comm = shape.layers * sum(op_time(op, group) for op in ops) if cp > 1 else 0.0
        sent = _payload(ops, cp) if cp > 1 else 0
        out.append(DecodeEstimate(merge, cp, tp, weights + attention + comm + tp_comm, weights, attention, comm,
                                  tp_comm, sent, merge == chosen))
    return out


def parallel_efficiency(single: float, parallel: float, cp: int) -> float:
    """``T(cp = 1) / (cp x T(cp))``: 1 for perfect strong scaling of the prefill."""
    return single / (cp * parallel)


__all__ = ["ACC", "EXTENDS", "MERGES", "DecodeEstimate", "ModelShape", "PrefillEstimate",
           "choose_decode_merge", "choose_extend", "cp_group", "decode_estimate", "decode_merge_ops", "extend_ops",
           "kv_bytes_per_device", "parallel_efficiency", "prefill_estimate"]
