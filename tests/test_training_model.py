"""The training-step model (cpattn.cost.training): its parts add up as documented."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cpattn import cli, cost
from cpattn.core.steps import CommOp
from cpattn.core.topology import Link, Topology
from cpattn.cost import collectives, presets
from cpattn.cost.presets import MATMUL_EFFICIENCY, MATMUL_PEAK, preset
from cpattn.cost.training import BACKWARD_SHARE, DecoderShape, dp_group, step_estimate
from cpattn.models import flops
from cpattn.models.llama import LLAMA_CONFIGS

CONF = LLAMA_CONFIGS["llama3-8b"]
SHAPE = DecoderShape(CONF.layers, CONF.heads, CONF.kv_heads, CONF.head_dim, flops.matmul_param_count(CONF),
                     flops.param_count(CONF))


def _estimate(cp=16, dp=4, seq=1 << 17, schedule="zigzag_ring", eff=0.7, dp_topology=None):
    return step_estimate(SHAPE, seq, cp, dp, "causal", schedule, preset("frontier", cp), MATMUL_PEAK["frontier"],
                         eff, dp_topology)


def test_the_parts_add_up():
    seq, cp, dp = 1 << 17, 16, 4
    e = _estimate(cp=cp, dp=dp, seq=seq)
    peak = MATMUL_PEAK["frontier"]
    assert e.dense == pytest.approx(6 * SHAPE.matmul_params * (seq // cp) / (peak * 0.7))
    problem = cost.Problem(seq, cp, "causal", 1, CONF.heads, CONF.kv_heads, CONF.head_dim)
    attention = CONF.layers * cost.estimate("zigzag_ring", problem, preset("frontier", cp)).total
    assert e.attention == pytest.approx(attention)
    assert e.grad_sync_exposed == pytest.approx(max(0.0, e.grad_sync - BACKWARD_SHARE * (e.dense + e.attention)))
    assert e.step == pytest.approx(e.dense + e.attention + e.grad_sync_exposed)
    per_token = flops.llama_flops_per_token(CONF, seq)  # the models' own accounting, causal pairs
    assert e.model_flops_per_device == pytest.approx(per_token * seq // cp)
    assert e.mfu == pytest.approx(e.model_flops_per_device / (e.step * peak))
    assert e.tokens_per_s == pytest.approx(seq * dp / e.step)


def test_gradient_sync_only_with_data_parallelism_and_exposed_when_links_are_slow():
    assert _estimate(dp=1).grad_sync == 0
    slow_world = replace(preset("frontier", 16 * 64), inter=Link(10e-6, 1e6))
    slow = _estimate(dp=64, dp_topology=dp_group(slow_world, 16))
    assert slow.grad_sync_exposed > 0 and slow.step > _estimate(dp=64).step


def test_gradient_sync_is_the_cost_models_all_reduce_on_the_dp_group():
    cp, dp = 16, 4
    world = preset("frontier", cp * dp)
    group = dp_group(world, cp)
    # one device per node (the replica fills 2 nodes); the node's 4 NICs shared by its 8 groups
    assert (group.nodes, group.devices_per_node, group.nics_per_node) == (dp, 1, 1)
    assert group.inter == Link(world.inter.latency, world.inter.bandwidth * world.nics_per_node / 8)
    e = _estimate(cp=cp, dp=dp, dp_topology=group)
    assert e.grad_sync == pytest.approx(collectives.op_time(CommOp("all_reduce", SHAPE.params * 2), group))
    assert _estimate(cp=cp, dp=dp).grad_sync == pytest.approx(e.grad_sync)  # the default: the same placement
    # the ring's own formula, 2 (g - 1) (alpha + N / (g B)), where the topology asks for the ring
    ring = replace(group, algorithm="ring")
    n, b = SHAPE.params * 2, group.inter.bandwidth
    assert _estimate(cp=cp, dp=dp, dp_topology=ring).grad_sync == pytest.approx(
        2 * (dp - 1) * (group.inter.latency + n / dp / b))


def test_dp_groups_smaller_than_a_node_share_it():
    world = preset("frontier", 32)  # 4 nodes; cp 4: replicas 0, 1 on node 0, ...
    group = dp_group(world, 4)
    assert (group.nodes, group.devices_per_node) == (4, 2)  # ranks r, r + 4 on one node, 4 nodes
    assert group.inter.bandwidth == pytest.approx(world.inter.bandwidth * world.nics_per_node / 4)
    one_node = dp_group(preset("frontier", 8), 4)
    assert (one_node.nodes, one_node.devices_per_node) == (1, 2)
    with pytest.raises(ValueError, match="dividing the world"):
        dp_group(Topology(2, 8), 3)
    with pytest.raises(ValueError, match="devices per node"):
        dp_group(preset("frontier", 96), 12)


def test_frontier_attention_rate_is_the_cited_fraction_of_the_peak():
    fwd, bwd = presets.FRONTIER_ATTENTION_EFFICIENCY
    assert 0 < bwd < fwd < 1
    assert (fwd, bwd) == (0.45, 0.32)  # presets.py: FlashAttention-2 (CK) at 8,192 tokens, 86.72 / 61.07 TFLOP/s
    assert presets.FRONTIER_DEVICE.forward_flops == pytest.approx(fwd * MATMUL_PEAK["frontier"])
    assert presets.FRONTIER_DEVICE.backward_flops == pytest.approx(bwd * MATMUL_PEAK["frontier"])
    assert preset("frontier", 8).device is presets.FRONTIER_DEVICE


def test_every_preset_has_a_peak_and_a_matmul_efficiency():
    assert set(MATMUL_PEAK) == set(MATMUL_EFFICIENCY) == set(presets.PRESETS)
    assert all(p > 0 for p in MATMUL_PEAK.values())
    assert all(0 < e <= 1 for e in (*MATMUL_EFFICIENCY.values(), presets.DEFAULT_MATMUL_EFFICIENCY))
    assert MATMUL_EFFICIENCY["frontier"] == pytest.approx(127.0 / 191.5)  # the lower measured MI250X GCD matmul


def test_simulate_model_mode_uses_the_presets_matmul_efficiency(tmp_path, capsys):
    out = tmp_path / "m.json"
    base = ["simulate", "--model", "llama3-8b", "--topology", "frontier", "--cp", "16", "--dp", "4", "--seq", "131072",
            "--schedules", "zigzag_ring", "--json", str(out)]
    assert cli.main(base) == 0
    (row,) = json.loads(out.read_text())
    assert "dense layers at 66%" in " ".join(capsys.readouterr().out.split())
    expect = _estimate(cp=16, dp=4, eff=MATMUL_EFFICIENCY["frontier"], dp_topology=dp_group(preset("frontier", 64), 16))
    assert row["dense"] == pytest.approx(expect.dense) and row["grad_sync"] == pytest.approx(expect.grad_sync)
    assert cli.main([*base, "--matmul-efficiency", "0.5"]) == 0
    (row,) = json.loads(out.read_text())
    assert row["dense"] == pytest.approx(_estimate(cp=16, dp=4, eff=0.5).dense)
    assert cli.main([*base, "--algorithm", "tree"]) == 0  # the collective algorithms reach the gradient sync
    (row,) = json.loads(out.read_text())
    tree = dp_group(preset("frontier", 64, algorithm="tree"), 16)
    assert row["grad_sync"] == pytest.approx(_estimate(cp=16, dp=4, dp_topology=tree).grad_sync)
    assert row["grad_sync"] != pytest.approx(expect.grad_sync)


def test_bad_inputs():
    with pytest.raises(ValueError, match="matmul_efficiency"):
        _estimate(eff=1.5)
    with pytest.raises(ValueError, match="devices"):
        step_estimate(SHAPE, 1 << 17, 8, 1, "causal", "ring", preset("frontier", 16), 1e14, 0.5)
    with pytest.raises(ValueError, match="dp_topology"):
        step_estimate(SHAPE, 1 << 17, 8, 4, "causal", "ring", preset("frontier", 8), 1e14, 0.5, dp_group(
            preset("frontier", 64), 8))
