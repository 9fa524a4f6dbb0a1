"""What a run remembers, and who owns it: bounded caches keyed by value, and the scope that lends one
to the pure functions below (pair work, cell kinds, block tables, estimates).

A pure function that is worth remembering calls :func:`cached` with a key made of values (masks,
layouts, problems and schedules hash and compare by value). Inside ``with scope(cache):`` the result is
kept in ``cache``; outside any scope it is computed anew. So nothing is kept at module level: a
``ContextParallel`` lends its own cache (``Runtime.block_cache``) while it chooses, plans and runs, a
command (``cpattn simulate``) lends one for its duration, and an estimate opens one for its own call
when nobody lent one.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

#: entries of a cache a scope creates for itself
SCOPE_ENTRIES = 4096


class BoundedCache:
    """A least-recently-used map with at most ``maxsize`` entries, keyed by value."""

    def __init__(self, maxsize: int = 1024) -> None:
        self.maxsize = maxsize
        self._items: OrderedDict[Hashable, Any] = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The entry of ``key``, built by ``build()`` when missing (evicting the least recently used)."""
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = build()
        self.put(key, value)
        return value

    def get_for(self, owner: object, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()`` kept under ``key`` for ``owner``, an object the key names by ``id`` (a block list, a
        plan, a mask): built again when the entry holds another object, to which one that died left its id."""
        entry = self._items.get(key)
        if entry is None or entry[0] is not owner:
            entry = (owner, build())
            self.put(key, entry)
        else:
            self._items.move_to_end(key)
        return entry[1]

    def put(self, key: Hashable, value: Any) -> None:
        """Store ``value`` under ``key`` (evicting the least recently used)."""
        self._items[key] = value
        self._items.move_to_end(key)
        if len(self._items) > self.maxsize:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items


_ACTIVE: ContextVar[BoundedCache | None] = ContextVar("cpattn_memo", default=None)


@contextmanager
def scope(cache: BoundedCache | None = None) -> Iterator[BoundedCache]:
    """Keep what :func:`cached` computes in ``cache`` until the block ends. ``None``: the active scope's
    cache when there is one (an inner call shares its caller's), else a new one for this block."""
    if cache is None:
        active = _ACTIVE.get()
        if active is not None:
            yield active
            return
        cache = BoundedCache(SCOPE_ENTRIES)
    token = _ACTIVE.set(cache)
    try:
        yield cache
    finally:
        _ACTIVE.reset(token)


def scoped(func: Callable) -> Callable:
    """``func`` run inside :func:`scope` (its caller's, or one of its own for the call)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        with scope():
            return func(*args, **kwargs)

    return wrapper


def cached(key: Hashable, build: Callable[[], Any]) -> Any:
    """``build()``, kept under ``key`` in the active scope's cache (computed anew outside any scope).
    ``key`` must be made of values: its first element names the function."""
    cache = _ACTIVE.get()
    return build() if cache is None else cache.get(key, build)


__all__ = ["BoundedCache", "SCOPE_ENTRIES", "cached", "scope", "scoped"]
