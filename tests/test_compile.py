"""``cp.attention`` is one custom op (``cpattn::attention``, backward ``cpattn::attention_backward``):
``torch.compile(block, fullgraph=True)`` compiles a transformer block that calls it at P=2 on gloo, with
outputs and gradients equal to eager; selective activation checkpointing that saves the op's outputs
does not rerun its communication in the backward."""

from __future__ import annotations

import pytest
import worker_fns

#: float32 block outputs and gradients, compiled against eager (the attention op itself is the same)
TOLERANCE = 1e-5


# inductor generates and builds C++ (about 20 s on 2 cores): the slow suite; make test traces the same
# block through aot_eager
@pytest.mark.parametrize("schedule, backend", [pytest.param("zigzag_ring", "inductor", marks=pytest.mark.slow),
                                               ("zigzag_ring", "aot_eager"), ("ulysses", "aot_eager"),
                                               ("ultra", "aot_eager")])
def test_a_block_calling_cp_attention_compiles_fullgraph(worlds, schedule, backend):
    results = worlds.get(2).run(worker_fns.compile_block, timeout=600, name=f"compile {schedule}",
                                schedule=schedule, backend=backend)
    for rank, r in enumerate(results):
        assert isinstance(r, dict), f"rank {rank}: {r}"
        assert r["finite"], f"rank {rank}: {r}"
        assert not r["opcheck"], f"rank {rank}: torch.library.opcheck failed: {r['opcheck']}"
        assert r["diff"] <= TOLERANCE, f"rank {rank}: compiled differs from eager by {r['diff']:.2e}"
        calls = r["calls"]
        assert calls["eager"] > 0, f"rank {rank}: {calls}"  # the block communicated at all
        assert calls["compiled"] == calls["eager"], f"rank {rank}: compiled and eager communicate differently: {calls}"


def test_selective_checkpointing_does_not_rerun_the_communication(worlds):
    results = worlds.get(2).run(worker_fns.selective_checkpoint, timeout=300, schedule="ringx2o")
    for rank, r in enumerate(results):
        assert isinstance(r, dict), f"rank {rank}: {r}"
        alone, selective, full = r["backward alone"], r["selective"], r["full"]
        assert selective["calls"] == alone["calls"] > 0, f"rank {rank}: {r}"
        assert selective["bytes"] == alone["bytes"], f"rank {rank}: {r}"
        # plain checkpointing reruns the forward, communication included: the count sees it
        assert full["calls"] > alone["calls"], f"rank {rank}: {r}"
        assert max(selective["diff"], full["diff"]) <= 1e-6, f"rank {rank}: {r}"
