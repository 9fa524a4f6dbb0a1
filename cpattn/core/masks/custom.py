"""Masks given by a predicate (:func:`from_mask_mod`), classified from their dense form."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .mask import Mask


class MaskModMask(Mask):
    """A mask given by ``fn(q_idx, kv_idx) -> bool tensor`` (FlexAttention convention).

    Classification evaluates ``fn`` on the rectangle only, in row chunks, so memory stays bounded; time
    is O(rows x columns), so prefer a built-in mask (or a combination of them) at long sequence lengths.
    """

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], name: str = "mask_mod",
                 is_causal: bool = False) -> None:
        if not callable(fn):
            raise TypeError(f"from_mask_mod expects a callable fn(q_idx, kv_idx), got {type(fn).__name__}")
        self.fn = fn
        self.name = name
        self.is_causal = is_causal

    def mask_mod(self, q_idx, kv_idx):
        return self.fn(q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"MaskModMask(name={self.name!r})"
