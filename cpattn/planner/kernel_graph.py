"""The kernel graph of one phase (docs/ultraattn.md, "Routing" and "Schedule"): compute kernels,
transfers of chunks between devices, merges of partial results, and the dependencies between them,
as :class:`cpattn.core.simulator.Task` so the cost model times and simulates it.

Items that travel (one message each, ``chunk`` tokens of one chunk) and their sizes are the
message table, :data:`cpattn.planner.messages.ITEMS`: q, kv (packed), o (partial output and lse),
qb (the final lse, D = rowsum(dout * out), q and dout), dq and dkv (partial gradients).

Routing. A device that computes a cell of row i needs row i's input item; one that produced a partial
output of chunk i must return it to i's owner. Inside a node items go directly. Across nodes they are
rail-aligned: chunk i crosses once per node, between its owner and the device with the owner's local
index on the other node (its *rail peer*), which forwards it inside its node; partial outputs go the
other way, merged at the rail peer first, so each node sends one partial per chunk across.

Tasks: ``c{k}`` kernel k on its device's compute lane; ``t{n}`` transfer n on the sender's send lane
and the receiver's receive lane (and, across nodes, the NICs they use); ``m{n}`` the merge of partial
transfer n at its receiver (compute lane). Dependencies: a transfer of an input leaves a relay after
it arrived there; a kernel starts after its inputs arrived; a partial leaves after every kernel and
merge that contributes to it on that device; a merge follows its transfer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.simulator import Task, compute, transfer
from ..core.topology import Topology
from .block_table import BlockTable
from .messages import ITEMS, Sizes
from .pricing import Pricing
from .tiling import TileKernel

PHASES = ("forward", "backward")


def _items(role: str) -> dict[str, tuple[tuple[str, str], ...]]:
    return {ph: tuple((n, it.follows) for n, it in ITEMS.items() if ph in it.phases and it.role == role)
            for ph in PHASES}


#: per phase, the input items (and whether they follow a kernel's rows or its columns): the executor's table
INPUTS = _items("input")
#: per phase, the partial outputs a kernel produces (and whether per row or per column chunk)
OUTPUTS = _items("partial")


@dataclass(frozen=True)
class Transfer:
    """Chunk ``chunk`` of ``item`` sent from rank ``src`` to rank ``dst``."""

    src: int
    dst: int
    item: str
    chunk: int


@dataclass(frozen=True)
class KernelGraph:
    """One phase's kernels, transfers and timed tasks (``tasks`` named as in the module docstring)."""

    phase: str
    kernels: tuple[TileKernel, ...]
    transfers: tuple[Transfer, ...]
    tasks: tuple[Task, ...]


def _chunks(kernel: TileKernel, axis: str) -> tuple[int, ...]:
    return kernel.rows if axis == "rows" else kernel.cols


def route(phase: str, kernels: list[TileKernel] | tuple[TileKernel, ...], owner: list[int],
          topology: Topology) -> list[Transfer]:
    """Every transfer of ``phase`` for ``kernels`` (see "Routing" in the module docstring), inputs
    first, in a deterministic order."""
    inputs = {item for item, _ in INPUTS[phase]}
    out: dict[Transfer, None] = {}
    for item, axis in INPUTS[phase] + OUTPUTS[phase]:
        for chunk, dev in {(chunk, kn.device) for kn in kernels for chunk in _chunks(kn, axis)}:
            home = owner[chunk]
            if dev == home:
                continue
            peer = dev  # across nodes: the device of dev's node on the owner's rail
            if topology.node_of(dev) != topology.node_of(home):
                peer = topology.node_of(dev) * topology.devices_per_node + topology.local_index(home)
            path = [home, peer, dev] if peer != dev else [home, dev]
            if item not in inputs:  # partial results go the other way
                path.reverse()
            for src, dst in zip(path, path[1:]):
                out[Transfer(src, dst, item, chunk)] = None
    return sorted(out, key=lambda t: (t.item not in inputs, t.item in inputs and t.src != owner[t.chunk],
                                      t.item, t.chunk, t.src, t.dst))


