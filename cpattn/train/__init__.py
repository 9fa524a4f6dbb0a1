"""Training end to end: a reference model on a ("dp", "cp") DeviceMesh, one rank's part of the loop.

``python -m cpattn.train ...`` runs it under torchrun (``torchrun --nproc-per-node N -m cpattn.train``);
``cpattn train --nproc N ...`` runs the same function on N local processes (:mod:`cpattn.launcher`).

The world is a 2-D mesh ``(dp, cp)`` from ``init_device_mesh``: each context-parallel group (a row of
the mesh) splits every sequence of its share of the batch across its ranks with
:class:`cpattn.ContextParallel`; the dp groups split the batch. The state is sharded with FSDP2 over
the flattened dp x cp mesh, or replicated (:mod:`cpattn.train.sharding`).

Exactness across meshes. Every rank builds the same global batch for step t (a pure function of the
seed and t for the synthetic tasks; the text packer's position, saved with each checkpoint, for
``data``), keeps its dp rows and its cp tokens, and computes the *sum* of its tokens' losses and their
count. The loss is the mean over every token of the global batch: each rank divides its sum by the
global count (one all-reduce), so that summing every rank's parameter gradients over the whole world
(dp and cp together: a CP rank's gradient covers only its own tokens' share; FSDP2 is told to sum, not
average) gives exactly the gradient of the global mean. So a run at any (dp, cp), sharded or not and
with any schedule, follows the one-process run up to rounding.

The modules, each importing only those listed before it: :mod:`~cpattn.train.config` (the run),
:mod:`~cpattn.train.world` (mesh, device, peak), :mod:`~cpattn.train.tasks` (model, data, loss),
:mod:`~cpattn.train.sharding` (FSDP2 or replicated state), :mod:`~cpattn.train.checks` (checks before
start-up, checkpoint look-ups), :mod:`~cpattn.train.report` (lines, progress, table, plot),
:mod:`~cpattn.train.loop` (one rank's loop) and :mod:`~cpattn.train.cli_args` (the options, the
torchrun entry).
"""

from .checks import check_schedule, latest_checkpoint, preflight, text_position
from .cli_args import add_arguments, build_parser, config_from_args, main
from .config import DEFAULT_SCHEDULE, DTYPES, MASK_TASKS, MODELS, TASKS, TrainConfig
from .loop import STATUS_ENV, TrainingStopped, evaluate, run_rank
from .report import evaluation_line, plot_losses, results_table, run_label
from .sharding import parallelize, state_bytes
from .tasks import EVAL_BATCH, FIELD_SAMPLES, FIELD_STEPS
from .world import PEAK_MATMUL_N, matmul_peak, mesh, world_peak

__all__ = ["DEFAULT_SCHEDULE", "DTYPES", "EVAL_BATCH", "FIELD_SAMPLES", "FIELD_STEPS", "MASK_TASKS", "MODELS",
           "PEAK_MATMUL_N", "STATUS_ENV", "TASKS", "TrainConfig", "TrainingStopped", "add_arguments", "build_parser",
           "check_schedule", "config_from_args", "evaluate", "evaluation_line", "latest_checkpoint", "main",
           "matmul_peak", "mesh", "parallelize", "plot_losses", "preflight", "results_table", "run_label", "run_rank",
           "state_bytes", "text_position", "world_peak"]
