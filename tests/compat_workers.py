"""Worker functions for the ring-flash-attn stand-in tests (``cpattn.compat.ring_flash_attn``): each rank cuts
its tokens out of the full inputs by the library's own layout rules (written out here, not cpattn's), calls the
function and returns its local results, the global token index of each local row, and whether the call's
traffic equals its schedule's ``expected_volume``. The parent assembles them and compares with float64."""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.distributed as dist

import cpattn.compat

cpattn.compat.install("ring_flash_attn")

import ring_flash_attn  # noqa: E402  (cpattn's, installed above)
from ring_flash_attn import substitute_hf_flash_attn, update_ring_flash_attn_params  # noqa: E402


def inputs(seed: int, shape_q: tuple, shape_kv: tuple) -> tuple[torch.Tensor, ...]:
    """q, k, v, dout (float32), the same on every rank and in the parent."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=gen) for s in (shape_q, shape_kv, shape_kv, shape_q))


def batch_index(layout: str, seq: int, world: int, rank: int) -> torch.Tensor:
    """Global positions of a rank's tokens: ring (contiguous), zigzag (chunks r and 2P-1-r of 2P), stripe
    (t mod P)."""
    if layout == "ring":
        n = seq // world
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "zigzag":
        c = seq // (2 * world)
        return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                          torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c)])
    return torch.arange(rank, seq, world)


def varlen_index(layout: str, lengths: list[int], world: int, rank: int) -> torch.Tensor:
    """ring: every document cut in P pieces, piece r; zigzag: in 2P chunks, chunks r and 2P-1-r."""
    parts, start = [], 0
    for n in lengths:
        if layout == "ring":
            piece = n // world
            parts.append(torch.arange(start + rank * piece, start + (rank + 1) * piece))
        else:
            c = n // (2 * world)
            parts += [torch.arange(start + rank * c, start + (rank + 1) * c),
                      torch.arange(start + (2 * world - 1 - rank) * c, start + (2 * world - rank) * c)]
        start += n
    return torch.cat(parts)


def _last_object(cache):
    """The ContextParallel a compat call just used (the most recently used entry of its cache)."""
    entry = next(reversed(cache._items.values()))
    return entry[1] if isinstance(entry, tuple) else entry


def _traffic_matches(cp, q_local: torch.Tensor, k_local: torch.Tensor, run) -> bool:
    """Run ``run()`` (forward + backward) and compare the bytes and calls it counted with the schedule's
    ``expected_volume`` for one forward and one backward."""
    cp.reset_comm_stats()
    run()
    stats = cp.comm_stats()
    expected: dict[str, dict[str, int]] = {}
    for phase in cp.expected_volume(q_local, k_local).values():
        for op, counts in phase.items():
            acc = expected.setdefault(op, {"calls": 0, "bytes_sent": 0, "bytes_recv": 0})
            for key in acc:
                acc[key] += counts[key]
    got = {op: {k: v[k] for k in ("calls", "bytes_sent", "bytes_recv")} for op, v in stats.items()
           if op not in ("total", "levels")}
    return got == expected and sum(v["bytes_sent"] for v in got.values()) > 0


def _call_packed(func, form: str, q, k, v, dout, *args, **kwargs):
    """Call a function in its plain, kvpacked or qkvpacked form (the sequence at dim ``q.dim() - 3``) and
    run the backward; returns (out, lse, third, dq, dk, dv)."""
    dim = q.dim() - 2  # the pack dimension: [b, s, 3, h, d] or [total, 3, h, d]
    if form == "qkv":
        qkv = torch.stack([q, k, v], dim=dim).requires_grad_()
        out, lse, third = func(qkv, *args, return_attn_probs=True, **kwargs)
        out.backward(dout)
        return (out, lse, third, *qkv.grad.unbind(dim))
    if form == "kv":
        qq, kv = q.clone().requires_grad_(), torch.stack([k, v], dim=dim).requires_grad_()
        out, lse, third = func(qq, kv, *args, return_attn_probs=True, **kwargs)
        out.backward(dout)
        return (out, lse, third, qq.grad, *kv.grad.unbind(dim))
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse, third = func(qq, kk, vv, *args, return_attn_probs=True, **kwargs)
    out.backward(dout)
    return out, lse, third, qq.grad, kk.grad, vv.grad


def _result(idx, out, lse, third, dq, dk, dv, traffic: bool) -> dict:
    return {"idx": idx, "out": out.detach(), "lse": lse.detach(), "third": third, "dq": dq, "dk": dk, "dv": dv,
            "traffic": traffic}


def batch_cases(cases: list[dict]) -> list[dict]:
    """``cases``: dicts of name (ring, zigzag, stripe), form (plain, kv, qkv), causal, seed, b, seq, h, h_kv,
    d, optionally window_size. The ``[b, s_local, h, d]`` functions, forward and backward."""
    from cpattn import functional

    rank, world = dist.get_rank(), dist.get_world_size()
    found = []
    for c in cases:
        prefix = {"ring": "ring_flash_attn", "zigzag": "zigzag_ring_flash_attn", "stripe": "stripe_flash_attn"}
        suffix = {"plain": "func", "kv": "kvpacked_func", "qkv": "qkvpacked_func"}[c["form"]]
        func = getattr(ring_flash_attn, f"{prefix[c['name']]}_{suffix}")
        q, k, v, dout = inputs(c["seed"], (c["b"], c["seq"], c["h"], c["d"]), (c["b"], c["seq"], c["h_kv"], c["d"]))
        idx = batch_index(c["name"], c["seq"], world, rank)
        local = [t[:, idx].contiguous() for t in (q, k, v, dout)]
        window = tuple(c.get("window_size", (-1, -1)))
        results = _call_packed(func, c["form"], *local, causal=c["causal"], window_size=window)
        cp = _last_object(functional._CACHE)
        traffic = _traffic_matches(cp, local[0], local[1], partial(_call_packed, func, c["form"], *local,
                                                                   causal=c["causal"], window_size=window))
        found.append(_result(idx, *results, traffic))
    return found


def varlen_cases(cases: list[dict]) -> list[dict]:
    """``cases``: dicts of name (ring, zigzag, llama3), form, causal, seed, lengths (global documents), h,
    h_kv, d; llama3 also ``pad`` (tokens merged into the last document) and ``repeat_last`` (a repeated final
    boundary). Packed ``[total_local, h, d]`` functions, forward and backward."""
    from cpattn.compat.ring_flash_attn import _calls

    rank, world = dist.get_rank(), dist.get_world_size()
    found = []
    for c in cases:
        lengths, seq = list(c["lengths"]), sum(c["lengths"])
        q, k, v, dout = inputs(c["seed"], (seq, c["h"], c["d"]), (seq, c["h_kv"], c["d"]))
        suffix = {"plain": "func", "kv": "kvpacked_func", "qkv": "qkvpacked_func"}[c["form"]]
        if c["name"] == "llama3":
            bounds = [0]
            for n in lengths:
                bounds.append(bounds[-1] + n)
            if c.get("repeat_last"):
                bounds.append(bounds[-1])
            cu = torch.tensor(bounds, dtype=torch.int32)
            prepared = ring_flash_attn.llama3_flash_attn_prepare_cu_seqlens(cu, c["causal"], rank, world)
            n = seq // world
            idx = torch.arange(rank * n, (rank + 1) * n)
            args = (*prepared[:4], c.get("heads_k_stride", 1), prepared[4])
            func = getattr(ring_flash_attn, f"llama3_flash_attn_varlen_{suffix}")
        else:
            local_bounds = [0]
            for n in lengths:
                local_bounds.append(local_bounds[-1] + n // world)
            cu = torch.tensor(local_bounds, dtype=torch.int32)
            idx = varlen_index(c["name"], lengths, world, rank)
            args = (cu, max(n // world for n in lengths))
            prefix = "ring_flash_attn" if c["name"] == "ring" else "zigzag_ring_flash_attn"
            func = getattr(ring_flash_attn, f"{prefix}_varlen_{suffix}")
        local = [t[idx].contiguous() for t in (q, k, v, dout)]
        window = tuple(c.get("window_size", (-1, -1)))
        results = _call_packed(func, c["form"], *local, *args, causal=c["causal"], window_size=window)
        cp = _last_object(_calls._OBJECTS)
        traffic = _traffic_matches(cp, local[0][None], local[1][None],
                                   partial(_call_packed, func, c["form"], *local, *args, causal=c["causal"],
                                           window_size=window))
        found.append(_result(idx, *results, traffic))
    return found


def bad_inputs() -> dict[str, tuple[str, str]]:
    """Every kind of bad input, on every rank: the error's type and message per case (no rank may hang)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q = torch.randn(8, 2, 8)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    cases = {
        "not at 0": lambda: ring_flash_attn.ring_flash_attn_varlen_func(q, q, q, torch.tensor([1, 8]), 8),
        "decreasing": lambda: ring_flash_attn.ring_flash_attn_varlen_func(q, q, q, torch.tensor([0, 5, 3, 8]), 5),
        "float": lambda: ring_flash_attn.ring_flash_attn_varlen_func(q, q, q, torch.tensor([0.0, 8.0]), 8),
        "wrong total": lambda: ring_flash_attn.ring_flash_attn_varlen_func(q, q, q, torch.tensor([0, 3, 6]), 3),
        "zigzag odd": lambda: ring_flash_attn.zigzag_ring_flash_attn_varlen_func(q, q, q, cu, 5, causal=True),
        "dropout": lambda: ring_flash_attn.ring_flash_attn_varlen_func(q, q, q, cu, 5, dropout_p=0.1),
        "alibi": lambda: ring_flash_attn.ring_flash_attn_func(q[None], q[None], q[None],
                                                               alibi_slopes=torch.ones(2)),
        "total not split": lambda: ring_flash_attn.llama3_flash_attn_prepare_cu_seqlens(
            torch.tensor([0, 3, 8 * world + 1], dtype=torch.int32), True, rank, world),
    }
    glob = torch.tensor([0, 5, 8 * world], dtype=torch.int32)
    prepared = ring_flash_attn.llama3_flash_attn_prepare_cu_seqlens(glob, True, rank, world)
    cu_q, cu_k, mq, mk, ks = prepared
    cases["local_k_slice"] = lambda: ring_flash_attn.llama3_flash_attn_varlen_func(
        q, q, q, cu_q, cu_k, mq, mk, 1, slice(ks.start, ks.stop + 1), causal=True)
    cases["max_seqlen"] = lambda: ring_flash_attn.llama3_flash_attn_varlen_func(
        q, q, q, cu_q, cu_k, mq + 1, mk, 1, ks, causal=True)
    cases["heads_k_stride"] = lambda: ring_flash_attn.llama3_flash_attn_varlen_func(
        q, q, q, cu_q, cu_k, mq, mk, 3, ks, causal=True)
    cases["not prepared"] = lambda: ring_flash_attn.llama3_flash_attn_varlen_func(
        q, q, q, torch.tensor([0, 1, 8], dtype=torch.int32), cu_k, mq, mk, 1, ks, causal=True)
    cases["prepared causal"] = lambda: ring_flash_attn.llama3_flash_attn_varlen_func(
        q, q, q, cu_q, cu_k, mq, mk, 1, ks, causal=False)
    # only the last rank's value is wrong: every rank raises its error
    bad = slice(ks.start, ks.stop + 1) if rank == world - 1 else ks
    cases["one rank's local_k_slice"] = lambda: ring_flash_attn.llama3_flash_attn_varlen_func(
        q, q, q, cu_q, cu_k, mq, mk, 1, bad, causal=True)
    found = {}
    for name, call in cases.items():
        try:
            call()
            found[name] = ("no error", "")
        except Exception as exc:  # noqa: BLE001 (reported to the parent)
            found[name] = (type(exc).__name__, str(exc))
    dist.barrier()  # every rank is still in step: no rank entered a collective the others skipped
    return found


