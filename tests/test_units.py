"""Pure pieces: masks, layouts, blocks, merge and kernels (no process group)."""

from __future__ import annotations

import math

import pytest
import torch
from cpattn.masks import BlockKind
from hypothesis import given, settings
from hypothesis import strategies as st

from cpattn import kernels, layout, masks, merge
from cpattn.core import blocks


# ------------------------------------------------------------------ masks
@settings(max_examples=200, deadline=None)
@given(q0=st.integers(0, 60), n=st.integers(1, 20), k0=st.integers(0, 60), m=st.integers(1, 20))
def test_causal_classifier_agrees_with_dense(q0, n, k0, m):
    mask = masks.causal()
    kind = mask.classify(q0, q0 + n, k0, k0 + m)
    dense = torch.arange(k0, k0 + m)[None, :] <= torch.arange(q0, q0 + n)[:, None]
    assert torch.equal(mask.dense(q0, q0 + n, k0, k0 + m), dense)
    assert kind == masks._kind_of_dense(dense)


@settings(max_examples=100, deadline=None)
@given(q0=st.integers(0, 40), n=st.integers(1, 16), k0=st.integers(0, 40), m=st.integers(1, 16),
       w=st.integers(1, 10))
def test_mask_mod_classifier_agrees_with_dense(q0, n, k0, m, w):
    mask = masks.from_mask_mod(lambda q, k: (k <= q) & (q - k < w), name="window")
    dense = mask.dense(q0, q0 + n, k0, k0 + m)
    assert mask.classify(q0, q0 + n, k0, k0 + m) == masks._kind_of_dense(dense)


def test_classify_does_not_build_the_whole_matrix():
    """A 1M-token causal mask classifies instantly (no S x S tensor)."""
    mask = masks.causal()
    s = 1 << 20
    assert mask.classify(0, s, 0, s) == BlockKind.CAUSAL
    assert mask.classify(s // 2, s, 0, s // 2) == BlockKind.FULL
    assert mask.classify(0, s // 2, s // 2, s) == BlockKind.EMPTY


def test_resolve_rejects_unknown():
    with pytest.raises(ValueError, match="accepted"):
        masks.resolve("diagonal")


# ------------------------------------------------------------------ layouts
@pytest.mark.parametrize("name", layout.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layout_partitions_and_roundtrips(name, world):
    lay = layout.Layout(name)
    seq = 2 * world * 3
    pos = torch.cat([lay.positions(seq, world, r) for r in range(world)])
    assert torch.equal(pos.sort().values, torch.arange(seq))
    x = torch.randn(2, seq, 3)
    parts = [layout.shard(x, lay, world, r, dim=1) for r in range(world)]
    assert torch.equal(layout.assemble(parts, lay, dim=1), x)


def test_zigzag_chunks():
    lay = layout.Layout("zigzag")
    assert lay.ranges(16, 4, 1) == [(2, 4), (12, 14)]
    assert lay.positions(8, 2, 0).tolist() == [0, 1, 6, 7]


def test_layout_errors_name_the_multiple():
    with pytest.raises(ValueError, match="multiple of 6"):
        layout.Layout("zigzag").check(10, 3)
    with pytest.raises(ValueError, match="unknown"):
        layout.Layout("spiral")


# ------------------------------------------------------------------ blocks
def test_zigzag_blocks_follow_the_balanced_rule():
    lay, mask, world, seq = layout.Layout("zigzag"), masks.causal(), 4, 32
    c = seq // (2 * world)
    for r in range(world):
        areas = []
        for i in range(world):
            bl = blocks.for_ranks(mask, lay, seq, world, r, [i])
            areas.append(sum(b.area for b in bl))
            if i < r:  # all local queries x first half of kv_i, one FULL call
                assert [(b.q, b.kv, b.kind) for b in bl] == [(slice(0, 2 * c), slice(0, c), BlockKind.FULL)]
            if i > r:  # second local half x all of kv_i
                assert [(b.q, b.kv, b.kind) for b in bl] == [(slice(c, 2 * c), slice(0, 2 * c), BlockKind.FULL)]
        assert all(a == 2 * c * c for i, a in enumerate(areas) if i != r)


def test_striped_blocks_shift_above_the_diagonal():
    bl = blocks.striped(masks.causal(), 5, q_rank=1, kv_rank=2)
    assert [(b.q, b.kv, b.kind) for b in bl] == [(slice(1, 5), slice(0, 4), BlockKind.CAUSAL)]
    with pytest.raises(NotImplementedError):
        blocks.striped(masks.from_mask_mod(lambda q, k: q >= k), 5, 0, 0)


# ------------------------------------------------------------------ merge
def _attn64(q, k, v):
    s = torch.einsum("bqhd,bkhd->bhqk", q, k)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


def test_pairwise_merge_is_exact_and_handles_empty_rows():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 4, dtype=torch.float64) for _ in range(3))
    full_o, full_l = _attn64(q, k, v)
    o1, l1 = _attn64(q, k[:, :2], v[:, :2])
    o2, l2 = _attn64(q, k[:, 2:], v[:, 2:])
    acc_o = torch.zeros_like(o1)
    acc_l = torch.full_like(l1, -math.inf)
    merge.merge_into(acc_o, acc_l, o1, l1)
    merge.merge_into(acc_o, acc_l, o2, l2)
    assert torch.allclose(acc_o, full_o, atol=1e-12) and torch.allclose(acc_l, full_l, atol=1e-12)
    # a partial with lse -inf changes nothing; an untouched row stays (0, -inf) without NaN
    empty_o, empty_l = torch.zeros_like(o1), torch.full_like(l1, -math.inf)
    merge.merge_into(acc_o, acc_l, empty_o, empty_l)
    assert torch.allclose(acc_o, full_o, atol=1e-12)
    z_o, z_l = torch.zeros_like(o1), torch.full_like(l1, -math.inf)
    merge.merge_into(z_o, z_l, empty_o, empty_l)
    assert not z_o.isnan().any() and bool((z_o == 0).all()) and bool(torch.isneginf(z_l).all())


# ------------------------------------------------------------------ kernels
def _ref(q, k, v, allowed, scale):
    g = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = (torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale).masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(lse.isinf(), 0.0, lse)[..., None])
    return torch.einsum("bhqk,bkhd->bqhd", p, vr), lse


