"""The Hugging Face integration (``cpattn.integrations.hf``): a tiny random transformers model with
``attn_implementation="cpattn"`` at CP = 2 and 3 matches the same weights with ``"eager"`` on one process,
logits, loss and parameter gradients; what cpattn cannot honour raises. transformers is a test
dependency (``make test`` installs the ``hf`` extra): without it these tests fail, they never skip."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

import cpattn
from cpattn.launcher import RankError

try:
    import transformers
except ImportError as exc:  # fail loudly: a silent skip would hide a missing integration test
    raise ImportError("tests/test_hf.py needs transformers: pip install -e '.[test,hf]' (make test does)") from exc

from hf_workers import VOCAB, model_pair, packed_parity, parity, tiny_config

from cpattn.integrations import hf

#: relative-norm tolerance in float32 (errors land near 1e-6)
RTOL = 1e-4


def check(results: list, case: str) -> None:
    for rank, r in enumerate(results):
        assert not isinstance(r, RankError), f"{case}: {r}\n{r.traceback}"
        for name, err in r.items():
            assert err <= RTOL, f"{case}: rank {rank}: {name} relative error {err:.3g} > {RTOL}"


@pytest.mark.parametrize("schedule,seq_len", [("zigzag_ring", 46), ("ring", 33)])
def test_llama_matches_sdpa_at_cp2(worlds, schedule, seq_len):
    """46 tokens on zigzag_ring and 33 on ring leave padding tokens (positions -1) on a rank."""
    seed = 11
    results = worlds.get(2).run(parity, schedule=schedule, seq_len=seq_len, seed=seed, timeout=120)
    check(results, f"llama {schedule} seq {seq_len} seed {seed}")


def test_mistral_sliding_window_and_documents_at_cp2(worlds):
    w = worlds.get(2)
    check(w.run(parity, schedule="zigzag_ring", seq_len=40, seed=5, kind="mistral", window=8, timeout=120),
          "mistral sliding window 8, seed 5")
    check(w.run(parity, schedule="ring", seq_len=46, seed=7, documents=[13, 20, 13], batch=1, timeout=120),
          "llama documents [13, 20, 13], seed 7")


@pytest.mark.parametrize("kind,schedule,world", [("qwen3", "ulysses", 3), ("gemma3", "zigzag_ring", 3),
                                                 ("gpt_oss", "zigzag_ring", 2), ("gemma2", "ulysses", 2)])
def test_families_match_at_cp2_and_cp3(worlds, kind, schedule, world):
    """Qwen3 (q/k norms), Gemma 3 (sliding-window layers between full ones, on one causal
    ContextParallel: each window layer runs on its view with the window added) and gpt-oss (the same, plus
    attention sinks and a mixture of experts), Gemma 2 (windows and soft-capped scores): logits, loss and
    every gradient, the sinks' included."""
    results = worlds.get(world).run(parity, schedule=schedule, seq_len=42, seed=3, kind=kind, batch=1, timeout=180)
    check(results, f"{kind} {schedule} CP={world}")


@pytest.mark.parametrize("checkpoint,backward_thread", [("reentrant", True), ("non_reentrant", True),
                                                        ("non_reentrant", False)])
def test_gradient_checkpointing_in_any_thread(worlds, checkpoint, backward_thread):
    """Layers recomputed in the backward, which runs on a thread that never entered hf.use(cp), still
    attend through their ContextParallel and give the reference's gradients."""
    results = worlds.get(2).run(parity, schedule="zigzag_ring", seq_len=24, seed=9, batch=1, checkpoint=checkpoint,
                                backward_thread=backward_thread, timeout=120)
    check(results, f"llama checkpoint={checkpoint} backward thread={backward_thread}")


def test_a_flattened_batch_gives_each_document_its_own_logits(worlds):
    """DataCollatorWithFlattening (position_ids restarting per document, cu_seq_lens keywords) through
    hf.packed at CP=2: each document's logits are those of the document alone, the loss is the
    token-weighted mean over the documents and the gradients are that mean's."""
    results = worlds.get(2).run(packed_parity, schedule="zigzag_ring", lengths=[9, 1, 14, 6], seq_len=36, seed=2,
                                timeout=120)
    check(results, "packed documents [9, 1, 14, 6] in 36 tokens")


def test_packed_refuses_what_it_cannot_read():
    cp = cpattn.ContextParallel(8, schedule="ring")
    ids = torch.arange(6)[None]
    with pytest.raises(ValueError, match="restart at 0"):
        hf.packed(cp, {"input_ids": ids, "position_ids": torch.tensor([[1, 2, 3, 0, 1, 2]])})
    with pytest.raises(ValueError, match="more than the ContextParallel's seq_len=8"):
        hf.packed(cp, {"input_ids": torch.arange(9)[None], "position_ids": torch.arange(9)[None]})
    with pytest.raises(ValueError, match="cu_seq_lens_q does not match"):
        hf.packed(cp, {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]]),
                       "cu_seq_lens_q": torch.tensor([0, 2, 6])})
    view, batch = hf.packed(cp, {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]]),
                                 "labels": ids})
    assert view.mask == cpattn.masks.document([3, 3, 2]) and batch["labels"][0, 6:].tolist() == [-100, -100]


