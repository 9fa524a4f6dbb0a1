"""Piece covers of structured masks, stacked kernel calls, and their exactness (docs/masks_speed.md).

A mask's ``cover`` of any rectangle (and ``blocks.for_ranks`` of whole ranks' rectangles) is compared cell
by cell with the dense mask: every allowed pair exactly once, FULL pieces all allowed, CAUSAL pieces
square. Stacked calls keep the kernel invocations of many small documents to a handful, and the forward
and backward through ``attend`` / ``attend_backward`` match a float64 plain softmax reference."""

from __future__ import annotations

import random

import pytest
import torch
from cpattn.masks import BlockKind, Mask
from hypothesis import given, settings
from hypothesis import strategies as st

from cpattn import ContextParallel, kernels, layout, masks
from cpattn.core import blocks
from cpattn.core.comm import Communicator
from cpattn.schedules.base import Accumulators, Runtime, attend, attend_backward


def _doc_lengths(total: int, max_len: int) -> st.SearchStrategy[list[int]]:
    """Lengths summing to ``total``, 1-token documents included."""
    def split(seed: int) -> list[int]:
        rng, out, left = random.Random(seed), [], total
        while left:
            n = min(left, rng.choice([1, 1, 2, rng.randint(1, max_len)]))
            out.append(n)
            left -= n
        return out
    return st.integers(0, 10**6).map(split)


