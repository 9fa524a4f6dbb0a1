"""cpattn's stand-in for ring-flash-attn 0.1.8 (``cpattn.compat.ring_flash_attn``): its names and signatures,
every function exact against a float64 reference that shares no code with cpattn (forward and backward, lse in
ring-flash-attn's shapes, traffic equal to the schedule's ``expected_volume``), its prepared values, its errors,
and a Hugging Face model trained the way OpenRLHF-style frameworks drive the adapter."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import random
import sys
import types

import pytest
import torch

import cpattn.compat

#: the flash-attn style arguments every attention function of ring-flash-attn ends with
_FLASH_ARGS = ("dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None, "
               "deterministic=False, return_attn_probs=False, group=None")
#: ring-flash-attn 0.1.8's public functions and their parameters (read from its source)
SIGNATURES = {
    "adapters.hf_adapter.check_params":
        "f1, f2",
    "adapters.hf_adapter.update_ring_flash_attn_params":
        "cu_seqlens, process_group",
    "adapters.hf_adapter.use_ring_attn":
        "flag",
    "adapters.hf_adapter.flash_attention_forward":
        "module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, "
        "softcap=None, **kwargs",
    "adapters.hf_adapter.substitute_hf_flash_attn":
        "process_group, heads_k_stride, schedule=None",  # schedule: cpattn's extension
    "llama3_flash_attn_varlen.llama3_flash_attn_prepare_cu_seqlens":
        "cu_seqlens, causal, rank, world_size",
    "llama3_flash_attn_varlen.llama3_flash_attn_varlen_qkvpacked_func":
        "qkv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride, local_k_slice, " + _FLASH_ARGS,
    "llama3_flash_attn_varlen.llama3_flash_attn_varlen_kvpacked_func":
        "q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride, local_k_slice, " + _FLASH_ARGS,
    "llama3_flash_attn_varlen.llama3_flash_attn_varlen_func":
        "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride, local_k_slice, "
        + _FLASH_ARGS,
    "ring_flash_attn.ring_flash_attn_qkvpacked_func":
        "qkv, " + _FLASH_ARGS,
    "ring_flash_attn.ring_flash_attn_kvpacked_func":
        "q, kv, " + _FLASH_ARGS,
    "ring_flash_attn.ring_flash_attn_func":
        "q, k, v, " + _FLASH_ARGS,
    "ring_flash_attn_varlen.ring_flash_attn_varlen_qkvpacked_func":
        "qkv, cu_seqlens, max_seqlen, " + _FLASH_ARGS,
    "ring_flash_attn_varlen.ring_flash_attn_varlen_kvpacked_func":
        "q, kv, cu_seqlens, max_seqlen, " + _FLASH_ARGS,
    "ring_flash_attn_varlen.ring_flash_attn_varlen_func":
        "q, k, v, cu_seqlens, max_seqlen, " + _FLASH_ARGS,
    "stripe_flash_attn.stripe_flash_attn_qkvpacked_func":
        "qkv, " + _FLASH_ARGS,
    "stripe_flash_attn.stripe_flash_attn_kvpacked_func":
        "q, kv, " + _FLASH_ARGS,
    "stripe_flash_attn.stripe_flash_attn_func":
        "q, k, v, " + _FLASH_ARGS,
    "utils.get_default_args":
        "func",
    "utils.update_out_and_lse":
        "out, lse, block_out, block_lse, slice_=None",
    "zigzag_ring_flash_attn.zigzag_ring_flash_attn_qkvpacked_func":
        "qkv, " + _FLASH_ARGS,
    "zigzag_ring_flash_attn.zigzag_ring_flash_attn_kvpacked_func":
        "q, kv, " + _FLASH_ARGS,
    "zigzag_ring_flash_attn.zigzag_ring_flash_attn_func":
        "q, k, v, " + _FLASH_ARGS,
    "zigzag_ring_flash_attn_varlen.zigzag_ring_flash_attn_varlen_qkvpacked_func":
        "qkv, cu_seqlens, max_seqlen, " + _FLASH_ARGS,
    "zigzag_ring_flash_attn_varlen.zigzag_ring_flash_attn_varlen_kvpacked_func":
        "q, kv, cu_seqlens, max_seqlen, " + _FLASH_ARGS,
    "zigzag_ring_flash_attn_varlen.zigzag_ring_flash_attn_varlen_func":
        "q, k, v, cu_seqlens, max_seqlen, " + _FLASH_ARGS,
    "adapters.hf_adapter.create_ring_flash_attention_forward":
        "process_group, heads_k_stride, schedule=None",  # schedule: cpattn's extension
}


def _signature_text(func) -> str:
    parts = []
    for p in inspect.signature(func).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is p.empty:
            parts.append(p.name)
        else:
            parts.append(f"{p.name}={p.default!r}")
    return ", ".join(parts)


# ------------------------------------------------------------------ names and install
def test_install_makes_the_library_and_its_submodules_resolve_to_cpattn():
    module = cpattn.compat.install("ring_flash_attn")
    assert cpattn.compat.install("ring_flash_attn") is module  # idempotent
    import ring_flash_attn
    import ring_flash_attn.adapters.hf_adapter as hf_adapter

    assert ring_flash_attn is module and module.__name__ == "cpattn.compat.ring_flash_attn"
    assert hf_adapter.__name__ == "cpattn.compat.ring_flash_attn.adapters.hf_adapter"
    assert ring_flash_attn.substitute_hf_flash_attn is hf_adapter.substitute_hf_flash_attn
    with pytest.raises(ValueError, match="no stand-in for 'flash_attn'"):
        cpattn.compat.install("flash_attn")


def test_install_refuses_when_the_real_package_is_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "ring_flash_attn", types.ModuleType("ring_flash_attn"))
    with pytest.raises(ImportError, match="already imported"):
        cpattn.compat.install("ring_flash_attn")


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_every_public_name_has_ring_flash_attns_signature(name):
    cpattn.compat.install("ring_flash_attn")
    module, attr = name.rsplit(".", 1)
    func = getattr(importlib.import_module(f"ring_flash_attn.{module}"), attr)
    assert _signature_text(func) == SIGNATURES[name]
    if module.count(".") == 0 and not module.startswith(("utils", "adapters")):
        import ring_flash_attn

        assert getattr(ring_flash_attn, attr) is func  # exported at the top, as theirs are


# ------------------------------------------------------------------ prepared values
def _their_prepared(bounds: list[int], causal: bool, rank: int, world: int):
    """ring-flash-attn's ``llama3_flash_attn_prepare_cu_seqlens`` values from its documented meaning, per document:
    the documents from the first one whose tokens reach this rank's slice (or an empty one starting at its first
    token) up to the one holding its last token; q bounds clipped to the slice, k from the first such document's
    start to the slice's end (causal) or the last document's end."""
    n = bounds[-1] // world
    lo, hi = rank * n, (rank + 1) * n
    docs = [(a, b) for a, b in zip(bounds, bounds[1:]) if a < hi and (b > lo or a == b == lo)]
    q_bounds = [0] + [min(b, hi) - lo for _a, b in docs]
    start = docs[0][0]
    k_end = hi if causal else docs[-1][1]
    k_bounds = [0] + [b - start for _a, b in docs[:-1]] + [k_end - start]
    longest = (max(y - x for x, y in zip(q_bounds, q_bounds[1:])), max(y - x for x, y in zip(k_bounds, k_bounds[1:])))
    return q_bounds, k_bounds, longest, slice(start, k_end)


def test_prepared_values_equal_ring_flash_attns():
    cpattn.compat.install("ring_flash_attn")
    from ring_flash_attn import llama3_flash_attn_prepare_cu_seqlens

    rng = random.Random(0)
    checked = 0
    for case in range(300):
        world = rng.randint(1, 4)
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 8))]
        lengths[-1] += -sum(lengths) % world  # OpenRLHF: the padding joins the last document
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        if case % 3 == 0:
            bounds.append(bounds[-1])  # a repeated final boundary: an empty last document
        cu = torch.tensor(bounds, dtype=torch.int32)
        for rank in range(world):
            for causal in (True, False):
                cu_q, cu_k, max_q, max_k, k_slice = llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)
                q_bounds, k_bounds, longest, expected_slice = _their_prepared(bounds, causal, rank, world)
                assert cu_q.tolist() == q_bounds and cu_k.tolist() == k_bounds, (bounds, rank, causal)
                assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.device == cu.device
                assert (max_q, max_k) == longest and type(max_q) is int and type(max_k) is int
                assert k_slice == expected_slice and type(k_slice.start) is int and type(k_slice.stop) is int
                checked += 1
    assert checked > 1000


def test_update_ring_flash_attn_params_fills_data_params():
    cpattn.compat.install("ring_flash_attn")
    from ring_flash_attn.adapters.hf_adapter import DATA_PARAMS, update_ring_flash_attn_params

    update_ring_flash_attn_params(torch.tensor([0, 5, 12, 12], dtype=torch.int32), None)
    assert set(DATA_PARAMS) == {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "local_k_slice"}
    assert DATA_PARAMS["cu_seqlens_q"].tolist() == [0, 5, 12] and DATA_PARAMS["local_k_slice"] == slice(0, 12)
    assert (DATA_PARAMS["max_seqlen_q"], DATA_PARAMS["max_seqlen_k"]) == (7, 7)


# ------------------------------------------------------------------ utils
def _attend64(q, k, v, scale):
    """float64 attention of q [s, d] over k, v [t, d]: (out [s, d], lse [s])."""
    scores = q.double() @ k.double().T * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[:, None]) @ v.double(), lse


def test_update_out_and_lse_merges_as_ring_flash_attn_does():
    cpattn.compat.install("ring_flash_attn")
    from ring_flash_attn.utils import update_out_and_lse

    gen = torch.Generator().manual_seed(5)
    b, s, h, d, t = 2, 6, 3, 4, 10
    q, k, v = torch.randn(b, s, h, d, generator=gen), torch.randn(b, t, h, d, generator=gen), \
        torch.randn(b, t, h, d, generator=gen)

    def block(keys):  # [b, s, h, d] out and [b, h, s] lse of q over the keys ``keys``
        outs, lses = torch.empty(b, s, h, d, dtype=torch.float64), torch.empty(b, h, s, dtype=torch.float64)
        for i in range(b):
            for j in range(h):
                outs[i, :, j], lses[i, j] = _attend64(q[i, :, j], k[i, keys, j], v[i, keys, j], 0.5)
        return outs, lses

    whole, whole_lse = block(slice(0, t))
    first, second = block(slice(0, 4)), block(slice(4, t))
    out, lse = update_out_and_lse(None, None, first[0].float(), first[1].float())
    assert out.dtype == torch.float32 and lse.shape == (b, s, h, 1)
    merged_out, merged_lse = update_out_and_lse(out, lse, second[0].float(), second[1].float())
    assert (merged_out - whole).abs().max() < 1e-5
    assert (merged_lse.squeeze(-1).transpose(1, 2) - whole_lse).abs().max() < 1e-5
    # packed [total, h, d] with lse [h, total], as the varlen functions keep them
    out, lse = update_out_and_lse(None, None, first[0][0].float(), first[1][0].float())
    out, lse = update_out_and_lse(out, lse, second[0][0].float(), second[1][0].float())
    assert (out - whole[0]).abs().max() < 1e-5 and (lse[..., 0].T - whole_lse[0]).abs().max() < 1e-5
    # slice_: only the rows it selects take the block
    out, lse = update_out_and_lse(None, None, first[0].float(), first[1].float())
    rows = (slice(None), slice(s // 2, None))
    out2, lse2 = update_out_and_lse(out, lse, second[0][rows].float(), second[1][:, :, s // 2:].float(), slice_=rows)
    assert out2 is out and (out[rows] - whole[rows]).abs().max() < 1e-5
    assert (out[:, : s // 2] - first[0][:, : s // 2]).abs().max() < 1e-6
    with pytest.raises(RuntimeError, match="slice_"):
        update_out_and_lse(None, None, first[0], first[1], slice_=rows)


def test_get_default_args():
    cpattn.compat.install("ring_flash_attn")
    from ring_flash_attn.utils import get_default_args

    def kernel(q, k, v, dropout_p=0.0, softcap=None, *, kw_only=1):
        return q

    assert get_default_args(kernel) == {"q": None, "k": None, "v": None, "dropout_p": 0.0, "softcap": 0.0}
    assert get_default_args(types.SimpleNamespace(_init_fn=kernel)) == get_default_args(kernel)


# ------------------------------------------------------------------ exactness against float64
def _reference(q, k, v, dout, allowed: torch.Tensor, scale: float, dtype: torch.dtype):
    """Attention of q [b, S, h, d] over k, v [b, S, h_kv, d] where ``allowed [S, S]``, in ``dtype``, with
    autograd: out, lse [b, h, S], dq, dk, dv (a plain softmax; shares no code with cpattn)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(g, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), vv)
    out.backward(dout.to(dtype))
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _allowed(seq: int, lengths: list[int] | None, causal: bool, window_size=(-1, -1)) -> torch.Tensor:
    """flash-attn's rule: query i attends key j of its document when i - left <= j <= i + right (-1:
    unbounded; causal: right = 0)."""
    doc = torch.zeros(seq, dtype=torch.long) if lengths is None else \
        torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(seq)
    left, right = window_size
    right = 0 if causal else right
    allowed = doc[:, None] == doc[None, :]
    if left >= 0:
        allowed &= pos[None, :] >= pos[:, None] - left
    if right >= 0:
        allowed &= pos[None, :] <= pos[:, None] + right
    return allowed


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    x = x.double()
    assert torch.isfinite(x).all()
    return float((x - ref).norm() / ref.norm())


