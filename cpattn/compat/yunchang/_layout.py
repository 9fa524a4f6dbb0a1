"""Which tokens a rank holds under yunchang's ``LongContextAttention``.

Its all-to-all gathers a Ulysses group's local tokens in the group's rank order, and its ring then runs on
those spans: ring rank r's span is, for ``ring_impl_type`` basic, piece r of R contiguous pieces; zigzag,
chunks r and 2R-1-r of 2R; strip, tokens r, r+R, r+2R, ... So Ulysses rank u of ring rank r holds the
u-th of D equal contiguous parts of that span (R, D: the ring and Ulysses degrees), whichever ranks the
groups are made of.
"""

from __future__ import annotations

from ...core import layout as layout_mod

RING_IMPL_TYPES = ("basic", "zigzag", "strip")


def span(ring_impl_type: str, seq_len: int, ring_degree: int, ring_rank: int) -> list[tuple[int, int]]:
    """Ring rank ``ring_rank``'s global ``[start, stop)`` ranges, in its local order."""
    r, n = ring_rank, ring_degree
    if ring_impl_type == "basic":
        piece = seq_len // n
        return [(r * piece, (r + 1) * piece)]
    if ring_impl_type == "zigzag":
        c = seq_len // (2 * n)
        return [(r * c, (r + 1) * c), ((2 * n - 1 - r) * c, (2 * n - r) * c)]
    return [(t, t + 1) for t in range(r, seq_len, n)]


def part(ranges: list[tuple[int, int]], index: int, parts: int) -> list[tuple[int, int]]:
    """Tokens ``[index L, (index+1) L)`` of the concatenated ``ranges`` (L = their length / ``parts``), as
    ranges, adjacent ones merged."""
    total = sum(b - a for a, b in ranges)
    lo, hi = index * total // parts, (index + 1) * total // parts
    out: list[tuple[int, int]] = []
    seen = 0
    for a, b in ranges:
        x, y = max(a, a + lo - seen), min(b, a + hi - seen)
        if x < y:
            if out and out[-1][1] == x:
                out[-1] = (out[-1][0], y)
            else:
                out.append((x, y))
        seen += b - a
    return out


def rank_ranges(ring_impl_type: str, seq_len: int, ulysses_degree: int, ring_degree: int,
                coords: tuple[tuple[int, int], ...]) -> list[list[tuple[int, int]]]:
    """Every member's global ranges, members as ``coords`` ((ring rank, Ulysses rank) each) lists them."""
    return [part(span(ring_impl_type, seq_len, ring_degree, r), u, ulysses_degree) for r, u in coords]


def layout(ring_impl_type: str, seq_len: int, ulysses_degree: int, ring_degree: int,
           coords: tuple[tuple[int, int], ...]) -> layout_mod.Layout:
    """The cpattn layout of the members' tokens: a named one (contiguous, zigzag, striped) where it is one,
    else explicit."""
    world = len(coords)
    ranges = rank_ranges(ring_impl_type, seq_len, ulysses_degree, ring_degree, coords)
    for name in ("contiguous", "zigzag"):
        if seq_len % (2 * world if name == "zigzag" else world) == 0:
            named = layout_mod.Layout(name)
            if all(ranges[p] == _merged(named.ranges(seq_len, world, p)) for p in range(world)):
                return named
    if world > 1 and all(ranges[p] == [(t, t + 1) for t in range(p, seq_len, world)] for p in range(world)):
        return layout_mod.Layout("striped")
    return layout_mod.Layout.explicit(ranges, name=f"yunchang {ring_impl_type} {ulysses_degree}x{ring_degree}")


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
