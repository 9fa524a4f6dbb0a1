"""The one communicator every schedule uses.

All ranks here are *group-relative* (0 .. world_size - 1 inside ``group``); conversion to the global
ranks torch.distributed wants happens in exactly one place (:meth:`Communicator.global_rank`).

Accounting (``stats()``), per op kind, counts calls and the *payload* bytes that must leave or enter
this rank whatever algorithm the library picks. :func:`cpattn.core.steps.payload` is this table, the one rule that the
communicator, the schedules' ``volume()`` (derived from their ``steps()``) and the cost model share:

| op | bytes_sent | bytes_recv |
|---|---|---|
| send / recv (point-to-point) | tensor bytes | tensor bytes |
| broadcast of N bytes | N on the root | N on every other rank |
| reduce of N bytes | N on every non-root rank | N on the root |
| all_gather, n bytes in per rank | (P-1) n | (P-1) n |
| reduce_scatter, n bytes out per rank | (P-1) n | (P-1) n |
| all_reduce of N bytes | 2 (P-1) N / P | 2 (P-1) N / P |
| all_to_all of N bytes in per rank | (P-1) N / P | (P-1) N / P |

Each op kind also counts ``wire_sent``: the bytes this rank sends on the wire under the algorithm the
cost model picks for that op and size on the communicator's topology (:meth:`Communicator.set_topology`:
``ContextParallel`` gives it its topology and ``cpattn.cost.collectives.algorithm``), counting what
it forwards for others (:func:`cpattn.core.steps.wire`): a ring broadcast sends N from every rank but the
chain's last, a tree one about N per rank, an all_reduce 2 (P-1) N / P as a ring and about 2 N as a
tree; the other ops send their payload. ``stats()`` gives it in ``"total"``, and per op with
``stats(wire=True)``.

A hierarchical all_gather / reduce_scatter (:meth:`Communicator.hierarchical_all_gather`) counts as
*one* call of its op kind with the flat payload, (P-1) n: that is exactly what the rank sends and
receives over its two levels ((N-1) n across nodes plus (D-1) N n inside the node, for N nodes of D
devices), so a schedule's volume does not depend on the topology. Each level is also counted in the
stats of its own sub-communicator (:meth:`Communicator.level_stats`).

With ``cpattn.core.trace.recording()`` active, every call is also recorded (issue and wait), for the
tests that compare a schedule's run with its ``steps()``; with ``cpattn.core.trace.timeline()`` active, the
issue and the wait's start and end are stamped with wall time (``cpattn bench --trace``).

On a gloo group, calls on CUDA tensors (and on CPU tensors when forced: ``stage=True`` or
``CPATTN_STAGE=1``) run through reused host buffers (:mod:`cpattn.core.staging`), which lets P ranks
share one GPU; the accounting is the same either way.

Why one module over 500 lines: it is the one communicator (every collective and point-to-point call goes
through it, docs/architecture.md), and its accounting, staging and two-level collectives must see every call.
"""

from __future__ import annotations

import copy
import importlib
import logging
import os
import sys
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import trace
from .launch import no_group_error
from .staging import Stager, StagingPool, device_backends
from .steps import TREE_OPS, payload
from .steps import wire as wire_bytes
from .topology import Topology

log = logging.getLogger(__name__)

# Before any process group exists: torch.distributed.nn.functional's functions take ``group=group.WORLD`` as
# a default argument, evaluated once, at import. torch imports it lazily (``torch._dynamo``, which the first
# call of a custom op such as ``cpattn::attention`` imports), and imported after ``init_process_group`` its
# ten defaults would hold the default group for the life of the process: ``destroy_process_group()`` (and
# cpattn.distributed's exit hook) could not end it, and its gloo worker threads ran on into interpreter
# teardown, where one releasing a finished call's tensors aborted the process.
_BOUND_LATE = "torch.distributed.nn.functional" not in sys.modules and dist.is_available() and dist.is_initialized()
importlib.import_module("torch.distributed.nn.functional")
if _BOUND_LATE:  # too late for the import above: say so once
    log.warning("cpattn was imported after the default process group was created: torch's "
                "torch.distributed.nn.functional then holds that group until the process ends, and a gloo group may "
                "abort the interpreter's teardown; import cpattn before init_process_group (cpattn.distributed.init "
                "does)")

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# torch >= 2.7 names the flat collectives *_single; older releases only have *_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
#: when set (tests), fresh buffers are NaN-filled so any element read before it is written shows up
POISON_ENV = "CPATTN_POISON_BUFFERS"


