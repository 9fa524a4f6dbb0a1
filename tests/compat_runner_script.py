"""A script in a framework's shape: it imports ring_flash_attn and yunchang itself and knows nothing of cpattn.
tests/test_compat_runner.py runs it unmodified under ``torchrun ... -m cpattn.compat --as ring_flash_attn,yunchang``.

``--exit CODE``: exit with CODE right after parsing (no attention). Otherwise both ranks run yunchang's
``LongContextAttention`` (zigzag) and ring-flash-attn's ``zigzag_ring_flash_attn_func`` on their zigzag chunks of
one causal problem, compare each with a float64 softmax of the whole sequence and print
``rank R: ok <modules> <argv>``."""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from ring_flash_attn import zigzag_ring_flash_attn_func
from yunchang import LongContextAttention, set_seq_parallel_pg

parser = argparse.ArgumentParser()
parser.add_argument("--exit", type=int, default=None)
parser.add_argument("--tag", default="")
args = parser.parse_args()
if args.exit is not None:
    sys.exit(args.exit)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
gen = torch.Generator().manual_seed(7)
q, k, v = (torch.randn(1, 8 * world, 4, 8, generator=gen) for _ in range(3))
seq = q.shape[1]
scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 8 ** -0.5
scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
reference = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.double())

chunk = seq // (2 * world)
idx = torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                 torch.arange((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk)])
local = [t[:, idx] for t in (q, k, v)]
set_seq_parallel_pg(1, world, rank, world)
out_yunchang = LongContextAttention(ring_impl_type="zigzag")(*local, causal=True)
out_ring = zigzag_ring_flash_attn_func(*local, causal=True)
for out in (out_yunchang, out_ring):
    assert (out.double() - reference[:, idx]).abs().max() < 1e-5
modules = " ".join(sys.modules[name].__name__ for name in ("ring_flash_attn", "yunchang"))
print(f"rank {rank}: ok {modules} {sys.argv[1:]}", flush=True)
dist.destroy_process_group()
