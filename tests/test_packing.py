"""``cpattn.packing``: flash-attn's ``cu_seqlens`` read once and turned into document masks and a step's
view of a ContextParallel (one process, no communication)."""

from __future__ import annotations

import pytest
import torch

import cpattn
from cpattn.packing import document_lengths, document_mask, documents_view, read_bounds


def test_cu_seqlens_are_read_and_checked():
    assert read_bounds(torch.tensor([0, 3, 3, 8], dtype=torch.int32)) == (0, 3, 3, 8)
    assert document_lengths((0, 3, 3, 8)) == [3, 5]  # a repeated boundary is an empty document
    with pytest.raises(ValueError, match="cu_seq_lens_q must start at 0"):
        read_bounds([1, 4], "cu_seq_lens_q")
    with pytest.raises(ValueError, match="must not decrease"):
        read_bounds([0, 4, 2])
    with pytest.raises(TypeError, match="1-D integer tensor"):
        read_bounds(torch.tensor([0.0, 4.0]))


def test_document_masks_follow_flash_attn_windows():
    assert document_mask([3, 5], True) == cpattn.masks.document([3, 5])
    assert document_mask([3, 5], False) == cpattn.masks.document([3, 5], causal=False)
    windowed = document_mask([3, 5], True, (1, 0))
    assert windowed == cpattn.masks.document([3, 5]) & cpattn.masks.sliding_window(2)


def test_documents_view_fills_the_row_and_keeps_a_window():
    cp = cpattn.ContextParallel(12, mask="causal", schedule="ring")
    view = documents_view(cp, [0, 3, 8])
    assert view.base is cp and view.mask == cpattn.masks.document([3, 5, 4])
    assert documents_view(view, [0, 12]).mask == cpattn.masks.document([12])  # a view's base is used
    windowed = cpattn.ContextParallel(12, mask=cpattn.masks.sliding_window(4), schedule="ring")
    assert documents_view(windowed, [0, 5, 12]).mask == cpattn.masks.sliding_window(4) & cpattn.masks.document([5, 7])
    with pytest.raises(ValueError, match="covers 13 tokens, more than the ContextParallel's seq_len=12"):
        documents_view(cp, [0, 13])
