"""Cost model: topologies, devices, collectives, schedule estimates and a task-graph simulator.

Everything here is pure data in, data out (no process group): ``estimate(schedule, problem,
topology)`` predicts one schedule from its own ``steps`` declaration (``ultra``: from its plan);
``rank_schedules`` / ``choose`` power ``schedule="auto"``; ``simulate`` runs UltraAttn-style task
graphs on per-device lanes; ``presets.preset(name, world)`` builds Frontier, DGX H100, DGX H200,
DGX A100 (a GPU preset priced by a measured GPU profile when given one, ``cost.profile``) or the
calibrated ``local`` machine. Problems, steps, topologies and devices are core data
(``cpattn.core.steps``, ``cpattn.core.topology``), re-exported here; calibration, which runs processes, is a tool
(``cpattn.lab.machine_profile``).
"""

from ..core.pairs import PairWork, pair_work
from ..core.simulator import Simulation, Task, lane, simulate, transfer
from ..core.steps import CommOp, Kernel, Problem, Step, Work, distribution, work
from ..core.topology import Device, Link, RatePoint, Topology
from . import presets
from .collectives import op_time
from .estimate import (
    Estimate,
    check_supports,
    choose,
    declares_steps,
    default_candidates,
    estimable,
    estimate,
    rank_schedules,
)
from .presets import preset
from .profile import Profile, ProfileError

__all__ = ["CommOp", "Device", "Estimate", "Kernel", "Link", "PairWork", "Problem", "Profile", "ProfileError",
           "RatePoint", "Step", "Simulation", "Task", "Topology", "Work", "check_supports", "choose", "declares_steps",
           "default_candidates", "distribution", "estimable", "estimate", "lane", "op_time", "pair_work", "preset",
           "presets", "rank_schedules", "simulate", "transfer", "work"]