def _check_exact(results: list[dict], full: tuple, lengths, causal: bool, packed: bool, case,
                 window_size=(-1, -1)) -> None:
    """Assemble every rank's rows in global order, compare with float64 within 2 e_local + 1e-6 (e_local: the
    same plain softmax in float32 on one device)."""
    q, k, v, dout = (t[None] if packed else t for t in full)
    scale = q.shape[-1] ** -0.5
    allowed = _allowed(q.shape[1], lengths, causal, window_size)
    ref = _reference(q, k, v, dout, allowed, scale, torch.float64)
    single = _reference(q, k, v, dout, allowed, scale, torch.float32)
    seq_dim = 0 if packed else 1
    for key in ("out", "lse", "dq", "dk", "dv"):
        dim = (1 if packed else 2) if key == "lse" else seq_dim
        parts = [r[key] for r in results]
        assembled = torch.empty_like(torch.cat(parts, dim=dim))
        assembled.index_copy_(dim, torch.cat([r["idx"] for r in results]), torch.cat(parts, dim=dim))
        if packed:
            assembled = assembled[None]
        err, e_local = _relative(assembled, ref[key]), _relative(single[key], ref[key])
        assert err <= 2 * e_local + 1e-6, f"{case}: {key} relative error {err:.2e} (single device {e_local:.2e})"
    for rank, r in enumerate(results):
        local = r["idx"].numel()
        shape = (q.shape[2], local) if packed else (q.shape[0], q.shape[2], local)
        assert tuple(r["lse"].shape) == shape and r["lse"].dtype == torch.float32, (case, rank)
        assert r["third"] is None and r["traffic"], (case, rank, "traffic differs from expected_volume")


