"""Exactness check: every schedule against a float64 single-device reference.

The reference (:func:`reference`) is a plain ``softmax(q k^T * scale + mask) v`` with autograd on the
whole sequence, written here from scratch: it shares no code with the schedules, the kernels or the
merge. A distributed result passes when its relative error is at most ``2 * e_local + 1e-6``, where
``e_local`` is the error of the single-device kernel in the same dtype (testing.md). Communication is
checked too: the bytes and calls each rank counted must equal the schedule's analytic volume.

:func:`rank_case` runs on every worker of a :class:`~cpattn.launcher.LocalWorld`; :func:`check`
runs in the parent and judges the results.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from . import kernels
from .masks import BlockKind

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
QUANTITIES = ("out", "lse", "dq", "dk", "dv")


@dataclass(frozen=True)
class Case:
    schedule: str
    world: int  # size of the worker world the case runs on
    mask: str = "causal"  # "causal" or "full"
    dtype: str = "float32"
    batch: int = 2
    seq: int = 48
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 16
    seed: int = 0
    group: tuple[int, ...] | None = None  # global ranks of a subgroup to run on; None = the whole world
    backend: str = "auto"
    topology: tuple[int, int] | None = None  # (nodes, devices_per_node) passed to ContextParallel

    @property
    def label(self) -> str:
        where = f"P={self.world}" if self.group is None else f"group{list(self.group)}/P={self.world}"
        if self.topology is not None:
            where += f" topo={self.topology[0]}x{self.topology[1]}"
        return (f"{self.schedule} {where} {self.mask} {self.dtype} h={self.heads}:{self.kv_heads} "
                f"S={self.seq} seed={self.seed}")


def make_inputs(case: Case) -> dict[str, torch.Tensor]:
    """Seeded full-sequence q, k, v, dout: drawn in float64, rounded to the case dtype."""
    g = torch.Generator().manual_seed(case.seed)
    b, s, h, hkv, d = case.batch, case.seq, case.heads, case.kv_heads, case.head_dim
    dt = DTYPES[case.dtype]
    shapes = {"q": (b, s, h, d), "k": (b, s, hkv, d), "v": (b, s, hkv, d), "dout": (b, s, h, d)}
    return {n: torch.randn(*shp, generator=g, dtype=torch.float64).to(dt) for n, shp in shapes.items()}


def dense_mask(name: str, seq: int) -> torch.Tensor:
    """The reference's own mask: bool [S, S], True = attend."""
    if name == "causal":
        return torch.ones(seq, seq, dtype=torch.bool).tril()
    if name == "full":
        return torch.ones(seq, seq, dtype=torch.bool)
    raise ValueError(f"no reference mask for {name!r}")


