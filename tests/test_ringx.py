"""RingX: the hierarchical variants and collectives against the flat ones, the functional entry points and
one regression test per defect listed in ringx.md. Each variant's exactness over world sizes 1-4 and a
subgroup is in test_exactness.py's registry-driven matrix; its bidirectional masks in test_masks.py.
Module-level functions taking keyword arguments run on the worker ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cpattn
from cpattn import exactness
from cpattn.core.comm import Communicator
from cpattn.core.steps import Problem
from cpattn.cost import Topology
from cpattn.launcher import RankError

VARIANTS = ["ringx1", "ringx1o", "ringx2", "ringx2o", "ringx3", "ringx3b", "ringx4", "ringx4o"]
BIDIRECTIONAL_ONLY = ["ringx1", "ringx1o", "ringx3b"]
CAUSAL_ONLY = ["ringx2", "ringx2o", "ringx3", "ringx4", "ringx4o"]


def mask_of(schedule: str) -> str:
    return "full" if schedule in BIDIRECTIONAL_ONLY else "causal"


def check_all(worlds, cases: list[exactness.Case]) -> None:
    failed = [r.describe() for r in (exactness.run(worlds.get(c.world), c) for c in cases) if not r.passed]
    assert not failed, "\n".join(failed)


# ---------------------------------------------------------------------------------- worker side
def hierarchy_vs_flat(nodes: int, devices_per_node: int) -> dict:
    """Flat and hierarchical all-gather / reduce-scatter of the same inputs on this rank, with counts."""
    topo = Topology(nodes, devices_per_node)
    flat, hier = Communicator(), Communicator()
    p, r = flat.world_size, flat.rank
    g = torch.Generator().manual_seed(100 + r)
    t = torch.randn(3, 5, generator=g)
    ints = torch.randint(-8, 8, (p, 3, 5), generator=g).to(torch.float32)  # sums of these are exact
    wide = torch.randn(p, 3, 5, generator=g, dtype=torch.float64)
    res, counts = {}, {}

    def both(op: str, make_out, flat_fn, hier_fn, *args) -> None:
        for name, comm, fn in (("flat", flat, flat_fn), ("hier", hier, hier_fn)):
            before = comm.stats()  # not reset: that would also reset the levels' counts
            res[op, name] = make_out()
            fn(res[op, name], *args)
            counts[op, name] = {kind: {k: v - before.get(kind, {}).get(k, 0) for k, v in c.items()}
                                for kind, c in comm.stats().items() if kind != "total"}

    nan = float("nan")
    both("gather", lambda: torch.full((p, 3, 5), nan), flat.all_gather,
         lambda o, x: hier.hierarchical_all_gather(o, x, topo), t)
    both("gather_async", lambda: torch.full((p, 3, 5), nan), flat.all_gather,
         lambda o, x: hier.hierarchical_all_gather(o, x, topo, async_op=True).wait(), t)
    both("scatter_ints", lambda: torch.full((3, 5), nan), flat.reduce_scatter,
         lambda o, x: hier.hierarchical_reduce_scatter(o, x, topo), ints)
    both("scatter_wide", lambda: torch.full((3, 5), nan, dtype=torch.float64), flat.reduce_scatter,
         lambda o, x: hier.hierarchical_reduce_scatter(o, x, topo, async_op=True).wait(), wide)
    rail, node = hier.hierarchy(topo)
    trivial = [hier.hierarchy(tp) is None for tp in (None, Topology(1, p), Topology(p, 1))]
    try:
        hier.hierarchy(Topology(p, 2))
        mismatch = ""
    except ValueError as exc:
        mismatch = str(exc)
    return {
        "rank": r,
        "gather_equal": torch.equal(res["gather", "flat"], res["gather", "hier"]),
        "gather_async_equal": torch.equal(res["gather_async", "flat"], res["gather_async", "hier"]),
        "gather_is_rank_order": torch.equal(res["gather", "hier"][r], t),
        "scatter_ints_equal": torch.equal(res["scatter_ints", "flat"], res["scatter_ints", "hier"]),
        "scatter_wide_close": torch.allclose(res["scatter_wide", "flat"], res["scatter_wide", "hier"],
                                             rtol=1e-12, atol=1e-12),
        "same_counts": all(counts[op, "flat"] == counts[op, "hier"] for op, _ in counts),
        "rail_size": rail.world_size, "node_size": node.world_size,
        "rail": rail.stats(), "node": node.stats(),
        "trivial_is_flat": all(trivial), "mismatch": mismatch,
    }


def x3_levels(schedule: str, nodes: int, devices_per_node: int) -> dict:
    """Run ``schedule`` with a topology; report what its rail and node levels counted."""
    topo = Topology(nodes, devices_per_node)
    p = dist.get_world_size()
    cp = cpattn.ContextParallel(8 * p, mask_of(schedule), schedule, topology=topo)
    q, k, v = (torch.randn(1, 8, 2, 8, requires_grad=True) for _ in range(3))
    cp.attention(q, k, v).sum().backward()
    rail, node = cp.comm.hierarchy(topo)
    return {"rail": rail.stats(), "node": node.stats()}


def reject_mask(schedule: str, mask: str) -> dict:
    """Ask ``schedule`` for ``mask`` via the class and the functional entry point; report the errors,
    then prove every rank is still in step with one all-reduce."""
    errors = []
    x = torch.randn(1, 8, 2, 4)
    for call in (lambda: cpattn.ContextParallel(8 * dist.get_world_size(), mask, schedule),
                 lambda: getattr(cpattn, f"{schedule}_attn_func")(x, x, x, causal=mask == "causal")):
        try:
            call()
            errors.append(None)
        except Exception as exc:  # the point: report what was raised
            errors.append((type(exc).__name__, str(exc)))
    one = torch.ones(1)
    dist.all_reduce(one)
    return {"errors": errors, "in_step": one.item() == dist.get_world_size()}


def outputs_survive_second_call(schedule: str) -> dict:
    """float32 attention twice: the first call's output and gradients must not change in the second."""
    p = dist.get_world_size()
    cp = cpattn.ContextParallel(16 * p, mask_of(schedule), schedule)
    g = torch.Generator().manual_seed(dist.get_rank())

    def call():
        q, k, v = (torch.randn(2, 16, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
        out = cp.attention(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=g))
        return (out, *grads)

    first = call()
    kept = [t.detach().clone() for t in first]
    second = call()
    return {"unchanged": all(torch.equal(a, b) for a, b in zip(first, kept)),
            "distinct": not any(a.data_ptr() == b.data_ptr() for a in first for b in second)}


def backward_counts(schedule: str) -> dict:
    """This rank's communication counts of one backward, and the size of its float32 dk/dv."""
    p, r = dist.get_world_size(), dist.get_rank()
    cp = cpattn.ContextParallel(12 * p, "causal", schedule)
    q, k, v = (torch.randn(2, 12, h, 8, requires_grad=True) for h in (4, 2, 2))
    out = cp.attention(q, k, v)
    cp.reset_comm_stats()
    out.backward(torch.randn(out.shape))
    return {"rank": r, "world": p, "stats": cp.comm_stats(), "dkv_bytes": 2 * k.numel() * 4}


def functional_matches(schedule: str) -> bool:
    """``cpattn.<schedule>_attn_func`` gives the same output and lse as ContextParallel."""
    p = dist.get_world_size()
    mask = mask_of(schedule)
    cp = cpattn.ContextParallel(16 * p, mask, schedule)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 16, h, 8, generator=g) for h in (4, 2, 2))
    out, lse = cp.attention(q, k, v, return_lse=True)
    func = getattr(cpattn, f"{schedule}_attn_func")
    out_f, lse_f, none = func(q, k, v, causal=mask == "causal", return_attn_probs=True)
    return torch.equal(out, out_f) and torch.equal(lse, lse_f) and none is None


