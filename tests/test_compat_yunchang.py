"""The yunchang stand-in (``cpattn.compat.yunchang``): yunchang 0.6.4's names and signatures, its rank sets, and
``LongContextAttention`` / ``UlyssesAttention`` exact against float64, forward and backward, for every
``ring_impl_type`` and degree pair."""

from __future__ import annotations

import inspect

import pytest
import torch
from test_compat_ring_flash_attn import _allowed, _relative

import cpattn.compat

#: yunchang 0.6.4's public callables and their parameters (read from its source)
SIGNATURES = {
    "set_seq_parallel_pg": "sp_ulysses_degree, sp_ring_degree, rank, world_size, use_ulysses_low=True",
    "LongContextAttention.__init__": "self, scatter_idx=2, gather_idx=1, ring_impl_type='basic', use_pack_qkv=False, "
                                     "use_sync=False, attn_type=<AttnType.FA: 'fa'>, attn_processor=None, "
                                     "schedule=None",
    "LongContextAttention.forward": "self, query, key, value, dropout_p=0.0, softmax_scale=None, causal=False, "
                                    "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, "
                                    "return_attn_probs=False, *args",
    "UlyssesAttention.__init__": "self, sequence_process_group=None, scatter_idx=2, gather_idx=1, use_sync=False, "
                                 "attn_type=<AttnType.FA: 'fa'>, schedule=None",
    "UlyssesAttention.forward": "self, query, key, value, dropout_p=0.0, softmax_scale=None, causal=False, "
                                "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, "
                                "return_attn_probs=False, *args",
    "basic_extract_local": "value, rank, world_size, *args, **kwargs",
    "zigzag_extract_local": "value, rank, world_size, rd, ud, dim=1, *args, **kwargs",
    "stripe_extract_local": "value, rank, world_size, rd, ud, *args, **kwargs",
}


