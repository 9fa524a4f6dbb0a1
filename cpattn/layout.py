"""Which global token positions each rank holds.

Pure functions of (layout, seq_len, world, rank): no process group needed. A layout lists, for each
rank, the global position ranges it holds *in local order*; ``positions`` expands them. ``shard``
picks a rank's tokens from a full tensor; ``assemble`` puts every rank's local tensors back in the
original order (``ContextParallel.unshard`` gathers, then assembles).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("contiguous", "zigzag", "striped")


@dataclass(frozen=True)
class Layout:
    """``name``: contiguous (rank r holds [r*s, (r+1)*s)), zigzag (2P chunks; rank r holds chunks r and
    2P-1-r, in that order) or striped (token t lives on rank t mod P)."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in LAYOUTS:
            raise ValueError(f"layout={self.name!r} is unknown; accepted: {', '.join(LAYOUTS)}")

    def multiple(self, world: int) -> int:
        """The global length must be a multiple of this."""
        return 2 * world if self.name == "zigzag" else world

    def check(self, seq_len: int, world: int) -> None:
        if world < 1:
            raise ValueError(f"world size must be >= 1, got {world}")
        m = self.multiple(world)
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