def functional_window(schedule: str, causal: bool, window_size: tuple[int, int], layout: str) -> float:
    """``<schedule>_attn_func(..., causal, window_size)`` on inputs in ``layout`` against a float64 dense
    reference built here from flash-attn's rule (keys i - left .. i + right; causal: right = 0). Returns
    the worst relative error of this rank's output."""
    p, r = dist.get_world_size(), dist.get_rank()
    seq = 12 * p
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(1, seq, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    func = getattr(cpattn, f"{schedule}_attn_func")
    local = cpattn.layout.Layout(layout).positions(seq, p, r)
    out = func(*(t[:, local].float() for t in (q, k, v)), causal=causal, window_size=window_size)
    left, right = window_size
    right = 0 if causal else right
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    allowed = torch.ones(seq, seq, dtype=torch.bool)
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) / 8 ** 0.5
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vv)[:, local]
    return float((out.double() - ref).abs().max() / ref.abs().max())


def poison_is_on() -> bool:
    return bool(Communicator.new_buffer((4,), torch.float32, "cpu").isnan().all())


# ---------------------------------------------------------------------------------- exactness
def hierarchical_cases() -> list[exactness.Case]:
    """X3 and X3b on 2 nodes x 2 devices and on 2 x 4 (zigzag over 8 ranks needs seq % 16 == 0)."""
    cases = []
    for name in ("ringx3", "ringx3b"):
        for world, topology, seq in ((4, (2, 2), 48), (8, (2, 4), 64)):
            for dtype, (h, hkv) in (("float32", (4, 4)), ("bfloat16", (8, 2))):
                cases.append(exactness.Case(name, world, mask_of(name), dtype, seq=seq, heads=h, kv_heads=hkv,
                                         topology=topology, seed=200 + len(cases)))
    return cases


