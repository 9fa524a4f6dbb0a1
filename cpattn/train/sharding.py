"""Where the training state lives. By default the parameters, gradients and AdamW state are sharded with
FSDP2 (``torch.distributed.fsdp.fully_shard``, each block and then the root) over the *flattened* dp x cp
mesh, as torchtitan's ``dp_shard_cp``: context-parallel ranks hold different tokens of the same
sequences, so for the weights they are data-parallel ranks like any other, and each rank keeps
1 / (dp x cp) of the state (:func:`parallelize`, :class:`_ShardedGrads`). ``fsdp=False`` keeps a full
copy on every rank (replicated), its gradients in one flat buffer summed in place by one all-reduce
(:class:`_ReplicatedGrads`): the reference the sharded run is tested against. ``dtype="bfloat16"`` runs
the forward under bf16 autocast; parameters, gradients, their reduction and the optimizer stay float32.
:func:`state_bytes` counts what a rank holds."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..checkpoint import _local
from .config import TrainConfig


def parallelize(model: torch.nn.Module, cfg: TrainConfig, flat) -> torch.nn.Module:
    """Shard ``model`` with FSDP2 over the flattened dp x cp mesh (``cfg.fsdp``): each block, then the
    root (embedding, final norm, head); every FSDP module sums its gradients over the ranks instead of
    averaging them (the loss is already each rank's share of the global mean) with plain SUM
    collectives (gloo has no pre-multiplied sum). Returns the model (unchanged when not ``cfg.fsdp``)."""
    if not cfg.fsdp:
        return model
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for block in model.layers:
        fully_shard(block, mesh=flat)
    fully_shard(model, mesh=flat)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


class _ShardedGrads:
    """FSDP2 gradients: already summed and sharded by the backward's reduce-scatters."""

    def __init__(self, params: list[torch.nn.Parameter], optim: torch.optim.Optimizer) -> None:
        self.params, self.optim = params, optim

    def sync(self) -> float:
        """The norm of the summed gradient (the same on every rank): one all-reduce of the shards'
        squared norms."""
        sq = sum((_local(p.grad).double().pow(2).sum() for p in self.params if p.grad is not None),
                 torch.zeros((), dtype=torch.float64, device=self.params[0].device))
        dist.all_reduce(sq)
        return float(sq.sqrt())

    def zero(self) -> None:
        self.optim.zero_grad(set_to_none=True)


class _ReplicatedGrads:
    """Replicated gradients: each ``p.grad`` is a view into one flat float32 buffer that the backward
    accumulates into in place, summed over the whole world by one all-reduce (no copies)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            p.grad = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def sync(self) -> float:
        dist.all_reduce(self.flat)
        return float(self.flat.norm())

    def zero(self) -> None:
        self.flat.zero_()


def state_bytes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for the parameters, their gradients and the optimizer state (each storage
    counted once: FSDP2's padded shards, the replicated gradient buffer)."""
    def held(tensors) -> int:
        storages = {}
        for t in tensors:
            if isinstance(t, torch.Tensor):
                s = _local(t).untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        return sum(storages.values())

    params = list(model.parameters())
    return {"params": held(params), "grads": held(p.grad for p in params if p.grad is not None),
            "optimizer": held(v for state in optim.state.values() for v in state.values())}


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole of parameter ``p`` (a sharded one is gathered: collective)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p
