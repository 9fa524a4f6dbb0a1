"""A script tests/test_faults.py runs under torchrun (2 processes, gloo on the CPU).

``python -m torch.distributed.run --nproc-per-node 2 tests/torchrun_fault.py MODE``:

- ``exact``: causal ``ring`` attention of seeded float32 inputs, forward and backward, against a
  float64 reference computed here (plain softmax with autograd); each rank prints
  ``rank R exact ERR local ELOCAL finite BOOL`` (ELOCAL: the error of single-device float32 attention)
  and the run exits 0.
- ``fault``: the same, then a second call whose forward every rank issues; rank 1 then prints
  ``rank 1 exits at T`` (``time.time()``) and exits at once (``os._exit(3)``) while rank 0 runs the
  backward, which blocks on rank 1 until the backend notices it is gone.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch

import cpattn
import cpattn.distributed

SEQ, HEADS, KV_HEADS, DIM = 64, 4, 2, 16


def reference(q, k, v, dout):
    """float64 causal attention with autograd: out and (dq, dk, dv)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) / math.sqrt(q.shape[-1])
    allowed = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(g, 2))
    out.backward(dout.double())
    return out.detach(), (q.grad, k.grad, v.grad)


def single_device(q, k, v, dout):
    """float32 causal attention of the whole sequence on one device (torch's SDPA): out and grads."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=True, enable_gqa=True).transpose(1, 2)
    out.backward(dout)
    return out.detach(), (q.grad, k.grad, v.grad)


def rel_err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(float((a.double() - b).norm() / b.norm()) for a, b in zip(got, ref, strict=True))


def say(line: str) -> None:
    """One line to stdout in one write: both ranks share torchrun's stdout, and a line written in two
    pieces (text, then newline) can be split by the other rank's line."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def main(mode: str) -> None:
    rank, world, local_rank, device = cpattn.distributed.init()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(1, SEQ, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)]
    cp = cpattn.ContextParallel(SEQ, "causal", "ring")
    q, k, v = (cp.shard(t).to(device).requires_grad_() for t in full[:3])
    out = cp.attention(q, k, v)
    out.backward(cp.shard(full[3]).to(device))
    ref_out, ref_grads = reference(*full)
    local_out, local_grads = single_device(*full)
    got = [cp.unshard(t.detach().cpu()) for t in (out, q.grad, k.grad, v.grad)]
    err, e_local = rel_err(got, [ref_out, *ref_grads]), rel_err([local_out, *local_grads], [ref_out, *ref_grads])
    finite = all(bool(t.isfinite().all()) for t in got)
    say(f"rank {rank} exact {err:.3e} local {e_local:.3e} finite {finite}")
    if mode == "fault":
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = cp.attention(q, k, v)
        if rank == 1:
            say(f"rank 1 exits at {time.time():.3f}")
            os._exit(3)
        out.sum().backward()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
