"""Worker functions for the yunchang stand-in tests (``cpattn.compat.yunchang``): each rank makes yunchang's
groups, cuts its tokens out of the full inputs by yunchang's layout rules (written out here, not cpattn's), runs
``LongContextAttention`` forward and backward and returns its local results, the global token index of each
local row, and whether the call's traffic equals its schedule's ``expected_volume``."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cpattn.compat

cpattn.compat.install("yunchang")

from compat_workers import _traffic_matches  # noqa: E402
from yunchang import (  # noqa: E402
    EXTRACT_FUNC_DICT,
    LongContextAttention,
    LongContextAttentionQKVPacked,
    UlyssesAttention,
    set_seq_parallel_pg,
)
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
    if impl.startswith("basic"):  # basic and its other kernels (basic_pytorch, ...)
        span = tokens.reshape(rd, -1)[ring_rank]
    elif impl == "zigzag":
        span = tokens.reshape(2 * rd, -1)[[ring_rank, 2 * rd - 1 - ring_rank]].reshape(-1)
    else:
        span = tokens[ring_rank::rd]
    return span.chunk(ud)[ulysses_rank]


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
            attn = LongContextAttentionQKVPacked(ring_impl_type=c["impl"]) if c.get("packed") else \
                LongContextAttention(ring_impl_type=c["impl"])
        local = [t[:, idx].contiguous() for t in (q, k, v, dout)]
        kwargs = {"causal": c["causal"], "window_size": tuple(c.get("window_size", (-1, -1))),
                  "softcap": c.get("softcap", 0.0)}

        def run(local=local, attn=attn, kwargs=kwargs):
            if isinstance(attn, LongContextAttentionQKVPacked):
                qkv = torch.stack(local[:3], dim=2).requires_grad_()
                out = attn(qkv, **kwargs)
                out.backward(local[3])
                return out.detach(), *qkv.grad.unbind(2)
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


def _hf_call(attention, local, causal=True, softcap=None, sliding_window=None):
    """Forward and backward of the substituted ``_flash_attention_forward`` on this rank's ``[b, s, h, d]``."""
    qq, kk, vv = (t.clone().requires_grad_() for t in local[:3])
    out = attention(qq, kk, vv, None, query_length=qq.shape[1], is_causal=causal, softcap=softcap,
                    sliding_window=sliding_window)
    out.backward(local[3])
    return out.detach(), qq.grad, kk.grad, vv.grad


def schedules_behind_the_hf_adapter(lengths: list[int], b: int, h: int, h_kv: int, d: int, seed: int,
                                    requests: list[str | None], refused: str) -> dict:
    """``substitute_hf_flash_attn`` with ``$CPATTN_SCHEDULE`` set to each of ``requests`` (None: unset), the same
    documents and a ``[b, S/P, h, d]`` contiguous slice of them per rank (rows sharing ``DATA_PARAMS``): per
    request the schedule that ran, the local out and gradients, and the bytes ``cpattn.compat.comm_stats``
    counted against the object's own; the cost model's choice for the case, made here from
    ``cpattn.cost.choose`` over the schedules that run on a contiguous slice; and the error a schedule that
    needs another layout raises (``refused``)."""
    import os

    import transformers.modeling_flash_attention_utils as fa_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from cpattn import cost, schedules
    from cpattn.compat.ring_flash_attn import _calls, substitute_hf_flash_attn, update_ring_flash_attn_params
    from cpattn.core.layout import Layout
    from cpattn.core.masks import document

    rank, world = dist.get_rank(), dist.get_world_size()
    seq = sum(lengths)
    q, k, v, dout = inputs(seed, (b, seq, h, d), (b, seq, h_kv, d))
    n = seq // world
    local = [t[:, rank * n:(rank + 1) * n].contiguous() for t in (q, k, v, dout)]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    saved = fa_utils._flash_attention_forward, ALL_ATTENTION_FUNCTIONS["flash_attention_2"]
    env = os.environ.get(_calls.SCHEDULE_ENV)
    substitute_hf_flash_attn(None, heads_k_stride=1)
    found: dict = {"runs": []}
    try:
        for request in requests:
            if request is None:
                os.environ.pop(_calls.SCHEDULE_ENV, None)
            else:
                os.environ[_calls.SCHEDULE_ENV] = request
            update_ring_flash_attn_params(cu_seqlens, None)
            cpattn.compat.reset_comm_stats()
            out, dq, dk, dv = _hf_call(fa_utils._flash_attention_forward, local)
            cp = _calls._OBJECTS.get(next(reversed(_calls._OBJECTS._items)), None)
            moved = [(t["bytes_sent"], t["bytes_recv"]) for t in (cpattn.compat.comm_stats()["total"],
                                                                   cp.comm_stats()["total"])]
            found["runs"].append({"request": request, "schedule": cp.schedule_name, "out": out, "dq": dq, "dk": dk,
                                  "dv": dv, "compat_bytes": moved[0], "object_bytes": moved[1]})
        mask = document(lengths, causal=True)
        names = [name for name in cost.default_candidates(mask) if cost.declares_steps(name)
                 and (schedules.get(name).custom_layout or schedules.get(name).layout_for(mask) == "contiguous")]
        problem = cost.Problem(seq, world, mask, batch=b, heads=h, kv_heads=h_kv, head_dim=d, dtype="float32",
                               layout=Layout("contiguous"))
        found["cost_model"] = cost.choose(problem, cost.presets.this_machine(world, "test"), names)[0]
        os.environ[_calls.SCHEDULE_ENV] = refused
        update_ring_flash_attn_params(cu_seqlens, None)
        try:
            _hf_call(fa_utils._flash_attention_forward, local)
            found["refused"] = None
        except ValueError as exc:
            found["refused"] = str(exc)
    finally:
        fa_utils._flash_attention_forward, ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = saved
        if env is None:
            os.environ.pop(_calls.SCHEDULE_ENV, None)
        else:
            os.environ[_calls.SCHEDULE_ENV] = env
    return found


