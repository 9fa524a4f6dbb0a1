"""Persistent gloo worker worlds shared by the whole test session (testing.md)."""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from cpattn.core.comm import POISON_ENV
from cpattn.launcher import LocalWorld
from cpattn.planner import CACHE_ENV

# plans built by tests go to a throw-away cache, never the user's (workers inherit the environment)
_CACHE = tempfile.mkdtemp(prefix="cpattn-test-plans-")
os.environ[CACHE_ENV] = _CACHE


class Worlds:
    """``worlds.get(n)`` returns a live n-rank world, starting (or restarting after a failure) it."""

    def __init__(self) -> None:
        self._worlds: dict[int, LocalWorld] = {}

    def get(self, size: int) -> LocalWorld:
        w = self._worlds.get(size)
        if w is None or not w.alive:
            w = LocalWorld(size, threads=1, env={POISON_ENV: "1", CACHE_ENV: _CACHE})
            self._worlds[size] = w
        return w

    def close(self) -> None:
        # every world winds down its process group at once rather than one after another
        with ThreadPoolExecutor() as pool:
            list(pool.map(LocalWorld.close, self._worlds.values()))


@pytest.fixture(scope="session")
def worlds():
    ws = Worlds()
    yield ws
    ws.close()