def dependencies(phase: str, kernels: list[TileKernel] | tuple[TileKernel, ...],
                 transfers: list[Transfer] | tuple[Transfer, ...], owner: list[int]) -> dict[str, tuple[str, ...]]:
    """Task name -> the task names it waits for (``c{k}``, ``t{n}``, ``m{n}``). Raises ValueError when
    an input never reaches a device that needs it, or arrives twice."""
    inputs = {item for item, _ in INPUTS[phase]}
    delivered: dict[tuple[str, int, int], int] = {}
    for n, t in enumerate(transfers):
        if t.item in inputs:
            key = (t.item, t.chunk, t.dst)
            if key in delivered or t.dst == owner[t.chunk]:
                raise ValueError(f"transfer {n} delivers {t.item} of chunk {t.chunk} to rank {t.dst} again")
            delivered[key] = n

    def arrival(item: str, chunk: int, dev: int) -> list[str]:
        if dev == owner[chunk]:
            return []
        if (item, chunk, dev) not in delivered:
            raise ValueError(f"rank {dev} needs {item} of chunk {chunk} but no transfer brings it")
        return [f"t{delivered[item, chunk, dev]}"]

    deps: dict[str, tuple[str, ...]] = {}
    producers: dict[tuple[str, int, int], list[str]] = {}
    for k, kn in enumerate(kernels):
        waits: list[str] = []
        for item, axis in INPUTS[phase]:
            for chunk in _chunks(kn, axis):
                waits += arrival(item, chunk, kn.device)
        deps[f"c{k}"] = tuple(dict.fromkeys(waits))
        for item, axis in OUTPUTS[phase]:
            for chunk in _chunks(kn, axis):
                producers.setdefault((item, chunk, kn.device), []).append(f"c{k}")
    for n, t in enumerate(transfers):
        if t.item not in inputs:
            deps[f"m{n}"] = (f"t{n}",)
            producers.setdefault((t.item, t.chunk, t.dst), []).append(f"m{n}")
    for n, t in enumerate(transfers):
        if t.item in inputs:
            deps[f"t{n}"] = tuple(arrival(t.item, t.chunk, t.src))
        else:
            made = producers.get((t.item, t.chunk, t.src), [])
            if not made:
                raise ValueError(f"transfer {n} sends a partial {t.item} of chunk {t.chunk} that rank {t.src} "
                                 "never computes or receives")
            deps[f"t{n}"] = tuple(made)
    return deps


def build(phase: str, table: BlockTable, kernels: list[TileKernel], owner: list[int], topology: Topology,
          sizes: Sizes, pricing: Pricing) -> KernelGraph:
    """The timed kernel graph of ``phase`` for ``kernels`` on ``topology`` (kernel times from
    ``pricing``, the cost model's, as the executor runs each kernel)."""
    transfers = route(phase, kernels, owner, topology)
    deps = dependencies(phase, kernels, transfers, owner)
    device = topology.device
    tasks: list[Task] = []
    for k, kn in enumerate(kernels):
        # the kernel's outputs are folded into per-chunk accumulators on the same lane, right after it
        folded = sum(len(_chunks(kn, per)) * sizes.item_bytes(item) for item, per in OUTPUTS[phase])
        seconds = pricing.seconds(table, kn.kind, kn.rows, kn.cols, phase) + device.merge_time(folded)
        tasks.append(compute(f"c{k}", kn.device, seconds, deps[f"c{k}"]))
    for n, t in enumerate(transfers):
        nbytes = sizes.item_bytes(t.item)
        task = transfer(f"t{n}", t.src, t.dst, nbytes, topology, deps[f"t{n}"])
        if topology.node_of(t.src) != topology.node_of(t.dst):  # the NICs the two rails go through
            task = replace(task, lanes=(*task.lanes, f"node{topology.node_of(t.src)}.nic{topology.nic_of(t.src)}.out",
                                        f"node{topology.node_of(t.dst)}.nic{topology.nic_of(t.dst)}.in"))
        tasks.append(task)
        if f"m{n}" in deps:
            tasks.append(compute(f"m{n}", t.dst, device.merge_time(nbytes), deps[f"m{n}"]))
    return KernelGraph(phase, tuple(kernels), tuple(transfers), tuple(tasks))
