"""Hugging Face trainers with context-parallel attention: :func:`context_parallel` turns a trainer class
(``transformers.Trainer``, TRL's ``SFTTrainer``, a user's subclass of either) into one whose model attends
through cpattn; ``cpattn.integrations.hf.Trainer`` is ``context_parallel(transformers.Trainer)``.

::

    hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="cpattn")
    trainer = hf.Trainer(model=model, args=TrainingArguments(...), train_dataset=data, eval_dataset=held_out,
                         cp_size=2, cp_schedule="zigzag_ring")
    trainer.train()            # torchrun --nproc-per-node 4 train.py: 2 data-parallel groups of 2 ranks
    trainer.evaluate()

    SFTTrainer = hf.context_parallel(trl.SFTTrainer)     # or TrainingArguments(parallelism_config=
    trainer = SFTTrainer(model=model, args=SFTConfig(..., parallelism_config=ParallelismConfig(cp_size=2)), ...)

The context-parallel degree is ``cp_size=`` or accelerate's ``ParallelismConfig(cp_size=...)`` (in the
arguments or in accelerate's ``PARALLELISM_CONFIG_*`` environment variables), which is taken out of the
configuration before the ``Accelerator`` is built, so accelerate's own (torch) context parallelism never runs.
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
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import transformers
from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard
from accelerate.utils import recursively_apply

from ..api import ContextParallel
from ..core import masks as masks_mod
from ..core.comm import HeldGroup
from ..core.memo import BoundedCache
from ..schedules import Schedule
from ..schedules import resolve as resolve_schedule
from . import hf_common

logger = logging.getLogger(__name__)
#: ContextParallel objects kept, one per sequence length met (each costs one small exchange to build)
CONTEXTS_KEPT = 8
#: per-token tensors of a batch that are sharded along the sequence (dim 1)
PER_TOKEN = ("input_ids", "inputs_embeds", "labels", "shift_labels", "token_type_ids")
#: keys of a packed batch (transformers' ``return_flash_attn_kwargs``, TRL's ``padding_free``) that the step's
#: document view replaces: checked against its positions, then left out of the model's inputs
PACKED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


class ContextParallelTrainer:
    """What :func:`context_parallel` adds to a ``transformers.Trainer`` class: its model attends through
    cpattn over groups of ``cp_size`` ranks.

    ``cp_size``: ranks per context-parallel group (consecutive ranks; the world size must be a multiple);
    the ``world / cp_size`` groups are the data-parallel replicas. Left out, it is the ``cp_size`` of
    ``args.parallelism_config`` (or of accelerate's ``PARALLELISM_CONFIG_*`` environment variables), else 1;
    given both, they must agree. That configuration loses its ``cp_size`` before the ``Accelerator`` is built
    (:func:`take_context_parallel`). ``cp_schedule``: a schedule name, ``"auto"`` or a
    :class:`cpattn.schedules.Schedule`. ``cp_mask``: the attention mask of every sequence (``"causal"``,
    ``"full"`` or a :class:`cpattn.masks.Mask`). Packed batches (``DataCollatorWithFlattening``:
    ``position_ids`` restarting at 0 in each document) run on the step's document view of it
    (:func:`cpattn.integrations.hf.packed`), and so do TRL's ``padding_free`` batches (their
    ``cu_seq_lens_q/k``, ``max_length_q/k`` and ``seq_idx`` are checked and consumed); right-padded rows (a
    0/1 ``attention_mask``) are packed by the step: their real tokens in one row, each row a document.
    Every other argument is the Trainer's.

    The model must be built with ``attn_implementation="cpattn"`` (after ``hf.register()``) and take
    the loss keyword arguments (``num_items_in_batch``, as transformers' models do). What would make a
    rank's loss other than its share of the batch's mean raises ``NotImplementedError`` at construction
    (label smoothing, ``compute_loss_func``, ``ParallelismConfig``'s tensor or sequence parallelism), or when
    a data loader is built (batches dispatched from the main process).
    """

    #: this rank's context-parallel group (None: the whole world), held weakly (HeldGroup)
    _cp_group = HeldGroup()


    def __init__(self, *args, cp_size: int | None = None, cp_schedule: str | Schedule = "zigzag_ring",
                 cp_mask: masks_mod.Mask | str = "causal", **kwargs) -> None:
        if cp_size is not None and (isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1):
            raise ValueError(f"cp_size must be a positive int (ranks per context-parallel group), got {cp_size!r}")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        self.cp_size = take_context_parallel(training_args, cp_size)
        self.cp_mask = masks_mod.resolve(cp_mask)
        if cp_schedule != "auto":
            resolve_schedule(cp_schedule).check_mask(self.cp_mask)
        self.cp_schedule = cp_schedule
        hf_common.register()
        super().__init__(*args, **kwargs)
        self._check_setup()
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        #: the data-parallel group of this rank and the number of groups
        self.dp_rank, self.dp_size = rank // self.cp_size, world // self.cp_size
        self._cp_group = _consecutive_groups(self.cp_size, world, rank)
        self._contexts = BoundedCache(CONTEXTS_KEPT)
        self._step_cp: ContextParallel | None = None  # the ContextParallel of the batch being run
        self._step_tokens = torch.zeros((), dtype=torch.long)  # the group's real tokens of the batch (TRL's num_tokens)
        self._step_labelled: torch.Tensor | None = None  # this rank's labelled tokens of the batch being run
        self._own_step = self._reentered = False  # inside a subclass's prediction_step (prediction_step below)
        self._logged = False

    # ------------------------------------------------------------------ checks
    def _check_setup(self) -> None:
        """Refuse, before any communication and alike on every rank, what would give another loss or
        gradient than the model trained on the whole sequences by one process."""
        config = getattr(self.model, "config", None)
        impl = getattr(config, "_attn_implementation", None)
        if config is not None and impl != hf_common.NAME:
            raise ValueError(f"{type(self).__name__} needs a model built with attn_implementation={hf_common.NAME!r} "
                             f"(after cpattn.integrations.hf.register()), got {impl!r}: its attention would see this "
                             "rank's tokens only. Build it with from_config(config, attn_implementation='cpattn') or "
                             "from_pretrained(name, attn_implementation='cpattn'), call "
                             "model.set_attn_implementation('cpattn'), or give TRL "
                             "model_init_kwargs={'attn_implementation': 'cpattn'}")
        if self.accelerator.num_processes % self.cp_size:
            raise ValueError(f"cp_size={self.cp_size} does not divide the {self.accelerator.num_processes} "
                             "processes: the ranks form groups of cp_size consecutive ranks")
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is not None and (pc.cp_size > 1 or pc.tp_size > 1 or pc.sp_size > 1):
            raise NotImplementedError(_UNSUPPORTED_DIMS.format(cls=type(self).__name__, tp=pc.tp_size, sp=pc.sp_size)
                                      + f" (the accelerator has cp_size={pc.cp_size})")
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
        if self._own_step:  # a prediction_step of a subclass, already sharded by prediction_step below
            self._reentered = True
            return functools.partial(hf_common.use, self._step_cp), inputs
        tokens = inputs.get("input_ids", inputs.get("inputs_embeds"))
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
            raise ValueError("hf.Trainer: a batch needs input_ids [b, seq] or inputs_embeds [b, seq, hidden]")
        attention_mask = inputs.pop("attention_mask", None)
        # the group's real tokens, as TRL counts them: the attention mask's ones, else the packed row
        self._step_tokens = attention_mask.sum() if attention_mask is not None else torch.tensor(tokens.shape[1])
        if attention_mask is not None and not bool(attention_mask.all()):
            inputs = _pack_rows(inputs, attention_mask)  # right-padded rows: their real tokens, one document each
            tokens = inputs["input_ids"]
        positions = inputs.get("position_ids")
        if positions is None and any(inputs.get(key) is not None for key in PACKED_KEYS):
            raise ValueError(f"hf.Trainer: a packed batch ({', '.join(k for k in PACKED_KEYS if k in inputs)}) needs "
                             "position_ids restarting at 0 in each document")
        cp = self.context(tokens.shape[1])
        if positions is not None and not bool((positions == torch.arange(tokens.shape[1],
                                                                          device=positions.device)).all()):
            cp, packed = hf_common.packed(cp, inputs)  # documents: the step's view of cp, with their document mask
            inputs.update(packed)
            positions = cp.shard(packed["position_ids"], dim=1)
        else:
            positions = cp.positions()[None]
        for key in PACKED_KEYS:  # checked by packed() (cu_seq_lens) or implied by the documents: the view replaces them
            inputs.pop(key, None)
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
        labelled = inputs.get("shift_labels", inputs.get("labels"))
        # kept on the device (read by an evaluation step only): no host sync in a training step
        self._step_labelled = (labelled != hf_common.IGNORE_INDEX).sum() if labelled is not None else None
        if hasattr(getattr(self.model, "config", None), "use_cache"):
            inputs.setdefault("use_cache", False)  # no key/value cache of a whole sequence in training
        self._step_cp = cp
        if not self._logged:
            self._logged = True
            if self.accelerator.is_main_process:
                logger.info("cpattn context parallelism: %d data-parallel group(s) of %d ranks, schedule %s, mask %s "
                            "(this step: %s)", self.dp_size, self.cp_size, cp.schedule_name, self.cp_mask.name,
                            cp.mask.name)
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
        own_step = type(self)._base_prediction_step() is not transformers.Trainer.prediction_step
        local_mean = False  # whether the loss is the mean over this rank's labelled tokens
        if (has_labels or loss_without_labels) and own_step:  # e.g. TRL's: it calls compute_loss without the hook
            inputs = self._prepare_inputs(inputs)
            context, inputs = self._prepare_context_parallel_inputs(model, inputs)
            self._own_step, self._reentered = True, False
            try:
                with context():
                    loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
            finally:
                self._own_step = False
            local_mean = not self._reentered  # the hook not called again: no num_items_in_batch either
        elif has_labels or loss_without_labels:  # the Trainer shards the batch through the hook above
            loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        else:  # the Trainer would call the model on the full batch, outside hf.use
            loss, logits, labels = self._predict_without_labels(model, inputs, prediction_loss_only, ignore_keys)
        cp = self._step_cp
        if loss is not None and cp.world_size > 1 and local_mean:  # the group's mean: weighted by the counts
            count = torch.zeros((), dtype=loss.dtype, device=loss.device) if self._step_labelled is None \
                else self._step_labelled.to(device=loss.device, dtype=loss.dtype)
            both = torch.stack([loss.detach().reshape(()) * count, count])
            dist.all_reduce(both, group=cp.comm.group)
            loss = both[0] / both[1].clamp(min=1)
        elif loss is not None and cp.world_size > 1:
            dist.all_reduce(loss, group=cp.comm.group)
            loss = loss / cp.world_size
        if logits is not None:
            logits = _unshard(cp, logits)
        return loss, logits, labels

    @classmethod
    def _base_prediction_step(cls):
        """The ``prediction_step`` this class's base trainer runs."""
        return super().prediction_step

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The base trainer's loss. TRL's ``SFTTrainer`` sums its metrics (token accuracy, entropy) over the
        ranks with ``gather_for_metrics``, which at the end of a data loader with a partial last batch keeps
        as many ranks' values as the batch has samples: here every rank's value is kept (the ranks of a group
        hold parts of the same samples). It counts the tokens of every rank's shard in its logged
        ``num_tokens`` (the layout's padding included); they are counted here once per group's batch."""
        before = getattr(self, "_total_train_tokens", None)
        accelerator = self.accelerator
        if self.cp_size > 1:
            accelerator.gather_for_metrics = lambda data, use_gather_object=False: accelerator.gather(data)
        try:
            result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)
        finally:
            accelerator.__dict__.pop("gather_for_metrics", None)
        metrics = getattr(self, "_metrics", None)
        if before is not None and isinstance(metrics, dict) and "train" in metrics and self.model.training:
            count = accelerator.gather(self._step_tokens.to(accelerator.device)).sum().item()
            self._total_train_tokens = before + count // self.cp_size
            metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return result

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


_UNSUPPORTED_DIMS = ("{cls} runs cpattn's context parallelism with data parallelism (ParallelismConfig's "
                     "dp_replicate_size and dp_shard_size, and cp_size) only, got tp_size={tp}, sp_size={sp}: "
                     "set tp_size=1 and sp_size=1")


def take_context_parallel(args, cp_size: int | None) -> int:
    """The context-parallel degree of a trainer given ``cp_size`` and training arguments ``args``, whose
    ``parallelism_config`` (else accelerate's ``PARALLELISM_CONFIG_*`` environment variables, when
    ``ACCELERATE_USE_PARALLELISM_CONFIG`` is true) may hold it; raises when both give one and they differ,
    or when tensor or sequence parallelism is asked for. Takes it out of that configuration, before the
    ``Accelerator`` is built, so accelerate (and TRL's checks) never see context parallelism: on a CPU no
    ``ParallelismConfig`` remains (data parallel over the CP groups); on GPUs the CP ranks join
    ``dp_shard`` (FSDP2 over ``dp_shard x cp`` ranks, the mesh accelerate would shard over)."""
    given = getattr(args, "parallelism_config", None)
    from_env = os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true"
    if given is None and not from_env:
        return cp_size or 1
    from accelerate import ParallelismConfig

    config = given if given is not None else ParallelismConfig()
    if config.tp_size > 1 or config.sp_size > 1:
        raise NotImplementedError(_UNSUPPORTED_DIMS.format(cls="context_parallel", tp=config.tp_size,
                                                           sp=config.sp_size))
    if config.cp_size > 1 and cp_size is not None and cp_size != config.cp_size:
        raise ValueError(f"cp_size={cp_size} disagrees with ParallelismConfig(cp_size={config.cp_size}): give the "
                         "context-parallel degree once (either is enough)")
    size = config.cp_size if config.cp_size > 1 else (cp_size or 1)
    if config.cp_size == 1 and given is not None:
        return size  # nothing to take out: data-parallel dimensions only (accelerate checks them)
    on_cpu = bool(getattr(args, "use_cpu", False)) or not torch.cuda.is_available()
    kept = None if on_cpu else ParallelismConfig(
        dp_replicate_size=config.dp_replicate_size, dp_shard_size=config.dp_shard_size * config.cp_size,
        tp_size=1, cp_size=1, sp_size=1)
    if args is not None:
        args.parallelism_config = kept
    if from_env and kept is None:
        os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "false"  # accelerate would rebuild it from the environment
    elif from_env:
        os.environ["PARALLELISM_CONFIG_CP_SIZE"] = "1"
        os.environ["PARALLELISM_CONFIG_DP_SHARD_SIZE"] = str(kept.dp_shard_size)
    return size


def _pack_rows(inputs: dict[str, Any], attention_mask: torch.Tensor) -> dict[str, Any]:
    """A batch of right-padded rows (``attention_mask [b, S]``: each row's ones, then zeros) as one packed
    row of their real tokens, each row a document (``position_ids`` restarting at 0; its first label
    ignored, as a row's first token is never predicted). Any other padding raises."""
    b, width = attention_mask.shape
    lengths = attention_mask.sum(1)
    right = torch.arange(width, device=attention_mask.device)[None] < lengths[:, None]
    if not bool((attention_mask.bool() == right).all()):
        raise ValueError("hf.Trainer: attention_mask has padding (zeros) that is not right padding, which cpattn does "
                         "not take: pad on the right (padding_side='right'), or pack the sequences without padding "
                         "(transformers.DataCollatorWithFlattening, TRL's padding_free=True: each document then "
                         "attends to itself only)")
    out = dict(inputs)
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(width, device=attention_mask.device).expand(b, width)
    if out.get("labels") is not None:
        out["labels"] = out["labels"].clone()
        out["labels"][:, 0] = hf_common.IGNORE_INDEX
    for key in (*PER_TOKEN, "position_ids"):
        value = out.get(key)
        if isinstance(value, torch.Tensor) and tuple(value.shape[:2]) == (b, width):
            out[key] = value[right][None]
    return out


_CLASSES: dict[type, type] = {}


def context_parallel(trainer_class: type) -> type:
    """``trainer_class`` (``transformers.Trainer`` or a subclass: TRL's ``SFTTrainer``, a user's own) with
    cpattn's context parallelism: a subclass taking ``cp_size=``, ``cp_schedule=`` and ``cp_mask=`` besides
    its own arguments (:class:`ContextParallelTrainer`), or reading ``cp_size`` from
    ``args.parallelism_config``. The same class for the same argument; a class that already has it is
    returned as it is::

        SFTTrainer = hf.context_parallel(trl.SFTTrainer)
        trainer = SFTTrainer(model=model, args=SFTConfig(..., parallelism_config=ParallelismConfig(cp_size=2)),
                             train_dataset=data, processing_class=tokenizer)
    """
    if not isinstance(trainer_class, type) or not issubclass(trainer_class, transformers.Trainer):
        raise TypeError(f"context_parallel takes transformers.Trainer or a subclass of it, got {trainer_class!r}")
    if issubclass(trainer_class, ContextParallelTrainer):
        return trainer_class
    if trainer_class not in _CLASSES:
        _CLASSES[trainer_class] = type(trainer_class.__name__, (ContextParallelTrainer, trainer_class),
                                       {"__module__": trainer_class.__module__,
                                        "__qualname__": trainer_class.__qualname__,
                                        "__doc__": f"{trainer_class.__name__} with cpattn's context parallelism "
                                                   "(cpattn.integrations.hf.context_parallel)."})
    return _CLASSES[trainer_class]


class Trainer(ContextParallelTrainer, transformers.Trainer):
    """``transformers.Trainer`` whose model attends through cpattn over groups of ``cp_size`` ranks
    (``context_parallel(transformers.Trainer)``; see :class:`ContextParallelTrainer`)."""


_CLASSES[transformers.Trainer] = Trainer
