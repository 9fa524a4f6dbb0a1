"""Calibration profiles: what ``cpattn calibrate`` measured on a machine, as validated JSON.

A profile holds kernel rates versus block shape, per-op link fits (alpha, bandwidth) of the local
collectives, the epilogue memory bandwidth, how much communication hides behind compute, and the
conditions of the measurement (cores, ranks, threads per rank). It is plain JSON with a schema name
and version; :func:`load` checks every field and raises :class:`ProfileError` naming the file and the
field (:class:`ProfileVersionError` for a profile of another format version). The default location is
``$CPATTN_PROFILE``, else ``$XDG_CACHE_HOME/cpattn/profile.json`` (``~/.cache/cpattn/profile.json``);
:func:`load_default` ignores a corrupt file there with a warning (the conservative defaults apply) but
refuses one of another version, which a newer or older cpattn wrote and ``cpattn calibrate`` replaces.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..core.steps import COMM_OPS, PHASES
from ..core.topology import KINDS, Link, RatePoint

SCHEMA = "cpattn-profile"
VERSION = 1
PROFILE_ENV = "CPATTN_PROFILE"

log = logging.getLogger(__name__)


class ProfileError(ValueError):
    """A profile file that is missing, unreadable, or not a valid profile of this version."""


class ProfileVersionError(ProfileError):
    """A profile of another format version (``found``) than this cpattn reads (``expected``)."""

    def __init__(self, source: str, found, expected: int = VERSION) -> None:
        self.source, self.found, self.expected = source, found, expected
        super().__init__(f"{source}: calibration profile format version {found!r}, this cpattn reads version "
                         f"{expected}; delete it or run `cpattn calibrate` to measure this machine again")


@dataclass(frozen=True)
class Profile:
    """Measurements of one machine. ``kernels``: rates per (phase, kind, block). ``links``: ``{op: Link}``
    fitted from timed collectives on ``ranks`` local processes. ``memory_bandwidth``: bytes/s of the
    merge epilogue. ``overlap``: fraction of a transfer hidden behind a concurrent kernel, in [0, 1].
    ``cores``: CPU cores of the machine; ``ranks`` x ``threads_per_rank``: how the kernels ran.
    ``memory``: bytes of memory of the machine (shared by its ranks). ``host``: free-form description
    (torch version, platform)."""

    kernels: tuple[RatePoint, ...]
    links: dict[str, Link]
    memory_bandwidth: float
    overlap: float
    cores: int
    ranks: int
    threads_per_rank: int
    memory: int
    host: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "version": VERSION,
                "kernels": [asdict(p) for p in self.kernels],
                "links": {op: {"latency": ln.latency, "bandwidth": ln.bandwidth} for op, ln in self.links.items()},
                "memory_bandwidth": self.memory_bandwidth, "overlap": self.overlap, "cores": self.cores,
                "ranks": self.ranks, "threads_per_rank": self.threads_per_rank, "memory": self.memory,
                "host": dict(self.host)}


def default_path() -> Path:
    """``$CPATTN_PROFILE``, else ``$XDG_CACHE_HOME/cpattn/profile.json`` (``~/.cache`` by default)."""
    if os.environ.get(PROFILE_ENV):
        return Path(os.environ[PROFILE_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "cpattn" / "profile.json"


def save(profile: Profile, path: str | os.PathLike | None = None) -> Path:
    """Write ``profile`` as JSON (atomically) to ``path`` or :func:`default_path`; returns the path."""
    target = Path(path) if path is not None else default_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=2))
    os.replace(tmp, target)
    return target


def _number(where: str, value, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileError(f"{where} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ProfileError(f"{where} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _int(where: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ProfileError(f"{where} must be a positive int, got {value!r}")
    return value


def _keys(where: str, obj, required: tuple[str, ...]) -> dict:
    if not isinstance(obj, dict):
        raise ProfileError(f"{where} must be an object, got {type(obj).__name__}")
    missing = [k for k in required if k not in obj]
    if missing:
        raise ProfileError(f"{where} is missing {', '.join(missing)}")
    return obj


def from_json(data, source: str = "profile") -> Profile:
    """Validate a decoded JSON profile; raises :class:`ProfileError` naming ``source`` and the field."""
    top = _keys(source, data, ("schema", "version", "kernels", "links", "memory_bandwidth", "overlap", "cores",
                               "ranks", "threads_per_rank", "memory"))
    if top["schema"] != SCHEMA:
        raise ProfileError(f"{source}: schema is {top['schema']!r}, expected {SCHEMA!r}")
    if top["version"] != VERSION:
        raise ProfileVersionError(source, top["version"])
    if not isinstance(top["kernels"], list) or not top["kernels"]:
        raise ProfileError(f"{source}: kernels must be a non-empty list")
    kernels = []
    for n, k in enumerate(top["kernels"]):
        where = f"{source}: kernels[{n}]"
        k = _keys(where, k, ("phase", "kind", "q_len", "kv_len", "flop_per_s"))
        if k["phase"] not in PHASES or k["kind"] not in KINDS:
            raise ProfileError(f"{where}: phase/kind {k['phase']!r}/{k['kind']!r} unknown; accepted: "
                               f"{', '.join(PHASES)} / {', '.join(KINDS)}")
        kernels.append(RatePoint(k["phase"], k["kind"], _int(f"{where}.q_len", k["q_len"]),
                                 _int(f"{where}.kv_len", k["kv_len"]),
                                 _number(f"{where}.flop_per_s", k["flop_per_s"])))
    links_obj = _keys(f"{source}: links", top["links"], ("sendrecv",))
    links = {}
    for op, ln in links_obj.items():
        where = f"{source}: links.{op}"
        if op not in COMM_OPS:
            raise ProfileError(f"{where}: unknown op; accepted: {', '.join(COMM_OPS)}")
        ln = _keys(where, ln, ("latency", "bandwidth"))
        links[op] = Link(_number(f"{where}.latency", ln["latency"], positive=False),
                         _number(f"{where}.bandwidth", ln["bandwidth"]))
    overlap = _number(f"{source}: overlap", top["overlap"], positive=False)
    if overlap > 1:
        raise ProfileError(f"{source}: overlap must be in [0, 1], got {overlap!r}")
    host = top.get("host", {})
    if not isinstance(host, dict):
        raise ProfileError(f"{source}: host must be an object")
    return Profile(tuple(kernels), links, _number(f"{source}: memory_bandwidth", top["memory_bandwidth"]), overlap,
                   _int(f"{source}: cores", top["cores"]), _int(f"{source}: ranks", top["ranks"]),
                   _int(f"{source}: threads_per_rank", top["threads_per_rank"]),
                   _int(f"{source}: memory", top["memory"]), {str(k): str(v) for k, v in host.items()})


def load(path: str | os.PathLike | None = None) -> Profile:
    """Read and validate the profile at ``path`` (default :func:`default_path`)."""
    target = Path(path) if path is not None else default_path()
    try:
        text = target.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read the calibration profile {target}: {exc.strerror or exc}; "
                           "run `cpattn calibrate` to create it") from exc
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{target} is not text ({exc.reason} at byte {exc.start}); "
                           "run `cpattn calibrate` again") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{target} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                           "run `cpattn calibrate` again") from exc
    return from_json(data, str(target))


def load_default() -> Profile | None:
    """The profile at the default location, or None when there is none. A corrupt one (unreadable, not
    JSON, a field wrong) is ignored with a warning, so the conservative defaults apply; one of another
    format version raises :class:`ProfileVersionError` (``cpattn calibrate`` replaces it)."""
    path = default_path()
    if not path.exists():
        return None
    try:
        return load(path)
    except ProfileVersionError:
        raise
    except ProfileError as exc:
        log.warning("ignoring the calibration profile (%s): it is corrupt; using conservative defaults until "
                    "`cpattn calibrate` writes a new one", exc)
        return None


__all__ = ["PROFILE_ENV", "SCHEMA", "VERSION", "Profile", "ProfileError", "ProfileVersionError", "default_path",
           "from_json", "load", "load_default", "save"]
