"""Topology presets with published figures (each with its source), and ``local`` from calibration.

``preset(name, world)`` returns the :class:`Topology` of ``world`` devices of that machine: whole nodes
(``world`` a multiple of the devices per node), or one partly used node for smaller worlds.

Figures that no vendor publishes (attention-kernel efficiency, collective-library latency per step)
are stated as assumptions next to the figure they support.
"""

from __future__ import annotations

import os
from dataclasses import replace

from ..core.topology import Device, Link, Topology
from .profile import Profile, load_default

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
FRONTIER_DEVICE = Device("MI250X GCD", forward_flops=FRONTIER_ATTENTION_EFFICIENCY[0] * 191.5e12,
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
DGX_H100_DEVICE = Device("H100 SXM5", forward_flops=450e12, backward_flops=350e12, memory_bandwidth=3.35e12,
                         memory=80 * 10**9, half_tokens=128.0, launch=5e-6)
DGX_H100 = dict(devices_per_node=8, intra=Link(3e-6, 450e9), inter=Link(6e-6, 50e9), nics_per_node=8,
                device=DGX_H100_DEVICE)

# --- NVIDIA DGX A100: 8 A100 SXM4 80 GB; NVLink 3 (600 GB/s bidirectional per GPU = 300 per direction);
# 8 ConnectX-6 200 Gb/s HDR (25 GB/s) compute NICs, one per GPU. Sources: NVIDIA DGX A100 data sheet;
# A100 data sheet: 312 TFLOP/s dense bf16, 2.0 TB/s HBM2e (80 GB). FlashAttention-2 (Dao, 2023): 50-73%
# of peak forward on A100, up to about 225 TFLOP/s; we take 200 forward, 160 backward.
DGX_A100_DEVICE = Device("A100 SXM4", forward_flops=200e12, backward_flops=160e12, memory_bandwidth=2.0e12,
                         memory=80 * 10**9, half_tokens=128.0, launch=5e-6)
DGX_A100 = dict(devices_per_node=8, intra=Link(3e-6, 300e9), inter=Link(6e-6, 25e9), nics_per_node=8,
                device=DGX_A100_DEVICE)

# --- local without a calibration profile: deliberately pessimistic CPU figures (a few GFLOP/s per
# rank, 1 GB/s and 100 us per message over loopback, no overlap, 8 GiB per rank), so that an
# uncalibrated choice prefers little communication and little memory.
LOCAL_DEFAULT_DEVICE = Device("local CPU (uncalibrated)", forward_flops=20e9, backward_flops=10e9,
                              memory_bandwidth=5e9, memory=8 * 2**30, half_tokens=256.0, causal_efficiency=0.6,
                              partial_efficiency=0.1, launch=50e-6)
LOCAL_DEFAULT_LINK = Link(100e-6, 1e9)

PRESETS = {"frontier": FRONTIER, "dgx-h100": DGX_H100, "dgx-a100": DGX_A100}
NAMES = (*PRESETS, "local")


#: dense bf16 matmul peak per device (FLOP/s) of each preset, from the data sheets cited above (MI250X:
#: 383 TFLOP/s per package of 2 GCDs; H100 SXM5: 989; A100 SXM4: 312): the peak MFU is taken against
MATMUL_PEAK = {"frontier": 191.5e12, "dgx-h100": 989e12, "dgx-a100": 312e12}

#: fraction of MATMUL_PEAK the dense layers reach, per preset. frontier: measured bf16 matmul maxima on
#: one MI250X GCD, S. Bekman, "Machine Learning Engineering Open Book", compute/accelerator/README.md,
#: "Maximum Achievable Matmul FLOPS" table: 147.0 TFLOP/s (76.7% of 191.5; ROCm 6.2, best of a shape
#: search), and 127 TFLOP/s reported on another MI250X GCD in stas00/ml-engineering issue #76 (2024);
#: we take the lower, 127 / 191.5 = 0.66 (range 0.66-0.77; a search maximum bounds real layer shapes
#: from above). dgx-h100, dgx-a100: assumed 0.7 (the same table measures 80% and 87%).
MATMUL_EFFICIENCY = {"frontier": 127.0 / 191.5, "dgx-h100": 0.7, "dgx-a100": 0.7}
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
    ``cpattn bench`` uses.
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
    cores = cores or profile.cores
    threads = threads_per_rank or max(1, cores // world)
    share_now = min(float(threads), cores / world)
    share_then = min(float(profile.threads_per_rank), profile.cores / profile.ranks)
    fwd = [p.flop_per_s for p in profile.kernels if p.phase == "forward" and p.kind == "full"]
    bwd = [p.flop_per_s for p in profile.kernels if p.phase == "backward" and p.kind == "full"]
    device = Device("local CPU (calibrated)", forward_flops=max(fwd, default=LOCAL_DEFAULT_DEVICE.forward_flops),
                    backward_flops=max(bwd, default=LOCAL_DEFAULT_DEVICE.backward_flops),
                    memory_bandwidth=profile.memory_bandwidth, memory=profile.memory // world, launch=0.0,
                    table=profile.kernels).scaled(share_now / share_then)
    intra = profile.links["sendrecv"]
    return Topology(**shape, intra=intra, inter=intra, device=device, overlap=profile.overlap,
                    op_links=tuple(sorted(profile.links.items())), algorithm=LOCAL_ALGORITHM, cores=float(cores),
                    threads_per_rank=threads, name=f"local{where}")


def preset(name: str, world: int, profile: Profile | None = None, algorithm: str | None = None) -> Topology:
    """The topology of ``world`` devices of preset ``name`` (see :data:`NAMES`). ``local`` uses
    ``profile``, else the profile at the default location, else conservative defaults.
    ``algorithm``: the collective algorithms (``Topology.algorithm``; default ``"auto"``, and for
    ``local`` the algorithms its calibration fitted)."""
    key = name.lower().replace("_", "-")
    if key == "local":
        topo = local(world, profile if profile is not None else load_default(), cores=os.cpu_count() or 1)
        return topo if algorithm is None else replace(topo, algorithm=algorithm)
    if key not in PRESETS:
        raise ValueError(f"topology preset {name!r} is unknown; accepted: {', '.join(NAMES)}")
    spec = PRESETS[key]
    nodes, per_node = _nodes(key, world, spec["devices_per_node"])
    return Topology(nodes, per_node, **{k: v for k, v in spec.items() if k != "devices_per_node"},
                    algorithm=algorithm or "auto", name=key)


__all__ = ["DEFAULT_MATMUL_EFFICIENCY", "DGX_A100", "DGX_H100", "FRONTIER", "FRONTIER_ATTENTION_EFFICIENCY",
           "LOCAL_DEFAULT_DEVICE", "MATMUL_EFFICIENCY", "MATMUL_PEAK", "NAMES", "PRESETS", "local", "preset"]
