"""Worker functions for tests/test_memory.py (run on every rank of a persistent world)."""

from __future__ import annotations

import gc

import torch

from cpattn.api import ContextParallel
from cpattn.memory import PeakTracker


def peak_fwd_bwd(schedule: str, seq: int, heads: int, kv_heads: int, head_dim: int, mask: str = "causal") -> dict:
    """Peak live tensor bytes of one forward + backward on this rank (after a warm-up step that builds
    plans and caches), with the bytes of this rank's q and k + v shards. The least of three measured
    steps: a collective's buffer that the process group's worker thread releases a moment after the
    wait returned is counted live a little longer in some steps (the program's peak is the least)."""
    g = torch.Generator().manual_seed(seq)
    cp = ContextParallel(seq, mask, schedule)
    shapes = {"q": (1, seq, heads, head_dim), "k": (1, seq, kv_heads, head_dim), "v": (1, seq, kv_heads, head_dim),
              "dout": (1, seq, heads, head_dim)}
    q, k, v, dout = (cp.shard(torch.randn(*shp, generator=g)) for shp in shapes.values())

    def step() -> None:
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        cp.attention(qq, kk, vv).backward(dout)

    step()
    gc.collect()  # no cycle from the warm-up may be freed inside the measured step
    gc.disable()
    peaks = []
    try:
        for _ in range(3):
            with PeakTracker() as t:
                step()
            peaks.append(t.peak_bytes)
    finally:
        gc.enable()
    return {"peak": min(peaks), "q": q.nbytes, "kv": k.nbytes + v.nbytes}
