"""ring-flash-attn's helpers for code that merges partial results itself: :func:`update_out_and_lse` (on
cpattn's one merge, ``cpattn.core.merge``) and :func:`get_default_args`."""

from __future__ import annotations

import functools
import inspect

import torch

from ...core.merge import merge_into

__all__ = ["update_out_and_lse", "get_default_args"]


def update_out_and_lse(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
                       block_lse: torch.Tensor, slice_=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge one partial result into the running one, in ring-flash-attn's layout: ``out`` float32 ``[b, s, h,
    d]`` (or ``[total, h, d]``), ``lse [b, s, h, 1]`` (or ``[total, h, 1]``), ``block_out`` like ``out`` in any
    dtype, ``block_lse [b, h, s]`` (or ``[h, total]``), natural log. The first call passes ``out = lse = None``
    and gets ``block_out`` as float32 and ``block_lse`` in the running layout. Without ``slice_`` the merged
    tensors are new ones; with ``slice_`` (an index of ``out``'s rows, e.g. ``(slice(None), slice(s // 2,
    None))``) the rows it selects are merged in place and ``out``, ``lse`` returned. A row whose lse is -inf
    (no key) takes nothing from that side."""
    if out is None:
        if slice_ is not None:
            raise RuntimeError("first update_out_and_lse should not pass slice_ args")
        return block_out.to(torch.float32), block_lse.transpose(-2, -1).unsqueeze(dim=-1)
    if slice_ is not None:
        rows_out, rows_lse = out[slice_], lse[slice_]
        rows_out, rows_lse = update_out_and_lse(rows_out, rows_lse, block_out, block_lse)
        out[slice_], lse[slice_] = rows_out, rows_lse
        return out, lse
    merged_out, merged_lse = out.clone(), lse.clone()
    packed = merged_out.dim() == 3  # [total, h, d]: one row of a batch
    running_out = merged_out.unsqueeze(0) if packed else merged_out
    running_lse = merged_lse.squeeze(-1).unsqueeze(0) if packed else merged_lse.squeeze(-1)  # [b, s, h]
    block = block_out.to(merged_out.dtype)
    merge_into(running_out, running_lse.transpose(1, 2), block.unsqueeze(0) if packed else block,
               (block_lse.unsqueeze(0) if packed else block_lse).to(merged_lse.dtype))
    return merged_out, merged_lse


@functools.cache
def _defaults(func) -> dict:
    params = inspect.signature(func).parameters.values()
    args = {p.name: (None if p.default is inspect.Parameter.empty else p.default) for p in params
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    if "softcap" in args:
        args["softcap"] = 0.0
    return args


def get_default_args(func) -> dict:
    """Every positional argument of ``func`` by name, with its default (None where it has none; ``softcap``:
    0.0), as ring-flash-attn passes them to flash-attn's kernels. A ``torch.library`` custom op is read through
    the function it was made from (``_init_fn``). The dict is cached per function: copy it before changing it."""
    return _defaults(func if inspect.isfunction(func) else func._init_fn)
