"""Local multi-process launcher: persistent gloo worlds on 127.0.0.1.

A :class:`LocalWorld` starts ``size`` worker processes once (starting a world costs seconds) and then
runs any number of *cases* on them: ``world.run(fn, **kwargs)`` calls the importable, module-level
``fn(**kwargs)`` on every rank and returns the per-rank results. A case that raises on a rank returns
that rank's error; a case that hangs past its timeout, or a worker that dies, shuts the whole world
down and raises :class:`WorldError` with the case's name (and the lost rank), so nothing blocks.

When a worker dies mid-call, the others are usually blocked in a collective with it. The parent notices
the death within :data:`POLL_S`, asks the others to stop, and kills those still running after
``stop_grace`` seconds: every rank has ended about ``stop_grace + POLL_S`` seconds after the death. The
process-group timeout (``pg_timeout``, default :data:`DEFAULT_PG_TIMEOUT_S`) bounds a blocked gloo call
on its own too, in place of gloo's 30-minute default.

A worker whose launcher dies (the parent killed, even by SIGKILL) exits within :data:`PARENT_POLL_S`
(:func:`watch_parent`, which ``python -m cpattn.train`` uses under torchrun too) instead of running on
as an orphan. :meth:`LocalWorld.signal` forwards a signal to every worker (``cpattn train`` forwards
SIGTERM so that the run saves and stops).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import logging
import os
import queue
import signal as signal_mod
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

log = logging.getLogger(__name__)

#: seconds a gloo call of a worker waits for its peers before it fails (gloo's own default is 30 min)
DEFAULT_PG_TIMEOUT_S = 30.0
#: seconds between the parent's checks that every worker is alive
POLL_S = 0.2
#: seconds between a worker's checks that its launcher is alive
PARENT_POLL_S = 0.5
#: exit status of a worker that stopped because its launcher died
PARENT_GONE_EXIT = 75


class WorldError(RuntimeError):
    """A case timed out, or a worker died; the world has been shut down."""


@dataclass
class RankError:
    """What a case raised on one rank."""

    rank: int
    type: str
    message: str
    traceback: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.type}: {self.message}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def watch_parent(parent_pid: int, launcher: str = "launcher", poll_s: float = PARENT_POLL_S) -> threading.Thread | None:
    """Exit this process (status :data:`PARENT_GONE_EXIT`, one line on stderr) within ``poll_s`` of its
    parent ``parent_pid`` dying: an orphan is re-parented, so ``os.getppid()`` changes. A daemon
    thread; None when ``parent_pid`` is not this process's parent (already gone, or init)."""
    if parent_pid <= 1 or os.getppid() != parent_pid:
        return None

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent_pid:
                try:
                    os.write(2, f"worker pid {os.getpid()}: its {launcher} (pid {parent_pid}) is gone; exiting\n"
                             .encode())
                finally:
                    os._exit(PARENT_GONE_EXIT)

    thread = threading.Thread(target=watch, name="cpattn-watch-parent", daemon=True)
    thread.start()
    return thread


def _worker(rank: int, size: int, port: int, threads: int, env: dict, start_timeout: float, pg_timeout: float,
            tasks, results, parent_pid: int = 0) -> None:
    watch_parent(parent_pid, "LocalWorld parent")
    os.environ.update(env)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    # the rendezvous waits up to start_timeout (a loaded machine starts workers slowly); collectives
    # wait up to pg_timeout
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=timedelta(seconds=start_timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=pg_timeout))
    results.put(("ready", rank, None))
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            task_id, path, kwargs = task
            try:
                value = _resolve(path)(**kwargs)
                results.put((task_id, rank, ("ok", value)))
            except BaseException as exc:  # report to the parent; the world stays usable
                results.put((task_id, rank, ("error", RankError(rank, type(exc).__name__, str(exc),
                                                                 traceback.format_exc()))))
    finally:
        dist.destroy_process_group()


class LocalWorld:
    """``size`` gloo processes on this machine, each with ``threads`` torch threads and ``env`` added to
    its environment.

    ``start_timeout``: seconds to wait for every worker to join the world. ``pg_timeout``: seconds a
    worker's gloo call waits for its peers before it fails (:data:`DEFAULT_PG_TIMEOUT_S`). ``stop_grace``:
    seconds the workers get to exit on their own when the world shuts down (after a case timed out, a
    worker died, or :meth:`close`) before they are killed."""

    def __init__(self, size: int, threads: int = 1, env: dict[str, str] | None = None,
                 start_timeout: float = 120.0, pg_timeout: float = DEFAULT_PG_TIMEOUT_S,
                 stop_grace: float = 3.0) -> None:
        if size < 1:
            raise ValueError(f"world size must be >= 1, got {size}")
        if not pg_timeout > 0 or not stop_grace >= 0:
            raise ValueError(f"pg_timeout must be > 0 and stop_grace >= 0, got {pg_timeout} and {stop_grace}")
        self.size, self.threads = size, threads
        self.pg_timeout, self.stop_grace = float(pg_timeout), float(stop_grace)
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(size)]
        self._results = ctx.Queue()
        self._ids = itertools.count()
        port = free_port()
        self._procs = [ctx.Process(target=_worker, args=(r, size, port, threads, dict(env or {}), start_timeout,
                                                         self.pg_timeout, self._tasks[r], self._results, os.getpid()),
                                   daemon=True)
                       for r in range(size)]
        for p in self._procs:
            p.start()
        ready: set[int] = set()
        deadline = time.monotonic() + start_timeout
        while len(ready) < size:
            ready.add(self._get(deadline, f"starting a {size}-rank world")[1])
        self.alive = True

    def _get(self, deadline: float, what: str):
        while True:
            try:
                return self._results.get(timeout=POLL_S)
            except queue.Empty:
                pass
            dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]
            if dead:
                self.close()
                lost = ", ".join(f"rank {r} exited with code {code}" for r, code in dead)
                raise WorldError(f"{what}: worker {lost}; all workers of the {self.size}-rank world were stopped")
            if time.monotonic() > deadline:
                self.close()
                raise WorldError(f"{what}: timed out; all workers of the {self.size}-rank world were stopped")

    def run(self, fn: str | Any, timeout: float = 120.0, name: str | None = None, **kwargs) -> list[Any]:
        """Run ``fn(**kwargs)`` on every rank; returns per-rank values (or :class:`RankError`)."""
        if not self.alive:
            raise WorldError("this world was shut down; start a new one")
        path = fn if isinstance(fn, str) else f"{fn.__module__}.{fn.__qualname__}"
        task_id = next(self._ids)
        for q in self._tasks:
            q.put((task_id, path, kwargs))
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(out) < self.size:
            tid, rank, (status, value) = self._get(deadline, f"case {name or path!r}")
            if tid == task_id:
                out[rank] = value
        return [out[r] for r in range(self.size)]

    def signal(self, sig: int = signal_mod.SIGTERM) -> None:
        """Send ``sig`` to every live worker (e.g. SIGTERM: ``cpattn.train.run_rank`` then saves and
        returns after the step in progress)."""
        for p in self._procs:
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, sig)

    def close(self) -> None:
        if not getattr(self, "alive", True) and not any(p.is_alive() for p in self._procs):
            return
        self.alive = False
        for q in self._tasks:
            with contextlib.suppress(Exception):  # a broken queue: the process is terminated below anyway
                q.put_nowait(None)
        deadline = time.monotonic() + self.stop_grace
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
