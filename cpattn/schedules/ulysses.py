"""Ulysses (DeepSpeed-Ulysses): all-to-all between a sequence split and a head split.

Forward: one all-to-all turns every rank's local queries ``[b, s, h, d]`` into the *whole* sequence
for h/D of the heads, ``[b, D*s, h/D, d]`` (D = the Ulysses degree, here the group size P; the
sequence is the members' local tokens in member order). Keys and values go the same way, packed in
one message; each rank attends its heads over the whole sequence under the mask (EMPTY blocks skipped,
FULL/CAUSAL blocks on the fast kernel, PARTIAL ones masked) and one all-to-all each brings ``out``
(input dtype) and ``lse`` (float32) back to the sequence split.

Backward: the head-split q, kv, out and lse are kept from the forward; one all-to-all brings dout to
the head split, the local backward runs, and all-to-alls return dq (input dtype) and packed dk/dv.

Key/value heads (:func:`kv_plan`): with h_kv divisible by D each rank receives its h_kv/D heads; with
D divisible by h_kv (D > h_kv) each rank receives the one kv head its queries use, so every kv head
travels to D/h_kv ranks and no further; otherwise each rank receives one kv head per query head. When
a kv head reaches several ranks, their dk/dv come back as float32 and are summed at home; otherwise
dk/dv come back in the input dtype. Needs h % D == 0 (:meth:`UlyssesSchedule.check_shape` names the
valid degrees; ``usp`` combines a smaller Ulysses degree with a ring).

Per rank, for P > 1, every op is an all-to-all of N bytes in, counted (P-1) N / P each way: forward
q (b s h d elements), kv (2 b s D K d, K kv heads per destination), out (b s h d) and lse (b h s,
float32); backward dout, dq (b s h d each) and dk/dv (2 b s D K d). The exchange helpers take any
list of member ranks; a strict subset of the group (``usp``'s Ulysses groups) exchanges with
point-to-point shifts instead of a collective (same bytes: (D-1) sends and receives of N / D).
"""

from __future__ import annotations

import torch

from ..kernels import acc_dtype
from ..layout import grouped
from ..pairs import head_split, pair_work
from ..steps import CommOp, Problem, Step
from ..topology import Topology
from .base import Runtime, Schedule, attend, attend_backward, new_accumulators
from .ring import ring_steps

TAG_A2A = 2  # point-to-point exchanges inside a sub-group (ring.py uses 0 and 1)


def divisors(n: int, at_most: int) -> list[int]:
    """Divisors of ``n`` that are <= ``at_most``, ascending."""
    return [d for d in range(1, min(n, at_most) + 1) if n % d == 0]


