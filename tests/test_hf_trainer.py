"""``cpattn.integrations.hf.Trainer``: a tiny random Qwen3 trained by it at CP=2 logs the losses and
gradient norms of the stock ``transformers.Trainer`` on one process (eager attention, the whole
sequences), and evaluates and predicts alike; what would change the loss raises at construction.
transformers and accelerate are test dependencies (``make test`` installs the ``hf`` extra): without
them these tests fail, they never skip."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cpattn

try:
    import transformers
except ImportError as exc:  # fail loudly: a silent skip would hide a missing integration test
    raise ImportError("tests/test_hf_trainer.py needs transformers: pip install -e '.[test,hf]' (make test does)") \
        from exc

from hf_trainer_workers import RUN, Rows, accelerate_state, train
from hf_workers import tiny_config

from cpattn.integrations import hf
from cpattn.launcher import RankError, free_port

#: relative tolerance on every logged number (float32; differences land near 1e-7)
RTOL = 1e-5


def reference(**kw) -> dict:
    """The stock Trainer on this process, one torch thread (as each worker has)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train("transformers", **kw)
    finally:
        torch.set_num_threads(threads)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def check(results: list, ref: dict, case: str) -> None:
    for rank, r in enumerate(results):
        assert not isinstance(r, RankError), f"{case}: {r}\n{r.traceback}"
        assert len(r["loss"]) == len(ref["loss"]) == RUN["steps"], f"{case}: rank {rank}: {len(r['loss'])} steps"
        for name in ("loss", "grad_norm"):
            for step, (got, want) in enumerate(zip(r[name], ref[name])):
                assert rel(got, want) <= RTOL, f"{case}: rank {rank}: step {step + 1} {name} {got} != {want}"
        for name in ("eval_loss", "predict_loss"):
            assert rel(r[name], ref[name]) <= RTOL, f"{case}: rank {rank}: {name} {r[name]} != {ref[name]}"
        for name in ("logits", "unlabelled_logits"):
            logits, want = r[name], ref[name]
            assert logits.shape == want.shape, f"{case}: rank {rank}: {name} {tuple(logits.shape)}"
            err = float((logits.double() - want.double()).norm() / want.double().norm())
            assert err <= RTOL, f"{case}: rank {rank}: predicted {name} relative error {err:.3g}"


@pytest.fixture(scope="module")
def one_process():
    return reference()


def test_cp2_trains_like_one_process(worlds, one_process):
    """10 steps of 2 accumulated batches, 45 tokens (3 padding tokens at CP=2, labels ignored at the
    start of each row): every step's loss and gradient norm, the evaluation loss and the predicted
    logits, with labels and without (5 rows: the last batch is partial), equal the one-process
    Trainer's."""
    results = worlds.get(2).run(train, trainer="cpattn", cp_size=2, timeout=300)
    check(results, one_process, "hf.Trainer CP=2 zigzag_ring")


@pytest.mark.slow
@pytest.mark.parametrize("schedule,average_tokens", [("ring", True), ("ulysses", False)])
def test_cp2_other_schedules_and_token_averaging(worlds, one_process, schedule, average_tokens):
    """The same on other schedules, and with average_tokens_across_devices=False (each group's loss is
    its own batch's mean; at one group the same numbers)."""
    results = worlds.get(2).run(train, trainer="cpattn", cp_size=2, schedule=schedule,
                                average_tokens=average_tokens, timeout=300)
    check(results, one_process, f"hf.Trainer CP=2 {schedule} average_tokens={average_tokens}")


@pytest.mark.slow
@pytest.mark.parametrize("average_tokens", [True, False])
def test_dp2_cp2_trains_like_one_process_on_both_batches(worlds, average_tokens):
    """4 ranks: 2 data-parallel groups of CP=2 read different batches; the one-process Trainer reads both
    in one batch of twice the rows. With average_tokens_across_devices=False each group's loss is the
    mean of its own batch and the step's gradient the mean of the groups' (the one-process run then
    differs: it weights rows by their labelled tokens), so it is compared with a run at CP=1 on 2 ranks,
    the stock data-parallel semantics. 8 evaluation rows: no partial last batch."""
    kw = dict(dp=2, eval_rows=8)
    results = worlds.get(4).run(train, trainer="cpattn", cp_size=2, average_tokens=average_tokens, timeout=600, **kw)
    if average_tokens:
        ref = reference(**kw)
    else:
        ref = worlds.get(2).run(train, trainer="cpattn", cp_size=1, average_tokens=False, timeout=300, **kw)[0]
        assert not isinstance(ref, RankError), f"{ref}\n{ref.traceback}"
    check(results, ref, f"hf.Trainer DP=2 x CP=2 average_tokens={average_tokens}")


