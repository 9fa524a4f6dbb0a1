"""What every schedule shares: the runtime it runs in, its declared properties, the autograd glue.

A schedule is one algorithm (one file in this package). It declares its layout, which masks it
accepts and its memory class, and its program: ``steps(problem, phase, topology)``
(``cpattn.core.steps``), the one description of its traffic and work, which the one executor runs
(:meth:`Schedule.forward` and :meth:`Schedule.backward` are the same for every schedule), the cost
model times, and the recording tests hold the run to; its byte counts (:meth:`Schedule.volume`) are
derived from it here. A schedule that plans (``ultra``) makes a plan (:attr:`Schedule.make_plan`)
and compiles each rank's steps from it (:meth:`Schedule.program`).

A schedule object is stateless: its options (``USP(ulysses_degree=2)``, ``Ultra(options)``) are fixed
at construction, and caches (block lists, plans) belong to the ``ContextParallel`` that runs it.
See docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Callable, Hashable, Mapping
from functools import partial
from typing import Any

import torch

from ..core import blocks as blocks_mod
from ..core import layout as layout_mod
from ..core import memo
from ..core.executor import (
    ANY,
    START_ROLES,
    Accumulators,
    Run,
    Runtime,
    attend,
    attend_backward,
    check_program,
    execute,
)
from ..core.kernels import acc_dtype, region_calls
from ..core.layout import Layout
from ..core.masks import BlockKind, Mask
from ..core.merge import sink_grad, with_sinks
from ..core.pairs import PairWork, head_split, pair_work
from ..core.program import Plan
from ..core.steps import PHASES, Problem, Step, Work, distribution, group_size, sources, work
from ..core.topology import Topology

Volume = dict[str, dict[str, dict[str, int]]]  # phase -> op -> {"calls", "bytes_sent", "bytes_recv"}


class Schedule:
    """Base class. Subclasses set the class attributes and implement :meth:`steps` (or, planning,
    :attr:`make_plan`, :meth:`read_plan` and :meth:`program`).

    A schedule with options is a frozen dataclass (``USP(ulysses_degree=2)``); two schedules are equal
    when their class and options are, so they key caches by value."""

    name: str = ""
    layout: str = "contiguous"
    #: "any" or a tuple of mask names this schedule accepts
    masks: str | tuple[str, ...] = "any"
    causal: bool = True  # accepts masks with is_causal
    bidirectional: bool = True  # accepts masks without is_causal
    memory: str = "O(local)"
    #: runs on any range layout (``ContextParallel(layout=...)``, e.g. "balanced"), not only its own
    custom_layout: bool = False
    #: with no ``layout`` given, a document mask runs on ``cpattn.layout.balanced`` (rebalanced for each
    #: step's lengths) rather than on the schedule's own layout: for schedules whose work per rank follows
    #: the layout, and whose own layout is not what they are (zigzag_ring's zigzag, ulysses' head split)
    balances_documents: bool = False
    #: its collectives run in two levels (rails, then node) when the runtime has a two-level topology, so
    #: ``ContextParallel`` sets up the rail and node groups at construction
    hierarchical: bool = False
    summary: str = ""
    #: the names this class is registered under, each with its options (a class with options may be
    #: several schedules users know by name, e.g. ``ringx1o`` = ``RingX(overlap=True)``); empty: ``name``
    aliases: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------------ identity
    def options(self) -> dict[str, Any]:
        """The options this object was built with (dataclass fields; none for plain schedules)."""
        if not dataclasses.is_dataclass(self):
            return {}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def spec(self) -> str:
        """``name`` plus its options, e.g. ``usp(ulysses_degree=2)``: what it is, as text (the name alone
        when the options are the name's own, e.g. ``ringx1o``)."""
        alias = self.aliases.get(self.name)
        if alias is not None and type(self)(**alias).options() == self.options():
            return self.name
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{self.name}({opts})" if opts else self.name

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.options() == other.options()  # type: ignore[union-attr]

    def __hash__(self) -> int:
        return hash((type(self), tuple(self.options().items())))

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"

    # ------------------------------------------------------------------ what it accepts
    def layout_for(self, mask: Mask) -> str:
        """The layout this schedule uses for ``mask`` (most schedules have one)."""
        return self.layout

    def check_mask(self, mask: Mask) -> None:
        """Raise ``ValueError`` before any communication if this schedule cannot run ``mask`` exactly."""
        if self.masks != "any" and mask.name not in self.masks:
            raise ValueError(
                f"schedule {self.name!r} supports masks {', '.join(self.masks)}, not {mask.name!r}")
        if mask.is_causal and not self.causal:
            raise ValueError(f"schedule {self.name!r} is bidirectional-only and cannot run the causal mask "
                             f"{mask.name!r}; pick a causal schedule (see cpattn.schedules.available())")
        if not mask.is_causal and not self.bidirectional:
            raise ValueError(f"schedule {self.name!r} is causal-only and cannot run the mask {mask.name!r}; "
                             "pick a bidirectional schedule (see cpattn.schedules.available())")

    def check_shape(self, q: torch.Tensor, k: torch.Tensor, world: int) -> None:
        """Schedule-specific shape requirements (e.g. heads divisible by the world). Default: none."""

    # ------------------------------------------------------------------ the algorithm
    #: roles a forward program leaves for the backward, each with the role the backward program starts
    #: it as (Ulysses keeps its head-split q, kv, out and lse); autograd keeps them between the two
    keeps: tuple[tuple[str, str], ...] = ()
    #: ``make_plan(problem, topology, fast=False) -> cpattn.core.program.Plan``: the plan this schedule
    #: runs ``problem`` with (``fast``: a quick one, for a per-step mask), made on one rank and handed to
    #: every rank as JSON (:meth:`read_plan`); None (the default): the schedule runs its rank-generic
    #: :meth:`steps` and needs no plan
    make_plan: Callable[..., Plan] | None = None

    def read_plan(self, text: str) -> Plan:
        """The plan :attr:`make_plan` made, from its JSON form (validated)."""
        raise NotImplementedError(f"schedule {self.name!r} makes no plans")

    def choose_layout(self, mask: Mask, seq_len: int, world: int) -> tuple[Layout, int] | None:
        """The layout and padded length this schedule picks for ``mask`` itself when the user names
        none (a planner's owner map), or None for its own :meth:`layout_for`."""
        return None

    def program(self, problem: Problem, phase: str, topology: Topology | None = None, plan: Plan | None = None,
                rank: int = 0) -> list[Step]:
        """What group rank ``rank`` runs in ``phase``: the rank-generic :meth:`steps` with each step's
        ``work`` priced from its compute actions (:meth:`work_of`), or the steps compiled from ``plan``
        for that rank (a schedule that plans; its plan prices them)."""
        return [dataclasses.replace(st, work=self.work_of(problem, srcs)) if (srcs := sources(st)) else st
                for st in self.steps(problem, phase, topology)]

    def work_of(self, problem: Problem, srcs: tuple[Hashable, ...]) -> tuple[tuple[Work, int], ...]:
        """Over ranks, the kernel calls of one step's compute: the blocks its ``Attend`` / ``AttendBack``
        actions' sources ``srcs`` name (the one declaration of a step's compute: the executor runs them
        through :meth:`blocks_of`, the cost model prices this). Closed forms of the pair work where they
        apply (a ring offset, a rank's own kv, every other rank's kv; a head split's groups), else each
        rank's pairs (:meth:`rank_pairs`) counted from it."""
        p = problem.world
        if len(srcs) == 1 and srcs[0][0] == "groups":  # pair work over the groups, not the ranks
            _, d, t, heads, kv_heads = srcs[0]
            spans = layout_mod.grouped(problem.layout_or(self.layout_for(problem.mask)), problem.padded_len, p, d)
            groups = pair_work(problem.mask, spans, problem.padded_len, p // d, problem.seq_len)
            return head_split(groups.by_offset(t), d, heads, kv_heads)
        pairs = self.pairs(problem)
        if len(srcs) == 1 and srcs[0][0] in ("ring", "own"):
            return pairs.by_offset(srcs[0][1] if srcs[0][0] == "ring" else 0)
        if sorted(srcs) == [("other", j) for j in range(p)]:
            return pairs.remote_rows()
        return distribution(work((k, n) for src in srcs for i, j in self.rank_pairs(src, r, p)
                                 for k, n in pairs.pair(i, j)) for r in range(p))

    def rank_pairs(self, src, rank: int, world: int) -> list[tuple[int, int]]:
        """The (query rank, key rank) pairs whose blocks a source ``src`` names on ``rank`` (none: nothing to
        compute): ``("ring", t)``, the kv that started t places behind; ``("own",)``, this rank's own kv;
        ``("other", j)``, rank j's kv (none on rank j itself: its own diagonal runs apart)."""
        kind = src[0]
        if kind == "ring":
            return [(rank, (rank - src[1]) % world)]
        if kind == "own":
            return [(rank, rank)]
        if kind == "other":
            return [] if src[1] == rank else [(rank, src[1])]
        raise ValueError(f"schedule {self.name!r}: unknown block source {src!r}")

    def local_fns(self, rt: Runtime, q: torch.Tensor, k: torch.Tensor) -> Mapping[Hashable, Callable[[Any], Any]]:
        """The functions the program's :class:`~cpattn.core.steps.Local` actions name, for local ``q``
        and ``k`` (pure rearrangements: Ulysses' packing for an exchange); none by default."""
        return {}

    def forward(self, rt: Runtime, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """Local ``q [b, s, h, d]``, ``k, v [b, s, h_kv, d]`` -> ``out`` (input dtype), ``lse [b, h, s]``
        and the tensors of :attr:`keeps`. The executor (``cpattn.core.executor.execute``) runs
        :meth:`program` from the roles ``q`` and ``kv0`` (the local ``(k, v)``, packed into one tensor
        when it first travels); the result is role ``out``: output accumulators, finished here (sinks
        merged, cast), or the final output when the program finishes it itself (then with role ``lse``)."""
        steps = self._program(rt, q, k, "forward")
        keep = ("out", "lse", *(role for role, _ in self.keeps))
        roles = execute(rt, steps, {"q": q, "kv0": (k, v)}, partial(self.blocks_of, rt), keep=keep,
                        transforms=self.local_fns(rt, q, k))
        out = roles["out"]
        if not isinstance(out, Accumulators):  # the program finished the output itself
            return out, roles["lse"], tuple(roles[role] for role, _ in self.keeps)
        out, lse = out.out, out.lse  # sinks merged on the rows' owner, then cast
        if rt.sinks is not None:
            out, lse = with_sinks(out, lse, rt.sinks)
        out = out.to(q.dtype)
        return out, lse, tuple(roles[role] for role, _ in self.keeps)

    def backward(self, rt: Runtime, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, saved: tuple[torch.Tensor, ...] = ()
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients ``dq, dk, dv`` in the input dtype. The executor runs :meth:`program` from the roles
        ``q``, ``kv0``, ``dout``, ``out`` and ``lse`` (those of :attr:`keeps` replaced by ``saved``); the
        results are roles ``dq`` and ``dkv`` (packed)."""
        steps = self._program(rt, q, k, "backward")
        start = {"q": q, "kv0": (k, v), "dout": dout, "out": out, "lse": lse}
        start.update((role, t) for (_, role), t in zip(self.keeps, saved))
        roles = execute(rt, steps, start, partial(self.blocks_of, rt), keep=("dq", "dkv"),
                        transforms=self.local_fns(rt, q, k))
        dkv = roles["dkv"]
        return roles["dq"].to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)

    def _program(self, rt: Runtime, q: torch.Tensor, k: torch.Tensor, phase: str) -> list[Step]:
        """This rank's program of the call, kept with the runtime's cache (made once per call signature
        and plan)."""
        problem, plan = rt.problem(q, k), rt.plan
        def make() -> list[Step]:
            with memo.scope(rt.block_cache):
                kept = {role: ANY for _, role in self.keeps} if phase == "backward" else {}
                return check_program(self.program(problem, phase, rt.topology, plan, rt.rank),
                                     {**kept, **START_ROLES[phase]})

        return rt.block_cache.get_for(plan, ("program", self, problem, phase, rt.topology, rt.rank, id(plan)), make)

    def blocks_of(self, rt: Runtime, src) -> list[blocks_mod.Block] | None:
        """The blocks an action's source ``src`` (``cpattn.core.steps.Attend``) names on this rank (None:
        nothing to compute): those of its :meth:`rank_pairs` (:meth:`pair_blocks`), or for ``("groups", d,
        t, heads, kv_heads)`` the queries of this rank's group of d consecutive ranks against the keys of
        the group t places behind it (one group: the whole sequence; a head split's ring, on ``heads``
        and ``kv_heads`` per member)."""
        r = rt.rank
        if src[0] == "groups":
            d, t = src[1], src[2]
            i, n = r // d, rt.world // d
            return rt.blocks([i * d + x for x in range(d)], [(i - t) % n * d + x for x in range(d)])
        pairs = self.rank_pairs(src, r, rt.world)
        if not pairs:
            return None
        [(i, j)] = pairs
        return self.pair_blocks(rt, i, j)

    def pair_blocks(self, rt: Runtime, q_rank: int, kv_rank: int) -> list[blocks_mod.Block]:
        """The blocks of ``q_rank``'s queries against ``kv_rank``'s keys."""
        return rt.blocks(q_rank, [kv_rank])

    def saved_like(self, q: torch.Tensor, k: torch.Tensor, world: int, topology: Topology | None = None
                   ) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of the tensors :meth:`forward` returns for its backward (none by default), for
        ``torch.compile``'s view of the op without running it."""
        return []

    # ------------------------------------------------------------------ its description
    def steps(self, problem: Problem, phase: str, topology: Topology | None = None) -> list[Step]:
        """What every rank does in ``phase`` ("forward" or "backward"), step by step, as the runtime does
        it (``cpattn.core.steps``): per step, the kernel calls of each rank, the communication ops issued in
        it with their bytes, whether they are in flight during the step's compute, and the buffers
        alive. ``topology``: where the ranks run, for schedules whose algorithm depends on it (``usp``
        takes its Ulysses degree from the devices per node); None as ``ContextParallel`` runs without
        one. A schedule that plans compiles a program per rank from its plan instead (:meth:`program`)."""
        raise NotImplementedError(f"schedule {self.name!r} does not implement steps(problem, phase, topology)")

    def volume(self, problem: Problem, rank: int, topology: Topology | None = None, plan: Plan | None = None
               ) -> Volume:
        """Bytes and calls per op kind on group rank ``rank``, per phase: the ops of its
        :meth:`program`, counted by the communicator's rule (``CommOp.accounting``)."""
        out: Volume = {}
        for phase in PHASES:
            vol: dict[str, dict[str, int]] = {}
            for st in self.program(problem, phase, topology, plan, rank):
                for op in st.comm:
                    size = group_size(op.group, problem.world, topology)
                    for kind, counts in op.accounting(rank, size).items():
                        acc = vol.setdefault(kind, {"calls": 0, "bytes_sent": 0, "bytes_recv": 0})
                        for field, n in zip(acc, counts):
                            acc[field] += n
            out[phase] = vol
        return out

    def pairs(self, problem: Problem) -> PairWork:
        """The kernel calls of every (query rank, key rank) pair of ``problem`` in this schedule's layout,
        for :meth:`steps` (closed forms where they exist, else the run-time block lists)."""
        return pair_work(problem.mask, problem.layout_or(self.layout_for(problem.mask)), problem.padded_len,
                         problem.world, problem.seq_len)

# ---------------------------------------------------------------------- the attention op
# ``cpattn::attention`` is one ``torch.library`` custom op: ``torch.compile`` treats it as a unit (its
# communication runs eagerly inside, never traced), selective activation checkpointing can keep its
# outputs, and its backward is a second op. What an op call runs on is named by an int ``site``: an
# object (a ``ContextParallel``, or one of its per-mask views) registered with :func:`register_site`;
# ``family`` names the object the site is a view of (itself when it is none), which answers the shapes
# for the fake implementation. A compiled model sees a new view each step as a new ``site`` value:
# ``torch.compile`` turns that int into a symbolic one after the first change, and the fake
# implementation never needs its value, so per-step masks compile once more and then not again. Sites
# answer
#   ``prepare(q, k, v, softmax_scale) -> (schedule, runtime)``: checks (and agreement) for a forward;
#   ``runtime(q, k, softmax_scale) -> (schedule, runtime)``: the same call's runtime, for the backward;
#   ``world_size``, ``topology``: for the shapes of a schedule's saved tensors.
_SITES: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_NEXT_SITE = itertools.count(1)


def register_site(site: Any) -> int:
    """The handle ``cpattn::attention`` calls ``site`` by (kept while the site lives)."""
    handle = next(_NEXT_SITE)
    _SITES[handle] = site
    return handle


def _site(handle: int) -> Any:
    site = _SITES.get(handle)
    if site is None:
        raise RuntimeError(f"cpattn::attention: site {handle} is gone (its ContextParallel was deleted)")
    return site


def _own(outputs: list[torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """``outputs``, each copied when it shares storage with an input or an earlier output (an op's
    outputs must not alias its inputs or each other; e.g. dk and dv are views of one packed buffer)."""
    seen = {x.untyped_storage().data_ptr() for x in inputs}
    owned = []
    for t in outputs:
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        owned.append(t)
    return owned


def _slot_site(slot: torch.Tensor) -> Any:
    """The site a slot names: a 0-d int64 tensor on the host, made by :func:`site_slot` (read without a
    device: it never lives on one)."""
    if slot.device.type != "cpu" or slot.dim() != 0:
        raise ValueError(f"cpattn::attention: the site slot must be a 0-d tensor on the host, got {slot.device} "
                         f"{tuple(slot.shape)}")
    return _site(slot.tolist())


def site_slot(handle: int) -> torch.Tensor:
    """The slot tensor ``cpattn::attention`` takes for site ``handle`` (a tensor, so that a compiled model
    that calls a new view each step sees new data, not a new constant, and is not recompiled)."""
    return torch.tensor(handle, dtype=torch.int64)


def _for_call(rt: Runtime, q: torch.Tensor, sinks: torch.Tensor, softcap: float | None) -> Runtime:
    """The runtime of one call: its sinks and soft-cap, and whether a rank's step runs as one call per
    region (``kernels.region_calls``: on the device and path of ``q``)."""
    return dataclasses.replace(rt, sinks=sinks if sinks.numel() else None, softcap=softcap,
                               regions=region_calls(q, rt.mask, rt.backend, softcap))


def _attention_body(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, family: int, slot: torch.Tensor,
                    softmax_scale: float | None, sinks: torch.Tensor, softcap: float | None
                    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    schedule, rt = _slot_site(slot).prepare(q, k, v, softmax_scale)
    rt = _for_call(rt, q, sinks, softcap)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    with memo.scope(rt.block_cache):
        out, lse, saved = schedule.forward(rt, q, k, v)
    out, lse, *saved = _own([out, lse, *saved], (q, k, v))
    return out, lse, saved


@torch.library.custom_op("cpattn::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, family: int, slot: torch.Tensor,
                 softmax_scale: float | None, sinks: torch.Tensor, softcap: float | None
                 ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Local ``q [b, s, h, d]``, ``k, v [b, s, h_kv, d]`` -> ``out`` (input dtype), ``lse [b, h, s]``
    (accumulation dtype) and the tensors the schedule keeps for its backward (Ulysses' head-split ones).
    ``sinks [h]``: per-head sink logits merged into every row (``merge.with_sinks``); empty for none.
    ``softcap``: scores soft-capped as ``tanh(s / softcap) * softcap`` (None: not capped)."""
    return _attention_body(q, k, v, family, slot, softmax_scale, sinks, softcap)


@attention_op.register_fake
def _attention_fake(q, k, v, family, slot, softmax_scale, sinks, softcap):
    owner = _site(family)  # every view of a family has its shapes
    b, s, h, _ = q.shape
    saved = owner.schedule.saved_like(q, k, owner.world_size, owner.topology)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((b, h, s), dtype=acc_dtype(q.dtype)),
            [q.new_empty(shape, dtype=dtype) for shape, dtype in saved])


def _attention_backward_body(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, saved: list[torch.Tensor], slot: torch.Tensor,
                             softmax_scale: float | None, sinks: torch.Tensor, softcap: float | None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    schedule, rt = _slot_site(slot).runtime(q, k, softmax_scale)
    rt = _for_call(rt, q, sinks, softcap)
    dout = dout.contiguous()
    with memo.scope(rt.block_cache):  # out and lse are final (sinks merged in): the kernels' P and D are exact
        dq, dk, dv = schedule.backward(rt, dout, q, k, v, out, lse, tuple(saved))
    dsinks = sink_grad(dout, out, lse, sinks) if sinks.numel() else torch.empty_like(sinks)
    return tuple(_own([dq, dk, dv, dsinks], (dout, q, k, v, out, lse, *saved)))


@torch.library.custom_op("cpattn::attention_backward", mutates_args=())
def attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, saved: list[torch.Tensor], slot: torch.Tensor,
                          softmax_scale: float | None, sinks: torch.Tensor, softcap: float | None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``dq, dk, dv`` (input dtype) of :func:`attention_op`, and of ``sinks`` over this rank's
    rows (empty without sinks)."""
    return _attention_backward_body(dout, q, k, v, out, lse, saved, slot, softmax_scale, sinks, softcap)


@attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, saved, slot, softmax_scale, sinks, softcap):
    grads = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    return (*grads, torch.empty_like(sinks))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, _family, slot, softmax_scale, sinks, softcap = inputs
    out, lse, saved = output
    ctx.save_for_backward(q, k, v, out, lse, slot, sinks, *saved)
    ctx.softmax_scale, ctx.softcap = softmax_scale, softcap
    ctx.mark_non_differentiable(lse, *saved)


def _backward(ctx, dout, _dlse, _dsaved):
    q, k, v, out, lse, slot, sinks, *saved = ctx.saved_tensors
    dq, dk, dv, dsinks = attention_backward_op(dout, q, k, v, out, lse, saved, slot, ctx.softmax_scale, sinks,
                                               ctx.softcap)
    return dq, dk, dv, None, None, None, dsinks if sinks.numel() else None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)

_BODIES = {torch.ops.cpattn.attention.default: _attention_body,
           torch.ops.cpattn.attention_backward.default: _attention_backward_body}


def op_body(func) -> Callable | None:
    """The Python body of ``func`` when it is one of cpattn's ops (an ``OpOverload``), else None. A
    ``TorchDispatchMode`` sees a custom op as one call and runs it with the mode switched off; a mode
    that must see the aten ops inside (``cpattn.memory.PeakTracker``, checks for host reads) runs this
    body under itself instead: ``with self: return body(*args, **kwargs)``."""
    return _BODIES.get(func)


__all__ = ["Accumulators", "BlockKind", "Run", "Runtime", "Schedule", "Volume", "attend",
           "attend_backward", "attention_op", "op_body", "register_site", "site_slot"]
