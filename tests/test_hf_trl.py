"""``cpattn.integrations.hf.context_parallel(trl.SFTTrainer)`` with accelerate's ``ParallelismConfig(cp_size=...)``:
a tiny random Llama fine-tuned at CP=2 (and DP=2 x CP=2 on 4 ranks) logs the same per-step losses,
``num_tokens`` and ``mean_token_accuracy`` as the stock SFTTrainer on one process, packed (padding-free
batches) and unpacked (right-padded rows), with completion-only loss and gradient accumulation.

TRL is the optional ``trl`` extra (``make test-trl`` installs it and runs these tests, marked ``trl``);
without it they are skipped with a message naming the extra."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed: pip install -e '.[trl]' (make test-trl does)")

from trl_workers import RUN, sft  # noqa: E402

from cpattn.launcher import RankError  # noqa: E402

pytestmark = pytest.mark.trl

#: tolerance on every logged number (float32): absolute on the loss and the accuracy, exact token counts
TOL = 1e-5
#: the largest differences met per configuration, for the report at the end of the module
MEASURED: dict[str, dict[str, float]] = {}


def reference(**kw) -> dict:
    """The stock SFTTrainer on this process, one torch thread (as each worker has)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return sft("trl", **kw)
    finally:
        torch.set_num_threads(threads)


def check(results: list, ref: dict, case: str, evaluated: bool = True) -> None:
    assert len(ref["loss"]) == RUN["steps"], f"{case}: the reference logged {len(ref['loss'])} steps"
    assert max(ref["loss"]) - min(ref["loss"]) > 0.05, f"{case}: the loss does not move: {ref['loss']}"
    worst = {"loss": 0.0, "num_tokens": 0.0, "mean_token_accuracy": 0.0}
    for rank, r in enumerate(results):
        assert not isinstance(r, RankError), f"{case}: {r}\n{r.traceback}"
        assert len(r["loss"]) == RUN["steps"], f"{case}: rank {rank}: {len(r['loss'])} steps"
        for name in ("loss", "num_tokens", "mean_token_accuracy"):
            for step, (got, want) in enumerate(zip(r[name], ref[name])):
                worst[name] = max(worst[name], abs(got - want))
                assert abs(got - want) <= TOL * max(1.0, abs(want)), \
                    f"{case}: rank {rank}: step {step + 1} {name} {got} != {want}"
        if evaluated:
            for name in ("eval_loss", "eval_mean_token_accuracy"):
                worst[name] = max(worst.get(name, 0.0), abs(r[name] - ref[name]))
                assert abs(r[name] - ref[name]) <= TOL * max(1.0, abs(ref[name])), \
                    f"{case}: rank {rank}: {name} {r[name]} != {ref[name]}"
    MEASURED[case] = worst
    print(f"{case}: max |difference| " + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()))


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "unpacked"])
def test_sft_cp2_logs_what_one_process_logs(worlds, packing):
    """CP=2 from ParallelismConfig(cp_size=2), zigzag_ring: 10 steps of 2 accumulated batches, then
    evaluate() (TRL's own prediction_step, which calls no context-parallel hook) on 14 more examples."""
    ref = reference(packing=packing)
    results = worlds.get(2).run(sft, trainer="cpattn", packing=packing, cp_size=2, timeout=600)
    check(results, ref, f"SFTTrainer CP=2 {'packed' if packing else 'unpacked'}")


@pytest.mark.slow
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "unpacked"])
def test_sft_dp2_cp2_logs_what_one_process_logs_on_both_batches(worlds, packing):
    """4 ranks: ParallelismConfig(dp_shard_size=2, cp_size=2); the one-process run reads both groups'
    examples in one batch of twice the examples."""
    ref = reference(packing=packing, dp=2)
    results = worlds.get(4).run(sft, trainer="cpattn", packing=packing, cp_size=2, dp=2, timeout=600)
    # evaluation: each group's batch mean, averaged over the groups, is not the one-process batch's mean
    check(results, ref, f"SFTTrainer DP=2 x CP=2 {'packed' if packing else 'unpacked'}", evaluated=False)
