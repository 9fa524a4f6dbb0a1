"""Packed sequences as flash-attn describes them: ``cu_seqlens``, the cumulative document boundaries
``[0, l0, l0 + l1, ..., n]`` over one packed row, read on the host once and turned into a cpattn document
mask (:func:`document_mask`) or into one step's view of a ContextParallel (:func:`documents_view`).

The ring-flash-attn drop-in (``cpattn.compat``) and the Hugging Face integration (packed batches of
``DataCollatorWithFlattening`` and TRL's ``padding_free``) read their documents through these functions.
"""

from __future__ import annotations

import operator

import torch

from .api import ContextParallel
from .core.masks import Mask, causal, document, full
from .functional import _window_mask


def read_bounds(cu_seqlens, name: str = "cu_seqlens") -> tuple[int, ...]:
    """The host values of a ``cu_seqlens`` (a 1-D integer tensor or a sequence of ints), checked: it
    starts at 0 and never decreases (a repeated boundary is an empty document). ``name`` is the argument's
    name in the errors."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex \
                or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"{name} must be a 1-D integer tensor (int32, as flash-attn takes it), got "
                            f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
        bounds = tuple(cu_seqlens.tolist())
    else:
        try:
            bounds = tuple(operator.index(b) for b in cu_seqlens)
        except TypeError:
            raise TypeError(f"{name} must be a 1-D integer tensor, got {type(cu_seqlens).__name__}") from None
    if len(bounds) < 2 or bounds[0] != 0:
        raise ValueError(f"{name} must start at 0 and hold at least one document boundary after it, got "
                         f"{show_bounds(bounds)}")
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{name} must not decrease, got {show_bounds(bounds)}")
    return bounds


def show_bounds(bounds) -> str:
    """``bounds`` for an error message (the first five and last three of a long list)."""
    bounds = list(bounds)
    return str(bounds if len(bounds) <= 10 else bounds[:5] + ["..."] + bounds[-3:])


def document_lengths(bounds: tuple[int, ...]) -> list[int]:
    """Document lengths, empty documents (repeated boundaries) left out."""
    return [b - a for a, b in zip(bounds, bounds[1:]) if b > a]


def document_mask(lengths: list[int], is_causal: bool = True, window_size=(-1, -1)) -> Mask:
    """The documents, each attending only inside itself, under flash-attn's ``causal`` and ``window_size``."""
    window = _window_mask(bool(is_causal), window_size)
    docs = document(lengths, causal=window.is_causal)
    return docs if window in (causal(), full()) else docs & window


def documents_view(cp: ContextParallel, cu_seqlens, name: str = "cu_seqlens") -> ContextParallel:
    """One step's view of ``cp`` (``cp.base.with_mask``) for the packed documents ``cu_seqlens`` (global
    boundaries over the first ``n <= seq_len`` tokens of the row): their document mask, plus one filler
    document of the ``seq_len - n`` tokens after them (it attends only itself, so it changes nothing else;
    their labels are to be ignored), intersected with ``cp``'s mask when that is neither ``"causal"`` nor
    ``"full"`` (e.g. a window). Collective over ``cp``'s group the first time a mask is met."""
    base = cp.base
    bounds = read_bounds(cu_seqlens, name)
    if bounds[-1] > base.seq_len:
        raise ValueError(f"{name} covers {bounds[-1]} tokens, more than the ContextParallel's seq_len={base.seq_len}")
    fill = base.seq_len - bounds[-1]
    documents = document_mask(document_lengths(bounds) + ([fill] if fill else []), base.mask.is_causal)
    plain = base.mask.name in ("causal", "full")
    return base.with_mask(documents if plain else base.mask & documents)
