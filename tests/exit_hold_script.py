"""The end of a training script, run by tests/test_clean_exit.py on two processes with the torchrun
environment set (gloo on the CPU): one causal ``zigzag_ring`` forward and backward and an ``unshard``,
then the same through ``zigzag_ring_attn_func`` and ring-flash-attn's and yunchang's stand-ins (yunchang's
groups made by ``set_seq_parallel_pg``), with the ``ContextParallel``, the layer, the outputs and their
autograd graphs left in globals, as scripts leave them, and the groups left to cpattn's exit hook.

A process group must end in that hook, while the interpreter is whole: a group that something still
holds lives on into interpreter teardown, where its gloo worker threads can abort the process
("terminate called without an active exception") after a run that succeeded. A hook registered before
``cpattn.distributed.init`` runs after cpattn's (atexit runs hooks last in, first out) and prints
``rank R: gloo threads after the exit hook: N`` on stderr (N is 0 once the group has ended).
"""

from __future__ import annotations

import atexit
import os
import sys

import torch


def _gloo_threads() -> int:
    names = (open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task"))
    return sum("gloo" in name for name in names)


def _report() -> None:
    print(f"rank {os.environ['RANK']}: gloo threads after the exit hook: {_gloo_threads()}", file=sys.stderr,
          flush=True)


atexit.register(_report)  # before init: runs after cpattn's hook

import cpattn  # noqa: E402
import cpattn.compat  # noqa: E402
import cpattn.distributed  # noqa: E402

RANK, WORLD, _, _ = cpattn.distributed.init()
S = 128
gen = torch.Generator().manual_seed(0)
q_full, k_full, v_full, dout_full = (torch.randn(1, S, 4, 16, generator=gen) for _ in range(4))
cp = cpattn.ContextParallel(seq_len=S, mask="causal", schedule=sys.argv[1] if len(sys.argv) > 1 else "zigzag_ring")
q, k, v = (cp.shard(t, dim=1).requires_grad_() for t in (q_full, k_full, v_full))
out = cp.attention(q, k, v)
out.backward(cp.shard(dout_full, dim=1))
out_full = cp.unshard(out, dim=1)
# the other ways in keep groups too: the functional entry points, ring-flash-attn's and yunchang's stand-ins
cpattn.compat.install("ring_flash_attn")
cpattn.compat.install("yunchang")
from ring_flash_attn import zigzag_ring_flash_attn_func  # noqa: E402
from yunchang import LongContextAttention, set_seq_parallel_pg  # noqa: E402

out_func = cpattn.zigzag_ring_attn_func(q, k, v, causal=True)
out_rfa = zigzag_ring_flash_attn_func(q, k, v, causal=True)
set_seq_parallel_pg(1, WORLD, RANK, WORLD)
layer = LongContextAttention()
out_yc = layer(q, k, v, causal=True)
(out_func.sum() + out_rfa.sum() + out_yc.sum()).backward()
print(f"rank {RANK}: attention done, gloo threads running: {_gloo_threads()}", file=sys.stderr, flush=True)
