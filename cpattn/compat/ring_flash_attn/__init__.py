"""ring-flash-attn 0.1.8's public API on cpattn (``docs/compat.md``): the same names, signatures, defaults,
tensor layouts and return values, each function one of cpattn's schedules on the caller's layout (ring ->
``ring``, zigzag -> ``zigzag_ring``, stripe -> ``stripe_ring``, llama3 -> ``allgather``), exact forward and
backward, on CPU/gloo and CUDA/NCCL. ``cpattn.compat.install("ring_flash_attn")`` makes ``import
ring_flash_attn`` resolve here."""

from .adapters import substitute_hf_flash_attn, update_ring_flash_attn_params
from .llama3_flash_attn_varlen import (
    llama3_flash_attn_prepare_cu_seqlens,
    llama3_flash_attn_varlen_func,
    llama3_flash_attn_varlen_kvpacked_func,
    llama3_flash_attn_varlen_qkvpacked_func,
)
from .ring_flash_attn import ring_flash_attn_func, ring_flash_attn_kvpacked_func, ring_flash_attn_qkvpacked_func
from .ring_flash_attn_varlen import (
    ring_flash_attn_varlen_func,
    ring_flash_attn_varlen_kvpacked_func,
    ring_flash_attn_varlen_qkvpacked_func,
)
from .stripe_flash_attn import stripe_flash_attn_func, stripe_flash_attn_kvpacked_func, stripe_flash_attn_qkvpacked_func
from .zigzag_ring_flash_attn import (
    zigzag_ring_flash_attn_func,
    zigzag_ring_flash_attn_kvpacked_func,
    zigzag_ring_flash_attn_qkvpacked_func,
)
from .zigzag_ring_flash_attn_varlen import (
    zigzag_ring_flash_attn_varlen_func,
    zigzag_ring_flash_attn_varlen_kvpacked_func,
    zigzag_ring_flash_attn_varlen_qkvpacked_func,
)

__all__ = [
    "llama3_flash_attn_prepare_cu_seqlens", "llama3_flash_attn_varlen_func", "llama3_flash_attn_varlen_kvpacked_func",
    "llama3_flash_attn_varlen_qkvpacked_func", "ring_flash_attn_func", "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func", "ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func",
    "ring_flash_attn_varlen_qkvpacked_func", "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_qkvpacked_func", "zigzag_ring_flash_attn_varlen_func",
    "zigzag_ring_flash_attn_varlen_kvpacked_func", "zigzag_ring_flash_attn_varlen_qkvpacked_func",
    "stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func", "stripe_flash_attn_qkvpacked_func",
    "substitute_hf_flash_attn", "update_ring_flash_attn_params",
]
