"""The partition ILP of one tiling level (docs/ultraattn.md, "Partition ILP"), its greedy fallback,
and the traffic model both are judged by.

A level places cells on ``devices`` units (the nodes of the cluster, or the devices of one node).
Each row (query chunk) and column (key/value chunk) has a *home*: the unit that holds it. Placing cell
(i, j) on g makes g fetch row i unless it is home(i), and column j unless it is home(j).

Variables: binary ``x[c, g]`` (cell c on g); ``a[g, i] >= x[c, g]`` for the cells c of row i (g needs
row i), ``b[g, j] >= x[c, g]`` likewise for columns. Per unit g: ``A_g`` rows fetched, ``B_g`` columns
fetched, ``C_g`` = sum over g's own rows of the other units fetching them, ``D_g`` likewise for
columns. Message units (:class:`MessageUnits`): forward ``in = A + C + 2B``, ``out = A + C + 2D``;
backward ``in = 2A + 2B + C + 2D``, ``out = A + 2B + 2C + 2D``, every KV term times ``h_kv / h``.
Constraints: each cell on exactly one unit (diagonal cells pinned to their home); ``in_g, out_g <= V``;
``load_g <= bound``. Objective: minimise V, the busiest unit's traffic; ties are broken by the total
traffic (``V * M + total`` with ``M`` above any total, so the optimal V is unchanged).

The load bound is ``(1 + eps) * total / units``, raised to the makespan of a longest-processing-time
assignment when cells are too coarse to meet it (so the problem is always feasible); the plan records
the bound used. CP-SAT runs single-threaded with a fixed seed under a deterministic time limit and
starts from the greedy solution (a hint), so its answer is never worse than the greedy one. Without OR-Tools, or when
the solver finds nothing in time, the greedy assignment is used and the report says why.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MessageUnits:
    """Coefficients of A, B, C, D in a unit's incoming and outgoing traffic, scaled by the query head
    count ``h`` so they are integers: a row-sized message (q, dO, partial O, dQ) of h heads costs h;
    a KV chunk 2 h_kv."""

    in_a: int
    in_b: int
    in_c: int
    in_d: int
    out_a: int
    out_b: int
    out_c: int
    out_d: int

    @staticmethod
    def for_phase(phase: str, heads: int, kv_heads: int) -> MessageUnits:
        """The message units of ``phase`` ("forward" or "backward"; docs/ultraattn.md, "Partition ILP"),
        KV terms times h_kv / h."""
        q, kv = heads, 2 * kv_heads
        if phase == "forward":  # in = A + C + 2B, out = A + C + 2D
            return MessageUnits(q, kv, q, 0, q, 0, q, kv)
        if phase == "backward":  # in = 2A + 2B + C + 2D, out = A + 2B + 2C + 2D
            return MessageUnits(2 * q, kv, q, kv, q, kv, 2 * q, kv)
        raise ValueError(f"phase={phase!r} is unknown; accepted: forward, backward")

    def flows(self, a, b, c, d) -> tuple:
        """``(in, out)`` traffic of a unit that fetches ``a`` rows and ``b`` columns and whose own rows
        and columns other units fetch ``c`` and ``d`` times (numbers, or the ILP's linear expressions)."""
        return (self.in_a * a + self.in_b * b + self.in_c * c + self.in_d * d,
                self.out_a * a + self.out_b * b + self.out_c * c + self.out_d * d)


@dataclass(frozen=True)
class PartitionProblem:
    """Cells to place on ``devices`` units. ``cells[c] = (row, col)``; ``work[c]`` its compute weight;
    ``row_home[row]`` / ``col_home[col]`` the unit holding it; ``pinned`` the cells fixed to a unit
    (``{cell index: unit}``)."""

    devices: int
    cells: tuple[tuple[int, int], ...]
    work: tuple[int, ...]
    row_home: dict[int, int]
    col_home: dict[int, int]
    pinned: dict[int, int]
    units: MessageUnits
    eps: float = 0.1

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"a partition needs at least one unit, got devices={self.devices}")
        if len(self.cells) != len(self.work):
            raise ValueError("cells and work differ in length")
        for c, g in self.pinned.items():
            if not 0 <= g < self.devices or not 0 <= c < len(self.cells):
                raise ValueError(f"pinned cell {c} -> unit {g} is out of range")


