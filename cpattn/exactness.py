"""Exactness check: every schedule against a float64 single-device reference.

The reference (:func:`reference`) is a plain ``softmax(q k^T * scale + mask) v`` with autograd on the
whole sequence, written here from scratch: it shares no code with the schedules, the kernels or the
merge. A distributed result passes when its relative error is at most ``2 * e_local + 1e-6``, where
``e_local`` is the error of the single-device kernel in the same dtype (docs/testing.md). Communication is
checked too: the bytes and calls each rank counted must equal the schedule's analytic volume.

:func:`rank_case` runs on every worker of a :class:`~cpattn.launcher.LocalWorld`; :func:`check`
runs in the parent and judges the results.

Masks: a case names a mask kind (``Case.mask``) and its JSON-able arguments (``Case.mask_args``), as
``cpattn.masks.from_spec`` takes them. The reference builds its own dense mask from that description
(:func:`dense_mask`, pair by pair, from the definitions in the mask docstrings), never through the
library's masks. Padding rows (a length the layout cannot split) and rows or keys the mask leaves
empty must come out exactly: out 0, lse -inf and zero gradients.

Why one module over 500 lines: a case, what each rank runs for it and how the parent judges it
share one data format, so they are read together.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .core import kernels, trace
from .core.masks import BlockKind

DTYPES = kernels.DTYPES
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
    mask_args: dict | None = None  # JSON-able arguments of the mask kind ``mask`` (cpattn.masks.from_spec)
    layout: str | None = None  # passed to ContextParallel (None: the schedule's own; "balanced")
    #: options of the schedule object, JSON-able (the schedule reads nested ones back, e.g. ``ultra``'s
    #: ``plan_options`` as a dict)
    options: dict | None = None
    #: (dp, nodes, devices per node): the world as a ("dp", "cp_inter", "cp_intra") DeviceMesh; every dp
    #: replica runs the case on its 2-D context-parallel mesh (two-level collectives), replica
    #: ``replica``'s results are checked
    mesh: tuple[int, int, int] | None = None
    replica: int = 0

    @property
    def mask_spec(self) -> dict:
        return {"kind": self.mask, **(self.mask_args or {})}

    @property
    def label(self) -> str:
        where = f"P={self.world}" if self.group is None else f"group{list(self.group)}/P={self.world}"
        if self.mesh is not None:
            where = f"mesh dp{self.mesh[0]}x{self.mesh[1]}x{self.mesh[2]} replica {self.replica}/P={self.world}"
        if self.topology is not None:
            where += f" topo={self.topology[0]}x{self.topology[1]}"
        mask = self.mask if not self.mask_args else f"{self.mask}{json.dumps(self.mask_args, separators=(',', ':'))}"
        if self.layout is not None:
            where += f" layout={self.layout}"
        if self.options:
            where += f" options={json.dumps(self.options, separators=(',', ':'), sort_keys=True)}"
        return (f"{self.schedule} {where} {mask} {self.dtype} h={self.heads}:{self.kv_heads} "
                f"S={self.seq} seed={self.seed}")


def make_inputs(case: Case) -> dict[str, torch.Tensor]:
    """Seeded full-sequence q, k, v, dout: drawn in float64, rounded to the case dtype."""
    g = torch.Generator().manual_seed(case.seed)
    b, s, h, hkv, d = case.batch, case.seq, case.heads, case.kv_heads, case.head_dim
    dt = DTYPES[case.dtype]
    shapes = {"q": (b, s, h, d), "k": (b, s, hkv, d), "v": (b, s, hkv, d), "dout": (b, s, h, d)}
    return {n: torch.randn(*shp, generator=g, dtype=torch.float64).to(dt) for n, shp in shapes.items()}


_CELL = {0: 0, 1: 1, 2: 2, "empty": 0, "full": 1, "causal": 2}


def _rule(name: str, args: dict) -> Callable[[int, int], bool]:
    """The reference definition of one mask kind: ``allowed(q, k)`` for global positions q, k."""
    a = dict(args)
    if name == "full":
        return lambda q, k: True
    if name == "causal":
        return lambda q, k: k <= q
    if name == "sliding_window":
        w, causal = a["window"], a.get("causal", True)
        return (lambda q, k: 0 <= q - k < w) if causal else (lambda q, k: abs(q - k) < w)
    if name == "document":
        doc_of = [i for i, n in enumerate(a["lengths"]) for _ in range(n)]
        causal = a.get("causal", True)

        def same_doc(q: int, k: int) -> bool:
            return q < len(doc_of) and k < len(doc_of) and doc_of[q] == doc_of[k] and (k <= q or not causal)
        return same_doc
    if name in ("streaming", "star"):
        bs, sink = a.get("block_size", 1), a.get("sink", 1)
        window = a["window"] if name == "streaming" else 1
        return lambda q, k: k <= q and (k // bs < sink or q // bs - k // bs < window)
    if name == "global_local":
        bs, g, w = a["block_size"], a.get("global_blocks", 1), a.get("local_blocks", 1)
        return lambda q, k: q // bs < g or k // bs < g or abs(q // bs - k // bs) < w
    if name == "strided":
        bs, st, w, causal = a["block_size"], a["stride"], a.get("local", 1), a.get("causal", True)

        def strided(q: int, k: int) -> bool:
            dq = q // bs - k // bs
            return (abs(dq) < w or dq % st == 0) and (k <= q or not causal)
        return strided
    if name == "block_table":
        table, bs = a["table"], a["block_size"]

        def cell(q: int, k: int) -> bool:
            i, j = q // bs, k // bs
            c = _CELL[table[i][j]] if i < len(table) and j < len(table[0]) else 0
            return c == 1 or (c == 2 and q - i * bs >= k - j * bs)
        return cell
    if name in ("and", "or"):
        rules = [_rule(m["kind"], {x: v for x, v in m.items() if x != "kind"}) for m in a["masks"]]
        if name == "and":
            return lambda q, k: all(r(q, k) for r in rules)
        return lambda q, k: any(r(q, k) for r in rules)
    raise ValueError(f"no reference mask for {name!r}")


def dense_mask(name: str, seq: int, args: dict | None = None, device: torch.device | str | None = None
               ) -> torch.Tensor:
    """The reference's own mask: bool [S, S], True = attend, evaluated pair by pair from the mask
    kind's definition (small S only), on ``device`` (default the CPU)."""
    rule = _rule(name, args or {})
    return torch.tensor([[bool(rule(q, k)) for k in range(seq)] for q in range(seq)], dtype=torch.bool,
                        device=device)


