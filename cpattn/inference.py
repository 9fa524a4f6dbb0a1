"""Inference over a key/value cache sharded across the ranks of a context-parallel group.

:class:`KVCache` (``KVCache(cp, ...)``) holds, per layer, this rank's keys and values and, on every rank,
which row and position each cached token of every rank has (a few integers per token, so every rank
can place and mask without asking the others). A step first *places* its tokens, then each layer
*writes* its keys and values and *attends*:

- **Prefill** (a fresh prompt): :meth:`KVCache.place_prompt` with the ContextParallel that shards the
  prompt; each layer runs ``cp.attention`` on its local tokens and :meth:`KVCache.write` keeps them as
  this rank's shard, in the layout's order (padding dropped). Nothing is gathered
  (:meth:`KVCache.prefill` does both).
- **Multi-turn prefill** (new prompt tokens on top of a cache): the new tokens are placed the same way;
  :meth:`KVCache.extend_attention` attends them to each other with ``cp.attention`` and to the cache by
  ``pass_q`` (the new queries go to every cache owner; partial results come back to theirs) or
  ``pass_kv`` (the cache is gathered), whichever the cost model predicts faster
  (``cpattn.cost.inference.choose_extend``, which says why); the two partials merge by log-sum-exp.
- **Decode**: every rank holds the new tokens (one per row) and runs the dense layers on them;
  :meth:`KVCache.place_decode` appends each row's token to the rank holding the fewest tokens (ties: the
  lowest rank), so the shards stay within one token of each other; :meth:`KVCache.decode_attention`
  attends the new queries to this rank's shard and merges the partials of every rank exactly: an
  all-reduce of the maxima then one of the rescaled sums, or one all-gather of ``(out, lse)``
  (``cpattn.cost.inference.choose_decode_merge`` picks, and says why).

Rows: a batch of prompts of different lengths is one packed sequence of documents (one per row) while
prefilling, and one query per row while decoding; a token attends only the tokens of its own row at
positions up to its own (and within a layer's sliding window, when given). Prefill runs
``cp.attention``; decode and a second turn's exchange are executor programs too (:data:`DECODE`,
:data:`PASS_Q`, :data:`PASS_KV`: ``cpattn.core.executor.execute`` issues their collectives, through the
cache's communicator, a view of the ContextParallel's whose ``comm_stats()`` counts this cache's
attention traffic only), and every merge is ``cpattn.core.merge``'s (its pieces as the executor's
``LseMax`` / ``Weigh`` actions and the :data:`MERGES` functions).

Why one module over 500 lines: the placement, the token tables and the programs that read them share
one state, the cache's current step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .api import ContextParallel
from .core import kernels, merge
from .core.blocks import Block
from .core.executor import Accumulators, Runtime, execute
from .core.masks import BlockKind
from .core.memo import BoundedCache
from .core.steps import Attend, CommOp, Local, LseMax, Step, Weigh, Zeros
from .cost import inference as inference_cost

#: accepted values of ``KVCache(merge=...)`` and ``KVCache(extend=...)``
MERGE_CHOICES = ("auto", *inference_cost.MERGES)
EXTEND_CHOICES = ("auto", *inference_cost.EXTENDS)


#: block lists (and their stacked calls) a cache keeps: those of the last few masks
STEP_CACHE = 16


def _blocks(allowed: torch.Tensor) -> list[Block] | None:
    """The one block of a cache program's ``Attend`` for ``allowed [queries, keys]`` (host: deciding its
    kind reads nothing back from a device), or None when nothing is allowed."""
    host = allowed.numpy()
    n, m = allowed.shape
    if not host.any():  # nothing allowed (or no queries or no keys)
        return None
    return [Block(slice(0, n), slice(0, m), BlockKind.FULL if host.all() else BlockKind.PARTIAL,
                  None if host.all() else allowed)]


def _merge_all(everyone: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's partial ``[P, n, h, d + 1]`` (out, then lse) merged exactly: ``(out [1, n, h, d], lse)``."""
    lses = everyone[..., -1].transpose(1, 2)  # [P, h, n]
    m = lses.amax(0, keepdim=True)
    num, den = merge.merge_weights(everyone[..., :-1], lses, m.expand_as(lses))
    return merge.merge_finish(num.sum(0, keepdim=True), den.sum(0, keepdim=True), m)


