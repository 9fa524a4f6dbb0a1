"""Transfers of a gloo group staged through host buffers, so that P ranks can share one GPU.

NCCL refuses two ranks on one CUDA device, and gloo cannot move CUDA tensors point to point (it hands
the device pointer to its socket). So on a gloo group the communicator (:mod:`cpattn.core.comm`) runs
every call on CUDA tensors through host buffers instead:

- at issue, each tensor the call reads is copied device -> host into a buffer of this module's
  :class:`StagingPool`, and the copy is waited for (an event on the copying stream, not the whole
  device) before gloo reads the buffer; gloo then runs on host tensors only;
- at ``wait()``, once gloo is done, each tensor the call writes is copied host -> device (on the
  current stream, so later kernels see it) and the call's buffers go back to the pool.

Every call is staged, the collectives too: gloo's own CUDA collectives copy through host tensors they
allocate on each call, while the pool's buffers are reused, so a steady-state call allocates nothing.

The pool is keyed by *in-flight slot*: a call takes the lowest free slots, one per tensor, and gives
them back at its ``wait``. A rank runs the same program every call, so a given slot serves the same
transfers every time and, once grown to the largest of them, is never reallocated; two buffers of the
same shape in flight together (a ring's kv and dkv) get two slots. On a GPU the buffers are pinned (the
copies are then asynchronous DMA); forced on CPU tensors they are plain host memory.

Forcing: ``CPATTN_STAGE=1`` (:data:`STAGE_ENV`), or ``Communicator(stage=True)``, stages CPU tensors
too, so this path runs in the CPU test suite. With the communicator's poison switch
(``CPATTN_POISON_BUFFERS=1``, set by the tests), a buffer given back is overwritten with all bits set
(NaN in every floating format, -1 in integers), so a use after release fails a test. ``docs/one_gpu.md``
tells the whole story.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: ``CPATTN_STAGE=1`` stages the CPU tensors of gloo groups as well (tests; CUDA tensors on gloo always are)
STAGE_ENV = "CPATTN_STAGE"
#: how a call uses a tensor: read (copied to the host at issue), written (copied back at ``wait``), both
DIRECTIONS = ("in", "out", "inout")


def device_backends(group: dist.ProcessGroup) -> dict[str, str]:
    """``{device type: backend name}`` of ``group`` (``init_process_group("gloo")`` gives ``{"cpu":
    "gloo", "cuda": "gloo"}``; ``"cpu:gloo,cuda:nccl"`` sends CUDA tensors to NCCL)."""
    config = str(dist.get_backend_config(group))
    if ":" not in config:  # one backend for every device
        return {"cpu": config, "cuda": config}
    return dict(part.split(":", 1) for part in config.split(","))


@dataclass
class _Slot:
    """One in-flight slot of the pool: raw bytes, viewed as each transfer's dtype and shape."""

    buffer: torch.Tensor
    pinned: bool
    busy: bool = False
    #: records the host -> device copy that last read the buffer; waited for before the slot is reused
    copied: torch.cuda.Event | None = None
    pending: bool = False  # that copy may still be running


