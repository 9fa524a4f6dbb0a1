"""Worker functions for the yunchang stand-in tests (``cpattn.compat.yunchang``): each rank makes yunchang's
groups, cuts its tokens out of the full inputs by yunchang's layout rules (written out here, not cpattn's), runs
``LongContextAttention`` forward and backward and returns its local results, the global token index of each
local row, and whether the call's traffic equals its schedule's ``expected_volume``."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cpattn.compat

cpattn.compat.install("yunchang")

from yunchang import EXTRACT_FUNC_DICT, LongContextAttention, UlyssesAttention, set_seq_parallel_pg  # noqa: E402
from yunchang.globals import PROCESS_GROUP  # noqa: E402


def inputs(seed: int, shape_q: tuple, shape_kv: tuple) -> tuple[torch.Tensor, ...]:
    """q, k, v, dout (float32), the same on every rank and in the parent."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=gen) for s in (shape_q, shape_kv, shape_kv, shape_q))


def their_groups(ud: int, rd: int, world: int, low: bool) -> tuple[list[list[int]], list[list[int]]]:
    """yunchang 0.6.4's Ulysses and ring rank sets, as its set_seq_parallel_pg loops make them."""
    sp = ud * rd
    ulysses, ring = [], []
    for offset in range(0, world, sp):
        if low:
            ulysses += [list(range(i * ud + offset, (i + 1) * ud + offset)) for i in range(rd)]
            ring += [list(range(i + offset, sp + offset, ud)) for i in range(ud)]
        else:
            ring += [list(range(i * rd + offset, (i + 1) * rd + offset)) for i in range(ud)]
            ulysses += [list(range(i + offset, sp + offset, rd)) for i in range(rd)]
    return ulysses, ring


def token_index(impl: str, seq: int, ud: int, rd: int, ring_rank: int, ulysses_rank: int) -> torch.Tensor:
    """yunchang's rule: the ring rank's span (basic: piece r of R; zigzag: chunks r and 2R-1-r of 2R; strip:
    tokens r, r+R, ...), then the Ulysses rank's contiguous part of it (the all-to-all's order)."""
    tokens = torch.arange(seq)
    if impl == "basic":
        span = tokens.reshape(rd, -1)[ring_rank]
    elif impl == "zigzag":
        span = tokens.reshape(2 * rd, -1)[[ring_rank, 2 * rd - 1 - ring_rank]].reshape(-1)
    else:
        span = tokens[ring_rank::rd]
    return span.chunk(ud)[ulysses_rank]


def _traffic_matches(cp, q_local, k_local, run) -> bool:
    cp.reset_comm_stats()
    run()
    expected: dict[str, dict[str, int]] = {}
    for phase in cp.expected_volume(q_local, k_local).values():
        for op, counts in phase.items():
            acc = expected.setdefault(op, {"calls": 0, "bytes_sent": 0, "bytes_recv": 0})
            for key in acc:
                acc[key] += counts[key]
    got = {op: {k: v[k] for k in ("calls", "bytes_sent", "bytes_recv")} for op, v in cp.comm_stats().items()
           if op not in ("total", "levels")}
    return got == expected and sum(v["bytes_sent"] for v in got.values()) > 0


def long_context_cases(cases: list[dict]) -> list[dict]:
    """``cases``: dicts of impl (basic, zigzag, strip), ud, rd, low, causal, seed, b, seq, h, h_kv, d, and
    optionally window_size, softcap, ulysses_layer (UlyssesAttention on the world instead)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    found = []
    for c in cases:
        q, k, v, dout = inputs(c["seed"], (c["b"], c["seq"], c["h"], c["d"]), (c["b"], c["seq"], c["h_kv"], c["d"]))
        if c.get("ulysses_layer"):
            attn = UlyssesAttention()
            idx, groups_ok = token_index("basic", c["seq"], world, 1, 0, rank), True
        else:
            set_seq_parallel_pg(c["ud"], c["rd"], rank, world, use_ulysses_low=c["low"])
            ulysses, ring = their_groups(c["ud"], c["rd"], world, c["low"])
            mine_u = next(g for g in ulysses if rank in g)
            mine_r = next(g for g in ring if rank in g)
            groups_ok = (dist.get_process_group_ranks(PROCESS_GROUP.ULYSSES_PG) == mine_u
                         and dist.get_process_group_ranks(PROCESS_GROUP.RING_PG) == mine_r)
            idx = token_index(c["impl"], c["seq"], c["ud"], c["rd"], mine_r.index(rank), mine_u.index(rank))
            attn = LongContextAttention(ring_impl_type=c["impl"])
        local = [t[:, idx].contiguous() for t in (q, k, v, dout)]
        kwargs = {"causal": c["causal"], "window_size": tuple(c.get("window_size", (-1, -1))),
                  "softcap": c.get("softcap", 0.0)}

        def run(local=local, attn=attn, kwargs=kwargs):
            qq, kk, vv = (t.clone().requires_grad_() for t in local[:3])
            out = attn(qq, kk, vv, **kwargs)
            out.backward(local[3])
            return out.detach(), qq.grad, kk.grad, vv.grad

        out, dq, dk, dv = run()
        cp = next(reversed(attn._objects._items.values()))
        cp = cp[1] if isinstance(cp, tuple) else cp
        extract = None
        if not c.get("ulysses_layer") and c["low"]:  # yunchang's helpers assume the Ulysses groups on the low ranks
            extract = EXTRACT_FUNC_DICT[c["impl"]](q, rank, world, rd=c["rd"], ud=c["ud"])
        found.append({"idx": idx, "out": out, "dq": dq, "dk": dk, "dv": dv, "groups_ok": groups_ok,
                      "schedule": cp.schedule_name, "local_len": cp.local_len,
                      "extract_ok": extract is None or torch.equal(extract, local[0]),
                      "traffic": _traffic_matches(cp, local[0], local[1], run)})
    return found
