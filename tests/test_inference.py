"""The sharded key/value cache (``cpattn.inference``): prefill, multi-turn prefill (pass-Q and pass-KV) and
decoding (both merges) against a float64 reference that shares no code with cpattn, at one rank and at
CP = 2 and 3; the counted traffic equals the formulas of ``cpattn.cost.inference``; the cache per rank
falls as 1 / P; the cost model's choices and the simulated inference."""

from __future__ import annotations

import pytest
import torch
from inference_workers import DIM, HEADS, KV_HEADS, cache_bytes, kv_exactness

import cpattn
from cpattn.cost import inference as icost
from cpattn.cost.presets import preset
from cpattn.inference import KVCache
from cpattn.launcher import RankError


def check_exact(result: dict, case: str) -> None:
    assert set(result["errors"]) >= {"prefill", "decode"}, case
    for phase, (err, e_local) in result["errors"].items():
        assert err <= 2 * e_local + 1e-6, f"{case}: {phase} relative error {err:.3g} > 2 x {e_local:.3g} + 1e-6"
    for phase, (how, counted, formula) in result["traffic"].items():
        assert counted == formula, f"{case}: {phase} ({how}) counted {counted}, its formula says {formula}"


def check_ranks(results: list, case: str) -> None:
    for rank, r in enumerate(results):
        assert not isinstance(r, RankError), f"{case}: {r}\n{r.traceback}"
        check_exact(r, f"{case}, rank {rank}")


def test_one_rank_rows_window_sinks_and_a_second_turn():
    """Two rows of different lengths, a sliding window and sinks, a second turn and three decoded tokens,
    on one process (no communication at all)."""
    r = kv_exactness([20, 13], [5, 7], 3, "zigzag_ring", window=9, with_sinks=True, seed=1)
    check_exact(r, "one rank")
    assert r["row_lengths"] == [28, 23] and r["tokens"] == [51]
    for _, counted, _ in r["traffic"].values():
        assert counted == {"calls": 0, "bytes_sent": 0, "bytes_recv": 0}


@pytest.mark.parametrize("world,kw", [
    (2, dict(prompt=[20], more=[5], steps=3, schedule="ring", merge_how="all_reduce", extend="pass_q")),
    (3, dict(prompt=[20, 13], more=[5, 7], steps=3, schedule="zigzag_ring", merge_how="all_gather",
             extend="pass_kv", window=9, with_sinks=True)),
])
def test_sharded_cache_is_exact_and_sends_what_its_formula_says(worlds, world, kw):
    """Prefill keeps each rank's tokens; the second turn attends the cache by pass-Q (CP=2) or pass-KV
    (CP=3, two rows, a window and sinks); decoding merges by all-reduce (CP=2) or all-gather (CP=3).
    Every output within 2 e_local + 1e-6 of the float64 reference, the counted bytes and calls equal to
    the formulas, the new tokens spread so that the shards stay within one token."""
    results = worlds.get(world).run("inference_workers.kv_exactness", seed=2, timeout=180, **kw)
    check_ranks(results, f"CP={world} {kw}")
    short = dict(kw, prompt=[2] * len(kw["prompt"]), more=[1] * len(kw["prompt"]))  # ranks holding padding only
    check_ranks(worlds.get(world).run("inference_workers.kv_exactness", seed=3, timeout=180, **short),
                f"CP={world} {short}")
    tokens = results[0]["tokens"]
    assert max(tokens) - min(tokens) <= 1 and sum(tokens) == sum(results[0]["row_lengths"])
    assert all(r["tokens"] == tokens for r in results)  # the replicated table agrees


