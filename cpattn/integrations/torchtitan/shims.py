"""The adjustments torchtitan 0.3.0 needs to run on torch 2.13, each listed in docs/torchtitan.md with the
versions that need it. :func:`apply` runs them once, before torchtitan's trainer modules are imported
(``python -m cpattn.integrations.torchtitan`` and the config module call it), and nothing else here
changes torchtitan's behaviour."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

_APPLIED = False


def _cpu_properties(device=None) -> SimpleNamespace:
    import psutil

    return SimpleNamespace(name="cpu", total_memory=psutil.virtual_memory().total)


def _cpu_device_module() -> SimpleNamespace:
    """What torchtitan calls on its device module (``torch.cuda`` by default), answered for the CPU:
    one device, no allocator statistics (torchtitan reports -1 for them), the machine's memory as the
    device's capacity."""
    return SimpleNamespace(
        set_device=lambda device: None, current_device=lambda: 0, device_count=lambda: 1,
        synchronize=lambda device=None: None, get_device_name=lambda device=None: "cpu",
        get_device_properties=_cpu_properties, memory_stats=lambda device=None: {},
        reset_peak_memory_stats=lambda device=None: None, empty_cache=lambda: None, is_available=lambda: True)


def _accelerator() -> bool:
    return torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()


def cpu_device() -> None:
    """torchtitan 0.3.0 takes ``cuda`` when torch finds no accelerator (``tools.utils.get_device_info``)
    and then calls ``torch.cuda.set_device``; without one, point it at the CPU and a device module that
    answers for it. Its modules import ``device_type`` and ``device_module`` by name, so the ones already
    imported are updated too."""
    import torchtitan.tools.utils as titan_utils

    if _accelerator() or titan_utils.device_type == "cpu":
        return
    cpu = _cpu_device_module()
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if not name.startswith("torchtitan"):
            continue
        if getattr(module, "device_type", None) == titan_utils.device_type:
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is titan_utils.device_module:
            module.device_module = cpu
    titan_utils.device_type, titan_utils.device_module = "cpu", cpu


def set_timeout_alias() -> None:
    """torchtitan 0.3.0 shortens the collective timeout after the first step with
    ``torch.distributed.set_timeout``, which torch 2.13 has only as the private ``_set_pg_timeout``."""
    if not hasattr(dist, "set_timeout"):
        from torch.distributed import distributed_c10d

        dist.set_timeout = distributed_c10d._set_pg_timeout


def apply() -> None:
    """Every adjustment, once per process."""
    global _APPLIED
    if _APPLIED:
        return
    cpu_device()
    set_timeout_alias()
    _APPLIED = True
