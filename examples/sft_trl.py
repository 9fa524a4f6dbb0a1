"""Fine-tune with TRL's SFTTrainer and cpattn's context parallelism, turned on the Hugging Face way:
``ParallelismConfig(cp_size=2)`` in the training arguments.

    pip install -e '.[hf,trl]'
    torchrun --nproc-per-node 2 examples/sft_trl.py            # add --no-packing for right-padded batches

``hf.context_parallel(SFTTrainer)`` is SFTTrainer with cpattn: it takes ``cp_size`` out of the
``ParallelismConfig`` before accelerate sees it (accelerate's own torch context parallelism never runs), both
ranks read the same batches and each runs the model on half of every sequence, attending to the whole
sequence through cpattn. Packed batches (TRL's ``padding_free``) run on their document mask, so documents
never attend to one another. Everything is built in code (a word-level tokenizer, a small random Llama,
prompt-completion pairs of random words): nothing is downloaded. Runs on the CPU (gloo) in well under two
minutes; rank 0 prints the loss of every step.
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import torch
from accelerate import ParallelismConfig
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from cpattn.integrations import hf

WORDS = 200


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{f"w{i}": 3 + i for i in range(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")


def data(n: int) -> Dataset:
    """Prompts of random words; each completion is its prompt's words, each one word up (learnable)."""
    g = torch.Generator().manual_seed(0)
    prompts, completions = [], []
    for _ in range(n):
        ids = torch.randint(0, WORDS - 1, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g)
        prompts.append(" ".join(f"w{int(i)}" for i in ids))
        completions.append(" " + " ".join(f"w{int(i) + 1}" for i in ids))
    return Dataset.from_dict({"prompt": prompts, "completion": completions})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--no-packing", dest="packing", action="store_false", help="right-padded batches")
    parser.add_argument("--schedule", default="zigzag_ring", help="a cpattn schedule name, or 'auto'")
    cli = parser.parse_args()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("cpattn").setLevel(logging.INFO)  # the line naming the schedule and the mask

    hf.register()  # the "cpattn" attention implementation
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=WORDS + 3, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="cpattn")
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, max_steps=cli.steps, per_device_train_batch_size=4, learning_rate=3e-3,
                         warmup_steps=3, logging_steps=1, max_length=128, packing=cli.packing, use_cpu=True,
                         bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="no",
                         disable_tqdm=True, parallelism_config=ParallelismConfig(cp_size=2))
        trainer = hf.context_parallel(SFTTrainer)(model=model, args=args, train_dataset=data(600),
                                                  processing_class=tokenizer(), cp_schedule=cli.schedule)
        trainer.train()
    if trainer.accelerator.is_main_process:
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"step {entry['step']:3d}  loss {entry['loss']:.4f}  tokens {int(entry['num_tokens']):6d}  "
                      f"accuracy {entry['mean_token_accuracy']:.3f}")


if __name__ == "__main__":
    main()
