"""Training checkpoints that commit atomically, describe themselves, and are checked before use.

A checkpoint directory holds one run. Its complete steps are the directories ``step-NNNNNN``; each is
written as ``.tmp-step-NNNNNN`` and published by one rename once every rank's files are durable:

1. every rank writes its shards with ``torch.distributed.checkpoint`` (DCP; rank 0 adds ``.metadata``);
2. every rank fsyncs and hashes (SHA-256) a share of the files, and rank 0 gathers the sums;
3. rank 0 writes ``record.json`` (through a temporary file, fsynced, renamed), fsyncs the directory,
   renames it to ``step-NNNNNN`` and fsyncs the checkpoint directory.

``record.json`` holds the format version, the step, the data position (the step: a synthetic batch
is a pure function of the seed and the step; a text run adds ``data``, its packer's position and the
corpus fingerprint), the losses so far, the run's configuration and id, the cpattn
and torch versions, every parameter's shape and the size and SHA-256 of every file of the step. A
step is used only when its record validates and every file matches it; ``.tmp-*`` directories (a
save that was cut short) are never read and are removed by the next run. Nothing is pickled: the
record is JSON, the tensors are DCP's.

:func:`find_latest` walks the steps newest first and returns the first intact one with the reasons
the newer ones were passed over; :func:`check_resume` compares a saved configuration with a new one
field by field; :func:`prepare_new_run` refuses a directory that holds another run's steps unless
told to clear it. :data:`FAULT_ENV` injects a failure at a chosen point of a save (tests).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from .version import __version__

#: version of ``record.json``; another version is refused with both named
FORMAT = 1
RECORD = "record.json"
_STEP_RE = re.compile(r"^step-(\d{6,})$")
_TMP_PREFIX = ".tmp-step-"
_OLD_PREFIX = ".old-step-"
#: fields of the configuration that change what a run computes: a resume that changes one is refused
RESULT_FIELDS = ("model", "config", "task", "seed", "seq", "batch", "lr", "documents", "dtype", "data", "tokenizer")
#: fields a resume may change (logged): how the run is split and scheduled, how long and how often it
#: saves, evaluates and reports
FREE_FIELDS = ("dp", "cp", "fsdp", "schedule", "steps", "stop_after", "checkpoint", "checkpoint_every", "resume",
               "overwrite", "eval_every", "peak_tflops", "progress", "log", "plot")
#: ``point[:step[:rank[:how]]]``: fail a save at ``point`` (``shards``: after DCP wrote the shards;
#: ``record``: after ``record.json`` was written in the temporary directory, before the rename;
#: ``publish``: after the rename), at ``step`` (default: every), on ``rank`` (default: every), by
#: ``how``: ``exit`` (``os._exit(9)``, default) or ``raise`` (RuntimeError)
FAULT_ENV = "CPATTN_CHECKPOINT_FAULT"


class CheckpointError(ValueError):
    """A checkpoint directory or step that cannot be used as asked (named in the message)."""


# ---------------------------------------------------------------------------------- names
def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def list_steps(root: str | Path) -> list[int]:
    """Steps published under ``root`` (directories ``step-NNNNNN``), ascending; intact or not."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for path in root.iterdir() if (m := _STEP_RE.match(path.name)) and path.is_dir())


def _ours(path: Path) -> bool:
    return bool(_STEP_RE.match(path.name)) or path.name.startswith((_TMP_PREFIX, _OLD_PREFIX))


# ---------------------------------------------------------------------------------- durability
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_file(path: Path, sync: bool = False) -> dict:
    """``{"bytes", "sha256"}`` of ``path`` (fsynced first with ``sync``)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if sync:
            os.fsync(f.fileno())
        size = 0
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


def write_json_atomic(path: Path, obj) -> None:
    """``path`` holds ``obj`` as JSON in full or not at all: a temporary file, fsynced, renamed."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=1, allow_nan=False))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fault(point: str, step: int) -> None:
    where, at, on, how = (os.environ.get(FAULT_ENV, "").split(":") + ["", "", ""])[:4]
    if where != point:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    if any(field not in ("", "*") and int(field) != value for field, value in ((at, step), (on, rank))):
        return
    if how == "raise":
        raise RuntimeError(f"injected checkpoint fault at {point} of step {step} (${FAULT_ENV})")
    os._exit(9)


# ---------------------------------------------------------------------------------- records
def _fail(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}")