@pytest.mark.slow
@pytest.mark.parametrize("kind,schedule,world", [
    ("qwen3", "zigzag_ring", 2), ("qwen3", "ulysses", 2), ("qwen3", "zigzag_ring", 3),
    ("gemma3", "zigzag_ring", 2), ("gemma3", "ulysses", 2), ("gemma3", "ulysses", 3),
    ("gpt_oss", "ulysses", 2), ("gpt_oss", "zigzag_ring", 3), ("gpt_oss", "ulysses", 3),
    ("gemma2", "zigzag_ring", 2), ("gemma2", "zigzag_ring", 3), ("gemma2", "ulysses", 3)])
def test_families_match_the_rest_of_the_matrix(worlds, kind, schedule, world):
    results = worlds.get(world).run(parity, schedule=schedule, seq_len=42, seed=4, kind=kind, batch=1, timeout=180)
    check(results, f"{kind} {schedule} CP={world}")


def test_import_cpattn_does_not_import_transformers():
    code = "import sys, cpattn, cpattn.integrations.hf; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_register_is_idempotent():
    hf.register()
    hf.register()
    assert transformers.AttentionInterface._global_mapping[hf.NAME] is hf.attention_forward
    assert transformers.AttentionMaskInterface._global_mapping[hf.NAME] is hf.mask_hook


@pytest.fixture(scope="module")
def pair():
    return model_pair(tiny_config(), seed=3)


@pytest.fixture(scope="module")
def llama(pair):
    return pair[0]


def ids(seq_len: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(2))


def test_model_outside_use_raises(llama):
    with pytest.raises(RuntimeError, match=r"outside cpattn.integrations.hf.use\(cp\)"):
        llama(ids(), use_cache=False)


def test_use_nests_and_is_per_thread():
    a, b = cpattn.ContextParallel(16, schedule="ring"), cpattn.ContextParallel(32, schedule="ring")
    seen = []
    with hf.use(a):
        with hf.use(b):
            assert hf.active() is b
            t = threading.Thread(target=lambda: seen.append(hf.active()))
            t.start()
            t.join()
        assert hf.active() is a
    assert hf.active() is None and seen == [None]
    with pytest.raises(TypeError, match="ContextParallel"):
        with hf.use("ring"):
            pass


def test_padding_attention_mask_raises(llama):
    cp = cpattn.ContextParallel(16, schedule="ring")
    padded = torch.ones(1, 16, dtype=torch.long)
    padded[0, :3] = 0
    with hf.use(cp), pytest.raises(ValueError, match="padding.*cpattn.masks.document"):
        llama(ids(), attention_mask=padded, use_cache=False)
    with hf.use(cp):  # a mask of ones pads nothing
        llama(ids(), attention_mask=torch.ones(1, 16, dtype=torch.long), use_cache=False)


def test_custom_4d_mask_raises(llama):
    cp = cpattn.ContextParallel(16, schedule="ring")
    custom = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril()
    with hf.use(cp), pytest.raises(ValueError, match="prepared attention mask"):
        llama(ids(), attention_mask=custom, use_cache=False)


def test_disagreements_raise():
    x = ids()
    cp = cpattn.ContextParallel(16, schedule="ring")
    mistral, _ = model_pair(tiny_config("mistral", sliding_window=4), seed=3)
    with hf.use(cpattn.ContextParallel(16, mask=cpattn.masks.sliding_window(6), schedule="ring")), \
            pytest.raises(ValueError, match=r"window of 4 tokens but the ContextParallel mask has a window of 6"):
        mistral(x, use_cache=False)
    with hf.use(cp):  # a causal ContextParallel: the window layers run on its view with their window
        mistral(x, use_cache=False)
        assert cp.with_mask(cp.mask & cpattn.masks.sliding_window(4)) in cp._views._items.values()
    llama, _ = model_pair(tiny_config(), seed=3)
    with hf.use(cpattn.ContextParallel(16, mask=cpattn.masks.sliding_window(4), schedule="ring")), \
            pytest.raises(ValueError, match="has no sliding window"):
        llama(x, use_cache=False)
    with hf.use(cpattn.ContextParallel(16, mask="full", schedule="ring")), pytest.raises(ValueError, match="causal"):
        llama(x, use_cache=False)
    with hf.use(cp), pytest.raises(ValueError, match=r"position_ids=cp.positions\(\)\[None\]"):
        llama(x, position_ids=torch.arange(16)[None] + 1, use_cache=False)


def test_dropout_and_cache_raise():
    x = ids()
    cp = cpattn.ContextParallel(16, schedule="ring")
    config = tiny_config()
    config.attention_dropout = 0.1
    model, _ = model_pair(config, seed=3)
    with hf.use(cp), pytest.raises(NotImplementedError, match="dropout"):
        model.train()(x, use_cache=False)
    with hf.use(cp):
        model.eval()(x, use_cache=False)  # dropout is off in eval
        cache = model(x, use_cache=True).past_key_values
        with pytest.raises(NotImplementedError, match="use_cache=False"):
            model(x[:, :1], past_key_values=cache, position_ids=torch.tensor([[16]]))


def test_causal_lm_loss_one_rank_matches_transformers(pair):
    model, ref = pair
    x = ids(15)
    cp = cpattn.ContextParallel(15, schedule="zigzag_ring")  # padded to 16: one padding token
    with hf.use(cp):
        logits = model(cp.shard(x, dim=1), position_ids=cp.positions()[None], use_cache=False).logits
    loss = hf.causal_lm_loss(logits, x, cp)
    torch.testing.assert_close(loss, ref(x, labels=x, use_cache=False).loss, rtol=1e-5, atol=1e-6)
    with hf.use(cp), pytest.raises(ValueError, match="pass inputs sharded by cp.shard"):
        model(x, use_cache=False)
