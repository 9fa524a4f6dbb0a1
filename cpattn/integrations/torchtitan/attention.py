"""The inner attention a torchtitan model calls with ``[B, L, N, H]`` tensors (``GQAttention`` passes
this rank's q, k, v after RoPE): ``cp.attention`` on the step's ``ContextParallel`` view, which the
trainer passes as the model's ``attention_masks`` (one object per step: its document mask, its layout
and its group). Under ``torch.compile`` the view is an input of each block, and a new view each step
does not recompile it (the custom op takes its site as a tensor)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.models.common.attention import BaseAttention
from torchtitan.protocols.module import Module

from ...api import ContextParallel


class CpattnAttention(Module):
    """``out [B, L, N, H] = cp.attention(q, k, v)`` over the sequence split across the
    context-parallel ranks; k and v may have fewer heads (GQA: only they travel)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                attention_masks: ContextParallel | None = None, scale: float | None = None,
                **kwargs) -> torch.Tensor:
        if not isinstance(attention_masks, ContextParallel):
            raise TypeError("CpattnAttention needs the step's cpattn.ContextParallel as attention_masks (the "
                            "cpattn torchtitan Trainer passes it), got "
                            f"{type(attention_masks).__name__}")
        return attention_masks.attention(q_BLNH, k_BLNH, v_BLNH, softmax_scale=scale)


def use_cpattn(model_config: Module.Config) -> int:
    """Replace the inner attention of every attention layer of ``model_config`` by
    :class:`CpattnAttention`, in place; returns how many layers were changed."""
    changed = 0
    for _fqn, attention, _parent, _attr in model_config.traverse(BaseAttention.Config):
        attention.inner_attention = CpattnAttention.Config()
        changed += 1
    if not changed:
        raise ValueError(f"{type(model_config).__qualname__} has no attention layer to run on cpattn")
    return changed
