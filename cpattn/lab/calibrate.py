"""Old import path of :mod:`cpattn.lab.machine_profile` (renamed): warns, then hands out its names."""

from ..core.old_paths import warn_moved
from . import machine_profile as _moved

warn_moved("cpattn.lab.calibrate", "cpattn.lab.machine_profile")


def __getattr__(name: str):
    return getattr(_moved, name)
