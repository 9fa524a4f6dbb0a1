"""yunchang's Ulysses layer (``cpattn.compat.yunchang._layer``)."""

from .._layer import UlyssesAttention

__all__ = ["UlyssesAttention"]