# ------------------------------------------------------------------ a framework's training step
def tiny_llama(seed: int):
    """A Llama-style model built from a config (float64, 2 layers, 4 query and 2 key/value heads), with
    ``attn_implementation="sdpa"`` (transformers refuses flash_attention_2 at load without the package)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).double()


def hf_training_steps(steps: list[list[int]], seed: int = 0) -> list[dict]:
    """OpenRLHF-shaped steps: per step, documents of the given lengths packed into one row, padded to a
    multiple of P with the padding merged into the last document (``cu_seqlens[-1] += pad``), each rank
    running its contiguous slice through a Hugging Face Llama whose attention implementation is
    flash_attention_2. Per step: the gathered logits of the real tokens, the loss, and every parameter's
    gradient summed over the ranks; the reference runs each document alone in one process (sdpa)."""
    import transformers.modeling_flash_attention_utils as fa_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_llama(seed)
    reference = copy.deepcopy(model)
    model.config._attn_implementation = "flash_attention_2"  # without the flash-attn package (docs/compat.md)
    saved = fa_utils._flash_attention_forward, ALL_ATTENTION_FUNCTIONS["flash_attention_2"]
    substitute_hf_flash_attn(None, heads_k_stride=1)
    try:
        return _steps(model, reference, steps, seed, rank, world)
    finally:  # this worker runs other tests after this one
        fa_utils._flash_attention_forward, ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = saved


def _steps(model, reference, steps: list[list[int]], seed: int, rank: int, world: int) -> list[dict]:
    found = []
    for step, lengths in enumerate(steps):
        gen = torch.Generator().manual_seed(1000 * seed + step)
        docs = [torch.randint(0, 96, (n,), generator=gen) for n in lengths]
        weights = [torch.randn(n, 96, generator=gen, dtype=torch.float64) for n in lengths]
        total = sum(lengths)
        pad = -total % world
        ids = torch.cat([*docs, torch.zeros(pad, dtype=torch.long)])[None]
        positions = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(pad)])[None]
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        cu_seqlens[-1] += pad
        update_ring_flash_attn_params(cu_seqlens, None)
        n = (total + pad) // world
        part = slice(rank * n, (rank + 1) * n)
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids[:, part], position_ids=positions[:, part]).logits
        weight = torch.cat([*weights, torch.zeros(pad, 96, dtype=torch.float64)])[part]
        (logits[0] * weight).sum().backward()
        gathered = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(gathered, logits.detach())
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g)
        reference.zero_grad(set_to_none=True)
        ref_logits = []
        for doc, w in zip(docs, weights):
            out = reference(input_ids=doc[None], position_ids=torch.arange(len(doc))[None]).logits
            (out[0] * w).sum().backward()
            ref_logits.append(out[0].detach())
        got = torch.cat(gathered, dim=1)[0, :total]
        ref = torch.cat(ref_logits)
        grad_err = max(float((grads[name] - p.grad).norm() / p.grad.norm().clamp(min=1e-30))
                       for name, p in reference.named_parameters())
        found.append({"logits": float((got - ref).norm() / ref.norm()), "grads": grad_err, "total": total + pad})
    return found
