"""Topology presets with published figures (each with its source), and ``local`` from calibration.

``preset(name, world)`` returns the :class:`Topology` of ``world`` devices of that machine: whole nodes
(``world`` a multiple of the devices per node), or one partly used node for smaller worlds.

Figures that no vendor publishes (attention-kernel efficiency, collective-library latency per step)
are stated as assumptions next to the figure they support.

A GPU preset's attention rates are a data-sheet / paper assumption unless a measured GPU profile is given
(``preset(name, world, profile)``; :mod:`cpattn.cost.profile`); ``dgx-h200`` uses the shipped H200 cuDNN
profile by default. The device's name says which (``"H200 SXM, rates: measured NVIDIA H200 cudnn_cuda
2026-12-04 profile"``). A profile of another GPU of the same die is accepted and labelled; one of another
die, or a CPU profile, is refused.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, replace

from ..core.topology import GENERIC_DEVICE, GENERIC_INTRA, Device, Link, Topology
from .profile import Profile, ProfileError, load_default, shipped

log = logging.getLogger(__name__)

#: what a preset's device name says about its attention rates when no measured profile priced them
ASSUMED_RATES = "rates: data sheet / paper assumption"

# --- Frontier (OLCF): 4 AMD MI250X per node = 8 GCDs; 4 HPE Slingshot-11 NICs, one per MI250X.
# Sources: OLCF Frontier User Guide, "System Overview" / "Node Types" (docs.olcf.ornl.gov/systems/
# frontier_user_guide.html): 64 GB HBM2e and 1.6 TB/s per GCD; GCD-GCD Infinity Fabric 50-100 GB/s
# between MI250X (200 GB/s inside one), per direction; 4 x 25 GB/s Slingshot NICs, each attached to one
# MI250X. AMD Instinct MI250X data sheet: 383 TFLOP/s dense bf16 per MI250X = 191.5 per GCD.
# Attention rate, independent of RingX: FlashAttention-2 (ROCm flash-attention, CK backend, ROCm 6.4.1,
# gfx90a) under the upstream benchmarks/benchmark_flash_attention.py, posted in LlamaFactory issue #8793
# ("Flash Attention 2 on ROCm is SLOWER during sft training", 2025): non-causal, head dim 64, batch 2 x
# 8,192 tokens: 86.72 TFLOP/s forward, 61.07 backward, = 45.3% / 31.9% of a GCD's 191.5 (47.9% / 33.7%
# if that gfx90a was a 181 TFLOP/s MI210 or MI250 GCD); 73.7-87.6 / 47.2-62.4 TFLOP/s over 512-8,192
# tokens. We take 45% / 32% as the large-block rate (the block-size factor then puts an 8,192-token
# block about 6% below the measured figure); plausible range 38-48% forward, 25-34% backward (head
# dim 128, bf16 and causal blocks were not in that run). Assumed: 10 us per collective step (RCCL over
# Slingshot; rccl-tests small-message times are a few to tens of us) and 5 us inside the node.
FRONTIER_ATTENTION_EFFICIENCY = (0.45, 0.32)  # forward, backward: fractions of 191.5 TFLOP/s (above)
FRONTIER_DEVICE = Device(f"MI250X GCD, {ASSUMED_RATES}", forward_flops=FRONTIER_ATTENTION_EFFICIENCY[0] * 191.5e12,
                         backward_flops=FRONTIER_ATTENTION_EFFICIENCY[1] * 191.5e12,
                         memory_bandwidth=1.6e12, memory=64 * 2**30, half_tokens=256.0, launch=10e-6)
FRONTIER = dict(devices_per_node=8, intra=Link(5e-6, 50e9), inter=Link(10e-6, 25e9), nics_per_node=4,
                device=FRONTIER_DEVICE)

# --- NVIDIA DGX H100: 8 H100 SXM5 80 GB; NVLink 4 (900 GB/s bidirectional per GPU = 450 per direction)
# through NVSwitch; 8 ConnectX-7 400 Gb/s (50 GB/s) compute NICs, one per GPU (rail-optimised).
# Sources: NVIDIA DGX H100 data sheet and DGX H100 User Guide; H100 data sheet: 989 TFLOP/s dense bf16,
# 3.35 TB/s HBM3. FlashAttention-3 (Shah et al., 2024), H100 head dim 128 bf16: FlashAttention-2 about
# 330-370 TFLOP/s forward, FlashAttention-3 500-740 forward and 450-550 backward; we take 450 / 350.
# Assumed: NCCL per-step latency about 3 us over NVLink and 6 us over InfiniBand (nccl-tests small sizes).
DGX_H100_DEVICE = Device(f"H100 SXM5, {ASSUMED_RATES}", forward_flops=450e12, backward_flops=350e12,
                         memory_bandwidth=3.35e12, memory=80 * 10**9, half_tokens=128.0, launch=5e-6)
DGX_H100 = dict(devices_per_node=8, intra=Link(3e-6, 450e9), inter=Link(6e-6, 50e9), nics_per_node=8,
                device=DGX_H100_DEVICE)

# --- NVIDIA DGX H200: 8 H200 SXM 141 GB; NVLink 4 (900 GB/s bidirectional per GPU = 450 per direction)
# through NVSwitch; 8 ConnectX-7 400 Gb/s (50 GB/s) compute NICs, one per GPU. Sources: NVIDIA DGX H200
# data sheet; H200 data sheet: 989 TFLOP/s dense bf16 (the GH100 die of the H100 SXM), 141 GB HBM3e at
# 4.8 TB/s. Attention rates: measured on one H200 (the shipped profile DEFAULT_PROFILES["dgx-h200"]:
# cuDNN, the path the kernel order runs first on sm90 in bf16, 2026-12-04, cpattn/cost/profiles/); the
# device below holds the rest (launch, block-size curve, memory) and, for a profile without full-block
# points only, the H100 preset's FlashAttention-3-paper rates. Assumed, as for the H100: NCCL per-step
# latency 3 us over NVLink, 6 us over InfiniBand; 5 us per kernel launch.
DGX_H200_DEVICE = Device(f"H200 SXM, {ASSUMED_RATES}", forward_flops=450e12, backward_flops=350e12,
                         memory_bandwidth=4.8e12, memory=141 * 10**9, half_tokens=128.0, launch=5e-6)
DGX_H200 = {**DGX_H100, "device": DGX_H200_DEVICE}

# --- NVIDIA DGX A100: 8 A100 SXM4 80 GB; NVLink 3 (600 GB/s bidirectional per GPU = 300 per direction);
# 8 ConnectX-6 200 Gb/s HDR (25 GB/s) compute NICs, one per GPU. Sources: NVIDIA DGX A100 data sheet;
# A100 data sheet: 312 TFLOP/s dense bf16, 2.0 TB/s HBM2e (80 GB). FlashAttention-2 (Dao, 2023): 50-73%
# of peak forward on A100, up to about 225 TFLOP/s; we take 200 forward, 160 backward.
DGX_A100_DEVICE = Device(f"A100 SXM4, {ASSUMED_RATES}", forward_flops=200e12, backward_flops=160e12,
                         memory_bandwidth=2.0e12, memory=80 * 10**9, half_tokens=128.0, launch=5e-6)
DGX_A100 = dict(devices_per_node=8, intra=Link(3e-6, 300e9), inter=Link(6e-6, 25e9), nics_per_node=8,
                device=DGX_A100_DEVICE)

# --- local without a calibration profile: deliberately pessimistic CPU figures (a few GFLOP/s per
# rank, 1 GB/s and 100 us per message over loopback, no overlap, 8 GiB per rank), so that an
# uncalibrated choice prefers little communication and little memory.
LOCAL_DEFAULT_DEVICE = Device("local CPU (uncalibrated)", forward_flops=20e9, backward_flops=10e9,
                              memory_bandwidth=5e9, memory=8 * 2**30, half_tokens=256.0, causal_efficiency=0.6,
                              partial_efficiency=0.1, launch=50e-6)
LOCAL_DEFAULT_LINK = Link(100e-6, 1e9)

PRESETS = {"frontier": FRONTIER, "dgx-h100": DGX_H100, "dgx-h200": DGX_H200, "dgx-a100": DGX_A100}
NAMES = (*PRESETS, "local")


@dataclass(frozen=True)
class GpuModel:
    """A GPU model: ``model`` as it appears in the device name torch reports (``pattern``, a regex),
    its ``die`` (models of one die share its compute units and peak FLOP/s; their memory differs) and
    the ``product`` a preset's device is called."""

    model: str
    die: str
    product: str
    pattern: str

    def matches(self, device_name: str) -> bool:
        return re.search(self.pattern, device_name, flags=re.IGNORECASE) is not None


