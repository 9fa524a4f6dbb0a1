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


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Final ``(out, lse)`` of rows that also attend a per-head *sink*: a key with logit ``sinks[h]`` and
    no value (gpt-oss's ``s_aux``), merged in last on the row's owner: ``lse' = logaddexp(lse, sink)``
    and ``out' = out * exp(lse - lse')``. ``out [b, s, h, d]``, ``lse [b, h, s]`` (accumulation dtype),
    ``sinks [h]``. A row that saw no key keeps out 0 (its lse becomes the sink's)."""
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    total = torch.logaddexp(lse, sink)
    return out * _row_weight(lse, total).to(out.dtype), total


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Gradient of the sink logits ``sinks [h]`` over these rows, from the final ``out`` and ``lse`` (with
    the sinks) and ``dout``: ``-sum_rows exp(sink - lse) * rowsum(dout * out)`` (the sink's probability
    times the row's ``D``; the sink has no value, so its ``dP`` is 0)."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1).transpose(1, 2)  # [b, h, s]
    p_sink = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)


def merge_weights(out: torch.Tensor, lse: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The terms one rank adds to a distributed merge, given ``m``, the maximum of every rank's
    ``lse``: ``num = out * den`` ``[b, s, h, d]`` and ``den = exp(lse - m)`` ``[b, s, h, 1]``
    (contiguous; 0 for -inf partials and for rows nobody covered)."""
    den = _row_weight(lse, m)
    return out * den, den.contiguous()


def merge_finish(num: torch.Tensor, den: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` from the summed ``num`` and ``den`` of :func:`merge_weights` and the maximum
    ``m``: ``num / den`` and ``log(den) + m``; rows nobody covered get out 0 and lse -inf."""
    uncovered = den == 0  # NaN (from NaN inputs) is covered: it propagates as on one device
    final = torch.where(uncovered, torch.zeros_like(num), num / torch.where(uncovered, torch.ones_like(den), den))
    log_den = torch.log(den.squeeze(-1).transpose(1, 2))  # [b, h, s]; -inf where uncovered
    safe_m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return final, log_den + safe_m
