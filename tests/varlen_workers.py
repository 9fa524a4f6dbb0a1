"""Worker functions for the per-step mask (varlen) tests: a ContextParallel built once, then a new
document mask every step through ``with_mask``, each step checked against a float64 reference that
shares no code with cpattn (its mask is built from document ids)."""

from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist

import cpattn


def random_rows(rng: random.Random, rows: int, row_len: int, longest: int) -> list[int]:
    """Document lengths of ``rows`` packed rows of ``row_len`` tokens (1 to ``longest`` tokens each; a
    row is sometimes one document); no document crosses a row."""
    lengths = []
    for _ in range(rows):
        if rng.random() < 0.2:
            lengths.append(row_len)
            continue
        left = row_len
        while left:
            n = min(left, rng.randint(1, longest))
            lengths.append(n)
            left -= n
    return lengths


def reference(q, k, v, dout, lengths: list[int], scale: float) -> dict[str, torch.Tensor]:
    """float64 causal attention inside each document; q [1, S, h, d], k/v [1, S, h_kv, d]. One query
    head at a time, so that long sequences fit in memory."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(doc.numel())
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    outs = []
    for h in range(q.shape[2]):
        scores = torch.einsum("bqd,bkd->bqk", q[:, :, h], k[:, :, h // g]) * scale
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out = torch.einsum("bqk,bkd->bqd", probs, v[:, :, h // g])
        out.backward(dout[:, :, h].double())
        outs.append(out.detach())
    return {"out": torch.stack(outs, dim=2), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def varlen_steps(schedules: list[str], steps: int, rows: int, row_len: int, longest: int, seed: int = 0) -> dict:
    """Per schedule: the largest relative error of out, dq, dk, dv over ``steps`` steps of random
    documents, the host seconds per step of ``with_mask`` + ``shard`` and of the attention."""
    seq = rows * row_len
    heads, kv_heads, dim = 12, 12, 8  # divisible by 2, 3 and 4 ranks (ulysses splits heads)
    scale = dim ** -0.5
    rng = random.Random(seed)
    batches = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(seed * 1000 + step)
        lengths = random_rows(rng, rows, row_len, longest)
        tensors = [torch.randn(1, seq, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads, heads)]
        batches.append((lengths, tensors, reference(*tensors, lengths, scale)))
    report = {}
    for name in schedules:
        cp = cpattn.ContextParallel(seq, "causal", schedule=name)
        worst, view_s, attn_s = 0.0, 0.0, 0.0
        for lengths, (q, k, v, dout), ref in batches:
            t0 = time.perf_counter()
            view = cp.with_mask(cpattn.masks.document(lengths))
            ql, kl, vl, dl = (view.shard(t, dim=1) for t in (q, k, v, dout))
            t1 = time.perf_counter()
            ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
            out = view.attention(ql, kl, vl, softmax_scale=scale)
            out.backward(dl)
            t2 = time.perf_counter()
            view_s, attn_s = view_s + t1 - t0, attn_s + t2 - t1
            keys = ("out", "dq", "dk", "dv")  # one unshard of the four (every head count is the same)
            full = view.unshard(torch.stack([out.detach(), ql.grad, kl.grad, vl.grad]), dim=2).double()
            for key, value in zip(keys, full):
                err = ((value - ref[key]).abs().max() / ref[key].abs().max().clamp(min=1e-12)).item()
                worst = max(worst, err)
        report[name] = {"error": worst, "view_s": view_s / steps, "attention_s": attn_s / steps,
                        "world": dist.get_world_size() if dist.is_initialized() else 1,
                        "layout": view.layout.name, "padded_len": view.padded_len, "base_padded_len": cp.padded_len}
    return report


def view_agreement(mismatch: bool) -> dict:
    """Every rank asks for a view; with ``mismatch`` the last rank's documents differ. Returns what each
    rank got: the error's type and first line, or the view's mask."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cp = cpattn.ContextParallel(64, "causal", schedule="zigzag_ring")
    lengths = [20, 44] if mismatch and rank == world - 1 else [30, 34]
    try:
        view = cp.with_mask(cpattn.masks.document(lengths))
    except Exception as exc:  # noqa: BLE001 (reported to the parent)
        return {"error": type(exc).__name__, "message": str(exc).splitlines()[0]}
    return {"mask": repr(view.mask), "same": cp.with_mask(cpattn.masks.document(lengths)) is view}


def compiled_views(steps: int) -> dict:
    """A block compiled with ``fullgraph=True`` that calls a new per-step view: the graphs it compiled,
    and the largest error against the eager view."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    seq = 64
    cp = cpattn.ContextParallel(seq, "causal", schedule="zigzag_ring")

    def block(x, view):
        return view.attention(x * 2.0, x, x)

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    rng, worst = random.Random(3), 0.0
    for step in range(steps):
        cut = rng.randint(1, seq - 1)
        view = cp.with_mask(cpattn.masks.document([cut, seq - cut]))
        gen = torch.Generator().manual_seed(step)
        x = view.shard(torch.randn(1, seq, 2, 8, generator=gen), dim=1)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_c, out_e = compiled(a, view), block(b, view)
        out_c.sum().backward()
        out_e.sum().backward()
        worst = max(worst, (out_c - out_e).abs().max().item(), (a.grad - b.grad).abs().max().item())
    return {"graphs": counters["stats"]["unique_graphs"], "error": worst}