def example_mask_args(name: str, seq: int) -> dict | None:
    """Arguments for mask kind ``name`` that make an interesting pattern at length ``seq`` (used by
    :func:`matrix` for bare mask names): every kind with EMPTY, FULL and PARTIAL blocks over a few ranks,
    the document and block-table examples with rows that attend nothing or one token."""
    if name in ("causal", "full"):
        return None
    if name == "sliding_window":
        return {"window": max(2, seq // 7)}
    if name == "document":
        first, second = seq // 4 + 1, 1
        third = max(1, (seq - first - second) // 2)
        return {"lengths": [first, second, third, seq - first - second - third]}
    if name == "strided":
        return {"block_size": 4, "stride": 3}
    if name == "global_local":
        return {"block_size": 4, "global_blocks": 1, "local_blocks": 2}
    if name == "star":
        return {"block_size": max(2, seq // 8), "sink": 1}
    if name == "streaming":
        return {"sink": 3, "window": max(2, seq // 6)}
    if name == "block_table":
        bs = 8
        n = -(-seq // bs)
        table = [[2 if i == j else 1 if j < i and (i - j) % 2 else 0 for j in range(n)] for i in range(n)]
        table[1] = [0] * n  # a block of rows that attends nothing
        return {"table": table, "block_size": bs}
    raise ValueError(f"no example arguments for mask {name!r}")


def reference(q, k, v, dout, allowed: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
    """float64 attention and gradients on one device. q [b,s,h,d], k/v [b,s,h_kv,d]."""
    q, k, v = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    allowed = allowed.to(q.device)  # a mask built on the CPU judges inputs on any device
    g = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vr)
    out.backward(dout.to(torch.float64))
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def local_kernel(q, k, v, dout, mask_name: str, scale: float, allowed: torch.Tensor | None = None
                 ) -> dict[str, torch.Tensor]:
    """The single-device kernel on the whole sequence in the inputs' dtype (for e_local): the causal or
    full kernel, or the masked one with ``allowed`` for any other mask."""
    kind = {"causal": BlockKind.CAUSAL, "full": BlockKind.FULL}.get(mask_name, BlockKind.PARTIAL)
    mask = allowed.to(q.device) if kind == BlockKind.PARTIAL else None  # the kernels take it where q is
    out, lse = kernels.forward(q, k, v, kind, scale, mask)
    dq, dk, dv = kernels.backward(dout, q, k, v, out.to(q.dtype), lse, kind, scale, mask)
    return {"out": out.to(q.dtype), "lse": lse, "dq": dq.to(q.dtype), "dk": dk.to(q.dtype), "dv": dv.to(q.dtype)}


def local_errors(x: dict[str, torch.Tensor], mask_name: str, scale: float, allowed: torch.Tensor,
                 ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """e_local per quantity: the single-device kernel's error in the inputs' dtype. For a mask other
    than causal / full, schedules run its FULL and CAUSAL sub-blocks on the fast kernel and the rest on
    the masked one, so e_local is the larger of the masked kernel's error on this mask and the fast
    kernel's error on the causal (or full) mask, each against its own float64 reference."""
    args = (x["q"], x["k"], x["v"], x["dout"])
    loc = local_kernel(*args, mask_name, scale, allowed)
    errors = {q: rel_error(loc[q], ref[q]) for q in QUANTITIES}
    if mask_name in ("causal", "full"):
        return errors
    fast = "causal" if not bool(allowed.triu(1).any()) else "full"
    fast_allowed = dense_mask(fast, allowed.shape[0], device=allowed.device)
    fast_ref = reference(*args, fast_allowed, scale)
    fast_loc = local_kernel(*args, fast, scale)
    return {q: max(errors[q], rel_error(fast_loc[q], fast_ref[q])) for q in QUANTITIES}


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


def _cp_mesh(shape: tuple[int, int, int]):
    """The 2-D context-parallel mesh of this rank in a ("dp", "cp_inter", "cp_intra") mesh of ``shape``
    and this rank's dp index (built, and flattened, once per process: collective over the world)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _MESHES:
        if shape[0] * shape[1] * shape[2] != dist.get_world_size():
            raise ValueError(f"mesh {shape} does not cover the {dist.get_world_size()}-rank world")
        mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=("dp", "cp_inter", "cp_intra"))
        cp = mesh["cp_inter", "cp_intra"]
        cp._flatten()
        _MESHES[shape] = (cp, mesh.get_local_rank("dp"))
    return _MESHES[shape]


_MESHES: dict[tuple[int, int, int], tuple[object, int]] = {}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy() if t.is_floating_point() else t.detach().numpy()


def schedule_of(case: Case):
    """The schedule object a case runs: its name with its options."""
    from . import schedules

    return schedules.get(case.schedule, **(case.options or {}))


def rank_case(**fields) -> dict:
    """Run one case on this rank; returns local results (numpy, float64) and communication counts."""
    from .core.masks import from_spec

    case = Case(**fields)
    return run_case_on_rank(case, from_spec(case.mask_spec))


def run_case_on_rank(case: Case, mask) -> dict:
    """:func:`rank_case` with its mask given (a mask with no JSON spec, built on this rank: a
    ``from_mask_mod`` mask, which cannot travel to the worker)."""
    import torch.distributed as dist

    from .api import ContextParallel
    from .core.topology import Topology

    group = None
    if case.group is not None:
        group = _subgroup(tuple(case.group))
        if dist.get_rank() not in case.group:
            return {"member": False}
    checked = True
    if case.mesh is not None:
        group, dp_index = _cp_mesh(tuple(case.mesh))
        checked = dp_index == case.replica
    x = make_inputs(case)
    topology = Topology(*case.topology) if case.topology is not None else None
    cp = ContextParallel(case.seq, mask, schedule_of(case), group=group, backend=case.backend,
                         topology=topology, layout=case.layout)
    pad = cp.positions() < 0
    noise = torch.Generator().manual_seed(10_000 + 100 * case.seed + cp.rank)

    def local(name: str) -> torch.Tensor:
        """This rank's tokens; padding rows hold random values, which must not matter."""
        t = cp.shard(x[name])
        t[:, pad] = torch.randn(t[:, pad].shape, generator=noise, dtype=torch.float64).to(t.dtype)
        return t

    q, k, v = (local(n).requires_grad_() for n in ("q", "k", "v"))
    dout = local("dout")
    cp.reset_comm_stats()
    with trace.recording() as fwd_events:
        out, lse = cp.attention(q, k, v, return_lse=True)
    fwd = cp.comm_stats()
    cp.reset_comm_stats()
    with trace.recording() as bwd_events:
        out.backward(dout)
    bwd = cp.comm_stats()
    expected = cp.expected_volume(q, k)
    # the run against the schedule's steps() (its problem carries the layout and the padding)
    spec = spec_report(cp, q, k, {"forward": fwd_events, "backward": bwd_events})
    return {"member": checked, "rank": cp.rank, "positions": _np(cp.positions()), "out": _np(out),
            "lse": _np(lse), "dq": _np(q.grad), "dk": _np(k.grad), "dv": _np(v.grad),
            "measured": {"forward": fwd, "backward": bwd}, "expected": expected, "spec": spec,
            "levels": {"forward": fwd.get("levels", {}), "backward": bwd.get("levels", {})}}


# ---------------------------------------------------------------------------------- the run against steps()
def _calls(events: list[dict]) -> tuple[list[dict], list[int]]:
    """A recording (``cpattn.core.trace``) as its communicator calls in issue order (``ops``, the ``issue``
    and ``wait`` positions) and the positions of its kernel calls."""
    calls: dict[int, dict] = {}
    order, computes = [], []
    for pos, ev in enumerate(events):
        if ev["ev"] == "issue":
            call = calls.get(ev["call"])
            if call is None:
                call = calls[ev["call"]] = {"ops": [], "issue": pos, "wait": None}
                order.append(call)
            call["ops"].append((ev["op"], ev["sent"], ev["recv"]))
        elif ev["ev"] == "wait":
            calls[ev["call"]]["wait"] = pos
        else:
            computes.append(pos)
    return order, computes


def _call_key(ops: list[tuple[str, int, int]]) -> tuple:
    """One call as a message key: a send and a receive batched together are one ``sendrecv``."""
    if sorted(op for op, _, _ in ops) == ["recv", "send"]:
        return ("sendrecv", sum(s for _, s, _ in ops), sum(r for _, _, r in ops))
    return ops[0] if len(ops) == 1 else ("batch", *sorted(ops))


def _step_key(op, rank: int, size: int) -> tuple:
    acc = op.accounting(rank, size)
    if op.op == "sendrecv":
        return ("sendrecv", acc["send"][1], acc["recv"][2])
    _, sent, recv = acc[op.op]
    return (op.op, sent, recv)


def check_steps(steps: list, events: list[dict], rank: int, world: int, topology=None) -> dict:
    """Compare one rank's recording of one phase with the schedule's ``steps`` (pure).

    - messages: every call matches one op of the steps (kind and bytes on this rank) and every op ran;
    - order: calls are issued in step order (an op may be issued at the end of the step before the
      one it is declared in flight in, never later than its step);
    - overlap: ``overlapped`` counts the calls of steps with ``overlap`` that were in flight (issued
      before, waited after) across a kernel call; a step's ops must be, on every rank that computes
      in that step (summed over ranks by the caller, against :func:`expected_overlap`).

    Returns ``{"problems": [...], "overlapped": n, "computes": kernel calls}``."""
    from .core.steps import group_size

    expected = [(k, _step_key(op, rank, group_size(op.group, world, topology)))
                for k, st in enumerate(steps) for op in st.comm]
    used = [False] * len(expected)
    calls, computes = _calls(events)
    problems: list[str] = []
    latest, overlapped = 0, 0
    for call in calls:
        key = _call_key(call["ops"])
        match = next((i for i, (_, e) in enumerate(expected) if not used[i] and e == key), None)
        if match is None:
            problems.append(f"rank {rank} issued {key}, which steps() does not declare")
            continue
        used[match] = True
        k = expected[match][0]
        if k < latest:
            problems.append(f"rank {rank} issued {key} of step {k} after an op of step {latest}")
        latest = max(latest, k)
        if call["wait"] is None:
            problems.append(f"rank {rank} never waited for {key}")
        elif steps[k].overlap and any(call["issue"] < p < call["wait"] for p in computes):
            overlapped += 1
    missing = [e for (_, e), u in zip(expected, used) if not u]
    if missing:
        problems.append(f"rank {rank}: steps() declares {len(missing)} ops that never ran, e.g. {missing[0]}")
    return {"problems": problems, "overlapped": overlapped, "computes": len(computes)}


def expected_overlap(steps: list) -> tuple[int, int]:
    """``(overlapped calls, kernel calls)`` summed over ranks that ``steps`` declare: every op of a step
    with ``overlap`` is in flight across a kernel call on each rank that computes in the step."""
    overlapped = sum(len(st.comm) * sum(n for w, n in st.work if w) for st in steps if st.overlap)
    computes = sum(calls * n for st in steps for w, n in st.work for _, calls in w)
    return overlapped, computes


def own_overlap(steps: list, calls: list[int]) -> tuple[int, int]:
    """``(overlapped calls, kernel calls)`` one rank's own program declares, with ``calls[i]`` the kernel
    calls of step i on that rank: an op of a step with ``overlap``, issued at step j and waited at the
    end of step j or at the start of a later step w, is in flight across a kernel call when a step of
    j .. w-1 computes."""
    overlapped = sum(any(calls[j:j + 1 if op.wait is None else op.wait])
                     for j, st in enumerate(steps) if st.overlap for op in st.comm)
    return overlapped, sum(calls)


def spec_report(cp, q: torch.Tensor, k: torch.Tensor, events: dict[str, list[dict]]) -> dict:
    """This rank's recordings of one call (per phase) against the program it ran (:func:`check_steps`;
    ``ContextParallel.program``: the schedule's rank-generic steps, or those its plan compiles for this
    rank). The steps' problem carries the call's layout and padding, so the overlap and kernel counts
    are checked too (by :func:`check`, over all ranks), for every layout and padded length: against
    :func:`expected_overlap` for rank-generic steps (``expected``), else against the sum of every rank's
    :func:`own_overlap` (``mine``; a step's kernel calls are its actions' blocks on this rank, one
    recorded call each, as a stacked call records its pieces)."""
    from .core.steps import Attend, AttendBack

    out = {}
    sched, rt = cp.runtime(q, k, None)
    for phase, evs in events.items():
        steps = cp.program(q, k, phase)
        rep = check_steps(steps, evs, cp.rank, cp.world_size, cp.topology)
        if rt.plan is None:
            out[phase] = {**rep, "expected": expected_overlap(steps), "mine": None}
            continue
        calls = [sum(len(sched.blocks_of(rt, a.src) or ()) for a in st.run if isinstance(a, Attend | AttendBack))
                 for st in steps]
        out[phase] = {**rep, "expected": None, "mine": own_overlap(steps, calls)}
    return out


def _compare_spec(members: list[dict]) -> list[str]:
    bad = [p for r in members for ph in r["spec"].values() for p in ph["problems"]]
    for phase in ("forward", "backward"):
        reports = [r["spec"][phase] for r in members]
        expected = reports[0]["expected"]
        if expected is None:  # rank-specific programs: each rank declares its own
            expected = tuple(sum(rep["mine"][i] for rep in reports) for i in range(2))
        overlapped = sum(rep["overlapped"] for rep in reports)
        computes = sum(rep["computes"] for rep in reports)
        if overlapped != expected[0]:
            bad.append(f"{phase}: {overlapped} transfers were in flight during a kernel call over all ranks; "
                       f"the program declares {expected[0]}")
        if computes != expected[1]:
            bad.append(f"{phase}: {computes} kernel calls over all ranks; the program declares {expected[1]}")
    return bad


# ---------------------------------------------------------------------------------- parent side
@dataclass
class CaseResult:
    case: Case
    errors: dict[str, float] = field(default_factory=dict)
    tolerances: dict[str, float] = field(default_factory=dict)
    comm_mismatches: list[str] = field(default_factory=list)
    spec_mismatches: list[str] = field(default_factory=list)  # the run against the schedule's steps()
    exact_violations: list[str] = field(default_factory=list)  # padding / empty rows not exactly 0, -inf
    failure: str | None = None  # an exception on a rank, a timeout
    #: per checked rank and phase, the bytes each level of the hierarchical collectives carried
    levels: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return (self.failure is None and not self.comm_mismatches and not self.spec_mismatches
                and not self.exact_violations
                and bool(self.errors) and all(self.errors[q] <= self.tolerances[q] for q in QUANTITIES))

    def describe(self) -> str:
        parts = [self.case.label]
        if self.failure:
            parts.append(f"FAILED: {self.failure}")
        for q in QUANTITIES:
            if q in self.errors:
                flag = "" if self.errors[q] <= self.tolerances[q] else " (over)"
                parts.append(f"{q} {self.errors[q]:.2e}/{self.tolerances[q]:.2e}{flag}")
        return "; ".join(parts + self.comm_mismatches + self.spec_mismatches + self.exact_violations)

    def as_dict(self) -> dict:
        return {"passed": self.passed, **asdict(self)}


def assemble(results: list[dict], name: str, seq_dim: int) -> torch.Tensor:
    """The full float64 tensor ``name`` from every rank's real (non-padding) rows: each result holds
    its local array ``name`` and ``positions`` (global position per local row, -1 for padding)."""
    first = torch.from_numpy(results[0][name])
    shape = list(first.shape)
    shape[seq_dim] = sum(int((r["positions"] >= 0).sum()) for r in results)
    full = torch.full(shape, float("nan"), dtype=torch.float64)
    for r in results:
        pos = torch.from_numpy(r["positions"])
        real = (pos >= 0).nonzero().flatten()
        full.index_copy_(seq_dim, pos[real], torch.from_numpy(r[name]).double().index_select(seq_dim, real))
    return full


def _exact_checks(members: list[dict], got: dict[str, torch.Tensor], allowed: torch.Tensor) -> list[str]:
    """Padding rows, rows that attend nothing and keys nobody attends must be exactly 0 (lse -inf)."""
    bad = []
    for r in members:
        pad = torch.from_numpy(r["positions"]) < 0
        if not bool(pad.any()):
            continue
        for q in ("out", "dq", "dk", "dv"):
            if not bool((torch.from_numpy(r[q])[:, pad] == 0).all()):
                bad.append(f"rank {r['rank']}: padding rows of {q} are not 0")
        if not bool(torch.isneginf(torch.from_numpy(r["lse"])[:, :, pad]).all()):
            bad.append(f"rank {r['rank']}: padding rows of lse are not -inf")
    empty_rows, dead_keys = ~allowed.any(1), ~allowed.any(0)
    for q, idx in (("out", empty_rows), ("dq", empty_rows), ("dk", dead_keys), ("dv", dead_keys)):
        if not bool((got[q][:, idx] == 0).all()):
            bad.append(f"{q} is not 0 where the mask allows nothing")
    return bad


def _compare_comm(results: list[dict]) -> list[str]:
    bad = []
    for r in results:
        for phase in ("forward", "backward"):
            measured = {op: v for op, v in r["measured"][phase].items() if op not in ("total", "levels")}
            expected = r["expected"][phase]
            for op in sorted(set(measured) | set(expected)):
                m, e = (d.get(op, {"calls": 0, "bytes_sent": 0, "bytes_recv": 0}) for d in (measured, expected))
                if m != e:
                    bad.append(f"rank {r['rank']} {phase} {op}: measured {m}, formula {e}")
    return bad


def _compare_levels(case: Case, results: list[dict]) -> list[str]:
    """A hierarchical schedule on a two-level topology (or 2-D mesh) of N nodes x D devices must run
    every all-gather and reduce-scatter in two levels: a collective whose flat payload is (P-1) n puts
    (N-1) n on the rail (across nodes) and (D-1) N n inside the node, one call each."""
    shape = case.mesh[1:] if case.mesh is not None else case.topology
    if shape is None or min(shape) < 2 or not schedule_of(case).hierarchical:
        return []
    n_nodes, d = shape
    p = n_nodes * d
    bad = []
    for r in results:
        for phase in ("forward", "backward"):
            ops = [r["measured"][phase].get(op, {"calls": 0, "bytes_sent": 0})
                   for op in ("all_gather", "reduce_scatter")]
            calls, sent = sum(o["calls"] for o in ops), sum(o["bytes_sent"] for o in ops)
            expected = {"inter_node": {"calls": calls, "bytes_sent": sent * (n_nodes - 1) // (p - 1)},
                        "intra_node": {"calls": calls, "bytes_sent": sent * (d - 1) * n_nodes // (p - 1)}}
            levels = r["levels"][phase]
            for level, want in expected.items():
                got = {k: levels.get(level, {}).get(k, 0) for k in want}
                if got != want and calls:
                    bad.append(f"rank {r['rank']} {phase} {level}: measured {got}, two-level collectives need {want}")
    return bad


def check(case: Case, per_rank: list, allowed: torch.Tensor | None = None, mask_name: str | None = None) -> CaseResult:
    """Judge the per-rank outputs of :func:`rank_case` (or the errors they raised). ``allowed``,
    ``mask_name``: the reference's dense mask and its name when the case's mask is not a JSON spec
    (:func:`run_case_on_rank`); by default, the case's own."""
    from .launcher import RankError

    res = CaseResult(case)
    errs = [r for r in per_rank if isinstance(r, RankError)]
    if errs:
        res.failure = f"{errs[0]}\n{errs[0].traceback}"
        return res
    members = sorted((r for r in per_rank if r["member"]), key=lambda r: r["rank"])
    x = make_inputs(case)
    scale = kernels.default_scale(case.head_dim)
    if allowed is None:
        allowed, mask_name = dense_mask(case.mask, case.seq, case.mask_args), case.mask
    ref = reference(x["q"], x["k"], x["v"], x["dout"], allowed, scale)
    e_local = local_errors(x, mask_name, scale, allowed, ref)
    got = {q: assemble(members, q, 2 if q == "lse" else 1) for q in QUANTITIES}
    res.errors = {q: rel_error(got[q], ref[q]) for q in QUANTITIES}
    res.tolerances = {q: 2 * e_local[q] + 1e-6 for q in QUANTITIES}
    res.comm_mismatches = _compare_comm(members) + _compare_levels(case, members)
    res.levels = {r["rank"]: r.get("levels", {}) for r in members}
    res.spec_mismatches = _compare_spec(members)
    res.exact_violations = _exact_checks(members, got, allowed)
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
           masks: tuple = ("causal", "full"), dtypes: tuple[str, ...] = ("float32", "bfloat16"),
           heads: tuple[tuple[int, int], ...] = ((4, 4), (8, 2)), seed: int = 0, seq: int = 48) -> list[Case]:
    """The exactness matrix: schedules x world sizes (+ a 2-rank subgroup of a 4-rank world) x masks x
    dtypes x (heads, kv_heads); each case gets its own seed. A mask is a kind name (any of
    ``cpattn.masks.KINDS``; arguments from :func:`example_mask_args`) or a ``(kind, args)`` pair.
    Combinations a schedule rejects (mask or heads) are left out."""
    from . import schedules as registry
    from .core.masks import from_spec

    cases = []
    places = [(w, None) for w in worlds] + ([(4, (1, 3))] if subgroup else [])
    specs = [(m, example_mask_args(m, seq)) if isinstance(m, str) else (m[0], m[1]) for m in masks]
    for name in schedules:
        sched = registry.get(name)
        for world, group in places:
            for kind, args in specs:
                try:
                    sched.check_mask(from_spec({"kind": kind, **(args or {})}))
                except (ValueError, NotImplementedError):
                    continue  # the schedule rejects this mask (tested separately)
                for dtype in dtypes:
                    for h, hkv in heads:
                        p = world if group is None else len(group)
                        try:
                            sched.check_shape(torch.empty(1, 1, h, 1), torch.empty(1, 1, hkv, 1), p)
                        except ValueError:
                            continue  # e.g. Ulysses with heads not divisible by the world size
                        cases.append(Case(name, world, kind, dtype, seq=seq, heads=h, kv_heads=hkv,
                                          seed=seed + len(cases), group=group, mask_args=args))
    return cases
