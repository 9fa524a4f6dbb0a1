"""Old import path of :mod:`cpattn.lab.papers` (renamed): warns, then hands out its names."""

from ..core.old_paths import warn_moved
from . import papers as _moved

warn_moved("cpattn.lab.reproduce", "cpattn.lab.papers")


def __getattr__(name: str):
    return getattr(_moved, name)