def _signature_text(func) -> str:
    parts = []
    for p in inspect.signature(func).parameters.values():
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        parts.append(prefix + p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(parts)


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_public_names_have_yunchangs_signatures(name):
    cpattn.compat.install("yunchang")
    import yunchang

    obj = yunchang
    for part in name.split("."):
        obj = getattr(obj, part)
    assert _signature_text(obj) == SIGNATURES[name]


def test_install_resolves_yunchangs_modules():
    cpattn.compat.install("yunchang")
    import yunchang
    from yunchang.globals import PROCESS_GROUP
    from yunchang.kernels import AttnType

    assert yunchang.__name__ == "cpattn.compat.yunchang"
    assert AttnType.from_string("fa") is AttnType.FA and AttnType("torch_math").name == "TORCH_MATH"
    with pytest.raises(ValueError):
        AttnType.from_string("nope")
    assert hasattr(PROCESS_GROUP, "ULYSSES_PG") and hasattr(PROCESS_GROUP, "RING_PG")
    assert sorted(yunchang.EXTRACT_FUNC_DICT) == ["basic", "basic_flashinfer", "basic_npu", "basic_pytorch", "strip",
                                                  "zigzag"]


def test_unsupported_arguments_are_refused():
    from cpattn.compat.yunchang import _layer

    with pytest.raises(NotImplementedError, match="scatter_idx"):
        _layer._check_indices(1, 2, (2, 1))
    with pytest.raises(NotImplementedError, match="attn_processor"):
        _layer._check_attn_type(_layer.AttnType.FA, torch.nn.Identity())


# ------------------------------------------------------------------ exactness against float64
def _reference(q, k, v, dout, allowed: torch.Tensor, softcap: float, dtype: torch.dtype) -> dict:
    """A plain softmax attention with autograd (shares no code with cpattn): out, dq, dk, dv."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(g, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * q.shape[-1] ** -0.5
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1), vv)
    out.backward(dout.to(dtype))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _cases(world: int) -> list[dict]:
    pairs = [(1, 2), (2, 1)] if world == 2 else [(2, 2), (1, 4), (4, 1)]
    seq = 16 * world
    cases = []
    for ud, rd in pairs:
        for impl in ("basic", "zigzag", "strip"):
            for low in ((True,) if world == 2 else (True, False)):
                cases.append({"impl": impl, "ud": ud, "rd": rd, "low": low, "causal": True, "b": 2, "seq": seq,
                              "h": 4, "h_kv": 2, "d": 8})
            cases.append({"impl": impl, "ud": ud, "rd": rd, "low": True, "causal": False, "b": 1, "seq": seq,
                          "h": 4, "h_kv": 4, "d": 8})
    cases.append({"impl": "zigzag", "ud": pairs[0][0], "rd": pairs[0][1], "low": True, "causal": True, "b": 1,
                  "seq": seq, "h": 4, "h_kv": 1, "d": 8, "window_size": (5, 0), "softcap": 3.0})
    cases.append({"impl": "basic", "ud": world, "rd": 1, "low": True, "causal": True, "b": 1, "seq": seq, "h": 4,
                  "h_kv": 2, "d": 8, "ulysses_layer": True})
    cases.append({"impl": "strip", "ud": pairs[0][0], "rd": pairs[0][1], "low": True, "causal": True, "b": 1,
                  "seq": seq, "h": 4, "h_kv": 4, "d": 8, "packed": True})  # LongContextAttentionQKVPacked
    cases.append({"impl": "basic_pytorch", "ud": pairs[0][0], "rd": pairs[0][1], "low": True, "causal": True, "b": 1,
                  "seq": seq, "h": 4, "h_kv": 2, "d": 8})  # another kernel of the basic ring: the basic layout
    for i, c in enumerate(cases):
        c["seed"] = 1000 * world + i
    return cases


def _run_exactness(worlds, world: int) -> None:
    import yunchang_workers as w

    cases = _cases(world)
    report = worlds.get(world).run("yunchang_workers.long_context_cases", timeout=600, cases=cases)
    for rank, r in enumerate(report):
        assert isinstance(r, list), f"rank {rank}: {r}"
    for i, c in enumerate(cases):
        results = [r[i] for r in report]
        q, k, v, dout = w.inputs(c["seed"], (c["b"], c["seq"], c["h"], c["d"]), (c["b"], c["seq"], c["h_kv"], c["d"]))
        allowed = _allowed(c["seq"], None, c["causal"], c.get("window_size", (-1, -1)))
        ref = _reference(q, k, v, dout, allowed, c.get("softcap", 0.0), torch.float64)
        single = _reference(q, k, v, dout, allowed, c.get("softcap", 0.0), torch.float32)
        idx = torch.cat([r["idx"] for r in results])
        assert sorted(idx.tolist()) == list(range(c["seq"])), c  # every token on one rank, none on two
        for key in ("out", "dq", "dk", "dv"):
            assembled = torch.empty_like(ref[key], dtype=torch.float32)
            assembled.index_copy_(1, idx, torch.cat([r[key] for r in results], dim=1))
            err, e_local = _relative(assembled, ref[key]), _relative(single[key], ref[key])
            assert err <= 2 * e_local + 1e-6, f"{c}: {key} relative error {err:.2e} (single device {e_local:.2e})"
        for rank, r in enumerate(results):
            assert r["groups_ok"] and r["extract_ok"], (c, rank)
            assert r["traffic"], (c, rank, "traffic differs from expected_volume")
            assert r["local_len"] == c["seq"] // world < c["seq"], (c, rank)  # no rank holds the whole sequence
            expected = "ulysses" if c.get("ulysses_layer") or c["rd"] == 1 else \
                "stripe_ring" if c["impl"] == "strip" and c["ud"] == 1 and c["causal"] else "usp"
            assert r["schedule"] == expected, (c, rank, r["schedule"])


def test_long_context_attention_is_exact_at_p2(worlds):
    _run_exactness(worlds, 2)


@pytest.mark.slow
def test_long_context_attention_is_exact_at_p4(worlds):
    _run_exactness(worlds, 4)


# ------------------------------------------------------------------ the schedule behind a borrowed call
def test_cpattn_schedule_changes_the_schedule_behind_substitute_hf_flash_attn(worlds):
    """``$CPATTN_SCHEDULE`` puts ring, usp or the cost model's choice behind the Hugging Face adapter (allgather
    when unset) with the same results, batch 2 rows sharing the documents; a schedule that needs another
    layout is refused on every rank; ``cpattn.compat.comm_stats`` counts the bytes."""
    import yunchang_workers as w

    lengths, b, h, h_kv, d, seed = [5, 13, 7, 7], 2, 4, 2, 8, 77  # the second document crosses the ranks
    requests = [None, "ring", "usp", "auto"]
    report = worlds.get(2).run("yunchang_workers.schedules_behind_the_hf_adapter", timeout=300, lengths=lengths,
                               b=b, h=h, h_kv=h_kv, d=d, seed=seed, requests=requests, refused="ringx4")
    for rank, r in enumerate(report):
        assert isinstance(r, dict), f"rank {rank}: {r}"
        assert [run["schedule"] for run in r["runs"]] == ["allgather", "ring", "usp", r["cost_model"]], r["runs"]
        assert r["refused"] and "ringx4" in r["refused"] and "contiguous" in r["refused"], r["refused"]
        for run in r["runs"]:
            assert run["compat_bytes"] == run["object_bytes"] and sum(run["compat_bytes"]) > 0, run
    seq = sum(lengths)
    q, k, v, dout = w.inputs(seed, (b, seq, h, d), (b, seq, h_kv, d))
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    ref = _reference(q, k, v, dout, allowed, 0.0, torch.float64)
    single = _reference(q, k, v, dout, allowed, 0.0, torch.float32)
    for i, request in enumerate(requests):
        for key in ("out", "dq", "dk", "dv"):
            got = torch.cat([r["runs"][i][key] for r in report], dim=1)
            err, e_local = _relative(got, ref[key]), _relative(single[key], ref[key])
            assert err <= 2 * e_local + 1e-6, f"{request}: {key} relative error {err:.2e} (single {e_local:.2e})"
            first = torch.cat([r["runs"][0][key] for r in report], dim=1)
            torch.testing.assert_close(got, first, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_schedule_behind_long_context_attention(worlds, world):
    """``LongContextAttention(schedule=...)``: another schedule on yunchang's layout with the same exact results,
    ``"auto"`` the cost model's choice among the schedules that run on that layout, and one that needs another
    layout refused; ``$CPATTN_SCHEDULE`` behind ``ring_flash_attn_varlen_func``."""
    import yunchang_workers as w

    # 1 x 2 zigzag is the zigzag layout; 2 x 2 zigzag is an explicit one (each rank one of the ring span's halves)
    ud, rd, layout = (1, 2, "zigzag") if world == 2 else (2, 2, None)
    seq, h, h_kv, d, seed = 16 * world, 4, 2, 8, 4242
    requests = [None, "ring", "auto"]
    report = worlds.get(world).run("yunchang_workers.layer_schedules", timeout=300, ud=ud, rd=rd, impl="zigzag",
                                   layout=layout or "zigzag", seq=seq, h=h, h_kv=h_kv, d=d, seed=seed,
                                   requests=requests, refused="stripe_ring")
    for rank, r in enumerate(report):
        assert isinstance(r, dict), f"rank {rank}: {r}"
        assert [run["schedule"] for run in r["runs"]][:2] == ["usp", "ring"], r["runs"]
        if layout is not None:  # the test names the caller's layout only where it is a named one
            assert r["runs"][2]["schedule"] == r["cost_model"], (r["runs"][2]["schedule"], r["cost_model"])
        assert r["refused"] and "stripe_ring" in r["refused"] and "never laid out again" in r["refused"], r["refused"]
        assert r["varlen"]["schedules"] == ["ring", "usp"] and r["varlen"]["difference"] <= 1e-5, r["varlen"]
    q, k, v, dout = w.inputs(seed, (1, seq, h, d), (1, seq, h_kv, d))
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
    ref = _reference(q, k, v, dout, allowed, 0.0, torch.float64)
    single = _reference(q, k, v, dout, allowed, 0.0, torch.float32)
    idx = torch.cat([r["idx"] for r in report])
    for i, request in enumerate(requests):
        for key in ("out", "dq", "dk", "dv"):
            got = torch.empty_like(ref[key], dtype=torch.float32)
            got.index_copy_(1, idx, torch.cat([r["runs"][i][key] for r in report], dim=1))
            err, e_local = _relative(got, ref[key]), _relative(single[key], ref[key])
            assert err <= 2 * e_local + 1e-6, f"{request}: {key} relative error {err:.2e} (single {e_local:.2e})"


def test_a_layer_keeps_its_groups_and_bad_input_raises_on_every_rank(worlds):
    report = worlds.get(2).run("yunchang_workers.groups_and_errors", timeout=120)
    for rank, r in enumerate(report):
        assert isinstance(r, dict), f"rank {rank}: {r}"
        assert (r["ring"], r["ulysses"]) == ("usp", "ulysses"), r
        assert r["zigzag"].startswith("ValueError") and "2 x 2 chunks" in r["zigzag"], r["zigzag"]
        assert r["dropout"].startswith("NotImplementedError") and "dropout" in r["dropout"], r["dropout"]
    assert report[0]["zigzag"] == report[1]["zigzag"]
