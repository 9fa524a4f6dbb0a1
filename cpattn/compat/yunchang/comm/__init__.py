"""yunchang's ``comm`` package: the helpers that cut a rank's tokens out of the full sequence."""

from .extract_local import EXTRACT_FUNC_DICT, basic_extract_local, stripe_extract_local, zigzag_extract_local

__all__ = ["EXTRACT_FUNC_DICT", "basic_extract_local", "stripe_extract_local", "zigzag_extract_local"]
