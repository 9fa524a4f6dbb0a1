"""Worker functions for the attention-sink tests: every schedule with per-head sink logits against a
float64 reference (the sink as one more softmax column with no value) that shares no code with cpattn."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cpattn
from cpattn import schedules


def reference(q, k, v, s, dout, causal: bool, scale: float, softcap: float | None = None) -> dict[str, torch.Tensor]:
    q, k, v, s = (t.detach().double().requires_grad_() for t in (q, k, v, s))
    n, h = q.shape[1], q.shape[2]
    g = h // k.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    scores = torch.cat([scores, s.view(1, h, 1, 1).expand(q.shape[0], h, n, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :n]
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(g, 2))
    out.backward(dout.double())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "dsinks": s.grad}


def sinks_everywhere(seq: int = 48, seed: int = 0, softcap: float | None = None) -> dict[str, float]:
    """Per registered schedule (causal mask, or full for the bidirectional-only ones): the largest
    relative error of out, dq, dk, dv and of the sinks' gradient summed over the ranks; ``softcap``:
    the scores soft-capped too."""
    world = dist.get_world_size()
    heads, kv_heads, dim, scale = 12, 6, 8, 8 ** -0.5
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(2, seq, heads, dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, seq, kv_heads, dim, generator=gen) for _ in range(2))
    s = torch.randn(heads, generator=gen) * 2
    refs = {c: reference(q, k, v, s, dout, c, scale, softcap) for c in (True, False)}
    errors = {}
    for name in schedules.names():
        causal = schedules.get(name).causal
        cp = cpattn.ContextParallel(seq, "causal" if causal else "full", schedule=name)
        ql, kl, vl, dl = (cp.shard(t, dim=1) for t in (q, k, v, dout))
        ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
        sl = s.clone().requires_grad_()
        out = cp.attention(ql, kl, vl, softmax_scale=scale, sinks=sl, softcap=softcap)
        out.backward(dl)
        dsinks = sl.grad.clone()
        if world > 1:
            dist.all_reduce(dsinks)
        ref = refs[causal]
        got = {key: cp.unshard(t, dim=1) for key, t in (("out", out.detach()), ("dq", ql.grad), ("dk", kl.grad),
                                                          ("dv", vl.grad))}
        got["dsinks"] = dsinks
        errors[name] = max(((got[x].double() - ref[x]).abs().max() / ref[x].abs().max()).item() for x in got)
    return errors