#: the functions the cache programs' ``Local`` actions name: the merge's pieces (``cpattn.core.merge``)
MERGES = {
    "cat": lambda nd: torch.cat(nd, dim=-1),
    "finish": lambda nd_m: merge.merge_finish(nd_m[0][..., :-1], nd_m[0][..., -1:], nd_m[1]),
    "with_lse": lambda acc: torch.cat([acc.out, acc.lse.transpose(1, 2).unsqueeze(-1)], dim=-1)[0],
    "merge_all": _merge_all,
    "same": lambda x: x,
}

#: this rank's partial: its queries (role ``q``) to its cached keys and values (``kv0``)
_PARTIAL = (Zeros("part", "q", output=True), Attend("kv0", ("cache",), into="part"))
#: the maximum lse of every rank's partial, on every rank
_MAX = Step(before=(LseMax("part", "m"),), comm=(CommOp("all_reduce", 0, send="m", reduce_op="max"),))
#: a decode step's program by how the ranks' partials merge: None (one rank), "all_reduce" (the maximum
#: lse, then the weighted sums) or "all_gather" (every partial, merged on every rank)
DECODE = {
    None: [Step(run=_PARTIAL, after=(Local("same", "part", "out"),))],
    "all_reduce": [
        Step(run=_PARTIAL), _MAX,
        Step(before=(Weigh("part", "m", "num", "den"), Local("cat", ("num", "den"), "nd")),
             comm=(CommOp("all_reduce", 0, send="nd"),), after=(Local("finish", ("nd", "m"), "out"),))],
    "all_gather": [
        Step(run=_PARTIAL),
        Step(before=(Local("with_lse", "part", "mine"),), comm=(CommOp("all_gather", 0, send="mine", recv="all"),),
             after=(Local("merge_all", "all", "out"),))],
}
#: a second turn's new queries to the tokens cached before it, every rank's queries gathered ("pass_q")
PASS_Q = [
    Step(comm=(CommOp("all_gather", 0, send="q0", recv="qs"),), after=(Local("queries", "qs", "q"),)),
    Step(run=_PARTIAL), _MAX,
    Step(before=(Weigh("part", "m", "num", "den"), Local("cat", ("num", "den"), "nd"), Local("split", "nd", "nds")),
         comm=(CommOp("reduce_scatter", 0, send="nds", recv="nd_mine"),),
         after=(Local("mine", ("nd_mine", "m"), "out"),))]
#: ... or every rank's cached keys and values gathered ("pass_kv")
PASS_KV = [
    Step(before=(Local("padded", "kv0", "kv_mine"),), comm=(CommOp("all_gather", 0, send="kv_mine", recv="kv_all"),),
         after=(Local("unpadded", "kv_all", "kv"),)),
    Step(run=(Zeros("part", "q", output=True), Attend("kv", ("cache",), into="part")),
         after=(Local("same", "part", "out"),))]


@dataclass
class Placement:
    """Where the tokens of one step go. ``kind``: "prompt" or "decode". ``positions``: the position in its
    row of each token this rank computes (prompt: the local tokens of the chunk's layout, -1 for
    padding; decode: one per row, every rank). ``before``: tokens every rank held before the step.
    ``take``: which of this rank's computed tokens it keeps (indices into the local tokens, or into the
    rows). ``start``: the slot of the first kept token. ``query_rows`` / ``query_positions``: the row and
    position of every rank's queries (prompt steps; -1 for padding)."""

    kind: str
    positions: torch.Tensor
    before: list[int]
    take: torch.Tensor
    start: int
    rows: torch.Tensor
    query_rows: list[torch.Tensor] = field(default_factory=list)
    query_positions: list[torch.Tensor] = field(default_factory=list)
    written: set = field(default_factory=set)
    masks: dict = field(default_factory=dict)


