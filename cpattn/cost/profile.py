"""Calibration profiles: what ``cpattn calibrate`` measured on a machine, as validated JSON.

A profile holds kernel rates versus block shape, per-op link fits (alpha, bandwidth) of the local
collectives, the epilogue memory bandwidth, how much communication hides behind compute, and the
conditions of the measurement (cores, ranks, threads per rank). It is plain JSON with a schema name
and version; :func:`load` checks every field and raises :class:`ProfileError` naming the file and the
field (:class:`ProfileVersionError` for a profile of another format version). The default location is
``$CPATTN_PROFILE``, else ``$XDG_CACHE_HOME/cpattn/profile.json`` (``~/.cache/cpattn/profile.json``);
:func:`load_default` ignores a corrupt file there with a warning (the conservative defaults apply) but
refuses one of another version, which a newer or older cpattn wrote and ``cpattn calibrate`` replaces.

A *GPU profile* describes one GPU measured at world size 1: its ``gpu`` section (:class:`GpuInfo`: the
device, its compute capability, the kernel path of each block kind, the date, the software, which
block sizes were measured and a note on how the others were extrapolated) replaces the CPU figures
(links, cores, threads per rank, overlap), which a single device cannot measure. The section is optional,
so format version 1 covers both kinds: every CPU profile written before it loads unchanged.
:func:`from_gpu_check` derives a GPU profile from a ``scripts/gpu_check.py`` report, and the package
ships the first measured ones (:data:`SHIPPED`, :func:`shipped`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from ..core.kernels import PATHS
from ..core.steps import BACKWARD_FLOP_RATIO, COMM_OPS, PHASES
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
class GpuInfo:
    """What a GPU profile was measured on and how. ``device``: the device name as torch reports it
    (``"NVIDIA H200"``); ``capability``: its CUDA compute capability (major, minor); ``paths``: the kernel
    path (``cpattn.kernels.PATHS``) each block kind's rates were measured on, ``{kind: path}``;
    ``measured``: the date (ISO, ``YYYY-MM-DD``); ``software``: versions (torch, CUDA, cuDNN, ...);
    ``measured_tokens``: the square block sides (tokens) that were timed; every other kernel point was
    extrapolated, as ``note`` says."""

    device: str
    capability: tuple[int, int]
    paths: dict[str, str]
    measured: str
    software: dict[str, str]
    measured_tokens: tuple[int, ...]
    note: str

    @property
    def dense_path(self) -> str:
        """The kernel path of the full blocks (the one a label names)."""
        return self.paths.get("full") or next(iter(self.paths.values()))

    def label(self) -> str:
        """``"NVIDIA H200 cudnn_cuda 2026-12-04"``: the device, dense kernel path and date."""
        return f"{self.device} {self.dense_path} {self.measured}"

    def to_json(self) -> dict:
        return {**asdict(self), "capability": list(self.capability), "measured_tokens": list(self.measured_tokens)}


@dataclass(frozen=True)
class Profile:
    """Measurements of one machine. ``kernels``: rates per (phase, kind, block). ``links``: ``{op: Link}``
    fitted from timed collectives on ``ranks`` local processes. ``memory_bandwidth``: bytes/s of the
    merge epilogue. ``overlap``: fraction of a transfer hidden behind a concurrent kernel, in [0, 1].
    ``cores``: CPU cores of the machine; ``ranks`` x ``threads_per_rank``: how the kernels ran.
    ``memory``: bytes of memory of the machine (shared by its ranks). ``host``: free-form description
    (torch version, platform). ``gpu``: set for a GPU profile (one device at world size 1, see
    :class:`GpuInfo`); its ``links`` are empty, ``ranks``, ``cores`` and ``threads_per_rank`` are 1 and
    ``overlap`` is 1 (a GPU's transfers run on their own streams): none of them was measured."""

    kernels: tuple[RatePoint, ...]
    links: dict[str, Link]
    memory_bandwidth: float
    overlap: float
    cores: int
    ranks: int
    threads_per_rank: int
    memory: int
    host: dict[str, str] = field(default_factory=dict)
    gpu: GpuInfo | None = None

    def to_json(self) -> dict:
        head = {"schema": SCHEMA, "version": VERSION}
        kernels = [asdict(p) for p in self.kernels]
        if self.gpu is not None:  # the CPU-only figures are not measured on one GPU: not written
            return {**head, "gpu": self.gpu.to_json(), "kernels": kernels, "memory_bandwidth": self.memory_bandwidth,
                    "memory": self.memory, "ranks": self.ranks, "host": dict(self.host)}
        return {**head, "kernels": kernels,
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


def _strings(where: str, obj) -> dict[str, str]:
    if not isinstance(obj, dict) or not all(isinstance(v, (str, int, float)) for v in obj.values()):
        raise ProfileError(f"{where} must be an object of strings")
    return {str(k): str(v) for k, v in obj.items()}


def _kernels(source: str, items) -> tuple[RatePoint, ...]:
    if not isinstance(items, list) or not items:
        raise ProfileError(f"{source}: kernels must be a non-empty list")
    kernels = []
    for n, k in enumerate(items):
        where = f"{source}: kernels[{n}]"
        k = _keys(where, k, ("phase", "kind", "q_len", "kv_len", "flop_per_s"))
        if k["phase"] not in PHASES or k["kind"] not in KINDS:
            raise ProfileError(f"{where}: phase/kind {k['phase']!r}/{k['kind']!r} unknown; accepted: "
                               f"{', '.join(PHASES)} / {', '.join(KINDS)}")
        kernels.append(RatePoint(k["phase"], k["kind"], _int(f"{where}.q_len", k["q_len"]),
                                 _int(f"{where}.kv_len", k["kv_len"]),
                                 _number(f"{where}.flop_per_s", k["flop_per_s"])))
    return tuple(kernels)


def _links(where: str, obj, required: tuple[str, ...]) -> dict[str, Link]:
    links = {}
    for op, ln in _keys(where, obj, required).items():
        at = f"{where}.{op}"
        if op not in COMM_OPS:
            raise ProfileError(f"{at}: unknown op; accepted: {', '.join(COMM_OPS)}")
        ln = _keys(at, ln, ("latency", "bandwidth"))
        links[op] = Link(_number(f"{at}.latency", ln["latency"], positive=False), _number(f"{at}.bandwidth",
                                                                                         ln["bandwidth"]))
    return links


def _gpu_info(source: str, obj, kernels: tuple[RatePoint, ...]) -> GpuInfo:
    where = f"{source}: gpu"
    g = _keys(where, obj, ("device", "capability", "paths", "measured", "software", "measured_tokens", "note"))
    for name in ("device", "note"):
        if not isinstance(g[name], str) or not g[name].strip():
            raise ProfileError(f"{where}.{name} must be a non-empty string, got {g[name]!r}")
    cap = g["capability"]
    if not (isinstance(cap, list) and len(cap) == 2 and all(isinstance(c, int) and not isinstance(c, bool)
                                                            and c >= 0 for c in cap)):
        raise ProfileError(f"{where}.capability must be [major, minor] (non-negative ints), got {cap!r}")
    paths = g["paths"]
    if not isinstance(paths, dict) or not paths:
        raise ProfileError(f"{where}.paths must be a non-empty object {{kind: kernel path}}, got {paths!r}")
    for kind, path in paths.items():
        if kind not in KINDS or path not in PATHS:
            raise ProfileError(f"{where}.paths.{kind}: kind/path {kind!r}/{path!r} unknown; accepted: "
                               f"{', '.join(KINDS)} / {', '.join(PATHS)}")
    unpathed = sorted({p.kind for p in kernels} - set(paths))
    if unpathed:
        raise ProfileError(f"{where}.paths names no kernel path for the {', '.join(unpathed)} kernels")
    try:
        datetime.date.fromisoformat(g["measured"])
    except (TypeError, ValueError):
        raise ProfileError(f"{where}.measured must be a date YYYY-MM-DD, got {g['measured']!r}") from None
    sides = g["measured_tokens"]
    if not isinstance(sides, list) or not sides:
        raise ProfileError(f"{where}.measured_tokens must be a non-empty list of block sides, got {sides!r}")
    squares = {p.q_len for p in kernels if p.q_len == p.kv_len}
    for n, side in enumerate(sides):
        _int(f"{where}.measured_tokens[{n}]", side)
        if side not in squares:
            raise ProfileError(f"{where}.measured_tokens[{n}]: no kernel point of {side} x {side}")
    return GpuInfo(g["device"], (cap[0], cap[1]), dict(paths), g["measured"],
                   _strings(f"{where}.software", g["software"]), tuple(sides), g["note"])


def from_json(data, source: str = "profile") -> Profile:
    """Validate a decoded JSON profile; raises :class:`ProfileError` naming ``source`` and the field.
    A profile with a ``gpu`` section is a GPU profile: it needs no links, cores, threads per rank nor
    overlap (one device measured alone) and must have ``ranks`` 1."""
    top = _keys(source, data, ("schema", "version"))
    if top["schema"] != SCHEMA:
        raise ProfileError(f"{source}: schema is {top['schema']!r}, expected {SCHEMA!r}")
    if top["version"] != VERSION:
        raise ProfileVersionError(source, top["version"])
    host = top.get("host", {})
    if not isinstance(host, dict):
        raise ProfileError(f"{source}: host must be an object")
    host = {str(k): str(v) for k, v in host.items()}
    if "gpu" in top:
        _keys(source, top, ("gpu", "kernels", "memory_bandwidth", "memory", "ranks"))
        kernels = _kernels(source, top["kernels"])
        if _int(f"{source}: ranks", top["ranks"]) != 1:
            raise ProfileError(f"{source}: ranks must be 1 in a GPU profile (one device measured alone), "
                               f"got {top['ranks']!r}")
        return Profile(kernels, {}, _number(f"{source}: memory_bandwidth", top["memory_bandwidth"]), 1.0, 1, 1, 1,
                       _int(f"{source}: memory", top["memory"]), host, _gpu_info(source, top["gpu"], kernels))
    _keys(source, top, ("kernels", "links", "memory_bandwidth", "overlap", "cores", "ranks", "threads_per_rank",
                        "memory"))
    kernels = _kernels(source, top["kernels"])
    links = _links(f"{source}: links", top["links"], ("sendrecv",))
    overlap = _number(f"{source}: overlap", top["overlap"], positive=False)
    if overlap > 1:
        raise ProfileError(f"{source}: overlap must be in [0, 1], got {overlap!r}")
    return Profile(kernels, links, _number(f"{source}: memory_bandwidth", top["memory_bandwidth"]), overlap,
                   _int(f"{source}: cores", top["cores"]), _int(f"{source}: ranks", top["ranks"]),
                   _int(f"{source}: threads_per_rank", top["threads_per_rank"]),
                   _int(f"{source}: memory", top["memory"]), host)


#: square block sides (tokens) a GPU profile gets extrapolated points at, below its smallest measured one
EXTRAPOLATED_SIDES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
#: the block side at which a dimension runs at half efficiency in that extrapolation (tokens): the
#: analytic curve the GPU presets assume without measurements (``cpattn.cost.presets``), an assumption
EXTRAPOLATION_HALF_TOKENS = 128.0


def extrapolate_below(points: tuple[RatePoint, ...], sides: tuple[int, ...] = EXTRAPOLATED_SIDES,
                      half_tokens: float = EXTRAPOLATION_HALF_TOKENS) -> tuple[RatePoint, ...]:
    """Points at the square ``sides`` smaller than the smallest measured square block of each (phase,
    kind), on ``Device``'s analytic curve through that block: ``rate(n) = rate(m) * (f(n) / f(m))^2`` with
    ``f(n) = n / (n + half_tokens)`` (FLOP/s; sides in tokens). Without them ``Device.rate`` would give
    every smaller block the rate of the smallest measured one."""
    def efficiency(n: int) -> float:
        return n / (n + half_tokens)

    out = []
    for phase, kind in sorted({(p.phase, p.kind) for p in points}):
        squares = [p for p in points if (p.phase, p.kind) == (phase, kind) and p.q_len == p.kv_len]
        if not squares:
            continue
        m = min(squares, key=lambda p: p.q_len)
        out += [RatePoint(phase, kind, n, n, m.flop_per_s * (efficiency(n) / efficiency(m.q_len)) ** 2)
                for n in sides if n < m.q_len]
    return tuple(out)


#: the shape ``scripts/gpu_check.py`` times its ``bench`` rows at on a GPU
GPU_CHECK_SHAPE = "b=1, 32:8 heads, d=128, bfloat16"


def from_gpu_check(report: Mapping, path: str, *, measured: str, memory: int, memory_bandwidth: float,
                   figures_source: str, shape: str = GPU_CHECK_SHAPE, sides: tuple[int, ...] = EXTRAPOLATED_SIDES,
                   half_tokens: float = EXTRAPOLATION_HALF_TOKENS, source: str = "gpu_check report") -> Profile:
    """A GPU profile from a ``scripts/gpu_check.py`` JSON report (its ``env`` and ``bench`` sections): the
    rates of kernel ``path`` (e.g. ``"cudnn_cuda"``) on every measured square FULL and CAUSAL block,
    forward = FLOPs / forward time, backward = 2.5 x FLOPs / (forward+backward time - forward time), FLOPs
    counted as the cost model counts them (``Kernel.flops``: a causal block's n (n + 1) / 2 pairs), plus
    :func:`extrapolate_below` points for smaller blocks. The report measures neither the memory nor its
    bandwidth: ``memory`` (bytes) and ``memory_bandwidth`` (bytes/s) come from ``figures_source`` (e.g. the
    data sheet), which the note names, as does ``measured`` (the run's date, ``YYYY-MM-DD``). Raises
    :class:`ProfileError` naming the field of the report that is missing or wrong."""
    env = _keys(source, report, ("env", "bench"))["env"]
    env = _keys(f"{source}: env", env, ("device", "capability", "torch"))
    rows = report["bench"]
    if not isinstance(rows, list):
        raise ProfileError(f"{source}: bench must be a list of rows")
    points, sides_seen = [], set()
    for n, row in enumerate(rows):
        where = f"{source}: bench[{n}]"
        row = _keys(where, row, ("s", "kind", "flops_fwd"))
        if f"{path}_fwd_ms" not in row:  # this path did not run at this size (an error, the time budget)
            continue
        side, kind = _int(f"{where}.s", row["s"]), row["kind"]
        if kind not in ("full", "causal"):
            raise ProfileError(f"{where}.kind must be full or causal, got {kind!r}")
        fwd = _number(f"{where}.{path}_fwd_ms", row[f"{path}_fwd_ms"]) / 1e3
        both = _number(f"{where}.{path}_fwd_bwd_ms", row.get(f"{path}_fwd_bwd_ms")) / 1e3
        if both <= fwd:
            raise ProfileError(f"{where}: {path}_fwd_bwd_ms ({both * 1e3}) is not above {path}_fwd_ms ({fwd * 1e3})")
        dense = side * side // (2 if kind == "causal" else 1)  # the pairs gpu_check's FLOPs count
        per_pair = _number(f"{where}.flops_fwd", row["flops_fwd"]) / dense  # 4 b h d
        flops = per_pair * (side * (side + 1) // 2 if kind == "causal" else side * side)
        points += [RatePoint("forward", kind, side, side, flops / fwd),
                   RatePoint("backward", kind, side, side, BACKWARD_FLOP_RATIO * flops / (both - fwd))]
        sides_seen.add(side)
    if not points:
        timed = sorted({k[: -len("_fwd_ms")] for r in rows if isinstance(r, dict) for k in r if k.endswith("_fwd_ms")})
        raise ProfileError(f"{source}: no bench row has {path}_fwd_ms; the report timed {', '.join(timed) or 'none'}")
    measured_sides = tuple(sorted(sides_seen))
    low, high = measured_sides[0], measured_sides[-1]
    note = (f"Measured: forward and forward+backward of FULL and CAUSAL square blocks of "
            f"{', '.join(map(str, measured_sides))} tokens on {path} ({shape}; scripts/gpu_check.py bench, CUDA "
            f"events). Backward = forward+backward - forward, at 2.5x the forward FLOPs. Extrapolated: blocks "
            f"below {low} tokens, on rate(n) = rate({low}) * (f(n) / f({low}))^2, f(n) = n / (n + {half_tokens:g}) "
            f"(half_tokens {half_tokens:g}, the GPU presets' analytic curve: an assumption); blocks above {high} "
            f"get the rate of {high}. Not measured: PARTIAL blocks (flex_cuda), which the model prices at the "
            f"device's partial_efficiency of the full-block rate. Memory and memory bandwidth: {figures_source}.")
    software = {k: str(env[k]) for k in ("torch", "cuda", "cudnn", "cpattn") if k in env}
    cap = env["capability"]
    if not (isinstance(cap, list) and len(cap) == 2):
        raise ProfileError(f"{source}: env.capability must be [major, minor], got {cap!r}")
    info = GpuInfo(str(env["device"]), (int(cap[0]), int(cap[1])), {"full": path, "causal": path}, measured,
                   software, measured_sides, note)
    kernels = tuple(points) + extrapolate_below(tuple(points), sides, half_tokens)
    prof = Profile(kernels, {}, float(memory_bandwidth), 1.0, 1, 1, 1, int(memory), {}, info)
    return from_json(prof.to_json(), source)  # one validation for every GPU profile


#: the GPU profiles shipped with the package (``cpattn/cost/profiles/NAME.json``)
SHIPPED = ("h200-2026-12-04-cudnn", "h200-2026-12-04-flash")


def shipped(name: str) -> Profile:
    """The shipped GPU profile ``name`` (one of :data:`SHIPPED`), validated."""
    if name not in SHIPPED:
        raise ProfileError(f"no shipped profile {name!r}; shipped: {', '.join(SHIPPED)}")
    text = resources.files(__package__).joinpath("profiles", f"{name}.json").read_text()
    return from_json(json.loads(text), f"shipped profile {name}")


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


def digest(path: str | os.PathLike | None = None) -> str:
    """16 hex digits of the SHA-256 of the profile file at ``path`` (default :func:`default_path`), or
    ``""`` when there is no readable file: ranks whose digests match read the same profile."""
    try:
        data = (Path(path) if path is not None else default_path()).read_bytes()
    except OSError:
        return ""
    return hashlib.sha256(data).hexdigest()[:16]


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


__all__ = ["EXTRAPOLATED_SIDES", "EXTRAPOLATION_HALF_TOKENS", "GPU_CHECK_SHAPE", "PROFILE_ENV", "SCHEMA", "SHIPPED",
           "VERSION", "GpuInfo", "Profile", "ProfileError", "ProfileVersionError", "default_path", "digest",
           "extrapolate_below", "from_gpu_check", "from_json", "load", "load_default", "save", "shipped"]
