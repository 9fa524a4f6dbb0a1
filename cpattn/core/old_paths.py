"""Old import paths of renamed modules: each is a small module that calls :func:`warn_moved` and hands out
the new module's names, so code written against the old path keeps working, with a ``DeprecationWarning``,
until the next release drops them."""

from __future__ import annotations

import warnings


def warn_moved(old: str, new: str) -> None:
    """A ``DeprecationWarning`` that ``old`` is now ``new``, attributed to the line that imported ``old``
    (``warnings`` skips the import machinery's frames), so Python shows it there by default."""
    warnings.warn(f"{old} is deprecated: import {new} instead", DeprecationWarning, stacklevel=3)


__all__ = ["warn_moved"]
