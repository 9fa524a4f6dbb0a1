"""Data for the reference models (:mod:`cpattn.models`): synthetic tasks (nothing to download, every
sample a deterministic function of a ``torch.Generator``) and local text.

- :func:`recall_batch`: associative recall, a language-model task that needs attention across the
  whole sequence;
- :func:`packed_documents`: several documents per row, for the ``cpattn.masks.document`` mask;
- :func:`advection_diffusion` and :func:`field_pairs`: a 2-D multi-channel field and (x_t, x_{t+1})
  training pairs for the ViT;
- :class:`TextCorpus` and :class:`TextPacker`: documents of local text files (a directory, a JSONL
  file's ``text`` fields, or one file), as bytes or through a ``tokenizers`` tokenizer, packed into rows
  of documents; the packer's position is a small JSON-able state, so a resumed run continues at the
  same document;
- :func:`lm_loss_sums`, :func:`accuracy_sums`, :func:`mse_sums`: per-rank sums and counts, so that the
  global mean is one all-reduce of each away (``sum / count`` after summing both over the ranks);
  :func:`shard_labels`: labels sharded with padding ignored.

Labels use -100 (``IGNORE``) for positions without a target, as ``torch.nn.functional.cross_entropy``.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn.functional as F

from .api import ContextParallel

#: label of a position without a target
IGNORE = -100


def _randint(low: int, high: int, size: tuple[int, ...], generator: torch.Generator | None) -> torch.Tensor:
    return torch.randint(low, high, size, generator=generator, dtype=torch.long)


# ---------------------------------------------------------------------------------- associative recall
def recall_ranges(vocab: int) -> tuple[range, range, range]:
    """``(filler, keys, values)``: the disjoint token ranges of :func:`recall_batch` over ``vocab``
    (a quarter of it filler, the rest split evenly between keys and values)."""
    if vocab < 5:
        raise ValueError(f"recall needs vocab >= 5 (filler, keys and values disjoint), got {vocab}")
    n_filler = max(1, vocab // 4)
    n_keys = (vocab - n_filler) // 2
    return range(0, n_filler), range(n_filler, n_filler + n_keys), range(n_filler + n_keys, n_filler + 2 * n_keys)


def recall_batch(batch: int, seq_len: int, vocab: int, pairs: int,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Associative recall: ``(tokens [batch, seq_len], labels [batch, seq_len])``, both long.

    Each row is ``k1 v1 k2 v2 ... kP vP`` (``pairs`` distinct keys, each with a random value), filler
    tokens, then the ``pairs`` keys again in a random order, each followed by its value:
    ``... q1 a1 q2 a2 ... qP aP``. The label of each query position is the next token, its value; every
    other label is -100. The pairs sit in the first ``2 * pairs`` tokens and the queries in the last
    ``2 * pairs``, so a correct answer needs attention across the sequence (across ranks under context
    parallelism). Chance accuracy is ``1 / len(recall_ranges(vocab)[2])``; measure it with
    :func:`accuracy_sums`.
    """
    filler, keys, values = recall_ranges(vocab)
    if not 1 <= pairs <= len(keys):
        raise ValueError(f"pairs must be in [1, {len(keys)}] (distinct keys in vocab {vocab}), got {pairs}")
    if seq_len < 4 * pairs:
        raise ValueError(f"seq_len ({seq_len}) must be >= 4 * pairs ({4 * pairs}): pairs, then queries")
    key = torch.stack([torch.randperm(len(keys), generator=generator)[:pairs] for _ in range(batch)]) + keys.start
    value = _randint(values.start, values.stop, (batch, pairs), generator)
    order = torch.stack([torch.randperm(pairs, generator=generator) for _ in range(batch)])
    tokens = _randint(filler.start, filler.stop, (batch, seq_len), generator)
    tokens[:, 0:2 * pairs:2], tokens[:, 1:2 * pairs:2] = key, value
    start = seq_len - 2 * pairs
    tokens[:, start::2], tokens[:, start + 1::2] = key.gather(1, order), value.gather(1, order)
    labels = torch.full_like(tokens, IGNORE)
    labels[:, start::2] = tokens[:, start + 1::2]
    return tokens, labels


