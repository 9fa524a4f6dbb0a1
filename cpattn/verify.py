"""Old import path of :mod:`cpattn.exactness` (renamed): warns, then hands out its names."""

from . import exactness as _moved
from .core.old_paths import warn_moved

warn_moved("cpattn.verify", "cpattn.exactness")


def __getattr__(name: str):
    return getattr(_moved, name)
