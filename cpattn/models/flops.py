"""Parameter counts and training FLOPs per token of the reference models (pure arithmetic on configs).

Training FLOPs per token = ``6 * matmul_param_count(config)`` (forward 2, backward 4 per weight)
plus attention: ``3 * 4 * layers * heads * head_dim * allowed_pairs / seq_len`` (forward: 2 FLOPs per
head channel for each score of ``q k^T`` and 2 for each product of ``p v``; the backward twice that),
where ``allowed_pairs`` counts the (query, key) pairs the mask lets attend, which is what the kernels
compute: ``seq_len * (seq_len + 1) / 2`` for causal, ``seq_len**2`` for full, and
``cpattn.masks.allowed_pairs(mask, seq_len)`` for any mask. Element-wise work (norms, activations,
softmax, RoPE) is not counted, as in the usual model-FLOPs-utilisation accounting.

The matmul parameters are the weights that multiply activations: attention and MLP projections, the
output head (Llama; counted even when tied to the embedding, since the matmul happens), the patch
embedding and the head (ViT). The token embedding is a lookup and is left out, as are norm weights
and biases.
"""

from __future__ import annotations

import re

from .llama import LlamaConfig
from .vit import ViTConfig


def _block_matmul_params(dim: int, heads: int, kv_heads: int, ffn_dim: int) -> int:
    head_dim = dim // heads
    attention = 2 * dim * heads * head_dim + 2 * dim * kv_heads * head_dim  # wq, wo; wk, wv
    return attention + 3 * dim * ffn_dim  # SwiGLU: w1, w3, w2


def matmul_param_count(config: LlamaConfig | ViTConfig) -> int:
    """Weights that multiply activations (see the module docstring), the ``N`` of ``6 N`` FLOPs per token."""
    c = config
    blocks = c.layers * _block_matmul_params(c.dim, c.heads, c.kv_heads, c.ffn_dim)
    if isinstance(c, LlamaConfig):
        return blocks + c.dim * c.vocab
    if isinstance(c, ViTConfig):
        return blocks + 2 * c.patch_dim * c.dim
    raise TypeError(f"expected a LlamaConfig or ViTConfig, got {type(config).__name__}")


def param_count(config: LlamaConfig | ViTConfig) -> int:
    """Every trainable parameter of the model built from ``config`` (a tied head counted once)."""
    c = config
    matmul, norms = matmul_param_count(c), c.layers * 2 * c.dim + c.dim
    if isinstance(c, LlamaConfig):  # the token embedding, unless the head is it
        return matmul + norms + (0 if c.tie_embeddings else c.vocab * c.dim)
    return matmul + norms + c.dim + c.patch_dim  # the ViT's embedding and head biases


def _attention_flops_per_token(layers: int, heads: int, head_dim: int, seq_len: int, allowed_pairs: int) -> float:
    if allowed_pairs < 0 or allowed_pairs > seq_len * seq_len:
        raise ValueError(f"allowed_pairs must be in [0, seq_len**2 = {seq_len * seq_len}], got {allowed_pairs}")
    return 3 * 4 * layers * heads * head_dim * allowed_pairs / seq_len


def llama_flops_per_token(config: LlamaConfig, seq_len: int, allowed_pairs: int | None = None) -> float:
    """Training (forward + backward) FLOPs per token of a :class:`Llama` step over ``seq_len`` tokens;
    ``allowed_pairs`` defaults to causal, ``seq_len * (seq_len + 1) // 2``."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    pairs = seq_len * (seq_len + 1) // 2 if allowed_pairs is None else allowed_pairs
    attention = _attention_flops_per_token(config.layers, config.heads, config.head_dim, seq_len, pairs)
    return 6 * matmul_param_count(config) + attention


def vit_flops_per_token(config: ViTConfig, seq_len: int | None = None, allowed_pairs: int | None = None) -> float:
    """Training FLOPs per patch token of a :class:`ViT` step; ``seq_len`` is the number of patches
    (``config.n_patches``, the default), ``allowed_pairs`` defaults to full, ``seq_len**2``."""
    n = config.n_patches if seq_len is None else seq_len
    if n != config.n_patches:
        raise ValueError(f"seq_len ({n}) must be the number of patches ({config.n_patches})")
    pairs = n * n if allowed_pairs is None else allowed_pairs
    attention = _attention_flops_per_token(config.layers, config.heads, config.dim // config.heads, n, pairs)
    return 6 * matmul_param_count(config) + attention


#: dense (no sparsity) bfloat16 tensor-core peaks from the vendors' data sheets, TFLOP/s per device as
#: torch sees it (an MI250X package is two devices); ``(pattern, device, TFLOP/s)``, the first pattern
#: that matches ``torch.cuda.get_device_name()`` wins (docs/models.md)
BF16_PEAK_TFLOPS: tuple[tuple[str, str, float], ...] = (
    (r"\bH100\b.*\bNVL\b", "H100 NVL", 835.5),
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe", 756.5),
    (r"\bH100\b", "H100 SXM5", 989.5),
    (r"\bH200\b.*\bNVL\b", "H200 NVL", 835.5),
    (r"\bG?H200\b", "H200 SXM / GH200", 989.5),
    (r"\bA100\b", "A100", 312.0),
    (r"\bL4\b", "L4", 121.0),
    (r"\bMI300X\b", "MI300X", 1307.4),
    (r"\bMI250X\b", "MI250X (one GCD)", 191.5),
)


def datasheet_peak(device_name: str) -> tuple[str, float] | None:
    """``(device, FLOP/s)``: the data-sheet dense bfloat16 peak of the device named ``device_name``
    (:data:`BF16_PEAK_TFLOPS`), or None for a device the table does not hold."""
    for pattern, device, tflops in BF16_PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return device, tflops * 1e12
    return None