HIERARCHICAL = hierarchical_cases()


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow)
                                  if c.world == 8 and (c.dtype == "bfloat16" or c.schedule == "ringx3b")
                                  else c for c in HIERARCHICAL], ids=[c.label for c in HIERARCHICAL])
def test_hierarchical_x3_is_exact(worlds, case):  # 8 ranks: ringx3 in float32 here, the rest in the slow suite
    result = exactness.run(worlds.get(case.world), case)
    assert result.passed, result.describe()


@pytest.mark.parametrize("nodes,devices", [(2, 2), (2, 4)])
def test_hierarchical_collectives_equal_flat(worlds, nodes, devices):
    results = worlds.get(nodes * devices).run(hierarchy_vs_flat, timeout=60, nodes=nodes, devices_per_node=devices)
    n = 3 * 5 * 4  # bytes of the tensor each rank contributes (or keeps)
    for r in results:
        assert not isinstance(r, RankError), f"{r}\n{getattr(r, 'traceback', '')}"
        assert r["gather_equal"] and r["gather_async_equal"] and r["gather_is_rank_order"], r
        assert r["scatter_ints_equal"] and r["scatter_wide_close"], r
        assert r["same_counts"], "the parent must count the flat payload, one call per collective"
        assert (r["rail_size"], r["node_size"]) == (nodes, devices)
        # two gathers of n bytes: (N-1) n along the rail, then (D-1) N n inside the node
        assert r["rail"]["all_gather"] == {"calls": 2, "bytes_sent": 2 * (nodes - 1) * n,
                                           "bytes_recv": 2 * (nodes - 1) * n}
        assert r["node"]["all_gather"] == {"calls": 2, "bytes_sent": 2 * (devices - 1) * nodes * n,
                                           "bytes_recv": 2 * (devices - 1) * nodes * n}
        # reduce-scatters of float32 then float64 slices: inside the node first, then along the rail
        keep = n + 2 * n
        assert r["node"]["reduce_scatter"]["bytes_sent"] == (devices - 1) * nodes * keep
        assert r["rail"]["reduce_scatter"]["bytes_sent"] == (nodes - 1) * keep
        assert r["trivial_is_flat"] and "topology" in r["mismatch"]


@pytest.mark.parametrize("name", ["ringx3", "ringx3b"])
def test_x3_runs_both_levels(worlds, name):
    """One gather per phase and one reduce-scatter go through the rails and the nodes."""
    for r in worlds.get(4).run(x3_levels, timeout=60, schedule=name, nodes=2, devices_per_node=2):
        assert not isinstance(r, RankError), r
        for level in ("rail", "node"):
            assert r[level]["all_gather"]["calls"] == 2 and r[level]["reduce_scatter"]["calls"] == 1, r


def test_volumes_are_not_vacuous():
    """At P > 1 every variant declares traffic in both phases, and at P = 1 none but X3's empty gathers."""
    for name in VARIANTS:
        sched = cpattn.schedules.get(name)
        shape = Problem(32, 4, "causal" if sched.causal else "full", batch=2, heads=4, kv_heads=2, head_dim=16,
                        dtype="bfloat16")
        for rank in range(4):
            vol = sched.volume(shape, rank)
            for phase in ("forward", "backward"):
                assert sum(v["bytes_sent"] + v["bytes_recv"] for v in vol[phase].values()) > 0, (name, phase)
        one = Problem(32, 1, shape.mask, batch=2, heads=4, kv_heads=2, head_dim=16, dtype="bfloat16")
        single = sched.volume(one, 0)
        assert all(v["bytes_sent"] == v["bytes_recv"] == 0 for ph in single.values() for v in ph.values())


def test_registry_declares_masks():
    rows = {row["name"]: row for row in cpattn.schedules.available()}
    for name in BIDIRECTIONAL_ONLY:
        assert rows[name]["bidirectional"] and not rows[name]["causal"]
    for name in CAUSAL_ONLY:
        assert rows[name]["causal"] and not rows[name]["bidirectional"]
        assert rows[name]["masks"] == "any"  # any mask contained in causal (documents, windows, ...)


