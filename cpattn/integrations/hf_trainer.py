"""The Hugging Face ``transformers.Trainer`` with context-parallel attention (``cpattn.integrations.hf.Trainer``).

::

    hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="cpattn")
    trainer = hf.Trainer(model=model, args=TrainingArguments(...), train_dataset=data, eval_dataset=held_out,
                         cp_size=2, cp_schedule="zigzag_ring")
    trainer.train()            # torchrun --nproc-per-node 4 train.py: 2 data-parallel groups of 2 ranks
    trainer.evaluate()

The ranks form groups of ``cp_size`` consecutive ranks; every rank of a group reads the same batch
(the data loaders are sharded over the ``world / cp_size`` groups instead of over the ranks). Each step,
:meth:`Trainer._prepare_context_parallel_inputs` (the hook ``transformers`` calls to shard a batch and
to get the context a step runs in) shifts the labels on the full sequence, shards the per-token tensors
with the group's :class:`cpattn.ContextParallel` and returns ``hf.use(cp)``, inside which the Trainer
runs the forward and the backward. The loss is the model's own, on this rank's tokens with the shifted
labels and the Trainer's ``num_items_in_batch``: every rank's loss is its share of the batch's mean and
the Trainer's data-parallel averaging over all the ranks gives the gradient of that mean (see
``docs/huggingface.md``). Evaluation unshards the logits (``cp.unshard``) and keeps one copy per group.

``transformers`` and ``accelerate`` are imported with this module, which ``cpattn.integrations.hf``
imports on the first use of ``hf.Trainer``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import transformers
from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard
from accelerate.utils import recursively_apply

from ..api import ContextParallel
from ..core import masks as masks_mod
from ..core.memo import BoundedCache
from ..schedules import Schedule
from ..schedules import resolve as resolve_schedule
from . import hf_common

#: ContextParallel objects kept, one per sequence length met (each costs one small exchange to build)
CONTEXTS_KEPT = 8
#: per-token tensors of a batch that are sharded along the sequence (dim 1)
PER_TOKEN = ("input_ids", "inputs_embeds", "labels", "shift_labels", "token_type_ids")


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` whose model attends through cpattn over groups of ``cp_size`` ranks.

    ``cp_size``: ranks per context-parallel group (consecutive ranks; the world size must be a multiple);
    the ``world / cp_size`` groups are the data-parallel replicas. ``cp_schedule``: a schedule name,
    ``"auto"`` or a :class:`cpattn.schedules.Schedule`. ``cp_mask``: the attention mask of every
    sequence (``"causal"``, ``"full"`` or a :class:`cpattn.masks.Mask`); packed batches
    (``DataCollatorWithFlattening``: ``position_ids`` restarting at 0 in each document) run on the step's
    document view of it (:func:`cpattn.integrations.hf.packed`). Every other argument is the Trainer's.

    The model must be built with ``attn_implementation="cpattn"`` (after ``hf.register()``) and take
    the loss keyword arguments (``num_items_in_batch``, as transformers' models do). What would make a
    rank's loss other than its share of the batch's mean raises ``NotImplementedError`` at construction
    (label smoothing, ``compute_loss_func``, ``ParallelismConfig(cp_size=...)``, which is torch's own
    context parallelism, or its tensor and sequence parallelism), or when a data loader is built
    (batches dispatched from the main process).
    """

    def __init__(self, *args, cp_size: int = 1, cp_schedule: str | Schedule = "zigzag_ring",
                 cp_mask: masks_mod.Mask | str = "causal", **kwargs) -> None:
        if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
            raise ValueError(f"cp_size must be a positive int (ranks per context-parallel group), got {cp_size!r}")
        self.cp_size = cp_size
        self.cp_mask = masks_mod.resolve(cp_mask)
        if cp_schedule != "auto":
            resolve_schedule(cp_schedule).check_mask(self.cp_mask)
        self.cp_schedule = cp_schedule
        hf_common.register()
        super().__init__(*args, **kwargs)
        self._check_setup()
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        #: the data-parallel group of this rank and the number of groups
        self.dp_rank, self.dp_size = rank // cp_size, world // cp_size
        self._cp_group = _consecutive_groups(cp_size, world, rank)
        self._contexts = BoundedCache(CONTEXTS_KEPT)
        self._step_cp: ContextParallel | None = None  # the ContextParallel of the batch being run

    # ------------------------------------------------------------------ checks
    def _check_setup(self) -> None:
        """Refuse, before any communication and alike on every rank, what would give another loss or
        gradient than the model trained on the whole sequences by one process."""
        config = getattr(self.model, "config", None)
        impl = getattr(config, "_attn_implementation", None)
        if config is not None and impl != hf_common.NAME:
            raise ValueError(f"hf.Trainer needs a model built with attn_implementation={hf_common.NAME!r} (after "
                             f"cpattn.integrations.hf.register()), got {impl!r}: its attention would see this "
                             "rank's tokens only")
        if self.accelerator.num_processes % self.cp_size:
            raise ValueError(f"cp_size={self.cp_size} does not divide the {self.accelerator.num_processes} "
                             "processes: the ranks form groups of cp_size consecutive ranks")
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is not None and (pc.cp_size > 1 or pc.tp_size > 1 or pc.sp_size > 1):
            raise NotImplementedError(
                f"hf.Trainer runs with ParallelismConfig's data-parallel dimensions only, got cp_size={pc.cp_size}, "
                f"tp_size={pc.tp_size}, sp_size={pc.sp_size}: give the context-parallel degree as "
                "hf.Trainer(cp_size=...), and shard with FSDP2 over all ranks (e.g. "
                "ParallelismConfig(dp_shard_size=world_size))")
        if self.args.label_smoothing_factor:
            raise NotImplementedError("hf.Trainer: label smoothing shifts the labels of each rank's shard; set "
                                      "label_smoothing_factor=0")
        if self.compute_loss_func is not None:
            raise NotImplementedError("hf.Trainer: compute_loss_func would see this rank's shard of the logits and "
                                      "labels; the model's own loss is used (with labels shifted on the full "
                                      "sequence)")
        if not self.model_accepts_loss_kwargs:
            raise NotImplementedError("hf.Trainer needs a model whose forward takes the loss keyword arguments "
                                      "(num_items_in_batch): without them each rank's loss is the mean over its own "
                                      "tokens instead of its share of the batch's mean")
        if self.args.n_gpu > 1:
            raise NotImplementedError("hf.Trainer runs one device per process (torchrun), not DataParallel over "
                                      f"{self.args.n_gpu} GPUs")
        if self.args.train_sampling_strategy == "batch_rebalance":
            raise NotImplementedError("hf.Trainer: train_sampling_strategy='batch_rebalance' assigns batches to "
                                      "ranks itself; use 'random', 'sequential' or 'group_by_length'")

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self):
        return self._by_group(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._by_group(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset):
        return self._by_group(super().get_test_dataloader(test_dataset))

    def _by_group(self, loader):
        """``loader`` as accelerate prepared it, with its batches shared over the data-parallel groups
        (process ``dp_rank`` of ``dp_size``) instead of the ranks, so every rank of a context-parallel
        group reads the same batches. Accelerate's shards read these two numbers when iterated."""
        if self.cp_size == 1 or self.accelerator.num_processes == 1:
            return loader
        if isinstance(loader, DataLoaderDispatcher):
            raise NotImplementedError("hf.Trainer: batches dispatched from the main process are split over every "
                                      "rank; pass accelerator_config={'dispatch_batches': False}")
        shards = [s for s in (getattr(loader, name, None) for name in ("batch_sampler", "sampler", "dataset"))
                  if isinstance(s, (BatchSamplerShard, IterableDatasetShard))]
        if not shards:
            raise NotImplementedError(f"hf.Trainer cannot share the batches of {type(loader).__name__} "
                                      f"(dataset {type(getattr(loader, 'dataset', None)).__name__}) over the "
                                      "context-parallel groups: use a map-style dataset or a torch IterableDataset")
        for shard in shards:
            shard.num_processes, shard.process_index = self.dp_size, self.dp_rank
            if self.dp_size == 1 and isinstance(shard, BatchSamplerShard):
                shard.even_batches = False  # one group reads every batch, as one process would: nothing to even out
        return loader

    def get_cp_size(self) -> int:
        """Ranks that read the same batch (the Trainer divides the batch's token count by it)."""
        return self.cp_size

    # ------------------------------------------------------------------ steps
    def context(self, seq_len: int) -> ContextParallel:
        """The group's ContextParallel for sequences of ``seq_len`` tokens (built, collectively over the
        group, the first time a length is met)."""
        return self._contexts.get(seq_len, lambda: ContextParallel(seq_len, mask=self.cp_mask,
                                                                    schedule=self.cp_schedule,
                                                                    group=self._cp_group))

    def _prepare_context_parallel_inputs(self, model, inputs: dict[str, Any]) -> tuple[Callable, dict[str, Any]]:
        """Shard ``inputs`` (one batch of full sequences, the same on every rank of the group) for this
        rank, in place, and return ``(hf.use(cp) factory, inputs)``. The labels are shifted on the full
        sequence first, so a token whose successor lives on another rank keeps its label; padding tokens
        get no label; ``position_ids`` become the tokens' global positions (or their positions in their
        document for packed batches)."""
        tokens = inputs.get("input_ids", inputs.get("inputs_embeds"))
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
            raise ValueError("hf.Trainer: a batch needs input_ids [b, seq] or inputs_embeds [b, seq, hidden]")
        attention_mask = inputs.pop("attention_mask", None)
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("hf.Trainer: attention_mask has padding (zeros), which cpattn does not take: pack the "
                             "sequences without padding (transformers.DataCollatorWithFlattening: each document "
                             "then attends to itself only), or drop attention_mask when every token is real")
        cp = self.context(tokens.shape[1])
        positions = inputs.get("position_ids")
        if positions is not None and not bool((positions == torch.arange(tokens.shape[1],
                                                                          device=positions.device)).all()):
            cp, packed = hf_common.packed(cp, inputs)  # documents: the step's view of cp, with their document mask
            inputs.update(packed)
            positions = cp.shard(packed["position_ids"], dim=1)
        else:
            positions = cp.positions()[None]
        if inputs.get("labels") is not None and self._loss_shifts_labels and "shift_labels" not in inputs:
            inputs["shift_labels"] = hf_common.shift_labels(inputs["labels"])
        for key in PER_TOKEN:
            if isinstance(inputs.get(key), torch.Tensor):
                inputs[key] = cp.shard(inputs[key], dim=1)
        padding = cp.positions().to(tokens.device) < 0
        for key in ("labels", "shift_labels"):
            if inputs.get(key) is not None:
                inputs[key] = inputs[key].masked_fill(padding, hf_common.IGNORE_INDEX)
        inputs["position_ids"] = positions.to(tokens.device)
        if hasattr(getattr(self.model, "config", None), "use_cache"):
            inputs.setdefault("use_cache", False)  # no key/value cache of a whole sequence in training
        self._step_cp = cp
        return functools.partial(hf_common.use, cp), inputs

    # ------------------------------------------------------------------ evaluation
    def prediction_step(self, model, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None):
        """The Trainer's step on this rank's shard; then the loss is the group's (averaged over its ranks,
        whose shares the Trainer scaled by the number of processes) and the logits are the full sequences'
        (``cp.unshard``) on every rank of the group."""
        self._step_cp = None
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        return_loss = inputs.get("return_loss")
        loss_without_labels = not self.label_names and (self.can_return_loss if return_loss is None else return_loss)
        if has_labels or loss_without_labels:  # the Trainer shards the batch through the hook above
            loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        else:  # the Trainer would call the model on the full batch, outside hf.use
            loss, logits, labels = self._predict_without_labels(model, inputs, prediction_loss_only, ignore_keys)
        cp = self._step_cp
        if loss is not None and cp.world_size > 1:
            dist.all_reduce(loss, group=cp.comm.group)
            loss = loss / cp.world_size
        if logits is not None:
            logits = _unshard(cp, logits)
        return loss, logits, labels

    def _predict_without_labels(self, model, inputs, prediction_loss_only, ignore_keys):
        inputs = self._prepare_inputs(inputs)
        if ignore_keys is None:
            ignore_keys = getattr(getattr(self.model, "config", None), "keys_to_ignore_at_inference",
                                  ["past_key_values"])
        context, inputs = self._prepare_context_parallel_inputs(model, inputs)
        with torch.no_grad(), self.compute_loss_context_manager(), context():
            outputs = model(**inputs)
        if prediction_loss_only:
            return None, None, None
        logits = tuple(v for k, v in outputs.items() if k not in ignore_keys) if isinstance(outputs, dict) else outputs
        logits = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in logits)
        return None, logits[0] if len(logits) == 1 else logits, None

    def evaluation_loop(self, *args, **kwargs):
        """The Trainer's loop, gathering one copy of each group's results (:meth:`_gather_groups`)."""
        if self.cp_size == 1:
            return super().evaluation_loop(*args, **kwargs)
        previous = self.gather_function
        self.gather_function = self._gather_groups
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.gather_function = previous

    def _gather_groups(self, data):
        """accelerate's ``gather_for_metrics`` over the data-parallel groups: every rank's tensors
        (concatenated in rank order along dim 0), those of each group's first rank kept, then the
        samples the last batch repeated to even out the groups dropped."""
        gathered = self.accelerator.gather(data)
        world = self.accelerator.num_processes

        def first_of_each_group(t: torch.Tensor) -> torch.Tensor:
            n = t.shape[0] // world
            return torch.cat([t[r * n:(r + 1) * n] for r in range(0, world, self.cp_size)])

        kept = recursively_apply(first_of_each_group, gathered)  # only installed when cp_size > 1
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            kept = recursively_apply(lambda t: t[:state.remainder], kept)
        return kept


def _consecutive_groups(cp_size: int, world: int, rank: int) -> dist.ProcessGroup | None:
    """This rank's group of ``cp_size`` consecutive ranks (None: the whole world, or no process group).
    Every rank creates every group, in the same order, as ``new_group`` requires."""
    if world == 1 or cp_size == world:
        return None
    groups = [dist.new_group(list(range(first, first + cp_size))) for first in range(0, world, cp_size)]
    return groups[rank // cp_size]


def _unshard(cp: ContextParallel, outputs):
    """Each tensor of ``outputs`` (nested tuples) holding this rank's tokens at dim 1 (``[b, local_len,
    ...]``), gathered into the full sequence in token order on every rank; anything else as it is."""
    if isinstance(outputs, torch.Tensor):
        return cp.unshard(outputs, dim=1) if outputs.dim() >= 2 and outputs.shape[1] == cp.local_len else outputs
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_unshard(cp, x) for x in outputs)
    return outputs