# ---------------------------------------------------------------------------------- packed documents
def packed_documents(batch: int, seq_len: int, vocab: int, lengths: list[int],
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of packed documents: ``(tokens, labels, position_ids)``, each ``[batch, seq_len]`` long.

    Every row holds documents of the same ``lengths`` (summing to ``seq_len``), so one
    ``cpattn.masks.document(lengths)`` mask serves the batch. Each document repeats a random motif of
    2 to 8 tokens (drawn from ``vocab``), so after its first period the next token is predictable from
    inside the document alone. ``labels`` is the next token within a document and -100 at each
    document's last token; ``position_ids`` restart at 0 for each document (for RoPE).
    """
    if sum(lengths) != seq_len or any(n < 1 for n in lengths):
        raise ValueError(f"lengths must be positive and sum to seq_len ({seq_len}), got {list(lengths)}")
    tokens = torch.empty(batch, seq_len, dtype=torch.long)
    start = 0
    for n in lengths:
        period = int(_randint(2, 9, (1,), generator)) if n > 1 else 1
        motif = _randint(0, vocab, (batch, period), generator)
        tokens[:, start:start + n] = motif.repeat(1, -(-n // period))[:, :n]
        start += n
    labels = torch.full_like(tokens, IGNORE)
    labels[:, :-1] = tokens[:, 1:]
    ends = torch.tensor(lengths).cumsum(0) - 1
    labels[:, ends] = IGNORE
    position_ids = torch.cat([torch.arange(n) for n in lengths]).expand(batch, seq_len).contiguous()
    return tokens, labels, position_ids


# ---------------------------------------------------------------------------------- local text
#: vocabulary of the byte tokenizer (no tokenizer given): one token per byte
BYTE_VOCAB = 256
#: one document in every HOLD_OUT_EVERY (the last of each run of that many) is held out for evaluation
HOLD_OUT_EVERY = 20


class TextCorpus:
    """Documents of local text, read on demand and tokenised once each (a small cache keeps the recent
    ones).

    ``path`` is a directory (every regular file under it whose name does not start with ``.``, sorted by
    path: a ``*.jsonl`` file gives one document per line, any other file is one document), a ``.jsonl``
    file (the string field ``text`` of each non-blank line, one document each) or any other file (one
    document). ``tokenizer``: the path of a ``tokenizers`` JSON file (``Tokenizer.from_file``); without
    one, documents are their UTF-8 bytes (vocabulary 256). Empty documents are left out.
    ``fingerprint`` is the SHA-256 of the files' names and contents and the tokenizer file, so a resume
    can tell that the corpus it continues is the one it was saved with."""

    def __init__(self, path: str | Path, tokenizer: str | Path | None = None, cache: int = 256) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise ValueError(f"data path {self.path} does not exist")
        h = hashlib.sha256()
        self._docs: list[tuple[Path, int, int, bool]] = []  # (file, start, end, jsonl line)
        files = sorted(p for p in self.path.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(self.path).parts)) if self.path.is_dir() else [self.path]
        for file in files:
            raw = file.read_bytes()
            name = file.relative_to(self.path).as_posix() if self.path.is_dir() else file.name
            h.update(name.encode() + b"\0" + len(raw).to_bytes(8, "little") + raw)
            if file.suffix == ".jsonl":
                self._index_jsonl(file, raw)
            elif raw:
                self._docs.append((file, 0, len(raw), False))
        if not self._docs:
            raise ValueError(f"data path {self.path} holds no text (no non-empty file or JSONL text field)")
        self._tokenizer = None
        self.vocab = BYTE_VOCAB
        if tokenizer is not None:
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise ValueError("a tokenizer needs the tokenizers package: pip install tokenizers") from None
            try:
                self._tokenizer = Tokenizer.from_file(str(tokenizer))
            except Exception as exc:  # tokenizers raises its own exception type for a bad file
                raise ValueError(f"tokenizer {tokenizer} could not be loaded: {exc}") from None
            self.vocab = self._tokenizer.get_vocab_size(with_added_tokens=True)
            h.update(b"tokenizer\0" + Path(tokenizer).read_bytes())
        self.fingerprint = h.hexdigest()
        self._cache: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._cache_size = cache

    def _index_jsonl(self, file: Path, raw: bytes) -> None:
        start = 0
        for number, line in enumerate(raw.split(b"\n"), start=1):
            end = start + len(line)
            if line.strip():
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise ValueError(f"{file}:{number}: not valid JSON ({exc})") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ValueError(f"{file}:{number}: a JSONL line must be an object with a string 'text' field")
                if record["text"]:
                    self._docs.append((file, start, end, True))
            start = end + 1

    def __len__(self) -> int:
        return len(self._docs)

    def text(self, index: int) -> str:
        """Document ``index``'s text."""
        return self._raw(index).decode("utf-8", errors="replace")

    def _raw(self, index: int) -> bytes:
        file, start, end, jsonl = self._docs[index]
        with open(file, "rb") as f:
            f.seek(start)
            raw = f.read(end - start)
        return json.loads(raw)["text"].encode("utf-8") if jsonl else raw

    def tokens(self, index: int) -> torch.Tensor:
        """Document ``index`` as a 1-D long tensor of token ids (bytes without a tokenizer)."""
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        raw = self._raw(index)
        if self._tokenizer is None:
            ids = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        else:
            ids = torch.tensor(self._tokenizer.encode(raw.decode("utf-8", errors="replace"),
                                                      add_special_tokens=False).ids, dtype=torch.long)
        self._cache[index] = ids
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return ids

    def split(self) -> tuple[list[int], list[int]]:
        """``(train, held_out)`` document indices: with at least :data:`HOLD_OUT_EVERY` documents, every
        ``HOLD_OUT_EVERY``-th is held out; with fewer, nothing is."""
        every = HOLD_OUT_EVERY
        if len(self) < every:
            return list(range(len(self))), []
        return [i for i in range(len(self)) if i % every != every - 1], list(range(every - 1, len(self), every))


class TextPacker:
    """Packs the documents ``order`` of a :class:`TextCorpus` (indices, taken in turn and again from the
    start once all are used) into rows of ``seq_len`` tokens.

    A row is filled with whole documents; a document that does not fit is cut, and its rest begins the
    next row as a separate segment (a row never depends on another). Each segment is one document of
    the row's document mask, with positions restarting at 0. Labels are each token's successor in its
    document (also across a cut) and -100 at each document's last token.

    :meth:`state_dict` is where the next batch begins (``{"epoch", "document", "offset"}``: the pass
    over ``order``, the position in it, and the token offset inside that document);
    :meth:`load_state_dict` continues there, so a resumed run packs exactly the batches an uninterrupted
    one would."""

    def __init__(self, corpus: TextCorpus, order: list[int], seq_len: int) -> None:
        if not order:
            raise ValueError("the packer needs at least one document")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.corpus, self.order, self.seq_len = corpus, list(order), seq_len
        self.epoch, self.document, self.offset = 0, 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "document": self.document, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        try:
            epoch, document, offset = (int(state[k]) for k in ("epoch", "document", "offset"))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"a text data position needs integer epoch, document and offset, got {state!r}") from None
        if not (epoch >= 0 and 0 <= document < len(self.order) and offset >= 0):
            raise ValueError(f"text data position {state!r} is outside this corpus ({len(self.order)} documents)")
        self.epoch, self.document, self.offset = epoch, document, offset

    def current(self) -> int:
        """The corpus index of the document the next batch begins with."""
        return self.order[self.document]

    def _advance(self) -> None:
        self.document, self.offset = self.document + 1, 0
        if self.document == len(self.order):
            self.epoch, self.document = self.epoch + 1, 0

    def next_batch(self, rows: int) -> dict:
        """``rows`` packed rows: ``tokens``, ``labels``, ``position_ids`` (``[rows, seq_len]`` long),
        ``lengths`` (each row's segment lengths, a list of lists summing to ``seq_len``) and ``documents``
        (the corpus index of each row's first segment)."""
        s = self.seq_len
        tokens = torch.empty(rows, s, dtype=torch.long)
        labels = torch.full((rows, s), IGNORE, dtype=torch.long)
        positions = torch.empty(rows, s, dtype=torch.long)
        lengths: list[list[int]] = []
        firsts: list[int] = []
        for r in range(rows):
            row, filled, empties = [], 0, 0
            firsts.append(self.current())
            while filled < s:
                doc = self.corpus.tokens(self.current())
                left = len(doc) - self.offset
                if left <= 0:
                    empties += 1
                    if empties > len(self.order):
                        raise ValueError("the documents hold no tokens (every one is empty after tokenisation)")
                    self._advance()
                    continue
                empties = 0
                n = min(left, s - filled)
                part = doc[self.offset:self.offset + n + 1]  # one more: the last token's successor
                tokens[r, filled:filled + n] = part[:n]
                labels[r, filled:filled + len(part) - 1] = part[1:]
                positions[r, filled:filled + n] = torch.arange(n)
                row.append(n)
                filled += n
                self.offset += n
                if self.offset >= len(doc):
                    self._advance()
            lengths.append(row)
        return {"tokens": tokens, "labels": labels, "position_ids": positions, "lengths": lengths,
                "documents": firsts}


