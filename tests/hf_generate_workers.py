"""Functions the generation tests run on worker processes: ``hf.generate`` of a tiny random transformers model
(``attn_implementation="cpattn"``) at CP = the world size, against the same weights generating with
``"eager"`` on one process, one prompt at a time."""

from __future__ import annotations

import time

import torch
from hf_workers import VOCAB, model_pair, rel, tiny_config

import cpattn
from cpattn.core.steps import payload
from cpattn.cost.inference import decode_merge_ops
from cpattn.integrations import hf

#: the positions the tests reach (the tiny configs stop at 256)
MAX_POSITIONS = 2048


def config(kind: str):
    c = tiny_config(kind)
    c.max_position_embeddings = MAX_POSITIONS
    return c


def prompts(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Random prompts of ``lengths``, left-padded into ``[rows, max(lengths)]`` with their attention mask
    (None for one row)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n:] = torch.randint(0, VOCAB, (n,), generator=gen)
        mask[b, width - n:] = 1
    return ids, (mask if len(lengths) > 1 else None)


def top2_gap(logits: torch.Tensor) -> float:
    """The smallest gap between the two largest logits of any row."""
    top = logits.double().topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


def greedy_parity(kind: str, schedule: str, lengths: list[int], new_tokens: int, seed: int, merge: str = "auto",
                  eos: bool = False) -> dict:
    """Greedy ``hf.generate`` of ``new_tokens`` after prompts of ``lengths`` (one row each) at CP = the
    world size, against eager ``generate`` of each row alone on this process. Returns whether the
    tokens agree, the smallest top-2 logit gap of the reference, the worst relative error of any step's
    logits, the counted decode traffic per step and layer against the merge's formula, and the cache's
    size per rank. ``eos``: keep the config's end-of-sequence token (else generation runs the full
    length)."""
    model, ref = model_pair(config(kind), seed)
    ids, mask = prompts(lengths, seed + 1)
    cp = cpattn.ContextParallel(sum(lengths), mask="causal", schedule=schedule)
    extra = {} if eos else {"eos_token_id": None}
    out = hf.generate(model, ids, cp, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                      return_dict_in_generate=True, output_logits=True, merge=merge, **extra)
    kv = out.past_key_values.kv
    result = {"same_tokens": True, "min_gap": float("inf"), "logits": 0.0, "rows": []}
    for b, n in enumerate(lengths):
        row = ids[b:b + 1, ids.shape[1] - n:]
        r = ref.generate(row, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                         output_logits=True, **extra)
        want = r.sequences[0, n:]
        got = out.sequences[b, ids.shape[1]:ids.shape[1] + want.numel()]
        result["same_tokens"] &= bool(torch.equal(got, want))
        result["min_gap"] = min(result["min_gap"], min(top2_gap(x) for x in r.logits))
        result["logits"] = max(result["logits"], max(rel(a[b], x[0]) for a, x in zip(out.logits, r.logits)))
        result["rows"].append(want.numel())
    steps = len(out.logits) - 1  # decoding forwards after the prefill
    stats = kv.comm_stats()
    heads = model.config.num_attention_heads
    name = kv.last_merge[0] if kv.last_merge else "none"
    expected = {"calls": 0, "bytes_sent": 0, "bytes_recv": 0}
    if cp.world_size > 1:
        for op in decode_merge_ops(name, len(lengths), heads, kv.head_dim):
            sent, recv = payload(op.op, op.bytes, cp.world_size, cp.rank)
            expected["calls"] += 1
            expected["bytes_sent"] += sent
            expected["bytes_recv"] += recv
    per_layer = {k: stats["total"][k] / max(1, steps * kv.layers) for k in expected}
    result.update(steps=steps, merge=name, per_step_layer=per_layer, expected_per_step_layer=expected,
                  cache_bytes=kv.bytes_per_rank(), nbytes=kv.nbytes, tokens=kv.tokens_per_rank(),
                  shape=list(kv.shape), dtype=str(kv.dtype), same_on_ranks_digest=out.sequences.sum().item())
    return result