class KVCache:
    """Keys and values of ``layers`` attention layers, sharded over the ranks of ``cp``'s group.

    ``kv_heads``, ``head_dim``: per layer; ``rows``: independent sequences (the batch); ``dtype``,
    ``device``: of the stored keys and values; ``capacity``: tokens per rank to allocate up front (it
    grows by doubling when exceeded). ``merge``: "auto" (the cost model picks), "all_reduce" or
    "all_gather" for decoding; ``extend``: "auto", "pass_q" or "pass_kv" for multi-turn prefill.
    Collective methods (``place_*`` are not: every rank computes the same placement alone) must be
    called by every rank of the group in the same order.
    """

    def __init__(self, cp: ContextParallel, layers: int, kv_heads: int, head_dim: int, rows: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, capacity: int = 0,
                 merge: str = "auto", extend: str = "auto") -> None:
        if not isinstance(cp, ContextParallel):
            raise TypeError(f"KVCache takes a cpattn.ContextParallel, got {type(cp).__name__}")
        for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim), ("rows", rows)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0 (tokens per rank), got {capacity!r}")
        if dtype not in kernels.SUPPORTED_DTYPES:
            raise TypeError(f"dtype={dtype} is not supported; accepted: float32, bfloat16, float16, float64 (CPU)")
        for name, value, choices in (("merge", merge, MERGE_CHOICES), ("extend", extend, EXTEND_CHOICES)):
            if value not in choices:
                raise ValueError(f"{name}={value!r} is unknown; accepted: {', '.join(map(repr, choices))}")
        base = cp.base
        self.comm = base.comm.view(record=False)  # this cache's attention traffic, counted apart
        # its programs' caches hold the last few steps' block lists only: every step brings new masks
        self._runtime = Runtime(self.comm, base.mask, base.layout, base.padded_len, backend=base.backend,
                                block_cache=BoundedCache(STEP_CACHE), batch_cache=BoundedCache(STEP_CACHE))
        self.topology = base.topology
        self.rank, self.world_size = base.rank, base.world_size
        self.layers, self.kv_heads, self.head_dim, self.rows = layers, kv_heads, head_dim, rows
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.merge, self.extend = merge, extend
        #: (merge, why) of the last decode step, and (extend, why) of the last multi-turn prefill
        self.last_merge: tuple[str, str] | None = None
        self.last_extend: tuple[str, str] | None = None
        self._capacity = capacity
        self._keys: list[torch.Tensor | None] = [None] * layers  # [capacity, kv_heads, head_dim]
        self._values: list[torch.Tensor | None] = [None] * layers
        # row and position of every cached token of every rank (replicated, host): [2, room] per rank, the
        # first _count[r] columns used
        self._table = [torch.empty(2, 0, dtype=torch.long) for _ in range(self.world_size)]
        self._count = [0] * self.world_size
        self._merge_heads: int | None = None
        self._row_len = [0] * rows
        self._step: Placement | None = None

    # ------------------------------------------------------------------ what it holds
    @property
    def tokens(self) -> int:
        """Tokens this rank holds (every layer holds the same tokens)."""
        return self._count[self.rank]

    def tokens_per_rank(self) -> list[int]:
        return list(self._count)

    def row_lengths(self) -> list[int]:
        """Tokens cached per row (over every rank)."""
        return list(self._row_len)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``(layers, 2, tokens, kv_heads, head_dim)``: the keys and values this rank holds."""
        return (self.layers, 2, self.tokens, self.kv_heads, self.head_dim)

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values this rank holds (its share of the cache)."""
        return self.bytes_per_rank()[self.rank]

    def bytes_per_rank(self) -> list[int]:
        """:attr:`nbytes` of every rank (from the replicated token table; no communication)."""
        per_token = self.layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize
        return [per_token * n for n in self._count]

    def shard(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's keys and values of ``layer``, ``[tokens, kv_heads, head_dim]`` each (prompt tokens in
        the layout's order, then appended ones); views of the cache."""
        self._check_layer(layer)
        if self._keys[layer] is None:
            empty = torch.empty(0, self.kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
            return empty, empty
        return self._keys[layer][:self.tokens], self._values[layer][:self.tokens]

    def _held(self, rank: int, upto: int) -> torch.Tensor:
        """``[2, upto]``: the rows and positions of ``rank``'s first ``upto`` tokens."""
        return self._table[rank][:, :upto]

    def _append(self, rank: int, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Add tokens to ``rank``'s table (its room doubles when full)."""
        n, table = self._count[rank], self._table[rank]
        end = n + rows.numel()
        if end > table.shape[1]:
            grown = torch.empty(2, max(end, 2 * table.shape[1], self._capacity), dtype=torch.long)
            grown[:, :n] = table[:, :n]
            self._table[rank] = table = grown
        table[0, n:end] = rows
        table[1, n:end] = positions
        self._count[rank] = end

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Bytes and calls of this cache's attention collectives on this rank (decode merges, multi-turn
        prefill), in ``Communicator.stats`` form."""
        return self.comm.stats()

    def reset_comm_stats(self) -> None:
        self.comm.reset_stats()

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.layers}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, rows={self.rows}, "
                f"dtype={self.dtype}, rank {self.rank} of {self.world_size}: {self.tokens} tokens, "
                f"{self.nbytes} bytes)")

    # ------------------------------------------------------------------ placement (no communication)
    def place_prompt(self, cp: ContextParallel, lengths: list[int] | None = None) -> Placement:
        """Place a chunk of new prompt tokens sharded by ``cp``: ``lengths[b]`` tokens of row ``b`` (default
        ``[cp.seq_len]``, one row), packed row after row into ``cp``'s ``seq_len`` tokens (its mask: causal
        for one row, the rows' documents for several). They follow the row's cached tokens (position
        ``row_lengths()[b]`` onwards). Every rank keeps its own real tokens, in the layout's order.
        Returns the placement; ``positions`` are the local tokens' positions in their rows (-1: padding),
        what the model's ``position_ids`` must be."""
        lengths = [cp.seq_len] if lengths is None else [int(n) for n in lengths]
        if len(lengths) != self.rows or any(n < 1 for n in lengths) or sum(lengths) != cp.seq_len:
            raise ValueError(f"place_prompt: lengths must give every one of the {self.rows} rows at least one token "
                             f"and add up to cp.seq_len={cp.seq_len}, got {lengths}")
        if cp.world_size != self.world_size:
            raise ValueError(f"place_prompt: the ContextParallel has {cp.world_size} ranks, the cache "
                             f"{self.world_size}")
        self._check_idle("place_prompt")
        ends = torch.tensor(lengths).cumsum(0)
        starts = ends - torch.tensor(lengths)
        offsets = torch.tensor(self._row_len)
        before = self.tokens_per_rank()
        query_rows, query_positions = [], []
        for r in range(self.world_size):
            g = cp.layout.positions(cp.padded_len, cp.world_size, r)
            real = g < cp.seq_len
            row = torch.searchsorted(ends, g.clamp(max=cp.seq_len - 1), right=True)
            pos = torch.where(real, g - starts[row] + offsets[row], -1)
            row = torch.where(real, row, -1)
            query_rows.append(row)
            query_positions.append(pos)
            self._append(r, row[real], pos[real])
        for b, n in enumerate(lengths):
            self._row_len[b] += n
        mine = query_rows[self.rank]
        take = (mine >= 0).nonzero().flatten()
        self._step = Placement("prompt", query_positions[self.rank], before, take, before[self.rank], mine,
                               query_rows, query_positions)
        return self._step

    def place_decode(self) -> Placement:
        """Place one new token per row, each on the rank holding the fewest tokens at that moment (ties: the
        lowest rank), rows in order. ``positions [rows]``: each new token's position in its row."""
        self._check_idle("place_decode")
        before = self.tokens_per_rank()
        owners = []
        for b in range(self.rows):
            r = min(range(self.world_size), key=lambda i: (self._count[i], i))
            owners.append(r)
            self._append(r, torch.tensor([b]), torch.tensor([self._row_len[b]]))
            self._row_len[b] += 1
        positions = torch.tensor(self._row_len) - 1
        take = torch.tensor([b for b, r in enumerate(owners) if r == self.rank], dtype=torch.long)
        self._step = Placement("decode", positions, before, take, before[self.rank], torch.arange(self.rows))
        return self._step

    def _check_idle(self, what: str) -> None:
        step = self._step
        if step is not None and len(step.written) != self.layers:
            missing = sorted(set(range(self.layers)) - step.written)
            raise RuntimeError(f"{what}: the previous step has not written layers {missing}")
        self._step = None

    # ------------------------------------------------------------------ writes
    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.layers:
            raise ValueError(f"layer must be an int in [0, {self.layers}), got {layer!r}")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep this rank's tokens of the current step for ``layer``: ``k, v`` ``[1, local_len, kv_heads,
        head_dim]`` (a prompt chunk, the local tokens of its ContextParallel) or ``[rows, 1, kv_heads,
        head_dim]`` (decode: every row's new token; only the rows placed on this rank are kept)."""
        self._check_layer(layer)
        step = self._step
        if step is None:
            raise RuntimeError("write: place the step's tokens first (place_prompt or place_decode)")
        if layer in step.written:
            raise RuntimeError(f"write: layer {layer} was already written in this step")
        want = (1, step.rows.numel()) if step.kind == "prompt" else (self.rows, 1)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape[:2]) != want or \
                    tuple(t.shape[2:]) != (self.kv_heads, self.head_dim):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"write: {name} must be [{want[0]}, {want[1]}, {self.kv_heads}, {self.head_dim}] for "
                                 f"this {step.kind} step, got {shape}")
            if t.dtype != self.dtype:
                raise TypeError(f"write: {name}.dtype={t.dtype}, the cache holds {self.dtype}")
        kept = (k[0], v[0]) if step.kind == "prompt" else (k[:, 0], v[:, 0])
        kept = tuple(t.index_select(0, step.take.to(t.device)) for t in kept)
        end = step.start + step.take.numel()
        self._reserve(layer, end)
        self._keys[layer][step.start:end] = kept[0]
        self._values[layer][step.start:end] = kept[1]
        step.written.add(layer)

    def _reserve(self, layer: int, tokens: int) -> None:
        have = self._keys[layer]
        size = 0 if have is None else have.shape[0]
        if have is not None and tokens <= size:
            return
        new = max(tokens, 2 * size, self._capacity)
        for store in (self._keys, self._values):
            grown = torch.empty(new, self.kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
            if store[layer] is not None:
                grown[:size] = store[layer]
            store[layer] = grown

    # ------------------------------------------------------------------ attention
    def prefill(self, layer: int, cp: ContextParallel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                softmax_scale: float | None = None) -> torch.Tensor:
        """A fresh prompt's layer, forward only: ``cp.attention(q, k, v)`` on the local tokens, and ``k, v``
        kept as this rank's shard (:meth:`write`). Returns ``out [1, local_len, h, d]``."""
        with torch.no_grad():
            out = cp.attention(q, k, v, softmax_scale=softmax_scale)
        self.write(layer, k, v)
        return out

    def _mask(self, q_row: torch.Tensor, q_pos: torch.Tensor, k_row: torch.Tensor, k_pos: torch.Tensor,
              window: int | None) -> torch.Tensor:
        """``[queries, keys]``: a query attends the keys of its row at positions up to its own (and within
        the last ``window`` positions); padding (row -1) attends nothing."""
        allowed = (k_row[None] == q_row[:, None]) & (q_row[:, None] >= 0) & (k_pos[None] <= q_pos[:, None])
        if window is not None:
            allowed &= k_pos[None] > q_pos[:, None] - window
        return allowed

    def _run(self, steps: list[Step], roles: dict, allowed: torch.Tensor, scale: float, softcap: float | None,
             fns: dict | None = None):
        """Run a cache program on the executor: its ``Attend`` reads the keys of ``allowed [queries, keys]``
        (host; none: the rows stay at out 0, lse -inf); the result is role ``out`` (output accumulators,
        or the merged ``(out, lse)``)."""
        rt = dataclasses.replace(self._runtime, scale=scale, softcap=softcap)
        # one block list per mask: the layers of a step share it
        blocks = rt.block_cache.get_for(allowed, ("cache mask", id(allowed)), lambda: _blocks(allowed))
        out = execute(rt, steps, roles, lambda _: blocks, keep=("out",),
                      transforms={**MERGES, **(fns or {})})["out"]
        return (out.out, out.lse) if isinstance(out, Accumulators) else out

    def _local(self, layer: int, upto: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's first ``upto`` cached tokens of ``layer``: ``k, v [1, upto, h_kv, d]``, rows, positions."""
        self._reserve(layer, 0)  # allocated on first use
        return self._keys[layer][:upto][None], self._values[layer][:upto][None], *self._held(self.rank, upto)

    def _scale(self, q: torch.Tensor, softmax_scale: float | None) -> float:
        return kernels.default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)

    def decode_attention(self, layer: int, q: torch.Tensor, softmax_scale: float | None = None,
                         window: int | None = None, sinks: torch.Tensor | None = None,
                         softcap: float | None = None) -> torch.Tensor:
        """Attention of the new tokens' queries ``q [rows, 1, h, d]`` (the same on every rank) to the whole
        cache of ``layer``, the new tokens included (write them first): this rank's shard, then the exact
        merge of every rank's partial. ``window``: the layer's sliding window (a query sees the last
        ``window`` positions, itself included); ``sinks [h]``: per-head sink logits (gpt-oss);
        ``softcap``: soft-capped scores (``math`` path). Returns ``out [rows, 1, h, d]`` in q's dtype,
        the same on every rank. Collective."""
        step = self._step
        if step is None or step.kind != "decode" or layer not in step.written:
            raise RuntimeError(f"decode_attention: place_decode() and write({layer}, ...) come first")
        if q.dim() != 4 or q.shape[0] != self.rows or q.shape[1] != 1 or q.shape[3] != self.head_dim:
            raise ValueError(f"decode_attention: q must be [{self.rows}, 1, heads, {self.head_dim}], got "
                             f"{tuple(q.shape)}")
        k, v, k_row, k_pos = self._local(layer, self.tokens)
        key = ("decode", window)
        if key not in step.masks:
            step.masks[key] = self._mask(step.rows, step.positions, k_row, k_pos, window)
        if self.world_size > 1 and self._merge_heads != q.shape[2]:
            self.last_merge, self._merge_heads = self.decode_merge(q.shape[2]), q.shape[2]
        how = self.last_merge[0] if self.world_size > 1 else None
        out, lse = self._run(DECODE[how], {"q": q.transpose(0, 1).contiguous(), "kv0": (k, v)}, step.masks[key],
                             self._scale(q, softmax_scale), softcap)
        if sinks is not None:
            out, lse = merge.with_sinks(out, lse, sinks)
        return out.transpose(0, 1).to(q.dtype)

    def decode_merge(self, heads: int) -> tuple[str, str]:
        """``(merge, why)`` for a decode step of this cache's rows with ``heads`` query heads."""
        if self.merge != "auto":
            return self.merge, "asked for"
        return inference_cost.choose_decode_merge(self.topology, self.rows, heads, self.head_dim)

    def extend_attention(self, layer: int, cp: ContextParallel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         softmax_scale: float | None = None, window: int | None = None,
                         sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        """A multi-turn prefill layer: the new tokens' local ``q [1, s, h, d]``, ``k, v [1, s, h_kv, d]`` (as
        ``cp`` shards them; :meth:`place_prompt` with the same ``cp``, and :meth:`write`, come first)
        attend each other (``cp.attention``, its mask including ``window`` when the layer has one) and
        the tokens cached before this step (``pass_q`` or ``pass_kv``); the partials merge by log-sum-exp,
        then ``sinks``. Returns ``out [1, s, h, d]`` in q's dtype. Collective."""
        step = self._step
        if step is None or step.kind != "prompt" or layer not in step.written:
            raise RuntimeError(f"extend_attention: place_prompt(cp, ...) and write({layer}, ...) come first")
        scale = self._scale(q, softmax_scale)
        with torch.no_grad():
            new_out, new_lse = cp.attention(q, k, v, softmax_scale=softmax_scale, return_lse=True, softcap=softcap)
        out = new_out.to(kernels.acc_dtype(q.dtype))
        lse = new_lse.clone()
        if max(step.before) > 0:
            self.last_extend = self.extend_choice(q, k)
            cached = self._pass_q if self.last_extend[0] == "pass_q" or self.world_size == 1 else self._pass_kv
            old_out, old_lse = cached(layer, q, scale, window, softcap)
            merge.merge_into(out, lse, old_out, old_lse)
        if sinks is not None:
            out, lse = merge.with_sinks(out, lse, sinks)
        return out.to(q.dtype)

    def extend_choice(self, q: torch.Tensor, k: torch.Tensor) -> tuple[str, str]:
        """``(extend, why)`` for the current prompt step with local ``q``, ``k``."""
        if self.extend != "auto":
            return self.extend, "asked for"
        return inference_cost.choose_extend(self.topology, q.shape[1], max(self._step.before), q.shape[2],
                                            k.shape[2], q.shape[3], q.element_size())

    def _pass_q(self, layer: int, q: torch.Tensor, scale: float, window: int | None,
                softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's new queries to this rank's cached tokens; each query's partials reduced onto its
        owner."""
        step, p = self._step, self.world_size
        s, h, d = q.shape[1], q.shape[2], q.shape[3]
        k, v, k_row, k_pos = self._local(layer, step.before[self.rank])
        key = ("pass_q", window)
        if key not in step.masks:
            step.masks[key] = self._mask(torch.cat(step.query_rows), torch.cat(step.query_positions), k_row, k_pos,
                                         window)
        if p == 1:  # the whole cache is here: nothing to exchange
            return self._run(DECODE[None], {"q": q, "kv0": (k, v)}, step.masks[key], scale, softcap)
        fns = {"queries": lambda g: g.view(1, p * s, h, d),
               "mine": lambda nd_m: merge.merge_finish(nd_m[0][None, ..., :d], nd_m[0][None, ..., d:],
                                                       nd_m[1][:, :, self.rank * s:(self.rank + 1) * s]),
               "split": lambda nd: nd.view(p, s, h, d + 1)}
        return self._run(PASS_Q, {"q0": q[0].contiguous(), "kv0": (k, v)}, step.masks[key], scale, softcap, fns)

    def _pass_kv(self, layer: int, q: torch.Tensor, scale: float, window: int | None,
                 softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's cached keys and values (padded to the fullest rank) to every rank; its own new
        queries attend them."""
        step, p = self._step, self.world_size
        counts = step.before
        longest = max(counts)
        k, v, _, _ = self._local(layer, counts[self.rank])
        key = ("pass_kv", window)
        if key not in step.masks:
            pad = [torch.full((2, longest - n), -1, dtype=torch.long) for n in counts]  # to the fullest rank
            rows, pos = torch.cat([t for r, n in enumerate(counts) for t in (self._held(r, n), pad[r])], 1)
            step.masks[key] = self._mask(step.query_rows[self.rank], step.query_positions[self.rank], rows, pos,
                                         window)
        def padded(kv):  # this rank's cached keys and values, padded to the fullest rank
            mine = torch.zeros(longest, 2, self.kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
            mine[:counts[self.rank], 0] = kv[0][0]
            mine[:counts[self.rank], 1] = kv[1][0]
            return mine

        def unpadded(everyone):
            flat = everyone.reshape(p * longest, 2, self.kv_heads, self.head_dim)
            return flat[None, :, 0], flat[None, :, 1]

        return self._run(PASS_KV, {"q": q, "kv0": (k, v)}, step.masks[key], scale, softcap,
                         {"padded": padded, "unpadded": unpadded})


__all__ = ["EXTEND_CHOICES", "KVCache", "MERGE_CHOICES", "Placement"]