@pytest.mark.slow
def test_cp2_under_torchrun(tmp_path, one_process):
    """As a user runs it: torchrun starts 2 processes and accelerate creates their gloo group."""
    out = tmp_path / "run.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [
        str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), str(Path(__file__).parent / "hf_trainer_workers.py"), str(out), "2"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    run = json.loads(out.read_text())
    for name in ("loss", "grad_norm"):
        assert len(run[name]) == RUN["steps"]
        for step, (got, want) in enumerate(zip(run[name], one_process[name])):
            assert rel(got, want) <= RTOL, f"torchrun: step {step + 1} {name} {got} != {want}"
    for name in ("eval_loss", "predict_loss"):
        assert rel(run[name], one_process[name]) <= RTOL, f"torchrun: {name} {run[name]} != {one_process[name]}"


# ---------------------------------------------------------------------- one process, no training
def qwen3(impl: str = hf.NAME):
    hf.register()
    return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(tiny_config("qwen3")), attn_implementation=impl)


def make(tmp_path, model=None, **kw) -> hf.Trainer:
    args = {k: kw.pop(k) for k in list(kw) if k in ("label_smoothing_factor",)}
    return hf.Trainer(model=model or qwen3(), args=transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", **args), **kw)


def test_refuses_what_would_change_the_loss(tmp_path):
    with accelerate_state():
        with pytest.raises(ValueError, match="cp_size must be a positive int"):
            make(tmp_path, cp_size=0)
        with pytest.raises(ValueError, match="cp_size=2 does not divide the 1 processes"):
            make(tmp_path, cp_size=2)
        with pytest.raises(ValueError, match="attn_implementation='cpattn'.*got 'eager'"):
            make(tmp_path, model=qwen3("eager"))
        with pytest.raises(NotImplementedError, match="label smoothing"):
            make(tmp_path, label_smoothing_factor=0.1)
        with pytest.raises(NotImplementedError, match="compute_loss_func"):
            make(tmp_path, compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss)
        with pytest.raises(ValueError, match="schedule='nope' is unknown"):
            make(tmp_path, cp_schedule="nope")
        with pytest.raises(ValueError, match="mask='diagonal' is not a Mask"):
            make(tmp_path, cp_mask="diagonal")


def in_order(t: torch.Tensor, cp) -> list[int]:
    """The real tokens of a local ``[1, local_len]`` tensor, in sequence order."""
    pos = cp.positions()
    keep = pos >= 0
    return t[0, keep][pos[keep].argsort()].tolist()


def test_batches_are_checked_and_labels_shifted_on_the_full_sequence(tmp_path):
    """One process: a padding attention_mask raises; the shifted labels are those of the whole row,
    the padding token of zigzag (7 tokens in 8) gets none; a packed batch runs on its document view."""
    with accelerate_state():
        trainer = make(tmp_path, cp_size=1)
        ids = torch.arange(7)[None] + 3
        padded = {"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 1]])}
        with pytest.raises(ValueError, match="attention_mask has padding"):
            trainer._prepare_context_parallel_inputs(trainer.model, padded)
        context, batch = trainer._prepare_context_parallel_inputs(trainer.model, {"input_ids": ids, "labels": ids})
        cp = trainer._step_cp
        assert cp.seq_len == 7 and cp.local_len == 8 and "attention_mask" not in batch
        assert in_order(batch["shift_labels"], cp) == [*range(4, 10), -100]
        assert batch["shift_labels"][0, cp.positions() < 0].tolist() == [-100]
        assert batch["position_ids"][0].tolist() == cp.positions().tolist()
        with context():
            assert hf.active() is cp
        starts = torch.tensor([[1, 0, 0, 1, 0, 0, 0]], dtype=torch.bool)
        docs = {"input_ids": ids, "labels": ids.masked_fill(starts, -100),
                "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3]])}
        _, batch = trainer._prepare_context_parallel_inputs(trainer.model, docs)
        view = trainer._step_cp
        assert view.mask == cpattn.masks.document([3, 4])
        assert in_order(batch["shift_labels"], view) == [4, 5, -100, 7, 8, 9, -100]
        assert in_order(batch["position_ids"], view) == [0, 1, 2, 0, 1, 2, 3]


def test_rows_differ_in_their_labelled_tokens():
    rows = Rows(4, 6, seed=0)
    assert [int((rows[i]["labels"] != -100).sum()) for i in range(4)] == [5, 4, 3, 2]