def test_cache_bytes_fall_as_one_over_p(worlds):
    """1,000 prompt tokens, 2 layers: every rank holds 1000 / P tokens' keys and values (CP=1 and 2 here,
    CP=4 in the slow suite)."""
    one = cache_bytes(1000)
    assert one["nbytes"] == 1000 * 2 * 2 * KV_HEADS * DIM * 4 and one["shape"] == [2, 2, 1000, KV_HEADS, DIM]
    two = worlds.get(2).run("inference_workers.cache_bytes", prompt=1000, timeout=120)
    assert [r["nbytes"] for r in two] == [one["nbytes"] // 2] * 2, two


@pytest.mark.slow
def test_cache_bytes_at_cp4(worlds):
    four = worlds.get(4).run("inference_workers.cache_bytes", prompt=1000, timeout=300)
    assert [r["nbytes"] for r in four] == [cache_bytes(1000)["nbytes"] // 4] * 4, four


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_cache_matrix(worlds, world):
    for merge_how in ("all_reduce", "all_gather"):
        for extend in ("pass_q", "pass_kv"):
            kw = dict(prompt=[33, 20, 9], more=[4, 9, 1], steps=4, schedule="zigzag_ring", merge_how=merge_how,
                      extend=extend, window=7, with_sinks=True)
            check_ranks(worlds.get(world).run("inference_workers.kv_exactness", seed=5, timeout=300, **kw),
                        f"CP={world} {kw}")


def test_misuse_raises_before_anything_is_written():
    cp = cpattn.ContextParallel(8, mask="causal", schedule="ring")
    kv = KVCache(cp, layers=2, kv_heads=KV_HEADS, head_dim=DIM)
    k = torch.randn(1, 8, KV_HEADS, DIM)
    with pytest.raises(RuntimeError, match="place the step"):
        kv.write(0, k, k)
    with pytest.raises(ValueError, match="merge="):
        KVCache(cp, layers=1, kv_heads=1, head_dim=4, merge="tree")
    with pytest.raises(ValueError, match="lengths"):
        kv.place_prompt(cp, [3, 5])
    kv.place_prompt(cp)
    with pytest.raises(ValueError, match=r"k must be \[1, 8, 2, 8\]"):
        kv.write(0, k[:, :4], k[:, :4])
    with pytest.raises(TypeError, match="dtype"):
        kv.write(0, k.double(), k.double())
    kv.write(0, k, k)
    with pytest.raises(RuntimeError, match="already written"):
        kv.write(0, k, k)
    with pytest.raises(RuntimeError, match=r"not written layers \[1\]"):
        kv.place_decode()
    kv.write(1, k, k)
    kv.place_decode()
    with pytest.raises(RuntimeError, match="place_decode"):
        kv.decode_attention(0, torch.randn(1, 1, HEADS, DIM))
    assert kv.shape == (2, 2, 9, KV_HEADS, DIM) and kv.row_lengths() == [9]


# ---------------------------------------------------------------------- the cost model's choices
def test_decode_merge_gathers_in_small_groups_and_reduces_in_large_ones():
    """One all-gather of P - 1 latency steps against two tree all-reduces of 2 log P steps each: on DGX
    H100 nodes the gather wins at 8 ranks, the all-reduces at 128; both say why."""
    small, why_small = icost.choose_decode_merge(preset("dgx-h100", 8), 1, 32, 128)
    large, why_large = icost.choose_decode_merge(preset("dgx-h100", 128), 1, 32, 128)
    assert (small, large) == ("all_gather", "all_reduce"), (why_small, why_large)
    assert "us per layer" in why_small and "all_reduce" in why_small


def test_decode_merge_bytes():
    rows, heads, d = 2, 32, 128
    reduce_ops = icost.decode_merge_ops("all_reduce", rows, heads, d)
    assert [(op.op, op.bytes) for op in reduce_ops] == [("all_reduce", rows * heads * 4),
                                                        ("all_reduce", rows * heads * (d + 1) * 4)]
    assert [(op.op, op.bytes) for op in icost.decode_merge_ops("all_gather", rows, heads, d)] == \
        [("all_gather", rows * heads * (d + 1) * 4)]


def test_extend_moves_queries_to_a_large_cache_and_the_cache_to_many_queries():
    topo = preset("dgx-h100", 16)
    few_new = icost.choose_extend(topo, 128, 65536, 128, 8, 128, 2)  # 2K new tokens on a 1M-token cache
    many_new = icost.choose_extend(topo, 65536, 8192, 128, 8, 128, 2)  # 1M new tokens on a 128K cache
    assert few_new[0] == "pass_q" and many_new[0] == "pass_kv", (few_new, many_new)


def test_simulated_prefill_scales_and_decode_merges_are_priced():
    from cpattn.models.flops import matmul_param_count
    from cpattn.models.llama import LLAMA_CONFIGS

    c = LLAMA_CONFIGS["llama3-8b"]
    shape = icost.ModelShape(c.layers, c.heads, c.kv_heads, c.dim // c.heads, c.dim, matmul_param_count(c))
    seq = 1 << 17
    times = {}
    for cp in (1, 4):
        est = icost.prefill_estimate(shape, seq, cp, 1, "zigzag_ring", preset("dgx-h100", cp), 989e12, 0.7)
        times[cp] = est
        assert est.total == pytest.approx(est.attention + est.dense + est.tp_comm)
    assert times[4].kv_bytes * 4 == times[1].kv_bytes
    # near 1: at P=4 the zigzag blocks off the diagonal are full ones, which the model runs a little faster
    # than one long causal block, so the efficiency may pass 1 slightly
    assert 0.8 < icost.parallel_efficiency(times[1].total, times[4].total, 4) < 1.1
    rows = icost.decode_estimate(shape, seq, 4, 1, preset("dgx-h100", 4))
    assert {r.merge for r in rows} == set(icost.MERGES) and sum(r.chosen for r in rows) == 1
    assert all(r.merge_comm > 0 and r.total > r.weights for r in rows)


def test_a_long_decode_keeps_only_the_last_masks_block_lists():
    """Every decode step brings a new mask: the cache's programs keep the block lists (and stacked calls)
    of the last few only, however long it decodes."""
    from cpattn.inference import STEP_CACHE

    cp = cpattn.ContextParallel(16, "causal", "ring")
    kv = KVCache(cp, layers=1, kv_heads=2, head_dim=8)
    kv.place_prompt(cp)
    q, k, v = (torch.randn(1, 16, h, 8) for h in (4, 2, 2))
    kv.prefill(0, cp, q, k, v)
    for _ in range(2 * STEP_CACHE + 5):
        kv.place_decode()
        kv.write(0, torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8))
        kv.decode_attention(0, torch.randn(1, 1, 4, 8))
    assert len(kv._runtime.block_cache) <= STEP_CACHE and len(kv._runtime.batch_cache) <= STEP_CACHE
    assert len(kv._runtime.batch_cache) > 0  # the blocks did go through the runtime's stacked calls