#: the GPU models profiles can come from, first match wins (device names as torch reports them:
#: "NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "AMD Instinct MI250X"). Dies from
#: the vendors' architecture papers: H100, H200 and H800 are GH100; A100 GA100; MI250X's GCD Aldebaran.
GPU_MODELS = (GpuModel("H200", "GH100", "H200 SXM", r"\bH200\b"), GpuModel("H100", "GH100", "H100 SXM5", r"\bH100\b"),
              GpuModel("H800", "GH100", "H800", r"\bH800\b"), GpuModel("A100", "GA100", "A100 SXM4", r"\bA100\b"),
              GpuModel("MI250X", "Aldebaran", "MI250X GCD", r"\bMI250X\b"))
#: the GPU model of each preset
PRESET_GPUS = {"frontier": "MI250X", "dgx-h100": "H100", "dgx-h200": "H200", "dgx-a100": "A100"}
#: the measured profile a preset prices its attention with when none is given (a :data:`profile.SHIPPED` name)
DEFAULT_PROFILES = {"dgx-h200": "h200-2026-12-04-cudnn"}
#: data-sheet memory (bytes) and memory bandwidth (bytes/s) of the GPU models above, with their source,
#: for profiles whose measurement did not include them (``profile.from_gpu_check``)
DATA_SHEETS = {"H200": (141 * 10**9, 4.8e12, "NVIDIA H200 data sheet (141 GB HBM3e, 4.8 TB/s), not measured"),
               "H100": (80 * 10**9, 3.35e12, "NVIDIA H100 SXM5 data sheet (80 GB HBM3, 3.35 TB/s), not measured"),
               "A100": (80 * 10**9, 2.0e12, "NVIDIA A100 SXM4 80GB data sheet (2.0 TB/s), not measured")}