# ---------------------------------------------------------------------------------- fields
def _smooth_field(samples: int, channels: int, height: int, width: int, generator, modes: int = 4) -> torch.Tensor:
    """A random periodic field: a per-channel mean plus ``modes`` low-frequency Fourier modes, float64."""
    y = torch.arange(height, dtype=torch.float64).view(height, 1) / height
    x = torch.arange(width, dtype=torch.float64).view(1, width) / width
    field = torch.randn(samples, channels, 1, 1, generator=generator, dtype=torch.float64).expand(
        samples, channels, height, width).clone()
    for _ in range(modes):
        ky = _randint(0, 4, (samples, channels, 1, 1), generator)
        kx = _randint(1, 4, (samples, channels, 1, 1), generator)
        amp = torch.randn(samples, channels, 1, 1, generator=generator, dtype=torch.float64)
        phase = 2 * torch.pi * torch.rand(samples, channels, 1, 1, generator=generator, dtype=torch.float64)
        field += amp * torch.sin(2 * torch.pi * (ky * y + kx * x) + phase)
    return field


def advection_velocities(channels: int, courant: float = 0.4) -> torch.Tensor:
    """``[channels, 2]`` float64: channel c moves at ``courant`` cells per step in direction
    ``2 pi c / channels`` (columns: (dy, dx) in cells per step). Fixed per channel, so one snapshot
    determines the next."""
    angle = 2 * torch.pi * torch.arange(channels, dtype=torch.float64) / channels
    return courant * torch.stack((angle.sin(), angle.cos()), dim=1)


