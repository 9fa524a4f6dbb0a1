"""Functions the TRL and ParallelismConfig tests run: a tiny random Llama fine-tuned by TRL's ``SFTTrainer``
(a prompt-completion data set, a word-level tokenizer built in code: nothing is downloaded), by
``context_parallel(SFTTrainer)`` on every rank of a worker world with accelerate's ``ParallelismConfig``, or by
the stock ``SFTTrainer`` with eager attention on one process (the reference); and a sliding-window Mistral
trained by ``context_parallel(transformers.Trainer)`` likewise (no TRL needed)."""

from __future__ import annotations

import copy
import shutil
import tempfile

import torch
from hf_trainer_workers import Rows, accelerate_state
from hf_workers import tiny_config

from cpattn.integrations import hf

#: words of the tokenizer (the model's vocabulary is 128: these and 3 special tokens)
WORDS = 100
#: the run: 10 optimizer steps of 2 accumulated batches of 2 examples per data-parallel group
RUN = dict(steps=10, batch=2, accumulation=2, examples=320, max_length=48, seed=0, lr=3e-3)


def tokenizer():
    """A word-level tokenizer over ``w0 .. w99`` with ``[PAD]``, ``[EOS]`` and ``[UNK]``, built in code."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{f"w{i}": 3 + i for i in range(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")


def examples(n: int, seed: int):
    """``n`` prompt-completion pairs of random words (prompts of 2-12 words, completions of 2-20): the
    loss is the completions' only (TRL's completion_only_loss)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)

    def words(lo: int, hi: int) -> str:
        k = int(torch.randint(lo, hi + 1, (1,), generator=g))
        return " ".join(f"w{int(i)}" for i in torch.randint(0, WORDS, (k,), generator=g))

    pairs = [(words(2, 12), " " + words(2, 20)) for _ in range(n)]  # the space: no word merges across the two
    return Dataset.from_dict({"prompt": [p for p, _ in pairs], "completion": [c for _, c in pairs]})


def llama(impl: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    if impl == hf.NAME:
        hf.register()
    model = AutoModelForCausalLM.from_config(copy.deepcopy(tiny_config("llama")), attn_implementation=impl)
    return model.to(dtype)


def sft(trainer: str, packing: bool, cp_size: int = 1, dp: int = 1, steps: int = RUN["steps"],
        batch: int = RUN["batch"], accumulation: int = RUN["accumulation"], examples_n: int = RUN["examples"],
        max_length: int = RUN["max_length"], seed: int = RUN["seed"], lr: float = RUN["lr"],
        schedule: str = "zigzag_ring", dtype: str = "float32", eval_examples: int = 14) -> dict:
    """Fine-tune the tiny Llama for ``steps`` optimizer steps with TRL's SFTTrainer.

    ``trainer="cpattn"``: ``context_parallel(SFTTrainer)`` on this world, ``ParallelismConfig(cp_size=cp_size,
    dp_shard_size=dp)`` in its arguments, ``batch`` examples per group; ``"trl"``: the stock SFTTrainer
    with eager attention on one process, ``dp * batch`` examples per batch (the same examples per step).
    ``packing``: TRL's best-fit packing into rows of ``max_length`` tokens, batches padding-free (one row of
    documents with ``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k`` and ``seq_idx``); else
    right-padded rows with an ``attention_mask``. Returns the logged ``loss``, ``num_tokens``,
    ``mean_token_accuracy`` and ``grad_norm`` of every step, then ``eval_loss`` and
    ``eval_mean_token_accuracy`` of ``evaluate()`` on ``eval_examples`` more examples."""
    from accelerate import ParallelismConfig
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(seed)
    cpattn_run = trainer == "cpattn"
    model = llama(hf.NAME if cpattn_run else "eager", getattr(torch, dtype))
    rows = batch if cpattn_run else dp * batch
    out = tempfile.mkdtemp(prefix="cpattn-trl-")
    try:
        with accelerate_state():
            extra = {}
            if cpattn_run:
                extra["parallelism_config"] = ParallelismConfig(dp_shard_size=dp, cp_size=cp_size)
            args = SFTConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=rows,
                             per_device_eval_batch_size=rows,
                             gradient_accumulation_steps=accumulation, learning_rate=lr, warmup_steps=2,
                             logging_steps=1, seed=seed, use_cpu=True, report_to="none", save_strategy="no",
                             disable_tqdm=True, dataloader_num_workers=0, bf16=False, gradient_checkpointing=False,
                             max_length=max_length, packing=packing, dataset_num_proc=None, **extra)
            cls = hf.context_parallel(SFTTrainer) if cpattn_run else SFTTrainer
            kw = dict(cp_schedule=schedule) if cpattn_run else {}
            run = cls(model=model, args=args, train_dataset=examples(examples_n, seed + 1),
                      eval_dataset=examples(eval_examples, seed + 2), processing_class=tokenizer(), **kw)
            run.train()
            logs = [e for e in run.state.log_history if "loss" in e and "grad_norm" in e]
            metrics = run.evaluate()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    result = {name: [e[name] for e in logs] for name in ("loss", "num_tokens", "mean_token_accuracy", "grad_norm")}
    result.update({name: metrics[name] for name in ("eval_loss", "eval_mean_token_accuracy")})
    return result


