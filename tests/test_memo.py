"""``cpattn.core.memo``: what a run remembers is kept by its owner, bounded and keyed by value; nothing
is kept at module level."""

from __future__ import annotations

import cpattn
from cpattn.core import memo
from cpattn.core.layout import Layout
from cpattn.core.memo import BoundedCache
from cpattn.core.pairs import pair_work


def test_nothing_is_kept_outside_a_scope():
    built = []
    for _ in range(2):
        memo.cached(("probe", 1), lambda: built.append(1))
    assert len(built) == 2


def test_a_scope_keeps_by_value_and_inner_scopes_share_it():
    with memo.scope() as outer:
        a = pair_work(cpattn.masks.document([24, 40]), Layout("zigzag"), 64, 2)
        with memo.scope() as inner:
            b = pair_work(cpattn.masks.document([24, 40]), Layout("zigzag"), 64, 2)  # equal values, new objects
        assert inner is outer and a is b
    assert pair_work(cpattn.masks.document([24, 40]), Layout("zigzag"), 64, 2) is not a


def test_a_lent_cache_outlives_its_scope_and_stays_bounded():
    cache = BoundedCache(3)
    with memo.scope(cache):
        for i in range(5):
            memo.cached(("probe", i), lambda i=i: i * i)
    assert len(cache) == 3
    with memo.scope(cache):
        assert memo.cached(("probe", 4), lambda: "rebuilt") == 16  # kept
        assert memo.cached(("probe", 0), lambda: "rebuilt") == "rebuilt"  # evicted first


def test_a_context_parallel_remembers_in_its_own_cache():
    cp = cpattn.ContextParallel(64, cpattn.masks.document([24, 40]), schedule="ring")
    q = k = v = __import__("torch").randn(1, 64, 2, 8)
    cp.attention(q, k, v)
    assert len(cp._memo) > 0  # its steps and block lists
    other = cpattn.ContextParallel(64, cpattn.masks.document([24, 40]), schedule="ring")
    assert len(other._memo) < len(cp._memo)


def test_an_entry_kept_for_an_object_is_built_again_for_another_object_under_its_key():
    cache, built = BoundedCache(4), []

    def build(tag):
        return lambda: built.append(tag) or tag

    first, second = object(), object()
    assert cache.get_for(first, "id", build("first")) == "first"
    assert cache.get_for(first, "id", build("again")) == "first"  # kept
    assert cache.get_for(second, "id", build("second")) == "second"  # the key names another object now
    assert built == ["first", "second"] and len(cache) == 1
