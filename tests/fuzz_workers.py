"""Masks given by a predicate (``cpattn.masks.from_mask_mod``) for the fuzz tests (tests/test_fuzz.py).

A ``exactness.Case`` names its mask as JSON (``cpattn.masks.from_spec``), which a predicate has no form
of, so these cases describe the predicate as a small dict ``mod``::

    {"kind": "prefix_lm", "prefix": 10, "combine": "and"}

``kind`` names one of :data:`MODS` and the other keys are its arguments; ``combine`` is None (the
predicate alone) or "and" / "or" (the predicate combined with the case's own JSON mask, ``Case.mask``
and ``Case.mask_args``, with ``&`` / ``|``). Each kind has two definitions: a vectorised one that the
library gets through ``from_mask_mod`` (classified from its dense form) and a pair-by-pair one on plain
ints for the reference. The JSON side of a combination comes from ``exactness.dense_mask``, so the
reference shares no code with ``cpattn.masks``.

:func:`mask_mod_case` runs on every worker rank; :func:`run` runs it on a world and judges the results
with ``cpattn.exactness``'s checks: float64 reference, tolerance ``2 * e_local + 1e-6``, communication equal
to the schedule's steps, padding and empty rows exactly 0 (lse -inf).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict

import torch

from cpattn import exactness, masks
from cpattn.launcher import WorldError

#: multiplier of the block hash of ``random_blocks`` (Knuth's); products stay far below 2**63
_HASH = 2654435761


def _block_hash(i, j, seed: int):
    """Pseudo-random 0..999 per block pair; the same arithmetic on ints and on LongTensors."""
    return ((i * 131 + j * 31 + seed * 17 + 7) * _HASH >> 7) % 1000


# kind -> (vectorised fn(q_idx, kv_idx, **args) -> bool tensor, rule(q, k, **args) -> bool, is_causal(**args))
MODS: dict[str, tuple[Callable, Callable, Callable[..., bool]]] = {
    # prefix-LM: a bidirectional prefix, causal after it
    "prefix_lm": (lambda q, k, prefix: (k <= q) | (k < prefix),
                  lambda q, k, prefix: k <= q or k < prefix,
                  lambda prefix: False),
    # every d-th key back from the query (causal)
    "dilated": (lambda q, k, dilation: (k <= q) & ((q - k) % dilation == 0),
                lambda q, k, dilation: k <= q and (q - k) % dilation == 0,
                lambda dilation: True),
    # block-sparse, pairs of blocks kept at random (density in thousandths), optionally causal
    "random_blocks": (lambda q, k, block_size, density, seed, causal:
                      (_block_hash(q // block_size, k // block_size, seed) < density) & ((k <= q) | (not causal)),
                      lambda q, k, block_size, density, seed, causal:
                      _block_hash(q // block_size, k // block_size, seed) < density and (k <= q or not causal),
                      lambda block_size, density, seed, causal: causal),
    # rows q with q % period == phase attend nothing (out 0, lse -inf); the others attend causally
    "empty_rows": (lambda q, k, period, phase: (k <= q) & (q % period != phase),
                   lambda q, k, period, phase: k <= q and q % period != phase,
                   lambda period, phase: True),
}


def _args(mod: dict) -> dict:
    return {k: v for k, v in mod.items() if k not in ("kind", "combine")}


def build_mask(case: exactness.Case, mod: dict) -> masks.Mask:
    """The library mask of a case: the predicate ``mod`` wrapped by ``from_mask_mod``, alone or combined
    with the case's JSON mask."""
    fn, _, is_causal = MODS[mod["kind"]]
    args = _args(mod)
    mask = masks.from_mask_mod(lambda q, k: fn(q, k, **args), name=mod["kind"], is_causal=is_causal(**args))
    if mod.get("combine") is None:
        return mask
    other = masks.from_spec(case.mask_spec)
    return (mask & other) if mod["combine"] == "and" else (mask | other)


def reference_mask(case: exactness.Case, mod: dict) -> torch.Tensor:
    """The reference's bool ``[S, S]`` of the case, pair by pair (small S only)."""
    _, rule, _ = MODS[mod["kind"]]
    args = _args(mod)
    s = case.seq
    allowed = torch.tensor([[bool(rule(q, k, **args)) for k in range(s)] for q in range(s)], dtype=torch.bool)
    if mod.get("combine") is None:
        return allowed
    other = exactness.dense_mask(case.mask, s, case.mask_args)
    return (allowed & other) if mod["combine"] == "and" else (allowed | other)


def label(case: exactness.Case, mod: dict | None) -> str:
    """The case as text: ``verify``'s label, plus the predicate when there is one."""
    if mod is None:
        return case.label
    return f"{case.label} mask_mod={json.dumps(mod, separators=(',', ':'), sort_keys=True)}"


# ---------------------------------------------------------------------------------- worker side
def mask_mod_case(mod: dict, **fields) -> dict:
    """``exactness.rank_case`` with the mask of :func:`build_mask`, built here on the rank (a predicate
    cannot travel to the worker): this rank's results, counts and the run against its steps."""
    case = exactness.Case(**fields)
    return exactness.run_case_on_rank(case, build_mask(case, mod))


# ---------------------------------------------------------------------------------- parent side
def check(case: exactness.Case, mod: dict, per_rank: list) -> exactness.CaseResult:
    """``exactness.check`` with the reference mask of :func:`reference_mask`."""
    return exactness.check(case, per_rank, allowed=reference_mask(case, mod), mask_name="mask_mod")


def run(world, case: exactness.Case, mod: dict | None, timeout: float) -> exactness.CaseResult:
    """Run one fuzz case on a ``LocalWorld`` and judge it: ``exactness.run`` for a JSON mask, the predicate
    path above otherwise. A timeout or a dead worker is a failure naming the case."""
    if mod is None:
        return exactness.run(world, case, timeout=timeout)
    try:
        per_rank = world.run(mask_mod_case, timeout=timeout, name=label(case, mod), mod=mod, **asdict(case))
    except WorldError as exc:
        return exactness.CaseResult(case, failure=str(exc))
    return check(case, mod, per_rank)
