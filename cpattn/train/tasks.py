"""One run's task on this rank (:class:`_Task`): the model, the global batch of each step and the
held-out batch, this rank's share of them, the loss and evaluation sums, and the model FLOPs of a step.
Every rank builds the same global batch for step t: a pure function of the seed and t for the synthetic
tasks (recall, packed documents, the ViT's fields), the text packer's position for ``text``."""

from __future__ import annotations

import dataclasses

import torch

from ..api import ContextParallel
from ..core.masks import document
from .config import TrainConfig, _model_config

#: rows of the held-out batch each evaluation uses (synthetic tasks; text: one global batch)
EVAL_BATCH = 64
#: trajectories and time steps of the generated fields the ViT trains on
FIELD_SAMPLES, FIELD_STEPS = 16, 12


class _Task:
    """Model, data and loss of one run, on this rank. The synthetic tasks' batches are pure functions
    of (seed, step); the text task's come from a packer whose position is saved with each checkpoint."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        from .. import data
        from ..models import Llama, ViT, flops

        self.cfg, self.device, self.data, self.flops = cfg, device, data, flops
        self.corpus = self.packer = None
        self.mconf = _model_config(cfg.model, cfg.config)
        if cfg.task == "text":
            self.corpus = data.TextCorpus(cfg.data, cfg.tokenizer)
            self.mconf = dataclasses.replace(self.mconf, vocab=self.corpus.vocab)
            train_docs, self.held_out = self.corpus.split()
            self.packer = data.TextPacker(self.corpus, train_docs, cfg.seq)
        torch.manual_seed(cfg.seed)  # the same initial parameters on every rank
        if cfg.model == "llama":
            self.model = Llama(self.mconf).to(device)
            self.seq = cfg.seq
            self.mask = document(list(cfg.document_lengths())) if cfg.task == "documents" else "causal"
        else:
            self.model = ViT(self.mconf).to(device)
            self.seq = self.mconf.n_patches
            self.mask = "full"
            m = self.mconf  # the training and held-out fields: trajectories from two seeds
            self.fields = [data.advection_diffusion(samples, m.channels, m.height, m.width, FIELD_STEPS,
                                                    generator=self.generator(0, stream=2 + i))
                           for i, samples in enumerate((FIELD_SAMPLES, EVAL_BATCH))]

    @property
    def cp_len(self) -> int:
        """The sequence one ContextParallel spans: a row, or (text) a dp rank's rows flattened."""
        return self.seq * (self.cfg.batch // self.cfg.dp) if self.cfg.task == "text" else self.seq

    def generator(self, step: int, stream: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + 7919 * stream + step)

    def batch(self, step: int) -> dict:
        """Step ``step``'s global batch (identical on every rank; text: the packer moves on)."""
        if self.packer is not None:
            return self.packer.next_batch(self.cfg.batch)
        return self._synthetic(self.cfg.batch, self.generator(step))

    def held_out_batch(self) -> dict:
        """The fixed held-out batch of every evaluation."""
        cfg = self.cfg
        if self.packer is not None:
            if not self.held_out:
                raise ValueError(f"evaluation needs held-out documents: --data holds {len(self.corpus)}, fewer "
                                 f"than {self.data.HOLD_OUT_EVERY} (one in {self.data.HOLD_OUT_EVERY} is held out)")
            return self.data.TextPacker(self.corpus, self.held_out, self.seq).next_batch(cfg.batch)
        rows = max(cfg.dp, EVAL_BATCH // cfg.dp * cfg.dp)
        return self._synthetic(rows, self.generator(0, stream=1), held_out=True)

    def _synthetic(self, rows: int, gen: torch.Generator, held_out: bool = False) -> dict:
        cfg, m = self.cfg, self.mconf
        if cfg.model == "vit":
            x, y = self.data.field_pairs(self.fields[held_out], rows, gen)
            return {"x": x, "y": y}
        if cfg.task == "recall":
            tokens, labels = self.data.recall_batch(rows, self.seq, m.vocab, pairs=max(2, min(8, self.seq // 16)),
                                                    generator=gen)
            return {"tokens": tokens, "labels": labels}
        tokens, labels, position_ids = self.data.packed_documents(rows, self.seq, m.vocab,
                                                                  list(cfg.document_lengths()), gen)
        return {"tokens": tokens, "labels": labels, "position_ids": position_ids}

    def local(self, full: dict, dp_rank: int, cp: ContextParallel) -> tuple[dict, ContextParallel]:
        """This rank's inputs for its dp rows of ``full``, sharded by ``cp`` (text: by the view of the
        rows' document mask) and on the device; and the ContextParallel (or view) they run on."""
        rows = len(full["labels" if "labels" in full else "y"]) // self.cfg.dp
        mine = {k: v[dp_rank * rows:(dp_rank + 1) * rows] for k, v in full.items()}
        dev = self.device
        if self.cfg.model == "vit":
            from ..models.vit import patchify

            p = self.mconf.patch
            return {"x": cp.shard(patchify(mine["x"], p), dim=1).to(dev),
                    "y": cp.shard(patchify(mine["y"], p), dim=1).to(dev)}, cp
        if self.cfg.task == "text":  # the rows flattened into one packed sequence
            cp = cp.with_mask(document([n for row in mine["lengths"] for n in row]))
            mine = {k: mine[k].reshape(1, -1) for k in ("tokens", "labels", "position_ids")}
        out = {"tokens": cp.shard(mine["tokens"], dim=1).to(dev),
               "labels": self.data.shard_labels(cp, mine["labels"]).to(dev)}
        out["positions"] = cp.shard(mine["position_ids"], dim=1).to(dev) if "position_ids" in mine \
            else cp.positions().to(dev)
        return out, cp

    def sums(self, inputs: dict, cp: ContextParallel) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's loss sum and count for ``inputs`` (from :meth:`local`), plus evaluation sums."""
        if self.cfg.model == "vit":
            valid = cp.positions() >= 0
            pred = self.model(inputs["x"], cp.positions().to(self.device), cp)
            err, count = self.data.mse_sums(pred, inputs["y"], valid=valid)
            persistence, _ = self.data.mse_sums(inputs["x"], inputs["y"], valid=valid)
            return err, count, {"persistence": persistence.detach()}
        logits = self.model(inputs["tokens"], inputs["positions"], cp)
        loss_sum, count = self.data.lm_loss_sums(logits, inputs["labels"])
        correct, _ = self.data.accuracy_sums(logits.detach(), inputs["labels"])
        return loss_sum, count, {"correct": correct}

    def step_flops(self, full: dict) -> float:
        """Model FLOPs of one training step on the global batch ``full`` (forward and backward)."""
        f, cfg = self.flops, self.cfg
        if cfg.model == "vit":
            return f.vit_flops_per_token(self.mconf, self.seq) * self.seq * cfg.batch
        if cfg.task == "text":
            return sum(f.llama_flops_per_token(self.mconf, self.seq, sum(n * (n + 1) // 2 for n in row)) * self.seq
                       for row in full["lengths"])
        pairs = sum(n * (n + 1) // 2 for n in cfg.document_lengths()) if cfg.task == "documents" else None
        return f.llama_flops_per_token(self.mconf, self.seq, pairs) * self.seq * cfg.batch

    def chance(self) -> float | None:
        """Chance accuracy of the recall answers (None for other tasks)."""
        if self.cfg.task != "recall":
            return None
        return 1 / len(self.data.recall_ranges(self.mconf.vocab)[2])
