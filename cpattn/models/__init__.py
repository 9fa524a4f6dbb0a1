"""Reference models whose attention is one call into :meth:`cpattn.ContextParallel.attention`.

Not imported by ``import cpattn``; use ``import cpattn.models``. See docs/models.md.
"""

from .flops import llama_flops_per_token, matmul_param_count, param_count, vit_flops_per_token
from .llama import LLAMA_CONFIGS, Llama, LlamaConfig
from .vit import VIT_CONFIGS, ViT, ViTConfig, patchify, unpatchify

__all__ = [
    "LLAMA_CONFIGS",
    "VIT_CONFIGS",
    "Llama",
    "LlamaConfig",
    "ViT",
    "ViTConfig",
    "llama_flops_per_token",
    "matmul_param_count",
    "param_count",
    "patchify",
    "unpatchify",
    "vit_flops_per_token",
]
