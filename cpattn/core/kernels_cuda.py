"""Old import path of :mod:`cpattn.core.cuda_ops` (renamed): warns, then hands out its names."""

from . import cuda_ops as _moved
from .old_paths import warn_moved

warn_moved("cpattn.core.kernels_cuda", "cpattn.core.cuda_ops")


def __getattr__(name: str):
    return getattr(_moved, name)
