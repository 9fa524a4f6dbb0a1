"""The tokenizer and data the integration brings, since the torchtitan wheel ships neither: bytes as
tokens, and text generated from a seed, packed into rows of documents with per-document positions (the
format of torchtitan's text datasets: inputs and labels shifted inside each document, positions
restarting at 0 where a document starts).

Row ``i`` of the run is a function of the seed and ``i`` alone, and data-parallel rank ``r`` of ``W``
takes rows ``r * b .. r * b + b - 1`` of each global batch of ``W * b`` rows: every data-parallel
degree sees the same global batches (so a one-rank run with ``b * W`` rows per step is the reference
of a ``W``-rank run), and the loader's state is one number, the rows consumed, kept as a tensor."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer

#: bytes are ids 0..255; then begin and end of a document
BOS, EOS = 256, 257
VOCAB = 258

_WORDS = ("the of and to in is was that for on as with by he at from his an were are which this be "
          "or has had not but first one their its new after who they have her she two been other when "
          "there all during into school time may years more most only over city some world would where "
          "later up such used many can state about national out known university united then made "
          "river house over ring token rank split shard query key value block sequence attention "
          "context parallel exact gradient loss step model train layer head batch").split()


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes as token ids (0-255), ``BOS`` = 256 and ``EOS`` = 257: no files needed."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str = "") -> None:
        super().__init__()
        self.bos_id, self.eos_id = BOS, EOS

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True, **kwargs) -> list[int]:
        return [BOS] * add_bos + list(text.encode("utf-8")) + [EOS] * add_eos

    def decode(self, ids: list[int], **kwargs) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return VOCAB


def document(rng: random.Random, max_bytes: int) -> str:
    """One generated document: sentences of common words, between ``max_bytes // 8`` and ``max_bytes``
    bytes long (at least 8)."""
    target = rng.randint(max(8, max_bytes // 8), max(8, max_bytes))
    sentences, size = [], 0
    while size < target:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        sentence = " ".join(words).capitalize() + "."
        sentences.append(sentence)
        size += len(sentence) + 1
    return " ".join(sentences)[:target]


def row(seed: int, index: int, seq_len: int, tokenizer: BaseTokenizer) -> tuple[list[int], list[int], list[int]]:
    """Row ``index`` of the run with ``seed``: ``(inputs, labels, positions)``, ``seq_len`` tokens each,
    documents packed one after another (the last one cut at the row's end)."""
    rng = random.Random(f"cpattn-titan:{seed}:{index}")
    inputs: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    while len(inputs) < seq_len:
        tokens = tokenizer.encode(document(rng, seq_len), add_bos=True, add_eos=True)
        inputs += tokens[:-1]
        labels += tokens[1:]
        positions += range(len(tokens) - 1)
    return inputs[:seq_len], labels[:seq_len], positions[:seq_len]


class GeneratedTextLoader(BaseDataLoader):
    """Batches of ``local_batch_size`` rows of ``seq_len`` tokens for data-parallel rank ``dp_rank``:
    ``({"input": [b, L], "positions": [b, L]}, labels [b, L])``, endless."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "generated"
        seed: int = 0
        """Seed of the generated text (the same on every rank)"""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer,
                 seq_len: int, local_batch_size: int, **kwargs: Any) -> None:
        self.seed, self.tokenizer = config.seed, tokenizer
        self.dp_world_size, self.dp_rank = dp_world_size, dp_rank
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.rows = 0  # rows of the whole run consumed so far (every data-parallel rank's)

    @property
    def global_batch_rows(self) -> int:
        return self.dp_world_size * self.local_batch_size

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            first = self.rows + self.dp_rank * self.local_batch_size
            parts = [row(self.seed, first + j, self.seq_len, self.tokenizer) for j in range(self.local_batch_size)]
            inputs, labels, positions = (torch.tensor([p[i] for p in parts], dtype=torch.long) for i in range(3))
            self.rows += self.global_batch_rows
            yield {"input": inputs, "positions": positions}, labels

    def state_dict(self) -> dict[str, Any]:
        return {"rows": torch.tensor(self.rows, dtype=torch.int64)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        rows = int(state_dict["rows"])
        if rows % self.global_batch_rows:
            raise ValueError(f"the checkpoint's data position ({rows} rows) is not a whole number of global "
                             f"batches of {self.global_batch_rows} rows (data-parallel degree "
                             f"{self.dp_world_size} x local batch {self.local_batch_size})")
        self.rows = rows