def advection_diffusion(samples: int, channels: int, height: int, width: int, steps: int,
                        generator: torch.Generator | None = None, diffusion: float = 0.02) -> torch.Tensor:
    """Trajectories ``[samples, steps, channels, height, width]`` float32 of a periodic field advected at
    a constant velocity per channel (:func:`advection_velocities`) and diffused.

    One explicit step: first-order upwind advection plus the 5-point Laplacian times ``diffusion``
    (cells^2 per step). The update's coefficients are non-negative (``|c_y| + |c_x| + 4 * diffusion <= 1``),
    so it is stable and never creates new extrema, and on the periodic grid it conserves each channel's
    mean. Step 0 is the random smooth initial field; computed in float64, stored in float32.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    vel = advection_velocities(channels)
    if float(vel.abs().sum(1).max()) + 4 * diffusion > 1:
        raise ValueError(f"diffusion={diffusion} is unstable with courant 0.4: need |c_y| + |c_x| + 4 d <= 1")
    cy, cx = (vel[:, i].view(1, channels, 1, 1) for i in (0, 1))
    x = _smooth_field(samples, channels, height, width, generator)
    out = torch.empty(samples, steps, channels, height, width, dtype=torch.float32)
    out[:, 0] = x.float()
    for t in range(1, steps):
        up, down = torch.roll(x, 1, -2), torch.roll(x, -1, -2)  # x[i-1], x[i+1] along height
        left, right = torch.roll(x, 1, -1), torch.roll(x, -1, -1)
        advect = cy.clamp(min=0) * (x - up) + cy.clamp(max=0) * (down - x) \
            + cx.clamp(min=0) * (x - left) + cx.clamp(max=0) * (right - x)
        x = x - advect + diffusion * (up + down + left + right - 4 * x)
        out[:, t] = x.float()
    return out


def field_pairs(fields: torch.Tensor, batch: int,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, x_next)``, each ``[batch, C, H, W]``: ``batch`` random (sample, t) of ``fields``
    ``[samples, steps, C, H, W]`` (from :func:`advection_diffusion`) with their successors. The
    persistence baseline predicts ``x_t`` for ``x_next``."""
    samples, steps = fields.shape[:2]
    if steps < 2:
        raise ValueError(f"fields must have at least 2 steps, got {steps}")
    s = _randint(0, samples, (batch,), generator)
    t = _randint(0, steps - 1, (batch,), generator)
    return fields[s, t], fields[s, t + 1]