def _batch_cases(world: int) -> list[dict]:
    seq = 48 if world > 2 else 32  # a multiple of 2P
    cases = []
    for name in ("ring", "zigzag", "stripe"):
        for form in ("plain", "kv", "qkv"):
            h_kv = 2 if form == "qkv" else 1  # GQA where k and v come apart from q
            cases.append({"name": name, "form": form, "causal": True, "seed": len(cases), "b": 2, "seq": seq,
                          "h": 2, "h_kv": h_kv, "d": 8})
        cases.append({"name": name, "form": "plain", "causal": False, "seed": len(cases), "b": 1, "seq": seq,
                      "h": 4, "h_kv": 2, "d": 8})
        cases.append({"name": name, "form": "plain", "causal": True, "seed": len(cases), "b": 1, "seq": seq,
                      "h": 2, "h_kv": 1, "d": 8, "window_size": (5, 0)})  # extended: exact across ranks
    return cases


def _varlen_cases(world: int) -> list[dict]:
    unit = 2 * world  # zigzag: every document a multiple of 2P
    docs = [3 * unit, unit, 5 * unit, 2 * unit]
    rng = random.Random(world)
    free = [rng.randint(1, 30) for _ in range(5)]
    free[-1] += -sum(free) % world  # the padding merged into the last document
    cases = []
    for name in ("ring", "zigzag", "llama3"):
        for form in ("plain", "kv", "qkv"):
            cases.append({"name": name, "form": form, "causal": True, "seed": 100 + len(cases),
                          "lengths": free if name == "llama3" else docs, "h": 2, "h_kv": 2 if form == "qkv" else 1,
                          "d": 8, "repeat_last": form == "kv"})
        cases.append({"name": name, "form": "plain", "causal": False, "seed": 100 + len(cases),
                      "lengths": free if name == "llama3" else docs, "h": 4, "h_kv": 2, "d": 8})
    cases.append({"name": "llama3", "form": "plain", "causal": True, "seed": 200, "lengths": free, "h": 4,
                  "h_kv": 2, "d": 8, "heads_k_stride": 2})
    for name in ("ring", "zigzag", "llama3"):  # windows, extended: exact across ranks
        cases.append({"name": name, "form": "plain", "causal": True, "seed": 300 + len(cases),
                      "lengths": free if name == "llama3" else docs, "h": 2, "h_kv": 1, "d": 8, "window_size": (6, 0)})
    cases.append({"name": "ring", "form": "plain", "causal": False, "seed": 400, "lengths": docs, "h": 2, "h_kv": 1,
                  "d": 8, "window_size": (3, 3)})
    return cases