def trainer_with_parallelism_config(trainer: str, cp_size: int = 1, dp: int = 1, steps: int = 10,
                                    seq_len: int = 40, batch: int = 2, window: int = 8, seed: int = 0) -> dict:
    """A sliding-window Mistral (window ``window``) trained ``steps`` steps by ``transformers.Trainer``.

    ``trainer="cpattn"``: ``context_parallel(`` a user's subclass of ``transformers.Trainer`` ``)`` with
    ``ParallelismConfig(cp_size=cp_size, dp_shard_size=dp)``; it records what accelerate would have
    added for its own context parallelism (the accelerator's parallelism configuration, forward
    pre-hooks on any module, the context each step runs in) and the length of the ``input_ids`` each
    rank's model gets. ``"transformers"``: the stock Trainer with eager attention on one process."""
    from accelerate import ParallelismConfig
    from transformers import AutoModelForCausalLM, TrainingArguments
    from transformers import Trainer as StockTrainer

    class Recording(StockTrainer):  # a user's own subclass
        seen: list[int] = []

        def compute_loss(self, model, inputs, *args, **kwargs):
            self.seen.append(inputs["input_ids"].shape[1])
            return super().compute_loss(model, inputs, *args, **kwargs)

    torch.manual_seed(seed)
    cpattn_run = trainer == "cpattn"
    if cpattn_run:
        hf.register()
    config = copy.deepcopy(tiny_config("mistral", sliding_window=window))
    model = AutoModelForCausalLM.from_config(config, attn_implementation=hf.NAME if cpattn_run else "eager")
    rows = batch if cpattn_run else dp * batch
    out = tempfile.mkdtemp(prefix="cpattn-hf-pc-")
    try:
        with accelerate_state():
            extra = {"parallelism_config": ParallelismConfig(dp_shard_size=dp, cp_size=cp_size)} \
                if cpattn_run else {}
            args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=rows,
                                     learning_rate=3e-3, warmup_steps=2, logging_steps=1, seed=seed, use_cpu=True,
                                     report_to="none", save_strategy="no", disable_tqdm=True,
                                     dataloader_num_workers=0, **extra)
            cls = hf.context_parallel(Recording) if cpattn_run else StockTrainer
            run = cls(model=model, args=args, train_dataset=Rows(64, seq_len, seed + 1))
            contexts = []
            if cpattn_run:
                prepare = run._prepare_context_parallel_inputs

                def recorded(model, inputs):
                    context, inputs = prepare(model, inputs)
                    contexts.append(getattr(context, "func", None) is hf.use)
                    return context, inputs

                run._prepare_context_parallel_inputs = recorded
            run.train()
            logs = [e for e in run.state.log_history if "loss" in e and "grad_norm" in e]
            result = {"loss": [e["loss"] for e in logs], "grad_norm": [e["grad_norm"] for e in logs]}
            if cpattn_run:
                result.update(
                    accelerator_parallelism=repr(run.accelerator.parallelism_config),
                    args_parallelism=repr(run.args.parallelism_config),
                    pre_hooks=sum(len(m._forward_pre_hooks) for m in run.model.modules()),
                    input_lengths=sorted(set(Recording.seen)), local_len=run._step_cp.local_len,
                    cp_size=run.cp_size, all_steps_in_hf_use=bool(contexts) and all(contexts),
                    class_name=type(run).__name__, is_recording=isinstance(run, Recording))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return result
