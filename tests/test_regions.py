"""One kernel call per region (``cpattn.core.flex_masks.Region``): the masked work of a rank's step as one
FlexAttention call whose block mask comes from the mask's structure. The CUDA path takes it
(``kernels.region_calls``); here it is forced on the CPU: the region's geometry (ranges, padding, the
local order of a zigzag rank's chunks) against FlexAttention's own ``create_block_mask``, every
registered schedule exact through it at P=2 (on the dense form and on FlexAttention's eager form), a
steady-state call that builds no block mask, a compiled kernel that never recompiles over windows and
per-step documents, and the kernel calls per rank and step at 32K tokens."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import region_workers
import torch

import cpattn
from cpattn import exactness, schedules
from cpattn import masks as M
from cpattn.core import blocks, cuda_ops, flex_masks, kernels, memo
from cpattn.core.flex_masks import Region
from cpattn.core.layout import Layout
from cpattn.core.masks import BlockKind
from cpattn.launcher import WorldError

pytest.importorskip("torch.nn.attention.flex_attention")
from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402

#: planned schedules solve with small budgets here (their plans stay exact, only less tuned)
PLAN_OPTIONS = {"time_budget": 1.0, "partition_time_limit": 0.3, "schedule_time_limit": 0.3}
SEQ = 64

# a zigzag rank's two chunks against two other chunks, padding rows at the end of the queries
PARTS = {"q": ((0, 200, 0), (300, 512, 200)), "kv": ((0, 256, 0), (400, 512, 256))}
MASKS = {"documents": M.document([100, 300, 112]), "window": M.sliding_window(90),
         "bidirectional": M.document([128, 256, 128], causal=False),
         "and": M.sliding_window(150) & M.document([250, 262]),
         "strided": M.strided(block_size=16, stride=3),  # more intervals per row than the tensors hold
         "custom": M.from_mask_mod(lambda q, k: (q + k) % 3 == 0)}


def _region(mask) -> Region:
    return Region(mask, PARTS["q"], PARTS["kv"], 420, 368)


def _reference(mask) -> torch.Tensor:
    """The allowed local pairs, written out pair by pair from the mask's rule on global positions."""
    pos_q = torch.full((420,), -1)
    pos_k = torch.full((368,), -1)
    for pos, parts in ((pos_q, PARTS["q"]), (pos_k, PARTS["kv"])):
        for a, b, o in parts:
            pos[o:o + b - a] = torch.arange(a, b)
    out = torch.zeros(420, 368, dtype=torch.bool)
    for i in range(420):
        if pos_q[i] >= 0:
            keep = pos_k >= 0
            out[i, keep] = mask.mask_mod(torch.full((int(keep.sum()),), int(pos_q[i])), pos_k[keep])
    return out


@pytest.mark.parametrize("name", list(MASKS))
def test_a_region_is_its_pairs_and_flex_attention_builds_the_same_block_mask(name):
    mask = MASKS[name]
    region = _region(mask)
    want = _reference(mask)
    assert torch.equal(region.dense(), want) and region.area == int(want.sum())
    empty, ours = region.block_mask("cpu")
    assert torch.equal(empty, ~want.any(1))
    qi, ki = torch.arange(420).unsqueeze(1), torch.arange(368).unsqueeze(0)
    assert torch.equal(ours.mask_mod(0, 0, qi, ki), want)
    theirs = create_block_mask(lambda b, h, q, k: want[q, k], None, None, 420, 368, device="cpu")
    for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                  "q_indices", "full_q_num_blocks", "full_q_indices"):
        a, b = getattr(ours, field), getattr(theirs, field)
        assert a.shape == b.shape and torch.equal(a.to(b.dtype), b), field