@pytest.mark.parametrize("schedule", VARIANTS)
def test_functional_entry_point(worlds, schedule):
    assert worlds.get(2).run(functional_matches, timeout=60, schedule=schedule) == [True, True]


@pytest.mark.parametrize("schedule,causal,window,layout", [
    ("ring", True, (5, 0), "contiguous"), ("ring", True, (5, 3), "contiguous"), ("ring", False, (3, 3), "contiguous"),
    ("ring", False, (6, 0), "contiguous"), ("zigzag_ring", True, (4, -1), "zigzag"),
    ("ringx3b", False, (4, 4), "contiguous"), ("ulysses", True, (7, -1), "contiguous"),
    ("ringx1", False, (2, 2), "contiguous"), ("allgather", False, (-1, 0), "zigzag"),
])
def test_functional_window_size(worlds, schedule, causal, window, layout):
    """flash-attn's window_size maps onto the sliding-window mask; exact against a dense reference."""
    errors = worlds.get(2).run(functional_window, timeout=60, schedule=schedule, causal=causal,
                               window_size=window, layout=layout)
    assert max(errors) < 1e-5, errors


# ---------------------------------------------------------------------------------- the release's defects
@pytest.mark.parametrize("schedule", BIDIRECTIONAL_ONLY)
def test_bidirectional_variants_reject_causal(worlds, schedule):
    """Raised by every rank, identically, before any communication (the ranks are still in step)."""
    results = worlds.get(2).run(reject_mask, timeout=60, schedule=schedule, mask="causal")
    assert all(not isinstance(r, RankError) for r in results), results
    assert results[0]["errors"] == results[1]["errors"] and all(r["in_step"] for r in results)
    for kind, message in results[0]["errors"]:
        assert kind == "ValueError" and schedule in message and "bidirectional-only" in message


@pytest.mark.parametrize("schedule", CAUSAL_ONLY)
def test_causal_variants_reject_bidirectional(worlds, schedule):
    results = worlds.get(2).run(reject_mask, timeout=60, schedule=schedule, mask="full")
    assert results[0]["errors"] == results[1]["errors"] and all(r["in_step"] for r in results)
    for kind, message in results[0]["errors"]:
        assert kind == "ValueError" and schedule in message and "causal-only" in message


def test_causal_backward_is_exact(worlds):
    """dq, dk, dv of every causal variant on an odd world with GQA and a longer sequence."""
    check_all(worlds, [exactness.Case(name, 3, "causal", heads=6, kv_heads=2, seq=96, seed=300)
                       for name in CAUSAL_ONLY])


def test_accumulators_are_zeroed(worlds):
    """Fresh buffers are NaN in the test worlds, so a sum over an unwritten buffer cannot pass."""
    assert worlds.get(4).run(poison_is_on, timeout=30) == [True] * 4
    check_all(worlds, [exactness.Case(name, 4, mask_of(name), heads=8, kv_heads=2, seq=64, seed=400)
                       for name in VARIANTS])


def test_subgroup_with_nonzero_global_ranks(worlds):
    """Group ranks differ from global ranks in (1, 3) and (1, 2, 3): every rank test must be group-relative."""
    check_all(worlds, [exactness.Case(name, 4, mask_of(name), seq=48, group=group, seed=500)
                       for name in VARIANTS for group in ((1, 3), (1, 2, 3))])


@pytest.mark.parametrize("schedule", VARIANTS)
def test_float32_output_does_not_alias(worlds, schedule):
    results = worlds.get(2).run(outputs_survive_second_call, timeout=60, schedule=schedule)
    assert results == [{"unchanged": True, "distinct": True}] * 2


@pytest.mark.parametrize("schedule", ["ringx2", "ringx2o"])
def test_x2_backward_reduces_only_dk_dv(worlds, schedule):
    """Owner i < P-1 gets dk_i/dv_i reduced (rank P-1 computes its own alone); dq is never reduced."""
    for r in worlds.get(4).run(backward_counts, timeout=60, schedule=schedule):
        assert not isinstance(r, RankError), r
        p, rank, dkv, stats = r["world"], r["rank"], r["dkv_bytes"], r["stats"]
        owners = p - 1
        owns = int(rank < p - 1)
        assert stats["reduce"] == {"calls": owners, "bytes_sent": (owners - owns) * dkv, "bytes_recv": owns * dkv}
        assert set(stats) == {"broadcast", "reduce", "total"}
