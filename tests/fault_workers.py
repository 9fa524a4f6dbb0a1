"""Functions tests/test_faults.py runs on worker processes (module-level, so spawned workers import
them): a rank that dies in the middle of an attention call, and attention on non-finite inputs and
on masks with empty rows."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import cpattn

#: problem size of the non-finite and empty-row cases: [batch, seq, heads, head_dim], kv heads (GQA)
SEQ, HEADS, KV_HEADS, DIM = 64, 4, 2, 16


def exit_mid_call(rank: int, seq_len: int = 64, schedule: str = "ring", code: int = 3) -> str:
    """Every rank issues the forward of a causal attention; ``rank`` then exits at once (``os._exit``)
    while the others run the backward, which blocks on the lost rank."""
    cp = cpattn.ContextParallel(seq_len, "causal", schedule)
    g = torch.Generator().manual_seed(11)
    q, k, v = (cp.shard(torch.randn(1, seq_len, 2, 16, generator=g)).requires_grad_() for _ in range(3))
    out = cp.attention(q, k, v)
    if dist.get_rank() == rank:
        os._exit(code)
    out.sum().backward()
    return "backward finished"


def stall_collective(rank: int, seconds: float) -> dict:
    """``rank`` sleeps ``seconds`` and never joins; the others all-reduce and report how long the
    call took to fail and with what (the process-group timeout bounds it)."""
    if dist.get_rank() == rank:
        time.sleep(seconds)
        return {"elapsed": None, "error": None}
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except Exception as exc:  # the point: report the backend's error
        return {"elapsed": time.monotonic() - t0, "error": f"{type(exc).__name__}: {exc}"}
    return {"elapsed": time.monotonic() - t0, "error": None}


def exit_while_others_sleep(rank: int, seconds: float, code: int = 3) -> None:
    """``rank`` exits at once; the others sleep ``seconds`` outside any collective."""
    if dist.get_rank() == rank:
        os._exit(code)
    time.sleep(seconds)


def empty_rows(q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """Causal, except that query rows 0-2 (the start of rank 0's shard) and every row = 2 (mod 5)
    attend no key at all."""
    return (kv_idx <= q_idx) & (q_idx >= 3) & (q_idx % 5 != 2)


def _mask(name: str):
    return cpattn.masks.from_mask_mod(empty_rows, name="empty_rows") if name == "empty_rows" else name


def attention_case(schedule: str, mask: str, seed: int, poison: dict | None = None) -> dict | None:
    """Float32 attention of seeded full-sequence inputs (the same on every rank), forward and backward;
    ``poison = {"tensor": "q"|"k"|"v", "index": [b, s, h, d], "value": float}`` sets one element first.
    Rank 0 returns the inputs and the unsharded out, lse, dq, dk, dv (others None)."""
    g = torch.Generator().manual_seed(seed)
    full = {"q": torch.randn(1, SEQ, HEADS, DIM, generator=g),
            "k": torch.randn(1, SEQ, KV_HEADS, DIM, generator=g),
            "v": torch.randn(1, SEQ, KV_HEADS, DIM, generator=g)}
    dout = torch.randn(1, SEQ, HEADS, DIM, generator=g)
    if poison:
        full[poison["tensor"]][tuple(poison["index"])] = poison["value"]
    cp = cpattn.ContextParallel(SEQ, _mask(mask), schedule)
    q, k, v = (cp.shard(full[n]).requires_grad_() for n in ("q", "k", "v"))
    out, lse = cp.attention(q, k, v, return_lse=True)
    out.backward(cp.shard(dout))
    res = {"out": cp.unshard(out.detach()), "lse": cp.unshard(lse.detach(), dim=2),
           "dq": cp.unshard(q.grad), "dk": cp.unshard(k.grad), "dv": cp.unshard(v.grad)}
    if dist.get_rank() != 0:
        return None
    return {**res, **full, "dout": dout}
