"""Functions the tests run on worker processes (importable by spawned workers)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import cpattn


def sleep_on(rank: int, seconds: float) -> int:
    if dist.get_rank() == rank:
        time.sleep(seconds)
    return dist.get_rank()


def exit_on(rank: int) -> int:
    if dist.get_rank() == rank:
        os._exit(3)
    return dist.get_rank()


def raise_on(rank: int) -> int:
    if dist.get_rank() == rank:
        raise KeyError("boom")
    return dist.get_rank()


BAD_INPUTS = {
    "seq_not_positive": "seq_len",
    "ulysses_heads": "degrees <= 3 that divide 4",
    "mask_not_supported": "causal-only",
    "layout_not_supported": "runs only on its own",
    "document_lengths": "document lengths sum to",
    "heads_not_divisible": "multiple of key/value heads",
    "dtype_mismatch": "dtypes differ",
    "shape_mismatch": "k and v shapes differ",
    "batch_mismatch": "batch differs",
    "head_dim_mismatch": "head_dim differs",
    "wrong_local_len": "local tokens",
    "not_4d": "batch, seq, heads, head_dim",
    "bad_scale": "softmax_scale",
    "bad_dtype": "not supported",
    "unknown_schedule": "unknown",
    "unknown_mask": "accepted",
    "dropout": "dropout",
    "window": "window_size",
}


def bad_input(problem: str, schedule: str = "ring") -> dict:
    """Build a bad call on every rank; report the error and how much was communicated before it."""
    p = dist.get_world_size()
    seq = 8 * p
    kwargs = {"seq_len": seq, "mask": "causal", "schedule": schedule}
    if problem == "seq_not_positive":
        kwargs["seq_len"] = 0
    if problem == "ulysses_heads":
        kwargs["schedule"] = "ulysses"
    if problem == "mask_not_supported":
        kwargs.update(schedule="ringx4", mask=cpattn.masks.sliding_window(4, causal=False))
    if problem == "layout_not_supported":
        kwargs.update(schedule="stripe_ring", layout="balanced")
    if problem == "document_lengths":
        kwargs["mask"] = cpattn.masks.document([3, seq])
    if problem == "unknown_schedule":
        kwargs["schedule"] = "tree"
    if problem == "unknown_mask":
        kwargs["mask"] = "diagonal"
    s = seq // p
    q = torch.randn(2, s, 4, 16)
    k = torch.randn(2, s, 2, 16)
    v = torch.randn(2, s, 2, 16)
    scale = None
    if problem == "heads_not_divisible":
        k, v = torch.randn(2, s, 3, 16), torch.randn(2, s, 3, 16)
    elif problem == "dtype_mismatch":
        k = k.to(torch.bfloat16)
    elif problem == "shape_mismatch":
        v = torch.randn(2, s, 2, 8)
    elif problem == "batch_mismatch":
        q = torch.randn(3, s, 4, 16)
    elif problem == "head_dim_mismatch":
        q = torch.randn(2, s, 4, 8)
    elif problem == "wrong_local_len":
        q = torch.randn(2, s + 1, 4, 16)
    elif problem == "not_4d":
        q = torch.randn(2, s, 64)
    elif problem == "bad_scale":
        scale = -1.0
    elif problem == "bad_dtype":
        q, k, v = q.to(torch.int32), k.to(torch.int32), v.to(torch.int32)
    cp = None
    try:
        if problem == "dropout":
            cpattn.ring_attn_func(q, k, v, dropout_p=0.1)
        elif problem == "window":
            cpattn.ring_attn_func(q, k, v, window_size=(4, 2))
        else:
            cp = cpattn.ContextParallel(**kwargs)
            cp.attention(q, k, v, softmax_scale=scale)
    except Exception as exc:  # the point: report what was raised
        calls = cp.comm_stats()["total"]["calls"] if cp is not None else 0
        return {"type": type(exc).__name__, "message": str(exc), "calls": calls}
    return {"type": None, "message": "", "calls": cp.comm_stats()["total"]["calls"] if cp else 0}


def api_roundtrip(schedule: str) -> dict:
    """shard/unshard/positions round-trip and the functional entry point on this rank."""
    p, r = dist.get_world_size(), dist.get_rank()
    seq = 8 * p
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, seq, 4, 16, generator=g)
    cp = cpattn.ContextParallel(seq, "causal", schedule)
    local = cp.shard(x)
    pos = cp.positions()
    q = cp.shard(torch.randn(2, seq, 4, 16, generator=g))
    kv = cp.shard(torch.randn(2, seq, 2, 16, generator=g))
    out_cp = cp.attention(q, kv, kv)
    before = cp.comm_stats()["total"]
    full = cp.unshard(local)
    func = getattr(cpattn, f"{schedule}_attn_func")
    out_f, lse_f, none = func(q, kv, kv, causal=True, return_attn_probs=True)
    return {"rank": r, "roundtrip": torch.equal(full, x), "positions": pos.tolist(),
            "shard_matches": torch.equal(local, x[:, pos]), "functional_matches": torch.equal(out_cp, out_f),
            "lse_shape": tuple(lse_f.shape), "third": none, "unshard_not_counted": cp.comm_stats()["total"] == before,
            "attention_counted": before["calls"] > 0}


def distributed_merge_check(owner: int) -> dict:
    """Keys split over the ranks; each rank attends to its share; the executor's distributed merge
    (``LseMax``, an all_reduce max, ``Weigh``, two reduces, ``Land``) merges onto ``owner``. Rank 1 (if
    any) sees no key at all for the first query rows (lse -inf) to exercise the empty case."""
    from cpattn.core.comm import Communicator
    from cpattn.core.executor import Accumulators, Runtime, execute
    from cpattn.core.layout import Layout
    from cpattn.core.steps import CommOp, Land, LseMax, Step, Weigh, Zeros

    comm = Communicator()
    p, r = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 5, 2, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, 4 * p, 2, 4, generator=g, dtype=torch.float64)
    v = torch.randn(1, 4 * p, 2, 4, generator=g, dtype=torch.float64)
    allowed = torch.ones(5, 4 * p, dtype=torch.bool)
    allowed[0] = False  # a row nobody covers: must end as out 0, lse -inf
    allowed[1, 4:] = False  # a row only rank 0 covers
    s = torch.einsum("bqhd,bkhd->bhqk", q, k).masked_fill(~allowed, float("-inf"))
    full_lse = torch.logsumexp(s, -1)
    full_out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1).nan_to_num(0.0), v)
    mine = s[..., 4 * r:4 * (r + 1)]
    lse = torch.logsumexp(mine, -1)
    probs = torch.exp(mine - torch.where(lse.isinf(), 0.0, lse)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v[:, 4 * r:4 * (r + 1)])
    part = Accumulators(q)
    part.out.copy_(out)
    part.lse.copy_(lse)
    steps = [Step(before=(LseMax("part", "m"),), comm=(CommOp("all_reduce", 0, send="m", reduce_op="max"),)),
             Step(before=(Weigh("part", "m", "num", "den"),),
                  comm=(CommOp("reduce", 0, root=owner, send="num"), CommOp("reduce", 0, root=owner, send="den"))),
             Step(before=(Zeros("out", "q", output=True),), after=(Land(owner, "num", "den", "m", "out"),))]
    rt = Runtime(comm, cpattn.masks.full(), Layout("contiguous"), 4 * p)
    acc = execute(rt, steps, {"part": part, "q": q}, lambda _: None, keep=("out",))["out"]
    if r != owner:
        return {"rank": r, "owner": False}
    o, lse_m = acc.out, acc.lse
    return {"rank": r, "owner": True, "out_err": float((o - full_out).abs().max()),
            "lse_ok": bool(torch.equal(lse_m.isinf(), full_lse.isinf())),
            "lse_err": float((lse_m[~lse_m.isinf()] - full_lse[~full_lse.isinf()]).abs().max()),
            "nan": bool(o.isnan().any() or lse_m.isnan().any())}



# ---------------------------------------------------------------------------------- ranks that disagree
#: what each mismatch gives rank 1 (the others get the defaults), and the field the error must name
MISMATCHES = {
    "seq_len": ({"seq_len": 48}, "seq_len differs"),
    "schedule": ({"schedule": "ringx4o"}, "schedule differs"),
    "mask": ({"mask": "full"}, "mask differs"),
    "layout": ({"layout": "balanced"}, "layout differs"),
    "check": ({"check": "always"}, "check differs"),
    "dtype": ({"dtype": torch.float64}, "differs"),
    "batch": ({"batch": 3}, "q differs"),
    "requires_grad": ({"requires_grad": False}, "requires_grad"),
    "scale": ({"softmax_scale": 0.5}, "softmax_scale differs"),
    "invalid_heads": ({"kv_heads": 3}, "multiple of key/value heads"),
    "invalid_schedule": ({"schedule": "tree"}, "unknown"),
}


def mismatch(problem: str, schedule: str = "allgather") -> dict:
    """Rank 1 is given something different (:data:`MISMATCHES`); report what each rank raised, and
    how long it took."""
    args = {"seq_len": 32, "schedule": schedule, "mask": "causal", "layout": None, "check": "first",
            "dtype": torch.float32, "batch": 2, "requires_grad": True, "softmax_scale": None, "kv_heads": 2}
    if dist.get_rank() == 1:
        args.update(MISMATCHES[problem][0])
    start = time.perf_counter()
    try:
        cp = cpattn.ContextParallel(args["seq_len"], args["mask"], args["schedule"], layout=args["layout"],
                                    check=args["check"])
        s = cp.local_len
        q = torch.randn(args["batch"], s, 4, 16, dtype=args["dtype"], requires_grad=args["requires_grad"])
        k = torch.randn(args["batch"], s, args["kv_heads"], 16, dtype=args["dtype"])
        out = cp.attention(q, k, k.clone(), softmax_scale=args["softmax_scale"])
        out.sum().backward() if out.requires_grad else None
    except Exception as exc:  # the point: every rank reports what it raised
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - start}
    return {"type": None, "message": "", "seconds": time.perf_counter() - start}


def diverge_later(check: str) -> dict:
    """Same signature on the first call; on the second, rank 1's batch differs. Only check="always"
    sees it before the schedule's traffic (the test runs this with a short timeout for "always" only)."""
    cp = cpattn.ContextParallel(32, "causal", "ring", check=check)
    s = cp.local_len
    q = torch.randn(2, s, 4, 16)
    cp.attention(q, q, q)
    batch = 3 if dist.get_rank() == 1 else 2
    q = torch.randn(batch, s, 4, 16)
    try:
        cp.attention(q, q, q)
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}


