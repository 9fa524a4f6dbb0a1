"""Masks for real workloads: classification against the dense form, the library's definitions against
the reference's own, blocks and layouts built from them, and every schedule exact under every mask it
claims (forward and backward against float64, communication equal to its formula)."""

from __future__ import annotations

import dataclasses
import random

import fuzz_workers
import pytest
import torch
from cpattn.masks import BlockKind, _kind_of_dense
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cpattn import exactness, layout, masks, schedules
from cpattn.core import blocks
from cpattn.core.steps import Problem
from cpattn.schedules.stripe_ring import striped_blocks

#: combinations of masks (their spec lists the masks they combine); every other kind is a simple mask
COMPOSITES = ("and", "or")
KINDS = [k for k in masks.KINDS if k not in COMPOSITES]


# ------------------------------------------------------------------ mask strategies (JSON specs)
def _lengths(total: int):
    return st.lists(st.integers(1, max(1, total // 2)), min_size=1, max_size=12).map(
        lambda ls: _fit(ls, total))


def _fit(lengths: list[int], total: int) -> list[int]:
    out, acc = [], 0
    for n in lengths:
        if acc + n >= total:
            break
        out.append(n)
        acc += n
    return [*out, total - acc]


SEQ = 64
TABLE_CELLS = st.sampled_from([0, 1, 2])
SPECS = st.one_of(
    st.just({"kind": "causal"}), st.just({"kind": "full"}),
    st.builds(lambda w, c: {"kind": "sliding_window", "window": w, "causal": c}, st.integers(1, 70), st.booleans()),
    st.builds(lambda ls, c: {"kind": "document", "lengths": ls, "causal": c}, _lengths(SEQ), st.booleans()),
    st.builds(lambda bs, s, lo, c: {"kind": "strided", "block_size": bs, "stride": s, "local": lo, "causal": c},
              st.integers(1, 8), st.integers(2, 5), st.integers(1, 3), st.booleans()),
    st.builds(lambda bs, g, lo: {"kind": "global_local", "block_size": bs, "global_blocks": g, "local_blocks": lo},
              st.integers(1, 9), st.integers(0, 2), st.integers(1, 3)),
    st.builds(lambda bs, s: {"kind": "star", "block_size": bs, "sink": s}, st.integers(1, 9), st.integers(0, 3)),
    st.builds(lambda s, w, bs: {"kind": "streaming", "sink": s, "window": w, "block_size": bs},
              st.integers(0, 9), st.integers(1, 12), st.integers(1, 4)),
    st.builds(lambda bs, cells: {"kind": "block_table", "block_size": bs, "table": cells}, st.integers(3, 9),
              st.integers(1, 12).flatmap(lambda n: st.lists(st.lists(TABLE_CELLS, min_size=n, max_size=n),
                                                              min_size=n, max_size=n))),
)
SPECS_WITH_COMBOS = st.one_of(SPECS, st.builds(lambda a, b, op: {"kind": op, "masks": [a, b]}, SPECS, SPECS,
                                                st.sampled_from(["and", "or"])))
RECTS = st.tuples(st.integers(0, SEQ - 1), st.integers(1, 40), st.integers(0, SEQ - 1), st.integers(1, 40),
                  st.sampled_from(["diagonal", "square", "any"]))


def _rect(r):
    """(q0, q1, k0, k1): on the diagonal, square elsewhere, or any shape (squares can be CAUSAL)."""
    q0, n, k0, m, shape = r
    if shape == "diagonal":
        return q0, q0 + n, q0, q0 + n
    return q0, q0 + n, k0, k0 + (n if shape == "square" else m)


# ------------------------------------------------------------------ classification
@settings(max_examples=400, deadline=None)
@given(spec=SPECS_WITH_COMBOS, rects=st.lists(RECTS, min_size=1, max_size=6))
def test_classify_and_counts_agree_with_dense(spec, rects):
    mask = masks.from_spec(spec)
    for r in rects:
        q0, q1, k0, k1 = _rect(r)
        dense = mask.dense(q0, q1, k0, k1)
        assert mask.classify(q0, q1, k0, k1) == _kind_of_dense(dense), (mask, (q0, q1, k0, k1))
        assert torch.equal(mask.row_counts(q0, q1, k0, k1), dense.sum(1)), (mask, (q0, q1, k0, k1))


@settings(max_examples=150, deadline=None)
@given(spec=SPECS_WITH_COMBOS)
def test_definitions_agree_with_the_reference_and_specs_roundtrip(spec):
    """The library's per-pair definition equals verify's independent one; spec() rebuilds the mask."""
    mask = masks.from_spec(spec)
    want = exactness.dense_mask(spec["kind"], SEQ, {k: v for k, v in spec.items() if k != "kind"})
    assert torch.equal(mask.dense(0, SEQ, 0, SEQ), want)
    assert torch.equal(masks.from_spec(mask.spec()).dense(0, SEQ, 0, SEQ), want)
    if mask.is_causal:
        assert not bool(want.triu(1).any())


@settings(max_examples=60, deadline=None)
@given(spec=SPECS, rects=st.lists(RECTS, min_size=1, max_size=4), mod=st.integers(2, 5))
def test_combinations_with_a_mask_mod_classify_from_dense(spec, rects, mod):
    custom = masks.from_mask_mod(lambda q, k: (q + k) % mod != 0, name="custom")
    for mask in (masks.from_spec(spec) & custom, custom | masks.from_spec(spec)):
        for r in rects:
            q0, q1, k0, k1 = _rect(r)
            assert mask.classify(q0, q1, k0, k1) == _kind_of_dense(mask.dense(q0, q1, k0, k1))


def test_examples_of_each_kind():
    win = masks.sliding_window(4)
    assert win.classify(10, 14, 10, 14) == BlockKind.CAUSAL
    assert win.classify(10, 20, 0, 5) == BlockKind.EMPTY
    assert masks.sliding_window(4, causal=False).classify(10, 11, 7, 14) == BlockKind.FULL
    doc = masks.document([4, 4, 8])
    assert doc.classify(8, 16, 8, 16) == BlockKind.CAUSAL
    assert doc.classify(8, 16, 0, 8) == BlockKind.EMPTY
    assert masks.document([4, 4, 8], causal=False).classify(8, 16, 8, 16) == BlockKind.FULL
    star = masks.star(block_size=4)
    assert star.classify(12, 16, 0, 4) == BlockKind.FULL and star.classify(12, 16, 4, 12) == BlockKind.EMPTY
    table = masks.block_table([[2, 0], ["full", "causal"]], block_size=3)
    assert table.classify(3, 6, 0, 3) == BlockKind.FULL and table.classify(0, 3, 3, 6) == BlockKind.EMPTY
    assert table.is_causal and not masks.global_local(4).is_causal
    both = masks.document([8, 8]) & masks.sliding_window(3)
    assert both.name == "document&sliding_window" and both.is_causal
    assert both.classify(8, 16, 0, 8) == BlockKind.EMPTY
    assert (masks.causal() | masks.full()).classify(0, 5, 3, 9) == BlockKind.FULL


def test_long_sequences_classify_without_a_dense_matrix():
    """S = 1M: classification and counts sweep rows (an S x S bool matrix would need 1 TB)."""
    s = 1 << 20
    rng = random.Random(0)
    lengths = []
    while sum(lengths) < s - 40_000:
        lengths.append(rng.randint(1, 40_000))
    lengths.append(s - sum(lengths))
    doc = masks.document(lengths)
    assert doc.classify(0, s, 0, s) == BlockKind.PARTIAL
    assert doc.classify(s - lengths[-1], s, s - lengths[-1], s) == BlockKind.CAUSAL
    assert doc.classify(lengths[0], s, 0, lengths[0]) == BlockKind.EMPTY
    assert masks.allowed_pairs(doc, s) == sum(n * (n + 1) // 2 for n in lengths)
    win = masks.sliding_window(4096)
    assert masks.allowed_pairs(win, s) == 4096 * s - 4095 * 4096 // 2
    assert win.classify(s // 2, s, 0, s // 4) == BlockKind.EMPTY
    for mask in (masks.streaming(4, 1024), masks.strided(1024, 8), masks.global_local(4096, 1, 2),
                 masks.star(8192), masks.block_table([[2 if i == j else int(j == 0) for j in range(64)]
                                                      for i in range(64)], s // 64),
                 doc & masks.sliding_window(512)):
        assert mask.classify(s // 8, s // 4, 0, s // 8) in (BlockKind.PARTIAL, BlockKind.FULL, BlockKind.EMPTY)
        assert mask.count(s // 8, s // 4, 0, s // 4) > 0


@pytest.mark.parametrize("bad, match", [
    (lambda: masks.sliding_window(0), "window"),
    (lambda: masks.document([3, 0, 2]), "document length"),
    (lambda: masks.document([]), "empty"),
    (lambda: masks.strided(4, 1), "stride"),
    (lambda: masks.block_table([[0, 3]], 4), "cells"),
    (lambda: masks.block_table([[0, 1], [1]], 4), "rectangular"),
    (lambda: masks.from_spec({"kind": "spiral"}), "unknown"),
    (lambda: masks.from_spec({"kind": "sliding_window", "width": 3}), "bad arguments"),
    (lambda: masks.from_spec({"kind": "and", "masks": [{"kind": "causal"}]}), "at least two"),
    (lambda: masks.document([3, 4]).check_seq_len(8), "sum to 7"),
    (lambda: masks.block_table([[1]], 4).check_seq_len(8), "covers 4 tokens"),
])
def test_bad_mask_arguments_raise_clearly(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


# ------------------------------------------------------------------ blocks and layouts
def _coverage(bl: list[blocks.Block], nq: int, nk: int) -> torch.Tensor:
    got = torch.zeros(nq, nk, dtype=torch.int32)
    for b in bl:
        got[b.q, b.kv] += b.dense().int()
    return got


@settings(max_examples=80, deadline=None)
@given(spec=SPECS_WITH_COMBOS, cuts=st.lists(st.integers(1, SEQ - 1), min_size=2, max_size=6, unique=True),
       seed=st.integers(0, 100), valid=st.sampled_from([None, SEQ - 5, 33]), tile=st.sampled_from([6, 16, 512]))
def test_blocks_cover_exactly_the_allowed_pairs(spec, cuts, seed, valid, tile):
    """Blocks of any ranges (shuffled, adjacent or not; PARTIAL ones split) cover each allowed pair once,
    and never a padding position."""
    mask = masks.from_spec(spec)
    bounds = [0, *sorted(cuts), SEQ]
    rng = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    random.Random(seed).shuffle(rng)
    q_rng, kv_rng = rng[: len(rng) // 2 + 1], rng[len(rng) // 2:]
    bl = blocks.rectangles(mask, q_rng, kv_rng, valid, tile=tile)
    qp = torch.cat([torch.arange(a, b) for a, b in q_rng])
    kp = torch.cat([torch.arange(a, b) for a, b in kv_rng])
    want = mask.mask_mod(qp[:, None], kp[None, :])
    if valid is not None:
        want = want & (qp[:, None] < valid) & (kp[None, :] < valid)
    got = _coverage(bl, len(qp), len(kp))
    assert int(got.max()) <= 1 and torch.equal(got.bool(), want)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_striped_blocks_skip_padding(world):
    lay = layout.Layout("striped")
    for valid in range(1, 5 * world):
        padded = lay.padded_len(valid, world)
        for r in range(world):
            for j in range(world):
                bl = blocks.for_ranks(masks.causal(), lay, padded, world, r, [j], valid)
                qp, kp = torch.arange(r, padded, world), torch.arange(j, padded, world)
                want = (kp[None, :] <= qp[:, None]) & (qp[:, None] < valid) & (kp[None, :] < valid)
                got = _coverage(bl, len(qp), len(kp))
                assert int(got.max()) <= 1 and torch.equal(got.bool(), want)


@pytest.mark.parametrize("spec", [
    {"kind": "strided", "block_size": 128, "stride": 3, "local": 2},
    {"kind": "strided", "block_size": 128, "stride": 4, "local": 1, "causal": False},
    {"kind": "global_local", "block_size": 128, "global_blocks": 1, "local_blocks": 2},
    {"kind": "star", "block_size": 256, "sink": 1},
    {"kind": "streaming", "block_size": 128, "sink": 1, "window": 3},
    {"kind": "block_table", "block_size": 128, "table": [[1, 0, 0, 0, 0, 0, 0, 0]] + [[1, 2, 0, 0, 0, 0, 0, 0]] * 7},
])
@pytest.mark.parametrize("world", [2, 4])
def test_striped_blocks_of_block_masks_tile_by_cells(spec, world):
    """Block-sparse masks whose cells hold at least MIN_CELL_ROWS local rows are tiled cell by cell:
    every allowed pair once, no dense tile unless a cell is PARTIAL, and runs of FULL cells as one."""
    from cpattn.schedules.stripe_ring import MIN_CELL_ROWS
    mask, seq = masks.from_spec(spec), 1024
    assert mask.block_size // world >= MIN_CELL_ROWS
    for r in range(world):
        for j in range(world):
            bl = striped_blocks(mask, seq, world, r, j)
            qp, kp = torch.arange(r, seq, world), torch.arange(j, seq, world)
            got = _coverage(bl, len(qp), len(kp))
            assert int(got.max()) <= 1 and torch.equal(got.bool(), mask.mask_mod(qp[:, None], kp[None, :]))
            assert all(b.kind != BlockKind.PARTIAL for b in bl)
            assert all(b.q.stop - b.q.start == mask.block_size // world for b in bl if b.kind == BlockKind.FULL)


@settings(max_examples=30, deadline=None)
@given(spec=SPECS_WITH_COMBOS, world=st.integers(1, 4), cut=st.integers(0, 7), tile=st.sampled_from([5, 512]))
def test_striped_blocks_of_any_mask_cover_exactly_the_allowed_pairs(spec, world, cut, tile):
    """``stripe_ring``'s blocks for any mask (tiles classified on their global spans, the rest dense at
    the tokens' positions) cover each allowed pair of every rank pair once, never a padding position."""
    mask = masks.from_spec(spec)
    valid = SEQ - cut
    padded = layout.Layout("striped").padded_len(valid, world)
    for r in range(world):
        for j in range(world):
            bl = striped_blocks(mask, padded, world, r, j, None if valid == padded else valid, tile=tile)
            qp, kp = torch.arange(r, padded, world), torch.arange(j, padded, world)
            want = mask.mask_mod(qp[:, None], kp[None, :]) & (qp[:, None] < valid) & (kp[None, :] < valid)
            got = _coverage(bl, len(qp), len(kp))
            assert int(got.max()) <= 1 and torch.equal(got.bool(), want), (spec, world, valid, r, j)


@pytest.mark.parametrize("mask", [masks.sliding_window(24), masks.sliding_window(70), masks.sliding_window(9, False),
                                  masks.causal(), masks.full()])
def test_striped_pairs_of_a_shift_invariant_mask_are_shared_by_rank_offset(mask):
    """Under a mask that depends on q - k alone, the striped work of (q_rank, kv_rank) is that of any
    pair at the same offset: ``StripedPairs`` classifies 2P - 1 pairs and gives every pair exactly what
    classifying it on its own gives."""
    from cpattn.core.pairs import work
    from cpattn.core.steps import Kernel
    from cpattn.schedules.stripe_ring import StripedPairs

    assert mask.shift_invariant and not masks.document([128, 128]).shift_invariant
    world, seq = 4, 256
    shared = StripedPairs(mask, seq, world)
    for r in range(world):
        for j in range(world):
            own = work((Kernel(b.kind.value, b.q.stop - b.q.start, b.kv.stop - b.kv.start, b.area), 1)
                       for b in striped_blocks(mask, seq, world, r, j, tile=16))
            alone = work((Kernel(b.kind.value, b.q.stop - b.q.start, b.kv.stop - b.kv.start, b.area), 1)
                         for b in striped_blocks(mask, seq, world, r, j))
            assert shared.pair(r, j) == alone, (r, j)
            assert sum(k.area * n for k, n in own) == sum(k.area * n for k, n in alone)
    assert len(shared._cache) == 2 * world - 1


@pytest.mark.parametrize("mask", [masks.document([13, 40, 7, 100, 96]), masks.sliding_window(37),
                                  masks.sliding_window(11, False), masks.streaming(4, 3, 8),
                                  masks.sliding_window(30) & masks.document([100, 156])])
def test_striped_shapes_to_price_match_the_blocks_that_run(mask):
    """``striped_blocks(..., dense=False)`` (counts from key intervals, spans classified once) gives the
    blocks the run uses, PARTIAL ones with their pair count instead of their mask."""
    world, seq, spans = 4, 256, {}
    for r in range(world):
        for j in range(world):
            run = striped_blocks(mask, seq, world, r, j, tile=16)
            priced = striped_blocks(mask, seq, world, r, j, tile=16, spans=spans, dense=False)
            assert [(b.q, b.kv, b.kind, b.area) for b in run] == [(b.q, b.kv, b.kind, b.area) for b in priced]
            assert all(b.mask is None for b in priced)
    assert spans  # classified once, shared by the pairs


def test_explicit_layouts_validate_and_roundtrip():
    lay = layout.Layout.explicit([[(0, 2), (6, 8)], [(2, 6)]])
    assert lay.positions(8, 2, 0).tolist() == [0, 1, 6, 7] and lay.padded_len(7, 2) == 8
    x = torch.randn(1, 8, 3)
    assert torch.equal(layout.assemble([layout.shard(x, lay, 2, r) for r in range(2)], lay), x)
    with pytest.raises(ValueError, match="exactly once"):
        layout.Layout.explicit([[(0, 2)], [(1, 3)]])
    with pytest.raises(ValueError, match="different numbers"):
        layout.Layout.explicit([[(0, 1)], [(1, 4)]])
    with pytest.raises(ValueError, match="for 2 ranks"):
        lay.ranges(8, 3, 0)
    assert layout.Layout("zigzag").padded_len(13, 3) == 18


def test_balanced_layout_is_zigzag_for_causal_and_balances_documents():
    world, seq = 4, 64
    bal = layout.balanced(masks.causal(), seq, world, chunks_per_rank=2)
    zig = layout.Layout("zigzag")
    assert all(bal.positions(seq, world, r).tolist() == zig.positions(seq, world, r).tolist() for r in range(world))
    doc = masks.document([40, 3, 5, 16])
    contiguous = layout.work_report(layout.Layout("contiguous"), doc, seq, world)
    balanced = layout.work_report(layout.balanced(doc, seq, world), doc, seq, world)
    assert sum(balanced.per_rank) == sum(contiguous.per_rank) == masks.allowed_pairs(doc, seq)
    assert balanced.imbalance < contiguous.imbalance and balanced.imbalance < 1.2
    win = masks.sliding_window(8)
    padded = layout.work_report(layout.balanced(win, 48, 3, valid_len=45), win, 48, 3, valid_len=45)
    assert sum(padded.per_rank) == masks.allowed_pairs(win, 45)


# ------------------------------------------------------------------ every schedule, every mask it claims
def _takes_causal_flag(kind: str) -> bool:
    """Whether mask kind ``kind`` has a bidirectional form (its spec takes ``causal: false``)."""
    if kind in COMPOSITES:
        return True  # through the masks it combines
    try:
        return not masks.from_spec({"kind": kind, **(exactness.example_mask_args(kind, SEQ) or {}),
                                    "causal": False}).is_causal
    except ValueError:
        return False


def _spec(kind: str, seq: int, bidirectional: bool = False) -> tuple[str, dict | None]:
    """``(kind, args)`` of an interesting mask of ``kind`` at length ``seq``; its bidirectional form when
    asked (the kinds that take a ``causal`` flag; a combination of bidirectional masks)."""
    if kind in COMPOSITES:
        parts = [{"kind": "document", "lengths": [13, 1, 20, seq - 34]}, {"kind": "sliding_window", "window": 6}]
        return kind, {"masks": [{**m, "causal": False} if bidirectional else m for m in parts]}
    args = exactness.example_mask_args(kind, seq)
    return kind, ({**(args or {}), "causal": False} if bidirectional else args)


BIDIRECTIONAL_KINDS = [k for k in KINDS if _takes_causal_flag(k)]


#: the pipelined causal RingX variants run the masks at P = 3 only: their blocks and messages are their
#: plain variant's, only the order differs
PIPELINED = ("ringx2o", "ringx4o")


def _mask_cases() -> list[exactness.Case]:
    kinds = [_spec(k, 48) for k in masks.KINDS] + [_spec(k, 48, bidirectional=True) for k in BIDIRECTIONAL_KINDS]
    names = [n for n in schedules.names() if n not in ("ulysses", "usp")]  # in test_ulysses_usp.py
    cases = exactness.matrix(names, worlds=(2, 3), subgroup=False, masks=tuple(kinds), dtypes=("float32",),
                          heads=((4, 2),), seed=1000)
    cases = [c for c in cases if c.world == 3 or c.schedule not in PIPELINED]
    # causal and full on the other schedules are test_exactness.py's
    return [c for c in cases if c.schedule == "ring" or c.mask not in ("causal", "full")]


MASK_CASES = _mask_cases()


def _bidirectional(case: exactness.Case) -> bool:
    """Whether ``case`` runs the full mask or a bidirectional form (a combination: of bidirectional masks)."""
    args = case.mask_args or {}
    return case.mask == "full" or args.get("causal") is False or (
        bool(args.get("masks")) and all(m.get("causal") is False for m in args["masks"]))


@pytest.mark.parametrize("case", MASK_CASES, ids=[c.label for c in MASK_CASES])
def test_schedule_is_exact_under_mask(worlds, case):
    result = exactness.run(worlds.get(case.world), case)
    assert result.passed, result.describe()


#: every mask kind except global_local (bidirectional, no causal form) has a form contained in causal
CAUSAL_KINDS = set(masks.KINDS) - {"causal", "full", "global_local"}
CAUSAL_ONLY = ("ringx2", "ringx2o", "ringx3", "ringx4", "ringx4o")


def test_mask_matrix_covers_every_claiming_schedule():
    claimed = {c.schedule for c in MASK_CASES}
    assert {"ring", "zigzag_ring", "stripe_ring", "allgather", "ringx1", "ringx1o", "ringx3b", "ultra",
            *CAUSAL_ONLY} <= claimed
    assert {c.mask for c in MASK_CASES if c.schedule == "ring"} == set(masks.KINDS)
    assert {c.mask for c in MASK_CASES if c.schedule == "stripe_ring"} == set(masks.KINDS) - {"causal", "full"}
    assert set(BIDIRECTIONAL_KINDS) == {"sliding_window", "document", "strided"}
    # the causal-only variants take every mask contained in causal, and no other
    for name in CAUSAL_ONLY:
        mine = [c for c in MASK_CASES if c.schedule == name]
        worlds = {3} if name in PIPELINED else {2, 3}
        assert {(c.mask, c.world) for c in mine} == {(k, w) for k in CAUSAL_KINDS for w in worlds}, name
        assert not any(_bidirectional(c) for c in mine), name
    # the bidirectional forms run on every schedule that accepts them, at both world sizes: the
    # bidirectional-only RingX variants (which reject the causal forms) as much as the others
    for name in ("ring", "zigzag_ring", "stripe_ring", "allgather", "ringx1", "ringx1o", "ringx3b", "ultra"):
        got = {(c.mask, c.world) for c in MASK_CASES if c.schedule == name and _bidirectional(c)}
        assert {(k, w) for k in BIDIRECTIONAL_KINDS for w in (2, 3)} <= got, name


# ------------------------------------------------------------------ every mask kind at P = 4, one schedule per family
#: one schedule of each family runs every mask kind at P = 4, in the form it accepts (the causal one when
#: it can, else the bidirectional one); test_exactness.py runs causal and full at P = 4 on the baselines
#: (ring, allgather). The causal RingX family is ``ringx2``, whose collectives depend most on the mask (an
#: owner whose block no other rank reaches computes alone).
FAMILIES = {"ring": "ring", "all-gather": "allgather", "RingX bidirectional": "ringx1o", "RingX causal": "ringx2",
            "head-parallel": "ulysses", "planned": "ultra"}
PLAN_OPTIONS = {"plan_options": {"time_budget": 1.0, "partition_time_limit": 0.3, "schedule_time_limit": 0.3}}


def _family_cases() -> list[exactness.Case]:
    cases = []
    for f, name in enumerate(FAMILIES.values()):
        for i, kind in enumerate(masks.KINDS):
            if kind in ("causal", "full") and name in ("ring", "allgather"):
                continue  # test_exactness.py's full matrix
            forms = [_spec(kind, 48)] + ([_spec(kind, 48, bidirectional=True)] if _takes_causal_flag(kind) else [])
            for form in forms:
                found = exactness.matrix([name], worlds=(4,), subgroup=False, masks=(form,), dtypes=("float32",),
                                      heads=((8, 2),), seed=4000 + 20 * f + i)
                if found:
                    opts = PLAN_OPTIONS if (schedules.get(name).make_plan is not None) else None
                    cases.append(dataclasses.replace(found[0], options=opts))
                    break
    return cases


FAMILY_CASES = _family_cases()


# make test runs the causal RingX family's cases; the other families' run in the slow suite (each kind also runs
# at two and three ranks on every schedule in test_schedule_is_exact_under_mask, Ulysses and USP in test_ulysses_usp.py)
@pytest.mark.parametrize("case", [c if c.schedule == "ringx2" else pytest.param(c, marks=pytest.mark.slow)
                                  for c in FAMILY_CASES], ids=[c.label for c in FAMILY_CASES])
def test_every_mask_kind_at_four_ranks(worlds, case):
    result = exactness.run(worlds.get(case.world), case)
    assert result.passed, result.describe()


def test_family_cases_cover_every_mask_kind():
    for name in FAMILIES.values():
        got = {c.mask for c in FAMILY_CASES if c.schedule == name}
        if name == "ringx1o":  # bidirectional-only: the kinds with a bidirectional form, full, global_local
            assert got == {"full", "global_local", *BIDIRECTIONAL_KINDS, *COMPOSITES}
            assert all(_bidirectional(c) or c.mask == "global_local" for c in FAMILY_CASES if c.schedule == name)
        elif name in ("ring", "allgather"):
            assert got == set(masks.KINDS) - {"causal", "full"}, name
        elif name == "ringx2":  # causal-only: every kind with a form contained in causal
            assert got == CAUSAL_KINDS | {"causal"}
            assert not any(_bidirectional(c) for c in FAMILY_CASES if c.schedule == name)
        else:
            assert got == set(masks.KINDS), name
    assert {c.world for c in FAMILY_CASES} == {4}


DOC_SCHEDULES = ["ring", "zigzag_ring", "allgather"]


@settings(max_examples=3, deadline=None)
@given(lengths=_lengths(45))
@example(lengths=[1] * 45)  # many tiny documents
@example(lengths=[45])  # one document spanning every rank
@example(lengths=[7, 11, 13, 14])  # lengths that divide nothing
@example(lengths=[1, 43, 1])
def test_random_documents_are_exact(worlds, lengths):
    """Packed documents of random lengths, seq 45 over 3 ranks (padded), bf16 on one schedule."""
    for i, name in enumerate(DOC_SCHEDULES):
        case = exactness.Case(name, 3, "document", "bfloat16" if i == 2 else "float32", seq=45, heads=4, kv_heads=2,
                           mask_args={"lengths": lengths, "causal": i != 1}, seed=len(lengths) + i)
        result = exactness.run(worlds.get(3), case)
        assert result.passed, result.describe()


@pytest.mark.parametrize("window", [5, 16, 40])  # smaller than, equal to and larger than a chunk (48 / 3)
@pytest.mark.parametrize("name", ["ring", "zigzag_ring", "allgather"])
def test_windows_around_the_chunk_size(worlds, name, window):
    case = exactness.Case(name, 3, "sliding_window", seq=48, heads=4, kv_heads=2, mask_args={"window": window},
                       seed=window)
    result = exactness.run(worlds.get(3), case)
    assert result.passed, result.describe()


def test_rows_and_ranks_with_nothing_to_attend(worlds):
    """A block table whose first rank's rows attend nothing and whose last keys nobody attends: out 0,
    lse -inf, zero gradients (checked exactly by verify), on a subgroup of a 4-rank world."""
    table = [[0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 2, 0, 0, 0, 0], [1, 1, 2, 0, 0, 0],
             [1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0]]
    for name in ("ring", "allgather"):
        case = exactness.Case(name, 4, "block_table", seq=48, heads=4, kv_heads=4, group=(1, 3),
                           mask_args={"table": table, "block_size": 8}, seed=77)
        result = exactness.run(worlds.get(4), case)
        assert result.passed, result.describe()


# ------------------------------------------------------------------ causal RingX and stripe_ring under masks
#: the schedules that take every mask contained in causal on their own layouts (contiguous, zigzag,
#: striped): a causal predicate, and documents on a length their layout pads
CAUSAL_LAYOUT_SCHEDULES = ("ringx2", "ringx2o", "ringx3", "ringx4", "ringx4o", "stripe_ring")


@pytest.mark.parametrize("name", CAUSAL_LAYOUT_SCHEDULES)
def test_causal_predicate_mask(worlds, name):
    """A ``from_mask_mod`` predicate declared causal (every third key back, block-sparse), at P = 3."""
    case = exactness.Case(name, 3, "causal", seq=48, heads=4, kv_heads=2, seed=61)
    mod = {"kind": "dilated", "dilation": 3}
    result = fuzz_workers.run(worlds.get(3), case, mod, timeout=120)
    assert result.passed, result.describe()


@pytest.mark.parametrize("name", CAUSAL_LAYOUT_SCHEDULES)
def test_padded_documents(worlds, name):
    """44 tokens over 3 ranks: padded to 45 (contiguous, striped) or 48 (zigzag)."""
    case = exactness.Case(name, 3, "document", seq=44, heads=4, kv_heads=2, mask_args={"lengths": [7, 1, 19, 17]},
                       seed=62)
    result = exactness.run(worlds.get(3), case)
    assert result.passed, result.describe()


def test_ringx2_computes_alone_what_no_other_rank_reaches(worlds):
    """Documents that never cross a rank boundary leave every owner's block to itself: X2 runs with no
    communication at all; a window shorter than a rank's tokens shares only the next owner's step."""
    sched = schedules.get("ringx2")
    alone = Problem(48, 4, masks.document([12, 12, 12, 12]), heads=4, kv_heads=2, head_dim=8)
    assert all(not st_.comm for ph in ("forward", "backward") for st_ in sched.steps(alone, ph))
    window = Problem(48, 4, masks.sliding_window(5), heads=4, kv_heads=2, head_dim=8)
    roots = {ph: [op.root for st_ in sched.steps(window, ph) for op in st_.comm if op.op == "broadcast"]
             for ph in ("forward", "backward")}
    assert roots == {"forward": [1, 2, 3], "backward": [0, 1, 2]}
    half = Problem(48, 4, masks.document([24, 24]), heads=4, kv_heads=2, head_dim=8)
    roots = [op.root for st_ in sched.steps(half, "forward") for op in st_.comm if op.op == "broadcast"]
    assert roots == [1, 3]  # q_1 meets kv_0, q_3 meets kv_2; q_0 and q_2 stay home
    case = exactness.Case("ringx2", 4, "document", seq=48, heads=4, kv_heads=2, mask_args={"lengths": [12] * 4},
                       seed=63)
    result = exactness.run(worlds.get(4), case)
    assert result.passed, result.describe()


def _slow_cases() -> list[exactness.Case]:
    kinds = [(k, exactness.example_mask_args(k, 256)) for k in KINDS]
    return exactness.matrix(schedules.names(), worlds=(4,), subgroup=True, masks=tuple(kinds),
                         dtypes=("float32", "bfloat16"), heads=((8, 2),), seed=5000, seq=256)


SLOW_CASES = _slow_cases()


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=[c.label for c in SLOW_CASES])
def test_every_schedule_and_mask_at_length_256(worlds, case):
    result = exactness.run(worlds.get(case.world), case)
    assert result.passed, result.describe()
