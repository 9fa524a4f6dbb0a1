"""yunchang's helpers that cut this rank's tokens out of a full ``[b, s, ...]`` tensor, as its layers expect them
(see ``yunchang._layout``): ``basic`` takes piece ``rank`` of ``world_size`` contiguous pieces; ``zigzag`` and
``strip`` take, of ring rank r's span (chunks r and 2R-1-r of 2R; tokens r, r+R, ...), the Ulysses rank's
contiguous part, the ring and Ulysses ranks read from ``PROCESS_GROUP`` (zigzag) or from ``rank`` with the
Ulysses group on the low ranks (strip)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _layout
from ..globals import PROCESS_GROUP


def _take(value: torch.Tensor, ranges: list[tuple[int, int]], dim: int = 1) -> torch.Tensor:
    return torch.cat([value.narrow(dim, a, b - a) for a, b in ranges], dim=dim).contiguous()


def _check_degrees(rd: int, ud: int) -> None:
    for name, group, degree in (("ring", PROCESS_GROUP.RING_PG, rd), ("Ulysses", PROCESS_GROUP.ULYSSES_PG, ud)):
        if dist.get_world_size(group=group) != degree:
            raise ValueError(f"the {name} group has {dist.get_world_size(group=group)} ranks, not {degree}")


def basic_extract_local(value, rank, world_size, *args, **kwargs):
    """Piece ``rank`` of ``world_size`` contiguous pieces of dim 1 (a copy)."""
    return value.chunk(world_size, dim=1)[rank].detach().clone()


def zigzag_extract_local(value, rank, world_size, rd, ud, dim=1, *args, **kwargs):
    """This rank's tokens for ``ring_impl_type="zigzag"`` (ring and Ulysses ranks from ``PROCESS_GROUP``)."""
    _check_degrees(rd, ud)
    r, u = dist.get_rank(group=PROCESS_GROUP.RING_PG), dist.get_rank(group=PROCESS_GROUP.ULYSSES_PG)
    return _take(value, _layout.part(_layout.span("zigzag", value.shape[dim], rd, r), u, ud), dim)


def stripe_extract_local(value, rank, world_size, rd, ud, *args, **kwargs):
    """This rank's tokens for ``ring_impl_type="strip"``, ``rank = ring rank x ud + Ulysses rank``."""
    _check_degrees(rd, ud)
    r, u = divmod(rank, ud)
    return _take(value, _layout.part(_layout.span("strip", value.shape[1], rd, r), u, ud))


EXTRACT_FUNC_DICT = {
    "basic": basic_extract_local,
    "strip": stripe_extract_local,
    "zigzag": zigzag_extract_local,
    "basic_pytorch": basic_extract_local,
    "basic_flashinfer": basic_extract_local,
    "basic_npu": basic_extract_local,
}