@pytest.mark.parametrize("backend", ["aten", "math"])
@pytest.mark.parametrize("kind", [BlockKind.FULL, BlockKind.CAUSAL, BlockKind.PARTIAL])
def test_kernels_forward_backward_float64(backend, kind):
    torch.manual_seed(1)
    sq = 12
    sk = sq if kind == BlockKind.CAUSAL else 9
    q = torch.randn(2, sq, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, sk, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, sk, 2, 8, dtype=torch.float64, requires_grad=True)
    if kind == BlockKind.FULL:
        allowed, mask = torch.ones(sq, sk, dtype=torch.bool), None
    elif kind == BlockKind.CAUSAL:
        allowed, mask = torch.ones(sq, sk, dtype=torch.bool).tril(), None
    else:
        allowed = torch.rand(sq, sk) < 0.4
        allowed[3] = False  # a row with no key at all
        mask = allowed
    ref_o, ref_l = _ref(q, k, v, allowed, 0.3)
    dout = torch.randn_like(ref_o)
    ref_o.backward(dout)
    o, lse = kernels.forward(q.detach(), k.detach(), v.detach(), kind, 0.3, mask, backend)
    assert torch.allclose(o, ref_o.detach(), atol=1e-10) and torch.equal(lse.isinf(), ref_l.isinf())
    assert torch.allclose(lse[~lse.isinf()], ref_l.detach()[~lse.isinf()], atol=1e-10)
    dq, dk, dv = kernels.backward(dout, q.detach(), k.detach(), v.detach(), o, lse, kind, 0.3, mask, backend)
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert not got.isnan().any()
        assert torch.allclose(got, want, atol=1e-10)
    if kind == BlockKind.PARTIAL:
        assert bool((o[:, 3] == 0).all()) and bool(torch.isneginf(lse[:, :, 3]).all())
        assert bool((dq[:, 3] == 0).all())


def test_kernels_reject_bad_blocks():
    q = torch.randn(1, 4, 2, 8)
    k = torch.randn(1, 5, 2, 8)
    with pytest.raises(ValueError, match="square"):
        kernels.forward(q, k, k, BlockKind.CAUSAL, 1.0)
    with pytest.raises(ValueError, match="EMPTY"):
        kernels.forward(q, k, k, BlockKind.EMPTY, 1.0)
    with pytest.raises(ValueError, match="bool mask"):
        kernels.forward(q, k, k, BlockKind.PARTIAL, 1.0)
    with pytest.raises(NotImplementedError):
        kernels.check_backend("flex")
    with pytest.raises(ValueError):
        kernels.check_backend("cudnn")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernels_low_precision_returns_float32(dtype):
    q = torch.randn(1, 8, 2, 16).to(dtype)
    o, lse = kernels.forward(q, q, q, BlockKind.CAUSAL, 0.25)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == (1, 2, 8)