def read_record(step_path: Path) -> dict:
    """The validated ``record.json`` of ``step_path`` (CheckpointError naming the file otherwise)."""
    path = Path(step_path) / RECORD
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise _fail(path, "missing (the step was not completed)") from None
    except OSError as exc:
        raise _fail(path, f"unreadable ({exc.strerror})") from None
    try:
        rec = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _fail(path, f"not valid JSON ({exc}); the file is damaged or truncated") from None
    if not isinstance(rec, dict):
        raise _fail(path, "not a checkpoint record (a JSON object is expected)")
    if rec.get("format") != FORMAT:
        raise _fail(path, f"record format {rec.get('format')!r}, this cpattn reads format {FORMAT}")
    checks = {"step": int, "data_position": int, "run_id": str, "cpattn": str, "torch": str, "config": dict,
              "losses": list, "files": dict, "params": dict}
    for key, kind in checks.items():
        if not isinstance(rec.get(key), kind) or isinstance(rec.get(key), bool):
            raise _fail(path, f"field {key!r} is missing or not a {kind.__name__}")
    m = _STEP_RE.match(Path(step_path).name)
    if m and int(m.group(1)) != rec["step"]:
        raise _fail(path, f"records step {rec['step']}, but the directory is step {int(m.group(1))}")
    if len(rec["losses"]) != rec["step"] or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                    for x in rec["losses"]):
        raise _fail(path, f"'losses' must be {rec['step']} numbers")
    for name, meta in rec["files"].items():
        if (not isinstance(meta, dict) or not isinstance(meta.get("bytes"), int)
                or not isinstance(meta.get("sha256"), str) or "/" in name or name in ("", ".", "..", RECORD)):
            raise _fail(path, f"file entry {name!r} is malformed")
    if not rec["files"]:
        raise _fail(path, "lists no files")
    return rec


def verify_step(step_path: Path, checksums: bool = True) -> dict:
    """The record of ``step_path`` after checking that exactly its listed files are present, with
    their sizes and (``checksums``) SHA-256 sums; CheckpointError naming the step and file otherwise."""
    step_path = Path(step_path)
    rec = read_record(step_path)
    present = {p.name for p in step_path.iterdir() if p.name != RECORD}
    missing = sorted(set(rec["files"]) - present)
    extra = sorted(present - set(rec["files"]))
    if missing:
        raise _fail(step_path, f"file {missing[0]} listed in {RECORD} is missing")
    if extra:
        raise _fail(step_path, f"holds {extra[0]}, which {RECORD} does not list (files of another save)")
    for name, meta in sorted(rec["files"].items()):
        file = step_path / name
        size = file.stat().st_size
        if size != meta["bytes"]:
            raise _fail(file, f"{size} bytes, {RECORD} says {meta['bytes']} (truncated or damaged)")
        if checksums and _hash_file(file)["sha256"] != meta["sha256"]:
            raise _fail(file, f"SHA-256 differs from {RECORD} (the file is damaged)")
    return rec


def find_latest(root: str | Path, checksums: bool = True) -> tuple[int, Path, dict, list[str]]:
    """The newest intact step under ``root``: ``(step, path, record, passed_over)`` where
    ``passed_over`` says why each newer step was not used. CheckpointError when there is none."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"resume: checkpoint directory {root} does not exist")
    passed: list[str] = []
    for step in reversed(list_steps(root)):
        path = step_dir(root, step)
        try:
            return step, path, verify_step(path, checksums), passed
        except CheckpointError as exc:
            passed.append(str(exc))
        except OSError as exc:
            passed.append(f"{path}: unreadable ({exc})")
    if passed:
        raise CheckpointError(f"resume: no intact step under {root}: " + "; ".join(passed))
    raise CheckpointError(f"resume: {root} holds no complete step (no step-NNNNNN directory)")


# ---------------------------------------------------------------------------------- runs
def _comparable(config: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}


def check_resume(saved: dict, config: dict) -> list[str]:
    """Compare a step's saved configuration with a resuming run's, field by field. Raises
    CheckpointError listing every result-changing field that differs (:data:`RESULT_FIELDS`); returns
    one note per other field that differs (``"schedule: ring -> zigzag_ring"``)."""
    saved, config = _comparable(saved), _comparable(config)
    unknown = sorted(set(config) - set(RESULT_FIELDS) - set(FREE_FIELDS))
    bad = [f"{k} {saved.get(k)!r} -> {config.get(k)!r}" for k in (*RESULT_FIELDS, *unknown)
           if saved.get(k) != config.get(k)]
    if bad:
        raise CheckpointError("resume: the checkpoint was saved by a run with another configuration, and these "
                              "changes would train something else: " + "; ".join(bad)
                              + " (resume with the saved values, or start a new run in a fresh directory)")
    return [f"{k}: {saved.get(k)!r} -> {config.get(k)!r}" for k in FREE_FIELDS
            if k not in ("resume", "overwrite", "progress") and saved.get(k) != config.get(k)]


def check_new_run(root: str | Path) -> None:
    """Raise CheckpointError when a new run may not start in ``root``: it holds another run's steps
    (or an unfinished save), or is not a directory."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint path {root} exists and is not a directory")
    if root.is_dir() and any(_ours(p) for p in root.iterdir()):
        steps = list_steps(root)
        held = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else \
            f"step {steps[0]}" if steps else "an unfinished save"
        raise CheckpointError(f"checkpoint directory {root} already holds a run ({held}); continue it with "
                              f"--resume, clear it with --overwrite, or choose a fresh directory")


