"""ring-flash-attn's adapters: Hugging Face transformers (:mod:`.hf_adapter`)."""

from .hf_adapter import substitute_hf_flash_attn, update_ring_flash_attn_params

__all__ = ["substitute_hf_flash_attn", "update_ring_flash_attn_params"]