@dataclass(frozen=True)
class Partition:
    """A placement and how it was found. ``assign[c]`` is cell c's unit; ``v`` the busiest unit's
    traffic (message units); ``method`` "cp-sat", "greedy" or "closed-form"; ``status`` what the
    solver said (e.g. "OPTIMAL", "FEASIBLE (time limit)", "greedy: solver timed out")."""

    assign: tuple[int, ...]
    v: int
    total: int
    max_load: int
    bound: int
    method: str
    status: str
    seconds: float = 0.0
    greedy_v: int | None = None

    def report(self) -> dict:
        return {"method": self.method, "status": self.status, "v": self.v, "total": self.total,
                "greedy_v": self.greedy_v, "max_load": self.max_load, "bound": self.bound,
                "seconds": round(self.seconds, 3)}


# --------------------------------------------------------------------------------------- traffic
def deterministic_solver(seed: int, time_limit: float):
    """A CP-SAT solver that gives every rank the same answer: one worker, a fixed seed, and a
    deterministic time limit (``time_limit`` in CP-SAT's deterministic seconds)."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    solver.parameters.max_deterministic_time = time_limit
    solver.parameters.max_time_in_seconds = 2 * time_limit + 1  # a safety net: the line above binds first
    return solver


def traffic(problem: PartitionProblem, assign: tuple[int, ...] | list[int]) -> tuple[list[int], list[int]]:
    """Per-unit ``(in, out)`` message units of ``assign`` (what the ILP's ``in_g``, ``out_g`` equal at
    an optimum: every fetch indicator exactly 1 where needed)."""
    g_n = problem.devices
    rows_on = [set() for _ in range(g_n)]
    cols_on = [set() for _ in range(g_n)]
    for (i, j), g in zip(problem.cells, assign):
        if problem.row_home[i] != g:
            rows_on[g].add(i)
        if problem.col_home[j] != g:
            cols_on[g].add(j)
    c = Counter(problem.row_home[i] for rows in rows_on for i in rows)
    d = Counter(problem.col_home[j] for cols in cols_on for j in cols)
    flows = [problem.units.flows(len(rows_on[g]), len(cols_on[g]), c[g], d[g]) for g in range(g_n)]
    return [f[0] for f in flows], [f[1] for f in flows]


def loads(problem: PartitionProblem, assign: tuple[int, ...] | list[int]) -> list[int]:
    out = [0] * problem.devices
    for w, g in zip(problem.work, assign):
        out[g] += w
    return out


def check(problem: PartitionProblem, partition: Partition) -> None:
    """Raise ValueError unless ``partition`` places every cell once, keeps pins and the load bound."""
    if len(partition.assign) != len(problem.cells):
        raise ValueError(f"partition places {len(partition.assign)} cells, the problem has {len(problem.cells)}")
    if any(not 0 <= g < problem.devices for g in partition.assign):
        raise ValueError("partition uses a unit outside the level")
    for c, g in problem.pinned.items():
        if partition.assign[c] != g:
            raise ValueError(f"pinned cell {problem.cells[c]} moved from unit {g} to {partition.assign[c]}")
    worst = max(loads(problem, partition.assign), default=0)
    if worst > partition.bound:
        raise ValueError(f"a unit carries load {worst} over the bound {partition.bound}")


def _summary(problem: PartitionProblem, assign, bound: int, method: str, status: str, seconds: float,
             greedy_v: int | None = None) -> Partition:
    ins, outs = traffic(problem, assign)
    return Partition(tuple(assign), max(ins + outs, default=0), sum(ins) + sum(outs),
                     max(loads(problem, assign), default=0), bound, method, status, seconds, greedy_v)


# --------------------------------------------------------------------------------------- load bound
def _heaviest_first(problem: PartitionProblem) -> list[int]:
    """The cells that are not pinned, heaviest first (ties in cell order)."""
    return sorted((c for c in range(len(problem.cells)) if c not in problem.pinned),
                  key=lambda c: (-problem.work[c], problem.cells[c]))


def _lpt(problem: PartitionProblem) -> list[int]:
    """Longest processing time first, ignoring traffic: the most balanced simple placement."""
    assign = [-1] * len(problem.cells)
    load = [0] * problem.devices
    for c, g in problem.pinned.items():
        assign[c] = g
        load[g] += problem.work[c]
    for c in _heaviest_first(problem):
        g = min(range(problem.devices), key=lambda u: (load[u], u))
        assign[c] = g
        load[g] += problem.work[c]
    return assign


def load_bound(problem: PartitionProblem) -> int:
    """``ceil((1 + eps) * total / units)``, or the LPT makespan where that is larger."""
    total = sum(problem.work)
    target = math.ceil((1 + problem.eps) * total / problem.devices)
    return max(target, max(loads(problem, _lpt(problem)), default=0))


# --------------------------------------------------------------------------------------- greedy
def greedy(problem: PartitionProblem) -> Partition:
    """Place cells heaviest first, each on the unit that keeps the busiest traffic lowest (then adds
    the least traffic, then is least loaded) within the load bound; the LPT placement if that ever
    gets stuck. Deterministic."""
    start = time.perf_counter()
    bound = load_bound(problem)
    g_n, u = problem.devices, problem.units
    assign = [-1] * len(problem.cells)
    load = [0] * g_n
    ins, outs = [0] * g_n, [0] * g_n
    rows_on = [set() for _ in range(g_n)]
    cols_on = [set() for _ in range(g_n)]

    def deltas(i: int, j: int, g: int) -> dict[int, tuple[int, int]]:
        """``{unit: (in, out)}`` that placing a cell of row i and column j on g adds."""
        hi, hj = problem.row_home[i], problem.col_home[j]
        a = hi != g and i not in rows_on[g]  # g newly fetches row i
        b = hj != g and j not in cols_on[g]  # and column j
        d: dict[int, tuple[int, int]] = {}
        for unit, (di, do) in ((g, u.flows(a, b, 0, 0)), (hi, u.flows(0, 0, a, 0)), (hj, u.flows(0, 0, 0, b))):
            old = d.get(unit, (0, 0))
            d[unit] = (old[0] + di, old[1] + do)
        return d

    def place(c: int, g: int) -> None:
        i, j = problem.cells[c]
        for k, (di, do) in deltas(i, j, g).items():
            ins[k] += di
            outs[k] += do
        if problem.row_home[i] != g:
            rows_on[g].add(i)
        if problem.col_home[j] != g:
            cols_on[g].add(j)
        assign[c] = g
        load[g] += problem.work[c]

    for c, g in sorted(problem.pinned.items()):
        place(c, g)
    for c in _heaviest_first(problem):
        i, j = problem.cells[c]
        v_now = max(ins + outs)
        best = None
        for g in range(g_n):
            if load[g] + problem.work[c] > bound:
                continue
            d = deltas(i, j, g)
            v_new = max([v_now] + [max(ins[k] + di, outs[k] + do) for k, (di, do) in d.items()])
            key = (v_new, sum(di + do for di, do in d.values()), load[g], g)
            if best is None or key < best[0]:
                best = (key, g)
        if best is None:
            lpt = _lpt(problem)
            return _summary(problem, lpt, bound, "greedy", "greedy: load-balanced (LPT) placement",
                            time.perf_counter() - start)
        place(c, best[1])
    return _summary(problem, assign, bound, "greedy", "greedy", time.perf_counter() - start)


# --------------------------------------------------------------------------------------- CP-SAT
def solve(problem: PartitionProblem, time_limit: float = 5.0, seed: int = 0) -> Partition:
    """The ILP with CP-SAT (one worker, fixed seed, a deterministic time limit of ``time_limit``, about
    seconds, so the answer does not depend on machine load), started from the greedy placement. Falls
    back to the greedy placement (and says so in ``status``) when OR-Tools is missing or finds nothing
    in time."""
    start = time.perf_counter()
    fallback = greedy(problem)
    if problem.devices == 1 or len(problem.pinned) == len(problem.cells):
        return _summary(problem, fallback.assign, fallback.bound, "closed-form", "trivial: nothing to place",
                        time.perf_counter() - start, fallback.v)
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        log.warning("OR-Tools is not installed: the partition uses the greedy placement")
        return _with_status(fallback, "greedy: OR-Tools is not installed", time.perf_counter() - start)

    g_n, u, bound = problem.devices, problem.units, fallback.bound
    m = cp_model.CpModel()
    x: dict[tuple[int, int], object] = {}
    free = [c for c in range(len(problem.cells)) if c not in problem.pinned]
    for c in free:
        for g in range(g_n):
            x[c, g] = m.new_bool_var(f"x{c}_{g}")
        m.add_exactly_one(x[c, g] for g in range(g_n))
    rows = sorted({i for i, _ in problem.cells})
    cols = sorted({j for _, j in problem.cells})
    a = {(g, i): m.new_bool_var(f"a{g}_{i}") for i in rows for g in range(g_n) if g != problem.row_home[i]}
    b = {(g, j): m.new_bool_var(f"b{g}_{j}") for j in cols for g in range(g_n) if g != problem.col_home[j]}
    for c, g in problem.pinned.items():  # a pinned cell's fetches are certain
        i, j = problem.cells[c]
        if (g, i) in a:
            m.add(a[g, i] == 1)
        if (g, j) in b:
            m.add(b[g, j] == 1)
    for (c, g), lit in x.items():
        i, j = problem.cells[c]
        if (g, i) in a:
            m.add(a[g, i] >= lit)
        if (g, j) in b:
            m.add(b[g, j] >= lit)
    fetch_a = [sum(a[g, i] for i in rows if (g, i) in a) for g in range(g_n)]
    fetch_b = [sum(b[g, j] for j in cols if (g, j) in b) for g in range(g_n)]
    own_c = [sum(var for (_, i), var in a.items() if problem.row_home[i] == g) for g in range(g_n)]
    own_d = [sum(var for (_, j), var in b.items() if problem.col_home[j] == g) for g in range(g_n)]
    cap = (max(u.in_a, u.out_a) + max(u.in_c, u.out_c)) * len(rows) * g_n + \
        (max(u.in_b, u.out_b) + max(u.in_d, u.out_d)) * len(cols) * g_n
    v = m.new_int_var(0, cap, "V")
    total = 0
    pinned_load = [0] * g_n
    for c, g in problem.pinned.items():
        pinned_load[g] += problem.work[c]
    for g in range(g_n):
        tin, tout = u.flows(fetch_a[g], fetch_b[g], own_c[g], own_d[g])
        m.add(tin <= v)
        m.add(tout <= v)
        total += tin + tout
        m.add(sum(problem.work[c] * x[c, g] for c in free) <= bound - pinned_load[g])
    m.minimize(v * (2 * g_n * cap + 1) + total)
    for (c, g), var in x.items():
        m.add_hint(var, 1 if fallback.assign[c] == g else 0)

    solver = deterministic_solver(seed, time_limit)
    status = solver.solve(m)
    seconds = time.perf_counter() - start
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        why = "timed out" if status == cp_model.UNKNOWN else f"returned {solver.status_name(status)}"
        log.warning("partition ILP %s after %.1f s: using the greedy placement", why, seconds)
        return _with_status(fallback, f"greedy: solver {why}", seconds)
    assign = [0] * len(problem.cells)
    for c, g in problem.pinned.items():
        assign[c] = g
    for (c, g), lit in x.items():
        if solver.boolean_value(lit):
            assign[c] = g
    label = "OPTIMAL" if status == cp_model.OPTIMAL else "FEASIBLE (time limit)"
    result = _summary(problem, assign, bound, "cp-sat", label, seconds, fallback.v)
    if result.v > fallback.v:  # cannot happen from the hint, but never return the worse placement
        return _with_status(fallback, "greedy: better than the solver's incumbent", seconds)
    return result


def _with_status(p: Partition, status: str, seconds: float) -> Partition:
    return Partition(p.assign, p.v, p.total, p.max_load, p.bound, "greedy", status, seconds, p.v)