def gpu_model(device_name: str) -> GpuModel | None:
    """The :data:`GPU_MODELS` entry of a device name (None for a device none of them matches)."""
    return next((m for m in GPU_MODELS if m.matches(device_name)), None)


def _model(name: str) -> GpuModel:
    return next(m for m in GPU_MODELS if m.model == name)


def _full_rates(profile: Profile, default: Device) -> dict[str, float]:
    """``forward_flops`` and ``backward_flops`` of a device priced by ``profile``: its fastest full-block
    rate of each phase, else ``default``'s."""
    return {f"{phase}_flops": max((p.flop_per_s for p in profile.kernels if p.phase == phase and p.kind == "full"),
                                  default=getattr(default, f"{phase}_flops")) for phase in ("forward", "backward")}


def measured_device(name: str, profile: Profile, default: bool = False) -> Device:
    """The device of GPU preset ``name`` with the kernel rates of the GPU profile ``profile``; its name
    says so (``default``: the preset's own default profile). The launch overhead, block-size curve and
    efficiencies of kinds the profile does not cover stay the preset's. A profile of the preset's GPU
    model also gives its memory and epilogue bandwidth; one of another model of the same die keeps the
    preset's and is labelled (``"..., H200 rates on H100 (same GH100 die; memory bandwidth differs)"``).
    Raises ValueError naming both devices for a CPU profile or one of another die."""
    base = PRESETS[name]["device"]
    own = _model(PRESET_GPUS[name])
    if profile.gpu is None:
        raise ValueError(f"the {name} preset runs {own.model} GPUs; a CPU calibration profile ({profile.cores} cores, "
                         f"{profile.ranks} ranks) cannot price them: give a GPU profile (`cpattn calibrate` on the GPU "
                         "machine, or a shipped one)")
    found = gpu_model(profile.gpu.device)
    if found is None or found.die != own.die:
        theirs = f"the {found.die} die" if found else "an unknown die"
        raise ValueError(f"the {name} preset runs {own.model} GPUs ({own.die} die); the profile measured "
                         f"{profile.gpu.device} ({theirs}): its kernel rates do not carry over")
    label = f"rates: measured {profile.gpu.label()} profile" + (f" (the {name} default)" if default else "")
    same = found.model == own.model
    if not same:
        label += f", {found.model} rates on {own.model} (same {own.die} die; memory bandwidth differs)"
    return replace(base, name=f"{own.product}, {label}", **_full_rates(profile, base),
                   memory_bandwidth=profile.memory_bandwidth if same else base.memory_bandwidth,
                   memory=profile.memory if same else base.memory, table=profile.kernels)


#: dense bf16 matmul peak per device (FLOP/s) of each preset, from the data sheets cited above (MI250X:
#: 383 TFLOP/s per package of 2 GCDs; H100 SXM5 and H200 SXM: 989; A100 SXM4: 312): the peak MFU is taken against
MATMUL_PEAK = {"frontier": 191.5e12, "dgx-h100": 989e12, "dgx-h200": 989e12, "dgx-a100": 312e12}

