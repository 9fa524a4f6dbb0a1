"""Hierarchical context tiling (docs/ultraattn.md, "Levels" and "Kernel level"): which device
computes each cell, and which cells each device fuses into one kernel call.

Ownership is contiguous: with ``c`` chunks per rank, chunk i (its Q, K, V and final outputs) lives on
rank ``i // c``. Ranks are numbered node-major (rank = node * D + local index).

1. **Node level.** Chunks are grouped into node chunks of ``m`` consecutive chunks (one node's share
   split ``D * c / m`` ways); node cells are placed on nodes by the partition ILP with nodes as units.
   Inter-node traffic is rail-aligned (see :mod:`cpattn.planner.kernel_graph`), so inside the node
   that computes a cell, a remote chunk's *home* is the device with its owner's local index.
2. **Device level.** Inside each node the cells placed there are placed on its D devices by the ILP,
   with those homes. Diagonal cells stay pinned to their owner at both levels.
   When every cell of a level's problem is FULL and they form a complete rows x columns product, the
   closed-form 2-D grid is used instead: for each factorisation X * Y = units, unit (y, x) computes
   the rows whose home is in group y against the columns whose home is x modulo X; the one with the
   least traffic (within the load bound) wins.
3. **Kernel level.** On each device, cells are fused into kernel calls: runs of diagonal cells that
   together form one causal square, then rectangles of FULL cells (rows and columns that the device
   touches, in order), largest first and cut to at most ``max_cells`` cells; what is left (PARTIAL
   cells, lone diagonal cells) runs cell by cell.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..core.topology import Topology
from .block_table import BlockTable
from .partition_ilp import MessageUnits, Partition, PartitionProblem, greedy, load_bound, loads, solve, traffic


@dataclass(frozen=True)
class TileKernel:
    """One kernel call on ``device``: query chunks ``rows`` against key chunks ``cols`` (ascending),
    of ``kind`` "full", "causal" (one causal cell, or a causal square on the diagonal) or "partial"
    (one cell)."""

    device: int
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    kind: str

    def cells(self, table: BlockTable) -> list[tuple[int, int]]:
        """The non-empty cells this kernel computes."""
        return [(i, j) for i in self.rows for j in self.cols if table.kind(i, j) != "empty"]


@dataclass(frozen=True)
class Levels:
    """How a phase's cells were placed: ``assign[(i, j)]`` = rank, and one report per ILP solved."""

    assign: dict[tuple[int, int], int]
    reports: tuple[dict, ...]


