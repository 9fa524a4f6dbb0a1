"""Functions the Hugging Face Trainer tests run: a tiny random Qwen3 trained and evaluated by
``cpattn.integrations.hf.Trainer`` on every rank of a worker world, or by the stock ``transformers.Trainer``
with eager attention on one process (the reference)."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist
from hf_workers import VOCAB, tiny_config

from cpattn.integrations import hf

#: the run both trainers make: 10 optimizer steps of 2 accumulated batches of 2 rows of 45 tokens
#: (zigzag at 2 ranks splits 48 tokens into 4 pieces: 3 padding tokens), evaluation on 5 rows
RUN = dict(steps=10, seq_len=45, batch=2, accumulation=2, train_rows=48, eval_rows=5, seed=0)


class Rows(torch.utils.data.Dataset):
    """``n`` random rows of ``seq_len`` tokens; the labels are the tokens, with the first ``1 + i % 4`` of
    row ``i`` ignored (-100), so that the ranks' shards hold different numbers of labelled tokens."""

    def __init__(self, n: int, seq_len: int, seed: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, seq_len), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[:1 + i % 4] = hf.IGNORE_INDEX
        return {"input_ids": self.ids[i], "labels": labels}


class Unlabelled(torch.utils.data.Dataset):
    """The rows of ``rows`` without their labels (prediction only)."""

    def __init__(self, rows: Rows) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i]["input_ids"]}


@contextlib.contextmanager
def accelerate_state() -> Iterator[None]:
    """accelerate reads a process's rank and world size from the environment (torchrun's variables) and
    keeps its state in a process-wide singleton: the worker worlds initialise torch.distributed
    themselves, so give accelerate their rank for the run and reset its state around it."""
    from accelerate.state import AcceleratorState, GradientState

    env = {}
    if dist.is_initialized():
        rank, world = str(dist.get_rank()), str(dist.get_world_size())
        env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world,
               "OMP_NUM_THREADS": str(torch.get_num_threads())}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def train(trainer: str, cp_size: int = 1, schedule: str = "zigzag_ring", dp: int = 1, average_tokens: bool = True,
          steps: int = RUN["steps"], seq_len: int = RUN["seq_len"], batch: int = RUN["batch"],
          accumulation: int = RUN["accumulation"], train_rows: int = RUN["train_rows"],
          eval_rows: int = RUN["eval_rows"], seed: int = RUN["seed"]) -> dict:
    """Train the tiny Qwen3 for ``steps`` optimizer steps, then evaluate and predict on ``eval_rows`` rows.

    ``trainer="cpattn"``: ``hf.Trainer(cp_size=...)`` on this world (``dp`` data-parallel groups of
    ``cp_size`` ranks, ``batch`` rows per group); ``"transformers"``: the stock Trainer with eager
    attention on one process, ``dp * batch`` rows per batch (the same samples per step). Returns the
    logged losses and gradient norms, the evaluation loss and the predicted logits ``[eval_rows, seq_len,
    vocab]``, with and without labels in the batches."""
    from transformers import AutoModelForCausalLM, TrainingArguments
    from transformers import Trainer as StockTrainer

    torch.manual_seed(seed)
    impl = hf.NAME if trainer == "cpattn" else "eager"
    if trainer == "cpattn":
        hf.register()
    model = AutoModelForCausalLM.from_config(copy.deepcopy(tiny_config("qwen3")), attn_implementation=impl)
    rows = batch if trainer == "cpattn" else dp * batch
    out = tempfile.mkdtemp(prefix="cpattn-hf-trainer-")
    try:
        with accelerate_state():
            args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=rows,
                                     per_device_eval_batch_size=rows, gradient_accumulation_steps=accumulation,
                                     learning_rate=1e-3, warmup_steps=2, logging_steps=1, seed=seed,
                                     average_tokens_across_devices=average_tokens, use_cpu=True, report_to="none",
                                     save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
            data = dict(train_dataset=Rows(train_rows, seq_len, seed + 1), eval_dataset=Rows(eval_rows, seq_len,
                                                                                             seed + 2))
            if trainer == "cpattn":
                run = hf.Trainer(model=model, args=args, cp_size=cp_size, cp_schedule=schedule, **data)
            else:
                run = StockTrainer(model=model, args=args, **data)
            run.train()
            logs = [e for e in run.state.log_history if "loss" in e and "grad_norm" in e]
            metrics = run.evaluate()
            predicted = run.predict(data["eval_dataset"])
            unlabelled = run.predict(Unlabelled(data["eval_dataset"]))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"loss": [e["loss"] for e in logs], "grad_norm": [e["grad_norm"] for e in logs],
            "eval_loss": metrics["eval_loss"], "predict_loss": predicted.metrics["test_loss"],
            "logits": torch.as_tensor(predicted.predictions),
            "unlabelled_logits": torch.as_tensor(unlabelled.predictions)}


def main(argv: list[str] | None = None) -> None:
    """``torchrun --nproc-per-node N tests/hf_trainer_workers.py OUT.json CP_SIZE``: the cpattn run as a
    user launches it (torchrun's environment, accelerate creating the gloo process group); rank 0 writes
    the logged numbers to ``OUT.json``."""
    import json
    import sys

    out, cp_size = (argv if argv is not None else sys.argv[1:])
    result = train("cpattn", cp_size=int(cp_size))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({k: v for k, v in result.items() if not k.endswith("logits")}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
