"""The default process group under torchrun (``python -m torch.distributed.run``).

:func:`init` reads the environment torchrun sets for every worker (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), picks the backend (NCCL when CUDA is available,
else gloo), and sets the process-group timeout: how long a collective waits for the other ranks
before it fails. The default, :data:`DEFAULT_TIMEOUT_S` (120 s), is far below the backends' own
(30 minutes for gloo, 10 for NCCL) so that a rank stuck on a dead peer fails in minutes, and far
above the longest wait a healthy run has inside cpattn: group rank 0 builds an UltraAttn plan
(``PlanOptions.time_budget``, 15 s by default) while the other ranks wait for it. Set
``$CPATTN_PG_TIMEOUT_S`` (seconds) to change it without editing the script, e.g. for longer plan
budgets. Local worlds without torchrun: :mod:`cpattn.launcher`.

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

log = logging.getLogger(__name__)

#: seconds a collective waits for the other ranks before it fails (see the module docstring)
DEFAULT_TIMEOUT_S = 120.0
#: environment variable that overrides :data:`DEFAULT_TIMEOUT_S` (seconds)
TIMEOUT_ENV = "CPATTN_PG_TIMEOUT_S"
#: what torchrun sets for each worker and :func:`init` needs
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
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


def _env_int(name: str) -> int:
    text = os.environ[name]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {text!r}") from None


def init(backend: str | None = None, timeout_s: float | None = None) -> tuple[int, int, int, torch.device]:
    """Initialise the default process group from the torchrun environment; returns
    ``(rank, world_size, local_rank, device)``.

    ``backend``: ``"nccl"`` or ``"gloo"``; None picks NCCL when CUDA is available (and then uses GPU
    ``local_rank``, via ``torch.cuda.set_device``), else gloo on the CPU. ``timeout_s``: see
    :func:`timeout_seconds`. When the default group already exists (initialised by this function or
    the caller), nothing is changed and its figures are returned.

    Raises RuntimeError when the torchrun variables are missing, ValueError on a bad backend, timeout
    or variable.
    """
    missing = [name for name in TORCHRUN_ENV if not os.environ.get(name)]
    if missing:
        raise RuntimeError(f"cpattn.distributed.init needs the torchrun environment, but {', '.join(missing)} "
                           f"{'is' if len(missing) == 1 else 'are'} not set: launch the script with torchrun "
                           "(`torchrun --nproc-per-node N script.py` or `python -m torch.distributed.run ...`), "
                           "or run functions on a local world with cpattn.launcher.LocalWorld")
    rank, world, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
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
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=seconds))
    global _created
    if not _created:  # once per process, however many times a group is made and destroyed
        atexit.register(_at_exit)
    _created = True
    log.info("rank %d of %d (local rank %d): %s on %s, timeout %.0f s", rank, world, local_rank, backend, device,
             seconds)
    return rank, world, local_rank, device


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


__all__ = ["BACKENDS", "DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "TORCHRUN_ENV", "init", "shutdown", "timeout_seconds"]
