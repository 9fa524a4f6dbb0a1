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

from collections.abc import Callable
from typing import Any

import torch

from ..core.kernels import acc_dtype
from ..core.merge import with_sinks
from ..core.steps import CommOp, Local, Problem, Step
from ..core.topology import Topology
from .base import Runtime, Schedule
from .ring import ring_steps

#: what the forward keeps for the backward (role at the forward's end, role the backward starts it as)
KEEPS = (("q", "q"), ("kv0", "kv0"), ("out_h", "out"), ("lse_h", "lse"))


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


def transforms(q: torch.Tensor, k: torch.Tensor, degree: int, sinks: torch.Tensor | None = None,
               member: int = 0) -> dict[str, Callable[[Any], Any]]:
    """The local rearrangements of a head split among ``degree`` members (the :class:`~cpattn.core.steps.Local`
    actions of :func:`head_split_steps`), for local ``q [b, s, h, d]`` and ``k [b, s, h_kv, d]``. An
    exchange sends slice j of its ``*_pack`` output to member j and the ``*_unpack`` of what arrives
    (slice j from member j) is the other split:

    - ``heads``: ``[b, s, H, d]`` (sequence split) -> ``[b, D*s, H/D, d]`` (head split, the members'
      tokens in member order);
    - ``kv``: packed ``[2, b, s, h_kv, d]`` -> ``[2, b, D*s, K, d]``, member j getting the kv heads
      ``kv_plan(...)[j]``;
    - ``seq``: ``[b, D*s, H/D, d]`` -> ``[b, s, H, d]``, the inverse of ``heads``; ``lse``: ``[b, H/D,
      D*s]`` -> ``[b, H, s]``;
    - ``dkv``: the inverse of ``kv`` for float32 gradients, summing the copies of a kv head that went
      to several members (they travel home in float32 then, else in the input dtype);
    - ``out_h``, ``lse_h``: output accumulators -> the head-split ``out`` (input dtype) and ``lse``,
      with the sinks of this ``member``'s heads merged in (``sinks [H]``, when given); ``dq_h``: float32
      dq -> the input dtype; ``packed``: the start ``(k, v)`` as one tensor; ``same``: its input."""
    n, dtype, hk = degree, q.dtype, k.shape[2]
    plan = kv_plan(q.shape[2], hk, n)
    heads = torch.tensor([h for p in plan for h in p], device=q.device)

    mine = None if sinks is None else sinks.reshape(n, -1)[member]  # the sinks of this member's heads
    finals: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def final(acc):
        """The accumulators' (out, lse), with this member's sinks merged in once."""
        if mine is None:
            return acc.out, acc.lse
        if id(acc) not in finals:
            finals[id(acc)] = with_sinks(acc.out, acc.lse, mine)
        return finals[id(acc)]

    def heads_pack(x):
        b, s, h, d = x.shape
        return x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()

    def heads_unpack(r):
        _, b, s, hl, d = r.shape
        return r.permute(1, 0, 2, 3, 4).reshape(b, n * s, hl, d)

    def kv_pack(kv):
        kv = torch.stack(kv) if isinstance(kv, tuple) else kv
        _, b, s, _, d = kv.shape
        return kv.index_select(3, heads).reshape(2, b, s, n, len(plan[0]), d).permute(3, 0, 1, 2, 4, 5).contiguous()

    def kv_unpack(r):
        _, _, b, s, kh, d = r.shape
        return r.permute(1, 2, 0, 3, 4, 5).reshape(2, b, n * s, kh, d)

    def seq_pack(y):
        b, ns, hl, d = y.shape
        return y.reshape(b, n, ns // n, hl, d).transpose(0, 1).contiguous()

    def seq_unpack(r):
        _, b, s, hl, d = r.shape
        return r.permute(1, 2, 0, 3, 4).reshape(b, s, n * hl, d)

    def lse_pack(lse):
        b, hl, ns = lse.shape
        return lse.reshape(b, hl, n, ns // n).permute(2, 0, 1, 3).contiguous()

    def lse_unpack(r):
        _, b, hl, s = r.shape
        return r.transpose(0, 1).reshape(b, n * hl, s)

    def dkv_pack(dkv):
        _, b, ns, kh, d = dkv.shape
        send = dkv.to(acc_dtype(dtype) if _replicated(plan, hk) else dtype).reshape(2, b, n, ns // n, kh, d)
        return send.permute(2, 0, 1, 3, 4, 5).contiguous()

    def dkv_unpack(r):
        _, _, b, s, kh, d = r.shape
        recv = r.permute(1, 2, 3, 0, 4, 5).reshape(2, b, s, n * kh, d)
        if not _replicated(plan, hk):
            return recv
        out = torch.zeros(2, b, s, hk, d, dtype=recv.dtype, device=recv.device)
        return out.index_add_(3, heads, recv)

    return {"heads_pack": heads_pack, "heads_unpack": heads_unpack, "kv_pack": kv_pack, "kv_unpack": kv_unpack,
            "seq_pack": seq_pack, "seq_unpack": seq_unpack, "lse_pack": lse_pack, "lse_unpack": lse_unpack,
            "dkv_pack": dkv_pack, "dkv_unpack": dkv_unpack, "out_h": lambda acc: final(acc)[0].to(dtype),
            "lse_h": lambda acc: final(acc)[1], "dq_h": lambda dq: dq.to(dtype), "same": lambda x: x,
            "packed": lambda kv: torch.stack(kv) if isinstance(kv, tuple) else kv}


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

    keeps = KEEPS

    def saved_like(self, q, k, world, topology=None):
        return saved_like(q, k, world)

    def local_fns(self, rt: Runtime, q, k):
        return transforms(q, k, rt.world, rt.sinks, rt.rank)

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


def exchange_ops(degree: int, nbytes: int, whole_group: bool, group: str = "world", send: str | None = None,
                 recv: str | None = None) -> tuple[CommOp, ...]:
    """The ops of one exchange of ``nbytes`` in per rank among ``degree`` consecutive members, from
    role ``send`` (slice j for member j) into role ``recv``: one all-to-all over the whole group, else
    one point-to-point shift by k = 1 .. degree-1 of ``nbytes / degree`` each (all in flight together;
    the ops of a step add up, as the all-to-all's pairwise rounds do), on ``group`` ("node" when every
    member set lies in one node; on "world" a shift by k stands for the shift inside each member set)."""
    if degree == 1:
        return ()
    if whole_group:
        return (CommOp("all_to_all", nbytes, send=send, recv=recv),)
    return tuple(CommOp("sendrecv", nbytes // degree, group=group, peer=k, send=send, recv=recv, within=degree,
                        slot=True) for k in range(1, degree))


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

    def exchanges(part: int, live: int) -> list[Step]:  # one step per message, packed before, unpacked after
        return [Step(ops, overlap=False, live_bytes=live, before=CODECS[m][0], after=CODECS[m][1])
                for m in EXCHANGES[phase][part]
                if (ops := exchange_ops(degree, msg[m], degree == p, group, f"{m}_out", f"{m}_in"))]

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
    # ring neighbours are degree ranks apart
    ring = ring_steps(n, CommOp("sendrecv", kv, peer=degree), CommOp("sendrecv", kv_acc, peer=degree), phase,
                      live_ring, source=lambda t: ("groups", degree, t, problem.heads // degree, kv_heads))
    if degree == 1:  # no exchange: the ring's result is the sequence split's
        return ring + ([Step(live_bytes=live_out, after=ONE_MEMBER)] if phase == "forward" else [])
    return exchanges(0, live_in) + ring + exchanges(1, live_out)


#: per message, the actions around its exchange (:func:`transforms`): (before: pack what is sent,
#: after: unpack what arrived). Forward the head split replaces roles ``q`` and ``kv0`` (the ring runs
#: on them) and the final ``out`` and ``lse`` replace the accumulators (``out_h``, ``lse_h``: the
#: head-split output kept for the backward); backward ``dout`` is replaced and the results replace
#: ``dq`` and ``dkv``. Each message is a step of its own, so one message's buffers are alive at a time.
CODECS = {
    "q": ((Local("heads_pack", "q", "q_out"),), (Local("heads_unpack", "q_in", "q"),)),
    "kv": ((Local("kv_pack", "kv0", "kv_out"),), (Local("kv_unpack", "kv_in", "kv0"),)),
    "out": ((Local("out_h", "out", "out_h"), Local("lse_h", "out", "lse_h"), Local("seq_pack", "out_h", "out_out")),
            (Local("seq_unpack", "out_in", "out"),)),
    "lse": ((Local("lse_pack", "lse_h", "lse_out"),), (Local("lse_unpack", "lse_in", "lse"),)),
    "dout": ((Local("heads_pack", "dout", "dout_out"),), (Local("heads_unpack", "dout_in", "dout"),)),
    "dq": ((Local("dq_h", "dq", "dq_h"), Local("seq_pack", "dq_h", "dq_out")),
           (Local("seq_unpack", "dq_in", "dq"),)),
    "dkv": ((Local("dkv_pack", "dkv", "dkv_out"),), (Local("dkv_unpack", "dkv_in", "dkv"),)),
}
#: one member (a degree of 1): the ring's output finished as the exchanges would leave it
ONE_MEMBER = (Local("out_h", "out", "out_h"), Local("lse_h", "out", "lse_h"), Local("same", "out_h", "out"),
              Local("same", "lse_h", "lse"), Local("packed", "kv0", "kv0"))
