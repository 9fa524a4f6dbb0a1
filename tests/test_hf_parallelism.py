"""accelerate's ``ParallelismConfig(cp_size=...)`` served by ``cpattn.integrations.hf.context_parallel``: a
sliding-window Mistral trained by a user's subclass of ``transformers.Trainer`` at CP=2 logs the losses of the
stock Trainer on one process, and accelerate's own (torch) context parallelism never runs; bad
configurations raise before training. transformers and accelerate are test dependencies (``make test``
installs the ``hf`` extra): without them these tests fail, they never skip."""

from __future__ import annotations

import copy
import logging
import types

import pytest
import torch

import cpattn

try:
    import transformers
    from accelerate import ParallelismConfig
except ImportError as exc:  # fail loudly: a silent skip would hide a missing integration test
    raise ImportError("tests/test_hf_parallelism.py needs transformers and accelerate: pip install -e '.[test,hf]' "
                      "(make test does)") from exc

from hf_trainer_workers import Rows, accelerate_state
from hf_workers import tiny_config
from trl_workers import trainer_with_parallelism_config

from cpattn.integrations import hf
from cpattn.integrations.hf_trainer import take_context_parallel
from cpattn.launcher import RankError

RTOL = 1e-5


def test_parallelism_config_cp2_runs_cpattn_not_torch_context_parallelism(worlds):
    """ParallelismConfig(cp_size=2) on 2 CPU processes: the accelerator gets no parallelism configuration
    (so no torch context-parallel context and no attention pre-hooks), every step runs inside hf.use with
    each rank's model given S / 2 tokens, and the sliding-window model (window 8 of 40 tokens) logs the
    one-process Trainer's losses and gradient norms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = trainer_with_parallelism_config("transformers")
    finally:
        torch.set_num_threads(threads)
    assert max(ref["loss"]) - min(ref["loss"]) > 0.05, f"the loss does not move: {ref['loss']}"
    for rank, r in enumerate(worlds.get(2).run(trainer_with_parallelism_config, trainer="cpattn", cp_size=2,
                                               timeout=300)):
        assert not isinstance(r, RankError), f"rank {rank}: {r}\n{r.traceback}"
        assert r["cp_size"] == 2 and r["class_name"] == "Recording" and r["is_recording"], r
        assert r["accelerator_parallelism"] == "None" and r["args_parallelism"] == "None", r
        assert r["pre_hooks"] == 0, f"rank {rank}: {r['pre_hooks']} forward pre-hooks on the model"
        assert r["all_steps_in_hf_use"], f"rank {rank}: a step ran outside hf.use"
        assert r["input_lengths"] == [20] and r["local_len"] == 20, r["input_lengths"]
        assert len(r["loss"]) == len(ref["loss"]) == 10
        for name in ("loss", "grad_norm"):
            for step, (got, want) in enumerate(zip(r[name], ref[name])):
                assert abs(got - want) <= RTOL * abs(want), f"rank {rank}: step {step + 1} {name} {got} != {want}"


def qwen3(impl: str = hf.NAME):
    hf.register()
    return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(tiny_config("qwen3")), attn_implementation=impl)


def make(tmp_path, model=None, parallelism=None, **kw):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                          parallelism_config=parallelism)
    return hf.context_parallel(transformers.Trainer)(model=model or qwen3(), args=args,
                                                     train_dataset=Rows(4, 8, 0), **kw)


def test_bad_configurations_raise_before_training(tmp_path, monkeypatch):
    with accelerate_state():
        with pytest.raises(ValueError, match="cp_size=2 does not divide the 1 processes"):
            make(tmp_path, parallelism=ParallelismConfig(cp_size=2))
        with pytest.raises(ValueError, match="cp_size=4 disagrees with ParallelismConfig\\(cp_size=2\\)"):
            make(tmp_path, parallelism=ParallelismConfig(cp_size=2), cp_size=4)
        with pytest.raises(NotImplementedError, match="tp_size=2, sp_size=1: set tp_size=1 and sp_size=1"):
            make(tmp_path, parallelism=ParallelismConfig(tp_size=2, cp_size=2))
        with pytest.raises(NotImplementedError, match="tp_size=1, sp_size=2: set tp_size=1 and sp_size=1"):
            make(tmp_path, parallelism=ParallelismConfig(sp_size=2))
        with pytest.raises(ValueError, match="got 'eager'.*set_attn_implementation\\('cpattn'\\)"):
            make(tmp_path, model=qwen3("eager"), parallelism=ParallelismConfig(cp_size=1))
        # accelerate's environment variables (accelerate launch --parallelism-config-cp-size 2) are read too
        monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
        monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
        with pytest.raises(ValueError, match="cp_size=2 does not divide the 1 processes"):
            make(tmp_path)


def test_context_parallel_makes_one_class_per_trainer_class():
    assert hf.context_parallel(transformers.Trainer) is hf.Trainer
    cls = hf.context_parallel(transformers.Seq2SeqTrainer)
    assert cls is hf.context_parallel(transformers.Seq2SeqTrainer) and hf.context_parallel(cls) is cls
    assert issubclass(cls, transformers.Seq2SeqTrainer) and cls.__name__ == "Seq2SeqTrainer"
    with pytest.raises(TypeError, match="takes transformers.Trainer or a subclass"):
        hf.context_parallel(object)


def test_gpus_shard_over_dp_shard_times_cp(monkeypatch):
    """On GPUs the CP ranks join dp_shard (FSDP2 over dp_shard x cp, as accelerate shards with its own CP):
    checked on the configuration handed to accelerate (no GPU needed)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = types.SimpleNamespace(use_cpu=False, parallelism_config=ParallelismConfig(dp_shard_size=2, cp_size=4))
    assert take_context_parallel(args, None) == 4
    kept = args.parallelism_config
    assert (kept.dp_replicate_size, kept.dp_shard_size, kept.cp_size, kept.tp_size) == (1, 8, 1, 1)
    assert not kept.cp_enabled and kept.cp_handler is None
    args = types.SimpleNamespace(use_cpu=True, parallelism_config=ParallelismConfig(dp_shard_size=2, cp_size=4))
    assert take_context_parallel(args, 4) == 4 and args.parallelism_config is None


