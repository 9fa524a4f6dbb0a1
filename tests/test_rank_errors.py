"""Any exception a check raises on one rank reaches every rank (no check can hang the group), and the
functional entry points' errors speak their own terms: the entry point's name, the arguments the user
passed, the layout hint and the schedule's local-length rule."""

from __future__ import annotations

import re

import pytest
import torch

import cpattn
from cpattn import agree
from cpattn.launcher import RankError

SITES = ("construction", "first call", "with_mask", "unshard")
WHAT = {"construction": "ContextParallel", "first call": "ContextParallel.attention",
        "with_mask": "ContextParallel.with_mask", "unshard": "ContextParallel.unshard"}


def _same_everywhere(results: list) -> dict:
    assert all(not isinstance(r, RankError) for r in results), results
    assert len({(r["type"], r["message"]) for r in results}) == 1, f"ranks raised different errors: {results}"
    return results[0]


@pytest.mark.parametrize("kind,raised,named", [
    ("KeyError", "KeyError", "raised KeyError: 'no such entry'"),
    ("assert", "AssertionError", "raised AssertionError: raised at rank_error_workers.py:"),
    ("own", "RuntimeError", "raised rank_error_workers.CheckFailed: a check of the user's own failed"),
])
def test_any_exception_in_a_check_on_one_rank_reaches_every_rank(worlds, kind, raised, named):
    """A KeyError, a failed assert and an exception type of the user's own, raised by a check on rank 1
    only, at construction, the first call, with_mask and unshard: every rank raises the same error (the
    builtin type kept, else a RuntimeError naming the type), within the case's timeout; the world then
    still runs attention."""
    results = worlds.get(2).run("rank_error_workers.a_check_raises", timeout=60, name=f"a check raises {kind}",
                                kind=kind)
    assert all(not isinstance(r, RankError) for r in results), results
    for site in SITES:
        got = _same_everywhere([r[site] for r in results])
        assert got["type"] == raised, (site, got)
        assert f"{WHAT[site]}: rank 1 of 2 {named}" in got["message"], (site, got)
    if kind == "assert":
        assert "assert seen == 1" in results[0]["first call"]["message"]
    assert all(r["afterwards"]["type"] is None for r in results), results


def test_an_error_is_rebuilt_as_its_nearest_builtin_type():
    assert type(agree.rebuild_error("KeyError", "x")) is KeyError
    assert type(agree.rebuild_error("AssertionError", "x")) is AssertionError
    assert type(agree.rebuild_error("Exception", "x")) is RuntimeError
    assert type(agree.rebuild_error("UnicodeDecodeError", "x")) is RuntimeError  # needs more than a message
    assert type(agree.rebuild_error("print", "x")) is RuntimeError  # a builtin, not an exception
    assert agree.describe_error(agree.RanksDisagreeError("differ"))[:2] == ["cpattn.agree.RanksDisagreeError",
                                                                             "ValueError"]
    assert agree.describe_error(torch.OutOfMemoryError("full"))[1] == "RuntimeError"


# ------------------------------------------------------------------ the functional entry points
def test_a_heads_first_tensor_is_named_by_the_functional_entry_point():
    """World size 1: [b, h, s, d] tensors with GQA given to ring_attn_func name the layout and the way out,
    in the entry point's name, never a derived seq_len; the transposed call runs."""
    q, k = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8)
    with pytest.raises(ValueError) as caught:
        cpattn.ring_attn_func(q, k, k, causal=True)
    message = str(caught.value)
    assert message.startswith("ring_attn_func: q holds 4 tokens at dim 1 but k holds 2"), message
    assert "they look like [batch, heads, seq, head_dim]: pass q.transpose(1, 2), k.transpose(1, 2)" in message
    assert "qkv_format='bhsd'" in message and "seq_len" not in message, message
    out = cpattn.ring_attn_func(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), causal=True)
    assert out.shape == (1, 16, 4, 8)


@pytest.mark.parametrize("args,error,message", [
    (((1, 7, 4, 8), (1, 7, 2, 8)), ValueError,
     r"^zigzag_ring_attn_func needs an even local length: the zigzag layout cuts the sequence into 2 x world_size "
     r"= 2 chunks .* but q holds 7 tokens at dim 1. Pad the sequence to a multiple of 2 tokens, or use "
     r"ContextParallel\(seq_len=..., schedule='zigzag_ring'\)"),
    (((1, 8, 4, 8), (1, 6, 2, 8)), ValueError, r"^zigzag_ring_attn_func: q holds 8 tokens at dim 1 but k holds 6 .*"
                                               r"each with the same local length$"),
    (((1, 8, 4, 8), (1, 8, 8)), ValueError, r"^zigzag_ring_attn_func: k must be this rank's tokens as \[batch, seq, "
                                            r"heads, head_dim\], got shape \(1, 8, 8\)"),
])
def test_functional_errors_name_the_entry_point_and_the_users_arguments(args, error, message):
    q, k = (torch.randn(*shape) for shape in args)
    with pytest.raises(error, match=message):
        cpattn.zigzag_ring_attn_func(q, k, k, causal=True)


def test_functional_errors_on_two_ranks_are_the_same_everywhere_in_the_entry_points_terms(worlds):
    """On two ranks: the layout hint, the even-length rule, different local lengths per rank, and a check of
    ContextParallel's (an integer dtype), each the same on every rank, named by the entry point."""
    world = worlds.get(2)
    expect = {
        "bhsd": ("ValueError", "ring_attn_func: q holds 4 tokens at dim 1 but k holds 2", "they look like [batch, "
                 "heads, seq, head_dim]"),
        "odd": ("ValueError", "zigzag_ring_attn_func needs an even local length", "multiple of 4 tokens"),
        "lengths": ("RanksDisagreeError", "zigzag_ring_attn_func: ranks hold different local lengths at dim 1 of q "
                    "(rank 0: 8; rank 1: 10)", "every rank passes the same number of tokens"),
        "dtype": ("TypeError", "zigzag_ring_attn_func: q.dtype=torch.int32 is not supported", "accepted: float32"),
    }
    for problem, (kind, start, part) in expect.items():
        got = _same_everywhere(world.run("rank_error_workers.functional_error", timeout=60,
                                         name=f"functional {problem}", problem=problem))
        assert got["type"] == kind, (problem, got)
        assert start in got["message"] and part in got["message"], (problem, got)
        assert "ContextParallel" not in got["message"].split(":")[0], got
        assert not re.search(r"seq_len=\d", got["message"]), got  # no length the user did not pass
