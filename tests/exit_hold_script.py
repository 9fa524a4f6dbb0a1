"""The end of a training script, run by tests/test_clean_exit.py on two processes with the torchrun
environment set (gloo on the CPU): one causal ``zigzag_ring`` forward and backward and an ``unshard``,
with the ``ContextParallel``, its outputs and their autograd graph left in globals, as scripts leave
them, and the group left to cpattn's exit hook.

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
print(f"rank {RANK}: attention done, gloo threads running: {_gloo_threads()}", file=sys.stderr, flush=True)
