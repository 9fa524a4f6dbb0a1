"""The on-disk plan cache (docs/ultraattn.md, "Plan"): one JSON file per problem key.

:func:`get_plan` returns the plan of a :class:`~cpattn.planner.build.Request` from
:func:`cache_dir` when a valid file for its key is there, else builds and stores it. Files are
checked on load (:meth:`~cpattn.planner.model.Plan.from_json`); a corrupt or stale one, or one of
another format version, is rebuilt with a warning (a cache is disposable). :func:`load_plan` of a file
the user names refuses one of another format version with :class:`PlanVersionError`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from .build import Request, build_plan
from .model import Plan, PlanVersionError

log = logging.getLogger(__name__)

CACHE_ENV = "CPATTN_CACHE_DIR"


def cache_dir() -> Path:
    """``$CPATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/cpattn/plans`` (``~/.cache/cpattn/plans``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "cpattn" / "plans"


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file (ValueError naming the file when it is not a valid plan;
    :class:`PlanVersionError`, a ValueError, when it is a plan of another format version)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read plan {path}: {exc}") from exc
    try:
        return Plan.from_json(text)
    except PlanVersionError as exc:
        raise PlanVersionError(path, exc.found) from None
    except ValueError as exc:
        raise ValueError(f"plan {path} is invalid: {exc}") from exc


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` as JSON, atomically (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(plan.to_json())
    os.replace(tmp, path)


def get_plan(req: Request, cache: bool = True, directory: str | Path | None = None) -> Plan:
    """The plan for ``req``: from the cache when a valid file for its key exists, else built (and
    stored when ``cache``). A corrupt or stale file, or one of another format version, is rebuilt
    (and overwritten) with a warning."""
    path = Path(directory or cache_dir()) / f"{req.digest()}.json"
    if cache and path.exists():
        try:
            plan = load_plan(path)
            if plan.key != json.loads(json.dumps(req.key())):
                raise ValueError("its problem key differs (stale)")
            return plan
        except PlanVersionError as exc:
            log.warning("rebuilding the cached plan %s: it has format version %s, this cpattn reads version %s",
                        path, exc.found, exc.expected)
        except ValueError as exc:
            log.warning("rebuilding the cached plan %s: %s", path, exc)
    plan = build_plan(req)
    if cache:
        try:
            save_plan(plan, path)
        except OSError as exc:
            log.warning("could not cache the plan at %s: %s", path, exc)
    return plan
