"""Rank functions of tests/test_timeline.py (importable by the gloo workers)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cpattn
from cpattn.core import trace


def ring_step(schedule: str = "ring", seq: int = 64) -> dict:
    """One forward and backward under ``trace.recording()`` alone, then one under a recording and a
    timeline together: both recordings, and the timeline."""
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, seq, h, 16, generator=g) for h in (4, 2, 2, 4))
    cp = cpattn.ContextParallel(seq, "causal", schedule)
    q, k, v, dout = (cp.shard(t) for t in (q, k, v, dout))

    def step() -> None:
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        cp.attention(qq, kk, vv).backward(dout)

    step()  # first-call costs (agreement) out of the way
    with trace.recording() as plain:
        step()
    dist.barrier()
    with trace.recording() as both, trace.timeline() as tl:
        tl.mark("step")
        step()
        tl.mark("end")
    return {"rank": cp.rank, "plain": plain, "both": both, "timeline": tl.as_dict()}
