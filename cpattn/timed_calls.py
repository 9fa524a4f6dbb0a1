"""Kernel calls to time: the forward and backward of one block on random inputs, as ``cpattn calibrate``
measures them (``cpattn.lab.machine_profile``) and as ``cpattn bench --predict``'s speed probe times them again
(``cpattn.bench.SPEED_PROBE``), so the two measure the same calls."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from .core import kernels
from .core.masks import BlockKind
from .core.steps import Kernel

#: the fields of a kernel shape, as :func:`kernel_calls` takes them
SHAPE = ("batch", "heads", "kv_heads", "head_dim", "dtype")


def shape_of(config) -> dict:
    """The kernel shape of ``config`` (any object with the :data:`SHAPE` attributes: a calibration's
    settings, a bench configuration) as keyword arguments of :func:`kernel_calls` and :func:`block_inputs`."""
    return {name: getattr(config, name) for name in SHAPE}


def square_kernel(kind: str, n: int) -> Kernel:
    """The cost model's :class:`~cpattn.core.steps.Kernel` for one timed ``kind`` block of side ``n``: a
    causal block's allowed pairs are its lower triangle, the others' its whole square."""
    return Kernel(kind, n, n, n * (n + 1) // 2 if kind == BlockKind.CAUSAL.value else n * n)


def block_inputs(n: int, batch: int, heads: int, kv_heads: int, head_dim: int, dtype: str,
                 device: torch.device | str = "cpu"):
    """Random ``q`` ``[batch, n, heads, head_dim]`` and ``k``, ``v`` ``[batch, n, kv_heads, head_dim]`` in
    ``dtype`` on ``device`` (seeded by ``n``)."""
    g = torch.Generator().manual_seed(n)
    dt = kernels.DTYPES[dtype]
    return tuple(torch.randn(batch, n, h, head_dim, generator=g).to(device, dt) for h in (heads, kv_heads, kv_heads))


def kernel_calls(kind: str, n: int, pieces: int = 1, *, batch: int, heads: int, kv_heads: int, head_dim: int,
                 dtype: str, device: torch.device | str = "cpu", path: str | None = None
                 ) -> dict[str, Callable[[], object]]:
    """The forward and backward call (``{"forward", "backward"}``) of a ``kind`` kernel (full, causal, or
    partial: a band around the diagonal) of side ``n`` on ``device``, or of one stacked call of ``pieces``
    such blocks (``kernels.forward_stacked``) when ``pieces > 1``; ``path``: run that kernel path
    (``kernels.forward_with``, one block) rather than the one the dispatch picks. The forward runs once
    here, to give the backward its inputs."""
    if path is not None and pieces > 1:
        raise ValueError("kernel_calls: a named kernel path runs one block, not a stacked call")
    q, k, v = block_inputs(n, batch * pieces, heads, kv_heads, head_dim, dtype, device)
    block = BlockKind(kind)
    mask = None
    if block == BlockKind.PARTIAL:  # a band: every row attends a window around its diagonal
        idx = torch.arange(n, device=q.device)
        mask = (idx[:, None] - idx[None, :]).abs() < max(1, n // 4)
    scale = kernels.default_scale(head_dim)
    if pieces > 1:
        fwd, bwd, tail = kernels.forward_stacked, kernels.backward_stacked, (block, scale, pieces)
    elif path is not None:
        fwd, bwd, tail = partial(kernels.forward_with, path), partial(kernels.backward_with, path), (block, scale, mask)
    else:
        fwd, bwd, tail = kernels.forward, kernels.backward, (block, scale, mask)
    out, lse = fwd(q, k, v, *tail)
    out = out.to(q.dtype)
    dout = torch.randn_like(q)
    return {"forward": lambda: fwd(q, k, v, *tail), "backward": lambda: bwd(dout, q, k, v, out, lse, *tail)}


__all__ = ["SHAPE", "block_inputs", "kernel_calls", "shape_of", "square_kernel"]