def check_cost(calls: int = 200) -> dict:
    """Seconds per attention call (tiny, forward only) with check="off", "first" and "always"."""
    out = {}
    for mode in ("off", "first", "always", "off"):
        cp = cpattn.ContextParallel(64, "causal", "ring", check=mode)
        q = torch.randn(1, cp.local_len, 2, 16)
        cp.attention(q, q, q)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            cp.attention(q, q, q)
        out[mode] = (time.perf_counter() - start) / calls
    return out


def memory_refusal(schedule: str, limit: int, seq: int = 64) -> dict:
    """A call whose model peak exceeds ``limit`` bytes on rank 0 only: every rank must refuse alike."""
    cp = cpattn.ContextParallel(seq, "causal", schedule, memory_limit=limit if dist.get_rank() == 0 else None)
    q = torch.randn(1, cp.local_len, 4, 16, requires_grad=True)
    k = torch.randn(1, cp.local_len, 2, 16, requires_grad=True)
    try:
        cp.attention(q, k, k)
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc), "need": cp.peak_memory(q, k)}
    return {"type": None, "message": "", "need": cp.peak_memory(q, k)}


def topology_on_subgroup(schedule: str) -> dict:
    """A two-level topology on a strict subgroup (no mesh): refused, the same on every member."""
    group = dist.new_group([0, 1, 2, 3])
    if dist.get_rank() >= 4:
        return {"member": False}
    try:
        cpattn.ContextParallel(64, "causal" if schedule == "ringx3" else "full", schedule, group=group,
                               topology=cpattn.cost.Topology(2, 2))
    except Exception as exc:
        return {"member": True, "type": type(exc).__name__, "message": str(exc)}
    return {"member": True, "type": None, "message": ""}