#: fraction of MATMUL_PEAK the dense layers reach, per preset. frontier: measured bf16 matmul maxima on
#: one MI250X GCD, S. Bekman, "Machine Learning Engineering Open Book", compute/accelerator/README.md,
#: "Maximum Achievable Matmul FLOPS" table: 147.0 TFLOP/s (76.7% of 191.5; ROCm 6.2, best of a shape
#: search), and 127 TFLOP/s reported on another MI250X GCD in stas00/ml-engineering issue #76 (2024);
#: we take the lower, 127 / 191.5 = 0.66 (range 0.66-0.77; a search maximum bounds real layer shapes
#: from above). dgx-h100, dgx-h200, dgx-a100: assumed 0.7 (the same table measures 80% and 87%).
MATMUL_EFFICIENCY = {"frontier": 127.0 / 191.5, "dgx-h100": 0.7, "dgx-h200": 0.7, "dgx-a100": 0.7}
#: the assumption for devices with no figure above (``local``, generic NxD topologies)
DEFAULT_MATMUL_EFFICIENCY = 0.7


def _nodes(name: str, world: int, per_node: int) -> tuple[int, int]:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if world <= per_node:
        return 1, world
    if world % per_node:
        raise ValueError(f"the {name} preset has {per_node} devices per node: world={world} must be at most "
                         f"{per_node} or a multiple of it")
    return world // per_node, per_node


#: the collective algorithms ``local`` prices gloo's collectives with, and calibration fits its per-op
#: links to: all_reduce as a ring (gloo runs a ring), broadcast and reduce as trees. gloo's broadcast is
#: a binomial tree forwarding whole messages (ceil(log2 P) steps of N), its reduce a ring reduce-scatter
#: then a gather to the root; on the 2 ranks calibration measures, their ring and tree formulas agree.
LOCAL_ALGORITHM = "all_reduce:ring;broadcast:tree;reduce:tree"


def this_machine(world: int, who: str) -> Topology:
    """This machine as one node of ``world`` ranks: its calibration profile's figures (the ``local``
    preset), or conservative defaults, with a warning naming ``who`` when the profile cannot be read."""
    try:
        return preset("local", world)
    except ProfileError as exc:
        log.warning("%s: ignoring the calibration profile (%s); using conservative defaults", who, exc)
        return local(world)


