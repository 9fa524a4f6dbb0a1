"""Peak memory of a region of code, measured rather than sampled.

On a CPU, :class:`PeakTracker` counts the
bytes of live tensor storage: a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees the output
of every aten op run inside the region (autograd's backward included, and the ops inside cpattn's
attention op, whose body it runs under itself), and a storage is counted once, when an op first returns
it, until it is freed (a finalizer on the storage). Storage alive before the region is never counted: an
output that shares storage with one of the op's inputs (a view, an in-place or ``out=`` op, a collective
writing into its buffers) allocates nothing. What it does not see: scratch memory a fused kernel
allocates and frees inside one op, and tensors created outside torch's dispatcher (e.g.
``torch.from_numpy``). On CUDA it reads ``torch.cuda.max_memory_allocated`` instead, above what was
allocated on entry.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .schedules.base import op_body


def _stored(tree) -> list[torch.Tensor]:
    """The tensors of ``tree`` that have a storage (strided, not on the meta device)."""
    return [t for t in tree_flatten(tree)[0]
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"]


class _LiveStorage(TorchDispatchMode):
    """Counts the bytes of storages created inside the mode while they are alive (CPU and CUDA alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0  # bytes
        self.peak = 0
        self._ids: set[int] = set()  # storages counted and still alive (StorageImpl addresses)
        self._lock = threading.Lock()  # finalizers run in whatever thread drops the last reference

    def _free(self, key: int, nbytes: int) -> None:
        with self._lock:
            if key in self._ids:
                self._ids.discard(key)
                self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = op_body(func)
        if body is not None:  # cpattn's attention op: count the tensors created inside it
            with self:
                return body(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in _stored((args, kwargs))}
        for t in _stored(out):
            storage = t.untyped_storage()
            key, nbytes = storage._cdata, storage.nbytes()
            if key in inputs or nbytes == 0:
                continue
            with self._lock:
                if key in self._ids:
                    continue
                self._ids.add(key)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, nbytes)
        return out


class PeakTracker:
    """``with PeakTracker() as t: ...`` then ``t.peak_bytes``: the most bytes of tensors created inside
    the region that were alive at once (tensors alive before entering excluded); ``t.live_bytes`` is
    what is still alive at exit. ``device``: a CUDA device uses the caching allocator's statistics
    (``max_memory_allocated`` above the allocation on entry), anything else the dispatch mode."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.peak_bytes = 0
        self.live_bytes = 0

    def __enter__(self) -> PeakTracker:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = _LiveStorage()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            self.live_bytes = torch.cuda.memory_allocated(self.device) - self._base
        else:
            self._mode.__exit__(*exc)
            self.peak_bytes, self.live_bytes = self._mode.peak, self._mode.live


__all__ = ["PeakTracker"]
