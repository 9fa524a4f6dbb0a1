"""cpattn quick start: causal attention over a sequence split across the ranks, forward and backward,
checked against attention computed by one process.

    torchrun --nproc-per-node 2 examples/quickstart.py

Every rank builds the same full tensors (the same seed on every rank: cpattn never sends them, each rank
just keeps its own shard), runs ``cp.attention`` on its shard, and gathers the results back to compare
them with a plain float64 softmax on the whole sequence. Runs on CPUs (gloo) or GPUs (NCCL, one per rank).
Layout: ``[b, s, h, d]`` (batch, sequence, heads, head dim) for q, k, v and out; ``lse`` is ``[b, h, s]``.
"""

from __future__ import annotations

import argparse

import torch

import cpattn
import cpattn.distributed


def reference(q, k, v, dout, scale: float):
    """One-process causal attention in float64 on the full sequence: ``out [b, s, h, d]``, ``lse [b, h, s]``
    (natural log) and the gradients ``dq [b, s, h, d]``, ``dk, dv [b, s, h_kv, d]`` for the loss whose
    gradient with respect to ``out`` is ``dout``."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]  # query heads per key/value head (GQA)
    kh, vh = (t.repeat_interleave(groups, dim=2) for t in (k, v))  # [b, s, h, d]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kh) * scale  # [b, h, s, s]
    s = q.shape[1]
    allowed = torch.ones(s, s, dtype=torch.bool).tril()  # causal: query i sees keys 0..i
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = scores.logsumexp(dim=-1)  # [b, h, s]
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), vh)  # [b, s, h, d]
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` in the 2-norm, in float64."""
    return ((got.double().cpu() - want).norm() / want.norm()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048, help="global sequence length (default 2048)")
    p.add_argument("--schedule", default="zigzag_ring", help="any of `cpattn schedules` (default zigzag_ring)")
    args = p.parse_args()

    # the default process group from torchrun's environment: NCCL on GPU local_rank, else gloo on the CPU
    rank, world, local_rank, device = cpattn.distributed.init()

    b, s, h, h_kv, d = 1, args.seq, 8, 2, 64  # 8 query heads share 2 key/value heads (GQA)
    g = torch.Generator().manual_seed(0)  # the same seed on every rank: identical full tensors everywhere
    q_full = torch.randn(b, s, h, d, generator=g)  # [b, s, h, d]
    k_full = torch.randn(b, s, h_kv, d, generator=g)  # [b, s, h_kv, d]
    v_full = torch.randn(b, s, h_kv, d, generator=g)  # [b, s, h_kv, d]
    dout_full = torch.randn(b, s, h, d, generator=g)  # d(loss)/d(out), [b, s, h, d]

    cp = cpattn.ContextParallel(seq_len=s, mask="causal", schedule=args.schedule)  # group=None: WORLD
    # this rank's s / world tokens, in the schedule's layout (zigzag_ring: two chunks from opposite ends)
    q, k, v = (cp.shard(t.to(device), dim=1).requires_grad_() for t in (q_full, k_full, v_full))
    out, lse = cp.attention(q, k, v, return_lse=True)  # out [b, s/P, h, d]; lse [b, h, s/P], float32
    out.backward(cp.shard(dout_full.to(device), dim=1))  # q.grad [b, s/P, h, d]; k.grad, v.grad [b, s/P, h_kv, d]

    # every rank gets the full tensors back, in the original token order (unshard is a collective)
    got = {"out": cp.unshard(out.detach(), dim=1),  # [b, s, h, d]
           "lse": cp.unshard(lse, dim=2),  # [b, h, s]: the sequence is lse's dim 2
           "dq": cp.unshard(q.grad, dim=1), "dk": cp.unshard(k.grad, dim=1), "dv": cp.unshard(v.grad, dim=1)}
    want = dict(zip(got, reference(q_full, k_full, v_full, dout_full, d ** -0.5), strict=True))
    errors = {name: rel_error(got[name], want[name]) for name in got}
    if rank == 0:
        print(f"{cp.schedule_name} on {world} ranks ({device.type}), seq {s}, [b, s, h, d] = [{b}, {s}, {h}, {d}], "
              f"{h_kv} key/value heads; tokens of rank 0: {cp.positions()[:4].tolist()} ...")
        print("relative error vs one process (float64): "
              + ", ".join(f"{name} {e:.1e}" for name, e in errors.items()))
        sent = cp.comm_stats()["total"]  # this rank's traffic: bytes and calls
        print(f"rank 0 sent {sent['bytes_sent'] / 2**20:.1f} MiB in {sent['calls']} calls")
    worst = max(errors.values())
    if worst > 1e-4:  # float32 attention: about 1e-6 on a CPU; TF32 on a GPU stays well below the bound
        raise SystemExit(f"rank {rank}: relative error {worst:.1e} above 1e-4")


if __name__ == "__main__":
    main()
