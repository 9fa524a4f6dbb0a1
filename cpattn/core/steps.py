"""What a schedule declares: a problem, and the steps it runs on it (pure data).

A schedule's ``steps(problem, phase, topology)`` (see :class:`cpattn.schedules.base.Schedule`) returns
a list of :class:`Step`: the one description of its communication and compute. Its per-rank byte
counts (``Schedule.volume``, through :meth:`CommOp.accounting` and :func:`payload`), the
cost model's estimate and the recording tests (``cpattn.exactness.check_steps``) all read it. Steps run in
order on every rank. A step is the interval between two points where
ranks wait on each other (a transfer's ``wait``): it holds the kernel calls each rank runs (as a
distribution: which :data:`Work` how many ranks do), the communication ops issued in it, and whether
those ops overlap the step's compute. The cost model times a step by its busiest rank, so a step
must not span a synchronisation point.

Why one module over 500 lines: the whole vocabulary of a program (problem, work, ops,
steps, actions and the accounting rule) is read together by schedules, the executor and the cost model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field

from . import memo
from .kernels import DTYPES, element_bytes
from .layout import Layout
from .masks import BlockKind, CausalMask, FullMask, Mask, allowed_pairs, resolve

#: bytes per element of q/k/v for each supported dtype name (from the one table, ``kernels.DTYPES``)
DTYPE_BYTES = {name: element_bytes(name) for name in DTYPES}
PHASES = ("forward", "backward")
#: backward kernels do 2.5x the forward FLOPs (the convention docs/bench.md describes)
BACKWARD_FLOP_RATIO = 2.5


def payload(op: str, nbytes: int, size: int, rank: int, root: int = 0) -> tuple[int, int]:
    """``(bytes_sent, bytes_recv)`` that one ``op`` of ``nbytes`` adds to group rank ``rank``'s
    accounting in a group of ``size`` ranks (the table in ``cpattn.core.comm``'s docstring: the one
    accounting rule). ``nbytes``: the tensor of a send / recv / broadcast / reduce / all_reduce; the
    per-rank input of an all_gather or all_to_all; the per-rank output of a reduce_scatter. ``root``: of
    a broadcast or reduce."""
    n, p = int(nbytes), size
    if op == "send":
        return n, 0
    if op == "recv":
        return 0, n
    if op == "broadcast":
        return (n, 0) if rank == root else (0, n)
    if op == "reduce":
        return (0, n) if rank == root else (n, 0)
    if op == "all_reduce":
        vol = 2 * (p - 1) * n // p
    elif op == "all_to_all":
        vol = (p - 1) * n // p
    elif op in ("all_gather", "reduce_scatter"):
        vol = (p - 1) * n
    else:
        raise ValueError(f"op={op!r} is unknown to the accounting")
    return vol, vol


#: collectives that run as a ring or as a tree (the others have one algorithm)
TREE_OPS = ("broadcast", "reduce", "all_reduce")


def wire(op: str, nbytes: int, size: int, rank: int, root: int = 0, algorithm: str = "ring") -> int:
    """Bytes group rank ``rank`` sends *on the wire* for one ``op`` of ``nbytes`` (as :func:`payload`
    takes them) in a group of ``size`` ranks under ``algorithm`` ("ring" or "tree", for the ops of
    :data:`TREE_OPS`; the other ops have one algorithm and ignore it), counting what ranks forward for
    others. ``root``: of a broadcast or reduce.

    | op | ring | tree (double binary tree) |
    |---|---|---|
    | broadcast of N | N on every rank but the chain's last (root - 1) | N/2 per child per tree (below) |
    | reduce of N | N on every non-root rank | N on every non-root rank (N/2 up each tree) |
    | all_reduce of N | 2 (P-1) N / P | N/2 up (but at a tree's top) + N/2 per child, per tree |
    | all_gather, reduce_scatter (n) | (P-1) n | - |
    | all_to_all (N in) | (P-1) N / P | - |
    | send / recv (n) | n / 0 | - |

    Summed over the group: ring and tree broadcast and reduce (P-1) N, all_reduce 2 (P-1) N.

    Trees: two complementary binary trees, each carrying half of the message (the first ``N - N // 2``
    bytes, the second ``N // 2``). A tree over m ranks is the in-order binary tree of NCCL's double
    binary tree (top 0 with one child; every other rank's parent flips its lowest set bit up), the
    second the first mirrored (m - 1 - i, m even) or shifted by one (m odd), so that most ranks are
    inner nodes of one tree (two children: N/2 each) and leaves of the other: about N per rank. A
    broadcast or reduce builds both trees over the P - 1 ranks after the root (group rank root + 1 + i
    is tree rank i); the root feeds (or is fed by) both tops. An all_reduce builds them over all P
    ranks (group rank i is tree rank i), reduces up and broadcasts down each.
    """
    n, p = int(nbytes), size
    if op in TREE_OPS and algorithm not in ("ring", "tree"):
        raise ValueError(f"algorithm={algorithm!r} for {op}: expected 'ring' or 'tree' (resolve 'auto' first)")
    if p < 1 or not 0 <= rank < p or not 0 <= root < p:
        raise ValueError(f"rank={rank} and root={root} must lie in a group of size={size}")
    if op not in TREE_OPS or (op == "all_reduce" and algorithm == "ring"):
        return payload(op, n, p, rank, root)[0]  # which also rejects an unknown op
    if p == 1:
        return 0
    v = (rank - root) % p
    if op == "reduce":
        return 0 if v == 0 else n
    halves = (n - n // 2, n // 2)
    if op == "broadcast":
        if algorithm == "ring":
            return 0 if v == p - 1 else n
        if v == 0:
            return n
        return sum(h * c for h, c in zip(halves, _double_tree_children(v - 1, p - 1)))
    tops = (0, p - 1 if p % 2 == 0 else 1)  # all_reduce
    return sum(h * (c + (rank != top)) for h, c, top in zip(halves, _double_tree_children(rank, p), tops))


def _tree_children(i: int, m: int) -> int:
    """Children of rank ``i`` in the in-order binary tree over ``0 .. m-1``: the top 0 has one (the
    largest power of two below m); an odd rank is a leaf; rank i with lowest set bit b > 1 has i - b/2
    and the first of i + b/2, i + b/4, ..., i + 1 below m (there is one when i + 1 < m)."""
    if m <= 1:
        return 0
    if i == 0:
        return 1
    if i % 2:
        return 0
    return 1 + (i + 1 < m)


def _double_tree_children(i: int, m: int) -> tuple[int, int]:
    """Children of rank ``i`` in the two trees of a double binary tree over ``m`` ranks."""
    second = m - 1 - i if m % 2 == 0 else (i - 1) % m
    return _tree_children(i, m), _tree_children(second, m)


def attention_flops(batch: int, heads: int, head_dim: int, pairs: float, phase: str = "forward") -> float:
    """The one FLOP count: ``4 b h d`` per attending (query, key) pair forward, 2.5x that backward
    (docs/bench.md); ``phase`` may be "forward+backward"."""
    factor = sum(1.0 if p == "forward" else BACKWARD_FLOP_RATIO for p in split_phase(phase))
    return 4.0 * batch * heads * head_dim * pairs * factor


#: communication ops a step may issue (``sendrecv`` is one batched send plus one receive)
COMM_OPS = ("sendrecv", "send", "recv", "broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter",
            "all_to_all")
#: process groups an op may run on: every rank, the ranks of one node, or one rail (same local index)
GROUPS = ("world", "node", "rail")


@dataclass(frozen=True)
class Problem:
    """One attention call: a sequence of ``seq_len`` tokens over ``world`` ranks, ``[batch, seq, heads,
    head_dim]`` queries and ``kv_heads`` key/value heads in ``dtype`` (a name in :data:`DTYPE_BYTES`).

    ``layout``: how the ranks hold the tokens (a :class:`cpattn.layout.Layout`; None: the schedule's
    own). ``padded_len``: the length the layout splits, ``seq_len`` rounded up to its multiple (the
    tokens past ``seq_len`` are padding: they attend nothing and nothing attends them); None: no
    padding, so ``seq_len`` must split evenly. Message sizes count the padded local length; FLOPs
    count the pairs of real tokens."""

    seq_len: int
    world: int
    mask: Mask | str = "causal"
    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    layout: Layout | None = None
    padded_len: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mask", resolve(self.mask))
        if self.padded_len is None:
            object.__setattr__(self, "padded_len", self.seq_len)
        for name in ("seq_len", "world", "batch", "heads", "kv_heads", "head_dim", "padded_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Problem.{name} must be a positive int, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"Problem.heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"Problem.dtype={self.dtype!r} is unknown; accepted: {', '.join(DTYPE_BYTES)}")
        if self.layout is not None and not isinstance(self.layout, Layout):
            raise TypeError(f"Problem.layout must be a cpattn.layout.Layout or None, got {type(self.layout).__name__}")
        if self.padded_len < self.seq_len:
            raise ValueError(f"Problem.padded_len={self.padded_len} is shorter than seq_len={self.seq_len}")
        if self.padded_len % self.world:
            what = "seq_len" if self.padded_len == self.seq_len else "padded_len"
            raise ValueError(f"Problem.{what}={self.padded_len} is not a multiple of world={self.world}")
        if self.layout is not None:
            self.layout.check(self.padded_len, self.world)

    @property
    def padded(self) -> bool:
        """Whether the layout splits padding tokens beyond ``seq_len``."""
        return self.padded_len != self.seq_len

    def layout_or(self, own: str) -> Layout:
        """The layout of this problem, or the schedule's ``own`` when it names none."""
        return self.layout if self.layout is not None else Layout(own)

    @property
    def local_len(self) -> int:
        """Tokens per rank, padding included."""
        return self.padded_len // self.world

    @property
    def elem(self) -> int:
        """Bytes per element of q, k, v."""
        return DTYPE_BYTES[self.dtype]

    @property
    def acc_elem(self) -> int:
        """Bytes per element of partial outputs and gradient accumulators (``kernels.acc_dtype``)."""
        return element_bytes(self.dtype, accumulator=True)

    @property
    def q_bytes(self) -> int:
        """One rank's queries (or out, dout, dq in the input dtype) ``[b, s, h, d]``."""
        return self.batch * self.local_len * self.heads * self.head_dim * self.elem

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

    def allowed_pairs(self) -> int:
        """(query, key) pairs that attend over the whole sequence (closed form for causal and full)."""
        s = self.seq_len
        if isinstance(self.mask, FullMask):
            return s * s
        if isinstance(self.mask, CausalMask):
            return s * (s + 1) // 2
        return memo.cached(("allowed_pairs", self.mask, s), lambda: allowed_pairs(self.mask, s))

    def flops(self, phase: str) -> float:
        """Attention FLOPs of ``phase`` ("forward", "backward" or "forward+backward") over the whole
        sequence, counting only allowed pairs: 4 b h d pairs forward, 2.5 x that backward."""
        return attention_flops(self.batch, self.heads, self.head_dim, self.allowed_pairs(), phase)


def split_phase(phase: str) -> tuple[str, ...]:
    """``"forward"``, ``"backward"`` or ``"forward+backward"`` -> the phases it runs."""
    phases = tuple(phase.split("+"))
    if not phases or any(p not in PHASES for p in phases) or len(set(phases)) != len(phases):
        raise ValueError(f"phase={phase!r} is unknown; accepted: forward, backward, forward+backward")
    return phases


@dataclass(frozen=True, order=True)
class Kernel:
    """One local kernel call: ``q_len`` query rows against ``kv_len`` key rows of kind ``kind``
    ("full", "causal" or "partial"), of which ``area`` (query, key) pairs attend, on ``heads`` query
    and ``kv_heads`` key/value heads (0: all of the problem's; fewer when the heads are split over
    ranks, as in Ulysses)."""

    kind: str
    q_len: int
    kv_len: int
    area: int
    heads: int = 0
    kv_heads: int = 0

    def head_counts(self, problem: Problem) -> tuple[int, int]:
        """(query heads, key/value heads) this call runs."""
        return self.heads or problem.heads, self.kv_heads or problem.kv_heads

    def flops(self, problem: Problem, phase: str) -> float:
        """FLOPs this call executes. FULL and CAUSAL kernels skip what is masked; a PARTIAL one runs
        densely over its whole rectangle (the mask is applied to the scores)."""
        pairs = self.q_len * self.kv_len if self.kind == BlockKind.PARTIAL.value else self.area
        heads, _ = self.head_counts(problem)
        return attention_flops(problem.batch, heads, problem.head_dim, pairs, phase)

    def epilogue_bytes(self, problem: Problem, phase: str) -> float:
        """Memory traffic of folding the result into the accumulators (bytes): forward, read and
        write the running output and lse and read the block's; backward, the same for dq, dk, dv."""
        a, b, d = problem.acc_elem, problem.batch, problem.head_dim
        heads, kv_heads = self.head_counts(problem)
        if phase == "forward":
            return 3.0 * a * b * self.q_len * heads * (d + 1)
        return 3.0 * a * b * d * (self.q_len * heads + 2 * self.kv_len * kv_heads)


#: the kernel calls of one rank in one step: ``((kernel, calls), ...)``, canonical (sorted, merged)
Work = tuple[tuple[Kernel, int], ...]


def work(items) -> Work:
    """Canonical :data:`Work` from ``(kernel, calls)`` pairs (merges repeats, drops zero calls)."""
    counts: Counter[Kernel] = Counter()
    for kernel, calls in items:
        if calls:
            counts[kernel] += calls
    return tuple(sorted(counts.items()))


def area(w: Work) -> int:
    """Attending (query, key) pairs of a :data:`Work`."""
    return sum(k.area * n for k, n in w)


@dataclass(frozen=True)
class CommOp:
    """One communication op issued by every rank of ``group`` in a step.

    ``bytes`` is the op's message size, as in ``cpattn.core.comm``: the tensor of a ``sendrecv`` (rank r
    sends it to r + ``peer`` and receives one from r - ``peer``), of a ``send`` to / ``recv`` from the
    one group rank ``root`` (steps compiled for one rank, as ``ultra``'s plan is) or of a ``broadcast`` / ``reduce``
    (``root`` is the group rank that sends / receives it) / ``all_reduce``; the per-rank input of an
    ``all_gather`` or ``all_to_all``; the per-rank output of a ``reduce_scatter``. ``hierarchical``
    all-gathers and reduce-scatters run in two levels (across nodes along each rail, then inside the
    node; reduce-scatter mirrored) and are accounted as one flat call.

    What the executor (``cpattn.core.executor``) moves, outside the op's identity: ``send``, the buffer
    role it sends (a ``sendrecv``'s message, an ``all_gather``'s or ``reduce_scatter``'s input, the
    root's tensor of a ``broadcast``, the tensor a ``reduce`` or ``all_reduce`` reduces in place with
    ``reduce_op``, an ``all_to_all``'s input), and ``recv``, the role it receives into (a new buffer;
    a broadcast's root names its own tensor so). A ``sendrecv`` goes to group rank ``r + peer`` and
    comes from ``r - peer`` (modulo the group, or inside groups of ``within`` consecutive ranks).
    """

    op: str
    bytes: int
    group: str = "world"
    peer: int = 1
    root: int = 0
    hierarchical: bool = False
    send: str | None = field(default=None, compare=False)
    recv: str | None = field(default=None, compare=False)
    reduce_op: str = field(default="sum", compare=False)  # of a reduce or all_reduce: "sum" or "max"
    #: a sendrecv's ``peer`` wraps inside consecutive groups of this many ranks (None: the whole group)
    within: int | None = field(default=None, compare=False)
    #: a sendrecv of one slice of an exchange: send ``send[to]``, receive into ``recv[from]`` (members
    #: counted inside ``within``); the first such op of a step allocates ``recv`` with the own slice
    slot: bool = field(default=False, compare=False)
    #: the index of a later step (in the list being run) at whose start the op is waited for; None: at
    #: the end of its own step
    wait: int | None = field(default=None, compare=False)
    #: the message tag of a ``send`` / ``recv`` (None: the op's place in its step)
    tag: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.op not in COMM_OPS:
            raise ValueError(f"CommOp.op={self.op!r} is unknown; accepted: {', '.join(COMM_OPS)}")
        if self.group not in GROUPS:
            raise ValueError(f"CommOp.group={self.group!r} is unknown; accepted: {', '.join(GROUPS)}")
        if not isinstance(self.bytes, int) or self.bytes < 0:
            raise ValueError(f"CommOp.bytes must be a non-negative int, got {self.bytes!r}")
        if self.hierarchical and self.op not in ("all_gather", "reduce_scatter"):
            raise ValueError(f"only all_gather and reduce_scatter can be hierarchical, not {self.op!r}")

    def accounting(self, rank: int, size: int) -> dict[str, tuple[int, int, int]]:
        """``{op kind: (calls, bytes_sent, bytes_recv)}`` this op adds to group rank ``rank``'s
        ``Communicator.stats()`` in a group of ``size`` ranks (:func:`payload`)."""
        kinds = ("send", "recv") if self.op == "sendrecv" else (self.op,)
        return {k: (1, *payload(k, self.bytes, size, rank, self.root)) for k in kinds}


def group_size(group: str, world: int, topology=None) -> int:
    """Ranks in a :data:`GROUPS` group: every rank (``world``), one node's or one rail's (``topology``:
    a ``cpattn.core.topology.Topology``; required for "node" and "rail")."""
    if group == "world":
        return world
    if topology is None:
        raise ValueError(f"a {group!r} group needs a topology")
    return {"node": topology.devices_per_node, "rail": topology.nodes}[group]


@dataclass(frozen=True)
class Step:
    """One synchronised step. ``comm``: the ops issued in the step, sharing the links (their times add).
    ``overlap``: the ops run during the compute (True) or after it (False). ``live_bytes``: schedule
    buffers and accumulators alive on a rank during the step, beyond the resident inputs and outputs
    (bytes).

    The program (``cpattn.core.executor`` runs it on every rank): ``before``, actions that prepare what the
    step's ops send; ``run``, the actions of the step's compute, during which the ops of ``comm`` are
    in flight when ``overlap``; ``after``, actions once they have landed. Actions name buffer roles
    and rank-independent sources, so one step list serves every rank (not part of the step's
    identity).

    ``work``: ``((Work, ranks), ...)``, what the ranks compute (their counts sum to the world size; an
    idle rank has empty work), the cost model's view of ``run``. A schedule never writes it:
    ``Schedule.program`` prices it from the sources of ``run``'s compute actions (:func:`sources`,
    ``Schedule.work_of``), so the compute the executor runs and the compute the cost model times have
    one declaration."""

    comm: tuple[CommOp, ...] = ()
    overlap: bool = True
    live_bytes: int = 0
    run: tuple[Action, ...] = field(default=(), compare=False)
    after: tuple[Action, ...] = field(default=(), compare=False)
    before: tuple[Action, ...] = field(default=(), compare=False)
    work: tuple[tuple[Work, int], ...] = ()


# ---------------------------------------------------------------------- actions (the executor's program)
#: an action's ``index`` that means "this rank's" (e.g. its own slot of a gathered buffer)
OWN = "own"


@dataclass(frozen=True)
class Attend:
    """Forward: attend the queries of role ``q`` to the packed key/values of role ``kv`` (``[2, b, s,
    h_kv, d]``; ``index``: its slice ``kv[index]`` when the role holds several, :data:`OWN` for this
    rank's) with the blocks of ``src`` (a key the schedule resolves on each rank,
    ``Schedule.blocks_of``; nothing to do when it resolves to None), merged into the output
    accumulators of role ``into``."""

    kv: str
    src: Hashable
    index: int | str | None = None
    q: str = "q"
    into: str = "out"


@dataclass(frozen=True)
class AttendBack:
    """Backward of :class:`Attend`: the blocks' gradients added into role ``dq`` and into the packed
    float32 key/value gradients of role ``dkv`` (``dkv_index``: its slice, as ``index`` is of ``kv``),
    for the rows of roles ``q``, ``dout``, ``lse`` and their final ``out``, or, with ``out`` None,
    their ``delta = rowsum(dout * out)`` (rows whose output lives on another rank)."""

    kv: str
    src: Hashable
    dkv: str
    index: int | str | None = None
    dkv_index: int | str | None = None
    q: str = "q"
    dout: str = "dout"
    out: str | None = "out"
    lse: str = "lse"
    dq: str = "dq"
    delta: str | None = None


@dataclass(frozen=True)
class Zeros:
    """A new float32 (accumulation dtype) zero buffer ``role`` shaped like role ``like`` (a pair of
    tensors, as the start ``(k, v)``: like them packed; with a leading dimension of ``count`` when
    given); ``output``: output accumulators for queries like ``like`` (out 0, lse -inf;
    ``cpattn.core.executor.Accumulators``)."""

    role: str
    like: str
    count: int | None = None
    output: bool = False


@dataclass(frozen=True)
class Add:
    """``role into += role src``, in place (``on``: only on that group rank)."""

    into: str
    src: str
    on: int | None = None


@dataclass(frozen=True)
class LseMax:
    """A distributed merge's first piece: role ``into`` becomes a copy of the lse of the accumulators
    ``part``, which an ``all_reduce`` with ``reduce_op="max"`` then turns into every rank's maximum."""

    part: str
    into: str


@dataclass(frozen=True)
class Weigh:
    """The terms this rank adds to a distributed merge (``cpattn.merge.merge_weights``): roles ``num``
    and ``den`` from the accumulators ``part`` and the maximum ``m``, to be reduce-summed onto the
    owner."""

    part: str
    m: str
    num: str
    den: str


@dataclass(frozen=True)
class Land:
    """On group rank ``owner`` only: the merged result (``cpattn.merge.merge_finish`` of the summed
    ``num`` and ``den`` and the maximum ``m``) merged into the output accumulators ``into``."""

    owner: int
    num: str
    den: str
    m: str
    into: str = "out"


@dataclass(frozen=True)
class Fold:
    """Fold the partial result of role ``src`` (its sequence rows ``at``; None: all) into the
    accumulator of role ``into`` (its rows ``rows``; None: all): ``item`` "o" an ``(out, lse)`` pair
    (output accumulators or a pair) merged by its lse; "dq" ``[b, s, h, d]`` or "dkv" (packed ``[2, b,
    s, h_kv, d]``) added. A ``into`` not made yet becomes the partial itself."""

    item: str
    src: str
    into: str
    rows: tuple[int, int] | None = None
    at: tuple[int, int] | None = None


@dataclass(frozen=True)
class Local:
    """``role dst = fn(role src)``: local work the schedule names and defines (e.g. Ulysses' packing for
    an exchange, ``ultra``'s kernel calls and merges; the ``transforms`` the executor is given), no
    communication. ``fn``: a name, or a hashable naming one of a family (``("compute", 3)``); ``src``: a
    role, or a tuple of roles handed over as a tuple of values; ``dst``: the role of the result (None:
    the result is not kept)."""

    fn: Hashable
    src: str | tuple[str, ...]
    dst: str | None


Action = Attend | AttendBack | Zeros | Add | LseMax | Weigh | Land | Fold | Local


def sources(step: Step) -> tuple[Hashable, ...]:
    """The block sources of a step's compute actions (``Attend`` / ``AttendBack`` in ``run``), in order:
    what the step computes, which the executor runs and the cost model prices
    (``Schedule.blocks_of``, ``Schedule.work_of``)."""
    return tuple(a.src for a in step.run if isinstance(a, Attend | AttendBack))


def distribution(works) -> tuple[tuple[Work, int], ...]:
    """``((Work, ranks), ...)`` from an iterable of per-rank :data:`Work` (sorted, merged)."""
    return tuple(sorted(Counter(works).items()))


__all__ = ["Action", "Add", "Attend", "AttendBack", "BACKWARD_FLOP_RATIO", "COMM_OPS", "CommOp", "DTYPE_BYTES",
           "Fold", "GROUPS", "Kernel", "Land", "Local", "LseMax", "OWN", "PHASES", "Problem", "Step", "TREE_OPS",
           "Weigh", "Work", "Zeros", "area", "attention_flops", "distribution", "group_size", "payload",
           "sources", "split_phase", "wire", "work"]
