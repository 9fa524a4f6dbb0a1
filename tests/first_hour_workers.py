"""Worker functions for tests/test_first_hour.py: ``cp.attention(..., qkv_format="bhsd")`` on ``[b, h, s, d]``
tensors against a float64 reference that shares no code with cpattn (plain softmax with autograd)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cpattn


def reference(q, k, v, dout, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Causal attention of ``[b, s, h, d]`` tensors (key/value heads repeated for GQA) in ``dtype``, with
    autograd: out, dq, dk, dv."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    n, g = q.shape[1], q.shape[2] // k.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) * q.shape[3] ** -0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v.repeat_interleave(g, 2))
    out.backward(dout.to(dtype))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    return err if err == err else float("inf")  # NaN never passes


def heads_first(schedule: str = "zigzag_ring", seq: int = 64, seed: int = 0) -> dict:
    """Causal attention with GQA (8 query heads, 2 key/value heads) given as ``[b, h, s, d]`` with
    ``qkv_format="bhsd"``, forward and backward, on every rank of the world. Returns the relative errors
    of out, dq, dk, dv against float64, the same errors of single-device float32 attention (the
    tolerance's base), whether out and the gradients equal those of the same call in ``[b, s, h, d]``
    bit for bit, the shapes of out and lse, and the message a whole-sequence tensor gets."""
    gen = torch.Generator().manual_seed(seed)
    b, h, hkv, d = 2, 8, 2, 16
    q, dout = (torch.randn(b, seq, h, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, seq, hkv, d, generator=gen) for _ in range(2))
    ref = reference(q, k, v, dout)
    local = reference(q, k, v, dout, torch.float32)
    cp = cpattn.ContextParallel(seq, "causal", schedule=schedule)

    def run(fmt: str) -> dict[str, torch.Tensor]:
        dim = 2 if fmt == "bhsd" else 1
        tensors = [t.transpose(1, 2).contiguous() if fmt == "bhsd" else t for t in (q, k, v, dout)]
        ql, kl, vl, dl = (cp.shard(t, dim=dim) for t in tensors)
        ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
        out, lse = cp.attention(ql, kl, vl, return_lse=True, qkv_format=fmt)
        out.backward(dl)
        back = (lambda t: t.transpose(1, 2)) if fmt == "bhsd" else (lambda t: t)
        got = {"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
        return {"shapes": (tuple(out.shape), tuple(lse.shape)),
                **{key: back(cp.unshard(t, dim=dim)) for key, t in got.items()}}

    bhsd, bshd = run("bhsd"), run("bshd")
    message = ""
    try:  # the whole sequence, not this rank's part: every rank raises the same error
        cp.attention(*(t.transpose(1, 2) for t in (q, k, v)), qkv_format="bhsd")
    except ValueError as exc:
        message = str(exc)
    keys = ("out", "dq", "dk", "dv")
    return {"rank": dist.get_rank() if dist.is_initialized() else 0, "world": cp.world_size,
            "errors": {key: _rel(bhsd[key], ref[key]) for key in keys},
            "local": {key: _rel(local[key], ref[key]) for key in keys},
            "same_as_bshd": all(torch.equal(bhsd[key], bshd[key]) for key in keys),
            "shapes": bhsd["shapes"], "local_len": cp.local_len, "message": message}
