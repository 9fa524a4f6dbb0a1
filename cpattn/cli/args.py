"""Argument parsing shared by every command: comma-separated lists, masks, topologies, layouts, dtypes.

Each parser here is the only one of its kind; the commands add their options with these ``type=``
functions and never re-parse the text themselves. Nothing here imports rich, matplotlib or ortools.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

_SHAPE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


# ----------------------------------------------------------------------------------- collectives
def algorithm(text: str) -> str:
    """``type=`` for ``--algorithm``: a collective algorithm spec (``cpattn.core.topology.parse_algorithm``)."""
    from ..core.topology import parse_algorithm

    try:
        parse_algorithm(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def algorithm_choice(given: str | None) -> str | None:
    """The collective algorithms to simulate with: ``--algorithm``, else ``$NCCL_ALGO`` when set (it must
    be a spec ``--algorithm`` accepts; a bare "ring" or "tree" sets the all-reduce only, as in NCCL and
    RCCL, whose broadcast and reduce are always rings), else None (the topology's own: auto, or local's
    calibrated ones)."""
    import os

    from ..core.topology import parse_algorithm

    if given is not None:
        return given
    env = os.environ.get("NCCL_ALGO")
    if not env:
        return None
    try:
        parse_algorithm(env)
    except ValueError as exc:
        raise ValueError(f"NCCL_ALGO={env!r} sets the default of --algorithm but is not understood ({exc}); pass "
                         "--algorithm explicitly, e.g. --algorithm auto") from None
    bare = env.strip().lower()
    return f"all_reduce:{bare}" if bare in ("ring", "tree") else env


# ----------------------------------------------------------------------------------- lists
def positive(text: str) -> int:
    """A ``type=`` for counts and sizes: a positive int (argparse prints the error as one line)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def csv(kind: Callable[[str], T]) -> Callable[[str], list[T]]:
    """A ``type=`` for a comma-separated list of ``kind`` (``"2,4"`` -> ``[2, 4]``; empty items skipped)."""

    def parse(text: str) -> list[T]:
        return [kind(x) for x in text.split(",") if x]

    parse.__name__ = f"comma-separated {getattr(kind, '__name__', 'value')}"  # argparse names it in errors
    return parse


def layouts(text: str) -> list[str | None]:
    """``--layout``: comma-separated layout names; 'default' (None) = each schedule's own layout."""
    return [None if x == "default" else x for x in text.split(",") if x]


# ----------------------------------------------------------------------------------- masks
def masks(text: str) -> list[str | dict]:
    """``--mask``: comma-separated names (``causal,full``), or one JSON mask spec or a JSON list of them
    (``cpattn.masks.from_spec``), e.g. ``'{"kind": "strided", "block_size": 1024, "stride": 4}'``.
    Returns the names and spec dicts, unresolved (each command resolves what it accepts)."""
    text = text.strip()
    if text.startswith(("{", "[")):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
        return value if isinstance(value, list) else [value]
    return [x for x in text.split(",") if x]


def mask(text: str) -> str | dict:
    """``--mask`` of a command that takes one mask: as :func:`masks`, exactly one name or spec."""
    specs = masks(text)
    if len(specs) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: this command takes one mask (a name or one JSON spec), "
                                         f"not {len(specs)}")
    return specs[0]


# ----------------------------------------------------------------------------------- topology
@dataclass(frozen=True)
class TopologyArg:
    """A parsed ``--topology``: a preset name (``preset``, in lower case with '-'), or ``NxD`` (``nodes`` x
    ``devices_per_node``, which fixes the number of devices). ``text`` is what the user wrote."""

    text: str
    preset: str | None = None
    nodes: int | None = None
    devices_per_node: int | None = None

    @property
    def shape(self) -> tuple[int, int] | None:
        """``(nodes, devices_per_node)`` of an ``NxD`` topology, None for a preset."""
        return None if self.nodes is None else (self.nodes, self.devices_per_node)

    @property
    def devices(self) -> int | None:
        """The device count an ``NxD`` topology implies (None for a preset: it fits many counts)."""
        return None if self.nodes is None else self.nodes * self.devices_per_node

    def __str__(self) -> str:
        return self.text

    def build(self, world: int, profile=None):
        """The :class:`~cpattn.core.topology.Topology` of ``world`` devices: generic figures for ``NxD``, the
        preset's otherwise (``local``: ``profile``, else the default calibration profile)."""
        if self.nodes is None:
            from ..cost.presets import preset

            return preset(self.preset, world, profile)
        from ..core.topology import Topology

        if world != self.devices:
            raise ValueError(f"--topology {self.text} has {self.devices} devices, not {world}")
        return Topology(self.nodes, self.devices_per_node, name=self.text)


