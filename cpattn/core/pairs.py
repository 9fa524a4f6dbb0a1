"""The kernel calls of every (query rank, key rank) pair of a layout and mask, in bulk (pure).

A schedule's steps need, e.g., "what does each rank compute at ring offset t" for up to thousands of
ranks. :func:`pair_work` answers from closed forms for the causal and full masks on the contiguous,
zigzag and striped layouts (there the work of a pair depends only on whether the key rank is below,
equal to or above the query rank), and otherwise by classifying every pair with ``cpattn.core.blocks``,
exactly as the schedules do at run time (O(P^2) pairs: meant for small worlds or masks without a
closed form). Both give identical kernels; the tests compare them.
"""

from __future__ import annotations

from dataclasses import replace

from . import blocks, memo
from .layout import Layout
from .masks import BlockKind, CausalMask, FullMask, Mask
from .steps import Kernel, Work, distribution, work


def _kernel(blk: blocks.Block) -> Kernel:
    return Kernel(blk.kind.value, blk.q.stop - blk.q.start, blk.kv.stop - blk.kv.start, blk.area)


def _full(n: int, m: int) -> Kernel:
    return Kernel(BlockKind.FULL.value, n, m, n * m)


def _causal(n: int) -> Kernel:
    return Kernel(BlockKind.CAUSAL.value, n, n, n * (n + 1) // 2)


class PairWork:
    """Work of every (query rank, key rank) pair; distributions over ranks as ``((Work, ranks), ...)``."""

    def __init__(self, world: int) -> None:
        self.world = world

    def pair(self, q_rank: int, kv_rank: int) -> Work:
        """Kernel calls of ``q_rank``'s queries against ``kv_rank``'s keys."""
        raise NotImplementedError

    def by_offset(self, t: int) -> tuple[tuple[Work, int], ...]:
        """Over ranks r: the work of pair(r, (r - t) mod P) (ring step t)."""
        p = self.world
        return distribution(self.pair(r, (r - t) % p) for r in range(p))

    def by_q_rank(self, i: int) -> tuple[tuple[Work, int], ...]:
        """Over key ranks r: the work of pair(i, r) (rank r attends ``i``'s queries to its keys)."""
        return distribution(self.pair(i, r) for r in range(self.world))

    def by_kv_rank(self, j: int) -> tuple[tuple[Work, int], ...]:
        """Over query ranks r: the work of pair(r, j) (rank r attends its queries to ``j``'s keys)."""
        return distribution(self.pair(r, j) for r in range(self.world))

    def remote_rows(self) -> tuple[tuple[Work, int], ...]:
        """Over ranks r: the work of r's queries against every other rank's keys, summed."""
        p = self.world
        return distribution(work((k, n) for j in range(p) if j != r for k, n in self.pair(r, j))
                            for r in range(p))


class TriangularPairs(PairWork):
    """Pairs whose work depends only on the sign of ``kv_rank - q_rank``: ``below`` (kv_rank < q_rank),
    ``diagonal`` and ``above``, except the diagonals listed in ``special`` (rank -> Work). Every
    distribution is O(1) or O(P) instead of O(P^2)."""

    def __init__(self, world: int, below: Work, diagonal: Work, above: Work,
                 special: dict[int, Work] | None = None) -> None:
        super().__init__(world)
        self.below, self.diagonal, self.above = below, diagonal, above
        self.special = dict(special or {})

    def _diagonal(self, rank: int) -> Work:
        return self.special.get(rank, self.diagonal)

    def pair(self, q_rank: int, kv_rank: int) -> Work:
        if kv_rank == q_rank:
            return self._diagonal(q_rank)
        return self.below if kv_rank < q_rank else self.above

    def by_offset(self, t: int) -> tuple[tuple[Work, int], ...]:
        p, t = self.world, t % self.world
        if t == 0:
            return _merge([(self.diagonal, p - len(self.special)), *((w, 1) for w in self.special.values())])
        # pair(r, r - t): below for the p - t ranks r >= t, above (wrapped around) for the t others
        return _merge([(self.below, p - t), (self.above, t)])

    def by_q_rank(self, i: int) -> tuple[tuple[Work, int], ...]:
        return _merge([(self._diagonal(i), 1), (self.below, i), (self.above, self.world - 1 - i)])

    def by_kv_rank(self, j: int) -> tuple[tuple[Work, int], ...]:
        return _merge([(self._diagonal(j), 1), (self.below, self.world - 1 - j), (self.above, j)])

    def remote_rows(self) -> tuple[tuple[Work, int], ...]:
        p = self.world
        return distribution(work([*((k, n * r) for k, n in self.below), *((k, n * (p - 1 - r)) for k, n in self.above)])
                            for r in range(p))


#: a distribution ``((Work, ranks), ...)`` from ``(Work, ranks)`` pairs: the merge of :func:`work` (repeats
#: summed, zero counts dropped, sorted)
_merge = work


class EnumeratedPairs(PairWork):
    """Any mask and layout: each pair classified by ``cpattn.core.blocks.for_ranks`` (cached)."""

    def __init__(self, mask: Mask, layout: Layout, seq_len: int, world: int, valid_len: int | None = None) -> None:
        super().__init__(world)
        self._args = (mask, layout, seq_len, world, valid_len)
        self._cache: dict[tuple[int, int], Work] = {}

    def pair(self, q_rank: int, kv_rank: int) -> Work:
        key = (q_rank, kv_rank)
        if key not in self._cache:
            mask, layout, seq_len, world, valid_len = self._args
            self._cache[key] = work((_kernel(b), 1) for b in blocks.for_ranks(mask, layout, seq_len, world, q_rank,
                                                                                [kv_rank], valid_len))
        return self._cache[key]


def closed_form(mask: Mask, layout: Layout, seq_len: int, world: int) -> TriangularPairs | None:
    """The closed form for the causal and full masks on the built-in layouts, else None (also for one
    rank: its single pair is cheap to classify, and its ranges may merge into one)."""
    layout.check(seq_len, world)
    if world == 1:
        return None
    s = seq_len // world
    if isinstance(mask, FullMask):
        one = work([(_full(s, s), 1)])
        return TriangularPairs(world, one, one, one)
    if not isinstance(mask, CausalMask):
        return None
    if layout.name == "contiguous":
        return TriangularPairs(world, work([(_full(s, s), 1)]), work([(_causal(s), 1)]), ())
    if layout.name == "zigzag":
        c = s // 2  # rank r holds chunks r and 2P-1-r of c tokens each
        return TriangularPairs(world, work([(_full(2 * c, c), 1)]),  # all local q x first half of kv_j
                               work([(_causal(c), 2), (_full(c, c), 1)]),
                               work([(_full(c, 2 * c), 1)]),  # second half of local q x all of kv_j
                               special={world - 1: work([(_causal(s), 1)])})  # chunks P-1, P are adjacent
    if layout.name == "striped":
        above = work([(_causal(s - 1), 1)]) if s > 1 else ()  # causal shifted by one
        return TriangularPairs(world, work([(_causal(s), 1)]), work([(_causal(s), 1)]), above)
    return None


def head_split(groups: tuple[tuple[Work, int], ...], degree: int, heads: int,
               kv_heads: int) -> tuple[tuple[Work, int], ...]:
    """Work of ranks in groups of ``degree`` whose members all run their group's work, each on
    ``heads`` query and ``kv_heads`` key/value heads (Ulysses and USP split the heads inside a group):
    ``groups`` is a distribution over the groups (e.g. a :class:`PairWork` of the groups' token spans);
    the result is one over ranks, every kernel tagged with the head counts."""
    return _merge([(work((replace(k, heads=heads, kv_heads=kv_heads), n) for k, n in w), count * degree)
                   for w, count in groups])


def _build(mask: Mask, layout: Layout, seq_len: int, world: int, valid_len: int | None) -> PairWork:
    if valid_len is not None and valid_len != seq_len:  # padding: the closed forms do not hold
        return EnumeratedPairs(mask, layout, seq_len, world, valid_len)
    return closed_form(mask, layout, seq_len, world) or EnumeratedPairs(mask, layout, seq_len, world)


def pair_work(mask: Mask, layout: Layout, seq_len: int, world: int, valid_len: int | None = None) -> PairWork:
    """The :class:`PairWork` of ``mask`` on ``layout`` splitting ``seq_len`` tokens of which those at
    positions ``>= valid_len`` are padding (closed form when there is one); cached per (mask, layout,
    seq_len, world, valid_len) in the active ``cpattn.core.memo`` scope."""
    layout.check(seq_len, world)
    return memo.cached(("pair_work", mask, layout, seq_len, world, valid_len),
                       lambda: _build(mask, layout, seq_len, world, valid_len))


__all__ = ["EnumeratedPairs", "PairWork", "TriangularPairs", "closed_form", "head_split", "pair_work"]
