"""Attention sinks (``cp.attention(..., sinks=s)``, gpt-oss's ``s_aux``) and soft-capping
(``softcap=c``, Gemma 2): exact forward and backward, the sink logits' gradient included, on every
registered schedule."""

from __future__ import annotations

import pytest
import torch

import cpattn
from cpattn import schedules


@pytest.mark.parametrize("world,softcap", [(2, None), (3, 0.8)])
def test_sinks_and_softcap_are_exact_on_every_schedule(worlds, world, softcap):
    results = worlds.get(world).run("sink_workers.sinks_everywhere", timeout=300, seed=world, softcap=softcap)
    for rank, errors in enumerate(results):
        assert isinstance(errors, dict), f"rank {rank}: {errors}"
        assert set(errors) == set(schedules.names())
        bad = {n: e for n, e in errors.items() if not e < 1e-5}
        assert not bad, f"rank {rank}: relative errors {bad}"


def test_sinks_change_the_result_and_are_checked():
    """The reference can fail: a sink of -inf is no sink; a large one takes most of each row's weight."""
    import sink_workers as w

    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 16, 2, 4, generator=gen) for _ in range(4))
    none = w.reference(q, k, v, torch.full((2,), -torch.inf), dout, True, 0.5)["out"]
    big = w.reference(q, k, v, torch.full((2,), 5.0), dout, True, 0.5)["out"]
    assert (none - big).abs().max() > 0.1
    cp = cpattn.ContextParallel(16, "causal", schedule="ring")
    with pytest.raises(ValueError, match=r"sinks must have shape \[2\]"):
        cp.attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(TypeError, match="floating"):
        cp.attention(q, k, v, sinks=torch.zeros(2, dtype=torch.long))


def test_softcap_changes_the_result_and_needs_a_score_modifying_path():
    import sink_workers as w

    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, 16, 2, 4, generator=gen) * 2 for _ in range(4))
    none = torch.full((2,), -torch.inf)
    plain, capped = (w.reference(q, k, v, none, dout, True, 0.5, c)["out"] for c in (None, 0.5))
    assert (plain - capped).abs().max() > 0.1
    cp = cpattn.ContextParallel(16, "causal", schedule="ring", backend="aten")
    with pytest.raises(ValueError, match="soft-capping runs on the kernel paths that apply a score modification"):
        cp.attention(q, k, v, softcap=0.5)
    with pytest.raises(ValueError, match="softcap must be a positive"):
        cpattn.ContextParallel(16, "causal", schedule="ring").attention(q, k, v, softcap=-1.0)