SEQ = 96
MASKS = st.one_of(
    st.builds(masks.document, _doc_lengths(SEQ, 40), st.booleans()),
    st.builds(masks.sliding_window, st.integers(1, 94), st.booleans()),
    st.builds(masks.streaming, st.integers(0, 9), st.integers(1, 30), st.sampled_from([1, 1, 3, 8])),
    st.builds(masks.star, st.sampled_from([2, 5, 8]), st.integers(0, 3)),
    st.builds(masks.strided, st.sampled_from([2, 4, 8]), st.integers(2, 5), st.integers(1, 3), st.booleans()),
    st.builds(masks.global_local, st.sampled_from([4, 8]), st.integers(0, 2), st.integers(1, 3)),
    st.builds(lambda cells, bs: masks.block_table([cells[i:i + SEQ // bs] for i in range(0, len(cells), SEQ // bs)],
                                                  bs),
              st.lists(st.integers(0, 2), min_size=(SEQ // 8) ** 2, max_size=(SEQ // 8) ** 2), st.just(8)),
    st.just(masks.causal()),
)
RECTS = st.tuples(st.integers(0, SEQ - 1), st.integers(1, SEQ), st.integers(0, SEQ - 1), st.integers(1, SEQ))


def _piece_dense(p: masks.Piece, mask: Mask | None = None) -> torch.Tensor:
    n, m = p.q1 - p.q0, p.k1 - p.k0
    if p.kind == BlockKind.PARTIAL:  # a band tile: the pairs of its rectangle that the mask allows
        assert mask is not None and n <= masks.BAND_TILE, p
        return mask.dense(p.q0, p.q1, p.k0, p.k1).int()
    ones = torch.ones(n, m, dtype=torch.int32)
    if p.kind == BlockKind.FULL:
        return ones
    assert p.kind == BlockKind.CAUSAL and n == m, p
    return ones.triu() if p.flip else ones.tril()


def _bands(mask: Mask) -> bool:
    """Masks whose cover may hold PARTIAL band tiles: narrow token windows (sliding or streaming)."""
    token_window = isinstance(mask, masks.SlidingWindowMask) or (
        isinstance(mask, masks.StreamingMask) and mask.block_size == 1)
    return token_window and mask.window < masks.BAND_MAX_WINDOW


def _check_cover(mask: Mask, q0: int, q1: int, k0: int, k1: int) -> list[masks.Piece]:
    pieces = mask.cover(q0, q1, k0, k1)
    assert pieces is not None, mask
    want = mask.dense(q0, q1, k0, k1)
    got = torch.zeros(q1 - q0, k1 - k0, dtype=torch.int32)
    for p in pieces:
        assert q0 <= p.q0 < p.q1 <= q1 and k0 <= p.k0 < p.k1 <= k1, p
        assert p.kind != BlockKind.PARTIAL or _bands(mask), (mask, p)
        part = _piece_dense(p, mask)
        assert bool(want[p.q0 - q0:p.q1 - q0, p.k0 - k0:p.k1 - k0][part.bool()].all()), (mask, p)
        got[p.q0 - q0:p.q1 - q0, p.k0 - k0:p.k1 - k0] += part
    assert int(got.max()) <= 1, "overlapping pieces"
    assert torch.equal(got.bool(), want), mask
    return pieces


def _check_blocks(mask: Mask, bl: list[blocks.Block], qp: torch.Tensor, kp: torch.Tensor) -> None:
    got = torch.zeros(len(qp), len(kp), dtype=torch.int32)
    for b in bl:
        if b.kind == BlockKind.CAUSAL:
            assert b.q.stop - b.q.start == b.kv.stop - b.kv.start
        if b.kind == BlockKind.CAUSAL and not b.flip and mask.is_causal and isinstance(
                mask, (masks.DocumentMask, masks.CausalMask)):
            assert torch.equal(qp[b.q], kp[b.kv]), "a causal piece of a causal document lies on the diagonal"
        got[b.q, b.kv] += b.dense().int()
    assert int(got.max()) <= 1
    assert torch.equal(got.bool(), mask.mask_mod(qp[:, None], kp[None, :]))


@settings(max_examples=100, deadline=None)
@given(mask=MASKS, rect=RECTS)
def test_cover_of_random_rectangles_is_exact(mask, rect):
    q0, n, k0, m = rect
    _check_cover(mask, q0, min(SEQ, q0 + n), k0, min(SEQ, k0 + m))


@settings(max_examples=30, deadline=None)
@given(mask=MASKS, world=st.integers(1, 4), name=st.sampled_from(["contiguous", "zigzag"]))
def test_cover_of_whole_ranks_is_exact(mask, world, name):
    lay = layout.Layout(name)
    seq = 2 * world * (SEQ // (2 * world))
    mask = _fit(mask, seq)
    for r in range(world):
        for j in range(world):
            bl = blocks.for_ranks(mask, lay, seq, world, r, [j])
            assert _bands(mask) or all(b.kind != BlockKind.PARTIAL for b in bl), \
                "structured masks leave nothing dense but band tiles"
            _check_blocks(mask, bl, lay.positions(seq, world, r), lay.positions(seq, world, j))


def _fit(mask: Mask, seq: int) -> Mask:
    """The same kind of mask over ``seq`` tokens (documents re-cut to sum to ``seq``)."""
    if isinstance(mask, masks.DocumentMask) and mask.total != seq:
        lengths = [n for n in mask.lengths if n]
        while sum(lengths) > seq:
            lengths[-1] -= min(lengths[-1], sum(lengths) - seq)
            lengths = [n for n in lengths if n]
        return masks.document([*lengths, seq - sum(lengths)] if sum(lengths) < seq else lengths, mask.causal)
    return mask


@pytest.mark.parametrize("doc", [1, 2, 3, 4])
def test_a_thousand_tiny_documents(doc):
    lengths = [doc] * (4096 // doc) + ([4096 % doc] if 4096 % doc else [])
    mask = masks.document(lengths)
    pieces = _check_cover(mask, 1000, 3100, 900, 3200)
    assert all(p.kind != BlockKind.PARTIAL for p in pieces)
    bl = blocks.for_ranks(mask, layout.Layout("contiguous"), 4096, 1, 0, [0])
    assert len(bl) == len(lengths) and len(blocks.batches(bl)) <= 2


def test_random_documents_of_a_whole_rank():
    rng = random.Random(7)
    lengths = []
    while sum(lengths) < 4096:
        lengths.append(rng.choice([1, 2, 5, 7, 8, rng.randint(1, 300)]))
    lengths[-1] -= sum(lengths) - 4096
    mask = masks.document([n for n in lengths if n])
    for q0, q1, k0, k1 in [(0, 4096, 0, 4096), (1024, 2048, 0, 1024), (2000, 3000, 1500, 2500)]:
        _check_cover(mask, q0, q1, k0, k1)


def test_window_cover_has_no_dense_part_and_few_calls():
    s = 8192
    for causal in (True, False):
        _check_cover(masks.sliding_window(64, causal), 0, 1024, 0, 1024)
        mask = masks.sliding_window(1024, causal)
        pieces = mask.cover(0, s, 0, s)
        assert all(p.kind != BlockKind.PARTIAL for p in pieces)
        assert len(pieces) <= 3 * (s // masks.WINDOW_TILE)
        assert sum(int(_piece_dense(p).sum()) for p in pieces) == masks.allowed_pairs(mask, s)
        bl = blocks.for_ranks(mask, layout.Layout("contiguous"), s, 1, 0, [0])
        assert len(blocks.batches(bl)) <= 10


def test_masks_without_structure_fall_back_to_halving():
    mod = masks.from_mask_mod(lambda q, k: (q - k) % 3 == 0)
    assert mod.cover(0, 8, 0, 8) is None
    combo = masks.sliding_window(8) & masks.document([20, 44])
    assert combo.cover(0, 64, 0, 64) is None
    bl = blocks.rectangles(combo, [(0, 64)], [(0, 64)], tile=16)
    _check_blocks(combo, bl, torch.arange(64), torch.arange(64))


# ---------------------------------------------------------------------------------- stacked kernel calls
def _count_calls(monkeypatch) -> list[int]:
    calls = [0]
    original = kernels._run_forward

    def counted(*args):
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(kernels, "_run_forward", counted)
    return calls


def test_64_token_documents_take_one_stacked_call(monkeypatch):
    s = 8192
    mask = masks.document([64] * (s // 64))
    bl = blocks.for_ranks(mask, layout.Layout("contiguous"), s, 1, 0, [0])
    assert len(bl) == 128 and len(blocks.batches(bl)) == 1
    calls = _count_calls(monkeypatch)
    cp = ContextParallel(s, mask, "ring")
    q = torch.randn(1, s, 2, 16)
    k, v = torch.randn(1, s, 1, 16), torch.randn(1, s, 1, 16)
    cp.attention(q, k, v)
    assert calls[0] == 1


def test_batches_bound_rows_and_keep_query_rows_disjoint():
    bl = [blocks.Block(slice(i, i + 8), slice(j, j + 8), BlockKind.FULL) for i in range(0, 64, 8) for j in (0, 16)]
    out = blocks.batches(bl, max_rows=32)
    assert sum(len(b.blocks) for b in out) == len(bl)
    for b in out:
        rows = b.rows()
        assert len(b.blocks) * 8 <= 32 and rows.unique().numel() == rows.numel()


# ---------------------------------------------------------------------------------- exactness
def _reference(q, k, v, allowed, scale):
    """Float64 softmax(QK^T * scale + mask) V with autograd; rows with no key give 0."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vv), (q, k, v)


EXACT_MASKS = [
    masks.document([1, 1, 30, 2, 1, 60, 7, 1, 17, 8]),
    masks.document([4] * 32),
    masks.document([1, 1, 30, 2, 1, 60, 7, 1, 17, 8], causal=False),
    masks.sliding_window(9), masks.sliding_window(13, causal=False), masks.sliding_window(1),
    masks.streaming(3, 10), masks.streaming(1, 2, 8),
    masks.block_table([[2, 0, 0, 0], [1, 2, 0, 0], [0, 1, 2, 0], [1, 0, 1, 2]], 32),
    masks.strided(8, 3, 1), masks.global_local(16, 1, 2),
]


@pytest.mark.parametrize("mask", EXACT_MASKS, ids=repr)
@pytest.mark.parametrize("world_layout", [(1, "contiguous"), (2, "zigzag"), (4, "contiguous")])
def test_attend_matches_float64_reference(mask, world_layout):
    """Every rank's queries against every rank's keys through attend / attend_backward (one process),
    key gradients summed over query ranks, against the float64 reference of the whole sequence."""
    world, name = world_layout
    s, h, hkv, d, seed = 128, 4, 2, 16, 11 + world
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(2, s, n, d, generator=gen) for n in (h, hkv, hkv, h))
    lay = layout.Layout(name)
    rt = Runtime(Communicator(None), mask, lay, s, scale=d ** -0.5)
    ref, leaves = _reference(q, k, v, mask.dense(0, s, 0, s), rt.scale)
    ref.backward(dout.double())
    pos = [lay.positions(s, world, r) for r in range(world)]
    dk, dv = torch.zeros(2, s, hkv, d), torch.zeros(2, s, hkv, d)
    for r in range(world):
        qi = pos[r]
        acc = Accumulators(q[:, qi])
        for j in range(world):
            attend(rt, q[:, qi], k[:, pos[j]], v[:, pos[j]], blocks.for_ranks(mask, lay, s, world, r, [j]), acc)
        out, lse = acc
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref[:, qi].detach(), atol=2e-5, rtol=1e-5, msg=f"seed {seed}")
        dq = torch.full_like(out, 0.0)
        for j in range(world):
            dk_j, dv_j = torch.zeros(2, len(pos[j]), hkv, d), torch.zeros(2, len(pos[j]), hkv, d)
            attend_backward(rt, dout[:, qi], q[:, qi], k[:, pos[j]], v[:, pos[j]], out, lse,
                            blocks.for_ranks(mask, lay, s, world, r, [j]), dq, dk_j, dv_j)
            dk[:, pos[j]] += dk_j
            dv[:, pos[j]] += dv_j
        torch.testing.assert_close(dq.double(), leaves[0].grad[:, qi], atol=2e-5, rtol=1e-5, msg=f"seed {seed}")
    torch.testing.assert_close(dk.double(), leaves[1].grad, atol=2e-5, rtol=1e-5, msg=f"seed {seed}")
    torch.testing.assert_close(dv.double(), leaves[2].grad, atol=2e-5, rtol=1e-5, msg=f"seed {seed}")


@pytest.mark.parametrize("mask", [masks.sliding_window(40), masks.sliding_window(600), masks.document([5] * 40 + [824]),
                                  masks.streaming(4, 2, 16), masks.sliding_window(64) & masks.document([300, 724])])
def test_a_cover_without_masks_has_the_same_pieces_and_pair_counts(mask):
    """``rectangles(..., dense=False)`` (what the planner prices) gives the blocks the executor runs,
    PARTIAL ones with their pair count instead of their mask."""
    for rows, cols in [([(0, 1024)], [(0, 1024)]), ([(256, 512), (768, 1024)], [(0, 256), (512, 768)])]:
        full = blocks.rectangles(mask, rows, cols)
        shapes = blocks.rectangles(mask, rows, cols, dense=False)
        assert [(b.q, b.kv, b.kind, b.flip, b.area) for b in full] == \
            [(b.q, b.kv, b.kind, b.flip, b.area) for b in shapes]
        assert all(b.mask is None for b in shapes)
        if isinstance(mask, masks.SlidingWindowMask) and mask.window < 512:  # band tiles: PARTIAL pieces
            assert any(b.kind == BlockKind.PARTIAL for b in full)