def topology(presets: bool = True) -> Callable[[str], TopologyArg]:
    """A ``type=`` for ``--topology``: ``NxD`` (N nodes of D devices, e.g. ``2x2``) or, when ``presets``,
    a preset name (``cpattn.cost.presets.NAMES``)."""

    def parse(text: str) -> TopologyArg:
        m = _SHAPE.match(text)
        if m:
            nodes, per_node = int(m.group(1)), int(m.group(2))
            if nodes < 1 or per_node < 1:
                raise argparse.ArgumentTypeError(f"{text!r}: nodes and devices must be at least 1")
            return TopologyArg(text, nodes=nodes, devices_per_node=per_node)
        if presets:
            from ..cost.presets import NAMES

            key = text.strip().lower().replace("_", "-")
            if key in NAMES:
                return TopologyArg(text, preset=key)
            raise argparse.ArgumentTypeError(f"{text!r}: expected a preset ({', '.join(NAMES)}) or "
                                             "NODESxDEVICES, e.g. 2x2")
        raise argparse.ArgumentTypeError(f"{text!r}: expected NODESxDEVICES, e.g. 2x2")

    parse.__name__ = "topology"
    return parse


def device_counts(topology: TopologyArg | None, given: list[int] | None, default: list[int],
                  flag: str) -> list[int]:
    """The device counts to run: ``given`` (the ``flag`` option), else the count an ``NxD`` topology
    implies, else ``default``. ValueError when ``given`` disagrees with the topology."""
    implied = topology.devices if topology is not None else None
    if given is None:
        return [implied] if implied is not None else list(default)
    if implied is not None:
        wrong = [n for n in given if n != implied]
        if wrong:
            raise ValueError(f"--topology {topology.text} has {implied} devices but {flag} is "
                             f"{','.join(map(str, given))} (leave {flag} out: the topology implies it)")
    return list(given)


# ----------------------------------------------------------------------------------- schedules
def planned_schedule(name: str, time_budget: float | None):
    """The schedule ``name`` to estimate: one that plans and takes ``plan_options`` (``ultra``) with
    ``--time-budget`` (seconds of its planner's solves per plan) when given, else the name."""
    if time_budget is None:
        return name
    from .. import schedules
    from ..planner import PlanOptions

    made = schedules.get(name)
    if made.make_plan is None or not hasattr(made, "plan_options"):
        return name
    return schedules.get(name, plan_options=PlanOptions(time_budget=time_budget))


# ----------------------------------------------------------------------------------- dtypes, profiles
def dtypes(*, float64: bool = False) -> list[str]:
    """``choices=`` for ``--dtype``: the names of ``cpattn.kernels.DTYPES`` (float64 only when asked)."""
    from ..core.kernels import DTYPES

    return [name for name in DTYPES if float64 or name != "float64"]


def load_profile(path: str | None):
    """``--profile``: the calibration profile at ``path`` (or the shipped GPU profile of that name,
    ``cpattn.cost.profile.SHIPPED``), or at the default location (None when there is none)."""
    from ..cost import profile

    if path in profile.SHIPPED:
        return profile.shipped(path)
    return profile.load(path) if path else profile.load_default()


def topology_profile(topology: TopologyArg, path: str | None):
    """The profile ``--profile`` gives ``--topology``: ``local`` reads ``path`` or the default location; a
    GPU preset a GPU profile at ``path`` or shipped under that name (None without one: the preset's own
    default, ``cpattn.cost.presets.DEFAULT_PROFILES``, or its data-sheet figures); ``NxD`` takes none
    (ValueError when one is given)."""
    if path is None and topology.preset != "local":
        return None
    if topology.preset is None:
        raise ValueError(f"--profile prices a preset's devices; --topology {topology.text} has generic figures")
    return load_profile(path)


def topology_builder(args) -> tuple[Callable[[int], object], str | None]:
    """``(build, algorithm)`` for ``--topology``, ``--profile`` (:func:`topology_profile`) and ``--algorithm``
    (:func:`algorithm_choice`): ``build(world)`` is the topology of ``world`` devices priced with
    ``algorithm`` (None: the topology's own collective algorithms)."""
    from dataclasses import replace

    profile = topology_profile(args.topology, args.profile)
    algo = algorithm_choice(args.algorithm)

    def build(world: int):
        topo = args.topology.build(world, profile)
        return topo if algo is None else replace(topo, algorithm=algo)

    return build, algo


__all__ = ["TopologyArg", "csv", "device_counts", "dtypes", "layouts", "load_profile", "mask", "masks",
           "planned_schedule", "topology", "topology_builder", "topology_profile"]