def _run_exactness(worlds, world: int) -> None:
    import compat_workers as w

    for worker, cases, packed in (("batch_cases", _batch_cases(world), False),
                                  ("varlen_cases", _varlen_cases(world), True)):
        report = worlds.get(world).run(f"compat_workers.{worker}", timeout=600, cases=cases)
        for rank, r in enumerate(report):
            assert isinstance(r, list), f"rank {rank}: {r}"
        for i, case in enumerate(cases):
            if packed:
                seq = sum(case["lengths"])
                full = w.inputs(case["seed"], (seq, case["h"], case["d"]), (seq, case["h_kv"], case["d"]))
                lengths = case["lengths"]
            else:
                full = w.inputs(case["seed"], (case["b"], case["seq"], case["h"], case["d"]),
                                (case["b"], case["seq"], case["h_kv"], case["d"]))
                lengths = None
            _check_exact([r[i] for r in report], full, lengths, case["causal"], packed, case,
                         case.get("window_size", (-1, -1)))


def test_every_function_is_exact_at_p2(worlds):
    _run_exactness(worlds, 2)


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_every_function_is_exact_at_p3_p4(worlds, world):
    _run_exactness(worlds, world)


def test_one_process_under_inference_mode():
    """Without torch.distributed (one rank), under torch.inference_mode (tensors with no version counter)."""
    cpattn.compat.install("ring_flash_attn")
    import ring_flash_attn

    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(20, 2, 8, generator=gen) for _ in range(3))
    allowed = _allowed(20, [6, 14], True)
    ref = _reference(q[None], k[None], v[None], torch.zeros(1, 20, 2, 8), allowed, 8 ** -0.5, torch.float64)["out"][0]
    with torch.inference_mode():
        cu = torch.tensor([0, 6, 20], dtype=torch.int32)
        for _ in range(2):  # no version counter: each call reads cu_seqlens and finds its object by value
            out = ring_flash_attn.zigzag_ring_flash_attn_varlen_func(q, k, v, cu, 14, causal=True)
            assert (out.double() - ref).abs().max() < 1e-5
        prepared = ring_flash_attn.llama3_flash_attn_prepare_cu_seqlens(cu, True, 0, 1)
        out = ring_flash_attn.llama3_flash_attn_varlen_func(q, k, v, *prepared[:4], 1, prepared[4], causal=True)
        assert (out.double() - ref).abs().max() < 1e-5


