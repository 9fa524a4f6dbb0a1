"""What an UltraAttn message holds and its bytes (pure data): the planner plans these bytes and the
``ultra`` schedule (``cpattn.schedules.ultra``) packs and sends exactly them.

Per item: the ``phases`` it travels in, whether it is a kernel ``input`` or a ``partial`` result,
whether it follows a kernel's ``rows`` or ``cols``, and its size for the call's :class:`Sizes`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Sizes:
    """What a message's size depends on: ``batch``, ``chunk`` tokens, ``heads``, ``kv_heads``,
    ``head_dim``; ``elem`` / ``acc_elem`` bytes per element of the inputs / the accumulators."""

    batch: int
    chunk: int
    heads: int
    kv_heads: int
    head_dim: int
    elem: int
    acc_elem: int

    @property
    def rows(self) -> int:
        """Query rows of one chunk over all heads: ``b * chunk * h``."""
        return self.batch * self.chunk * self.heads

    @property
    def kv(self) -> int:
        """Elements of one chunk's packed k and v: ``2 * b * chunk * h_kv * d``."""
        return 2 * self.batch * self.chunk * self.kv_heads * self.head_dim

    def item_bytes(self, item: str) -> int:
        """Bytes of one message of ``item`` (:data:`ITEMS`)."""
        if item not in ITEMS:
            raise ValueError(f"item {item!r} is unknown; accepted: {', '.join(ITEMS)}")
        return ITEMS[item].nbytes(self)


@dataclass(frozen=True)
class Item:
    """One kind of message: in which ``phases`` it travels, whether it is an ``input`` of kernels or a
    ``partial`` result, whether it follows a kernel's ``rows`` or ``cols``, and its size."""

    phases: tuple[str, ...]
    role: str  # "input" or "partial"
    follows: str  # "rows" or "cols"
    nbytes: Callable[[Sizes], int]


#: every message kind, one row each
ITEMS: dict[str, Item] = {
    # query rows of a chunk
    "q": Item(("forward",), "input", "rows", lambda z: z.rows * z.head_dim * z.elem),
    # keys and values of a chunk, packed
    "kv": Item(("forward", "backward"), "input", "cols", lambda z: z.kv * z.elem),
    # a partial output and its lse, flat, in the accumulation dtype
    "o": Item(("forward",), "partial", "rows", lambda z: z.rows * (z.head_dim + 1) * z.acc_elem),
    # backward inputs of a row: its final lse and D = rowsum(dout * out) (accumulation dtype), then q and dout
    "qb": Item(("backward",), "input", "rows", lambda z: z.rows * 2 * (z.head_dim * z.elem + z.acc_elem)),
    # a partial dq
    "dq": Item(("backward",), "partial", "rows", lambda z: z.rows * z.head_dim * z.acc_elem),
    # a partial dk and dv, packed
    "dkv": Item(("backward",), "partial", "cols", lambda z: z.kv * z.acc_elem),
}

__all__ = ["ITEMS", "Item", "Sizes"]