class StagingPool:
    """Host buffers for staged transfers, one per in-flight slot, reused call after call.

    ``acquire`` hands out the lowest free slot, grown when the transfer is larger than it; ``release``
    gives it back at the transfer's ``wait``. ``allocations`` and ``allocated_bytes`` count the buffers
    made (a steady-state call makes none). ``poison``: buffers given back are overwritten with all bits
    set (NaN in every floating format, -1 in integers)."""

    def __init__(self, poison: bool = False) -> None:
        self.poison = poison
        self._slots: list[_Slot] = []
        self._in_flight: set[int] = set()  # data pointers of the buffers handed out
        self.allocations = 0
        self.allocated_bytes = 0

    @property
    def slots(self) -> int:
        return len(self._slots)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def acquire(self, shape: Sequence[int], dtype: torch.dtype, pinned: bool) -> tuple[int, torch.Tensor]:
        """A free slot and its buffer viewed as a contiguous ``shape`` tensor of ``dtype`` (contents
        undefined); ``pinned``: page-locked memory (needs a GPU), for asynchronous copies."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        index = next((i for i, s in enumerate(self._slots) if not s.busy), len(self._slots))
        if index == len(self._slots):
            self._slots.append(_Slot(self._allocate(nbytes, pinned), pinned))
        slot = self._slots[index]
        if slot.pending:  # the last host -> device copy from this buffer may still be reading it
            slot.copied.synchronize()
            slot.pending = False
        if slot.buffer.numel() < nbytes or slot.pinned != pinned:
            slot.buffer, slot.pinned = self._allocate(max(nbytes, slot.buffer.numel()), pinned), pinned
        ptr = slot.buffer.data_ptr()
        if ptr in self._in_flight:
            raise RuntimeError(f"staging slot {index}: its buffer is already in flight (handed out twice)")
        self._in_flight.add(ptr)
        slot.busy = True
        return index, slot.buffer[:nbytes].view(dtype).view(tuple(shape))

    def release(self, index: int, copied_to: torch.device | None = None) -> None:
        """Give slot ``index`` back; ``copied_to``: the CUDA device on whose current stream a copy from
        the buffer was just issued (the slot is reused only once that copy is done)."""
        slot = self._slots[index]
        ptr = slot.buffer.data_ptr()
        if not slot.busy or ptr not in self._in_flight:
            raise RuntimeError(f"staging slot {index} released while not in flight")
        if copied_to is not None:
            if slot.copied is None:
                slot.copied = torch.cuda.Event()
            slot.copied.record(torch.cuda.current_stream(copied_to))
            slot.pending = True
        if self.poison:
            if slot.pending:  # the copy must read the data, not the poison
                slot.copied.synchronize()
                slot.pending = False
            slot.buffer.fill_(0xFF)
        self._in_flight.discard(ptr)
        slot.busy = False

    def _allocate(self, nbytes: int, pinned: bool) -> torch.Tensor:
        nbytes = max(nbytes, 1)  # every buffer has an address of its own, which the in-flight check relies on
        self.allocations += 1
        self.allocated_bytes += nbytes
        log.debug("staging: new %s host buffer of %d bytes", "pinned" if pinned else "plain", nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


class Staged:
    """Handle of a staged call: ``wait()`` waits for gloo, copies the written tensors back to the
    device (on the current stream) and gives the call's buffers back to the pool."""

    def __init__(self, pool: StagingPool, work, slots: list[int],
                 back: list[tuple[torch.Tensor | None, torch.Tensor]]) -> None:
        self.pool, self.work, self.slots, self.back = pool, work, slots, back

    def wait(self) -> None:
        if self.work is None:
            return
        self.work.wait()  # when it raises, the buffers stay out of the pool: gloo may still hold them
        for dev, host in self.back:
            if dev is not None:
                dev.copy_(host, non_blocking=dev.is_cuda)
        for index, (dev, _) in zip(self.slots, self.back):
            self.pool.release(index, copied_to=dev.device if dev is not None and dev.is_cuda else None)
        self.work, self.slots, self.back = None, [], []


class Stager:
    """Which calls of one communicator are staged, and the staging itself.

    ``backends``: the group's :func:`device_backends`. CUDA tensors are staged when the group runs them
    on gloo (unless ``stage`` is False); CPU tensors when forced (``stage`` True, or ``stage`` None and
    ``CPATTN_STAGE=1``) on a group that runs them on gloo."""

    def __init__(self, backends: dict[str, str], stage: bool | None, pool: StagingPool) -> None:
        if stage and backends.get("cpu") != "gloo" and backends.get("cuda") != "gloo":
            raise ValueError(f"stage=True: this group's backends are {backends}; staging through host buffers "
                             "is for gloo groups (NCCL moves device tensors itself)")
        wanted = {"cuda": stage is not False, "cpu": stage if stage is not None else os.environ.get(STAGE_ENV) == "1"}
        self.devices = {device for device, on in wanted.items() if on and backends.get(device) == "gloo"}
        self.pool = pool
        self._copied: torch.cuda.Event | None = None  # marks the end of a call's device -> host copies

    def wants(self, t: torch.Tensor) -> bool:
        """Whether a call on ``t`` (the call's tensors share its device) is staged."""
        return t.device.type in self.devices

    def start(self, launch: Callable[..., object], tensors: Sequence[tuple[torch.Tensor, str]]) -> Staged:
        """``launch(*hosts)``, which starts the gloo call and returns its work, on host buffers standing
        for ``tensors``, each ``(tensor, direction)`` (:data:`DIRECTIONS`): the read ones are copied in,
        and those copies finished, before gloo starts."""
        pinned = any(t.is_cuda for t, _ in tensors)
        slots, back = [], []
        try:
            for t, direction in tensors:
                if direction not in DIRECTIONS:
                    raise ValueError(f"direction {direction!r} is not one of {DIRECTIONS}")
                index, host = self.pool.acquire(t.shape, t.dtype, pinned)
                slots.append(index)
                back.append((None if direction == "in" else t, host))
                if direction != "out":
                    host.copy_(t, non_blocking=pinned)
            if pinned:  # gloo reads the buffers from its own thread: the copies on this stream must be done
                if self._copied is None:
                    self._copied = torch.cuda.Event()
                device = next(t.device for t, _ in tensors if t.is_cuda)
                self._copied.record(torch.cuda.current_stream(device))
                self._copied.synchronize()
            work = launch(*(host for _, host in back))
        except BaseException:
            for index in slots:
                self.pool.release(index)
            raise
        return Staged(self.pool, work, slots, back)


__all__ = ["DIRECTIONS", "STAGE_ENV", "Staged", "Stager", "StagingPool", "device_backends"]
