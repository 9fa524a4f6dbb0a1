"""Which global token positions each rank holds.

Pure functions of (layout, seq_len, world, rank): no process group needed. A layout lists, for each
rank, the global position ranges it holds *in local order*; ``positions`` expands them. ``shard``
picks a rank's tokens from a full tensor; ``assemble`` puts every rank's local tensors back in the
original order (``ContextParallel.unshard`` gathers, then assembles).

Named layouts follow a rule for any length: contiguous, zigzag, striped. The general case is an
*explicit* layout: per-rank ranges for one sequence length (:meth:`Layout.explicit`); :func:`balanced`
builds one that evens out a mask's attention work across ranks. Every rank holds the same number of
tokens. A length a layout cannot split is padded up to :meth:`Layout.padded_len` (the padding tokens,
at the end of the sequence, are masked out; see ``cpattn.core.blocks``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .masks import Mask

LAYOUTS = ("contiguous", "zigzag", "striped")
#: chunks per rank that :func:`balanced` deals out
BALANCED_CHUNKS_PER_RANK = 4

Ranges = tuple[tuple[tuple[int, int], ...], ...]  # rank -> ((start, stop), ...) in local order


def round_up(seq_len: int, multiple: int) -> int:
    """The padded length: ``seq_len`` rounded up to a multiple of ``multiple`` (the one padding rule)."""
    return -(-seq_len // multiple) * multiple


@dataclass(frozen=True)
class Layout:
    """``name``: contiguous (rank r holds [r*s, (r+1)*s)), zigzag (2P chunks; rank r holds chunks r and
    2P-1-r, in that order), striped (token t lives on rank t mod P), or any other name for an explicit
    layout, whose ``rank_ranges`` give each rank's global ranges (see :meth:`explicit`)."""

    name: str
    rank_ranges: Ranges | None = None

    def __post_init__(self) -> None:
        if self.rank_ranges is None and self.name not in LAYOUTS:
            raise ValueError(f"layout={self.name!r} is unknown; accepted: {', '.join(LAYOUTS)} "
                             "(or an explicit layout: Layout.explicit(ranges))")
        if self.rank_ranges is not None:
            self._check_explicit()

    @staticmethod
    def explicit(rank_ranges, name: str = "explicit") -> Layout:
        """A layout from per-rank global ``[start, stop)`` ranges (in local order). Together they must
        cover ``[0, S)`` exactly once, with the same number of tokens on every rank."""
        return Layout(name, tuple(tuple((int(a), int(b)) for a, b in rr) for rr in rank_ranges))

    def _check_explicit(self) -> None:
        if self.name in LAYOUTS:
            raise ValueError(f"an explicit layout cannot be named {self.name!r} (a rule-based layout)")
        if not self.rank_ranges:
            raise ValueError("an explicit layout needs at least one rank")
        spans = sorted(r for rr in self.rank_ranges for r in rr)
        if any(a >= b for a, b in spans) or spans[0][0] != 0 or \
                any(spans[i][1] != spans[i + 1][0] for i in range(len(spans) - 1)):
            raise ValueError("explicit layout ranges must be non-empty and cover [0, S) exactly once")
        sizes = {sum(b - a for a, b in rr) for rr in self.rank_ranges}
        if len(sizes) != 1:
            raise ValueError(f"explicit layout ranks hold different numbers of tokens: {sorted(sizes)}")

    @property
    def total(self) -> int | None:
        """The sequence length of an explicit layout (None for rule-based layouts)."""
        if self.rank_ranges is None:
            return None
        return sum(b - a for rr in self.rank_ranges for a, b in rr)

    def multiple(self, world: int) -> int:
        """The global length must be a multiple of this (an explicit layout: its own length)."""
        if self.rank_ranges is not None:
            return self.total
        return 2 * world if self.name == "zigzag" else world

    def padded_len(self, seq_len: int, world: int) -> int:
        """The smallest length >= ``seq_len`` this layout splits over ``world`` ranks."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if self.rank_ranges is not None:
            self._check_world(world)
            if seq_len > self.total:
                raise ValueError(f"seq_len={seq_len} is longer than the explicit layout {self.name!r} "
                                 f"({self.total} tokens)")
            return self.total
        return round_up(seq_len, self.multiple(world))

    def _check_world(self, world: int) -> None:
        if world < 1:
            raise ValueError(f"world size must be >= 1, got {world}")
        if self.rank_ranges is not None and world != len(self.rank_ranges):
            raise ValueError(f"layout {self.name!r} is for {len(self.rank_ranges)} ranks, not {world}")

    def check(self, seq_len: int, world: int) -> None:
        self._check_world(world)
        m = self.multiple(world)
        if self.rank_ranges is not None and seq_len != m:
            raise ValueError(f"layout {self.name!r} splits exactly {m} tokens, not seq_len={seq_len}")
        if seq_len < 1 or seq_len % m != 0:
            raise ValueError(
                f"seq_len={seq_len} cannot be split by the {self.name} layout over {world} ranks: "
                f"it must be a positive multiple of {m}"
            )

    def local_len(self, seq_len: int, world: int) -> int:
        self.check(seq_len, world)
        return seq_len // world

    def ranges(self, seq_len: int, world: int, rank: int) -> list[tuple[int, int]] | None:
        """Global ``[start, stop)`` ranges of ``rank`` in local order; None for striped (not ranges)."""
        self.check(seq_len, world)
        if not 0 <= rank < world:
            raise ValueError(f"rank={rank} outside [0, {world})")
        if self.rank_ranges is not None:
            return list(self.rank_ranges[rank])
        if self.name == "contiguous":
            s = seq_len // world
            return [(rank * s, (rank + 1) * s)]
        if self.name == "zigzag":
            c = seq_len // (2 * world)
            j = 2 * world - 1 - rank
            return [(rank * c, (rank + 1) * c), (j * c, (j + 1) * c)]
        return None

    def positions(self, seq_len: int, world: int, rank: int) -> torch.Tensor:
        """1-D LongTensor: global position of each local token."""
        rng = self.ranges(seq_len, world, rank)
        if rng is None:
            return torch.arange(rank, seq_len, world)
        return torch.cat([torch.arange(a, b) for a, b in rng])


def grouped(layout: Layout, seq_len: int, world: int, degree: int) -> Layout:
    """The layout of ``world / degree`` groups of ``degree`` consecutive ranks, each group holding its
    members' tokens in member order (how Ulysses and USP see the sequence): contiguous stays contiguous,
    any other range layout becomes explicit."""
    if world % degree:
        raise ValueError(f"degree={degree} must divide world={world}")
    if layout.name == "contiguous" and layout.rank_ranges is None:
        return layout
    ranks = [layout.ranges(seq_len, world, r) for r in range(world)]
    if any(r is None for r in ranks):
        raise ValueError(f"layout {layout.name!r} is not a range layout; it cannot be grouped")
    groups = tuple(tuple(rng for r in range(g * degree, (g + 1) * degree) for rng in ranks[r])
                   for g in range(world // degree))
    return Layout.explicit(groups, f"{layout.name}/{degree}")


def pieces(layout: Layout, seq_len: int, world: int) -> tuple[int, tuple[int, ...]]:
    """A range layout as equal pieces: ``(piece, order)`` where ``piece`` is the largest length that
    every range boundary is a multiple of, and ``order`` lists the original piece index of each piece
    as the ranks hold them (rank 0's in local order, then rank 1's, ...). Contiguous is the identity."""
    ranges = [layout.ranges(seq_len, world, r) for r in range(world)]
    if any(rr is None for rr in ranges):
        raise ValueError(f"layout {layout.name!r} is not made of ranges")
    piece = math.gcd(seq_len, *(bound for rr in ranges for rng in rr for bound in rng))
    return piece, tuple(p for rr in ranges for a, b in rr for p in range(a // piece, b // piece))


def check_order(order, seq_len: int, world: int) -> tuple[int, ...]:
    """``order`` (as :func:`pieces` gives it) as a tuple; ValueError unless it is a permutation of
    ``n0`` equal pieces, ``n0`` a multiple of ``world`` that divides ``seq_len``."""
    order = tuple(int(p) for p in order)
    n0 = len(order)
    if n0 < 1 or sorted(order) != list(range(n0)) or n0 % world or seq_len % n0:
        raise ValueError(f"order must be a permutation of range(n0) with n0 a multiple of world={world} that "
                         f"divides seq_len={seq_len}; got {n0} pieces")
    return order


def from_pieces(order: tuple[int, ...], seq_len: int, world: int, name: str) -> Layout:
    """The explicit layout that hands out ``seq_len / len(order)``-token pieces in ``order``, an equal
    run of them per rank (the inverse of :func:`pieces`)."""
    order = check_order(order, seq_len, world)
    return Layout.explicit([source_ranges(r, seq_len // world, seq_len, order) for r in range(world)], name=name)


def source_ranges(chunk: int, chunk_len: int, seq_len: int, order: tuple[int, ...] | None
                  ) -> list[tuple[int, int]]:
    """Original ``[start, stop)`` token ranges, in order, of chunk ``chunk`` (``chunk_len`` tokens) of a
    ``seq_len``-token sequence whose ``len(order)`` equal pieces the ranks hold in ``order`` (None:
    contiguous, chunk i is tokens ``[i * chunk_len, (i + 1) * chunk_len)``)."""
    start, end = chunk * chunk_len, (chunk + 1) * chunk_len
    if order is None:
        return [(start, end)]
    piece = seq_len // len(order)
    out: list[tuple[int, int]] = []
    while start < end:
        p, off = divmod(start, piece)
        step = min(piece - off, end - start)
        a = order[p] * piece + off
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], a + step)
        else:
            out.append((a, a + step))
        start += step
    return out


def shard(x: torch.Tensor, layout: Layout, world: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of the full tensor ``x`` (sequence at ``dim``), contiguous."""
    seq_len = x.shape[dim]
    idx = layout.positions(seq_len, world, rank).to(x.device)
    return x.index_select(dim, idx).contiguous()