# ---------------------------------------------------------------------------------- losses and metrics
def shard_labels(cp: ContextParallel, labels: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``cp.shard(labels, dim)`` with padding positions set to -100 (``shard`` zero-fills them, and 0
    is a valid class)."""
    local = cp.shard(labels, dim)
    pad = (cp.positions() < 0).nonzero().flatten().to(local.device)
    return local.index_fill(dim, pad, IGNORE) if pad.numel() else local


def lm_loss_sums(logits_local: torch.Tensor, labels_local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, count)``, float32 scalars: the summed cross-entropy of ``logits_local [b, s, vocab]``
    over the positions whose ``labels_local [b, s]`` is not -100, and how many there are. The global mean
    loss is ``all_reduce(loss_sum) / all_reduce(count)`` (the count may be 0 on a rank)."""
    loss_sum = F.cross_entropy(logits_local.float().flatten(0, 1), labels_local.flatten(), ignore_index=IGNORE,
                               reduction="sum")
    return loss_sum, (labels_local != IGNORE).sum().float()


def accuracy_sums(logits_local: torch.Tensor, labels_local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(correct, count)``, float32 scalars: arg-max predictions equal to the label, over labels != -100."""
    keep = labels_local != IGNORE
    correct = (logits_local.argmax(-1) == labels_local) & keep
    return correct.sum().float(), keep.sum().float()


def mse_sums(pred: torch.Tensor, target: torch.Tensor,
             valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(squared_error_sum, count)``, float32 scalars, over the elements of ``pred``, ``target``
    ``[b, s, ...]``; ``valid`` (bool ``[s]`` or ``[b, s]``, e.g. ``cp.positions() >= 0``) keeps only those
    tokens, so that padding rows do not count. Global MSE: ``all_reduce(sum) / all_reduce(count)``."""
    err = (pred.float() - target.float()).pow(2)
    if valid is None:
        return err.sum(), torch.tensor(float(err.numel()))
    keep = valid.to(err.device).expand(err.shape[:2]).reshape(*err.shape[:2], *([1] * (err.dim() - 2)))
    per_token = err[0, 0].numel()
    return (err * keep).sum(), keep.sum().float() * per_token
