"""Worker functions for tests/test_rank_errors.py: a check that raises an unexpected exception on one rank
(construction, the first call, ``with_mask``, ``unshard``), and the functional entry points' errors, on every
rank of a world."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

import cpattn
import cpattn.api


class CheckFailed(Exception):
    """An exception type of the user's own, derived from Exception alone."""


def _fail(kind: str):
    if kind == "KeyError":
        return {}["no such entry"]
    if kind == "assert":
        seen = 0
        assert seen == 1
    raise CheckFailed("a check of the user's own failed")


@contextlib.contextmanager
def _patched(owner, name: str, replacement) -> Iterator[None]:
    """``owner.name`` replaced for the block (the worker process lives on: it is put back)."""
    original = owner.__dict__[name]
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _raises_on_rank_1(kind: str, original):
    def check(*args, **kwargs):
        if dist.get_rank() == 1:
            _fail(kind)
        return original(*args, **kwargs)
    return check


def _outcome(run) -> dict:
    try:
        run()
    except Exception as exc:  # the point: every rank reports what it raised
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}


def a_check_raises(kind: str) -> dict:
    """A check raising ``kind`` ("KeyError", "assert" or "own": an Exception subclass of the user's) on rank 1
    only, at construction, at the first call, in ``with_mask`` and in ``unshard``, one after another in the
    same world: what each rank raised at each site (no rank may hang)."""
    cls = cpattn.api.ContextParallel
    found = {}
    with _patched(cls, "_configure", _raises_on_rank_1(kind, cls._configure)):
        found["construction"] = _outcome(lambda: cls(32, "causal", "ring"))
    cp = cls(32, "causal", "ring")
    q = torch.randn(1, cp.local_len, 2, 8)
    with _patched(cls, "_validate", _raises_on_rank_1(kind, cls._validate)):
        found["first call"] = _outcome(lambda: cp.attention(q, q, q))
    with _patched(cpattn.api, "resolve", _raises_on_rank_1(kind, cpattn.api.resolve)):
        found["with_mask"] = _outcome(lambda: cp.with_mask(cpattn.masks.sliding_window(4)))
    local_len = cls.local_len
    with _patched(cls, "local_len", property(_raises_on_rank_1(kind, local_len.fget))):
        found["unshard"] = _outcome(lambda: cp.unshard(q))
    found["afterwards"] = _outcome(lambda: cp.unshard(cp.attention(q, q, q)))  # the world still works
    return found


def functional_error(problem: str) -> dict:
    """What each rank raises when a functional entry point is given ``problem``: "bhsd" ([b, h, s, d] tensors
    with GQA), "odd" (an odd local length on zigzag_ring), "lengths" (rank 1 holds more tokens) or "dtype"
    (integer tensors: a check of ContextParallel's, under the entry point's name)."""
    rank = dist.get_rank()
    s = 8 + 2 * rank if problem == "lengths" else (7 if problem == "odd" else 8)
    q, k = torch.randn(1, s, 4, 16), torch.randn(1, s, 2, 16)
    func = cpattn.zigzag_ring_attn_func
    if problem == "bhsd":
        q, k, func = q.transpose(1, 2), k.transpose(1, 2), cpattn.ring_attn_func
    elif problem == "dtype":
        q, k = q.to(torch.int32), k.to(torch.int32)
    return _outcome(lambda: func(q, k, k.clone(), causal=True))