def assemble(parts: list[torch.Tensor], layout: Layout, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard` over all ranks: ``parts[r]`` is rank r's local tensor."""
    world = len(parts)
    seq_len = sum(p.shape[dim] for p in parts)
    idx = torch.cat([layout.positions(seq_len, world, r) for r in range(world)]).to(parts[0].device)
    stacked = torch.cat(parts, dim=dim)
    out = torch.empty_like(stacked)
    out.index_copy_(dim, idx, stacked)
    return out


# ---------------------------------------------------------------------------------- work balance
def _row_work(mask: Mask, seq_len: int, valid_len: int | None) -> torch.Tensor:
    """Allowed keys of every query row ``[seq_len]`` (0 for padding rows, padding keys excluded)."""
    valid = seq_len if valid_len is None else valid_len
    work = torch.zeros(seq_len, dtype=torch.long)
    work[:valid] = mask.row_counts(0, valid, 0, valid)
    return work


@dataclass(frozen=True)
class WorkReport:
    """Attention work per rank, in allowed (query, key) pairs: what each rank computes when its queries
    stay home and meet every key (ring, zigzag ring, all-gather). ``imbalance`` = max / mean (1 is
    perfect)."""

    per_rank: tuple[int, ...]

    @property
    def max(self) -> int:
        return max(self.per_rank)

    @property
    def mean(self) -> float:
        return sum(self.per_rank) / len(self.per_rank)

    @property
    def imbalance(self) -> float:
        return self.max / self.mean if self.mean else 1.0


def work_report(layout: Layout, mask: Mask, seq_len: int, world: int, valid_len: int | None = None) -> WorkReport:
    """Work per rank of ``mask`` on ``layout`` (``seq_len``: the padded length the layout splits;
    positions ``>= valid_len`` are padding). Cost: one :meth:`Mask.row_counts` over the sequence."""
    work = _row_work(mask, seq_len, valid_len)
    return WorkReport(tuple(int(work[layout.positions(seq_len, world, r)].sum()) for r in range(world)))


def balanced(mask: Mask, seq_len: int, world: int, valid_len: int | None = None,
             chunks_per_rank: int = BALANCED_CHUNKS_PER_RANK) -> Layout:
    """An explicit layout that evens out ``mask``'s work across ranks.

    The (padded) sequence is cut into ``world * chunks_per_rank`` equal chunks; their work (allowed
    pairs of their query rows) is dealt out greedily, largest first, each to the least-loaded rank
    that still has room, so every rank gets ``chunks_per_rank`` chunks. Under a causal mask with two
    chunks per rank this is exactly the zigzag layout. Each rank keeps its chunks in sequence order,
    adjacent ones fused. ``seq_len`` must be a multiple of ``world * chunks_per_rank``.
    """
    n = world * chunks_per_rank
    if world < 1 or chunks_per_rank < 1 or seq_len % n:
        raise ValueError(f"balanced layout: seq_len={seq_len} must be a multiple of world * chunks_per_rank "
                         f"= {world} * {chunks_per_rank}")
    c = seq_len // n
    chunk_work = _row_work(mask, seq_len, valid_len).view(n, c).sum(1).tolist()
    load, owned = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(n), key=lambda i: (-chunk_work[i], i)):
        r = min((r for r in range(world) if len(owned[r]) < chunks_per_rank), key=lambda r: (load[r], r))
        load[r] += chunk_work[i]
        owned[r].append(i)
    return from_pieces(tuple(i for chunks in owned for i in sorted(chunks)), seq_len, world, "balanced")
