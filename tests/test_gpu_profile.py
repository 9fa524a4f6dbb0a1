"""GPU profiles: the format, the shipped H200 profiles and their derivation from a gpu_check report, the GPU
calibration (run on the CPU with a stand-in timer), GPU presets priced by a profile, packed documents and
``cpattn simulate --tflops``."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cpattn import cli
from cpattn.core import kernels
from cpattn.core.masks import BlockKind
from cpattn.core.steps import Problem
from cpattn.core.topology import Link, RatePoint
from cpattn.cost import documents, estimate, presets, profile
from cpattn.lab import machine_profile
from cpattn.timed_calls import square_kernel

ROOT = Path(__file__).resolve().parents[1]
#: the env and bench sections of scripts/gpu_check.py's report on one H200 (2026-12-04)
REPORT = Path(__file__).resolve().parent / "data" / "gpu_check_h200_2026-12-04.json"
CUDNN = "h200-2026-12-04-cudnn"


def _derived(path: str = "cudnn_cuda") -> profile.Profile:
    memory, bandwidth, source = presets.DATA_SHEETS["H200"]
    return profile.from_gpu_check(json.loads(REPORT.read_text()), path, measured="2026-12-04", memory=memory,
                                  memory_bandwidth=bandwidth, figures_source=source)


# ------------------------------------------------------------------ the format and the shipped profiles
def test_shipped_profiles_load_validate_and_are_installed():
    for name in profile.SHIPPED:
        prof = profile.shipped(name)
        assert prof.gpu.device == "NVIDIA H200" and prof.gpu.capability == (9, 0) and prof.ranks == 1
        assert prof.gpu.measured_tokens == (8192, 16384, 32768, 65536) and not prof.links
        assert "Extrapolated" in prof.gpu.note and profile.from_json(prof.to_json()) == prof
    assert profile.shipped(CUDNN).gpu.paths == {"full": "cudnn_cuda", "causal": "cudnn_cuda"}
    assert profile.shipped("h200-2026-12-04-flash").gpu.label() == "NVIDIA H200 flash_cuda 2026-12-04"
    shipped = {p.stem for p in (ROOT / "cpattn" / "cost" / "profiles").glob("*.json")}
    assert shipped == set(profile.SHIPPED)
    pyproject = (ROOT / "pyproject.toml").read_text()  # installed with the package, not only in the tree:
    assert re.search(r'\[tool\.setuptools\.package-data\][^\[]*"cpattn\.cost" = \["profiles/\*\.json"\]', pyproject)


def test_the_shipped_profile_is_the_report_derived_again():
    assert _derived() == profile.shipped(CUDNN)
    row = next(r for r in json.loads(REPORT.read_text())["bench"] if r["s"] == 8192 and r["kind"] == "full")
    rate = {(p.phase, p.kind, p.q_len): p.flop_per_s for p in _derived().kernels}
    assert rate["forward", "full", 8192] == pytest.approx(row["flops_fwd"] / (row["cudnn_cuda_fwd_ms"] / 1e3))
    bwd_s = (row["cudnn_cuda_fwd_bwd_ms"] - row["cudnn_cuda_fwd_ms"]) / 1e3
    assert rate["backward", "full", 8192] == pytest.approx(2.5 * row["flops_fwd"] / bwd_s)
    # below the smallest measured block: the analytic curve through it, slower as blocks shrink
    assert rate["forward", "full", 4096] < rate["forward", "full", 8192]
    assert rate["forward", "full", 1024] == pytest.approx(
        rate["forward", "full", 8192] * ((1024 / 1152) / (8192 / 8320)) ** 2)
    with pytest.raises(profile.ProfileError, match="no bench row has flash_attn_fwd_ms; the report timed .*cudnn"):
        _derived("flash_attn")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["gpu"].update(capability=[9]), r"gpu\.capability must be \[major, minor\]"),
    (lambda d: d["gpu"]["paths"].update(full="fast_cuda"), r"gpu\.paths\.full: kind/path"),
    (lambda d: d["gpu"]["paths"].pop("causal"), r"gpu\.paths names no kernel path for the causal"),
    (lambda d: d["gpu"].update(measured="4 Dec 2026"), r"gpu\.measured must be a date"),
    (lambda d: d["gpu"]["measured_tokens"].append(12345), r"gpu\.measured_tokens\[4\]: no kernel point"),
    (lambda d: d["gpu"].pop("note"), r"gpu is missing note"),
    (lambda d: d.update(ranks=2), r"ranks must be 1 in a GPU profile"),
    (lambda d: d["kernels"][3].update(flop_per_s=-1.0), r"kernels\[3\]\.flop_per_s must be > 0"),
    (lambda d: d.pop("memory"), r"missing memory"),
])
def test_a_corrupted_gpu_profile_is_refused_naming_the_field(tmp_path, edit, message):
    data = profile.shipped(CUDNN).to_json()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(profile.ProfileError, match=message) as info:
        profile.load(path)
    assert str(path) in str(info.value)


def test_cpu_profiles_of_version_1_load_unchanged(tmp_path):
    """A profile as ``cpattn calibrate`` wrote it before GPU profiles existed: no gpu section."""
    data = {"schema": "cpattn-profile", "version": 1,
            "kernels": [{"phase": "forward", "kind": "full", "q_len": 256, "kv_len": 256, "flop_per_s": 2e10}],
            "links": {"sendrecv": {"latency": 5e-5, "bandwidth": 2e9}}, "memory_bandwidth": 8e9, "overlap": 0.4,
            "cores": 2, "ranks": 2, "threads_per_rank": 1, "memory": 2**34, "host": {"torch": "2.5"}}
    (tmp_path / "p.json").write_text(json.dumps(data))
    prof = profile.load(tmp_path / "p.json")
    assert prof.gpu is None and prof.links == {"sendrecv": Link(5e-5, 2e9)} and prof.to_json() == data
    del data["links"]
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(profile.ProfileError, match="missing links"):  # a CPU profile still needs its links
        profile.load(tmp_path / "p.json")


# ------------------------------------------------------------------ calibration on a GPU (CPU stand-in)
def test_gpu_calibration_runs_its_cuda_branch_with_a_stand_in_timer(tmp_path):
    """The branch ``cpattn calibrate`` takes on a CUDA machine, on CPU tensors with a timer that runs each
    call once and answers fixed times: the rates are FLOPs over those times."""
    ran = []

    def timer(call, warmup, repeats):
        call()  # the real kernels and merge run, once each
        ran.append(call)
        return 0.004 if len(ran) % 2 else 0.010  # forward, backward, ...; the merge is the last, odd call

    settings = machine_profile.GpuSettings(sizes=(128, 256), heads=4, kv_heads=2, head_dim=16, merge_rows=64, warmup=0,
                                     repeats=1)
    prof = machine_profile.calibrate_gpu(settings, "cpu", timer)
    assert len(ran) == 2 * 2 * 2 + 1  # forward and backward of two kinds at two sizes, the merge
    problem = Problem(256, 1, "full", 1, 4, 2, 16, "bfloat16")
    measured = {(p.phase, p.kind, p.q_len): p.flop_per_s for p in prof.kernels if p.q_len in (128, 256)}
    for kind in ("full", "causal"):
        for n in (128, 256):
            for phase, seconds in (("forward", 0.004), ("backward", 0.010)):
                assert measured[phase, kind, n] == pytest.approx(square_kernel(kind, n).flops(problem, phase) / seconds)
    assert prof.gpu.measured_tokens == (128, 256) and {p.q_len for p in prof.kernels} > {16, 64, 128, 256}
    probe = torch.empty(1, 1, 4, 16, dtype=torch.bfloat16)  # the paths the dispatch takes on this device
    assert prof.gpu.paths["full"] == kernels.kernel_for(probe, BlockKind.FULL, kv_len=256)
    assert prof.memory_bandwidth > 0 and profile.load(profile.save(prof, tmp_path / "gpu.json")) == prof


# ------------------------------------------------------------------ presets priced by a profile
def test_dgx_h200_takes_its_rates_from_the_measured_profile_and_says_so():
    prof = profile.shipped(CUDNN)
    topo = presets.preset("dgx-h200", 16, prof)
    assert (topo.nodes, topo.devices_per_node) == (2, 8) and topo.device.table == prof.kernels
    assert "rates: measured NVIDIA H200 cudnn_cuda 2026-12-04 profile" in topo.device.name
    assert topo.device.rate("forward", "full", 8192, 8192) == pytest.approx(
        next(p.flop_per_s for p in prof.kernels if (p.phase, p.kind, p.q_len) == ("forward", "full", 8192)))
    assert topo.device.memory_bandwidth == prof.memory_bandwidth and topo.device.memory == prof.memory
    default = presets.preset("dgx-h200", 8)  # without a profile: the shipped one, and it says so
    assert default.device.table == prof.kernels and "(the dgx-h200 default)" in default.device.name
    assert presets.preset("dgx-h100", 8).device.name.endswith("rates: data sheet / paper assumption")
    flash = presets.preset("dgx-h200", 8, profile.shipped("h200-2026-12-04-flash"))
    problem = Problem(8192 * 8, 8, "causal", 1, 64, 8, 128, "bfloat16")
    assert estimate("zigzag_ring", problem, flash).total > estimate("zigzag_ring", problem, default).total


def test_another_gpu_of_the_same_die_is_labelled_and_other_devices_are_refused():
    h100 = presets.preset("dgx-h100", 8, profile.shipped(CUDNN))
    assert "H200 rates on H100 (same GH100 die; memory bandwidth differs)" in h100.device.name
    assert h100.device.memory_bandwidth == presets.DGX_H100_DEVICE.memory_bandwidth  # the H100's own
    with pytest.raises(ValueError, match=r"dgx-h200 preset runs H200 GPUs; a CPU calibration profile"):
        presets.preset("dgx-h200", 16, profile.from_json(_cpu_profile()))
    a100 = replace(profile.shipped(CUDNN), gpu=replace(profile.shipped(CUDNN).gpu, device="NVIDIA A100-SXM4-80GB"))
    with pytest.raises(ValueError, match=r"runs H200 GPUs \(GH100 die\); the profile measured NVIDIA A100-SXM4-80GB "
                                         r"\(the GA100 die\)"):
        presets.preset("dgx-h200", 8, a100)


def _cpu_profile() -> dict:
    return {"schema": "cpattn-profile", "version": 1,
            "kernels": [{"phase": "forward", "kind": "full", "q_len": 256, "kv_len": 256, "flop_per_s": 2e10}],
            "links": {"sendrecv": {"latency": 5e-5, "bandwidth": 2e9}}, "memory_bandwidth": 8e9, "overlap": 0.4,
            "cores": 2, "ranks": 2, "threads_per_rank": 1, "memory": 2**34}


def test_local_on_a_gpu_machine_uses_the_gpu_profile():
    topo = presets.local(4, profile.shipped(CUDNN))
    assert topo.cores == 0 and topo.device.table == profile.shipped(CUDNN).kernels and "measured" in topo.name
    assert estimate("ring", Problem(4 * 8192, 4, "causal", 1, 32, 8, 128, "bfloat16"), topo).total > 0


# ------------------------------------------------------------------ packed documents
def test_documents_pack_to_the_length_deterministically_and_chunk_long_ones():
    lengths = documents.pack("magiattention", 65536, seed=3)
    assert sum(lengths) == 65536 and lengths == documents.pack("magiattention", 65536, seed=3)
    assert max(lengths) <= 65536 // 4 and lengths != documents.pack("magiattention", 65536, seed=4)
    sizes, counts = documents.pieces(documents.MAGIATTENTION, 65536)
    assert sizes.max() == 16384 and counts.sum() > sum(n for _, _, n in documents.MAGIATTENTION.bins)


# ------------------------------------------------------------------ cpattn simulate --tflops
def test_simulate_prints_tflops_per_gpu_with_the_measured_h200_rates(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    assert cli.main(["simulate", "--topology", "dgx-h200", "--profile", CUDNN, "--gpus", "8", "--seq-per-gpu", "8192",
                     "--mask", "causal", "--heads", "64", "--kv-heads", "8", "--head-dim", "128", "--tflops",
                     "--schedules", "ring,zigzag_ring,ringx3b", "--plot", str(tmp_path / "t.png"),
                     "--json", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 160
    cells = {m.group(1): (int(m.group(2)), int(m.group(3)))
             for m in re.finditer(r"│ (\w+)\s+│\s+(\d+) / (\d+) │", out)}
    assert set(cells) == {"ring", "zigzag_ring"} and cells["zigzag_ring"][0] > cells["ring"][0]
    assert "device: H200 SXM, rates: measured NVIDIA H200 cudnn_cuda 2026-12-04 profile" in " ".join(out.split())
    assert "cannot run the causal mask: ringx3b" in out and (tmp_path / "t.png").stat().st_size > 0
    rows = json.loads((tmp_path / "t.json").read_text())
    assert {r["schedule"] for r in rows} == {"ring", "zigzag_ring"} and all(r["forward"] and r["backward"]
                                                                             for r in rows)
    assert cli.main(["simulate", "--topology", "dgx-h200", "--gpus", "8", "--seq-per-gpu", "8192", "--mask", "causal",
                     "--documents", "magiattention", "--tflops", "--schedules", "allgather,ulysses", "--plot", ""]) == 0
    out = capsys.readouterr().out
    assert "magiattention documents (seed 0), causal" in out and re.search(r"│ ulysses\s+│\s+\d+ / \d+ │", out)


def test_simulate_refuses_a_profile_the_preset_cannot_take(tmp_path, capsys):
    (tmp_path / "cpu.json").write_text(json.dumps(_cpu_profile()))
    assert cli.main(["simulate", "--topology", "dgx-h200", "--profile", str(tmp_path / "cpu.json"), "--gpus", "8",
                     "--seq", "65536", "--plot", ""]) != 0
    assert "a CPU calibration profile" in capsys.readouterr().err


def test_calibrate_derives_the_shipped_profile_from_the_report(tmp_path, capsys):
    out = tmp_path / "h200.json"
    assert cli.main(["calibrate", "--from-gpu-check", str(REPORT), "--date", "2026-12-04", "--profile", str(out)]) == 0
    assert profile.load(out) == profile.shipped(CUDNN)  # the dispatch's path on sm90 bf16: cuDNN
    printed = capsys.readouterr().out
    assert "NVIDIA H200 (compute capability 9.0)" in printed and "extrapolated" in printed


def test_rate_points_below_the_smallest_follow_the_curve():
    pts = (RatePoint("forward", "causal", 8192, 8192, 4e14), RatePoint("forward", "causal", 16384, 16384, 5e14))
    low = profile.extrapolate_below(pts, (1024, 8192, 9000), half_tokens=128.0)
    assert [p.q_len for p in low] == [1024] and low[0].flop_per_s == pytest.approx(
        4e14 * ((1024 / 1152) / (8192 / 8320)) ** 2)