def layer_schedules(ud: int, rd: int, impl: str, layout: str, seq: int, h: int, h_kv: int, d: int, seed: int,
                    requests: list, refused: str) -> dict:
    """``LongContextAttention(ring_impl_type=impl, schedule=request)`` for each of ``requests`` on yunchang's
    ``ud x rd`` groups (Ulysses on the low ranks), causal: per request the schedule that ran, out and gradients;
    the cost model's choice among the schedules that run on ``layout`` (the name of the layout these tokens
    form, as the test knows it); the error ``refused`` raises. Then ``ring_flash_attn_varlen_func`` with
    ``$CPATTN_SCHEDULE=usp`` against its own ``ring``: the schedules that ran and the largest difference."""
    import os

    from cpattn import cost, schedules
    from cpattn.compat.ring_flash_attn import _calls
    from cpattn.core.layout import Layout
    from cpattn.core.masks import causal

    rank, world = dist.get_rank(), dist.get_world_size()
    set_seq_parallel_pg(ud, rd, rank, world)
    q, k, v, dout = inputs(seed, (1, seq, h, d), (1, seq, h_kv, d))
    idx = token_index(impl, seq, ud, rd, rank // ud, rank % ud)
    local = [t[:, idx].contiguous() for t in (q, k, v, dout)]
    found: dict = {"idx": idx, "runs": []}
    for request in requests:
        attn = LongContextAttention(ring_impl_type=impl, schedule=request)
        qq, kk, vv = (t.clone().requires_grad_() for t in local[:3])
        out = attn(qq, kk, vv, causal=True)
        out.backward(local[3])
        cp = next(reversed(attn._objects._items.values()))
        cp = cp[1] if isinstance(cp, tuple) else cp
        found["runs"].append({"schedule": cp.schedule_name, "out": out.detach(), "dq": qq.grad, "dk": kk.grad,
                              "dv": vv.grad})
    names = [n for n in cost.default_candidates(causal()) if cost.declares_steps(n)
             and (schedules.get(n).custom_layout or schedules.get(n).layout_for(causal()) == layout)]
    problem = cost.Problem(seq, world, causal(), batch=1, heads=h, kv_heads=h_kv, head_dim=d, dtype="float32",
                           layout=Layout(layout))
    found["cost_model"] = cost.choose(problem, cost.presets.this_machine(world, "test"), names)[0]
    try:
        LongContextAttention(ring_impl_type=impl, schedule=refused)(*local[:3], causal=True)
        found["refused"] = None
    except ValueError as exc:
        found["refused"] = str(exc)

    ring_flash_attn = cpattn.compat.install("ring_flash_attn")
    lengths = [4 * world, 8 * world, 4 * world]
    tokens = sum(lengths)
    q, k, v, _ = inputs(seed + 1, (tokens, h, d), (tokens, h_kv, d))
    mine = torch.cat([torch.arange(a + rank * (n // world), a + (rank + 1) * (n // world))
                      for a, n in zip([0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]], lengths)])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32) // world
    outs, ran = [], []
    env = os.environ.pop(_calls.SCHEDULE_ENV, None)
    try:
        for request in (None, "usp"):
            if request is not None:
                os.environ[_calls.SCHEDULE_ENV] = request
            outs.append(ring_flash_attn.ring_flash_attn_varlen_func(q[mine], k[mine], v[mine], cu, 0, causal=True))
            ran.append(_calls._OBJECTS.get(next(reversed(_calls._OBJECTS._items)), None).schedule_name)
    finally:
        os.environ.pop(_calls.SCHEDULE_ENV, None)
        if env is not None:
            os.environ[_calls.SCHEDULE_ENV] = env
    found["varlen"] = {"schedules": ran, "difference": float((outs[0] - outs[1]).abs().max())}
    return found


def groups_and_errors() -> dict:
    """A layer made under ``set_seq_parallel_pg(1, 2)`` keeps those groups after ``set_seq_parallel_pg(2, 1)`` (as
    yunchang's layers keep the groups they read when made); the errors of a zigzag length the layout cannot cut and
    of dropout, as each rank sees them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    set_seq_parallel_pg(1, world, rank, world)
    ring_layer = LongContextAttention()
    set_seq_parallel_pg(world, 1, rank, world)
    ulysses_layer = LongContextAttention()
    q = torch.randn(1, 8, 4, 8)
    found = {}
    for name, layer in (("ring", ring_layer), ("ulysses", ulysses_layer)):
        layer(q, q, q, causal=True)
        cp = next(reversed(layer._objects._items.values()))
        found[name] = (cp[1] if isinstance(cp, tuple) else cp).schedule_name
    set_seq_parallel_pg(1, world, rank, world)
    for name, call in (("zigzag", lambda: LongContextAttention(ring_impl_type="zigzag")(q[:, :3], q[:, :3], q[:, :3])),
                       ("dropout", lambda: ring_layer(q, q, q, dropout_p=0.1))):
        try:
            call()
            found[name] = None
        except (ValueError, NotImplementedError) as exc:
            found[name] = f"{type(exc).__name__}: {exc}"
    return found