@pytest.mark.parametrize("name", ["documents", "window", "strided"])
def test_a_region_on_flex_attention_eager_is_exact(name):
    """Forward and backward (the backward operator with the row's out and lse, no second forward) against
    the math path on the region's dense pairs, float64, GQA 4:2, rows with no key."""
    region = _region(MASKS[name])
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 420, 4, 16, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 368, 2, 16, dtype=torch.float64, generator=g) for _ in range(2))
    dout = torch.randn(2, 420, 4, 16, dtype=torch.float64, generator=g)
    with memo.scope():
        o, lse = cuda_ops.flex_forward(q, k, v, BlockKind.PARTIAL, 0.25, region, compiled=False)
        o_ref, lse_ref = kernels._math_forward(q, k, v, BlockKind.PARTIAL, 0.25, region.dense())
        assert torch.allclose(o, o_ref, atol=1e-12) and torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
        assert torch.allclose(lse[~torch.isinf(lse)], lse_ref[~torch.isinf(lse_ref)], atol=1e-12)
        grads = cuda_ops.flex_backward(dout, q, k, v, o_ref, lse_ref, BlockKind.PARTIAL, 0.25, region,
                                           compiled=False)
        ref = kernels._math_backward(dout, q, k, v, o_ref, lse_ref, BlockKind.PARTIAL, 0.25, region.dense())
        for a, b in zip(grads, ref):
            assert torch.allclose(a, b, atol=1e-11)


def test_blocks_become_one_region_only_where_they_would_be_several_or_partial():
    doc = M.document([100, 300, 112])
    ranges = [(0, 128), (384, 512)]  # zigzag rank 0 of 2
    many = blocks.rectangles(doc, ranges, ranges)
    assert len(many) > 1
    [one] = blocks.rectangles(doc, ranges, ranges, regions=True)
    assert isinstance(one.mask, Region) and one.area == sum(b.area for b in many)
    assert (one.q, one.kv) == (slice(0, 256), slice(0, 256))
    # a lone FULL rectangle stays what the dense kernels run
    [full] = blocks.rectangles(doc, [(150, 200)], [(100, 150)], regions=True)
    assert full.kind == BlockKind.FULL and full.mask is None
    assert blocks.rectangles(doc, [(0, 100)], [(100, 200)], regions=True) == []
    # padding (positions >= valid_len) stays out of the region's pairs
    [padded] = blocks.rectangles(doc, ranges, ranges, valid_len=500, regions=True)
    assert padded.mask.q_parts[-1] == (384, 500, 128) and padded.area < one.area


def test_regions_are_chosen_where_flex_runs_the_masked_blocks(monkeypatch):
    q = torch.zeros(1, 8, 2, 16)
    assert not kernels.region_calls(q, M.document([4, 4]))  # the CPU keeps its mask-boundary splitting
    monkeypatch.setattr(kernels, "kernel_for", lambda q, kind, backend="auto", kv_len=None, softcap=None:
                        "flex_cuda" if kind == BlockKind.PARTIAL else "cudnn_cuda")
    assert kernels.region_calls(q, M.document([4, 4])) and kernels.region_calls(q, M.sliding_window(3))
    assert not kernels.region_calls(q, M.causal()) and not kernels.region_calls(q, M.full())


# ---------------------------------------------------------------------------------- every schedule, P=2
def _cases(masks: tuple[str, ...], names: list[str]) -> list[exactness.Case]:
    cases = []
    for name in names:
        sched = schedules.get(name)
        options = {"plan_options": PLAN_OPTIONS} if sched.make_plan is not None else None
        for mask in masks if sched.causal else ("document_bidirectional",):
            spec = (mask, exactness.example_mask_args(mask, SEQ)) if mask != "document_bidirectional" else \
                ("document", {**exactness.example_mask_args("document", SEQ), "causal": False})
            found = exactness.matrix([name], worlds=(2,), subgroup=False, masks=(spec,), dtypes=("float32",),
                                  heads=((4, 2),), seq=SEQ)
            cases += [dataclasses.replace(c, seed=300 + len(cases), options=options) for c in found]
    return cases


#: ``stripe_ring`` keeps its own block lists: its local rows are strided global positions, which a region's
#: ranges do not describe (its masked steps run as split blocks on every device)
OWN_BLOCKS = {"stripe_ring"}
DENSE = _cases(("document", "sliding_window"), [n for n in schedules.names() if n not in OWN_BLOCKS])
FLEX = _cases(("document",), ["ring", "zigzag_ring", "allgather", "ringx2", "ulysses", "ultra"])


def _judge(case: exactness.Case, per_rank: list) -> None:
    result = exactness.check(case, per_rank)
    assert result.failure is None, result.failure
    assert not result.comm_mismatches and not result.exact_violations, result.describe()
    for q in exactness.QUANTITIES:  # the recording's kernel counts differ by design: one call per region
        assert result.errors[q] <= result.tolerances[q], result.describe()
    assert sum(r["regions"]["regions"] for r in per_rank) > 0, "no kernel call got a region"


