"""Uneven lengths and balanced layouts: a sequence the layout cannot split is padded inside
ContextParallel with tokens that attend nothing and that nothing attends. shard/unshard hide the
padding, positions marks it -1, padding rows come out 0 (lse -inf) with zero gradients whatever
values they hold, and real rows are exact on every schedule. Module-level functions taking keyword
arguments run on the worker ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cpattn
from cpattn import exactness, masks, schedules
from cpattn.launcher import RankError


def _mask_for(name: str) -> str:
    """A mask the schedule accepts: causal when it can, else full."""
    try:
        schedules.get(name).check_mask(masks.causal())
        return "causal"
    except (ValueError, NotImplementedError):
        return "full"


def _padding_cases() -> list[exactness.Case]:
    cases = []
    # (world, seq): 45 over 2 (zigzag pads 3), 47 over 3 (1; zigzag 1), 61 over 4 (3): the baselines on
    # all three, every other schedule on one of them
    places = [(2, 45), (3, 47), (4, 61)]
    baselines = ("ring", "zigzag_ring", "stripe_ring", "allgather", "ulysses", "usp")
    for i, name in enumerate(schedules.names()):
        for j, (world, seq) in enumerate(places if name in baselines else [places[i % 3]]):
            heads = (6, 3) if world == 3 else (4, 2)
            cases.append(exactness.Case(name, world, _mask_for(name), seq=seq, heads=heads[0], kv_heads=heads[1],
                                     seed=3000 + 10 * i + j))
    doc = {"lengths": [9, 1, 20, 17], "causal": True}
    for name in ("ring", "zigzag_ring", "allgather", "ulysses", "usp"):
        cases.append(exactness.Case(name, 3, "document", seq=47, heads=6, kv_heads=3, mask_args=doc, seed=3200))
    cases.append(exactness.Case("stripe_ring", 4, "causal", "bfloat16", seq=61, group=None, seed=3201))
    cases.append(exactness.Case("ring", 4, "sliding_window", seq=45, group=(1, 3), mask_args={"window": 5}, seed=3202))
    return cases


def _balanced_cases() -> list[exactness.Case]:
    """layout="balanced" on every schedule that accepts a layout, uneven length included."""
    takers = [s["name"] for s in schedules.available() if s["custom_layout"]]
    doc = {"lengths": [30, 1, 4, 12], "causal": True}
    cases = []
    for i, name in enumerate(takers):
        mask, args = ("document", doc) if schedules.get(name).masks == "any" and schedules.get(name).causal \
            else (_mask_for(name), None)
        cases.append(exactness.Case(name, 3, mask, seq=47, heads=6, kv_heads=3, mask_args=args, layout="balanced",
                                 seed=3300 + i))
    return cases


PADDING = _padding_cases()
BALANCED = _balanced_cases()


@pytest.mark.parametrize("case", PADDING, ids=[c.label for c in PADDING])
def test_padded_lengths_are_exact(worlds, case):
    result = exactness.run(worlds.get(case.world), case)
    assert result.passed, result.describe()


@pytest.mark.parametrize("case", BALANCED, ids=[c.label for c in BALANCED])
def test_balanced_layout_is_exact(worlds, case):
    result = exactness.run(worlds.get(case.world), case)
    assert result.passed, result.describe()


def test_every_schedule_is_padded():
    assert {c.schedule for c in PADDING} == set(schedules.names())
    assert {"ring", "allgather", "ulysses", "usp"} <= {c.schedule for c in BALANCED}


# ------------------------------------------------------------------ world size 1, in this process
@pytest.mark.parametrize("schedule, layout", [("zigzag_ring", None), ("ring", "balanced"), ("ulysses", "balanced")])
def test_padding_rows_never_matter(schedule, layout):
    """zigzag over one rank needs an even length; "balanced" a multiple of 4: 31 tokens are padded. The
    padding rows hold random values and get a random output gradient: real outputs and gradients equal
    plain masked attention on the 31 tokens, padding outputs and gradients are exactly 0."""
    torch.manual_seed(3)
    mask = masks.document([10, 21])
    cp = cpattn.ContextParallel(31, mask, schedule, layout=layout)
    assert cp.padded_len == 32 and cp.local_len == 32
    pos = cp.positions()
    assert sorted(pos[pos >= 0].tolist()) == list(range(31)) and int((pos < 0).sum()) == 1
    x = {n: torch.randn(2, 31, 4, 8, dtype=torch.float64) for n in ("q", "k", "v")}
    local = {}
    for n, t in x.items():
        local[n] = cp.shard(t)
        assert bool((local[n][:, pos < 0] == 0).all())
        local[n][:, pos < 0] = torch.randn(2, 1, 4, 8, dtype=torch.float64)
        local[n].requires_grad_()
    out, lse = cp.attention(local["q"], local["k"], local["v"], return_lse=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert bool((out[:, pos < 0] == 0).all()) and bool(torch.isneginf(lse[:, :, pos < 0]).all())
    for n in ("q", "k", "v"):
        assert bool((local[n].grad[:, pos < 0] == 0).all())
    ref = {n: t.clone().requires_grad_() for n, t in x.items()}
    allowed = exactness.dense_mask("document", 31, {"lengths": [10, 21]})
    ref_out = torch.nn.functional.scaled_dot_product_attention(
        *(ref[n].transpose(1, 2) for n in ("q", "k", "v")), attn_mask=allowed).transpose(1, 2)
    ref_out.backward(cp.unshard(dout))
    assert torch.allclose(cp.unshard(out), ref_out, atol=1e-12)
    for n in ("q", "k", "v"):
        assert torch.allclose(cp.unshard(local[n].grad), ref[n].grad, atol=1e-12)


def test_layout_argument_errors():
    with pytest.raises(ValueError, match="runs only on its own"):
        cpattn.ContextParallel(32, "causal", "stripe_ring", layout="balanced")
    with pytest.raises(ValueError, match="unknown"):
        cpattn.ContextParallel(32, "causal", "ring", layout="spiral")
    with pytest.raises(ValueError, match="range layout"):
        cpattn.ContextParallel(32, "causal", "ring", layout="striped")
    with pytest.raises(ValueError, match="longer than"):
        cpattn.ContextParallel(32, "causal", "ring", layout=cpattn.layout.Layout.explicit([[(0, 16)]]))


# ------------------------------------------------------------------ worker side: the API round trip
def padded_roundtrip(schedule: str, seq: int, layout: str | None) -> dict:
    """shard / unshard / positions with a length the layout cannot split, on this rank."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, seq, 3, generator=g)
    labels = torch.arange(seq).repeat(2, 1)
    cp = cpattn.ContextParallel(seq, "causal", schedule, layout=layout)
    local, pos = cp.shard(x), cp.positions()
    real = pos >= 0
    return {"rank": dist.get_rank(), "local_len": cp.local_len, "positions": pos.tolist(),
            "shard_ok": torch.equal(local[:, real], x[:, pos[real]]) and bool((local[:, ~real] == 0).all()),
            "roundtrip": torch.equal(cp.unshard(local), x), "labels": torch.equal(cp.unshard(cp.shard(labels)), labels),
            "dim0": torch.equal(cp.unshard(cp.shard(x[0], dim=0), dim=0), x[0])}


@pytest.mark.parametrize("schedule, layout", [("ring", None), ("zigzag_ring", None), ("stripe_ring", None),
                                              ("allgather", "balanced"), ("usp", None)])
def test_shard_unshard_hide_the_padding(worlds, schedule, layout):
    results = worlds.get(3).run(padded_roundtrip, timeout=60, schedule=schedule, seq=34, layout=layout)
    for r in results:
        assert not isinstance(r, RankError), r
        assert r["shard_ok"] and r["roundtrip"] and r["labels"] and r["dim0"]
    positions = [p for r in results for p in r["positions"]]
    assert sorted(p for p in positions if p >= 0) == list(range(34))
    assert len(positions) == 3 * results[0]["local_len"] and len({r["local_len"] for r in results}) == 1