def in_order(t: torch.Tensor, cp) -> list[int]:
    """The real tokens of a local ``[1, local_len]`` tensor, in sequence order."""
    pos = cp.positions()
    keep = pos >= 0
    return t[0, keep][pos[keep].argsort()].tolist()


def test_right_padded_rows_and_trl_packed_batches_become_documents(tmp_path, caplog):
    """One process: right-padded rows (TRL's default collator) are packed into one row, each row a document
    with its first label ignored; TRL's padding-free keys are checked and consumed; a cu_seq_lens_k that
    disagrees with the positions raises. The first step logs one line naming the schedule and the mask."""
    with accelerate_state(), caplog.at_level(logging.INFO, logger="cpattn.integrations.hf_trainer"):
        trainer = make(tmp_path)
        ids = torch.tensor([[3, 4, 5, 0, 0], [6, 7, 8, 9, 10]])
        padded = {"input_ids": ids, "labels": ids.masked_fill(ids == 0, -100),
                  "attention_mask": (ids != 0).long()}
        _, batch = trainer._prepare_context_parallel_inputs(trainer.model, padded)
        lines = [r.getMessage() for r in caplog.records if r.name == "cpattn.integrations.hf_trainer"]
        assert lines == ["cpattn context parallelism: 1 data-parallel group(s) of 1 ranks, schedule zigzag_ring, "
                         "mask causal (this step: document)"], lines
        view = trainer._step_cp
        assert view.mask == cpattn.masks.document([3, 5]) and "attention_mask" not in batch
        assert in_order(batch["input_ids"], view) == [3, 4, 5, 6, 7, 8, 9, 10]
        assert in_order(batch["position_ids"], view) == [0, 1, 2, 0, 1, 2, 3, 4]
        assert in_order(batch["shift_labels"], view) == [4, 5, -100, 7, 8, 9, 10, -100]
        assert trainer._step_tokens == 8
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        trl_batch = {"input_ids": ids[ids != 0][None], "labels": torch.tensor([[-100, 4, 5, -100, 7, 8, 9, 10]]),
                     "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]), "cu_seq_lens_q": cu,
                     "cu_seq_lens_k": cu, "max_length_q": 5, "max_length_k": 5,
                     "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.int32)}
        _, batch = trainer._prepare_context_parallel_inputs(trainer.model, dict(trl_batch))
        assert trainer._step_cp.mask == cpattn.masks.document([3, 5])
        assert not {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"} & set(batch)
        assert in_order(batch["shift_labels"], trainer._step_cp) == [4, 5, -100, 7, 8, 9, 10, -100]
        with pytest.raises(ValueError, match="cu_seq_lens_k does not match the documents of position_ids"):
            trainer._prepare_context_parallel_inputs(trainer.model, {**trl_batch,
                                                                     "cu_seq_lens_k": torch.tensor([0, 4, 8])})
