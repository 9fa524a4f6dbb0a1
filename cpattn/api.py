"""The front door: :class:`ContextParallel` (the flash-attn style ``*_attn_func`` functions built on it
are in ``cpattn.functional``).

``ContextParallel`` wires a mask, a layout and a schedule object to a process group and owns what a
run keeps: the block lists of its runtime and, for a schedule that plans (``Schedule.make_plan``), the
plans it made (both bounded, keyed by value). Group rank 0 makes a plan and hands it to every rank as
JSON (``Schedule.read_plan``), so every rank runs the same one.

Why one module over 500 lines: ``ContextParallel`` is one object holding a run's state (its
communicator, runtime, caches, views and plans), and every method reads that state.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import logging
import math

import psutil
import torch
import torch.distributed as dist

from . import agree, cost, schedules
from .core import kernels, memo, placement
from .core import layout as layout_mod
from .core.comm import Communicator, DeviceMesh
from .core.masks import Mask, has_documents, resolve
from .core.memo import BoundedCache
from .core.steps import CommOp, Problem
from .core.topology import Topology
from .cost import collectives, discovery
from .cost.profile import digest as profile_digest
from .schedules.base import Runtime, Schedule, attention_op, register_site, site_slot
from .version import __version__

log = logging.getLogger(__name__)
#: plans a ContextParallel keeps (one per q/k shape and dtype it has run)
PLANS_KEPT = 8
#: entries a ContextParallel remembers (block lists, steps, pair work, estimates; cpattn.core.memo)
MEMO_KEPT = 1024
#: views (``with_mask``) a ContextParallel keeps, by mask: the windows of a model's layers, a few masks
VIEWS_KEPT = 16


#: the per-rank shape ``schedule="auto"`` estimates with: the layout (which ``shard`` needs) is fixed at
#: construction, before any q, k, v is seen
AUTO_SHAPE = {"batch": 1, "heads": 32, "kv_heads": 8, "head_dim": 128}


def _auto_schedule(mask: Mask, seq_len: int, world: int, topology: Topology | None) -> tuple[str, str]:
    """The schedule with the lowest predicted forward+backward time (``cpattn.cost.choose``) among those
    that support the mask, the layout split and :data:`AUTO_SHAPE` and that the cost model can estimate;
    ``(name, why)``. ``ultra`` is a candidate only for masks other than causal and full
    (``cpattn.cost.default_candidates``): its estimate plans :data:`AUTO_SHAPE` on every rank (under a
    second for small problems, tens of seconds at 64 ranks and 512K tokens; cached on disk afterwards).

    Estimated on ``topology`` when given (``ContextParallel`` gives the caller's, or the one found where the
    ranks run), else on the ``local`` preset: the calibration profile at the default location, or
    conservative defaults without one (or with an unreadable one, with a warning). Pure and deterministic,
    so every rank makes the same choice without communicating, as long as they see the same topology
    (``ContextParallel`` derives it from the placement every rank holds).
    """
    if topology is None:
        topology = cost.presets.this_machine(world, "schedule='auto'")
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    return cost.choose(cost.Problem(seq_len, world, mask, dtype=dtype, **AUTO_SHAPE), topology, nominal_shape=True)


def _exchange_device(comm: Communicator) -> torch.device:
    """Where the small setup tensors live: NCCL moves GPU tensors only."""
    if "nccl" in comm.backends.values() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _mask_text(mask: Mask) -> str:
    """A mask as text: its JSON spec, or its repr when it has none (``from_mask_mod`` masks)."""
    try:
        return json.dumps(mask.spec(), sort_keys=True)
    except TypeError:
        return repr(mask)


def _broadcast_text(comm: Communicator, text: str | None, device: torch.device) -> str:
    """Group rank 0's ``text`` on every rank (its length, then its UTF-8 bytes, as tensors on ``device``:
    NCCL only moves GPU tensors)."""
    raw = text.encode() if comm.rank == 0 else b""
    length = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    comm.broadcast(length, src=0)
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    if comm.rank == 0:
        data.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    comm.broadcast(data, src=0)
    return data.cpu().numpy().tobytes().decode()


#: the dimension orders ``ContextParallel.attention(qkv_format=...)`` takes q, k, v and returns out in
QKV_FORMATS = ("bshd", "bhsd")
#: the format of the call being checked on this thread (its messages name the caller's dimensions)
_QKV_FORMAT: contextvars.ContextVar[str] = contextvars.ContextVar("cpattn_qkv_format", default="bshd")


def _check_sinks(sinks, q: torch.Tensor) -> None:
    """Raise unless ``sinks`` is a floating tensor of one logit per query head, on q's device."""
    if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
        raise TypeError(f"sinks must be a floating torch.Tensor [heads], got {type(sinks).__name__}"
                        + (f" of {sinks.dtype}" if isinstance(sinks, torch.Tensor) else ""))
    if tuple(sinks.shape) != (q.shape[2],) or sinks.device != q.device:
        raise ValueError(f"sinks must have shape [{q.shape[2]}] (one logit per query head) on {q.device}, got "
                         f"{tuple(sinks.shape)} on {sinks.device}")