def one_dim_mesh() -> dict:
    """A 1-D DeviceMesh is the flat group: the result equals the one on the process group."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(5)
    x = torch.randn(1, 32, 4, 16)
    outs = []
    for group in (mesh, None):
        cp = cpattn.ContextParallel(32, "causal", "zigzag_ring", group=group)
        local = cp.shard(x)
        outs.append(cp.unshard(cp.attention(local, local, local)))
    return {"same": bool(torch.equal(outs[0], outs[1])), "rank": cp.rank}


def mesh_shape_mismatch() -> dict:
    """A 2-D mesh whose shape differs from the topology given: refused alike."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_inter", "cp_intra"))
    try:
        cpattn.ContextParallel(64, "causal", "ringx3", group=mesh, topology=cpattn.cost.Topology(1, 4))
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}


def bad_unshard() -> dict:
    """Rank 1 unshards a tensor of the wrong length: every rank raises the same error."""
    cp = cpattn.ContextParallel(32, "causal", "ring")
    x = torch.randn(1, cp.local_len + (1 if dist.get_rank() == 1 else 0), 2)
    try:
        cp.unshard(x)
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}


def check_off_stays_local() -> dict:
    """check="off": no exchange, so a rank's own error is raised there alone (and nothing hangs)."""
    try:
        cpattn.ContextParallel(32, "causal", "tree" if dist.get_rank() == 1 else "ring", check="off")
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}