class _Done:
    """Handle of an operation that already completed (world size 1, or a synchronous call)."""

    def wait(self) -> None:
        return None


class _Many:
    def __init__(self, works) -> None:
        self.works = list(works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []


class _Then:
    """Handle of a two-level collective: ``wait()`` waits for the first level, then runs ``finish``."""

    def __init__(self, first, finish) -> None:
        self.first, self.finish = first, finish

    def wait(self) -> None:
        if self.finish is not None:
            self.first.wait()
            self.finish()
            self.finish = None


#: (global ranks of the parent, nodes, devices per node) -> (rail group, node group) of this process
_HIERARCHY: dict[tuple[tuple[int, ...], int, int], tuple[weakref.ref, weakref.ref]] = {}


def _held(ref: weakref.ref | None) -> dist.ProcessGroup | None:
    """The process group behind a weak reference (None for none); a group destroyed since
    (``destroy_process_group``) is a RuntimeError rather than a call into a dead backend."""
    if ref is None:
        return None
    group = ref()
    if group is None:
        raise RuntimeError("this process group was destroyed (destroy_process_group, or cpattn.distributed.shutdown "
                           "at exit): build the ContextParallel, layer or trainer again on a live group")
    return group


class HeldGroup:
    """A process-group attribute held weakly: assign a group (or None); reading it gives the group, None, or a
    RuntimeError once the group was destroyed.

    torch.distributed's registry owns every group it made, so ``destroy_process_group()`` (cpattn.distributed's
    exit hook included) really ends them and joins gloo's worker threads while the interpreter is whole. An
    object a script keeps in a global (a ContextParallel, a layer, a trainer) that held its group strongly
    kept a destroyed group alive into interpreter teardown, where a gloo worker thread releasing a finished
    call's tensors found the interpreter finalizing and the process aborted ("terminate called without an
    active exception") after a run that had succeeded. Every cpattn object that keeps a group keeps it here."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = f"_{name}_held"

    def __get__(self, obj: object, objtype: type | None = None):
        if obj is None:
            return self
        return _held(obj.__dict__.get(self._slot))

    def __set__(self, obj: object, group: dist.ProcessGroup | None) -> None:
        obj.__dict__[self._slot] = None if group is None else weakref.ref(group)


#: names of the two levels of a hierarchical collective, rail first (``Communicator.level_stats``)
LEVELS = ("inter_node", "intra_node")


#: the payload counts of each op kind in ``Communicator.stats()`` (``Schedule.volume()``'s keys)
_PAYLOAD_KEYS = ("calls", "bytes_sent", "bytes_recv")


def _new_counts() -> dict[str, int]:
    return dict.fromkeys((*_PAYLOAD_KEYS, "wire_sent"), 0)


class _Recorded:
    """A handle whose ``wait()`` is recorded (``cpattn.core.trace``) the first time; with a timeline, its start
    and its end are stamped."""

    def __init__(self, handle, call: int) -> None:
        self.handle, self.call = handle, call

    def wait(self) -> None:
        if self.handle is not None:
            start = trace.now()
            self.handle.wait()
            self.handle = None
            trace.wait(self.call, start)


class Communicator:
    """Collectives and point-to-point on one process group, with byte accounting.

    ``group=None`` means WORLD; when torch.distributed is not initialised it is a one-rank world, so
    every schedule also runs as plain local attention, unless a launcher started this process as one of
    several (RuntimeError naming ``cpattn.distributed.init()``: :func:`cpattn.core.launch.no_group_error`).
    ``record=False``: never recorded by ``cpattn.core.trace`` (traffic that is not the schedule's own, e.g.
    ``unshard`` or the levels of a hierarchical collective, which is recorded as one call).

    ``stage``: whether calls run through host buffers (:mod:`cpattn.core.staging`): None (CUDA tensors
    on a gloo group, and CPU tensors too when ``CPATTN_STAGE=1``), True (CPU tensors too; the group must
    use gloo) or False (never). ``staging_pool``: the pool to take buffers from (a communicator's
    levels share their parent's; default a new one).
    """

    def __init__(self, group: dist.ProcessGroup | DeviceMesh | None = None, record: bool = True,
                 stage: bool | None = None, staging_pool: StagingPool | None = None) -> None:
        self.record = record
        self.stage = stage
        #: (rail, node) process groups of a 2-D mesh, or of a topology (see :meth:`setup_levels`)
        self._level_refs: tuple[weakref.ref, weakref.ref] | None = None
        self._levels_shape: tuple[int, int] | None = None
        self._subs: tuple[Communicator, Communicator] | None = None
        if isinstance(group, DeviceMesh):
            group = self._from_mesh(group)
        if not dist.is_available() or not dist.is_initialized():
            if group is not None:
                raise ValueError("group was given but torch.distributed is not initialised")
            missing = no_group_error(os.environ)  # a launcher started several processes: init() was forgotten
            if missing is not None:
                raise missing
            self.group = None
            self.rank, self.world_size = 0, 1
            self._global_ranks = [0]
            self.backends: dict[str, str] = {}  # device type -> backend name
            self._stager: Stager | None = None
        else:
            group = group if group is not None else dist.group.WORLD
            if group == dist.GroupMember.NON_GROUP_MEMBER:
                raise ValueError("this process is not a member of the given group")
            self.group = group
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
            self._global_ranks = dist.get_process_group_ranks(self.group)
            self.backends = device_backends(self.group)
            pool = staging_pool or StagingPool(poison=os.environ.get(POISON_ENV) == "1")
            self._stager = Stager(self.backends, stage, pool)
        self._stats: dict[str, dict[str, int]] = defaultdict(_new_counts)
        self._topology: Topology | None = None
        self._chooser: Callable[[str, int], str] | None = None
        self._algorithms: dict[tuple[str, int], str] = {}  # (op, bytes) -> the algorithm wire_sent counts

    #: the process group (None without torch.distributed), held weakly (:class:`HeldGroup`)
    group = HeldGroup()

    @property
    def _levels(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup] | None:
        """(rail, node) process groups of a 2-D mesh, or of a topology (see :meth:`setup_levels`)."""
        return None if self._level_refs is None else tuple(_held(r) for r in self._level_refs)

    @_levels.setter
    def _levels(self, groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None) -> None:
        self._level_refs = None if groups is None else tuple(weakref.ref(g) for g in groups)

    def _from_mesh(self, mesh: DeviceMesh) -> dist.ProcessGroup:
        """The flat group of a 1-D or 2-D device mesh; a 2-D mesh (inter-node dim first, intra-node dim
        second, e.g. ``("cp_inter", "cp_intra")``) also gives the rail and node groups of the two-level
        collectives. Flattening a 2-D mesh is collective over the default world (every process of it
        flattens its own mesh, in the same order), as building the mesh was."""
        if mesh.ndim == 1:
            return mesh.get_group()
        if mesh.ndim != 2:
            raise ValueError(f"group: a DeviceMesh of 1 or 2 dimensions is accepted (flat, or inter-node x "
                             f"intra-node), got {mesh.ndim} dimensions {mesh.mesh_dim_names}; slice the "
                             "context-parallel dimensions out of it, e.g. mesh['cp_inter', 'cp_intra']")
        self._levels = (mesh.get_group(0), mesh.get_group(1))
        self._levels_shape = (mesh.size(0), mesh.size(1))
        return mesh._flatten().get_group()

    def view(self, record: bool = False) -> Communicator:
        """A communicator on the same group and levels with its own statistics (``record=False``: not
        recorded by ``cpattn.core.trace``: setup traffic, ``unshard``), without creating any process group."""
        other = copy.copy(self)
        other.record = record
        other._stats = defaultdict(_new_counts)
        other._subs = None
        return other

    # ------------------------------------------------------------------ bookkeeping
    @property
    def staging(self) -> StagingPool | None:
        """The pool of host buffers staged calls use (its ``allocations`` count the buffers made), or
        None without a process group."""
        return self._stager.pool if self._stager is not None else None

    @property
    def levels_shape(self) -> tuple[int, int] | None:
        """(nodes, devices per node) of the two levels set up (from a 2-D mesh, or :meth:`setup_levels`)."""
        return self._levels_shape

    def global_rank(self, group_rank: int) -> int:
        if not 0 <= group_rank < self.world_size:
            raise ValueError(f"group rank {group_rank} outside [0, {self.world_size})")
        return self._global_ranks[group_rank]

    def set_topology(self, topology: Topology | None,
                     chooser: Callable[[str, int], str] | None = None) -> None:
        """The topology whose collective algorithms ``wire_sent`` counts with (None: one node of
        ``world_size`` ranks), and ``chooser(op, nbytes)``, which resolves them ("ring" or "tree"):
        ``ContextParallel`` passes the cost model's choice (``cpattn.cost.collectives.algorithm``), set
        at construction. Without a chooser, the topology's named algorithm counts, and "auto" counts as
        the ring."""
        if topology is not None and topology.world != self.world_size:
            raise ValueError(f"topology {topology.nodes} x {topology.devices_per_node} = {topology.world} ranks, "
                             f"but the group has {self.world_size}")
        self._topology = topology
        self._chooser = chooser
        self._algorithms = {}

    def algorithm(self, op: str, nbytes: int) -> str:
        """The algorithm ``wire_sent`` counts a broadcast, reduce or all_reduce of ``nbytes`` with (see
        :meth:`set_topology`); "ring" for other ops."""
        if op not in TREE_OPS:
            return "ring"
        key = (op, nbytes)
        if key not in self._algorithms:
            if self._chooser is not None:
                self._algorithms[key] = self._chooser(op, nbytes)
            else:
                named = (self._topology or Topology(1, self.world_size)).algorithm_for(op)
                self._algorithms[key] = "ring" if named == "auto" else named
        return self._algorithms[key]

    def _count(self, op: str, nbytes: int, root: int = 0) -> tuple[str, int, int]:
        """Account one ``op`` of ``nbytes`` (see :func:`payload` and :func:`wire`); returns ``(op, sent,
        recv)``."""
        sent, recv = payload(op, nbytes, self.world_size, self.rank, root)
        s = self._stats[op]
        s["calls"] += 1
        s["bytes_sent"] += sent
        s["bytes_recv"] += recv
        s["wire_sent"] += wire_bytes(op, nbytes, self.world_size, self.rank, root, self.algorithm(op, nbytes))
        return op, sent, recv

    def stats(self, wire: bool = False) -> dict[str, dict[str, int]]:
        """``{op: {"calls", "bytes_sent", "bytes_recv"}}`` plus ``"total"`` (which also has
        ``"wire_sent"``), for this rank; ``wire``: every op's ``"wire_sent"`` too. The per-op payload
        counts are what ``Schedule.volume()`` declares, key for key."""
        keys = (*_PAYLOAD_KEYS, "wire_sent") if wire else _PAYLOAD_KEYS
        out = {op: {k: v[k] for k in keys} for op, v in self._stats.items()}
        out["total"] = {k: sum(v[k] for v in self._stats.values()) for k in (*_PAYLOAD_KEYS, "wire_sent")}
        return out

    def reset_stats(self) -> None:
        self._stats.clear()
        for sub in self._subs or ():
            sub.reset_stats()

    @staticmethod
    def new_buffer(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """An uninitialised buffer (NaN-filled when CPATTN_POISON_BUFFERS=1)."""
        t = torch.empty(tuple(shape), dtype=dtype, device=device)
        if os.environ.get(POISON_ENV) == "1" and t.is_floating_point():
            t.fill_(float("nan"))
        return t

    # ------------------------------------------------------------------ point-to-point
    def send_recv(self, sends: Sequence[tuple[torch.Tensor, int]] = (),
                  recvs: Sequence[tuple[torch.Tensor, int]] = (), tag: int = 0):
        """Batched async point-to-point: ``sends`` / ``recvs`` are ``(tensor, group_rank)`` pairs.
        ``tag`` separates message streams between the same pair of ranks (e.g. kv vs gradients).
        Returns a handle; wait on it before reading received tensors or reusing sent ones."""
        start = trace.now()
        kinds = [(dist.isend, self.global_rank(peer)) for _, peer in sends]
        kinds += [(dist.irecv, self.global_rank(peer)) for _, peer in recvs]
        counted = [self._count("send", t.nbytes) for t, _ in sends]
        counted += [self._count("recv", t.nbytes) for t, _ in recvs]
        if not kinds:
            return _Done()

        def launch(*tensors: torch.Tensor) -> _Many:
            ops = [dist.P2POp(fn, t, peer, self.group, tag) for (fn, peer), t in zip(kinds, tensors)]
            return _Many(dist.batch_isend_irecv(ops))

        work = self._start(launch, *((t, "in") for t, _ in sends), *((t, "out") for t, _ in recvs))
        return self._issue(counted, work, start=start)

    # ------------------------------------------------------------------ collectives
    def _start(self, launch: Callable[..., object], *tensors: tuple[torch.Tensor, str]):
        """``launch(*tensors)``, which starts a call and returns its work, on the call's tensors (each
        ``(tensor, "in" | "out" | "inout")``: read, written or both), or on host buffers standing for
        them when this communicator stages the call (:mod:`cpattn.core.staging`)."""
        if self._stager is not None and self._stager.wants(tensors[0][0]):
            return self._stager.start(launch, tensors)
        return launch(*(t for t, _ in tensors))

    def _issue(self, counted: list[tuple[str, int, int]], work, async_op: bool = True, start=None):
        """The handle of a call already counted (``counted``) and started (``work``; None: done),
        recorded when ``cpattn.core.trace`` records or stamps a timeline; waited for here unless ``async_op``.
        ``start``: ``trace.now()``, taken by every call before it starts anything (a timeline's issue time;
        None without a timeline)."""
        handle = work if work is not None else _Done()
        call = trace.issue(counted, start) if self.record else None
        if call is not None:
            handle = _Recorded(handle, call)
        if async_op:
            return handle
        handle.wait()
        return _Done()

    def _collective(self, op: str, nbytes: int, async_op: bool, launch: Callable[..., object],
                    *tensors: tuple[torch.Tensor, str], root: int = 0, alone: Callable[[], object] | None = None):
        """The handle (:meth:`_issue`) of one call of ``op`` on ``nbytes``, counted (:meth:`_count`) and started:
        ``launch`` on ``tensors`` (:meth:`_start`); with one rank, ``alone()`` (the call's local effect) if given."""
        start = trace.now()
        counted = [self._count(op, nbytes, root=root)]
        if self.world_size > 1:
            return self._issue(counted, self._start(launch, *tensors), async_op, start=start)
        if alone is not None:
            alone()
        return self._issue(counted, None, async_op, start=start)

    def broadcast(self, t: torch.Tensor, src: int, async_op: bool = False):
        """Broadcast ``t`` (in place) from group rank ``src``."""
        return self._collective(
            "broadcast", t.nbytes, async_op,
            lambda x: dist.broadcast(x, self.global_rank(src), group=self.group, async_op=True),
            (t, "in" if self.rank == src else "out"), root=src)

    def reduce(self, t: torch.Tensor, dst: int, op: str = "sum", async_op: bool = False):
        """Reduce ``t`` (in place) onto group rank ``dst``; other ranks' ``t`` is scratch afterwards."""
        return self._collective(
            "reduce", t.nbytes, async_op,
            lambda x: dist.reduce(x, self.global_rank(dst), op=_REDUCE_OPS[op], group=self.group, async_op=True),
            (t, "inout" if self.rank == dst else "in"), root=dst)

    def all_reduce(self, t: torch.Tensor, op: str = "sum", async_op: bool = False):
        return self._collective("all_reduce", t.nbytes, async_op,
                                lambda x: dist.all_reduce(x, op=_REDUCE_OPS[op], group=self.group, async_op=True),
                                (t, "inout"))

    def _check_split(self, what: str, whole: torch.Tensor, part: torch.Tensor) -> None:
        """Shape check of an all-gather (``whole``: its out) or a reduce-scatter (``whole``: its input),
        flat or hierarchical: ``whole`` holds world_size ``part``s."""
        if whole.numel() != self.world_size * part.numel():
            raise ValueError(f"{what} has {whole.numel()} elements, expected {self.world_size} x {part.numel()}")

    def all_gather(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        """``out`` (first dim = world_size * t's first dim) receives every rank's ``t`` in rank order."""
        self._check_split("all_gather: out", out, t)
        return self._collective("all_gather", t.nbytes, async_op,
                                lambda o, i: _ALL_GATHER(o.view(-1), i.reshape(-1), group=self.group, async_op=True),
                                (out, "out"), (t, "in"), alone=lambda: out.copy_(t.view_as(out)))

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        """Sum ``t`` over ranks; rank r keeps the r-th of world_size equal slices in ``out``."""
        self._check_split("reduce_scatter: input", t, out)
        return self._collective(
            "reduce_scatter", out.nbytes, async_op,
            lambda o, i: _REDUCE_SCATTER(o.view(-1), i.reshape(-1), group=self.group, async_op=True),
            (out, "out"), (t, "in"), alone=lambda: out.copy_(t.view_as(out)))

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        """Equal-split all-to-all along the first dim (slice j of ``t`` goes to rank j)."""
        return self._collective("all_to_all", t.nbytes, async_op,
                                lambda o, i: dist.all_to_all_single(o, i, group=self.group, async_op=True),
                                (out, "out"), (t, "in"), alone=lambda: out.copy_(t))

    # ------------------------------------------------------------------ hierarchical collectives
    def setup_levels(self, topology: Topology | None) -> bool:
        """Make the rail and node groups of ``topology``'s two-level collectives ready; True when this
        communicator's hierarchical collectives run in two levels for ``topology``, False when the
        topology has one level (one node, one device per node, or no topology).

        Group rank g sits on node ``g // D`` at local index ``g % D`` (D = devices per node). The *rail*
        of local index l holds the ranks ``{n * D + l}`` (one per node: their traffic uses all NICs at
        once); the *node* group holds the D ranks of one node.

        - From a 2-D :class:`DeviceMesh` (``group=mesh``): its two dimensions are the rail and node
          groups; the topology must have the mesh's shape.
        - On a group spanning the whole default world: ``torch.distributed.new_group`` for every rail
          and every node, which every process enters in the same order (cached per process).
        - On a strict subgroup without a mesh: ``ValueError``, the same on every member. The processes
          outside the group would never enter ``new_group``, and a silently flat collective would not
          be the algorithm the cost model prices.

        ``ContextParallel`` calls this at construction, so no process group is created at run time.
        """
        if topology is None or min(topology.nodes, topology.devices_per_node, self.world_size) <= 1:
            return False
        if topology.world != self.world_size:
            raise ValueError(f"topology {topology.nodes} x {topology.devices_per_node} = {topology.world} ranks, "
                             f"but the group has {self.world_size}")
        shape = (topology.nodes, topology.devices_per_node)
        if self._level_refs is not None:
            if self._levels_shape != shape:
                raise ValueError(f"the levels set up are {self._levels_shape[0]} x {self._levels_shape[1]} "
                                 f"(inter-node x intra-node) but the topology is {shape[0]} x {shape[1]}")
            return True
        world = dist.get_world_size()
        if self.world_size != world:
            raise ValueError(
                f"topology {shape[0]} x {shape[1]} on a group of {self.world_size} of the {world} processes: "
                "its two-level collectives need rail and node process groups, which only every process of "
                "the world can create together. Pass group as a 2-D DeviceMesh instead, e.g. "
                "init_device_mesh(device, (dp, nodes, per_node), mesh_dim_names=('dp', 'cp_inter', "
                "'cp_intra'))['cp_inter', 'cp_intra'], or pass topology=None for flat collectives")
        key = (tuple(self._global_ranks), *shape)
        if key not in _HIERARCHY or any(r() is None for r in _HIERARCHY[key]):  # none yet, or destroyed since
            n_nodes, d = shape
            members = [[self._global_ranks[n * d + lo] for n in range(n_nodes)] for lo in range(d)]
            members += [[self._global_ranks[n * d + lo] for lo in range(d)] for n in range(n_nodes)]
            groups = [dist.new_group(ranks) for ranks in members]  # every process creates every group
            # every group stays registered in torch.distributed (which owns it) after this function
            _HIERARCHY[key] = (weakref.ref(groups[topology.local_index(self.rank)]),
                               weakref.ref(groups[d + topology.node_of(self.rank)]))
        self._level_refs, self._levels_shape = _HIERARCHY[key], shape
        return True

    def hierarchy(self, topology: Topology | None) -> tuple[Communicator, Communicator] | None:
        """``(rail, node)`` sub-communicators of this rank for ``topology`` (:meth:`setup_levels`, which
        runs here on first use when it has not run yet), or None when ``topology`` has one level."""
        if not self.setup_levels(topology):
            return None
        if self._subs is None:
            self._subs = tuple(Communicator(g, record=False, stage=self.stage, staging_pool=self.staging)
                               for g in self._levels)
        return self._subs

    def level_stats(self) -> dict[str, dict[str, int]]:
        """Totals (``calls``, ``bytes_sent``, ``bytes_recv``, ``wire_sent``) of the two levels of this
        communicator's hierarchical collectives: ``inter_node`` (the rails) and ``intra_node``; empty
        before any ran."""
        return {level: sub.stats()["total"] for level, sub in zip(LEVELS, self._subs or ())}

    def hierarchical_all_gather(self, out: torch.Tensor, t: torch.Tensor, topology: Topology | None,
                                async_op: bool = False):
        """:meth:`all_gather` in two levels: across nodes along each rail, then inside the node.

        The rail level gathers ``[N, *t.shape]`` (one piece per node, same local index); the node level
        gathers those into ``[D, N, *t.shape]``, which is transposed into ``out`` in group-rank order,
        so ``out`` equals the flat result exactly. With ``async_op`` the rail level is in flight until
        ``wait()``, which then runs the node level. Flat when :meth:`hierarchy` is None.
        """
        start = trace.now()
        levels = self.hierarchy(topology)
        if levels is None:
            return self.all_gather(out, t, async_op)
        rail, node = levels
        n_nodes, d = rail.world_size, node.world_size
        self._check_split("all_gather: out", out, t)
        counted = [self._count("all_gather", t.nbytes)]
        by_node = self.new_buffer((n_nodes, *t.shape), t.dtype, t.device)
        first = rail.all_gather(by_node, t.contiguous(), async_op=True)

        def finish() -> None:
            by_local = self.new_buffer((d, *by_node.shape), t.dtype, t.device)
            node.all_gather(by_local, by_node)
            out.view(n_nodes, d, -1).copy_(by_local.view(d, n_nodes, -1).transpose(0, 1))

        return self._issue(counted, _Then(first, finish), async_op, start=start)

    def hierarchical_reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, topology: Topology | None,
                                    async_op: bool = False):
        """:meth:`reduce_scatter` in two levels, mirroring :meth:`hierarchical_all_gather`.

        Inside the node first: the input is regrouped by destination local index (``[D, N, m]``) and
        reduce-scattered, so local index l holds the node's partial sums of the N slices bound for
        rail l; then across nodes along the rail, which leaves each rank its own slice summed over
        every rank. Sums are associated differently than in the flat collective (equal up to rounding).
        Flat when :meth:`hierarchy` is None.
        """
        start = trace.now()
        levels = self.hierarchy(topology)
        if levels is None:
            return self.reduce_scatter(out, t, async_op)
        rail, node = levels
        n_nodes, d = rail.world_size, node.world_size
        self._check_split("reduce_scatter: input", t, out)
        counted = [self._count("reduce_scatter", out.nbytes)]
        by_local = t.reshape(n_nodes, d, -1).transpose(0, 1).contiguous()
        partial = self.new_buffer((n_nodes, out.numel()), out.dtype, out.device)
        first = node.reduce_scatter(partial, by_local, async_op=True)
        return self._issue(counted, _Then(first, lambda: rail.reduce_scatter(out, partial)), async_op, start=start)

    def barrier(self) -> None:
        """Not counted: used by benchmarks to align ranks, never by schedules."""
        if self.world_size > 1:
            dist.barrier(group=self.group)
