"""A vision transformer that predicts the next state of a multi-channel 2-D field, patch by patch.

The field ``[b, C, H, W]`` is cut into ``p x p`` patches (:func:`patchify`); each patch is one token.
The tokens attend bidirectionally (pass a ``ContextParallel`` with ``mask="full"``) through one call
into :meth:`cpattn.ContextParallel.attention` per layer, and a linear head predicts each patch's
increment: the output is ``patches + head(...)``, so predicting "no change" (persistence) is the
easy starting point. Positions enter as a fixed 2-D sine-cosine embedding of each patch's (row, column),
looked up by global patch index, so any layout of the patches over the ranks gives the same result.

The blocks are those of :mod:`cpattn.models.llama` (RMSNorm, grouped-query attention, SwiGLU) without
rotary embeddings. Seed torch's global generator identically on every rank before construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..api import ContextParallel
from .llama import Block, RMSNorm, init_weights


@dataclass(frozen=True)
class ViTConfig:
    """Field ``channels x height x width`` in ``patch x patch`` patches; transformer sizes as for Llama."""

    channels: int
    height: int
    width: int
    patch: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn_dim: int
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("channels", "height", "width", "patch", "dim", "layers", "heads", "kv_heads", "ffn_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ViTConfig.{name} must be a positive int, got {value!r}")
        if self.height % self.patch or self.width % self.patch:
            raise ValueError(f"patch ({self.patch}) must divide height ({self.height}) and width ({self.width})")
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"dim ({self.dim}) must be a multiple of heads ({self.heads}), and heads of "
                             f"kv_heads ({self.kv_heads})")
        if self.dim % 4:
            raise ValueError(f"dim ({self.dim}) must be a multiple of 4 for the 2-D sine-cosine embedding")

    @property
    def grid(self) -> tuple[int, int]:
        """Patches per column and per row."""
        return self.height // self.patch, self.width // self.patch

    @property
    def n_patches(self) -> int:
        """The sequence length: one token per patch."""
        return self.grid[0] * self.grid[1]

    @property
    def patch_dim(self) -> int:
        """Values per patch token: ``channels * patch * patch``."""
        return self.channels * self.patch * self.patch


VIT_CONFIGS: dict[str, ViTConfig] = {
    # 64 patches of 2 x 4 x 4; trains in seconds on two CPU cores
    "tiny": ViTConfig(channels=2, height=32, width=32, patch=4, dim=64, layers=2, heads=4, kv_heads=2, ffn_dim=128),
    # 1024 patches of 4 x 4 x 4
    "small": ViTConfig(channels=4, height=128, width=128, patch=4, dim=256, layers=4, heads=8, kv_heads=2,
                       ffn_dim=768),
}


def patchify(fields: torch.Tensor, patch: int) -> torch.Tensor:
    """``fields [b, C, H, W]`` -> ``tokens [b, (H/p)*(W/p), C*p*p]``: patches in row-major order (patch
    index ``row * (W/p) + col``), each flattened as ``(C, p, p)``."""
    b, c, h, w = fields.shape
    if h % patch or w % patch:
        raise ValueError(f"patch ({patch}) must divide the field's height ({h}) and width ({w})")
    x = fields.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


def unpatchify(tokens: torch.Tensor, patch: int, height: int, width: int) -> torch.Tensor:
    """The inverse of :func:`patchify`: ``tokens [b, n, C*p*p]`` -> ``fields [b, C, height, width]``."""
    b, n, pd = tokens.shape
    gh, gw = height // patch, width // patch
    if n != gh * gw or pd % (patch * patch):
        raise ValueError(f"tokens {tuple(tokens.shape)} do not tile a {height} x {width} field in {patch} x {patch} "
                         "patches")
    c = pd // (patch * patch)
    x = tokens.reshape(b, gh, gw, c, patch, patch)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, c, height, width)


def sincos_2d(grid: tuple[int, int], dim: int) -> torch.Tensor:
    """Fixed position embedding ``[rows * cols, dim]`` float32: half the channels encode the patch's row,
    half its column, each as sines and cosines of geometrically spaced frequencies (computed in float64)."""
    rows, cols = grid
    quarter = dim // 4
    freq = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    r = torch.arange(rows, dtype=torch.float64).repeat_interleave(cols).unsqueeze(1) * freq
    c = torch.arange(cols, dtype=torch.float64).repeat(rows).unsqueeze(1) * freq
    return torch.cat((r.sin(), r.cos(), c.sin(), c.cos()), dim=1).float()


class ViT(nn.Module):
    """Next-field predictor. ``forward(patches_local, positions, cp)``: see :meth:`forward`."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.patch_embed = nn.Linear(c.patch_dim, c.dim)
        self.register_buffer("pos_embed", sincos_2d(c.grid, c.dim), persistent=False)
        self.layers = nn.ModuleList(Block(c.dim, c.heads, c.kv_heads, c.ffn_dim, c.norm_eps) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.head = nn.Linear(c.dim, c.patch_dim)
        init_weights(self, c.layers)

    def patchify(self, fields: torch.Tensor) -> torch.Tensor:
        """``[b, C, H, W]`` -> ``[b, n_patches, C*p*p]`` (:func:`patchify` with this config's patch)."""
        return patchify(fields, self.config.patch)

    def unpatchify(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[b, n_patches, C*p*p]`` -> ``[b, C, H, W]`` (:func:`unpatchify`)."""
        return unpatchify(tokens, self.config.patch, self.config.height, self.config.width)

    def forward(self, patches_local: torch.Tensor, positions: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        """This rank's ``patches_local [b, s_local, C*p*p]`` (``cp.shard(model.patchify(x), dim=1)``) and
        their global patch indices ``positions [s_local]`` or ``[b, s_local]`` (``cp.positions()``; -1
        marks padding) -> the predicted next-field patches ``[b, s_local, C*p*p]`` in the input's dtype.
        Outputs at padding positions are meaningless; exclude them from the loss."""
        if patches_local.dim() != 3 or patches_local.shape[2] != self.config.patch_dim:
            raise ValueError(f"patches_local must be [b, s_local, {self.config.patch_dim}], got "
                             f"{tuple(patches_local.shape)}")
        if positions.shape[-1] != patches_local.shape[1]:
            raise ValueError(f"positions has {positions.shape[-1]} tokens, patches_local has {patches_local.shape[1]}")
        pos = self.pos_embed[positions.to(self.pos_embed.device).clamp(min=0)]  # [s, dim] or [b, s, dim]
        h = self.patch_embed(patches_local) + pos.to(patches_local.dtype)
        for layer in self.layers:
            h = layer(h, cp)
        return patches_local + self.head(self.norm(h))
