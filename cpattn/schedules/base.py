"""What every schedule shares: the runtime it runs in, its declared properties, the autograd glue.

A schedule is one algorithm (one file in this package). It declares its layout, which masks it
accepts, its memory class and its analytic communication volume, and implements ``forward`` and
``backward`` from the kernels, the merge and the communicator. Nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import blocks as blocks_mod
from .. import kernels
from ..comm import Communicator
from ..cost.estimate import Estimate
from ..cost.pairs import PairWork, pair_work
from ..cost.steps import Problem, Step
from ..cost.topology import Topology
from ..kernels import acc_dtype
from ..layout import Layout
from ..masks import BlockKind, Mask
from ..merge import merge_into


@dataclass(frozen=True)
class Shape:
    """Per-rank problem size, for analytic volumes. ``elem`` = bytes per element of q/k/v."""

    batch: int
    local_len: int
    heads: int
    kv_heads: int
    head_dim: int
    elem: int
    acc_elem: int  # bytes per element of float32 (or float64) accumulators
    world: int
    topology: Topology | None = None  # where the ranks run, for schedules whose traffic depends on it

    @property
    def kv_bytes(self) -> int:
        """k and v of one rank, packed, in the input dtype."""
        return 2 * self.batch * self.local_len * self.kv_heads * self.head_dim * self.elem

    @property
    def dkv_bytes(self) -> int:
        """dk and dv of one rank, packed, in the accumulation dtype."""
        return 2 * self.batch * self.local_len * self.kv_heads * self.head_dim * self.acc_elem

    @property
    def acc_bytes(self) -> int:
        """The output (or dq) accumulator and the lse of one rank's queries, in the accumulation dtype."""
        return self.batch * self.local_len * self.heads * (self.head_dim + 1) * self.acc_elem

    @staticmethod
    def of_problem(problem: Problem) -> Shape:
        """The per-rank shape of a cost-model :class:`~cpattn.cost.steps.Problem`."""
        return Shape(problem.batch, problem.local_len, problem.heads, problem.kv_heads, problem.head_dim,
                     problem.elem, problem.acc_elem, problem.world)

    @staticmethod
    def of(q: torch.Tensor, k: torch.Tensor, world: int, topology: Topology | None = None) -> Shape:
        b, s, h, d = q.shape
        return Shape(b, s, h, k.shape[2], d, q.element_size(),
                     torch.empty((), dtype=acc_dtype(q.dtype)).element_size(), world, topology)


Volume = dict[str, dict[str, dict[str, int]]]  # phase -> op -> {"calls", "bytes_sent", "bytes_recv"}


def op_volume(calls: int, sent: int, recv: int) -> dict[str, int]:
    return {"calls": calls, "bytes_sent": sent, "bytes_recv": recv}


@dataclass
class Runtime:
    """Everything a schedule needs for one call, identical on every rank of the group."""

    comm: Communicator
    mask: Mask
    layout: Layout
    seq_len: int
    scale: float = 1.0
    backend: str = "auto"
    topology: Topology | None = None  # nodes x devices per node, when the schedule should use it
    valid_len: int | None = None  # positions >= valid_len are padding (never attend, never attended)
    _blocks: dict = field(default_factory=dict, repr=False)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world(self) -> int:
        return self.comm.world_size

    def blocks(self, q_rank: int | list[int], kv_ranks: list[int]) -> list[blocks_mod.Block]:
        """Cached block list of the queries of ``q_rank`` (a rank, or several concatenated in that
        order) against ``kv_ranks``' keys (concatenated in that order); padding is never covered."""
        key = (q_rank if isinstance(q_rank, int) else tuple(q_rank), tuple(kv_ranks))
        if key not in self._blocks:
            self._blocks[key] = blocks_mod.for_ranks(self.mask, self.layout, self.seq_len, self.world,
                                                     q_rank, list(kv_ranks), self.valid_len)
        return self._blocks[key]


