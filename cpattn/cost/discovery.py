"""The topology of a process group found from where its ranks run (``ContextParallel(topology=None)``).

Every ``ContextParallel`` exchanges each rank's :class:`~cpattn.core.placement.Place` (host, device,
device name, calibration-profile digest; one store round trip). :func:`discover` reads the topology off
that list alone, so every rank derives the same one without communicating:

- **Shape**: nodes x ranks per node, the ranks grouped by host (:func:`cpattn.core.placement.node_shape`;
  ``$CPATTN_HOST`` names a rank's host in place of its host name). Hosts that are not blocks of
  consecutive group ranks of one size, and a strict subgroup of the world spanning several hosts (its
  two-level collectives would need rail and node groups that only the whole world can create: a 2-D
  ``DeviceMesh`` gives them), run as one flat node, and the log line says why. A 2-D mesh's shape and
  a :class:`Topology` given by the caller are used as they are (not here).
- **Figures** (links, device), in this order: a preset named by ``topology="dgx-h200"`` or
  ``$CPATTN_TOPOLOGY`` (:data:`TOPOLOGY_ENV`; its figures on the shape found, :func:`presets.on_shape`,
  ``"local"`` for this machine's calibration); on one host, what ``schedule="auto"`` has always used, this
  machine's calibration profile or the conservative local defaults (:func:`presets.this_machine`); across
  hosts, the calibration profile when every rank's digest matches (ranks whose profiles differ would price
  differently), else the shipped GPU profile matched by the ranks' device name (generic links), else
  generic figures. Without the exchange (``check="off"``) the group is one flat node of this machine's
  figures.

:func:`announce` logs the one line that says what was found and where the figures come from, once per
process for each distinct line.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..core.placement import Place, hosts_text, node_shape
from ..core.topology import GENERIC_INTER, GENERIC_INTRA, Topology
from . import presets
from .profile import ProfileError, default_path, load_default, shipped

log = logging.getLogger(__name__)

#: environment variable naming the preset whose figures a discovered topology takes (``dgx-h200``, ...)
TOPOLOGY_ENV = "CPATTN_TOPOLOGY"


@dataclass(frozen=True)
class Discovered:
    """What :func:`discover` found: the ``topology``, the log ``line`` that says what was found and where
    its figures come from, whether the ranks' hosts were set aside (``flat``: irregular hosts or a
    strict subgroup across hosts; logged as a warning) and whether a preset named the figures (``named``)."""

    topology: Topology
    line: str
    flat: bool = False
    named: bool = False


def preset_name(given: str | None) -> tuple[str | None, str]:
    """The preset named by ``topology=`` (``given``) or ``$CPATTN_TOPOLOGY``, and how it was named;
    ``(None, "")`` for neither. ValueError naming where an unknown name came from."""
    if given is not None:
        where, name = f"topology={given!r}", given
    elif os.environ.get(TOPOLOGY_ENV):
        name = os.environ[TOPOLOGY_ENV]
        where = f"${TOPOLOGY_ENV}={name}"
    else:
        return None, ""
    try:
        return presets.preset_key(name), where
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def discover(places: Sequence[Place] | None, world: int, given: str | None = None, whole_world: bool = True,
             mesh: tuple[int, int] | None = None) -> Discovered:
    """The topology of a group of ``world`` ranks running at ``places`` (group-rank order; None: not
    exchanged, ``check="off"``). ``given``: a preset name passed as ``topology=``; ``whole_world``: the
    group spans every process of the default world (else hierarchical collectives cannot be set up
    without a mesh); ``mesh``: a 2-D device mesh's (inter, intra) shape, which is the shape when given.
    See the module docstring."""
    name, named = preset_name(given)
    flat_why = ""
    if mesh is not None:
        nodes, per_node = mesh
        found = f"{nodes} x {per_node} from the 2-D device mesh"
    elif places is None:
        nodes, per_node = 1, world
        found = f"one flat node of {world} ranks (check='off': no placement exchange)"
    else:
        nodes, per_node, flat_why = node_shape(places)
        hosts = len({p.host for p in places})
        if nodes > 1 and not whole_world:
            flat_why = (f"a strict subgroup of the world across {hosts} hosts ({hosts_text(places)}): its two-level "
                        "collectives need rail and node groups that only the whole world can create, so pass group "
                        "as a 2-D DeviceMesh (inter-node x intra-node) for them")
            nodes, per_node = 1, world
        if flat_why:
            found = f"one flat node of {world} ranks: {flat_why}"
        elif hosts == 1:
            found = f"one node of {world} ranks (host {places[0].host})"
        else:
            found = f"{nodes} nodes x {per_node} ranks per node ({hosts_text(places)})"
    topology, source = _figures(places, nodes, per_node, name, named, mesh is not None)
    return Discovered(topology, f"topology: {found}; figures: {source}", bool(flat_why), name is not None)


def _figures(places: Sequence[Place] | None, nodes: int, per_node: int, name: str | None, named: str,
             meshed: bool) -> tuple[Topology, str]:
    """The topology of ``nodes`` x ``per_node`` ranks with its figures, and where they come from."""
    world = nodes * per_node
    if name is not None and name != "local":
        return presets.on_shape(name, nodes, per_node), f"preset {name} ({named})"
    if meshed and name is None:  # a mesh's shape with the generic figures, as it always had
        return Topology(nodes, per_node), ("generic figures (name a preset with topology='dgx-h200'-style strings "
                                           f"or ${TOPOLOGY_ENV} for others)")
    via = f" ({named})" if named else ""
    hosts = {p.host for p in places} if places is not None else set()
    digests = {p.profile for p in places} if places is not None else set()
    if len(hosts) <= 1 and len(digests) <= 1:  # one host: what schedule='auto' always used there
        topology = presets.this_machine(world, "the topology") if nodes == 1 else \
            presets.local(world, _profile(), cores=os.cpu_count() or 1, nodes=nodes)
        return topology, _local_source(topology) + via
    if len(digests) > 1:
        why = "the ranks' calibration profiles differ"
    elif "" in digests:
        why = "no calibration profile"
    else:
        profile = _profile()
        names = {p.device_name for p in places}
        gpus = profile is not None and profile.gpu is not None
        fits = profile is not None and (profile.gpu.device in names and len(names) == 1 if gpus else
                                        all(p.device < 0 for p in places))
        if fits:
            topology = presets.local(world, profile, nodes=nodes)
            kind = "measured GPU, links not measured" if gpus else "its local links stand for both levels"
            return topology, f"the calibration profile {default_path()} ({kind}; the same on every rank){via}"
        why = "the calibration profile does not describe these devices"
    return _by_device(places, nodes, per_node, why)


def _profile():
    """The calibration profile at the default location (None without a usable one: warned)."""
    try:
        return load_default()
    except ProfileError as exc:
        log.warning("the topology: ignoring the calibration profile (%s); using conservative defaults", exc)
        return None


def _local_source(topology: Topology) -> str:
    if "uncalibrated" in topology.name:
        return "conservative local defaults (no calibration profile: `cpattn calibrate` measures one)"
    return f"this machine's calibration profile {default_path()} ({topology.device.name})"


def _by_device(places: Sequence[Place], nodes: int, per_node: int, why: str) -> tuple[Topology, str]:
    """Figures across hosts without a common calibration: the shipped profile of the ranks' GPU model
    (generic links), else generic figures; ``why``: why the calibration was not used."""
    world = nodes * per_node
    names = {p.device_name for p in places}
    model = presets.gpu_model(next(iter(names))) if len(names) == 1 else None
    key = next((k for k, m in presets.PRESET_GPUS.items() if model is not None and m == model.model), None)
    if key in presets.DEFAULT_PROFILES:
        profile_name = presets.DEFAULT_PROFILES[key]
        device = presets.measured_device(key, shipped(profile_name), default=True)
        topology = Topology(nodes, per_node, intra=GENERIC_INTRA, inter=GENERIC_INTER, device=device,
                            name=f"{key} device, generic links")
        return topology, (f"device from the shipped profile {profile_name} (matched {next(iter(names))}; {why}), "
                          f"generic links (name a preset with topology= or ${TOPOLOGY_ENV} for others)")
    if all(p.device < 0 for p in places):
        return presets.local(world, nodes=nodes), f"conservative local CPU defaults ({why})"
    return replace(Topology(nodes, per_node), name="generic"), (
        f"generic figures ({why}; no shipped profile for {', '.join(sorted(names))}): name a preset with "
        f"topology='dgx-h200'-style strings or ${TOPOLOGY_ENV}")


#: the lines :func:`announce` has logged in this process
_SAID: set[str] = set()


def announce(found: Discovered) -> None:
    """Log ``found.line`` once per process (a warning when the hosts were set aside, else info)."""
    if found.line in _SAID:
        return
    _SAID.add(found.line)
    log.log(logging.WARNING if found.flat else logging.INFO, "%s", found.line)


__all__ = ["TOPOLOGY_ENV", "Discovered", "announce", "discover", "preset_name"]
