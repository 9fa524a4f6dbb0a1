"""``hf.generate`` over a sharded key/value cache: a tiny random transformers model built from its config
(``attn_implementation="cpattn"``) generates at CP = 1, 2 and 3 the tokens that the same weights generate
with ``"eager"`` on one process (wherever the reference's top-2 logit gap exceeds 1e-4: each case checks
that its seed gives such gaps), with every step's logits within float32 tolerance; batches of prompts of
different lengths, a second turn on the returned cache, sampling with a shared seed. transformers is a
test dependency: without it these tests fail, they never skip."""

from __future__ import annotations

import pytest
import torch

import cpattn
from cpattn.launcher import RankError

try:
    import transformers  # noqa: F401
except ImportError as exc:  # fail loudly: a silent skip would hide a missing integration test
    raise ImportError("tests/test_hf_generate.py needs transformers: pip install -e '.[test,hf]'") from exc

from hf_generate_workers import config, greedy_parity, prompts
from hf_workers import model_pair

from cpattn.integrations import hf

#: relative-norm tolerance of each step's logits (float32; errors land near 1e-7)
RTOL = 1e-4
#: the smallest top-2 logit gap at which the tokens must agree
GAP = 1e-4


def check(results: list, case: str) -> dict:
    for rank, r in enumerate(results):
        assert not isinstance(r, RankError), f"{case}: {r}\n{r.traceback}"
        assert r["min_gap"] > GAP, f"{case}: the seed gives a top-2 gap of {r['min_gap']:.2g}: choose another seed"
        assert r["same_tokens"], f"{case}: rank {rank} generated other tokens than the eager reference"
        assert r["logits"] <= RTOL, f"{case}: rank {rank}: logits relative error {r['logits']:.3g} > {RTOL}"
        if "per_step_layer" in r:
            assert r["per_step_layer"] == pytest.approx(r["expected_per_step_layer"]), \
                f"{case}: rank {rank} decode traffic per step and layer {r['per_step_layer']} != {r}"
    return results[0]


def test_greedy_llama_at_cp2(worlds):
    """96 prompt tokens, 8 new ones on zigzag_ring: the tokens, every step's logits, one all-gather of
    (out, lse) per layer and step (the cost model's choice on 2 local ranks), the cache split evenly."""
    results = worlds.get(2).run(greedy_parity, kind="llama", schedule="zigzag_ring", lengths=[96], new_tokens=8,
                                seed=1, timeout=180)
    r = check(results, "llama zigzag_ring CP=2")
    assert r["steps"] == 7 and r["rows"] == [8] and r["merge"] == "all_gather"
    assert sorted(r["tokens"]) == [51, 52]  # 96 + 8 - 1 tokens cached (the last one is never fed back)
    assert [x["nbytes"] for x in results] == r["cache_bytes"] == [t * 2 * 2 * 2 * 16 * 4 for t in r["tokens"]]


def test_two_prompts_of_different_lengths_at_cp2(worlds):
    """Left-padded prompts of 70 and 45 tokens, prefilled as two documents on ringx4, decoded with the
    all-reduce merge; the end-of-sequence token kept. Each row equals that prompt generated alone."""
    check(worlds.get(2).run(greedy_parity, kind="llama", schedule="ringx4", lengths=[70, 45], new_tokens=8, seed=2,
                            merge="all_reduce", eos=True, timeout=180), "two prompts ringx4 CP=2")


def test_second_turn_on_the_returned_cache_at_cp2(worlds):
    """A second prompt on top of the first turn's cache: only the uncached tokens are prefilled, attending
    the cache by pass-Q; the result equals eager generation of the whole history."""
    results = worlds.get(2).run("hf_generate_workers.multi_turn_parity", schedule="zigzag_ring", first=40, second=7,
                                new_tokens=4, seed=3, extend="pass_q", timeout=180)
    r = check(results, "second turn pass_q CP=2")
    assert r["extend"][0] == "pass_q" and r["ops"] == ["all_gather", "all_reduce", "reduce_scatter"]


def test_sampling_with_a_shared_seed_at_cp2(worlds):
    """do_sample with temperature and top-k: every rank draws the tokens that one process draws after
    torch.manual_seed(seed)."""
    results = worlds.get(2).run("hf_generate_workers.sampling_parity", schedule="zigzag_ring", length=40,
                                new_tokens=8, seed=4, timeout=180)
    for r in results:
        assert not isinstance(r, RankError), f"{r}\n{r.traceback}"
        assert r["same_tokens"] and r["tokens"] == results[0]["tokens"], results


