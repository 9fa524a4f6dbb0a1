"""Per-step masks (``ContextParallel.with_mask``): a new document mask every step, exact against a float64
reference that shares no code with cpattn; views are cheap, agreed on, cached by mask, and compile once."""

from __future__ import annotations

import pytest
import torch

import cpattn
from cpattn import masks

VARLEN_SCHEDULES = ["ring", "zigzag_ring", "allgather", "ringx4o", "ulysses", "ultra"]


def test_from_cu_seqlens_is_the_document_mask():
    assert masks.from_cu_seqlens(torch.tensor([0, 3, 10, 16])) == masks.document([3, 7, 6])
    assert masks.from_cu_seqlens([0, 5], causal=False) == masks.document([5], causal=False)
    for bad in ([3, 5], [0], [0, 4, 4], torch.tensor([[0, 4]]), torch.tensor([0.0, 4.0])):
        with pytest.raises(ValueError, match="cu_seqlens"):
            masks.from_cu_seqlens(bad)


def test_a_view_is_kept_by_mask_and_shares_the_group():
    cp = cpattn.ContextParallel(64, "causal", schedule="zigzag_ring")
    view = cp.with_mask(masks.document([10, 54]))
    assert view.comm is cp.comm and view.schedule == cp.schedule and view.seq_len == 64
    assert view.mask == masks.document([10, 54]) and cp.mask == masks.causal()
    assert cp.with_mask(masks.document([10, 54])) is view and view.with_mask(masks.causal()) is cp
    assert cp.with_mask(masks.document([11, 53])) is not view
    with pytest.raises(ValueError, match="sum to 63"):
        cp.with_mask(masks.document([10, 53]))
    with pytest.raises(ValueError, match="causal-only"):
        cpattn.ContextParallel(64, "causal", schedule="ringx4").with_mask(masks.document([32, 32], causal=False))


@pytest.mark.parametrize("world,steps", [(2, 8), pytest.param(2, 20, marks=pytest.mark.slow), (3, 8)])
def test_varlen_steps_are_exact(worlds, world, steps):
    """Steps of random documents (b = 2 packed rows of 256 tokens, documents of 1 to 200 tokens, some rows
    one document) on six schedules: every step exact against the float64 reference. Three ranks
    oversubscribe two cores, so they run fewer steps here; the slow suite runs 20 longer steps at P=2, 3
    and 4."""
    report = worlds.get(world).run("varlen_workers.varlen_steps", timeout=600, schedules=VARLEN_SCHEDULES,
                                   steps=steps, rows=2, row_len=256, longest=200, seed=world)
    for rank, result in enumerate(report):
        assert isinstance(result, dict), f"rank {rank}: {result}"
        assert set(result) == set(VARLEN_SCHEDULES)
        for name, r in result.items():
            assert r["world"] == world
            assert r["error"] < 2e-5, f"rank {rank} {name}: relative error {r['error']:.2e}"
            assert r["padded_len"] == r["base_padded_len"], (name, r)  # a view never pads more than its base
        # document masks run balanced by default where that needs no more padding than the schedule's own
        # layout: ring's contiguous 512 tokens at P=2 (not P=3, where 512 is not a multiple of 2P), allgather's
        # zigzag (already padded to 2P) at any P; zigzag_ring keeps its zigzag
        ring = "balanced" if 512 % (2 * world) == 0 else "contiguous"
        assert [result[n]["layout"] for n in ("ring", "allgather", "zigzag_ring")] == [ring, "balanced", "zigzag"]


@pytest.mark.slow
@pytest.mark.parametrize("world,row_len", [(2, 2048), (3, 1024), (4, 1024)])
def test_varlen_long_steps_are_exact(worlds, world, row_len):
    """20 steps of 4K tokens at P=2 and of 2K at P=3 and 4 (documents of 1 to 2,000 tokens; about ten
    minutes per world on two cores)."""
    report = worlds.get(world).run("varlen_workers.varlen_steps", timeout=3600, schedules=VARLEN_SCHEDULES,
                                   steps=20, rows=2, row_len=row_len, longest=2000, seed=10 + world)
    for rank, result in enumerate(report):
        for name, r in result.items():
            assert r["error"] < 2e-5, f"rank {rank} {name}: relative error {r['error']:.2e}"


def test_the_reference_sees_the_documents():
    """The reference can fail: documents change its result against plain causal attention."""
    import random

    import varlen_workers as w

    lengths = w.random_rows(random.Random(0), 2, 64, 40)
    assert len(lengths) > 2
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 128, h, 8, generator=gen) for h in (2, 1, 1, 2))
    docs, whole = w.reference(q, k, v, dout, lengths, 0.3), w.reference(q, k, v, dout, [128], 0.3)
    assert (docs["out"] - whole["out"]).abs().max() > 1e-2


def test_ranks_with_different_masks_all_raise(worlds):
    ok = worlds.get(2).run("varlen_workers.view_agreement", mismatch=False)
    assert all(r == {"mask": ok[0]["mask"], "same": True} for r in ok), ok
    bad = worlds.get(2).run("varlen_workers.view_agreement", mismatch=True)
    assert all(r["error"] == "RanksDisagreeError" and "mask" in r["message"] for r in bad), bad


def test_a_compiled_block_takes_a_new_mask_every_step_without_recompiling(worlds):
    result = worlds.get(2).run("varlen_workers.compiled_views", timeout=300, steps=10)
    for r in result:
        assert r["graphs"] == 1 and r["error"] < 1e-5, r


def test_a_mask_is_agreed_on_once_unless_check_always(monkeypatch):
    """Window layers ask for their view on every call: with check="first" the ranks exchange its digest
    the first time only; check="always" exchanges every time; check="off" never."""
    from cpattn import agree

    calls = []
    real = agree.agree
    monkeypatch.setattr(agree, "agree", lambda comm, what, *a, **k: (calls.append(what), real(comm, what, *a, **k)))
    for check, expected in (("first", 2), ("always", 4), ("off", 0)):
        calls.clear()
        cp = cpattn.ContextParallel(64, "causal", schedule="ring", check=check)
        calls.clear()
        for _ in range(2):
            cp.with_mask(masks.causal() & masks.sliding_window(8))
            cp.with_mask(masks.document([30, 34]))
        assert calls.count("ContextParallel.with_mask") == expected, (check, calls)