def _scale_like(softmax_scale) -> bool:
    """Whether ``softmax_scale`` can travel into the op (None or a real number; its value is checked
    there)."""
    return softmax_scale is None or (isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool))


def _positive(name: str, value) -> float:
    """``value`` (``softmax_scale``, ``softcap``) as a float; raise unless it is a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number or None, got {value!r}")
    return float(value)


class ContextParallel:
    """Exact attention over a sequence of ``seq_len`` tokens split across the ranks of ``group``::

        cp = cpattn.ContextParallel(seq_len=4096, mask="causal", schedule="zigzag_ring")
        q, k, v = (cp.shard(t, dim=1) for t in (q_full, k_full, v_full))   # [b, s, h, d], this rank's
        out = cp.attention(q, k, v)                                        # differentiable
        out_full = cp.unshard(out, dim=1)                                  # every rank, token order
        # the single-device reference: cpattn.masks.causal().dense(0, 4096, 0, 4096) is the bool mask

    ``mask``: a :class:`cpattn.masks.Mask`, ``"causal"``, ``"full"`` or a mask spec dict
    (``cpattn.masks.from_spec``); ``with_mask`` gives views for other masks (one per step or per layer).
    ``schedule``: a name from ``cpattn.schedules.available()`` (``cpattn schedules`` lists them),
    ``"auto"`` (the cost model picks), or a schedule object with options
    (``cpattn.schedules.USP(ulysses_degree=2)``, ``cpattn.schedules.Ultra(cpattn.planner.PlanOptions(...))``).
    ``group``: the process group or ``DeviceMesh`` the sequence is split over (None: the default group;
    a 2-D mesh, inter-node x intra-node, gives two-level collectives; without torch.distributed, one
    rank). ``topology``: where the ranks run, for ``"auto"`` and the two-level schedules: a
    :class:`cpattn.cost.Topology`; a preset name (``"dgx-h200"``, ``cpattn.cost.presets.NAMES``), whose
    figures go on the shape found; or None: a 2-D mesh's shape, else the shape found where the ranks
    run (nodes x ranks per node, the ranks grouped by host, ``$CPATTN_HOST`` overriding a host name) with
    the figures of ``$CPATTN_TOPOLOGY``'s preset or a calibration profile (``cpattn.cost.discovery``);
    ``cp.topology`` is the one used, and one log line says what was found. ``backend``: local kernels,
    ``"auto"``, ``"aten"``, ``"flash_attn"``, ``"flash_attn3"``, ``"flash_attn4"`` (FlashAttention-2, -3,
    -4 where installed) or ``"math"`` (FlexAttention runs masked blocks on CUDA under all but ``"math"``).
    ``layout``: None (the schedule's own; for a document mask on ``ring``, ``allgather``, ``ringx3``,
    ``ringx3b`` and ``usp``, the balanced layout below whenever it needs no more padding),
    ``"balanced"`` (an explicit layout that evens out the mask's work per rank,
    ``cpattn.layout.balanced``, rebalanced for each view's mask), a layout name or a
    :class:`cpattn.layout.Layout`; only schedules with ``custom_layout`` accept one. ``check``: when the
    ranks exchange a fingerprint so that a rank given other settings or inputs makes every rank raise
    the same error instead of hanging: ``"first"`` (at construction and at the first call with each new
    shape or mask), ``"always"`` (every call) or ``"off"``. ``memory_limit``: bytes one rank may use for
    a call (None: the device's free memory); a call whose predicted peak exceeds it is refused before it
    starts, naming the leanest schedule that fits. Every argument is checked here, before any
    communication.

    Padding: when the layout cannot split ``seq_len`` evenly, the sequence is padded at its end to
    ``padded_len`` with tokens that attend nothing and that nothing attends. ``shard`` takes the
    unpadded tensor and returns this rank's ``local_len`` tokens (padding rows zero-filled);
    ``attention`` takes and returns those padded local tensors (padding rows of ``out`` are 0, of
    ``lse`` -inf, and their gradients 0); ``unshard`` returns the unpadded full tensor; ``positions``
    marks padding rows with -1.
    """

    def __init__(self, seq_len: int, mask: Mask | str | dict = "causal", schedule: str | Schedule = "auto",
                 group: dist.ProcessGroup | DeviceMesh | None = None, topology: Topology | str | None = None,
                 backend: str = "auto", layout: str | layout_mod.Layout | None = None, check: str = "first",
                 memory_limit: int | None = None) -> None:
        """See the class: checks every argument (the same error on every rank), resolves ``"auto"``,
        picks the layout and the padded length, and builds this call's communicator and runtime."""
        self.comm = Communicator(group)
        self._setup = self.comm.view(record=False)  # agreement, planning and unshard traffic is not attention's
        self._exchange_device = _exchange_device(self.comm)
        # where every rank runs, through the group's store (no backend call): an NCCL group with two ranks
        # on one GPU is refused here, before NCCL's first operation would fail, the same on every rank; the
        # topology is read off the same list (cpattn.cost.discovery)
        self._places = placement.exchange(self._setup, profile_digest()) if check != "off" else None
        if self._places is not None:
            placement.refuse_nccl_sharing(self._places, self.comm.backends)
        error = None
        self._memo = BoundedCache(MEMO_KEPT)  # what this object's choices, plans and runs remember
        try:
            with memo.scope(self._memo):
                self._configure(seq_len, mask, schedule, topology, backend, layout, check, memory_limit)
        except Exception as exc:  # any check's error reaches every rank (agree), or the others would wait
            error = exc
        if check != "off":  # "off" trusts the caller: no exchange at all, errors stay on their rank
            agree.agree(self._setup, "ContextParallel", self._construction_fields(seq_len, schedule, group),
                        error, self._exchange_device)
        elif error is not None:
            raise error
        if self.schedule.hierarchical:  # rail and node groups now (collectively), never at run time
            self.comm.setup_levels(self.topology)
        wire_topology = self._wire_topology
        self.comm.set_topology(self.topology, lambda op, n: collectives.algorithm(CommOp(op, n), wire_topology))
        self._base: ContextParallel | None = None  # the object a view was made from (with_mask)
        self._views = BoundedCache(VIEWS_KEPT)  # views by mask, shared with every view of this object
        self._own_state()

    def _own_state(self) -> None:
        """What an object owns apart from its base (a view's too): its runtime, plans, first-call checks
        and op site."""
        self._runtime = Runtime(self.comm, self.mask, self.layout, self.padded_len, backend=self.backend,
                                topology=self.topology, seq_len=self.seq_len, block_cache=self._memo)
        self._plans = BoundedCache(PLANS_KEPT)
        self._checked: set = set()  # call signatures already agreed on (check="first")
        self._site = register_site(self)  # how the cpattn::attention op finds this object
        self._slot = site_slot(self._site)

    def _configure(self, seq_len, mask, schedule, topology, backend, layout, check, memory_limit) -> None:
        """Check every argument and derive the layout, on this rank only (no communication)."""
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        self.check = agree.check_mode(check)
        if memory_limit is not None and (isinstance(memory_limit, bool) or not isinstance(memory_limit, int)
                                         or memory_limit < 1):
            raise ValueError(f"memory_limit must be a positive int (bytes) or None, got {memory_limit!r}")
        self.memory_limit = memory_limit
        self.mask = resolve(mask)
        kernels.check_backend(backend)
        if topology is not None and not isinstance(topology, (Topology, str)):
            raise TypeError(f"topology must be a cpattn.cost.Topology, a preset name ({', '.join(cost.presets.NAMES)}) "
                            f"or None, got {type(topology).__name__}")
        mesh_shape = self.comm.levels_shape
        wire_topology = topology  # the topology whose collective algorithms wire bytes count with
        if not isinstance(topology, Topology):  # found where the ranks run (or a 2-D mesh's shape)
            whole = self.comm.group is None or self.comm.world_size == dist.get_world_size()
            found = discovery.discover(self._places, self.comm.world_size, topology, whole, mesh_shape)
            discovery.announce(found)
            topology = wire_topology = found.topology
            if not found.named:  # a found shape without a named preset counts on generic figures, as it always has
                wire_topology = Topology(topology.nodes, topology.devices_per_node)
        if mesh_shape is not None and (topology.nodes, topology.devices_per_node) != mesh_shape:
            raise ValueError(f"the device mesh is {mesh_shape[0]} x {mesh_shape[1]} (inter-node x intra-node) but "
                             f"the topology is {topology.nodes} x {topology.devices_per_node}")
        if topology.world != self.comm.world_size:
            raise ValueError(f"topology {topology.nodes} x {topology.devices_per_node} = {topology.world} ranks, "
                             f"but the group has {self.comm.world_size}")
        self.topology, self._wire_topology = topology, wire_topology
        if schedule == "auto":
            even = layout_mod.round_up(seq_len, 2 * self.comm.world_size)  # padded for any built-in layout
            schedule, why = _auto_schedule(self.mask, even, self.comm.world_size, topology)
            log.debug("schedule='auto' chose %s: %s", schedule, why)
        self.schedule = schedules.resolve(schedule)
        self.schedule.check_mask(self.mask)
        self.mask.check_seq_len(seq_len)
        self.layout, self.padded_len = self._choose_layout(layout, seq_len)
        self._layout_arg = layout  # a view chooses its layout for its own mask the same way
        self.seq_len = seq_len
        self.backend = backend

    def _construction_fields(self, seq_len, schedule, group) -> dict[str, str]:
        """The fingerprint every rank must share (what this rank could derive before any error)."""
        def get(name, describe=str):
            value = getattr(self, name, None)
            return "?" if value is None else describe(value)

        topo = getattr(self, "topology", None)
        group_backend = "none" if self.comm.group is None else dist.get_backend(self.comm.group)
        return {
            "seq_len": repr(seq_len),
            "mask": get("mask", _mask_text),
            "schedule": self.schedule.spec() if hasattr(self, "schedule") else repr(schedule),
            "layout": get("layout", lambda lay: lay.name),
            "padded_len": get("padded_len"),
            "topology": "None" if topo is None else f"{topo.name} {topo.nodes}x{topo.devices_per_node}",
            "backend": get("backend"),
            "check": get("check"),
            "process group": f"{self.comm.world_size} ranks, {group_backend}",
            "cpattn version": __version__,
        }
    def _choose_layout(self, layout, seq_len: int) -> tuple[layout_mod.Layout, int]:
        """The layout and the padded length it splits."""
        world, sched = self.comm.world_size, self.schedule
        if layout is None:
            chosen = sched.choose_layout(self.mask, seq_len, world)  # e.g. a planner's owner map
            if chosen is not None:
                return chosen
            lay = layout_mod.Layout(sched.layout_for(self.mask))
            padded = lay.padded_len(seq_len, world)
            if sched.custom_layout and sched.balances_documents and has_documents(self.mask):
                # each step's documents balanced, on as many chunks per rank as keep the padded length
                for chunks in (layout_mod.BALANCED_CHUNKS_PER_RANK, 2):
                    if layout_mod.round_up(seq_len, world * chunks) == padded:
                        return layout_mod.balanced(self.mask, padded, world, valid_len=seq_len,
                                                   chunks_per_rank=chunks), padded
            return lay, padded
        if not sched.custom_layout:
            takers = ", ".join(s["name"] for s in schedules.available() if s["custom_layout"])
            raise ValueError(f"layout={layout!r}: schedule {sched.name!r} runs only on its own "
                             f"{sched.layout_for(self.mask)!r} layout; schedules that accept a layout: {takers}")
        if layout == "balanced":
            padded = layout_mod.round_up(seq_len, world * layout_mod.BALANCED_CHUNKS_PER_RANK)
            return layout_mod.balanced(self.mask, padded, world, valid_len=seq_len), padded
        if isinstance(layout, str):
            if layout not in layout_mod.LAYOUTS:
                raise ValueError(f"layout={layout!r} is unknown; accepted: None, 'balanced', "
                                 f"{', '.join(map(repr, layout_mod.LAYOUTS))} or a cpattn.layout.Layout")
            layout = layout_mod.Layout(layout)
        if not isinstance(layout, layout_mod.Layout):
            raise TypeError(f"layout must be None, a name or a cpattn.layout.Layout, got {type(layout).__name__}")
        if layout.name == "striped":
            raise ValueError("layout='striped' is not a range layout: only schedule 'stripe_ring' runs on it")
        return layout, layout.padded_len(seq_len, world)

    # ------------------------------------------------------------------ per-step masks
    def with_mask(self, mask: Mask | str | dict) -> ContextParallel:
        """A view of this ContextParallel for another mask over the same ``seq_len`` (one step's packed
        documents, one layer's window): the same group, schedule, topology, backend and checks, with
        ``shard``, ``unshard``, ``positions``, ``attention`` and ``comm_stats`` of its own mask. Cheap:
        no process group is made and no schedule is searched; the layout is chosen for the mask as the
        constructor would (the schedule's own, or ``layout="balanced"`` rebalanced for it). Views are
        kept by mask (the last few), so asking again for an equal mask returns the same view with its
        block lists and steps. Collective: the ranks agree on the mask (one small exchange of a digest)
        the first time a mask is asked for (every time with ``check="always"``, never with
        ``check="off"``), so a rank given another mask makes every rank raise.

        A batch whose rows hold different documents is one packed sequence (rows flattened into the
        sequence dimension): ``cpattn.masks.document(lengths)`` over ``b * S`` tokens, or
        ``cpattn.masks.from_cu_seqlens(cu_seqlens)``."""
        base = self.base
        error, view, fresh = None, None, True
        try:
            resolved = resolve(mask)
            fresh = resolved != base.mask and resolved not in base._views
            view = base if resolved == base.mask else base._views.get(resolved, lambda: MaskView(base, resolved))
        except Exception as exc:  # reaches every rank (agree)
            error = exc
        if base.check == "always" or (base.check == "first" and fresh):
            text = _mask_text(resolved) if error is None else "?"
            agree.agree(base._setup, "ContextParallel.with_mask", {"mask": text}, error, base._exchange_device)
        elif error is not None:
            raise error
        return view

    # ------------------------------------------------------------------ properties
    @property
    def base(self) -> ContextParallel:
        """The object this one is a view of (``with_mask``), or itself."""
        return self._base or self

    @property
    def schedule_name(self) -> str:
        return self.schedule.name

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def local_len(self) -> int:
        """Tokens per rank, padding included."""
        return self.padded_len // self.comm.world_size

    # ------------------------------------------------------------------ layout
    def positions(self) -> torch.Tensor:
        """Global token index of each local token (1-D LongTensor); -1 marks padding tokens."""
        pos = self.layout.positions(self.padded_len, self.world_size, self.rank)
        return torch.where(pos < self.seq_len, pos, -1)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's ``local_len`` tokens of a full tensor whose sequence (length ``seq_len``) is at
        ``dim``, in the layout's order; padding rows are zero-filled."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"shard: tensor has {x.shape[dim]} tokens at dim {dim}, expected seq_len={self.seq_len}")
        pos = self.positions().to(x.device)
        local = x.index_select(dim, pos.clamp(min=0))
        pad = (pos < 0).nonzero().flatten()
        if pad.numel():
            local.index_fill_(dim, pad, 0)
        return local.contiguous()

    def unshard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Gather every rank's local tensor; all ranks get the full tensor in original token order.
        Collective: unless ``check="off"``, the ranks first agree on the tensor's shape, dtype and
        ``dim`` (a rank with a wrong tensor makes every rank raise)."""
        error = None
        try:
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"unshard: expected a torch.Tensor, got {type(x).__name__}")
            if x.shape[dim] != self.local_len:
                raise ValueError(f"unshard: tensor has {x.shape[dim]} tokens at dim {dim}, expected {self.local_len}")
        except Exception as exc:  # reaches every rank (agree)
            error = exc
        if self.check != "off":
            shape = f"{tuple(x.shape)}, {x.dtype}, dim {dim}" if isinstance(x, torch.Tensor) else type(x).__name__
            agree.agree(self._setup, "ContextParallel.unshard", {"tensor": shape}, error, self._exchange_device)
        elif error is not None:
            raise error
        moved = x.movedim(dim, 0).contiguous()
        gathered = torch.empty((self.world_size, *moved.shape), dtype=x.dtype, device=x.device)
        self._setup.all_gather(gathered, moved)
        parts = [gathered[r].movedim(0, dim) for r in range(self.world_size)]
        return layout_mod.assemble(parts, self.layout, dim).narrow(dim, 0, self.seq_len)

    # ------------------------------------------------------------------ attention
    def _validate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale) -> float:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape {tuple(t.shape)}")
            if t.dtype not in kernels.SUPPORTED_DTYPES:
                raise TypeError(f"{name}.dtype={t.dtype} is not supported; accepted: float32, bfloat16, "
                                "float16, float64 (CPU)")
        if not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
        if not (q.device == k.device == v.device):
            raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
        if q.dtype == torch.float64 and q.device.type != "cpu":
            raise TypeError("float64 is supported on the CPU only (reference work)")
        if k.shape != v.shape:
            raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"batch differs: q has {q.shape[0]}, k/v have {k.shape[0]}")
        if q.shape[3] != k.shape[3]:
            raise ValueError(f"head_dim differs: q has {q.shape[3]}, k/v have {k.shape[3]}")
        heads_first = _QKV_FORMAT.get() == "bhsd"  # q, k, v are then the transposes of the caller's tensors
        seq_dim, form = (2, "[batch, heads, seq, head_dim] (qkv_format='bhsd')") if heads_first else \
            (1, "[batch, seq, heads, head_dim]")
        for name, t in (("q", q), ("k", k)):
            if t.shape[1] != self.local_len:
                hint = ""
                if t.shape[2] == self.local_len and heads_first:
                    hint = "; it looks like [batch, seq, heads, head_dim]: leave out qkv_format='bhsd'"
                elif t.shape[2] == self.local_len:
                    hint = (f"; it looks like [batch, heads, seq, head_dim]: cpattn takes [batch, seq, heads, "
                            f"head_dim], so pass {name}.transpose(1, 2), or the tensors as they are with "
                            "cp.attention(..., qkv_format='bhsd')")
                elif t.shape[1] == self.seq_len and self.world_size > 1:
                    hint = (f"; it holds the whole sequence: pass this rank's part, cp.shard({name}_full, "
                            f"dim={seq_dim})")
                shape = tuple(t.transpose(1, 2).shape) if heads_first else tuple(t.shape)
                raise ValueError(f"{name} has {t.shape[1]} local tokens at dim {seq_dim} (shape {shape}); with "
                                 f"seq_len={self.seq_len} over {self.world_size} ranks each rank holds "
                                 f"{self.local_len} (padding included), as {form}{hint}")
        h, hkv = q.shape[2], k.shape[2]
        if hkv < 1 or h % hkv != 0:
            raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")
        self.schedule.check_shape(q, k, self.world_size)
        return kernels.default_scale(q.shape[3]) if softmax_scale is None else _positive("softmax_scale", softmax_scale)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                  return_lse: bool = False, sinks: torch.Tensor | None = None, softcap: float | None = None,
                  qkv_format: str = "bshd"):
        """Local ``q [b, s, h, d]``, ``k, v [b, s, h_kv, d]`` in this schedule's layout -> local ``out``
        (and ``lse [b, h, s]`` float32 with ``return_lse``). Differentiable in q, k, v.

        ``qkv_format``: the order of the dimensions of q, k, v and ``out``: ``"bshd"`` (the default,
        flash-attn's) or ``"bhsd"``, ``[b, h, s, d]`` as Hugging Face's attention functions and SDPA take
        them: passed as they are, with no transpose by the caller (the op reads their ``transpose(1, 2)``
        views), and ``out`` is returned as ``[b, h, s, d]``; ``lse`` is ``[b, h, s]`` either way. The sequence
        dimension is the local tokens in every format (``cp.shard(t, dim=2)`` shards a ``[b, h, s, d]``
        tensor). For example, ``out = cp.attention(q, k, v, qkv_format="bhsd")`` for ``q [b, h, s, d]``.

        ``sinks [h]``: attention sinks (gpt-oss's ``s_aux``), one logit per query head that joins every
        row's softmax as a key with no value; merged exactly on each row's owner, and differentiable
        (its gradient sums this rank's rows, as every parameter's does under context parallelism).
        ``softcap``: soft-capped scores ``tanh(s / softcap) * softcap`` (Gemma 2), on the kernel paths that
        apply a score modification: FlexAttention's ``score_mod`` on CUDA, else ``math`` (``backend``
        "auto" or "math"; another backend raises).

        One ``torch.library`` custom op, ``cpattn::attention`` (its backward: ``cpattn::attention_backward``):
        ``torch.compile(..., fullgraph=True)`` compiles a model that calls it, and selective activation
        checkpointing can save its outputs so that its communication is not rerun in the backward."""
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or not _scale_like(softmax_scale):
            self._checked_scale(q, k, v, softmax_scale)  # raises, on every rank alike
        if qkv_format not in QKV_FORMATS:
            raise ValueError(f"qkv_format={qkv_format!r} is unknown; accepted: 'bshd' ([batch, seq, heads, "
                             "head_dim], the default) or 'bhsd' ([batch, heads, seq, head_dim])")
        heads_first = qkv_format == "bhsd"
        if heads_first:
            q, k, v = (t.transpose(1, 2) if t.dim() == 4 else t for t in (q, k, v))
        scale = None if softmax_scale is None else float(softmax_scale)
        if sinks is not None:
            _check_sinks(sinks, q)
        else:
            sinks = q.new_empty(0, dtype=torch.float32)  # none
        if softcap is not None:
            softcap = _positive("softcap", softcap)
            kernels.check_softcap_backend(self.backend)
        # the checks run inside the op, on this thread: they learn the caller's format to name its dimensions
        # (not while torch.compile traces the call, which cannot trace a ContextVar)
        given = _QKV_FORMAT.set(qkv_format) if heads_first and not torch.compiler.is_compiling() else None
        try:
            out, lse, _saved = attention_op(q, k, v, self.base._site, self._slot, scale, sinks, softcap)
        finally:
            if given is not None:
                _QKV_FORMAT.reset(given)
        if heads_first:
            out = out.transpose(1, 2)
        return (out, lse) if return_lse else out

    def _checked_scale(self, q, k, v, softmax_scale) -> float:
        """The call's softmax scale after its checks: agreed with the other ranks on the first call with
        this signature (every call with ``check="always"``), else checked on this rank only."""
        key = agree.signature_key(q, k, v, softmax_scale)
        if self.check == "always" or (self.check == "first" and key not in self._checked):
            scale = self._agree_on_call(q, k, v, softmax_scale)
            self._checked.add(key)
            return scale
        return self._validate(q, k, v, softmax_scale)

    def prepare(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None
                ) -> tuple[Schedule, Runtime]:
        """What ``cpattn::attention`` runs a forward with: the checks (and agreement), then the schedule
        and this call's runtime (scale, plan)."""
        return self._call(q, k, self._checked_scale(q, k, v, softmax_scale))

    def runtime(self, q: torch.Tensor, k: torch.Tensor, softmax_scale: float | None) -> tuple[Schedule, Runtime]:
        """The schedule and runtime of a call already checked by :meth:`prepare` (for its backward)."""
        return self._call(q, k, kernels.default_scale(q.shape[3]) if softmax_scale is None else float(softmax_scale))

    def _call(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> tuple[Schedule, Runtime]:
        return self.schedule, dataclasses.replace(self._runtime, scale=scale, plan=self.plan(q, k))

    def _agree_on_call(self, q, k, v, softmax_scale) -> float:
        """:meth:`_validate` and the memory pre-check on this rank, then one exchange so that every rank
        raises the same error when any rank's call is invalid or differs from the others'."""
        error, scale, plans = None, None, self.schedule.make_plan is not None
        try:
            scale = self._validate(q, k, v, softmax_scale)
            if not plans:
                self.check_memory(q, k, v)
        except Exception as exc:  # any check's error reaches every rank (agree), or the others would wait
            error = exc
        agree.agree(self._setup, "ContextParallel.attention", agree.signature(q, k, v, softmax_scale), error,
                    self._exchange_device)
        if plans:  # its model is its plan, made (collectively) for this signature
            error = None
            try:
                self.check_memory(q, k, v)
            except Exception as exc:
                error = exc
            agree.agree(self._setup, "ContextParallel.attention", {}, error, self._exchange_device)
        return scale

    # ------------------------------------------------------------------ memory
    def available_memory(self, device: torch.device) -> tuple[int, str]:
        """Bytes this rank can still allocate on ``device`` and where the figure comes from:
        ``memory_limit`` when given, else this rank's share of the device's free memory (CUDA: 1/k of
        the GPU's free memory for the k ranks of the group on that GPU, plus what torch's allocator
        holds unused in this process), else 1/k of the host's available memory for the k ranks of the
        group on this host. k comes from the placement exchanged at construction (1 with
        ``check="off"``)."""
        if self.memory_limit is not None:
            return self.memory_limit, "memory_limit"
        ranks = 1 if self._places is None else placement.sharers(self._places, self.rank, device.type)
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            if ranks == 1:
                return free + unused, f"{device} free"
            return free // ranks + unused, f"1/{ranks} of {device} free: {ranks} ranks of the group share it"
        available = psutil.virtual_memory().available
        if ranks == 1:
            return available, "host memory available"
        return available // ranks, f"1/{ranks} of the host memory available: {ranks} ranks of the group on this host"

    def peak_memory(self, q: torch.Tensor, k: torch.Tensor, schedule: Schedule | None = None) -> int:
        """The model's peak bytes per rank (``cpattn.cost``) of one call with local ``q``, ``k`` on
        ``schedule`` (default: this one): inputs, outputs and the schedule's largest live buffers;
        forward only when no input requires grad."""
        sched = schedule or self.schedule
        phase = "forward+backward" if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad) \
            else "forward"
        problem = self.problem(q, k)
        topology = self.topology
        plan = self.plan(q, k) if sched == self.schedule else None
        return cost.estimate(sched, problem, topology, phase, plan=plan).peak_memory

    def check_memory(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise ``MemoryError`` when the call's peak (:meth:`peak_memory`, less q, k, v already held)
        exceeds :meth:`available_memory`, naming both figures and the leanest schedule that fits."""
        held = sum(t.numel() * t.element_size() for t in (q, k, v))
        peak = self.peak_memory(q, k)
        need = peak - held
        have, source = self.available_memory(q.device)
        if need <= have:
            return
        lean = self._leanest(q, k, peak)
        gib = 2 ** 30
        if lean is None:
            advice = "no other schedule for this mask is estimated to need less"
        else:
            name, peak = lean
            fits = "fits" if peak - held <= have else "does not fit either"
            advice = (f"the leanest schedule for mask {self.mask.name!r} is {name!r} ({(peak - held) / gib:.2f} "
                      f"GiB, {fits})")
        raise MemoryError(f"schedule {self.schedule.name!r} needs about {need / gib:.2f} GiB per rank for this call "
                          f"(model peak less the q, k, v already held) but {have / gib:.2f} GiB is available "
                          f"({source}); {advice}. Reduce the batch or sequence, or choose a leaner schedule")

    def _leanest(self, q: torch.Tensor, k: torch.Tensor, mine: int) -> tuple[str, int] | None:
        """The registered schedule (of those that need no plan) with the smallest peak for this call's
        problem, when it is smaller than ``mine``, this schedule's peak."""
        problem, best = self.problem(q, k), None
        for name in schedules.names():
            sched = schedules.get(name)
            if sched.make_plan is not None or sched == self.schedule:
                continue
            try:
                cost.check_supports(sched, problem)
                peak = self.peak_memory(q, k, sched)
            except (ValueError, TypeError, NotImplementedError):
                continue
            if best is None or peak < best[1]:
                best = (name, peak)
        return best if best is not None and best[1] < mine else None

    # ------------------------------------------------------------------ plans (schedules that plan)
    def plan(self, q: torch.Tensor, k: torch.Tensor):
        """The plan this schedule runs a call with local ``q``, ``k`` with (kept per shape and dtype), or
        None when it needs none: made (or read from the plan cache) on group rank 0 and handed to every
        rank, so every rank runs the same plan; a view's plans are made fast (``make_plan(fast=True)``).
        Planning errors are raised on every rank, with their type."""
        if self.schedule.make_plan is None:
            return None
        key = (tuple(q.shape), tuple(k.shape), q.dtype, q.device.type)
        with memo.scope(self._memo):
            return self._plans.get(key, lambda: self._distribute_plan(q, k))

    def _distribute_plan(self, q: torch.Tensor, k: torch.Tensor):
        topology = self.topology
        fast = self._base is not None  # a per-step mask is placed fast; the solver stays for the base mask

        def make():
            return self.schedule.make_plan(self.problem(q, k), topology, fast=fast)

        if self.world_size == 1:
            return make()
        setup = self._setup  # planning traffic is not attention traffic
        text = None
        if setup.rank == 0:
            try:
                text = make().to_json()
            except Exception as exc:  # every rank must hear about it, or they would wait forever
                text = json.dumps({"error": agree.describe_error(exc)})
        text = _broadcast_text(setup, text, q.device)
        if text.startswith('{"error":'):
            kind, base, message = json.loads(text)["error"]
            raise agree.rebuild_error(base, f"{self.schedule.name}: planning failed on rank 0: {kind}: {message}")
        return self.schedule.read_plan(text)

    def problem(self, q: torch.Tensor, k: torch.Tensor) -> Problem:
        """The :class:`cpattn.core.steps.Problem` of a call with local ``q``, ``k`` (padded length)."""
        return self._runtime.problem(q, k)

    def expected_volume(self, q: torch.Tensor, k: torch.Tensor) -> dict[str, dict[str, dict[str, int]]]:
        """What ``comm_stats()`` must count on this rank for one forward and one backward with local
        ``q``, ``k``, per phase: the volume of this rank's program (``Schedule.volume``)."""
        return self.schedule.volume(self.problem(q, k), self.rank, self.topology, self.plan(q, k))

    def program(self, q: torch.Tensor, k: torch.Tensor, phase: str) -> list:
        """The steps this rank runs in ``phase`` for a call with local ``q``, ``k`` (``Schedule.program``
        with this call's plan)."""
        return self.schedule.program(self.problem(q, k), phase, self.topology, self.plan(q, k), self.rank)

    # ------------------------------------------------------------------ accounting
    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Bytes sent/received and calls per op kind on this rank, since creation or the last reset
        (attention traffic only); ``"total"`` also has ``wire_sent``, the bytes sent on the wire under
        the cost model's collective algorithms (``Communicator.stats``). When hierarchical collectives
        ran, ``"levels"`` gives the totals each level carried (``inter_node``: the rails across nodes;
        ``intra_node``), which add up to what their collectives count."""
        stats = self.comm.stats()
        if levels := self.comm.level_stats():
            stats["levels"] = levels
        return stats

    def reset_comm_stats(self) -> None:
        self.comm.reset_stats()


class MaskView(ContextParallel):
    """What :meth:`ContextParallel.with_mask` returns: a ContextParallel for another mask over its base's
    ``seq_len``. It shares the base's group, communicators, schedule, topology, backend, check mode and
    views, and owns what depends on the mask: the layout chosen for it, the caches (block lists, block
    masks, plans), the runtime, the op's site and its first-call checks (a view's first call is checked
    as a new object's is). Made on this rank only (``with_mask`` agrees on the mask)."""

    def __init__(self, base: ContextParallel, mask: Mask) -> None:  # nothing collective: no super().__init__
        base.schedule.check_mask(mask)
        mask.check_seq_len(base.seq_len)
        self._base, self.mask = base, mask
        # shared with the base: its group and communicators, its settings and its views
        self.comm, self._setup, self._exchange_device = base.comm, base._setup, base._exchange_device
        self._places, self._views, self.check, self.memory_limit = base._places, base._views, base.check, \
            base.memory_limit
        self.topology, self.schedule, self.backend, self.seq_len = base.topology, base.schedule, base.backend, \
            base.seq_len
        self._memo = BoundedCache(MEMO_KEPT)  # its own: caches, layout, runtime, plans, checks, op site
        with memo.scope(self._memo):
            self.layout, self.padded_len = self._choose_layout(base._layout_arg, base.seq_len)
        self._own_state()