def test_cases_cover_every_schedule():
    assert {c.schedule for c in DENSE} == set(schedules.names()) - OWN_BLOCKS


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.mask == "sliding_window" else c
                                  for c in DENSE], ids=[c.label for c in DENSE])
def test_schedule_is_exact_with_one_call_per_region(worlds, case):  # windows: the slow suite
    try:
        per_rank = worlds.get(2).run(region_workers.region_case, timeout=120, name=case.label,
                                     **dataclasses.asdict(case))
    except WorldError as exc:
        pytest.fail(str(exc))
    _judge(case, per_rank)


@pytest.mark.parametrize("case", FLEX, ids=[c.label for c in FLEX])
def test_schedule_is_exact_on_flex_attention_regions(worlds, case):
    try:
        per_rank = worlds.get(2).run(region_workers.region_case, timeout=120, name=case.label, flex=True,
                                     **dataclasses.asdict(case))
    except WorldError as exc:
        pytest.fail(str(exc))
    _judge(case, per_rank)


# ---------------------------------------------------------------------------------- steady state, compile
def test_a_steady_call_builds_no_block_mask_and_views_build_once():
    """World 1: the first call of a mask builds its regions' block masks, later calls none; a per-step
    view (``with_mask``) builds its own once."""
    counts = {"calls": 0, "regions": 0}
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 256, 4, 16, generator=g)
    k = torch.randn(1, 256, 2, 16, generator=g)
    with region_workers.forced(True, counts):
        cp = cpattn.ContextParallel(256, M.document([60, 100, 96]), "zigzag_ring")
        built = []
        for _ in range(3):
            before = flex_masks.STATS["block_masks"]
            qq = q.clone().requires_grad_()
            cp.attention(qq, k, k).sum().backward()
            built.append(flex_masks.STATS["block_masks"] - before)
        assert built[0] > 0 and built[1:] == [0, 0] and counts["regions"] > 0
        view = cp.with_mask(M.document([128, 128]))
        first = flex_masks.STATS["block_masks"]
        view.attention(q, k, k)
        second = flex_masks.STATS["block_masks"]
        view.attention(q, k, k)
        assert second > first and flex_masks.STATS["block_masks"] == second


def test_compiled_flex_attention_never_recompiles_over_windows_and_per_step_documents(monkeypatch):
    """Dynamo's guards, counted (the ``eager`` backend compiles nothing but guards as the GPU's does): one
    graph for every window offset and every step's documents; the unfused fallback's warning fails."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(cuda_ops, "_compiled_flex", lambda: compiled)
    compiled = torch.compile(flex_attention, backend="eager")
    g = torch.Generator().manual_seed(2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*materializ.*")
        for step in range(5):
            lengths = [40 + 17 * step, 200, 512 - 240 - 17 * step]
            for mask in (M.document(lengths), M.sliding_window(50 + 9 * step)):
                for q0 in (0, 256):
                    region = Region.rect(mask, q0, q0 + 256, 0, 256)
                    q = torch.randn(1, 256, 4, 16, generator=g)
                    k = torch.randn(1, 256, 2, 16, generator=g)
                    with memo.scope():
                        cuda_ops.flex_forward(q, k, k, BlockKind.PARTIAL, 0.25, region)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def _calls(mask, seq: int, world: int, regions: bool) -> list[int]:
    """Kernel calls per rank and ring step (zigzag layout) for ``mask`` at ``seq`` tokens: stacked calls of
    the block lists (``blocks.batches``), or one per region."""
    layout = Layout("zigzag")
    out = []
    for r in range(world):
        for t in range(world):
            q = layout.ranges(seq, world, r)
            kv = layout.ranges(seq, world, (r - t) % world)
            found = blocks.rectangles(mask, q, kv, dense=False, regions=regions)
            out.append(len(found) if regions else len(blocks.batches(found)))
    return out


@pytest.mark.parametrize("name,mask", [("documents", M.document([1000, 3000, 500, 2692, 1000] * 4)),
                                       ("window", M.sliding_window(4096))])
def test_a_step_is_at_most_one_call_per_rank_at_32k_tokens(name, mask):
    before, after = _calls(mask, 32768, 4, False), _calls(mask, 32768, 4, True)
    assert max(after) <= 1 and sum(after) <= sum(before)
    assert max(before) > 1  # the split path does launch several
