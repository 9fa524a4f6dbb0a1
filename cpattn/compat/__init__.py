"""Other libraries' public APIs on top of :class:`cpattn.ContextParallel`, name for name (``docs/compat.md``).

Each entry of :data:`MODULES` is a package that mirrors one library: its layouts are ordinary cpattn
layouts and its calls are ``ContextParallel`` calls, with no algorithm, merge or communication of its own.
Nothing is aliased by importing this package; :func:`install` makes ``import <name>`` resolve to ours::

    import cpattn.compat
    cpattn.compat.install("ring_flash_attn")
    from ring_flash_attn import substitute_hf_flash_attn, update_ring_flash_attn_params   # cpattn's
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from types import ModuleType

from .ring_flash_attn._calls import SCHEDULE_ENV, comm_stats, reset_comm_stats

__all__ = ["MODULES", "SCHEDULE_ENV", "comm_stats", "install", "reset_comm_stats"]

#: library name -> the cpattn module that stands in for it
MODULES = {
    "ring_flash_attn": "cpattn.compat.ring_flash_attn",
    "yunchang": "cpattn.compat.yunchang",
}


def _with_submodules(package: ModuleType) -> dict[str, ModuleType]:
    """``package`` and every module under it, imported, by their name relative to it ("" for itself)."""
    found = {"": package}
    for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
        if info.name.rsplit(".", 1)[-1].startswith("_"):
            continue
        found[info.name[len(package.__name__):]] = importlib.import_module(info.name)
    return found


def install(name: str) -> ModuleType:
    """Make ``import name`` (and ``import name.submodule``) resolve to cpattn's stand-in for the library
    ``name`` (a key of :data:`MODULES`), and return it. Idempotent. Raises ``ImportError`` when the real
    library is already imported in this process (its objects would be mixed with ours), ``ValueError``
    for a name cpattn has no stand-in for."""
    if name not in MODULES:
        raise ValueError(f"install({name!r}): cpattn has no stand-in for {name!r}; available: "
                         f"{', '.join(map(repr, sorted(MODULES)))}")
    target = MODULES[name]
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__name__", None) != target:
        where = getattr(loaded, "__file__", None) or "an unknown location"
        raise ImportError(f"install({name!r}): the real {name!r} is already imported (from {where}); call "
                          f"cpattn.compat.install({name!r}) before anything imports {name!r}")
    modules = _with_submodules(importlib.import_module(target))
    for suffix, module in modules.items():
        sys.modules[name + suffix] = module
    return modules[""]