# --------------------------------------------------------------------------------------- one level
def _grid(problem: PartitionProblem) -> Partition | None:
    """Best closed-form 2-D grid placement within the load bound, or None."""
    start = time.perf_counter()
    bound = load_bound(problem)
    best = None
    for x in range(1, problem.devices + 1):
        if problem.devices % x:
            continue
        assign = tuple((problem.row_home[i] // x) * x + problem.col_home[j] % x for i, j in problem.cells)
        if any(assign[c] != g for c, g in problem.pinned.items()) or max(loads(problem, assign)) > bound:
            continue
        ins, outs = traffic(problem, assign)
        key = (max(ins + outs), sum(ins) + sum(outs), x)
        if best is None or key < best[0]:
            best = (key, x, assign)
    if best is None:
        return None
    (v, total, x), _, assign = best
    return Partition(assign, v, total, max(loads(problem, assign)), bound, "closed-form",
                     f"2-D grid X={x} Y={problem.devices // x}", time.perf_counter() - start)


def _complete_product(cells: list[tuple[int, int]]) -> bool:
    rows = {i for i, _ in cells}
    cols = {j for _, j in cells}
    return len(cells) == len(rows) * len(cols)


def _canonical(problem: PartitionProblem, full: bool) -> tuple:
    """A key equal for problems that differ only by an order-preserving renaming of rows and columns
    (e.g. the device-level problems of different nodes of a regular pattern): they share one solve."""
    rows = sorted({i for i, _ in problem.cells})
    cols = sorted({j for _, j in problem.cells})
    ri = {i: n for n, i in enumerate(rows)}
    cj = {j: n for n, j in enumerate(cols)}
    return (problem.devices, problem.units, problem.eps, full,
            tuple((ri[i], cj[j], w, problem.pinned.get(c, -1))
                  for c, ((i, j), w) in enumerate(zip(problem.cells, problem.work))),
            tuple(problem.row_home[i] for i in rows), tuple(problem.col_home[j] for j in cols))


def place(problem: PartitionProblem, full: bool, time_limit: float, seed: int, use_solver: bool = True) -> Partition:
    """Place one level's cells: the closed-form grid when ``full`` (all FULL, complete product) and it
    fits the load bound, else the ILP (or only its greedy fallback without ``use_solver``)."""
    result = _grid(problem) if full else None
    if result is not None:
        return result
    return solve(problem, time_limit=time_limit, seed=seed) if use_solver else greedy(problem)


# --------------------------------------------------------------------------------------- hierarchy
def owners(n: int, world: int) -> list[int]:
    """Contiguous ownership of ``n`` chunks over ``world`` ranks."""
    if n % world:
        raise ValueError(f"{n} chunks cannot be split evenly over {world} ranks")
    c = n // world
    return [i // c for i in range(n)]


def _level_problem(cells: list[tuple[int, int]], work: list[int], row_home: dict[int, int],
                   col_home: dict[int, int], pinned_home: dict[int, int], units: MessageUnits, devices: int,
                   eps: float) -> PartitionProblem:
    pinned = {c: pinned_home[i] for c, (i, j) in enumerate(cells) if i == j and i in pinned_home}
    return PartitionProblem(devices, tuple(cells), tuple(work), row_home, col_home, pinned, units, eps)


def grouped_problem(table: BlockTable, m: int, home: list[int], devices: int, units: MessageUnits,
                    eps: float) -> tuple[PartitionProblem, bool]:
    """The cells of ``table`` grouped ``m x m`` (``m`` consecutive chunks a side) as one level's problem
    on ``devices`` units, group g of chunks homed, and its diagonal cell pinned, on the unit of its first
    chunk, ``home[g * m]``; and whether the closed-form grid applies (all FULL, a complete product)."""
    work: dict[tuple[int, int], int] = {}
    full_cells: dict[tuple[int, int], int] = {}
    for i, j in table.cells():
        key = (i // m, j // m)
        work[key] = work.get(key, 0) + table.work(i, j)
        full_cells[key] = full_cells.get(key, 0) + (table.kind(i, j) == "full")
    cells = sorted(work)
    homes = {big: home[big * m] for big in range(table.n // m)}
    full = all(full_cells[k] == m * m for k in cells) and _complete_product(cells)
    return _level_problem(cells, [work[k] for k in cells], homes, homes, homes, units, devices, eps), full


def allocate(table: BlockTable, topology: Topology, units: MessageUnits, node_chunk: int, eps: float = 0.1,
             time_limit: float = 5.0, seed: int = 0, use_solver: bool = True) -> Levels:
    """Place every non-empty cell of ``table`` on a rank of ``topology`` (node level, then device
    level in each node). ``node_chunk``: chunks per node-level chunk (divides the chunks per node).
    ``use_solver``: False places every level with the greedy fallback (no CP-SAT)."""
    world, d = topology.world, topology.devices_per_node
    owner = owners(table.n, world)
    per_node = table.n // topology.nodes
    if node_chunk < 1 or per_node % node_chunk:
        raise ValueError(f"node_chunk={node_chunk} must divide the {per_node} chunks of a node")
    reports: list[dict] = []
    cells = table.cells()
    local = {i: topology.local_index(owner[i]) for i in range(table.n)}
    if topology.nodes == 1:
        node_of_cell = {cell: 0 for cell in cells}
    else:
        m = node_chunk
        problem, full = grouped_problem(table, m, [topology.node_of(o) for o in owner], topology.nodes, units, eps)
        part = place(problem, full, time_limit, seed, use_solver)
        reports.append({"level": "node", "units": topology.nodes, "cells": len(problem.cells), **part.report()})
        big_assign = dict(zip(problem.cells, part.assign))
        node_of_cell = {(i, j): big_assign[(i // m, j // m)] for i, j in cells}
    problems: list[tuple[int, list[tuple[int, int]], PartitionProblem, bool]] = []
    for node in range(topology.nodes):
        mine = [cell for cell in cells if node_of_cell[cell] == node]
        if not mine:
            continue
        pinned_home = {i: local[i] for i, j in mine if i == j and topology.node_of(owner[i]) == node}
        full = all(table.kind(i, j) == "full" for i, j in mine) and _complete_product(mine)
        problem = _level_problem(mine, [table.work(i, j) for i, j in mine], local, local, pinned_home, units, d, eps)
        problems.append((node, mine, problem, full))
    # equivalent problems (a regular pattern's nodes) are solved once; distinct ones in parallel threads
    # (CP-SAT releases the GIL; each solve is single-threaded and deterministic)
    unique: dict[tuple, tuple[PartitionProblem, bool]] = {}
    for _, _, problem, full in problems:
        unique.setdefault(_canonical(problem, full), (problem, full))
    workers = max(1, min(len(unique), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        solved = dict(zip(unique, pool.map(lambda pf: place(pf[0], pf[1], time_limit, seed, use_solver),
                                           unique.values())))
    assign: dict[tuple[int, int], int] = {}
    first: set[tuple] = set()
    for node, mine, problem, full in problems:
        key = _canonical(problem, full)
        part = solved[key]
        reports.append({"level": "device", "node": node, "units": d, "cells": len(mine), "reused": key in first,
                        **part.report()})
        first.add(key)
        for cell, g in zip(mine, part.assign):
            assign[cell] = node * d + g
    return Levels(assign, tuple(reports))


# --------------------------------------------------------------------------------------- kernel level
def _max_rectangle(grid: list[list[bool]]) -> tuple[int, int, int, int, int]:
    """Largest all-True rectangle of a boolean grid: ``(area, r0, r1, c0, c1)`` (half-open); the first
    found (top-most, then left-most) among equal areas."""
    if not grid:
        return 0, 0, 0, 0, 0
    width = len(grid[0])
    heights = [0] * width
    best = (0, 0, 0, 0, 0)
    for r, row in enumerate(grid):
        heights = [h + 1 if cell else 0 for h, cell in zip(heights, row)]
        stack: list[int] = []
        for c in range(width + 1):
            h = heights[c] if c < width else 0
            while stack and heights[stack[-1]] >= h:
                top = stack.pop()
                left = stack[-1] + 1 if stack else 0
                area = heights[top] * (c - left)
                if area > best[0]:
                    best = (area, r - heights[top] + 1, r + 1, left, c)
            stack.append(c)
    return best


def _cut(h: int, w: int, max_cells: int) -> tuple[int, int]:
    """The largest, most square ``(rows, cols)`` of at most ``max_cells`` cells inside ``h x w``."""
    if h * w <= max_cells:
        return h, w
    best = (0, 0, 0)
    for hh in range(1, h + 1):
        ww = min(w, max_cells // hh)
        if ww < 1:
            break
        key = (hh * ww, -abs(hh - ww), hh)
        if key > best:
            best = key
    return best[2], best[0] // best[2]


def fuse(table: BlockTable, assign: dict[tuple[int, int], int], device: int, max_cells: int) -> list[TileKernel]:
    """Kernel calls of ``device`` for its cells in ``assign`` (see the module docstring)."""
    on = {cell for cell, g in assign.items() if g == device}
    left = set(on)
    kernels: list[TileKernel] = []
    # causal squares along the diagonal
    diag = sorted(i for i, j in on if i == j and table.kind(i, i) == "causal")
    k = 0
    while k < len(diag):
        a, b = diag[k], diag[k] + 1
        while (b in diag and (b - a + 1) * (b - a + 1) // 2 <= max_cells and table.causal_square(a, a, b + 1 - a)
               and all((i, j) in on for i in range(a, b + 1) for j in range(a, i + 1))):  # all on this device
            b += 1
        square = tuple(range(a, b))
        kernels.append(TileKernel(device, square, square, "causal"))
        left -= {(i, j) for i in square for j in square}
        k += b - a
    # rectangles of FULL cells, largest first
    full = {cell for cell in left if table.kind(*cell) == "full"}
    while full:
        rows = sorted({i for i, _ in full})
        cols = sorted({j for _, j in full})
        grid = [[(i, j) in full for j in cols] for i in rows]
        _, r0, r1, c0, c1 = _max_rectangle(grid)
        hh, ww = _cut(r1 - r0, c1 - c0, max_cells)
        rect_rows, rect_cols = tuple(rows[r0:r0 + hh]), tuple(cols[c0:c0 + ww])
        kernels.append(TileKernel(device, rect_rows, rect_cols, "full"))
        rect = {(i, j) for i in rect_rows for j in rect_cols}
        full -= rect
        left -= rect
    for i, j in sorted(left):
        kernels.append(TileKernel(device, (i,), (j,), table.kind(i, j)))
    return sorted(kernels, key=lambda kn: (kn.rows, kn.cols))


def fuse_all(table: BlockTable, assign: dict[tuple[int, int], int], world: int, max_cells: int) -> list[TileKernel]:
    """:func:`fuse` on every rank, in rank order."""
    return [kn for g in range(world) for kn in fuse(table, assign, g, max_cells)]