def test_ranks_given_other_prompts_all_raise_and_bfloat16_runs(worlds):
    """A rank with another prompt makes every rank raise the same error naming input_ids (no rank hangs);
    a bfloat16 model generates the same ids on both ranks, its cache in bfloat16."""
    w = worlds.get(2)
    errors = w.run("hf_generate_workers.disagreeing_prompts", seed=1, timeout=120)
    assert errors[0] == errors[1] and errors[0].startswith("RanksDisagreeError") and "input_ids" in errors[0], errors
    results = w.run("hf_generate_workers.bfloat16_generation", seed=1, timeout=120)
    assert not any(isinstance(r, RankError) for r in results), results
    assert results[0]["ids"] == results[1]["ids"] and results[0]["dtype"] == "torch.bfloat16", results


def test_one_rank_and_what_is_refused():
    """At one rank (no process group): the eager model's tokens and logits. Beam search, right padding, a
    model without the cpattn attention and unknown keywords raise before anything runs."""
    r = greedy_parity("qwen3", "zigzag_ring", [30, 21], 5, seed=6)
    assert r["same_tokens"] and r["min_gap"] > GAP and r["logits"] <= RTOL, r
    model, ref = model_pair(config("llama"), seed=0)
    ids, mask = prompts([12, 9], seed=1)
    cp = cpattn.ContextParallel(21, mask="causal", schedule="ring")
    with pytest.raises(NotImplementedError, match="beam search"):
        hf.generate(model, ids, cp, attention_mask=mask, num_beams=2, max_new_tokens=2)
    with pytest.raises(ValueError, match="left-padded"):
        hf.generate(model, ids, cp, attention_mask=mask.flip(1), max_new_tokens=2)
    with pytest.raises(ValueError, match="attn_implementation='cpattn'"):
        hf.generate(ref, ids, cp, attention_mask=mask, max_new_tokens=2)
    with pytest.raises(TypeError, match="unsupported keyword"):
        hf.generate(model, ids, cp, attention_mask=mask, max_new_tokens=2, streamer_of_doom=1)
    out = hf.generate(model, ids, cp, attention_mask=mask, max_new_tokens=2, eos_token_id=None,
                      return_dict_in_generate=True)
    kv = out.past_key_values.kv
    assert kv.row_lengths() == [13, 10] and kv.nbytes == 23 * 2 * 2 * 2 * 16 * 4  # 2 layers, 2 kv heads of 16
    history = torch.cat([out.sequences, ids[:, :1]], 1)
    longer = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], 1)
    wrong = history.clone()
    wrong[0, -6] = (wrong[0, -6] + 1) % 128
    with pytest.raises(ValueError, match="row 0 of the prompt does not continue the cache"):
        hf.generate(model, wrong, cp, attention_mask=longer, past_key_values=out.past_key_values, max_new_tokens=2)
    hf.generate(model, history, cp, attention_mask=longer, past_key_values=out.past_key_values, max_new_tokens=1)
    assert kv.row_lengths() == [15, 12]  # the last generated token and the new one prefilled, none decoded


SLOW_PROMPT, SLOW_NEW = 1000, 64


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("schedule", ["zigzag_ring", "ringx4"])
def test_greedy_1000_token_prompt_64_new_tokens(worlds, world, kind, schedule):
    check(worlds.get(world).run(greedy_parity, kind=kind, schedule=schedule, lengths=[SLOW_PROMPT],
                                new_tokens=SLOW_NEW, seed=11, timeout=900), f"{kind} {schedule} CP={world}")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_two_prompts_1000_and_700_tokens(worlds, world, kind):
    check(worlds.get(world).run(greedy_parity, kind=kind, schedule="zigzag_ring", lengths=[SLOW_PROMPT, 700],
                                new_tokens=SLOW_NEW, seed=12, eos=True, timeout=900), f"{kind} two prompts CP={world}")


@pytest.mark.slow
@pytest.mark.parametrize("extend", ["pass_q", "pass_kv"])
def test_second_turn_at_cp3(worlds, extend):
    check(worlds.get(3).run("hf_generate_workers.multi_turn_parity", schedule="zigzag_ring", first=500, second=100,
                            new_tokens=16, seed=13, extend=extend, timeout=900), f"second turn {extend} CP=3")