def local(world: int, profile: Profile | None = None, threads_per_rank: int | None = None,
          cores: int | None = None, nodes: int = 1) -> Topology:
    """``world`` ranks on this machine, from ``profile`` (or the conservative defaults without one).
    ``nodes`` > 1 emulates that many nodes of ``world // nodes`` ranks each (as gloo runs do): the
    same machine's figures, its loopback link standing in for both the intra- and inter-node links.
    Collectives run :data:`LOCAL_ALGORITHM`, the algorithms calibration fits its links with. The ranks
    share ``cores`` (``Topology.cores``): a step in which some ranks idle runs the others faster.

    Measured kernel rates are rescaled to the cores each rank gets: ``min(threads_per_rank, cores /
    world)`` against the same figure at calibration time (ranks share the cores; oversubscribed ranks
    run proportionally slower). ``threads_per_rank`` defaults to ``cores // world`` (at least 1), as
    ``cpattn bench`` uses. A GPU profile (``cpattn calibrate`` on a GPU) gives every rank a device of its
    own at the measured rates, with generic links (:func:`_local_gpus`).
    """
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if not isinstance(nodes, int) or nodes < 1 or world % nodes:
        raise ValueError(f"nodes must be a positive int dividing world={world}, got {nodes!r}")
    shape = {"nodes": nodes, "devices_per_node": world // nodes}
    where = "" if nodes == 1 else f" {nodes}x{world // nodes}"
    if profile is None:
        return Topology(**shape, intra=LOCAL_DEFAULT_LINK, inter=LOCAL_DEFAULT_LINK,
                        device=LOCAL_DEFAULT_DEVICE, overlap=0.0, algorithm=LOCAL_ALGORITHM,
                        name=f"local{where} (uncalibrated)")
    if profile.gpu is not None:
        return _local_gpus(shape, where, profile)
    cores = cores or profile.cores
    threads = threads_per_rank or max(1, cores // world)
    share_now = min(float(threads), cores / world)
    share_then = min(float(profile.threads_per_rank), profile.cores / profile.ranks)
    device = Device("local CPU (calibrated)", **_full_rates(profile, LOCAL_DEFAULT_DEVICE),
                    memory_bandwidth=profile.memory_bandwidth, memory=profile.memory // world, launch=0.0,
                    table=profile.kernels).scaled(share_now / share_then)
    intra = profile.links["sendrecv"]
    return Topology(**shape, intra=intra, inter=intra, device=device, overlap=profile.overlap,
                    op_links=tuple(sorted(profile.links.items())), algorithm=LOCAL_ALGORITHM, cores=float(cores),
                    threads_per_rank=threads, name=f"local{where}")


def _local_gpus(shape: dict, where: str, profile: Profile) -> Topology:
    """``local`` on a GPU machine from a GPU profile (one device measured alone): each rank has its own
    device at the measured kernel rates, memory and epilogue bandwidth; the links were not measured, so
    they are the generic PCIe-class figures (:data:`~cpattn.core.topology.GENERIC_INTRA`), and transfers
    hide behind compute (their own streams)."""
    gpu = DGX_H100_DEVICE  # the GPU presets' launch overhead and block-size curve (assumptions)
    device = Device(f"{profile.gpu.device}, rates: measured {profile.gpu.label()} profile",
                    **_full_rates(profile, GENERIC_DEVICE), memory_bandwidth=profile.memory_bandwidth,
                    memory=profile.memory, half_tokens=gpu.half_tokens, launch=gpu.launch, table=profile.kernels)
    return Topology(**shape, intra=GENERIC_INTRA, inter=GENERIC_INTRA, device=device, overlap=1.0,
                    name=f"local{where} (GPU rates measured, links not)")


def preset_key(name: str) -> str:
    """The :data:`NAMES` entry ``name`` spells (case and ``_``/``-`` aside); ValueError naming the accepted ones."""
    key = name.lower().replace("_", "-") if isinstance(name, str) else name
    if key not in NAMES:
        raise ValueError(f"topology preset {name!r} is unknown; accepted: {', '.join(NAMES)}")
    return key


def on_shape(name: str, nodes: int, devices_per_node: int) -> Topology:
    """GPU preset ``name``'s figures (links, NICs, device: :func:`preset`'s) on ``nodes`` x
    ``devices_per_node`` ranks, e.g. the shape found where the ranks run: each device keeps the preset's
    share of the node's NICs (at least one NIC per node)."""
    key = preset_key(name)
    if key == "local":
        raise ValueError("on_shape takes a GPU preset; the local machine's topology is local(world, nodes=...)")
    spec = PRESETS[key]
    full = preset(key, spec["devices_per_node"])
    nics = max(1, spec["nics_per_node"] * devices_per_node // spec["devices_per_node"])
    return replace(full, nodes=nodes, devices_per_node=devices_per_node, nics_per_node=nics)


def preset(name: str, world: int, profile: Profile | None = None, algorithm: str | None = None) -> Topology:
    """The topology of ``world`` devices of preset ``name`` (see :data:`NAMES`). ``local`` uses
    ``profile``, else the profile at the default location, else conservative defaults. A GPU preset
    takes its attention rates from the GPU ``profile`` when given (:func:`measured_device`: a CPU
    profile or one of another die raises ValueError), else from :data:`DEFAULT_PROFILES` (``dgx-h200``),
    else from its data-sheet / paper figures; its device's name says which.
    ``algorithm``: the collective algorithms (``Topology.algorithm``; default ``"auto"``, and for
    ``local`` the algorithms its calibration fitted)."""
    key = preset_key(name)
    if key == "local":
        topo = local(world, profile if profile is not None else load_default(), cores=os.cpu_count() or 1)
        return topo if algorithm is None else replace(topo, algorithm=algorithm)
    spec = PRESETS[key]
    nodes, per_node = _nodes(key, world, spec["devices_per_node"])
    device = spec["device"]
    if profile is not None:
        device = measured_device(key, profile)
    elif key in DEFAULT_PROFILES:
        device = measured_device(key, shipped(DEFAULT_PROFILES[key]), default=True)
    return Topology(nodes, per_node, **{k: v for k, v in spec.items() if k not in ("devices_per_node", "device")},
                    device=device, algorithm=algorithm or "auto", name=key)


__all__ = ["ASSUMED_RATES", "DATA_SHEETS", "DEFAULT_MATMUL_EFFICIENCY", "DEFAULT_PROFILES", "DGX_A100", "DGX_H100",
           "DGX_H200", "FRONTIER", "FRONTIER_ATTENTION_EFFICIENCY", "GPU_MODELS", "LOCAL_DEFAULT_DEVICE",
           "MATMUL_EFFICIENCY", "MATMUL_PEAK", "NAMES", "PRESETS", "PRESET_GPUS", "GpuModel", "gpu_model", "local",
           "measured_device", "on_shape", "preset", "preset_key", "this_machine"]