def multi_turn_parity(schedule: str, first: int, second: int, new_tokens: int, seed: int, extend: str) -> dict:
    """Two turns: ``first`` prompt tokens then ``new_tokens`` generated; then ``second`` more prompt tokens
    on top of the returned cache (multi-turn prefill with ``extend``) and ``new_tokens`` more. Against
    eager ``generate`` of the whole history from scratch."""
    model, ref = model_pair(config("llama"), seed)
    ids, _ = prompts([first], seed + 1)
    cp = cpattn.ContextParallel(first, mask="causal", schedule=schedule)
    opts = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                output_logits=True)
    one = hf.generate(model, ids, cp, extend=extend, **opts)
    more, _ = prompts([second], seed + 2)
    history = torch.cat([one.sequences, more], dim=1)
    kv = one.past_key_values.kv
    kv.reset_comm_stats()
    two = hf.generate(model, history, cp, past_key_values=one.past_key_values, **opts)
    r = ref.generate(history, **opts)
    return {"same_tokens": bool(torch.equal(two.sequences, r.sequences)),
            "min_gap": min(top2_gap(x) for x in r.logits),
            "logits": max(rel(a, b) for a, b in zip(two.logits, r.logits)),
            "extend": kv.last_extend, "ops": sorted(op for op in kv.comm_stats() if op != "total")}


def sampling_parity(schedule: str, length: int, new_tokens: int, seed: int) -> dict:
    """Sampling (temperature, top-k) with a seed every rank passes, against one process's
    ``torch.manual_seed(seed); generate(...)``."""
    model, ref = model_pair(config("llama"), seed)
    ids, _ = prompts([length], seed + 1)
    cp = cpattn.ContextParallel(length, mask="causal", schedule=schedule)
    opts = dict(max_new_tokens=new_tokens, do_sample=True, temperature=0.8, top_k=20, eos_token_id=None)
    got = hf.generate(model, ids, cp, seed=seed, **opts)
    torch.manual_seed(seed)
    want = ref.generate(ids, **opts)
    return {"same_tokens": bool(torch.equal(got, want)), "tokens": got[0, length:].tolist()}


def timing(kind: str, schedule: str, length: int, new_tokens: int, seed: int) -> dict:
    """Prefill seconds and the median seconds per decoded token of one greedy generation (a measurement,
    never a test)."""
    model, _ = model_pair(config(kind), seed)
    ids, _ = prompts([length], seed + 1)
    cp = cpattn.ContextParallel(length, mask="causal", schedule=schedule)
    hf.generate(model, ids[:, :64], cp, max_new_tokens=2, eos_token_id=None)  # warm-up
    marks = []

    class Clock:  # a stopping criterion called once per generated token
        def __call__(self, input_ids, scores, **kwargs):
            marks.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    from transformers import StoppingCriteriaList

    start = time.perf_counter()
    out = hf.generate(model, ids, cp, max_new_tokens=new_tokens, eos_token_id=None, return_dict_in_generate=True,
                      stopping_criteria=StoppingCriteriaList([Clock()]))
    gaps = sorted(b - a for a, b in zip(marks, marks[1:]))
    kv = out.past_key_values.kv
    return {"prefill_s": marks[0] - start, "decode_s_per_token": gaps[len(gaps) // 2], "cache_bytes": kv.nbytes,
            "decode_bytes_per_step_layer": kv.comm_stats()["total"]["bytes_sent"] / max(1, (len(marks) - 1)
                                                                                         * kv.layers),
            "merge": kv.last_merge}


def disagreeing_prompts(seed: int) -> str:
    """Rank 1 passes another prompt than rank 0: every rank must raise the same error, before any
    attention traffic. Returns the error's type and message."""
    import torch.distributed as dist

    model, _ = model_pair(config("llama"), seed)
    ids, _ = prompts([20], seed + dist.get_rank())
    cp = cpattn.ContextParallel(20, mask="causal", schedule="zigzag_ring")
    try:
        hf.generate(model, ids, cp, max_new_tokens=2)
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def bfloat16_generation(seed: int) -> dict:
    """A bfloat16 model at CP = the world size: runs, and the ranks agree (parity is float32's, above)."""
    model, _ = model_pair(config("qwen3"), seed)
    model = model.to(torch.bfloat16)
    ids, mask = prompts([33, 20], seed + 1)
    cp = cpattn.ContextParallel(53, mask="causal", schedule="zigzag_ring")
    out = hf.generate(model, ids, cp, attention_mask=mask, max_new_tokens=4, eos_token_id=None,
                      return_dict_in_generate=True)
    kv = out.past_key_values.kv
    return {"ids": out.sequences.tolist(), "dtype": str(kv.dtype), "nbytes": kv.nbytes}
