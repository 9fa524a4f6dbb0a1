"""Schedules on a world whose ranks say they run on several hosts (``$CPATTN_HOST``), for tests/test_cluster.py.

Run under two torchrun agents, one per emulated node (``python -m torch.distributed.run --nnodes 2
--node-rank I --nproc-per-node 2 ... tests/cluster_run.py SCHEDULE ...``, ``CPATTN_HOST=nodeI`` in each
agent's environment): every rank prints one line ``cluster-run rank R {json}`` (:func:`run`'s report) and
the run exits 0. :func:`on_local_world` runs the same on the workers of a ``LocalWorld``, each rank
naming its host before the ContextParallel objects are built.

Each schedule runs causal attention (full for the bidirectional-only ones) of seeded float32 inputs,
forward and backward, against a float64 reference computed here (plain softmax with autograd), with the
tolerance of docs/testing.md: at most twice the error of single-device float32 attention, plus 1e-6.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys

import torch
import torch.distributed as dist

import cpattn
import cpattn.distributed
from cpattn.core.placement import HOST_ENV
from cpattn.cost.discovery import TOPOLOGY_ENV

SEQ, HEADS, KV_HEADS, DIM = 64, 4, 2, 16


def reference(full: list[torch.Tensor], causal: bool):
    """float64 attention with autograd: out and (dq, dk, dv)."""
    q, k, v = (t.detach().double().requires_grad_() for t in full[:3])
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) / math.sqrt(q.shape[-1])
    allowed = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(g, 2))
    out.backward(full[3].double())
    return [out.detach(), q.grad, k.grad, v.grad]


def single_device(full: list[torch.Tensor], causal: bool):
    """float32 attention of the whole sequence on one device (torch's SDPA): out and grads."""
    q, k, v = (t.detach().requires_grad_() for t in full[:3])
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=causal, enable_gqa=True).transpose(1, 2)
    out.backward(full[3])
    return [out.detach(), q.grad, k.grad, v.grad]


def rel_err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(float((a.double() - b).norm() / b.norm()) for a, b in zip(got, ref, strict=True))


class _Lines(logging.Handler):
    """Keeps the messages of the records it sees."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _one(name: str, full: list[torch.Tensor], device: torch.device) -> dict:
    """One schedule's forward and backward against the references; its topology and levels."""
    info = next(s for s in cpattn.schedules.available() if s["name"] == name)
    causal = info["causal"]
    cp = cpattn.ContextParallel(SEQ, "causal" if causal else "full", name)
    q, k, v = (cp.shard(t).to(device).requires_grad_() for t in full[:3])
    cp.reset_comm_stats()
    out = cp.attention(q, k, v)
    out.backward(cp.shard(full[3]).to(device))
    stats = cp.comm_stats()
    got = [cp.unshard(t.detach().cpu()) for t in (out, q.grad, k.grad, v.grad)]
    ref = reference(full, causal)
    return {"error": rel_err(got, ref), "e_local": rel_err(single_device(full, causal), ref),
            "finite": all(bool(t.isfinite().all()) for t in got), "topology": _shape(cp.topology),
            "levels": stats.get("levels", {}), "stats": {op: c for op, c in stats.items() if op != "levels"}}


def _shape(topology) -> list:
    return [topology.nodes, topology.devices_per_node, topology.name]


def run(schedules: list[str], device: torch.device | None = None) -> dict:
    """Every schedule of ``schedules`` on the default group (see the module docstring), then
    ``schedule="auto"`` for causal attention of :data:`SEQ` tokens: this rank's report, with the log
    lines of the topology found and of ``auto``'s choice."""
    device = device or torch.device("cpu")
    g = torch.Generator().manual_seed(11)
    full = [torch.randn(1, SEQ, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)]
    lines = _Lines()
    loggers = [logging.getLogger(n) for n in ("cpattn.api", "cpattn.cost.discovery")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(lines)
        lg.setLevel(logging.DEBUG)
    try:
        report = {"rank": dist.get_rank(), "schedules": {name: _one(name, full, device) for name in schedules}}
        auto = cpattn.ContextParallel(SEQ, "causal", "auto")
        report["auto"] = {"schedule": auto.schedule_name, "topology": _shape(auto.topology)}
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(lines)
            lg.setLevel(level)
    report["log"] = lines.lines
    return report


def on_local_world(schedules: list[str], per_node: int = 2, preset: str | None = None) -> dict:
    """:func:`run` on a LocalWorld worker whose rank says it runs on host ``node{rank // per_node}``
    (``preset``: ``$CPATTN_TOPOLOGY`` too); the worker's environment is restored afterwards."""
    saved = {name: os.environ.get(name) for name in (HOST_ENV, TOPOLOGY_ENV)}
    os.environ[HOST_ENV] = f"node{dist.get_rank() // per_node}"
    if preset is None:
        os.environ.pop(TOPOLOGY_ENV, None)
    else:
        os.environ[TOPOLOGY_ENV] = preset
    try:
        return run(schedules)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main(schedules: list[str]) -> None:
    rank, _world, _local_rank, device = cpattn.distributed.init()
    torch.set_num_threads(1)
    line = f"cluster-run rank {rank} {json.dumps(run(schedules, device))}\n"
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())  # one write: the agents' ranks share stdout


if __name__ == "__main__":
    main(sys.argv[1:])
