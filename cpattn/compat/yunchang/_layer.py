"""yunchang's attention layers on ``ContextParallel``: ``[b, s_local, h, d]`` in and out, each rank's tokens as
yunchang lays them out (``_layout.py``), one cpattn schedule behind the call:

- ``LongContextAttention`` (Ulysses x ring): ``usp`` with the Ulysses degree, on the block of ranks
  ``set_seq_parallel_pg`` made (``ulysses`` when the ring degree is 1; ``stripe_ring`` for ``strip`` with a
  Ulysses degree of 1 under a causal or windowed mask, the one case ``usp`` cannot run: a striped layout);
- ``UlyssesAttention``: ``ulysses`` on its group.

``schedule=`` (cpattn's extension) or ``$CPATTN_SCHEDULE`` puts another schedule, or ``"auto"``, behind them;
one that needs another layout is refused (``ValueError``). Attention without a mask (``causal=False``, no
window) is the same for any order of the tokens, so it runs on the contiguous layout whatever yunchang's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...core import layout as layout_mod
from ...core.comm import HeldGroup
from ...core.masks import full
from ...core.memo import BoundedCache
from ...functional import _window_mask
from ...schedules import USP
from ..ring_flash_attn import _calls
from . import _layout
from .globals import PROCESS_GROUP, Grid
from .kernels import AttnType

#: ContextParallel objects a layer keeps (one per shape and mask it meets)
KEPT = 8
#: yunchang's other kernels of the basic (contiguous) ring: the same tokens per rank, cpattn's kernels
BASIC_KERNELS = ("basic_pytorch", "basic_flashinfer", "basic_npu")


def _check_indices(scatter_idx, gather_idx, expected: tuple[int, int]) -> None:
    if (scatter_idx, gather_idx) != expected:
        raise NotImplementedError(f"scatter_idx={scatter_idx}, gather_idx={gather_idx}: cpattn takes the sequence at "
                                  f"dim 1 and the heads at dim 2, as yunchang's defaults {expected} do")


def _check_attn_type(attn_type, attn_processor) -> None:
    if not isinstance(attn_type, AttnType):
        raise TypeError(f"attn_type must be an AttnType, got {attn_type!r}")
    if attn_processor is not None:
        raise NotImplementedError("attn_processor is not supported (cpattn runs its own exact kernels); pass None")


def _grid_of(ulysses_pg, ring_pg, recorded: Grid | None) -> Grid:
    """The sequence-parallel block of a layer's groups: the one set_seq_parallel_pg made them in (``recorded``
    when the layer was made, else the latest), or, where only one of the two groups has more than one rank,
    that group alone."""
    for grid in (recorded, PROCESS_GROUP.grid):
        if grid is not None and ulysses_pg is grid.ulysses_group and ring_pg is grid.ring_group:
            return grid
    sizes = [1 if g is None else dist.get_world_size(g) for g in (ulysses_pg, ring_pg)]
    if sizes[1] == 1 and ulysses_pg is not None:
        return Grid(ulysses_pg, sizes[0], 1, tuple((0, u) for u in range(sizes[0])))
    if sizes[0] == 1 and ring_pg is not None:
        return Grid(ring_pg, 1, sizes[1], tuple((r, 0) for r in range(sizes[1])))
    raise ValueError("LongContextAttention with a Ulysses group and a ring group of more than one rank each runs on "
                     "the groups yunchang.set_seq_parallel_pg made (it records their block of ranks); call it instead "
                     "of setting PROCESS_GROUP.ULYSSES_PG and RING_PG by hand")


class _CPAttention(torch.nn.Module):
    """What both layers share: the ContextParallel of each call, kept per shape and mask."""

    def __init__(self, schedule) -> None:
        super().__init__()
        self.schedule = schedule
        self._objects = BoundedCache(KEPT)

    def _grid(self) -> Grid:
        raise NotImplementedError

    def _default(self, grid: Grid, layout: layout_mod.Layout, masked: bool):
        raise NotImplementedError

    def _attend(self, what: str, ring_impl_type: str, query, key, value, dropout_p, softmax_scale, causal,
                window_size, softcap, alibi_slopes, deterministic):
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{what}: {name} must be a [batch, seq_local, heads, head_dim] tensor, got "
                                 + (f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__))
        _calls.refuse_unsupported(dropout_p, alibi_slopes, deterministic, query.device)
        grid = self._grid()
        requested = _calls.requested_schedule(self.schedule)
        window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
        shape = (query.shape[0], query.shape[2], key.shape[2], query.shape[3], query.dtype)
        key_ = (query.shape[1], bool(causal), window, requested, shape, id(grid.group))

        def settings():
            mask = _window_mask(bool(causal), window_size)
            seq_len = query.shape[1] * len(grid.coords)
            if ring_impl_type == "zigzag" and seq_len % (2 * grid.ring_degree):
                raise ValueError(f"{what}: ring_impl_type='zigzag' cuts the sequence into 2 x {grid.ring_degree} "
                                 f"chunks (2 x the ring degree), but it holds {seq_len} tokens ({query.shape[1]} per "
                                 f"rank x {len(grid.coords)} ranks); the local length times the Ulysses degree must be "
                                 "even")
            masked = mask != full()
            layout = _layout.layout(ring_impl_type, seq_len, grid.ulysses_degree, grid.ring_degree, grid.coords) \
                if masked else layout_mod.Layout("contiguous")
            schedule, arg = self._default(grid, layout, masked)
            if requested is not None:
                return schedule, seq_len, mask, layout
            return schedule, seq_len, mask, arg

        cp = self._objects.get(key_, lambda: _calls.context_parallel(what, grid.group, settings, requested, shape))
        return cp.attention(query, key, value, softmax_scale=softmax_scale, softcap=softcap or None)


class LongContextAttention(_CPAttention):
    """yunchang's Ulysses x ring attention over the groups of ``set_seq_parallel_pg``: ``query [b, s_local, h,
    d]``, ``key, value [b, s_local, h_kv, d]`` (this rank's tokens in yunchang's layout for ``ring_impl_type``
    basic, zigzag or strip) -> ``out [b, s_local, h, d]``. Exact, differentiable. ``schedule``: cpattn's
    extension (see the module doc)."""

    ring_pg = HeldGroup()  # this rank's groups, held weakly: torch.distributed owns them
    ulysses_pg = HeldGroup()

    def __init__(self, scatter_idx: int = 2, gather_idx: int = 1, ring_impl_type: str = "basic",
                 use_pack_qkv: bool = False, use_sync: bool = False, attn_type: AttnType = AttnType.FA,
                 attn_processor: torch.nn.Module = None, schedule=None) -> None:
        super().__init__(schedule)
        self.ring_pg = PROCESS_GROUP.RING_PG
        self.ulysses_pg = PROCESS_GROUP.ULYSSES_PG
        self._recorded = PROCESS_GROUP.grid  # the groups' block, as set_seq_parallel_pg made it
        if self.ring_pg is None and self.ulysses_pg is None:
            raise RuntimeError("use set_seq_parallel_pg() first: PROCESS_GROUP has no Ulysses or ring group")
        _check_indices(scatter_idx, gather_idx, (2, 1))
        if ring_impl_type not in _layout.RING_IMPL_TYPES and ring_impl_type not in BASIC_KERNELS:
            raise NotImplementedError(f"ring_impl_type={ring_impl_type!r}: cpattn runs "
                                      f"{', '.join(map(repr, _layout.RING_IMPL_TYPES + BASIC_KERNELS))}")
        _check_attn_type(attn_type, attn_processor)
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.ring_impl_type = ring_impl_type
        self._layout_type = "basic" if ring_impl_type in BASIC_KERNELS else ring_impl_type
        self.use_pack_qkv, self.use_sync = use_pack_qkv, use_sync
        self.attn_type, self.attn_processor = attn_type, attn_processor

    def _grid(self) -> Grid:
        return _grid_of(self.ulysses_pg, self.ring_pg, self._recorded)

    def _default(self, grid: Grid, layout: layout_mod.Layout, masked: bool):
        if grid.ring_degree == 1:
            return "ulysses", None
        if layout.name == "striped":
            return "stripe_ring", None
        return USP(ulysses_degree=grid.ulysses_degree), layout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p=0.0,
                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                deterministic=False, return_attn_probs=False, *args: Any) -> torch.Tensor:
        """``out [b, s_local, h, d]`` (only the output, with ``return_attn_probs`` too, as yunchang)."""
        return self._attend("LongContextAttention", self._layout_type, query, key, value, dropout_p,
                            softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic)


class LongContextAttentionQKVPacked(LongContextAttention):
    """:class:`LongContextAttention` on ``qkv [b, s_local, 3, h, d]``."""

    def __init__(self, scatter_idx: int = 3, gather_idx: int = 1, ring_impl_type: str = "basic",
                 use_sync: bool = False, attn_type: AttnType = AttnType.FA, schedule=None) -> None:
        _check_indices(scatter_idx, gather_idx, (3, 1))
        super().__init__(2, 1, ring_impl_type, False, use_sync, attn_type, None, schedule)
        self.scatter_idx = scatter_idx

    def forward(self, qkv: torch.Tensor, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                *args: Any) -> torch.Tensor:
        if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
            raise ValueError("LongContextAttentionQKVPacked: qkv must be a [batch, seq_local, 3, heads, head_dim] "
                             "tensor")
        return self._attend("LongContextAttentionQKVPacked", self._layout_type, qkv[:, :, 0], qkv[:, :, 1],
                            qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                            deterministic)


class UlyssesAttention(_CPAttention):
    """yunchang's Ulysses attention over ``sequence_process_group`` (None: the default group): this rank's
    contiguous ``[b, s_local, h, d]`` slice in, ``out`` of the same shape back, by cpattn's ``ulysses``
    schedule. ``schedule``: cpattn's extension (see the module doc)."""

    spg = HeldGroup()  # held weakly: torch.distributed owns it

    def __init__(self, sequence_process_group: dist.ProcessGroup = None, scatter_idx: int = 2, gather_idx: int = 1,
                 use_sync: bool = False, attn_type: AttnType = AttnType.FA, schedule=None) -> None:
        super().__init__(schedule)
        _check_indices(scatter_idx, gather_idx, (2, 1))
        _check_attn_type(attn_type, None)
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.use_sync, self.attn_type = use_sync, attn_type

    def _grid(self) -> Grid:
        group = self.spg if self.spg is not None else dist.group.WORLD
        size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        return Grid(self.spg, size, 1, tuple((0, u) for u in range(size)))

    def _default(self, grid: Grid, layout: layout_mod.Layout, masked: bool):
        return "ulysses", None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p=0.0,
                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                deterministic=False, return_attn_probs=False, *args: Any) -> torch.Tensor:
        """``out [b, s_local, h, d]`` (only the output, as yunchang)."""
        return self._attend("UlyssesAttention", "basic", query, key, value, dropout_p, softmax_scale, causal,
                            window_size, softcap, alibi_slopes, deterministic)
