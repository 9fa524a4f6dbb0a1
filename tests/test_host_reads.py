"""No device value is read back to the host in a steady-state call: on a GPU each such read stalls the
launch queue, so transfers stop overlapping compute. Every registered schedule runs fwd+bwd at P=2
(causal or full, a padded length, packed documents, a bidirectional window) under a dispatch mode that
records the ops of ``worker_fns.HOST_READS`` (``aten._local_scalar_dense``, ``aten.nonzero``, ...);
the second call with a shape must record none; so must a key/value cache's decode step."""

from __future__ import annotations

import pytest
import worker_fns

from cpattn import schedules

MASKS = [
    ("causal", 96),
    ("full", 96),
    ("causal", 90),  # padded to the layout's multiple
    ({"kind": "document", "lengths": [20, 50, 26]}, 96),
    ({"kind": "sliding_window", "window": 24, "causal": False}, 96),
]


def test_no_host_reads_in_a_steady_state_call(worlds):
    found = worlds.get(2).run(worker_fns.host_reads, timeout=300, masks=MASKS)
    for rank, result in enumerate(found):
        assert isinstance(result, dict), f"rank {rank}: {result}"
        ran = {key.split("/")[0] for key in result}
        assert ran == set(schedules.names()), f"rank {rank} ran only {sorted(ran)}"
        assert len(result) >= 3 * len(ran), f"rank {rank}: too few cases ran: {sorted(result)}"
        reads = {key: where for key, where in result.items() if where}
        assert not reads, f"rank {rank}: device values read on the host:\n" + "\n".join(
            f"  {key}: {len(where)} x, first {where[0]}" for key, where in reads.items())


@pytest.mark.parametrize("merge_how", ["all_reduce", "all_gather"])
def test_no_host_reads_in_a_kv_cache_decode_step(worlds, merge_how):
    found = worlds.get(2).run(worker_fns.decode_host_reads, timeout=120, merge_how=merge_how)
    for rank, seen in enumerate(found):
        assert seen == [], f"rank {rank}: device values read on the host:\n" + "\n".join(seen)
