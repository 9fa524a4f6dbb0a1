"""yunchang's Ulysses x ring layers (``cpattn.compat.yunchang._layer``)."""

from .._layer import LongContextAttention, LongContextAttentionQKVPacked

__all__ = ["LongContextAttention", "LongContextAttentionQKVPacked"]
