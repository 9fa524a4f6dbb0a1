"""Exact log-sum-exp combination of partial attention results (docs/ringx.md).

Shapes: ``out [b, s, h, d]`` and ``lse [b, h, s]``, both in the accumulation dtype (float32, or
float64 for float64 inputs). A partial with ``lse = -inf`` (a row that saw no key) contributes
nothing; a row that no partial covers ends with out 0 and lse -inf, never NaN.
"""

from __future__ import annotations

import torch


def _row_weight(lse: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """exp(lse - total) as a ``[b, s, h, 1]`` factor; 0 where total is -inf (no NaN from -inf - -inf)."""
    safe_total = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    return torch.exp(lse - safe_total).transpose(1, 2).unsqueeze(-1)


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Pairwise merge, in place: ``(out, lse) <- (out, lse) (+) (block_out, block_lse)``.

    ``out``/``lse`` may be views (rows of a larger accumulator); the new lse is
    ``logaddexp(lse, block_lse)`` and each side is weighted by ``exp(its lse - new lse)``.
    """
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(_row_weight(lse, new_lse)).add_(block_out * _row_weight(block_lse, new_lse))
    lse.copy_(new_lse)


class PendingMerge:
    """A distributed merge whose reduces are in flight (see :func:`start_distributed_merge`)."""

    def __init__(self, num: torch.Tensor, den: torch.Tensor, m: torch.Tensor, owner: int, comm, handles) -> None:
        self.num, self.den, self.m, self.owner, self.comm, self.handles = num, den, m, owner, comm, handles

    def wait(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Finish the reduces; the owner gets ``(out, lse)`` (fresh tensors), other ranks None."""
        for h in self.handles:
            h.wait()
        if self.comm.rank != self.owner:
            return None
        num, den, m = self.num, self.den, self.m
        uncovered = den == 0  # NaN (from NaN inputs) is covered: it propagates as on one device
        final = torch.where(uncovered, torch.zeros_like(num), num / torch.where(uncovered, torch.ones_like(den), den))
        log_den = torch.log(den.squeeze(-1).transpose(1, 2))  # [b, h, s]; -inf where uncovered
        safe_m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        return final, log_den + safe_m


def start_distributed_merge(out: torch.Tensor, lse: torch.Tensor, owner: int, comm) -> PendingMerge:
    """Merge partials of one query block that live on every rank of ``comm`` onto ``owner``.

    ``M = all_reduce_max(lse)``, ``den = exp(lse - M)``, ``num = out * den``; num and den are
    reduce-summed to ``owner`` (group-relative rank) asynchronously: the returned handle's ``wait()``
    gives the owner ``(num / den, log(den) + M)`` and other ranks None, so a pipelined schedule can
    compute its next block while the reduces travel. Ranks that skipped the block pass
    ``lse = -inf`` and ``out = 0``.
    """
    m = lse.clone()
    comm.all_reduce(m, op="max")
    den = _row_weight(lse, m)  # [b, s, h, 1]; 0 for -inf partials and for rows nobody covered
    num = out * den
    den = den.contiguous()
    handles = (comm.reduce(num, dst=owner, async_op=True), comm.reduce(den, dst=owner, async_op=True))
    return PendingMerge(num, den, m, owner, comm, handles)


def distributed_merge(out: torch.Tensor, lse: torch.Tensor, owner: int,
                      comm) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`start_distributed_merge` and wait: the owner gets ``(out, lse)``, other ranks None."""
    return start_distributed_merge(out, lse, owner, comm).wait()
