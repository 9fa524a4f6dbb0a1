"""Ranks agree, or all fail alike.

A context-parallel call is a sequence of collectives that every rank of the group must enter with the
same sizes. A rank given a different sequence length, mask, schedule or tensor shape does not fail by
itself: it hangs its peers, crashes inside the transport, or computes something else without a word.
:func:`agree` turns those cases into one error, the same on every rank, before any attention traffic:

- each rank contributes a small *fingerprint* (named fields, as text) and, when its own checks failed,
  its error;
- one all-gather carries a status word and a 64-bit digest per field from every rank, so the common
  case costs one small collective;
- only when the digests differ or some rank failed, a second exchange carries the text, so every rank
  can name the field, the values and the ranks that hold them, and raise the same exception.

``ContextParallel`` runs it at construction (seq_len, mask, schedule, layout, topology, backends,
version) and at the first call with each new signature of q, k, v (``check="first"``), at every call
(``check="always"``) or never (``check="off"``).
"""

from __future__ import annotations

import builtins
import contextlib
import contextvars
import hashlib
import json
import traceback
from collections.abc import Iterator, Mapping

import torch

from .core.comm import Communicator

#: values of ``ContextParallel(check=...)``
CHECK_MODES = ("first", "always", "off")
#: the public entry point a check runs for (a ``*_attn_func``), named in place of ``ContextParallel``
_ENTRY_POINT: contextvars.ContextVar[str | None] = contextvars.ContextVar("cpattn_entry_point", default=None)


@contextlib.contextmanager
def entry_point(name: str) -> Iterator[None]:
    """Inside the block, :func:`agree` names ``name`` (e.g. ``"zigzag_ring_attn_func"``) as what failed,
    instead of the ``ContextParallel`` method that the entry point calls: the user's own terms."""
    token = _ENTRY_POINT.set(name)
    try:
        yield
    finally:
        _ENTRY_POINT.reset(token)


class RanksDisagreeError(ValueError):
    """The ranks of a group were given different settings or inputs (raised the same on every rank).
    ``differing``: each field that differs -> {value: the ranks that hold it}."""

    def __init__(self, message: str, differing: Mapping[str, Mapping[str, list[int]]] | None = None) -> None:
        super().__init__(message)
        self.differing = dict(differing or {})


def describe_error(error: BaseException) -> list[str]:
    """``[type, builtin type, message]`` of an exception, as :func:`agree` sends it: its type's name (with
    its module when it is not a builtin), the nearest builtin exception class it derives from (what the
    other ranks raise), and its message; a message-less error (a bare ``assert``) is named by where it was
    raised."""
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    base = next(c.__name__ for c in kind.__mro__ if c.__module__ == "builtins")
    message = str(error)
    if not message and error.__traceback__ is not None:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        message = f"raised at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}: {frame.line or ''}".strip()
    return [name, base, message]


def rebuild_error(base: str, text: str) -> Exception:
    """An exception of the builtin class named ``base`` with message ``text``, or a RuntimeError when that
    class is not a builtin exception, is ``Exception`` itself, or cannot take a message alone."""
    kind = getattr(builtins, base, None)
    if isinstance(kind, type) and issubclass(kind, Exception) and kind is not Exception:
        try:
            return kind(text)
        except TypeError:  # e.g. UnicodeDecodeError wants its parts
            pass
    return RuntimeError(text)


def check_mode(check: str) -> str:
    if check not in CHECK_MODES:
        raise ValueError(f"check={check!r} is unknown; accepted: {', '.join(map(repr, CHECK_MODES))}")
    return check


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _gather_text(comm: Communicator, text: str, device: torch.device) -> list[str]:
    """Every rank's ``text`` on every rank (lengths first, then the bytes padded to the longest)."""
    raw = text.encode()
    lengths = torch.empty(comm.world_size, dtype=torch.int64, device=device)
    comm.all_gather(lengths, torch.tensor([len(raw)], dtype=torch.int64, device=device))
    longest = int(lengths.max().item())
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if raw:
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    everyone = torch.empty(comm.world_size * longest, dtype=torch.uint8, device=device)
    comm.all_gather(everyone, mine)
    data = everyone.view(comm.world_size, longest).cpu().numpy()
    return [data[r, : int(lengths[r])].tobytes().decode() for r in range(comm.world_size)]


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _differences(fields: list[str], values: list[dict[str, str]]) -> dict[str, dict[str, list[int]]]:
    """Each field whose value differs -> {value: the ranks that hold it}."""
    differing = {}
    for name in fields:
        holders: dict[str, list[int]] = {}
        for rank, vals in enumerate(values):
            holders.setdefault(vals.get(name, "?"), []).append(rank)
        if len(holders) > 1:
            differing[name] = holders
    return differing


