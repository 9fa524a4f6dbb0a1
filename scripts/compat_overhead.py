#!/usr/bin/env python
"""The host work of the ring-flash-attn stand-in (``cpattn.compat.ring_flash_attn``) against its attention time,
at P ranks of this machine (gloo, ``cpattn.launcher.LocalWorld``).

For each entry point (``ring_flash_attn_func``, ``zigzag_ring_flash_attn_varlen_func``,
``llama3_flash_attn_varlen_func`` as the Hugging Face adapter calls it):

- per call: the compat's own host work, outside ``ContextParallel.attention`` (finding the object, checking
  the prepared values, reshaping), timed with the attention replaced by a stub, median of many calls;
- per step: the work of a new step's documents (``update_ring_flash_attn_params`` and the first call,
  which makes the step's ``ContextParallel``: one small exchange between the ranks), also with the stub;
- the attention itself: one forward + backward of ``cp.attention`` on the same inputs, and the agreement
  its first call with a new object makes (``check="first"``), which a new step's documents add.

Usage: ``python scripts/compat_overhead.py [--world 2] [--seq 16384] [--heads 8] [--kv-heads 2] [--dim 64]``;
prints one JSON object per rank (docs/compat.md records a run)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import torch.distributed as dist

import cpattn.compat

cpattn.compat.install("ring_flash_attn")

import ring_flash_attn  # noqa: E402  (cpattn's)
from ring_flash_attn.adapters import hf_adapter  # noqa: E402

from cpattn import functional  # noqa: E402
from cpattn.api import ContextParallel  # noqa: E402
from cpattn.compat.ring_flash_attn import _calls  # noqa: E402

CALLS = 200


def _documents(seq: int, multiple: int, seed: int) -> list[int]:
    """Packed documents of 1 to 2,000 tokens (each a multiple of ``multiple``) filling ``seq`` tokens."""
    rng, left, lengths = random.Random(seed), seq, []
    while left:
        n = min(left, multiple * rng.randint(1, 2000 // multiple))
        lengths.append(n)
        left -= n
    return lengths


def _stub(self, q, k, v, softmax_scale=None, return_lse=False, **kwargs):
    out = torch.empty_like(q)
    return (out, q.new_empty(q.shape[0], q.shape[2], q.shape[1])) if return_lse else out


def _median_ms(fn, calls: int = CALLS) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure(seq: int, heads: int, kv_heads: int, dim: int) -> dict:
    """This rank's numbers, in milliseconds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = seq // world
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(n, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    found = {}
    real = ContextParallel.attention

    # batch: ring_flash_attn_func on [1, s_local, h, d]
    qb, kb, vb = q[None], k[None], v[None]
    ring_flash_attn.ring_flash_attn_func(qb, kb, vb, causal=True)  # makes the object
    cp = next(reversed(functional._CACHE._items.values()))
    found["ring_flash_attn_func"] = {"object": cp}

    # zigzag varlen: a step's documents, each a multiple of 2P
    lengths = _documents(seq, 2 * world, 1)
    local = torch.tensor([0, *torch.tensor([m // world for m in lengths]).cumsum(0).tolist()], dtype=torch.int32)
    args = (local, max(lengths) // world)

    # llama3 as the adapter: documents of any length
    glob_lengths = _documents(seq, 1, 2)
    cu = torch.tensor([0, *torch.tensor(glob_lengths).cumsum(0).tolist()], dtype=torch.int32)

    ContextParallel.attention = _stub
    try:
        found["ring_flash_attn_func"]["call_ms"] = _median_ms(
            lambda: ring_flash_attn.ring_flash_attn_func(qb, kb, vb, causal=True))
        dist.barrier()  # the step's first call waits for every rank (its object is made collectively)
        t0 = time.perf_counter()
        ring_flash_attn.zigzag_ring_flash_attn_varlen_func(q, k, v, *args, causal=True)
        zig_step = 1e3 * (time.perf_counter() - t0)
        found["zigzag_ring_flash_attn_varlen_func"] = {
            "step_ms": zig_step, "documents": len(lengths),
            "call_ms": _median_ms(lambda: ring_flash_attn.zigzag_ring_flash_attn_varlen_func(q, k, v, *args,
                                                                                            causal=True)),
            "object": next(reversed(_calls._OBJECTS._items.values()))}
        dist.barrier()
        t0 = time.perf_counter()
        hf_adapter.update_ring_flash_attn_params(cu, None)
        p = hf_adapter.DATA_PARAMS

        def call():
            return ring_flash_attn.llama3_flash_attn_varlen_func(
                q, k, v, p["cu_seqlens_q"], p["cu_seqlens_k"], p["max_seqlen_q"], p["max_seqlen_k"], 1,
                p["local_k_slice"], causal=True)

        call()
        found["llama3_flash_attn_varlen_func"] = {
            "step_ms": 1e3 * (time.perf_counter() - t0), "documents": len(glob_lengths), "call_ms": _median_ms(call),
            "object": next(reversed(_calls._OBJECTS._items.values()))}
    finally:
        ContextParallel.attention = real

    for entry in found.values():
        cp = entry.pop("object")
        shaped = [t[None] for t in (q, k, v)]
        dist.barrier()
        t0 = time.perf_counter()
        cp._agree_on_call(*shaped, None)  # what a new object's first attention call adds (check="first")
        entry["first_call_agreement_ms"] = 1e3 * (time.perf_counter() - t0)
        for _ in range(2):  # the second run is timed (the first warms up the kernels and caches)
            shaped = [t[None].clone().requires_grad_() for t in (q, k, v)]
            dist.barrier()
            t0 = time.perf_counter()
            out = cp.attention(*shaped)
            out.backward(torch.ones_like(out))
            entry["attention_ms"] = 1e3 * (time.perf_counter() - t0)
        entry["call_share"] = entry["call_ms"] / entry["attention_ms"]
        if "step_ms" in entry:
            entry["step_share"] = (entry["step_ms"] + entry["first_call_agreement_ms"]) / entry["attention_ms"]
    return {"rank": rank, "world": world, "seq": seq, **found}


def main() -> None:
    from cpattn.launcher import LocalWorld

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    a = parser.parse_args()
    world = LocalWorld(a.world, threads=max(1, (torch.get_num_threads() or 1) // a.world))
    try:
        for r in world.run("compat_overhead.measure", timeout=3600, seq=a.seq, heads=a.heads, kv_heads=a.kv_heads,
                           dim=a.dim):
            print(json.dumps(r if isinstance(r, dict) else {"error": str(r)}))
    finally:
        world.close()


if __name__ == "__main__":
    main()