def test_the_reference_sees_the_documents():
    """The check can fail: documents and windows change the reference against one causal sequence."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 24, 2, 8, generator=gen) for _ in range(4))
    docs = _reference(q, k, v, dout, _allowed(24, [10, 14], True), 0.3, torch.float64)
    whole = _reference(q, k, v, dout, _allowed(24, None, True), 0.3, torch.float64)
    assert (docs["out"] - whole["out"]).abs().max() > 1e-2
    window = _reference(q, k, v, dout, _allowed(24, None, True, (5, 0)), 0.3, torch.float64)
    assert (window["out"] - whole["out"]).abs().max() > 1e-2


# ------------------------------------------------------------------ errors
def test_bad_input_raises_the_same_error_on_every_rank_before_any_communication(worlds):
    report = worlds.get(2).run("compat_workers.bad_inputs", timeout=120)
    expected = {"not at 0": ("ValueError", "start at 0"), "decreasing": ("ValueError", "not decrease"),
                "float": ("TypeError", "integer"), "wrong total": ("ValueError", "sum to the local"),
                "zigzag odd": ("ValueError", "even"), "dropout": ("NotImplementedError", "dropout"),
                "alibi": ("NotImplementedError", "alibi"), "total not split": ("ValueError", "multiple of 2"),
                "local_k_slice": ("ValueError", "local_k_slice"), "max_seqlen": ("ValueError", "max_seqlen"),
                "heads_k_stride": ("ValueError", "heads_k_stride"),
                "not prepared": ("ValueError", "llama3_flash_attn_prepare_cu_seqlens"),
                "prepared causal": ("ValueError", "prepared with causal=True"),
                "one rank's local_k_slice": ("ValueError", "local_k_slice")}
    assert all(set(r) == set(expected) for r in report), report
    for name, (kind, words) in expected.items():
        for rank, r in enumerate(report):
            assert r[name][0] == kind and words in r[name][1], (name, rank, r[name])
        assert report[0][name] == report[1][name], name  # the same error on every rank


# ------------------------------------------------------------------ the Hugging Face adapter
def test_the_adapter_passes_check_params_and_use_ring_attn_switches(monkeypatch):
    pytest.importorskip("transformers")
    import transformers.modeling_flash_attention_utils as fa_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cpattn.compat.install("ring_flash_attn")
    from ring_flash_attn.adapters import hf_adapter

    calls = []

    def replaced(*args, **kwargs):
        calls.append(len(args))
        return "previous"

    replaced.__signature__ = inspect.signature(fa_utils._flash_attention_forward)
    monkeypatch.setattr(fa_utils, "_flash_attention_forward", replaced)
    find_spec = importlib.util.find_spec  # where flash-attn is installed, "off" runs the function it replaced
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn"
                        else find_spec(name, *a))
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "flash_attention_2", ALL_ATTENTION_FUNCTIONS["flash_attention_2"])
    hf_adapter.substitute_hf_flash_attn(None, 1)
    assert hf_adapter.check_params(replaced, fa_utils._flash_attention_forward)
    assert ALL_ATTENTION_FUNCTIONS["flash_attention_2"] is hf_adapter.flash_attention_forward
    hf_adapter.use_ring_attn(False)
    try:
        assert fa_utils._flash_attention_forward(1, 2, 3, None, 4, True) == "previous" and calls == [6]
    finally:
        hf_adapter.use_ring_attn(True)


def test_use_ring_attn_off_is_exact_local_attention_without_flash_attn(monkeypatch):
    """With the adapter off, a model runs its own tensors alone with transformers' meaning of a padding mask
    (left and right) and of packed position_ids: its logits equal each sequence run alone (float64)."""
    pytest.importorskip("transformers")
    import compat_workers as w
    import transformers.modeling_flash_attention_utils as fa_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cpattn.compat.install("ring_flash_attn")
    from ring_flash_attn.adapters import hf_adapter

    monkeypatch.setattr(fa_utils, "_flash_attention_forward", fa_utils._flash_attention_forward)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "flash_attention_2", ALL_ATTENTION_FUNCTIONS["flash_attention_2"])
    model = w.tiny_llama(3)
    reference = w.tiny_llama(3)
    model.config._attn_implementation = "flash_attention_2"
    hf_adapter.substitute_hf_flash_attn(None, 1)
    hf_adapter.use_ring_attn(False)
    try:
        gen = torch.Generator().manual_seed(3)
        ids = torch.randint(0, 96, (2, 12), generator=gen)
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[0, :3] = 0  # left padding
        mask[1, 8:] = 0  # right padding
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        for row in range(2):
            keep = mask[row].bool()
            alone = reference(input_ids=ids[row, keep][None]).logits[0]
            assert (logits[row, keep] - alone).abs().max() < 1e-10
        packed = torch.randint(0, 96, (1, 12), generator=gen)
        positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
        logits = model(input_ids=packed, position_ids=positions).logits[0]
        for a, b in ((0, 5), (5, 12)):
            alone = reference(input_ids=packed[:, a:b]).logits[0]
            assert (logits[a:b] - alone).abs().max() < 1e-10
        whole = reference(input_ids=packed).logits[0]
        assert (logits[5:] - whole[5:]).abs().max() > 1e-3  # the documents mattered
    finally:
        hf_adapter.use_ring_attn(True)


def _hf_steps(world: int) -> list[list[int]]:
    rng = random.Random(world)
    return [[rng.randint(1, 40) for _ in range(rng.randint(1, 5))] for _ in range(3)]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_a_framework_training_step_equals_each_document_alone(worlds, world):
    """OpenRLHF's shape, unmodified apart from install(): substitute_hf_flash_attn once, then every step
    update_ring_flash_attn_params with the packed row's global cu_seqlens (padding merged into the last
    document, a new total every step) and a contiguous slice of the row per rank, through a Hugging Face Llama
    whose attention implementation is flash_attention_2: its logits and parameter gradients equal one process
    running each document alone (float64)."""
    pytest.importorskip("transformers")
    steps = _hf_steps(world)
    report = worlds.get(world).run("compat_workers.hf_training_steps", timeout=600, steps=steps)
    for rank, r in enumerate(report):
        assert isinstance(r, list) and len(r) == len(steps), f"rank {rank}: {r}"
        assert len({s["total"] for s in r}) > 1  # a new total (and new documents) every step
        for step in r:
            assert step["logits"] < 1e-9 and step["grads"] < 1e-9, (rank, step)