class Schedule:
    """Base class. Subclasses set the class attributes and implement forward/backward/volume."""

    name: str = ""
    layout: str = "contiguous"
    #: "any" or a tuple of mask names this schedule accepts
    masks: str | tuple[str, ...] = "any"
    causal: bool = True  # accepts masks with is_causal
    bidirectional: bool = True  # accepts masks without is_causal
    memory: str = "O(local)"
    #: runs on any range layout (``ContextParallel(layout=...)``, e.g. "balanced"), not only its own
    custom_layout: bool = False
    #: estimated by building a plan (:meth:`estimate_override`), which takes from under a second to tens
    #: of seconds per problem: "auto" considers it only for masks other than causal and full
    planned: bool = False
    summary: str = ""

    def layout_for(self, mask: Mask) -> str:
        """The layout this schedule uses for ``mask`` (most schedules have one)."""
        return self.layout

    def default_layout(self, mask: Mask, seq_len: int, world: int) -> tuple[Layout, int] | None:
        """A layout fitted to this problem and the padded length it splits, for schedules that choose
        one per problem (``ultra``); None: the named :meth:`layout_for`. Pure, so every rank agrees."""
        return None

    def check_mask(self, mask: Mask) -> None:
        """Raise before any communication if this schedule cannot run ``mask`` exactly."""
        if self.masks != "any" and mask.name not in self.masks:
            raise NotImplementedError(
                f"schedule {self.name!r} supports masks {', '.join(self.masks)}, not {mask.name!r}")
        if mask.is_causal and not self.causal:
            raise ValueError(f"schedule {self.name!r} is bidirectional-only and cannot run the causal mask "
                             f"{mask.name!r}; pick a causal schedule (see cpattn.schedules.available())")
        if not mask.is_causal and not self.bidirectional:
            raise ValueError(f"schedule {self.name!r} is causal-only and cannot run the mask {mask.name!r}; "
                             "pick a bidirectional schedule (see cpattn.schedules.available())")

    def check_shape(self, q: torch.Tensor, k: torch.Tensor, world: int) -> None:
        """Schedule-specific shape requirements (e.g. heads divisible by the world). Default: none."""

    def forward(self, rt: Runtime, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Local ``q [b, s, h, d]``, ``k, v [b, s, h_kv, d]`` -> ``out`` (input dtype), ``lse [b, h, s]``.
        A schedule may return a third element, a tuple of tensors that autograd keeps and hands to its
        ``backward`` as ``saved=`` (e.g. Ulysses keeps its head-split tensors)."""
        raise NotImplementedError

    def backward(self, rt: Runtime, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients ``dq, dk, dv`` in the input dtype."""
        raise NotImplementedError

    def volume(self, shape: Shape, rank: int) -> Volume:
        """Analytic bytes and calls per op on ``rank``, per phase ("forward", "backward")."""
        raise NotImplementedError

    def steps(self, problem: Problem, phase: str) -> list[Step]:
        """What one rank does in ``phase`` ("forward" or "backward"), step by step, for the cost model
        (``cpattn.cost.steps``): per step, the kernel calls of each rank, the communication ops issued
        with their bytes (summing, over steps, to :meth:`volume`), whether they overlap the compute, and
        the buffers alive. Schedules that implement neither it nor :meth:`estimate_override` cannot be
        estimated or chosen by "auto"."""
        raise NotImplementedError(f"schedule {self.name!r} does not implement steps(problem, phase)")

    def steps_for(self, problem: Problem, phase: str, topology: Topology) -> list[Step]:
        """The steps on ``topology``, which is what :func:`cpattn.cost.estimate` times: :meth:`steps`,
        unless the algorithm depends on where the ranks run (``usp`` takes its Ulysses degree from the
        devices per node, as it does at run time with a topology)."""
        return self.steps(problem, phase)

    def estimate_override(self, problem: Problem, topology: Topology, phase: str) -> Estimate | None:
        """A prediction from the schedule's own model instead of :meth:`steps`, or None (the default) to
        time the steps. ``ultra`` returns its plan's simulated makespan. Must be deterministic: every rank
        of "auto" computes it independently."""
        return None

    def pairs(self, problem: Problem) -> PairWork:
        """The kernel calls of every (query rank, key rank) pair of ``problem`` in this schedule's layout,
        for :meth:`steps` (closed forms where they exist, else the run-time block lists)."""
        return pair_work(problem.mask, Layout(self.layout_for(problem.mask)), problem.seq_len, problem.world)


def new_accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero output and -inf lse accumulators for local queries ``q [b, s, h, d]``."""
    b, s, h, d = q.shape
    acc = acc_dtype(q.dtype)
    return (torch.zeros(b, s, h, d, dtype=acc, device=q.device),
            torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device))


def attend(rt: Runtime, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: list[blocks_mod.Block],
           out_acc: torch.Tensor, lse_acc: torch.Tensor) -> None:
    """Run the forward kernel on each block and merge it into the accumulators (in place)."""
    for blk in blocks:
        o, lse = kernels.forward(q[:, blk.q], k[:, blk.kv], v[:, blk.kv], blk.kind, rt.scale, blk.mask,
                                 rt.backend)
        merge_into(out_acc[:, blk.q], lse_acc[:, :, blk.q], o, lse)


def attend_backward(rt: Runtime, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, blocks: list[blocks_mod.Block],
                    dq_acc: torch.Tensor, dk_acc: torch.Tensor, dv_acc: torch.Tensor) -> None:
    """Run the backward kernel on each block and add its gradients into the accumulators."""
    for blk in blocks:
        dq, dk, dv = kernels.backward(dout[:, blk.q], q[:, blk.q], k[:, blk.kv], v[:, blk.kv], out[:, blk.q],
                                      lse[:, :, blk.q], blk.kind, rt.scale, blk.mask, rt.backend)
        dq_acc[:, blk.q] += dq
        dk_acc[:, blk.kv] += dk
        dv_acc[:, blk.kv] += dv


def block_area(blocks: list[blocks_mod.Block]) -> int:
    return sum(b.area for b in blocks)


class Attention(torch.autograd.Function):
    """Autograd glue: ``forward`` runs the schedule's forward, ``backward`` its backward."""

    @staticmethod
    def forward(ctx, q, k, v, schedule: Schedule, rt: Runtime):  # noqa: D401
        out, lse, *saved = schedule.forward(rt, q, k, v)  # a schedule may return tensors for its backward
        ctx.save_for_backward(q, k, v, out, lse, *(saved[0] if saved else ()))
        ctx.schedule, ctx.rt, ctx.has_saved = schedule, rt, bool(saved)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *saved = ctx.saved_tensors
        extra = {"saved": tuple(saved)} if ctx.has_saved else {}
        dq, dk, dv = ctx.schedule.backward(ctx.rt, dout.contiguous(), q, k, v, out, lse, **extra)
        return dq, dk, dv, None, None


__all__ = ["Attention", "BlockKind", "Runtime", "Schedule", "Shape", "Volume", "attend", "attend_backward",
           "block_area",
           "new_accumulators", "op_volume"]
