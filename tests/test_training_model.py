"""The training-step model (cpattn.cost.training): its parts add up as documented."""

from __future__ import annotations

import pytest

from cpattn import cost
from cpattn.cost.presets import MATMUL_PEAK, preset
from cpattn.cost.training import BACKWARD_SHARE, DecoderShape, step_estimate
from cpattn.models import flops
from cpattn.models.llama import LLAMA_CONFIGS

CONF = LLAMA_CONFIGS["llama3-8b"]
SHAPE = DecoderShape(CONF.layers, CONF.heads, CONF.kv_heads, CONF.head_dim, flops.matmul_param_count(CONF),
                     flops.param_count(CONF))


def _estimate(cp=16, dp=4, seq=1 << 17, schedule="zigzag_ring", eff=0.7, bw=12.5e9, lat=10e-6):
    return step_estimate(SHAPE, seq, cp, dp, "causal", schedule, preset("frontier", cp), MATMUL_PEAK["frontier"],
                         eff, bw, lat)


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
    slow = _estimate(dp=64, bw=1e6)
    assert slow.grad_sync_exposed > 0 and slow.step > _estimate(dp=64).step


def test_bad_inputs():
    with pytest.raises(ValueError, match="matmul_efficiency"):
        _estimate(eff=1.5)
    with pytest.raises(ValueError, match="devices"):
        step_estimate(SHAPE, 1 << 17, 8, 1, "causal", "ring", preset("frontier", 16), 1e14, 0.5, 1e9, 1e-5)
