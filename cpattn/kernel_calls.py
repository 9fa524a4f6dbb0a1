"""Old import path of :mod:`cpattn.timed_calls` (renamed): warns, then hands out its names."""

from . import timed_calls as _moved
from .core.old_paths import warn_moved

warn_moved("cpattn.kernel_calls", "cpattn.timed_calls")


def __getattr__(name: str):
    return getattr(_moved, name)
