"""The live-tensor peak tracker (cpattn.memory), and every schedule's declared memory class checked
against it: forward + backward peak bytes per rank at P = 2 and 4, at two local shard sizes."""

from __future__ import annotations

import pytest
import torch

from cpattn import schedules
from cpattn.memory import PeakTracker

FLOAT = 4  # bytes


# ------------------------------------------------------------------------------------------ tracker
def test_a_known_allocation_pattern_gives_the_exact_peak_and_what_is_left():
    with PeakTracker() as t:
        a = torch.empty(1000)  # 4000 live
        c = torch.empty(500)  # 6000: the peak
        del a  # 2000
        d = torch.empty(250)  # 3000
    assert t.peak_bytes == 1500 * FLOAT
    assert t.live_bytes == 750 * FLOAT
    del c, d


def test_views_and_in_place_ops_allocate_nothing():
    with PeakTracker() as t:
        a = torch.zeros(1000)
        v = a.view(10, 100)[2:5]
        a.add_(1)
        v.mul_(2)
        torch.add(a, 1, out=a)
        w = a.reshape(100, 10).transpose(0, 1)
    assert t.peak_bytes == t.live_bytes == 1000 * FLOAT
    del v, w


def test_tensors_alive_before_the_region_are_not_counted():
    before = torch.randn(4096)
    with PeakTracker() as t:
        before.mul_(2)
        view = before[::2]
        view.zero_()
    assert t.peak_bytes == 0 and t.live_bytes == 0
    del view


def test_tensors_freed_inside_lower_the_live_count_and_temporaries_count_while_alive():
    x = torch.randn(256)
    with PeakTracker() as t:
        for _ in range(5):
            y = x * 2  # the previous y is freed when the name is rebound
        z = (x + 1) * 3  # x + 1 is a temporary alive together with its product
    assert t.live_bytes == 2 * 256 * FLOAT
    assert t.peak_bytes == 3 * 256 * FLOAT  # y, the temporary, z
    del y, z


def test_backward_allocations_are_seen():
    x = torch.randn(64, 64, requires_grad=True)
    with PeakTracker() as t:
        (x @ x).sum().backward()
    assert t.live_bytes >= x.grad.nbytes  # the gradient is created inside and still alive
    assert t.peak_bytes >= x.grad.nbytes + 64 * 64 * FLOAT  # the product is alive with the gradient's pieces


# ------------------------------------------------------------------------------- schedule classes
#: O(local) schedules: peak <= C_LOCAL x (this rank's q + k + v bytes) at every world size; measured
#: 4.0-6.6 at P = 2 and 4 with out, dq, dk, dv, the lse and the kv buffers in flight all counted
C_LOCAL = 8.0
#: ... and the bound does not grow with P: peak / local at P=4 <= the same at P=2 + P_SLACK
P_SLACK = 1.0
SIZES = (32, 64)  # local tokens per rank; S = P x n
SHAPE = {"heads": 8, "kv_heads": 4, "head_dim": 32}
SCHEDULES = [(r["name"], r["memory"]) for r in schedules.available()]


def _class(memory: str) -> str:
    if memory.startswith("O(global kv)"):
        return "global"
    if "plan brings in" in memory:  # ultra: O(local) plus whatever chunks its plan places on this rank
        return "plan"
    assert memory.startswith("O(local)"), memory
    return "local"


def _measure(worlds, world: int, sizes: tuple[int, ...]) -> dict:
    """{(schedule, world, n): (peak bytes of the busiest rank, local q + kv bytes, local kv bytes)}."""
    out = {}
    w = worlds.get(world)
    for name, _ in SCHEDULES:
        mask = "causal" if schedules.get(name).causal else "full"
        for n in sizes:
            res = w.run("memory_workers.peak_fwd_bwd", timeout=120, name=f"memory {name} P={world} n={n}",
                        schedule=name, seq=world * n, mask=mask, **SHAPE)
            assert all(isinstance(r, dict) for r in res), res
            out[name, world, n] = (max(r["peak"] for r in res), res[0]["q"] + res[0]["kv"], res[0]["kv"])
    return out


@pytest.fixture(scope="module")
def peaks(worlds) -> dict:
    """P = 2 at both sizes (growth in the shard, and the class)."""
    return _measure(worlds, 2, SIZES)


def _check_class(name: str, kind: str, peaks: dict, world: int) -> None:
    peak, local, kv = peaks[name, world, SIZES[1]]
    if kind == "local":
        assert peak <= C_LOCAL * local, f"{name} P={world}: peak {peak / local:.2f} x local"
    elif kind == "plan":
        assert peak <= C_LOCAL * local + 2 * (world - 1) * kv, f"{name} P={world}: {peak / local:.2f} x local"
    else:  # holds every rank's kv at once
        assert peak >= world * kv, f"{name} P={world}: peak {peak / kv:.2f} x local kv"


@pytest.mark.parametrize("name,memory", SCHEDULES, ids=[n for n, _ in SCHEDULES])
def test_peak_memory_matches_the_declared_class(name, memory, peaks):
    small, large = peaks[name, 2, SIZES[0]], peaks[name, 2, SIZES[1]]
    # linear in the shard at fixed P: nothing quadratic in the local length (no score matrices)
    assert 1.8 <= large[0] / small[0] <= 2.2, (name, small, large)
    _check_class(name, _class(memory), peaks, 2)


@pytest.fixture(scope="module")
def peaks4(worlds, peaks) -> dict:
    return {**peaks, **_measure(worlds, 4, SIZES[1:])}


@pytest.mark.slow  # a second world size for every schedule; make test keeps the class at P = 2
@pytest.mark.parametrize("name,memory", SCHEDULES, ids=[n for n, _ in SCHEDULES])
def test_peak_memory_keeps_its_class_at_p4(name, memory, peaks4):
    kind = _class(memory)
    _check_class(name, kind, peaks4, 4)
    ratio2 = peaks4[name, 2, SIZES[1]][0] / peaks4[name, 2, SIZES[1]][1]
    ratio4 = peaks4[name, 4, SIZES[1]][0] / peaks4[name, 4, SIZES[1]][1]
    if kind == "local":
        assert ratio4 <= ratio2 + P_SLACK, f"{name}: peak / local {ratio2:.2f} at P=2, {ratio4:.2f} at P=4"
    elif kind == "global":  # two more ranks' kv (and their gradients) held at P=4
        kv_share = peaks4[name, 4, SIZES[1]][2] / peaks4[name, 4, SIZES[1]][1]
        assert ratio4 - ratio2 >= 2 * kv_share, f"{name}: peak / local {ratio2:.2f} at P=2, {ratio4:.2f} at P=4"
