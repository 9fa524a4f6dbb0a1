"""Functions tests/test_checkpoint.py runs on worker processes (module-level, so spawned workers import
them): a training run with variables set in the worker's environment for its duration (the
checkpoint fault injection, :data:`cpattn.checkpoint.FAULT_ENV`)."""

from __future__ import annotations

import os

from cpattn import train


def run_with_env(config: dict, env: dict[str, str], return_params: bool = False) -> dict:
    """``train.run_rank(config)`` with ``env`` added to this process's environment while it runs."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return train.run_rank(config, return_params=return_params)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
