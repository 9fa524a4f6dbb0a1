"""Old import path of :mod:`cpattn.core.kernel_order` (renamed): warns, then hands out its names."""

from . import kernel_order as _moved
from .old_paths import warn_moved

warn_moved("cpattn.core.kernel_table", "cpattn.core.kernel_order")


def __getattr__(name: str):
    return getattr(_moved, name)
