"""The default process group of a launched world: torchrun, SLURM's ``srun`` or ``mpirun``.

:func:`init` reads the environment the launcher set for this process (:func:`launch_env`, the one
parser of launcher variables, in :mod:`cpattn.core.launch`), picks the backend (NCCL when CUDA is
available, else gloo), and sets the process-group timeout: how long a collective waits for the other
ranks before it fails. The default, :data:`DEFAULT_TIMEOUT_S` (120 s), is far below the backends' own
(30 minutes for gloo, 10 for NCCL) so that a rank stuck on a dead peer fails in minutes, and far
above the longest wait a healthy run has inside cpattn: group rank 0 builds an UltraAttn plan
(``PlanOptions.time_budget``, 15 s by default) while the other ranks wait for it. Set
``$CPATTN_PG_TIMEOUT_S`` (seconds) to change it without editing the script, e.g. for longer plan
budgets. Local worlds without a launcher: :mod:`cpattn.launcher`.

Launchers (rank, world size, local rank: the GPU a rank takes; rank 0's address and port):

- **torchrun** (one node or ``--nnodes N``): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT`` (``LOCAL_WORLD_SIZE`` checked when set). All five are needed.
- **SLURM** ``srun`` (one task per GPU, e.g. ``srun --ntasks-per-node 4 python train.py``; a step is
  recognised by ``SLURM_STEP_ID``): ``SLURM_PROCID``, ``SLURM_LOCALID``, the step's task count
  ``SLURM_STEP_NUM_TASKS`` (the allocation's ``SLURM_NTASKS`` only when the step has none); the address is
  the first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``) in any of SLURM's forms
  (``node[01-04,07]`` -> ``node01``, ``a,b`` -> ``a``, ``gpu-[3,5-6]`` -> ``gpu-3``, zero padding kept); the
  port is 15000 + ``SLURM_JOB_ID`` mod 16000. An ``sbatch`` script's own shell (``SLURM_JOB_ID`` and the
  like, no ``srun`` step) is not a launch: start the ranks with ``srun`` inside it.
- **mpirun**: Open MPI's ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``, or MPICH's
  (and Intel MPI's) ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID`` (``MPI_LOCALNRANKS``). On one host (the
  local size equals the world size) the address is 127.0.0.1; across hosts set ``MASTER_ADDR`` to rank 0's
  host for every process (``mpirun -x MASTER_ADDR=host0`` for Open MPI, ``-genv MASTER_ADDR host0`` for
  MPICH). The port is 29500.

A user's ``MASTER_ADDR`` and ``MASTER_PORT`` always win over derived ones. When several launchers' variables
are set, the innermost wins: torchrun (e.g. one torchrun agent per node started by ``srun``), then
``mpirun`` (whose daemons ``srun`` may start), then ``srun``. A partial or contradictory set (``WORLD_SIZE``
without ``RANK``, ``RANK=3`` with ``WORLD_SIZE=2``, a nodelist that does not parse) is one ValueError
naming the variables and their launcher. Without a process group, ``ContextParallel`` and the
``*_attn_func`` entry points refuse to run when a launcher says the world has more than one process
(:func:`cpattn.core.launch.no_group_error`): call :func:`init` first.

A group that :func:`init` created is destroyed at interpreter exit (an ``atexit`` hook, :func:`shutdown`)
unless the script destroyed it first, so a script that raises, or never calls
``destroy_process_group()``, exits with its own error and exit code: the backend's threads are stopped
while Python is still whole, not torn down after it (where gloo could abort the process,
"terminate called without an active exception", SIGABRT).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from .core.launch import TORCHRUN_ENV, Launch, launch_env

log = logging.getLogger(__name__)

#: seconds a collective waits for the other ranks before it fails (see the module docstring)
DEFAULT_TIMEOUT_S = 120.0
#: environment variable that overrides :data:`DEFAULT_TIMEOUT_S` (seconds)
TIMEOUT_ENV = "CPATTN_PG_TIMEOUT_S"
BACKENDS = ("gloo", "nccl")


def timeout_seconds(timeout_s: float | None = None) -> float:
    """``timeout_s``, else ``$CPATTN_PG_TIMEOUT_S``, else :data:`DEFAULT_TIMEOUT_S` (seconds, > 0)."""
    where = "timeout_s"
    if timeout_s is None:
        text = os.environ.get(TIMEOUT_ENV)
        if not text:
            return DEFAULT_TIMEOUT_S
        where = f"${TIMEOUT_ENV}"
        try:
            timeout_s = float(text)
        except ValueError:
            raise ValueError(f"{where} must be a number of seconds, got {text!r}") from None
    if not timeout_s > 0 or timeout_s == float("inf"):
        raise ValueError(f"{where} must be a finite number of seconds > 0, got {timeout_s!r}")
    return float(timeout_s)


def init(backend: str | None = None, timeout_s: float | None = None) -> tuple[int, int, int, torch.device]:
    """Initialise the default process group from the launcher's environment (torchrun, ``srun`` or
    ``mpirun``: see the module docstring); returns ``(rank, world_size, local_rank, device)``.

    ``backend``: ``"nccl"`` or ``"gloo"``; None picks NCCL when CUDA is available (and then uses GPU
    ``local_rank``, via ``torch.cuda.set_device``), else gloo on the CPU. ``timeout_s``: see
    :func:`timeout_seconds`. When the default group already exists (initialised by this function or
    the caller), nothing is changed and its figures are returned.

    Raises RuntimeError when no launcher started the process, ValueError on a partial or contradictory
    set of launcher variables, a bad backend or timeout.
    """
    launch = launch_env(os.environ)
    if launch is None:
        raise RuntimeError(f"cpattn.distributed.init needs a launcher's environment, but {', '.join(TORCHRUN_ENV)} "
                           "are not set (torchrun), nor is this an srun step or an mpirun process: launch the "
                           "script with torchrun (`torchrun --nproc-per-node N script.py` or `python -m "
                           "torch.distributed.run ...`), srun or mpirun, or run functions on a local world with "
                           "cpattn.launcher.LocalWorld")
    rank, world, local_rank = launch.rank, launch.world_size, launch.local_rank
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; accepted: {', '.join(BACKENDS)}")
    if backend == "nccl" and not cuda:
        raise ValueError("backend='nccl' needs CUDA, which is not available here; use 'gloo'")
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), local_rank, device
    seconds = timeout_seconds(timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=_init_method(launch), rank=rank, world_size=world,
                            timeout=timedelta(seconds=seconds))
    global _created
    if not _created:  # once per process, however many times a group is made and destroyed
        atexit.register(_at_exit)
    _created = True
    log.info("rank %d of %d (local rank %d, %s, rendezvous %s:%d): %s on %s, timeout %.0f s", rank, world,
             local_rank, launch.launcher, launch.master_addr, launch.master_port, backend, device, seconds)
    return rank, world, local_rank, device


def _init_method(launch: Launch) -> str:
    """torchrun's workers join its agent's store (``env://`` reads the variables torchrun set); the other
    launchers' rank 0 opens the store at the launch's address."""
    if launch.launcher == "torchrun":
        return "env://"
    host = f"[{launch.master_addr}]" if ":" in launch.master_addr else launch.master_addr
    return f"tcp://{host}:{launch.master_port}"


#: whether :func:`init` created a default group in this process (its exit hook is then registered)
_created = False


def shutdown(failed: bool = False) -> bool:
    """Destroy the default process group and every group made from it, if one exists; returns whether
    there was one. Safe to call more than once, or after ``destroy_process_group()``.

    ``failed``: the process is exiting on an error. Its peers may still be inside a collective with
    it, so an NCCL group is aborted (local, never waits for them) instead of destroyed (which may);
    gloo's shutdown is local either way."""
    if not dist.is_initialized():
        return False
    if failed and dist.get_backend() == "nccl":
        from torch.distributed import distributed_c10d

        distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()
    return True


def _at_exit() -> None:
    """The ``atexit`` hook :func:`init` registers: :func:`shutdown`, never raising (an exit must keep the
    script's own error and status)."""
    failed = getattr(sys, "last_value", None) is not None  # set when an uncaught exception ends the script
    try:
        if shutdown(failed):
            log.info("destroyed the default process group at exit%s", " after an error" if failed else "")
    except Exception as exc:  # a hook that raises would only add noise after the script's own error
        log.warning("could not destroy the process group at exit: %s", exc)


__all__ = ["BACKENDS", "DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "TORCHRUN_ENV", "Launch", "init", "launch_env", "shutdown",
           "timeout_seconds"]
