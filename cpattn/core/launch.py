"""Which launcher started this process, read from its environment: the one parser of launcher variables.

:func:`launch_env` turns an environment (a plain mapping, so it tests with dicts) into a :class:`Launch`
(rank, world size, local rank, the rendezvous address and port) or None when no launcher started the
process; :func:`cpattn.distributed.init` builds the process group from it (the launchers, their variables
and the rules are listed in :mod:`cpattn.distributed`). :func:`no_group_error` is the check the
communicator makes when there is no process group: a launcher that says the world has more than one
process means a missing ``cpattn.distributed.init()``, not a world of one.

It lives in the core layer because the communicator needs that check; it reads only the mapping it is
given and imports nothing of cpattn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

#: what torchrun sets for every worker (``LOCAL_WORLD_SIZE`` too, which is optional here)
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: Open MPI's variables (``mpirun`` of Open MPI)
OMPI_ENV = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE")
#: MPICH's (and Intel MPI's) variables (``mpirun`` / ``mpiexec`` of MPICH, Hydra)
MPICH_ENV = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
#: an srun step's task count, else the allocation's
SLURM_COUNTS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
#: SLURM step ids that are not an ``srun`` step: the batch script's and the extern step's
SLURM_NON_STEPS = ("batch", "extern", "interactive", "4294967294", "4294967293", "4294967291")
#: the port of an ``srun`` launch without ``MASTER_PORT``: SLURM_PORT_BASE + SLURM_JOB_ID mod SLURM_PORT_SPAN
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 16000
#: the port of an ``mpirun`` launch without ``MASTER_PORT`` (torch's usual default)
MPIRUN_PORT = 29500
#: the address of a launch whose processes are all on this host
LOCALHOST = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class Launch:
    """Where this process stands in a launched world: ``rank`` of ``world_size``, ``local_rank`` on its host
    (the GPU it takes), ``local_world_size`` (None when the launcher does not say), and where rank 0 listens
    for the rendezvous, ``master_addr:master_port``. ``launcher``: "torchrun", "srun" or "mpirun"."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    master_addr: str
    master_port: int


def _set(environ: Mapping[str, str], name: str) -> bool:
    return bool(environ.get(name, "").strip())


def _int(environ: Mapping[str, str], name: str, launcher: str) -> int:
    text = environ[name].strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"${name}={text!r} ({launcher}) must be an integer") from None


def _slurm_step(environ: Mapping[str, str]) -> bool:
    """Whether this process runs inside an ``srun`` step (an ``sbatch`` script's own shell does not)."""
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID", "")).strip()
    return bool(step) and step not in SLURM_NON_STEPS


def _mpich(environ: Mapping[str, str]) -> bool:
    """Whether MPICH's (or Intel MPI's) ``mpirun`` started this process: ``PMI_RANK`` / ``PMI_SIZE``, which
    srun's PMI-2 plugin sets too, so inside an ``srun`` step only with MPICH's own ``MPI_LOCALRANKID``."""
    return any(_set(environ, name) for name in MPICH_ENV[:2]) and (not _slurm_step(environ)
                                                                  or _set(environ, "MPI_LOCALRANKID"))