def prepare_new_run(root: str | Path, overwrite: bool) -> None:
    """Make ``root`` ready for a new run: refuse (:func:`check_new_run`) when it holds another run's
    steps, unless ``overwrite``, which deletes them (and any unfinished save); other files are left
    alone."""
    root = Path(root)
    if not overwrite or (root.exists() and not root.is_dir()):
        check_new_run(root)
    if root.is_dir():
        for path in sorted(p for p in root.iterdir() if _ours(p)):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        _fsync_dir(root)
    root.mkdir(parents=True, exist_ok=True)


def remove_unfinished(root: str | Path) -> None:
    """Delete the temporary directories of saves that were cut short."""
    root = Path(root)
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith((_TMP_PREFIX, _OLD_PREFIX)) and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)


def new_run_id() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------------- collective save / load
def _agree(error: str | None, value=None) -> list:
    """Every rank's ``value``, in rank order (a collective); every rank raises the same CheckpointError,
    naming each rank that had an ``error``, when any rank had one."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (error, value))
    errors = [f"rank {rank}: {err}" for rank, (err, _) in enumerate(gathered) if err is not None]
    if errors:
        raise CheckpointError("; ".join(errors))
    return [v for _, v in gathered]


def param_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    return {name: list(p.shape) for name, p in model.named_parameters()}


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) parameter, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def save(root: str | Path, step: int, model: torch.nn.Module, optim, config, losses: list[float],
         run_id: str, data: dict | None = None) -> Path:
    """Save model and optimizer (replicated or sharded with FSDP2: DCP writes each rank's shards) as
    step ``step`` under ``root`` (a collective; see the module docstring); ``data``: a JSON-able data
    position beyond the step, kept in the record. Refuses non-finite parameters (each rank checks its
    shards; any finding makes every rank refuse). Returns the published step directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = Path(root)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    final, tmp = step_dir(root, step), root / f"{_TMP_PREFIX}{step:06d}"
    error = None
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(_local(p.detach())).all())]
    if bad:
        error = f"step {step}: parameter {bad[0]} is not finite; refusing to save it"
    elif rank == 0:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        except OSError as exc:
            error = f"cannot create {tmp}: {exc}"
    _agree(error)
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    dist.barrier()
    _fault("shards", step)
    error, sums = None, {}
    try:
        names = sorted(p.name for p in tmp.iterdir())
        sums = {name: _hash_file(tmp / name, sync=True) for name in names[rank::world]}
    except OSError as exc:
        error = f"cannot read back the files of {tmp}: {exc}"
    parts = _agree(error, sums)
    error = None
    if rank == 0:
        try:
            files = {name: meta for part in parts for name, meta in part.items()}
            record = {"format": FORMAT, "step": step, "data_position": step, "run_id": run_id,
                      "cpattn": __version__, "torch": torch.__version__, "world": world, "config": cfg,
                      "losses": [float(x) for x in losses], "params": param_shapes(model), "files": files}
            if data is not None:
                record["data"] = data
            write_json_atomic(tmp / RECORD, record)
            _fsync_dir(tmp)
            _fault("record", step)
            old = None
            if final.exists():  # a damaged step passed over at resume, saved again
                old = root / f"{_OLD_PREFIX}{step:06d}"
                if old.exists():
                    shutil.rmtree(old)
                os.rename(final, old)
            os.rename(tmp, final)
            _fsync_dir(root)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            _fault("publish", step)
        except Exception as exc:  # every rank raises it (an injected fault included)
            error = f"publishing {final}: {exc}"
    _agree(error)
    return final


def load(root: str | Path, model: torch.nn.Module, optim, config) -> tuple[int, dict, list[str]]:
    """Restore the newest intact step under ``root`` into ``model`` and ``optim`` after checking it
    against ``config`` (a collective; rank 0 verifies the checksums). Returns ``(step, record, notes)``:
    ``notes`` are what was passed over and what the resume changes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    cfg = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    found: list = [None]
    if dist.get_rank() == 0:
        try:
            step, path, rec, passed = find_latest(root)
            found[0] = ("ok", step, str(path), rec, passed)
        except (CheckpointError, OSError) as exc:
            found[0] = ("error", str(exc))
    dist.broadcast_object_list(found, src=0)
    if found[0][0] == "error":
        raise CheckpointError(found[0][1])
    _, step, path, rec, passed = found[0]
    notes = [f"passed over {p}" for p in passed]
    notes += [f"resume changes {n}" for n in check_resume(rec["config"], cfg)]
    shapes = param_shapes(model)
    if shapes != rec["params"]:
        diff = sorted(k for k in set(shapes) | set(rec["params"]) if shapes.get(k) != rec["params"].get(k))
        k = diff[0]
        raise CheckpointError(f"resume: {path} holds parameter {k} of shape {rec['params'].get(k)}, this model's is "
                              f"{shapes.get(k)} ({len(diff)} parameter(s) differ)")
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as exc:  # DCP's own errors run to many lines: name the step instead
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"resume: {path} could not be loaded: {first}") from exc
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step, rec, notes


__all__ = ["FAULT_ENV", "FORMAT", "RESULT_FIELDS", "CheckpointError", "check_new_run", "check_resume", "find_latest",
           "list_steps", "load", "prepare_new_run", "read_record", "save", "step_dir", "verify_step"]