def kv_plan(heads: int, kv_heads: int, degree: int) -> list[list[int]]:
    """The key/value heads each of ``degree`` ranks receives (the same count K for every rank), chosen
    so that local query head t of rank j uses local kv head ``t // (heads / degree / K)`` (plain GQA)."""
    hp, g = heads // degree, heads // kv_heads
    if kv_heads % degree == 0:
        k = kv_heads // degree
        return [list(range(j * k, (j + 1) * k)) for j in range(degree)]
    if degree % kv_heads == 0:
        return [[j * hp // g] for j in range(degree)]
    return [[(j * hp + t) // g for t in range(hp)] for j in range(degree)]


def _replicated(plan: list[list[int]], kv_heads: int) -> bool:
    return sum(len(p) for p in plan) != kv_heads


def exchange(rt: Runtime, members: list[int], send: torch.Tensor) -> torch.Tensor:
    """All-to-all among the group ranks ``members`` (this rank included): ``send[j]`` goes to
    ``members[j]``; returns ``recv`` with ``recv[j]`` from ``members[j]``. The whole group uses one
    collective; a strict subset posts one point-to-point shift per k = 1 .. D-1 (send to the member k
    places after this one, receive from the one k places before), all in flight together, as
    :func:`exchange_ops` declares."""
    comm, d = rt.comm, len(members)
    if d == 1:
        return send
    out = comm.new_buffer(send.shape, send.dtype, send.device)
    if d == comm.world_size:
        comm.all_to_all(out, send)
        return out
    me = members.index(comm.rank)
    out[me].copy_(send[me])
    shifts = [comm.send_recv([(send[(me + k) % d], members[(me + k) % d])],
                             [(out[(me - k) % d], members[(me - k) % d])], tag=TAG_A2A) for k in range(1, d)]
    for handle in shifts:
        handle.wait()
    return out


def scatter_heads(rt: Runtime, members: list[int], x: torch.Tensor) -> torch.Tensor:
    """Sequence split ``[b, s, H, d]`` -> head split ``[b, D*s, H/D, d]`` (members' tokens in order)."""
    b, s, h, d = x.shape
    n = len(members)
    send = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()
    return exchange(rt, members, send).permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def gather_heads(rt: Runtime, members: list[int], y: torch.Tensor) -> torch.Tensor:
    """Head split ``[b, D*s, H/D, d]`` -> sequence split ``[b, s, H, d]`` (inverse of scatter_heads)."""
    b, ns, hl, d = y.shape
    n = len(members)
    send = y.reshape(b, n, ns // n, hl, d).transpose(0, 1).contiguous()
    return exchange(rt, members, send).permute(1, 2, 0, 3, 4).reshape(b, ns // n, n * hl, d)


def gather_lse(rt: Runtime, members: list[int], lse: torch.Tensor) -> torch.Tensor:
    """Head split ``[b, H/D, D*s]`` -> sequence split ``[b, H, s]``."""
    b, hl, ns = lse.shape
    n = len(members)
    send = lse.reshape(b, hl, n, ns // n).permute(2, 0, 1, 3).contiguous()
    return exchange(rt, members, send).transpose(0, 1).reshape(b, n * hl, ns // n)


def scatter_kv(rt: Runtime, members: list[int], kv: torch.Tensor, plan: list[list[int]]) -> torch.Tensor:
    """Packed ``kv [2, b, s, h_kv, d]`` -> ``[2, b, D*s, K, d]``: rank j gets heads ``plan[j]``."""
    _, b, s, _, d = kv.shape
    n, k = len(members), len(plan[0])
    heads = torch.tensor([h for p in plan for h in p], device=kv.device)
    send = kv.index_select(3, heads).reshape(2, b, s, n, k, d).permute(3, 0, 1, 2, 4, 5).contiguous()
    return exchange(rt, members, send).permute(1, 2, 0, 3, 4, 5).reshape(2, b, n * s, k, d)


def gather_dkv(rt: Runtime, members: list[int], dkv: torch.Tensor, plan: list[list[int]], kv_heads: int,
               dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`scatter_kv` for gradients: ``[2, b, D*s, K, d]`` -> ``[2, b, s, h_kv, d]``
    (float32, or ``dtype``), summing the copies of a kv head that went to several ranks."""
    _, b, ns, k, d = dkv.shape
    n = len(members)
    send = dkv.to(dtype).reshape(2, b, n, ns // n, k, d).permute(2, 0, 1, 3, 4, 5).contiguous()
    recv = exchange(rt, members, send).permute(1, 2, 3, 0, 4, 5).reshape(2, b, ns // n, n * k, d)
    if not _replicated(plan, kv_heads):
        return recv
    heads = torch.tensor([h for p in plan for h in p], device=dkv.device)
    out = torch.zeros(2, b, ns // n, kv_heads, d, dtype=recv.dtype, device=recv.device)
    return out.index_add_(3, heads, recv)


def dkv_dtype(plan: list[list[int]], kv_heads: int, dtype: torch.dtype) -> torch.dtype:
    """dk/dv travel home in the input dtype, or float32 when copies of a head must be summed."""
    return acc_dtype(dtype) if _replicated(plan, kv_heads) else dtype


def saved_like(q: torch.Tensor, k: torch.Tensor, degree: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of what a head split of degree D keeps for its backward: ``q_h``, ``kv_h``,
    ``out_h`` and ``lse_h`` (as :func:`scatter_heads`, :func:`scatter_kv` and the attention give them)."""
    b, s, h, d = q.shape
    kv = len(kv_plan(h, k.shape[2], degree)[0])
    hl, n = h // degree, degree * s
    return [((b, n, hl, d), q.dtype), ((2, b, n, kv, d), k.dtype), ((b, n, hl, d), q.dtype),
            ((b, hl, n), acc_dtype(q.dtype))]


def check_heads(name: str, heads: int, degree: int, world: int) -> None:
    if heads % degree:
        valid = divisors(heads, world)
        raise ValueError(f"{name} splits the {heads} query heads over a Ulysses degree of {degree}: heads must be "
                         f"divisible by it; degrees <= {world} that divide {heads}: "
                         f"{', '.join(map(str, valid))} (largest: {valid[-1]}); 'usp' combines one with a ring")


class UlyssesSchedule(Schedule):
    name = "ulysses"
    layout = "contiguous"
    masks = "any"
    custom_layout = True
    memory = "O(local): head-split q, kv, out kept for the backward"
    summary = "all-to-all sequence <-> heads; whole-sequence attention on h/P heads"

    def check_shape(self, q: torch.Tensor, k: torch.Tensor, world: int) -> None:
        check_heads("ulysses", q.shape[2], world, world)

    def saved_like(self, q, k, world, topology=None):
        return saved_like(q, k, world)

    def forward(self, rt: Runtime, q, k, v):
        members = list(range(rt.world))
        plan = kv_plan(q.shape[2], k.shape[2], rt.world)
        q_h = scatter_heads(rt, members, q)
        kv_h = scatter_kv(rt, members, torch.stack([k, v]), plan)
        acc = new_accumulators(q_h)
        attend(rt, q_h, kv_h[0], kv_h[1], rt.blocks(members, members), acc)
        out_h, lse_h = acc.out.to(q.dtype), acc.lse
        out, lse = gather_heads(rt, members, out_h), gather_lse(rt, members, lse_h)
        return out, lse, (q_h, kv_h, out_h, lse_h)

    def backward(self, rt: Runtime, dout, q, k, v, out, lse, saved=()):
        q_h, kv_h, out_h, lse_h = saved
        members = list(range(rt.world))
        plan = kv_plan(q.shape[2], k.shape[2], rt.world)
        dout_h = scatter_heads(rt, members, dout)
        acc = acc_dtype(q.dtype)
        dq_h = torch.zeros(q_h.shape, dtype=acc, device=q.device)
        dkv_h = torch.zeros(kv_h.shape, dtype=acc, device=q.device)
        attend_backward(rt, dout_h, q_h, kv_h[0], kv_h[1], out_h, lse_h, rt.blocks(members, members),
                        dq_h, dkv_h[0], dkv_h[1])
        dq = gather_heads(rt, members, dq_h.to(q.dtype))
        dkv = gather_dkv(rt, members, dkv_h, plan, k.shape[2], dkv_dtype(plan, k.shape[2], q.dtype))
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype)

    def steps(self, problem: Problem, phase: str, topology: Topology | None = None) -> list[Step]:
        """The all-to-alls to the head split, whole-sequence attention on h/P heads (the same work on
        every rank), the all-to-alls back (:func:`head_split_steps` with one group)."""
        return head_split_steps(problem, phase, problem.world, self.name)


#: each phase's exchanges: (to the head split, back to the sequence split), in issue order
EXCHANGES = {"forward": (("q", "kv"), ("out", "lse")), "backward": (("dout",), ("dq", "dkv"))}


def messages(shape: Problem, degree: int) -> dict[str, int]:
    """Bytes per rank going into each exchange of Ulysses among ``degree`` ranks, for ``shape``
    (local tokens s): q, out, dout, dq (b s h d, input dtype), kv (2 b s D K d, K kv heads per member,
    input dtype), lse (b h s, accumulation dtype) and dkv (kv's elements, in the accumulation dtype
    when a kv head went to several members, else the input dtype)."""
    b, s, h, hk, d, e, a = (shape.batch, shape.local_len, shape.heads, shape.kv_heads, shape.head_dim,
                            shape.elem, shape.acc_elem)
    plan = kv_plan(h, hk, degree)
    seq = b * s * h * d * e
    kv = 2 * b * s * degree * len(plan[0]) * d
    return {"q": seq, "kv": kv * e, "out": seq, "lse": b * h * s * a, "dout": seq, "dq": seq,
            "dkv": kv * (a if _replicated(plan, hk) else e)}


def exchange_ops(degree: int, nbytes: int, whole_group: bool, group: str = "world") -> tuple[CommOp, ...]:
    """The cost-model ops of one :func:`exchange` of ``nbytes`` in per rank among ``degree`` members:
    one all-to-all over the whole group, else one point-to-point shift by k = 1 .. degree-1 of
    ``nbytes / degree`` each (one call each at run time, all in flight together; the ops of a step add
    up, as the all-to-all's pairwise rounds do), on ``group`` ("node" when every member set lies in one
    node; on "world" a shift by k stands for the shift inside each member set)."""
    if degree == 1:
        return ()
    if whole_group:
        return (CommOp("all_to_all", nbytes),)
    return tuple(CommOp("sendrecv", nbytes // degree, group=group, peer=k) for k in range(1, degree))


def head_split_steps(problem: Problem, phase: str, degree: int, name: str, group: str = "world") -> list[Step]:
    """Cost-model steps of Ulysses inside groups of ``degree`` consecutive ranks and ``ring.py``'s ring
    across the P / degree groups (``usp``; ``degree`` = P is ``ulysses``): the exchanges to the head
    split, the ring's steps (one step with no communication when there is one group), the exchanges
    back. The exchanges block, so nothing overlaps them. Every member computes its group's pairs (the
    groups' token spans, :func:`cpattn.layout.grouped`, as the ring sees them) on h / degree query heads.
    ``group``: where the point-to-point exchanges of a strict subset run (see :func:`exchange_ops`).
    ``live_bytes`` counts the head-split tensors, the ring's buffers and the exchange copies."""
    p = problem.world
    if p % degree:
        raise ValueError(f"{name}: the Ulysses degree {degree} must divide the group size {p}")
    check_heads(name, problem.heads, degree, p)
    shape, n = problem, p // degree
    msg = messages(shape, degree)
    kv_heads = len(kv_plan(problem.heads, problem.kv_heads, degree)[0])
    groups = grouped(problem.layout_or("contiguous"), problem.padded_len, p, degree)
    pairs = pair_work(problem.mask, groups, problem.padded_len, n, problem.seq_len)

    def work_at(t: int):
        return head_split(pairs.by_offset(t), degree, problem.heads // degree, kv_heads)

    into, back = (tuple(op for m in part for op in exchange_ops(degree, msg[m], degree == p, group))
                  for part in EXCHANGES[phase])
    q, kv, lse, acc = msg["q"], msg["kv"], msg["lse"], shape.acc_bytes
    kv_acc = kv // shape.elem * shape.acc_elem  # the ring's float32 dk/dv
    ring = 2 if n > 1 else 0  # the ring's current and next kv (and dk/dv in flight)
    if phase == "forward":
        live_in = 2 * (q + kv)  # send copies and received head-split q, kv
        live_ring = q + (1 + ring) * kv + acc  # q_h, kv_h, the ring's kv, output accumulators
        live_out = q + kv + acc + 3 * q + 2 * lse  # + out_h, send copies and received out, lse
    else:
        saved = 2 * q + kv + lse  # q_h, out_h, kv_h, lse_h kept from the forward
        dq_acc = q // shape.elem * shape.acc_elem
        live_in = saved + 2 * q  # dout's send copy and the received dout_h
        live_ring = saved + q + dq_acc + ring * kv + (1 + ring) * kv_acc
        live_out = saved + dq_acc + kv_acc + 2 * (q + msg["dkv"])
    kv_op = CommOp("sendrecv", kv, peer=degree)  # ring neighbours are degree ranks apart
    dkv_op = CommOp("sendrecv", kv_acc, peer=degree)
    steps = [Step((), into, overlap=False, live_bytes=live_in)] if into else []
    steps += ring_steps(n, work_at, kv_op, dkv_op, phase, live_ring)
    if back:
        steps.append(Step((), back, overlap=False, live_bytes=live_out))
    return steps