def reference(q, k, v, dout, allowed: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
    """float64 attention and gradients on one device. q [b,s,h,d], k/v [b,s,h_kv,d]."""
    q, k, v = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vr)
    out.backward(dout.to(torch.float64))
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def local_kernel(q, k, v, dout, mask_name: str, scale: float) -> dict[str, torch.Tensor]:
    """The single-device kernel on the whole sequence in the inputs' dtype (for e_local)."""
    kind = BlockKind.CAUSAL if mask_name == "causal" else BlockKind.FULL
    out, lse = kernels.forward(q, k, v, kind, scale)
    dq, dk, dv = kernels.backward(dout, q, k, v, out.to(q.dtype), lse, kind, scale)
    return {"out": out.to(q.dtype), "lse": lse, "dq": dq.to(q.dtype), "dk": dk.to(q.dtype), "dv": dv.to(q.dtype)}


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| over finite reference entries; inf if x has NaN/Inf where ref is finite
    or if ref's -inf entries (empty rows' lse) are not matched exactly."""
    x = x.to(torch.float64)
    finite = torch.isfinite(ref)
    if not torch.equal(x[~finite], ref[~finite]) or not bool(torch.isfinite(x[finite]).all()):
        return math.inf
    denom = float(torch.linalg.vector_norm(ref[finite])) or 1.0
    return float(torch.linalg.vector_norm(x[finite] - ref[finite])) / denom


# ---------------------------------------------------------------------------------- worker side
_SUBGROUPS: dict[tuple[int, ...], object] = {}


def _subgroup(ranks: tuple[int, ...]):
    import torch.distributed as dist

    if ranks not in _SUBGROUPS:  # new_group is collective over the world: every rank calls it
        _SUBGROUPS[ranks] = dist.new_group(list(ranks))
    return _SUBGROUPS[ranks]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy() if t.is_floating_point() else t.detach().numpy()


def rank_case(**fields) -> dict:
    """Run one case on this rank; returns local results (numpy, float64) and communication counts."""
    import torch.distributed as dist

    from .api import ContextParallel
    from .cost import Topology
    from .schedules.base import Shape

    case = Case(**fields)
    group = None
    if case.group is not None:
        group = _subgroup(tuple(case.group))
        if dist.get_rank() not in case.group:
            return {"member": False}
    x = make_inputs(case)
    topology = Topology(*case.topology) if case.topology is not None else None
    cp = ContextParallel(case.seq, case.mask, case.schedule, group=group, backend=case.backend, topology=topology)
    q, k, v = (cp.shard(x[n]).requires_grad_() for n in ("q", "k", "v"))
    cp.reset_comm_stats()
    out, lse = cp.attention(q, k, v, return_lse=True)
    fwd = cp.comm_stats()
    cp.reset_comm_stats()
    out.backward(cp.shard(x["dout"]))
    bwd = cp.comm_stats()
    expected = cp.schedule.volume(Shape.of(q, k, cp.world_size), cp.rank)
    return {"member": True, "rank": cp.rank, "positions": _np(cp.positions()), "out": _np(out),
            "lse": _np(lse), "dq": _np(q.grad), "dk": _np(k.grad), "dv": _np(v.grad),
            "measured": {"forward": fwd, "backward": bwd}, "expected": expected}


# ---------------------------------------------------------------------------------- parent side
@dataclass
class CaseResult:
    case: Case
    errors: dict[str, float] = field(default_factory=dict)
    tolerances: dict[str, float] = field(default_factory=dict)
    comm_mismatches: list[str] = field(default_factory=list)
    failure: str | None = None  # an exception on a rank, a timeout

    @property
    def passed(self) -> bool:
        return (self.failure is None and not self.comm_mismatches and bool(self.errors)
                and all(self.errors[q] <= self.tolerances[q] for q in QUANTITIES))

    def describe(self) -> str:
        parts = [self.case.label]
        if self.failure:
            parts.append(f"FAILED: {self.failure}")
        for q in QUANTITIES:
            if q in self.errors:
                flag = "" if self.errors[q] <= self.tolerances[q] else " (over)"
                parts.append(f"{q} {self.errors[q]:.2e}/{self.tolerances[q]:.2e}{flag}")
        parts.extend(self.comm_mismatches)
        return "; ".join(parts)

    def as_dict(self) -> dict:
        return {"case": asdict(self.case), "passed": self.passed, "errors": self.errors,
                "tolerances": self.tolerances, "comm_mismatches": self.comm_mismatches, "failure": self.failure}


def _assemble(results: list[dict], name: str, seq_dim: int) -> torch.Tensor:
    first = torch.from_numpy(results[0][name])
    shape = list(first.shape)
    shape[seq_dim] = sum(len(r["positions"]) for r in results)
    full = torch.full(shape, float("nan"), dtype=torch.float64)
    for r in results:
        full.index_copy_(seq_dim, torch.from_numpy(r["positions"]), torch.from_numpy(r[name]))
    return full


def _compare_comm(results: list[dict]) -> list[str]:
    bad = []
    for r in results:
        for phase in ("forward", "backward"):
            measured = {op: v for op, v in r["measured"][phase].items() if op != "total"}
            expected = r["expected"][phase]
            for op in sorted(set(measured) | set(expected)):
                m = measured.get(op, {"calls": 0, "bytes_sent": 0, "bytes_recv": 0})
                e = expected.get(op, {"calls": 0, "bytes_sent": 0, "bytes_recv": 0})
                if m != e:
                    bad.append(f"rank {r['rank']} {phase} {op}: measured {m}, formula {e}")
    return bad


def check(case: Case, per_rank: list) -> CaseResult:
    """Judge the per-rank outputs of :func:`rank_case` (or the errors they raised)."""
    from .launcher import RankError

    res = CaseResult(case)
    errs = [r for r in per_rank if isinstance(r, RankError)]
    if errs:
        res.failure = f"{errs[0]}\n{errs[0].traceback}"
        return res
    members = sorted((r for r in per_rank if r["member"]), key=lambda r: r["rank"])
    x = make_inputs(case)
    scale = kernels.default_scale(case.head_dim)
    ref = reference(x["q"], x["k"], x["v"], x["dout"], dense_mask(case.mask, case.seq), scale)
    loc = local_kernel(x["q"], x["k"], x["v"], x["dout"], case.mask, scale)
    for q in QUANTITIES:
        seq_dim = 2 if q == "lse" else 1
        got = _assemble(members, q, seq_dim)
        res.errors[q] = rel_error(got, ref[q])
        res.tolerances[q] = 2 * rel_error(loc[q], ref[q]) + 1e-6
    res.comm_mismatches = _compare_comm(members)
    return res


def run(world, case: Case, timeout: float = 120.0) -> CaseResult:
    """Run ``case`` on a :class:`~cpattn.launcher.LocalWorld` and judge it."""
    from .launcher import WorldError

    try:
        per_rank = world.run(rank_case, timeout=timeout, name=case.label, **asdict(case))
    except WorldError as exc:
        return CaseResult(case, failure=str(exc))
    return check(case, per_rank)


def matrix(schedules: list[str], worlds: tuple[int, ...] = (1, 2, 3, 4), subgroup: bool = True,
           masks: tuple[str, ...] = ("causal", "full"), dtypes: tuple[str, ...] = ("float32", "bfloat16"),
           heads: tuple[tuple[int, int], ...] = ((4, 4), (8, 2)), seed: int = 0) -> list[Case]:
    """The exactness matrix: schedules x world sizes (+ a 2-rank subgroup of a 4-rank world) x masks x
    dtypes x (heads, kv_heads); each case gets its own seed."""
    from . import schedules as registry
    from .masks import resolve

    cases = []
    places = [(w, None) for w in worlds] + ([(4, (1, 3))] if subgroup else [])
    for name in schedules:
        sched = registry.get(name)
        for world, group in places:
            for mask in masks:
                try:
                    sched.check_mask(resolve(mask))
                except (ValueError, NotImplementedError):
                    continue  # the schedule rejects this mask (tested separately)
                for dtype in dtypes:
                    for h, hkv in heads:
                        cases.append(Case(name, world, mask, dtype, heads=h, kv_heads=hkv,
                                          seed=seed + len(cases), group=group))
    return cases