def holders_text(holders: Mapping[str, list[int]]) -> str:
    """``rank 0: 4; ranks 1, 2: 6``: which ranks hold which value."""
    return "; ".join(f"{_ranks(r)}: {value}" for value, r in holders.items())


def agree(comm: Communicator, what: str, fields: Mapping[str, str], error: BaseException | None = None,
          device: torch.device | str = "cpu") -> None:
    """Check, collectively, that every rank of ``comm`` has the same ``fields`` and no ``error``.

    Every rank must call this with the same ``what`` and the same field *names* (the values may
    differ: that is what is checked). On success it returns on every rank. Otherwise every rank raises
    the same exception: the first failing rank's error, whatever its type (any ``Exception`` a check
    raises, so that no check can leave the other ranks waiting), prefixed with the rank that raised it and
    its type (with ``what`` alone when every rank raised the same), raised as its nearest builtin exception
    class (``KeyError``, ``AssertionError``, ``ValueError`` ...; a RuntimeError for a class derived from
    ``Exception`` alone); or :class:`RanksDisagreeError`
    naming each differing field with its values and ranks (``differing``). With one rank, ``error`` is
    re-raised unchanged and nothing is exchanged. Inside :func:`entry_point`, ``what`` is that entry point.
    """
    if comm.world_size == 1:
        if error is not None:
            raise error
        return
    what = _ENTRY_POINT.get() or what
    names = list(fields)
    word = torch.tensor([0 if error is None else 1, _digest(json.dumps(names))]
                        + [_digest(str(fields[n])) for n in names], dtype=torch.int64, device=device)
    table = torch.empty(comm.world_size * word.numel(), dtype=torch.int64, device=device)
    comm.all_gather(table, word)
    table = table.view(comm.world_size, -1).cpu()
    failed = [r for r in range(comm.world_size) if table[r, 0] != 0]
    if not failed and bool((table == table[0]).all()):
        return
    # something differs: everyone learns what, from everyone's text (the same text on every rank)
    mine = {"fields": {n: str(fields[n]) for n in names},
            "error": None if error is None else describe_error(error)}
    reports = [json.loads(t) for t in _gather_text(comm, json.dumps(mine), device)]
    if failed:
        kind, base, message = reports[failed[0]]["error"]
        message = message.removeprefix(f"{what}: ")  # an error that names the entry point already
        if len(failed) == comm.world_size and all(reports[r]["error"] == reports[0]["error"] for r in failed):
            text = f"{what}: {message}" if kind == base else f"{what}: {kind}: {message}"  # every rank alike
        else:
            others = f" (also failed: {_ranks(failed[1:])})" if len(failed) > 1 else ""
            text = f"{what}: rank {failed[0]} of {comm.world_size} raised {kind}: {message}{others}"
        exc = rebuild_error(base, text)
        if error is not None and comm.rank == failed[0]:
            raise exc from error
        raise exc
    differing = _differences(names, [r["fields"] for r in reports])
    lines = [f"{name} differs ({holders_text(holders)})" for name, holders in differing.items()]
    if not lines:  # same values, different field names: the ranks run different cpattn code
        lines = [f"the checked fields differ ({'; '.join(str(list(r['fields'])) for r in reports)})"]
    raise RanksDisagreeError(f"{what}: the {comm.world_size} ranks of the group disagree: " + "; ".join(lines),
                             differing)


def signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale) -> dict[str, str]:
    """The fields of one attention call that every rank must share."""
    out = {name: (f"shape {tuple(t.shape)}, {str(t.dtype).removeprefix('torch.')}, {t.device.type}, "
                  f"requires_grad={t.requires_grad}") if isinstance(t, torch.Tensor) else type(t).__name__
           for name, t in (("q", q), ("k", k), ("v", v))}
    return {**out, "softmax_scale": repr(softmax_scale)}


def signature_key(q, k, v, softmax_scale) -> tuple:
    """A hashable key of :func:`signature` (what ``check="first"`` remembers)."""
    parts = tuple((tuple(t.shape), t.dtype, t.device.type, t.requires_grad) if isinstance(t, torch.Tensor)
                  else type(t).__name__ for t in (q, k, v))
    return parts + (softmax_scale if isinstance(softmax_scale, (int, float, type(None))) else repr(softmax_scale),)


__all__ = ["CHECK_MODES", "RanksDisagreeError", "agree", "check_mode", "describe_error", "entry_point",
           "holders_text", "rebuild_error", "signature", "signature_key"]