#: ops that read a device value back to the host (or give a shape that depends on one)
HOST_READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.item", "aten.is_nonzero")


def _reads_mode():
    """A dispatch mode that records every op of :data:`HOST_READS` with the stack that issued it
    (``seen``), stepping into cpattn's attention ops (``ops`` counts them)."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    from cpattn.schedules.base import op_body

    class Reads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []
            self.ops = 0  # cpattn ops stepped into (a forward and a backward per call)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            body = op_body(func)
            if body is not None:  # step inside cpattn's attention op
                self.ops += 1
                with self:
                    return body(*args, **(kwargs or {}))
            if str(func.overloadpacket) in HOST_READS:
                stack = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                         for f in traceback.extract_stack()[:-1] if "/cpattn/" in f.filename]
                self.seen.append(f"{func.overloadpacket} at " + " <- ".join(reversed(stack[-4:])))
            return func(*args, **(kwargs or {}))

    return Reads()


def host_reads(masks: list) -> dict:
    """Every registered schedule, fwd+bwd at this world size, for each ``(mask spec, seq_len)`` it
    accepts (a length the layout cannot split runs padded). The first
    call with the shape warms up: block lists, plans, agreement); the next call runs under
    :func:`_reads_mode`. ``{schedule/mask: [where, ...]}`` (empty lists: no read)."""
    fast = cpattn.planner.PlanOptions(time_budget=1.0, partition_time_limit=0.3, schedule_time_limit=0.3)
    found = {}
    for name in cpattn.schedules.names():
        for spec, seq in masks:
            mask = cpattn.masks.resolve(spec)
            sched = cpattn.schedules.get(name)
            try:
                sched.check_mask(mask)
            except (ValueError, NotImplementedError):
                continue
            if (sched.make_plan is not None):
                sched = type(sched)(fast)
            cp = cpattn.ContextParallel(seq, mask, sched)
            g = torch.Generator().manual_seed(7)
            q, k, v = (torch.randn(1, cp.local_len, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
            cp.attention(q, k, v).sum().backward()
            mode = _reads_mode()
            with mode:
                cp.attention(q, k, v).sum().backward()
            if mode.ops != 2:
                raise RuntimeError(f"{name}: the mode stepped into {mode.ops} cpattn ops, expected 2")
            found[f"{name}/{mask.name}/{seq}"] = mode.seen
    return found


def decode_host_reads(merge_how: str) -> list[str]:
    """A key/value cache (``cpattn.inference.KVCache``) after a prompt: one decode step warms up (its
    merge choice), the next runs under :func:`_reads_mode`; what it recorded."""
    from cpattn.inference import KVCache

    cp = cpattn.ContextParallel(32, "causal", "ring")
    g = torch.Generator().manual_seed(5)
    kv = KVCache(cp, layers=2, kv_heads=2, head_dim=8, rows=2, merge=merge_how)
    kv.place_prompt(cp, [16, 16])
    for layer in range(2):
        q, k, v = (torch.randn(1, cp.local_len, h, 8, generator=g) for h in (4, 2, 2))
        kv.prefill(layer, cp, q, k, v)

    def step() -> None:
        kv.place_decode()
        for layer in range(2):
            q, k, v = (torch.randn(2, 1, h, 8, generator=g) for h in (4, 2, 2))
            kv.write(layer, k, v)
            kv.decode_attention(layer, q)

    step()
    mode = _reads_mode()
    with mode:
        step()
    return mode.seen


class _Block(torch.nn.Module):
    """A pre-norm transformer block (GQA attention through ``cp.attention``, then an MLP), small."""

    def __init__(self, cp, dim: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.cp, self.heads, self.kv_heads, self.hd = cp, heads, kv_heads, dim // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.wq = torch.nn.Linear(dim, dim, bias=False)
        self.wkv = torch.nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.wq(h).view(b, s, self.heads, self.hd)
        k, v = self.wkv(h).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
        a = self.cp.attention(q, k, v)
        x = x + self.wo(a.reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


def _block_run(block, x, dy, run):
    """``run(block, x)`` forward and backward: (y, input grad, parameter grads), grads cleared first."""
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = run(block, x)
    y.backward(dy)
    return y.detach(), x.grad, [p.grad.clone() for p in block.parameters()]


def compile_block(schedule: str, backend: str, seq: int = 64) -> dict:
    """A transformer block that calls ``cp.attention``, eager and ``torch.compile(fullgraph=True)`` on
    ``backend``: the largest relative difference of outputs and gradients, and the attention calls each
    made (one forward and one backward op per step)."""
    torch._dynamo.reset()
    cp = cpattn.ContextParallel(seq, "causal", schedule)
    torch.manual_seed(3)
    block = _Block(cp)
    x = cp.shard(torch.randn(2, seq, 32))
    dy = cp.shard(torch.randn(2, seq, 32))
    counts = {}

    def counted(name, run):
        cp.reset_comm_stats()
        result = _block_run(block, x, dy, run)
        counts[name] = cp.comm_stats()["total"]["calls"]
        return result

    eager = counted("eager", lambda m, t: m(t))
    compiled_block = torch.compile(block, fullgraph=True, backend=backend)
    counted("compiled warm-up", lambda m, t: compiled_block(t))
    compiled = counted("compiled", lambda m, t: compiled_block(t))
    diff = 0.0
    for a, b in zip([eager[0], eager[1], *eager[2]], [compiled[0], compiled[1], *compiled[2]]):
        diff = max(diff, float((a - b).norm() / b.norm().clamp(min=1e-30)))
    # the op's registration: schema, fake implementation against the real outputs, autograd
    q, k, v = (torch.randn(2, cp.local_len, h, 8, requires_grad=True) for h in (4, 2, 2))
    args = (q, k, v, cp._site, cp._slot, None, q.new_empty(0), None)
    opcheck = torch.library.opcheck(torch.ops.cpattn.attention.default, args,
                                    test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    return {"diff": diff, "calls": counts, "finite": bool(torch.isfinite(compiled[0]).all()),
            "opcheck": {name: result for name, result in opcheck.items() if result != "SUCCESS"}}


def selective_checkpoint(schedule: str, seq: int = 64) -> dict:
    """A block under activation checkpointing: selective (``cpattn::attention`` must be saved, the rest
    recomputed) and plain (everything recomputed). Per mode: the communication calls and bytes of the
    backward, and the largest relative gradient difference from the run without checkpointing; also
    the calls and bytes the schedule's backward alone makes (``expected_volume``)."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        if op is torch.ops.cpattn.attention.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    cp = cpattn.ContextParallel(seq, "causal", schedule)
    torch.manual_seed(4)
    block = _Block(cp)
    x = cp.shard(torch.randn(2, seq, 32))
    dy = cp.shard(torch.randn(2, seq, 32))
    plain = _block_run(block, x, dy, lambda m, t: m(t))
    runs = {
        "selective": lambda m, t: checkpoint(m, t, use_reentrant=False,
                                             context_fn=partial(create_selective_checkpoint_contexts, policy)),
        "full": lambda m, t: checkpoint(m, t, use_reentrant=False),
    }
    found = {}
    for name, run in runs.items():
        block.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        y = run(block, xi)
        cp.reset_comm_stats()
        y.backward(dy)
        total = cp.comm_stats()["total"]
        grads = [xi.grad, *[p.grad for p in block.parameters()]]
        diff = max(float((a - b).norm() / b.norm().clamp(min=1e-30)) for a, b in zip(grads, [plain[1], *plain[2]]))
        found[name] = {"calls": total["calls"], "bytes": total["bytes_sent"], "diff": diff}
    q = torch.empty(2, cp.local_len, 4, 8)
    k = torch.empty(2, cp.local_len, 2, 8)
    back = cp.expected_volume(q, k)["backward"]
    found["backward alone"] = {"calls": sum(v["calls"] for v in back.values()),
                               "bytes": sum(v["bytes_sent"] for v in back.values())}
    return found
