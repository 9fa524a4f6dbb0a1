"""Worker functions of the sharded key/value cache tests (``cpattn.inference``): prefill, multi-turn prefill
and decoding of random queries, keys and values against a float64 reference that shares no code with
cpattn (each row's causal softmax, its window and sinks written out), and the counted traffic against
the formulas of ``cpattn.cost.inference``."""

from __future__ import annotations

import torch

import cpattn
from cpattn.core import kernels, merge
from cpattn.core.masks import BlockKind
from cpattn.core.steps import payload
from cpattn.cost.inference import decode_merge_ops, extend_ops
from cpattn.inference import KVCache

HEADS, KV_HEADS, DIM = 4, 2, 8
SCALE = DIM ** -0.5


def reference(q, k, v, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """One row: ``q, k, v [1, n, heads, d]`` -> every position's output, float64: softmax over the keys at
    positions <= its own (and > its own - window), plus one sink column per head without a value."""
    q, k, v = (t.double() for t in (q, k, v))
    n, g = q.shape[1], q.shape[2] // k.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) * SCALE
    i = torch.arange(n)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(1, -1, 1, 1).expand(1, q.shape[2], n, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :n]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(g, 2))


def one_device(q, k, v, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """The same row on one device with the local kernel in q's dtype (for e_local)."""
    n = q.shape[1]
    i = torch.arange(n)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    out, lse = kernels.forward(q, k, v, BlockKind.PARTIAL, SCALE, allowed)
    if sinks is not None:
        out, lse = merge.with_sinks(out, lse, sinks)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _sent(ops, world: int, rank: int) -> dict[str, int]:
    out = {"calls": 0, "bytes_sent": 0, "bytes_recv": 0}
    for op in ops:
        sent, recv = payload(op.op, op.bytes, world, rank)
        out["calls"] += 1
        out["bytes_sent"] += sent
        out["bytes_recv"] += recv
    return out


def _chunk(lengths: list[int], schedule: str, window: int | None) -> tuple[cpattn.ContextParallel, object]:
    """The ContextParallel of a packed chunk (one document per row) and the view its layers attend on."""
    mask = "causal" if len(lengths) == 1 else cpattn.masks.document(lengths)
    cp = cpattn.ContextParallel(sum(lengths), mask=mask, schedule=schedule)
    view = cp if window is None else cp.with_mask(cp.mask & cpattn.masks.sliding_window(window))
    return cp, view


def kv_exactness(prompt: list[int], more: list[int], steps: int, schedule: str, merge_how: str = "auto",
                 extend: str = "auto", window: int | None = None, with_sinks: bool = False, seed: int = 0) -> dict:
    """Rows of ``prompt[b]`` prompt tokens, then ``more[b]`` more (multi-turn prefill; none when empty),
    then ``steps`` decoded tokens, through one cache layer at CP = the world size. Returns, per phase,
    the worst relative error against the float64 reference and e_local (one device, float32), the
    counted traffic of the decoding and multi-turn steps against their formulas, and the cache's
    tokens per rank."""
    rows = len(prompt)
    more = more or []
    total = [p + (more[b] if more else 0) + steps for b, p in enumerate(prompt)]
    gen = torch.Generator().manual_seed(seed)
    qs = [torch.randn(1, n, HEADS, DIM, generator=gen) for n in total]
    ks = [torch.randn(1, n, KV_HEADS, DIM, generator=gen) for n in total]
    vs = [torch.randn(1, n, KV_HEADS, DIM, generator=gen) for n in total]
    sinks = torch.randn(HEADS, generator=gen) if with_sinks else None
    refs = [reference(q, k, v, window, sinks) for q, k, v in zip(qs, ks, vs)]
    locals_ = [one_device(q, k, v, window, sinks) for q, k, v in zip(qs, ks, vs)]
    errors: dict[str, list[float]] = {}

    def record(phase: str, got: torch.Tensor, b: int, a: int, z: int) -> None:
        e = errors.setdefault(phase, [0.0, 0.0])
        e[0] = max(e[0], _rel(got, refs[b][:, a:z]))
        e[1] = max(e[1], _rel(locals_[b][:, a:z], refs[b][:, a:z]))

    cp, view = _chunk(prompt, schedule, window)
    world, rank = cp.world_size, cp.rank
    kv = KVCache(cp, layers=1, kv_heads=KV_HEADS, head_dim=DIM, rows=rows, merge=merge_how, extend=extend)
    done = [0] * rows

    def packed(chunk: list[int], ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t[:, done[b]:done[b] + n] for b, (t, n) in enumerate(zip(ts, chunk))], dim=1)

    def unpack(out_full: torch.Tensor, chunk: list[int], phase: str) -> None:
        start = 0
        for b, n in enumerate(chunk):
            record(phase, out_full[:, start:start + n], b, done[b], done[b] + n)
            start += n
            done[b] += n

    # prefill: cp.attention on each rank's tokens, its keys and values kept
    kv.place_prompt(cp, prompt)
    q, k, v = (cp.shard(packed(prompt, ts), dim=1) for ts in (qs, ks, vs))
    out = view.attention(q, k, v, softmax_scale=SCALE, sinks=sinks)
    kv.write(0, k, v)
    unpack(cp.unshard(out, dim=1), prompt, "prefill")
    traffic = {}
    if more:
        cp2, view2 = _chunk(more, schedule, window)
        kv.reset_comm_stats()
        before = max(kv.tokens_per_rank())
        kv.place_prompt(cp2, more)
        q, k, v = (cp2.shard(packed(more, ts), dim=1) for ts in (qs, ks, vs))
        kv.write(0, k, v)
        out = kv.extend_attention(0, view2, q, k, v, softmax_scale=SCALE, window=window, sinks=sinks)
        unpack(cp2.unshard(out, dim=1), more, "extend")
        how = kv.last_extend[0] if kv.last_extend else "none"
        ops = extend_ops(how, world, cp2.local_len, before, HEADS, KV_HEADS, DIM, 4) if world > 1 else []
        traffic["extend"] = (how, {x: kv.comm_stats()["total"][x] for x in ("calls", "bytes_sent", "bytes_recv")},
                             _sent(ops, world, rank))
    kv.reset_comm_stats()
    for _ in range(steps):
        kv.place_decode()
        q = torch.cat([qs[b][:, done[b]:done[b] + 1] for b in range(rows)])  # [rows, 1, h, d]
        k = torch.cat([ks[b][:, done[b]:done[b] + 1] for b in range(rows)])
        v = torch.cat([vs[b][:, done[b]:done[b] + 1] for b in range(rows)])
        kv.write(0, k, v)
        out = kv.decode_attention(0, q, softmax_scale=SCALE, window=window, sinks=sinks)
        for b in range(rows):
            record("decode", out[b:b + 1], b, done[b], done[b] + 1)
            done[b] += 1
    if steps:
        how = kv.last_merge[0] if kv.last_merge else "none"
        ops = decode_merge_ops(how, rows, HEADS, DIM) * steps if world > 1 else []
        traffic["decode"] = (how, {x: kv.comm_stats()["total"][x] for x in ("calls", "bytes_sent", "bytes_recv")},
                             _sent(ops, world, rank))
    return {"errors": errors, "traffic": traffic, "tokens": kv.tokens_per_rank(), "row_lengths": kv.row_lengths(),
            "nbytes": kv.nbytes, "bytes_per_rank": kv.bytes_per_rank(), "shape": list(kv.shape)}


def cache_bytes(prompt: int, layers: int = 2, schedule: str = "zigzag_ring") -> dict:
    """This rank's cache after prefilling ``prompt`` tokens (``layers`` layers of 2 key/value heads of 8,
    float32): its bytes, tokens and shape."""
    cp = cpattn.ContextParallel(prompt, mask="causal", schedule=schedule)
    kv = KVCache(cp, layers=layers, kv_heads=KV_HEADS, head_dim=DIM)
    kv.place_prompt(cp)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, prompt, HEADS, DIM, generator=gen)
    k, v = (torch.randn(1, prompt, KV_HEADS, DIM, generator=gen) for _ in range(2))
    for layer in range(layers):
        kv.prefill(layer, cp, cp.shard(q), cp.shard(k), cp.shard(v))
    return {"nbytes": kv.nbytes, "tokens": kv.tokens, "shape": list(kv.shape), "bytes_per_rank": kv.bytes_per_rank()}