def launcher_of(environ: Mapping[str, str]) -> str | None:
    """The launcher whose variables ``environ`` holds, innermost first: torchrun (also torchrun started by
    ``srun`` or ``mpirun``, one agent per node), then ``mpirun`` (also Open MPI's daemons started by
    ``srun``), then an ``srun`` step. None: no launcher (a plain run, or an ``sbatch`` script's shell)."""
    if any(_set(environ, name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return "torchrun"
    if any(_set(environ, name) for name in OMPI_ENV[:2]) or _mpich(environ):
        return "mpirun"
    if _slurm_step(environ):
        return "srun"
    return None


def _missing(environ: Mapping[str, str], needed, launcher: str, sets) -> None:
    """A ValueError naming the ``needed`` variables that are not set, those of ``sets`` (what ``launcher``
    sets) that are, and the launcher."""
    absent = [name for name in needed if not _set(environ, name)]
    if absent:
        given = [f"{name}={environ[name].strip()}" for name in sets if _set(environ, name)]
        raise ValueError(f"a partial {launcher} environment: {', '.join(absent)} "
                         f"{'is' if len(absent) == 1 else 'are'} not set"
                         + (f" (set: {', '.join(given)})" if given else "")
                         + f"; {launcher} sets {', '.join(sets)} for every process it starts")


def _check_ranks(launcher: str, rank: tuple[str, int], world: tuple[str, int], local: tuple[str, int],
                 local_world: tuple[str, int] | None) -> None:
    """Contradictions inside one launcher's variables (each a ``(variable, value)`` pair)."""
    def say(a, b, rule):
        return ValueError(f"contradictory {launcher} variables: {a[0]}={a[1]} {rule} {b[0]}={b[1]}")

    if world[1] < 1:
        raise ValueError(f"contradictory {launcher} variables: {world[0]}={world[1]}, a world needs a process")
    if not 0 <= rank[1] < world[1]:
        raise say(rank, world, "is not a rank below")
    if local[1] < 0:
        raise ValueError(f"contradictory {launcher} variables: {local[0]}={local[1]} is negative")
    if local_world is not None:
        if not local[1] < local_world[1]:
            raise say(local, local_world, "is not a local rank below")
        if local_world[1] > world[1]:
            raise say(local_world, world, "processes on one host, more than")


def _port(environ: Mapping[str, str], default: int | None, launcher: str, derived: str) -> int:
    if _set(environ, "MASTER_PORT"):
        port = _int(environ, "MASTER_PORT", "the rendezvous port")
    elif default is None:
        raise ValueError(f"{launcher}: no rendezvous port: set MASTER_PORT ({derived})")
    else:
        port = default
    if not 0 < port < 65536:
        raise ValueError(f"$MASTER_PORT={port} is not a TCP port (1 .. 65535)")
    return port


def _torchrun(environ: Mapping[str, str]) -> Launch:
    _missing(environ, TORCHRUN_ENV, "torchrun", TORCHRUN_ENV)
    rank, world, local = (("RANK", _int(environ, "RANK", "torchrun")),
                          ("WORLD_SIZE", _int(environ, "WORLD_SIZE", "torchrun")),
                          ("LOCAL_RANK", _int(environ, "LOCAL_RANK", "torchrun")))
    local_world = ("LOCAL_WORLD_SIZE", _int(environ, "LOCAL_WORLD_SIZE", "torchrun")) \
        if _set(environ, "LOCAL_WORLD_SIZE") else None
    _check_ranks("torchrun", rank, world, local, local_world)
    return Launch("torchrun", rank[1], world[1], local[1], local_world[1] if local_world else None,
                  environ["MASTER_ADDR"].strip(), _port(environ, None, "torchrun", "torchrun sets it"))


def _mpirun(environ: Mapping[str, str]) -> Launch:
    flavours = []
    if any(_set(environ, name) for name in OMPI_ENV):
        flavours.append(("mpirun (Open MPI)", OMPI_ENV))
    if _mpich(environ):
        flavours.append(("mpirun (MPICH)", MPICH_ENV))
    found = []
    for launcher, names in flavours:
        required = names if launcher.endswith("(Open MPI)") else names[:3]
        _missing(environ, required, launcher, names)
        values = [(name, _int(environ, name, launcher)) if _set(environ, name) else None for name in names]
        _check_ranks(launcher, values[0], values[1], values[2], values[3])
        found.append((launcher, values))
    if len(found) == 2:  # both families set: they must describe the same process
        (a, va), (b, vb) = found
        for x, y in zip(va[:2], vb[:2]):
            if x[1] != y[1]:
                raise ValueError(f"contradictory mpirun variables: {x[0]}={x[1]} ({a}) but {y[0]}={y[1]} ({b})")
    launcher, (rank, world, local, local_world) = found[0]
    if _set(environ, "MASTER_ADDR"):
        addr = environ["MASTER_ADDR"].strip()
    elif local_world is not None and local_world[1] == world[1]:
        addr = LOCALHOST  # every process on this host
    else:
        spread = f"{local_world[0]}={local_world[1]} of {world[0]}={world[1]}" if local_world else \
            f"{world[0]}={world[1]}, and the launcher does not say how many processes share a host"
        raise ValueError(f"{launcher} across hosts ({spread}): set MASTER_ADDR to the host of rank 0 for every "
                         "process (Open MPI: mpirun -x MASTER_ADDR=<host> ...; MPICH: mpirun -genv MASTER_ADDR "
                         "<host> ...)")
    return Launch("mpirun", rank[1], world[1], local[1], local_world[1] if local_world else None, addr,
                  _port(environ, MPIRUN_PORT, launcher, ""))


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[01-04,07]`` -> ``node01``, ``a,b`` -> ``a``,
    ``gpu-[3,5-6]`` -> ``gpu-3``, ``rack[2-3]-n[08-09]`` -> ``rack2-n08`` (zero-padded numbers kept as written).
    Raises ValueError on an empty or malformed list."""
    text, host, depth, group = nodelist.strip(), [], 0, ""
    for char in text:
        if char == "[":
            if depth:
                raise ValueError(f"node list {nodelist!r}: nested '['")
            depth, group = 1, ""
        elif char == "]":
            if not depth:
                raise ValueError(f"node list {nodelist!r}: ']' without '['")
            first = group.split(",")[0].split("-")[0].strip()
            if not first.isdigit():
                raise ValueError(f"node list {nodelist!r}: [{group}] is not a list of numbers and ranges")
            host.append(first)
            depth = 0
        elif depth:
            group += char
        elif char == ",":
            break  # the first host is complete
        else:
            host.append(char)
    if depth:
        raise ValueError(f"node list {nodelist!r}: '[' without ']'")
    name = "".join(host).strip()
    if not name:
        raise ValueError(f"node list {nodelist!r} names no host")
    return name


def _srun(environ: Mapping[str, str]) -> Launch:
    counts = [name for name in SLURM_COUNTS if _set(environ, name)]
    names = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS")
    _missing(environ, ["SLURM_PROCID", "SLURM_LOCALID"] + ([] if counts else ["SLURM_STEP_NUM_TASKS"]), "srun",
             names)
    world_var = counts[0]  # the step's own count; the allocation's (SLURM_NTASKS) only when the step has none
    rank, world, local = (("SLURM_PROCID", _int(environ, "SLURM_PROCID", "srun")),
                          (world_var, _int(environ, world_var, "srun")),
                          ("SLURM_LOCALID", _int(environ, "SLURM_LOCALID", "srun")))
    _check_ranks("srun", rank, world, local, None)
    if _set(environ, "MASTER_ADDR"):
        addr = environ["MASTER_ADDR"].strip()
    else:
        lists = [name for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if _set(environ, name)]
        if not lists:
            raise ValueError("a partial srun environment: SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are not set; "
                             "set MASTER_ADDR to the host of rank 0")
        try:
            addr = first_host(environ[lists[0]])
        except ValueError as exc:
            raise ValueError(f"${lists[0]} (srun): {exc}") from None
    default = None
    if _set(environ, "SLURM_JOB_ID"):
        default = SLURM_PORT_BASE + _int(environ, "SLURM_JOB_ID", "srun") % SLURM_PORT_SPAN
    return Launch("srun", rank[1], world[1], local[1], None, addr,
                  _port(environ, default, "srun", "or run inside a job, where SLURM_JOB_ID gives one"))


def launch_env(environ: Mapping[str, str]) -> Launch | None:
    """The :class:`Launch` that ``environ`` describes (torchrun, ``srun`` or ``mpirun``; see
    :func:`launcher_of` for which wins when several are set), or None when no launcher started the process.
    A user's ``MASTER_ADDR`` and ``MASTER_PORT`` always win over derived ones. Raises ValueError, naming
    the variables and their launcher, on a partial or contradictory set."""
    launcher = launcher_of(environ)
    if launcher is None:
        return None
    return {"torchrun": _torchrun, "mpirun": _mpirun, "srun": _srun}[launcher](environ)


def claimed_world(environ: Mapping[str, str]) -> tuple[str, str, int | None] | None:
    """``(launcher, variable, world size)``: the world size a launcher set in ``environ`` (None when it is
    missing or not an integer), or None without a launcher. Reads only the size, so a partial set still
    says what it claims."""
    launcher = launcher_of(environ)
    if launcher is None:
        return None
    names = {"torchrun": ("WORLD_SIZE",), "mpirun": (OMPI_ENV[1], MPICH_ENV[1]), "srun": SLURM_COUNTS}[launcher]
    for name in names:
        if _set(environ, name):
            text = environ[name].strip()
            return launcher, f"{name}={text}", int(text) if text.isdigit() else None
    return launcher, f"{names[0]} not set", None


def no_group_error(environ: Mapping[str, str]) -> RuntimeError | None:
    """The error to raise when there is no process group but a launcher started this process as one of
    several (a world size other than 1, or none given): every rank would otherwise run alone on the whole
    sequence. None for a plain one-process run (no launcher, or a world size of 1). The message is the
    same on every rank."""
    claim = claimed_world(environ)
    if claim is None or claim[2] == 1:
        return None
    launcher, size, _ = claim
    return RuntimeError(f"no process group, but {launcher} started this process as one of a world ({size}): "
                        "call cpattn.distributed.init() (or torch.distributed.init_process_group) before "
                        "ContextParallel or a *_attn_func, or every rank runs alone on the whole sequence")


__all__ = ["LOCALHOST", "MPICH_ENV", "MPIRUN_PORT", "OMPI_ENV", "SLURM_PORT_BASE", "SLURM_PORT_SPAN", "TORCHRUN_ENV",
           "Launch", "claimed_world", "first_host", "launch_env", "launcher_of", "no_group_error"]
