"""A user script that fails without destroying its process group; tests/test_clean_exit.py runs it on two
processes with the torchrun environment set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), gloo on the CPU.

Both ranks run one causal ``ring`` attention forward and backward; then rank 0 raises ``RuntimeError``
and rank 1 calls ``sys.exit(3)``, neither calling ``destroy_process_group()``. A hook registered before
``cpattn.distributed.init`` runs after cpattn's own exit hook (atexit runs hooks last in, first out) and
prints ``rank R: group alive at exit: BOOL`` on stderr.
"""

from __future__ import annotations

import atexit
import sys

import torch
import torch.distributed as dist


def _report() -> None:
    print(f"rank {dist.get_rank() if dist.is_initialized() else RANK}: group alive at exit: {dist.is_initialized()}",
          file=sys.stderr, flush=True)


atexit.register(_report)  # before init: runs after cpattn's hook

import cpattn  # noqa: E402
import cpattn.distributed  # noqa: E402

RANK, WORLD, _, _ = cpattn.distributed.init()
cp = cpattn.ContextParallel(seq_len=64, mask="causal", schedule="ring")
q, k, v = (cp.shard(torch.randn(1, 64, 2, 16, generator=torch.Generator().manual_seed(i))).requires_grad_()
           for i in range(3))
cp.attention(q, k, v).sum().backward()
print(f"rank {RANK}: attention done", file=sys.stderr, flush=True)
if RANK == 0:
    raise RuntimeError("the user's own error on rank 0")
sys.exit(3)
