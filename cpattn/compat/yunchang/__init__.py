"""yunchang 0.6.4's public API on cpattn (``docs/compat.md``): ``set_seq_parallel_pg`` with yunchang's rank sets,
``PROCESS_GROUP`` (``yunchang.globals``), ``LongContextAttention`` (Ulysses x ring, ``ring_impl_type`` basic,
zigzag or strip) and ``UlyssesAttention`` with yunchang's arguments and forward signature, ``AttnType``
(``yunchang.kernels``) and ``EXTRACT_FUNC_DICT``. The layers run cpattn's ``usp`` and ``ulysses`` schedules on
the tokens each rank holds in yunchang's layout, exact forward and backward, no rank ever holding the whole
sequence. ``cpattn.compat.install("yunchang")`` makes ``import yunchang`` resolve here."""

from .comm import EXTRACT_FUNC_DICT, basic_extract_local, stripe_extract_local, zigzag_extract_local
from .globals import PROCESS_GROUP, set_seq_parallel_pg
from .hybrid import LongContextAttention, LongContextAttentionQKVPacked
from .kernels import AttnType
from .ulysses import UlyssesAttention

__version__ = "0.6.4"

__all__ = ["EXTRACT_FUNC_DICT", "PROCESS_GROUP", "AttnType", "LongContextAttention", "LongContextAttentionQKVPacked",
           "UlyssesAttention", "basic_extract_local", "set_seq_parallel_pg", "stripe_extract_local",
           "zigzag_extract_local"]
