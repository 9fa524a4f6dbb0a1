"""A Llama-3-style decoder whose attention is one call into :meth:`cpattn.ContextParallel.attention`.

RMSNorm, rotary position embeddings (RoPE) from *global* position ids, grouped-query attention and a
SwiGLU MLP, pre-norm residual blocks. The model sees only this rank's tokens; the ``ContextParallel``
passed to :meth:`Llama.forward` decides the mask, the layout and how key/value blocks travel, so the
same model runs on one process or on P ranks.

Parameters are drawn from torch's global generator: seed it identically on every rank before
construction (``torch.manual_seed(0); model = Llama(LLAMA_CONFIGS["tiny"])``) and every rank holds the
same weights. Llama 3.1's long-context RoPE frequency scaling is not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..api import ContextParallel


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a :class:`Llama`. ``kv_heads`` divides ``heads`` (grouped-query attention)."""

    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn_dim: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "layers", "heads", "kv_heads", "ffn_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be a multiple of heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    # trains in seconds on two CPU cores (tests, the recall task)
    "tiny": LlamaConfig(vocab=64, dim=64, layers=2, heads=4, kv_heads=2, ffn_dim=128),
    # minutes on a few CPU cores; long sequences on one GPU
    "small": LlamaConfig(vocab=512, dim=256, layers=4, heads=8, kv_heads=2, ffn_dim=768),
    # Meta Llama 3 8B (the FLOP and parameter accounting; too large to run here)
    "llama3-8b": LlamaConfig(vocab=128256, dim=4096, layers=32, heads=32, kv_heads=8, ffn_dim=14336),
}


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, the statistics in float32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the rotary angles for global ``positions`` (``[s]`` or ``[b, s]``, long), each
    ``[1 or b, s, 1, head_dim / 2]`` in ``dtype``. The angles are computed in float64 (exact for any
    position below 2**53) and rounded once. Padding positions (-1) are taken as 0."""
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    if positions.dim() != 2:
        raise ValueError(f"positions must be [s] or [b, s], got shape {tuple(positions.shape)}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim
    inv_freq = theta ** -exponents
    angles = positions.clamp(min=0).to(torch.float64).unsqueeze(-1) * inv_freq  # [b, s, d/2]
    return angles.cos().to(dtype).unsqueeze(2), angles.sin().to(dtype).unsqueeze(2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) pair of channels of ``x [b, s, h, d]`` by its angle (Meta's layout); the
    result has ``x``'s dtype (under bf16 autocast q and k stay bf16 while the angles are float32)."""
    pairs = x.unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention: ``heads`` query heads share ``kv_heads`` key/value heads, which are
    handed to the ``ContextParallel`` as they are (only those travel between ranks)."""

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cp: ContextParallel,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x [b, s, dim]`` -> ``[b, s, dim]``; ``rope``: ``(cos, sin)`` from :func:`rope_angles`."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = cp.attention(q, k, v)  # [b, s, heads, head_dim]
        return self.wo(out.reshape(b, s, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, dim: int, heads: int, kv_heads: int, ffn_dim: int, norm_eps: float) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.attention = Attention(dim, heads, kv_heads)
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.feed_forward = SwiGLU(dim, ffn_dim)

    def forward(self, x: torch.Tensor, cp: ContextParallel,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cp, rope)
        return x + self.feed_forward(self.ffn_norm(x))


def init_weights(model: nn.Module, layers: int, std: float = 0.02) -> None:
    """Normal(0, ``std``) for linear and embedding weights; the projections back into the residual stream
    (``wo``, ``w2``) get ``std / sqrt(2 * layers)`` so the stream's variance does not grow with depth.
    Draws from torch's global generator (seed before construction)."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            scale = std / math.sqrt(2 * layers) if name.endswith(("wo", "w2")) else std
            nn.init.normal_(module.weight, mean=0.0, std=scale)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


class Llama(nn.Module):
    """Llama-3-style decoder. ``forward(tokens, positions, cp)``: see :meth:`forward`."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(Block(c.dim, c.heads, c.kv_heads, c.ffn_dim, c.norm_eps) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)
        init_weights(self, c.layers)
        if c.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        """This rank's ``tokens [b, s_local]`` (long, in ``cp``'s layout: ``cp.shard(tokens, dim=1)``) and
        their global ``positions`` (``[s_local]`` or ``[b, s_local]`` long, e.g. ``cp.positions()``, or
        per-document position ids sharded the same way; -1 marks padding) -> ``logits [b, s_local, vocab]``
        float32. Logits at padding positions are meaningless; exclude them from the loss."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [b, s_local], got shape {tuple(tokens.shape)}")
        if positions.shape[-1] != tokens.shape[1]:
            raise ValueError(f"positions has {positions.shape[-1]} tokens, tokens has {tokens.shape[1]}")
        h = self.tok_embeddings(tokens)
        rope = rope_angles(positions.to(tokens.device), self.config.head_dim, self.config.rope_theta, h.dtype)
        for layer in self.layers:
            h = layer(h, cp, rope)
        return self.output(self.norm(h)).float()
