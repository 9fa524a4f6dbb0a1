"""The world a run trains on: the ("dp", "cp") DeviceMesh and its flattened dp x cp mesh, this rank's
device, and the per-rank peak MFU is taken against: the device's data-sheet dense bf16 peak on a GPU
:data:`cpattn.models.flops.BF16_PEAK_TFLOPS` knows, else the matmul rate measured on every rank at once
in the run's dtype (the CPU)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .config import DTYPES

#: side of the square matmul whose measured rate is the peak where the device has no data-sheet entry
PEAK_MATMUL_N = 1024

_MESHES: dict[tuple[str, int, int], tuple] = {}


def mesh(dp: int, cp: int, device_type: str = "cpu"):
    """``(grid, flat)``: the ("dp", "cp") DeviceMesh of the default world and its flattened 1-D
    ``"dp_cp"`` mesh, the one FSDP2 shards over (torchtitan's ``dp_shard_cp``); built once per shape
    and process (collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if dp * cp != world:
        raise ValueError(f"dp={dp} x cp={cp} = {dp * cp} ranks, but the world has {world}")
    key = (device_type, dp, cp)
    if key not in _MESHES:
        grid = init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))
        _MESHES[key] = grid, grid["dp", "cp"]._flatten("dp_cp")
    return _MESHES[key]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def world_peak(dtype: str = "float32", seconds: float = 0.5) -> tuple[float, str]:
    """``(FLOP/s per rank, what it is)``: the peak MFU is taken against (collective). On a GPU the
    :data:`cpattn.models.flops.BF16_PEAK_TFLOPS` table knows, its data-sheet dense bf16 peak; otherwise
    the ``dtype`` matmul rate measured on every rank at once (as they compute during training: ranks
    that share cores share them here too), averaged over the world."""
    from ..models.flops import datasheet_peak

    device = _device()
    if device.type == "cuda":
        found = datasheet_peak(torch.cuda.get_device_name(device))
        if found is not None:
            return found[1], f"{found[0]} data-sheet dense bf16 peak"
    rate = torch.tensor([matmul_peak(device, DTYPES[dtype], seconds)], dtype=torch.float64, device=device)
    dist.all_reduce(rate)
    return float(rate) / dist.get_world_size(), (f"measured {dtype} matmul peak ({PEAK_MATMUL_N}^2, every rank "
                                                 f"at once)")


def matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32, seconds: float = 0.2) -> float:
    """Measured rate of a :data:`PEAK_MATMUL_N`-square matmul in ``dtype`` on this rank (FLOP/s)."""
    n = PEAK_MATMUL_N
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        calls += 1
    _sync(device)
    return 2 * n**3 * calls / (time.perf_counter() - start)
