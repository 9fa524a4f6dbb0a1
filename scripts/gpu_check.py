#!/usr/bin/env python
"""One run on a CUDA machine that checks cpattn's CUDA paths and measures them against torch's own kernels.

The run fits a time budget (``--budget``, default 300 s for the whole run, start-up included). Each
section gets a share of it (below); a section that finishes early leaves its time to the ones after it,
and one that runs out records the cases it had no time for as ``{"skipped": why}``. The JSON report is
written after every section, so a run cut short keeps what it did. Sections, in the order they run:

1. ``exactness`` (20%): every available kernel path (flash_cuda, cudnn_cuda, efficient_cuda, flex_cuda,
   flash_attn, flash_attn3, flash_attn4, math) x block kind (FULL, CAUSAL, PARTIAL where the path takes it)
   x dtype (float16, bfloat16, float32 where the path takes it) x GQA (1, 4), forward and backward, against a float64
   reference computed on the GPU in plain torch (``cpattn.exactness.reference``). Tolerance
   (docs/testing.md): relative error <= 2 * e_local + 1e-6 per quantity, where e_local is the error of
   ``torch.nn.functional.scaled_dot_product_attention`` in the same dtype on the same inputs (rows the
   mask leaves empty are given every key for that measurement, since SDPA makes them NaN); lse, which
   SDPA does not return, is held to out's tolerance. Each FULL / PARTIAL case also runs *split*: the
   keys in two blocks, merged by log-sum-exp, each block's backward given the merged out and lse, as
   the schedules call the kernels. Soft-capped blocks (``softcap``) run on flex_cuda, the path
   ``backend="auto"`` gives them on CUDA, against a float64 autograd reference of the capped scores.
2. ``context_parallel`` (6%): ``cpattn.ContextParallel`` at world size 1 (no process group: a one-rank
   world), S = 256, for every registered schedule (``cpattn.schedules.names()``) x causal, full,
   sliding_window, document, judged like ``cpattn verify``. A pair the schedule refuses
   (``Schedule.check_mask`` raises) is recorded as skipped, not failed. Every pair runs once in
   bfloat16 with GQA 4 before any runs again in float32 with GQA 1.
3. ``parity`` (36%): ``cp.attention`` at world 1 ("ring"), bfloat16, b=1, 32 query : 8 kv heads, against
   the fastest single-GPU kernel torch offers: SDPA under each of the flash, cuDNN and efficient backends
   (``enable_gqa=True``; a backend that refuses it is retimed with k/v repeated inside the timed region),
   the best per phase is the baseline, at S = 16K and 64K, causal and full, d = 128 (and d = 64, 256 at
   16K, causal); and FlexAttention called directly (compiled, one block mask built outside the timed
   region from the mask's rule) for 8 packed documents of 4K, a causal sliding window of 4096 and a
   streaming mask (4 sink tokens + a 4096 window) at S = 32K. Per row: forward and forward+backward
   milliseconds (CUDA events, median of ``--reps`` after 2 warm-ups), TFLOP/s (4 b h d * allowed pairs
   forward, 3.5x that forward+backward), the time ratio cpattn / baseline, the peak memory of each side's
   forward+backward (as allocated, and above what its inputs hold: the figure the table compares), the
   kernel path cpattn's dispatch chose, and exactness: relative error of cpattn's out and gradients
   against the baseline's <= 2e-2. Each masked row starts with empty compile caches, as a process that
   runs only that mask would. Rows run cheapest first; one predicted not to fit in what is left of the
   share is skipped. Printed as one table at the end of the run.
4. ``steady`` (12%): ``cp.attention`` at world 1, S = 8K, causal, document and sliding window: after 3
   warm-up calls one forward+backward must compile nothing (torch._dynamo counters), copy nothing from
   the host to the device (profiler "Memcpy HtoD" events) and synchronise with the host nowhere
   (``torch.cuda.set_sync_debug_mode("warn")``); a count above 0 fails the case. A CUDA graph capture of
   the causal forward+backward (replay against eager, relative difference <= 1e-2) and
   ``torch.compile(fullgraph=True)`` of a cpattn Llama block at S = 8K (compile seconds, difference to
   eager <= 2e-2, eager and compiled milliseconds) run after the causal case, the masked cases last.
5. ``model`` (10%): one training step of a Llama (dim 2048, 8 layers, 16:4 heads, S = 16K, bf16 weights,
   fused AdamW) with cpattn's attention against the same model with the fastest SDPA backend (step ms,
   tokens/s, model TFLOP/s, peak memory); and ``cpattn.integrations.hf_generate.generate`` (32K prefill,
   128 greedy tokens, a small random transformers Llama) against ``model.generate`` with SDPA. Without
   transformers the generation part is recorded as skipped. Measurements only: nothing here fails the run
   unless it raises.
6. ``multirank`` (16%): ranks sharing cuda:0. Two NCCL ranks must be refused by cpattn (naming the staged
   gloo alternative) before NCCL's first operation; then P = 2 and P = 4 gloo ranks (one launch each) run
   every registered schedule x causal, full, document x bfloat16, float32 against the float64 reference,
   transfers staged through pinned host buffers (``--multirank-schedules`` narrows the schedules).

``bench`` (only with ``--sections bench``): forward and forward+backward time of each fused path against
SDPA's flash backend at S = 8K..64K (``--seqs``).

Usage: ``python scripts/gpu_check.py`` writes ``gpu_check.json`` (``$OUT/gpu_check.json`` when ``$OUT`` is
set; ``--out``). ``--sections a,b`` runs only those sections (the selected ones share the budget in
proportion to their shares), ``--skip a,b`` leaves some out, ``--quick`` runs smaller matrices.
``--device cpu`` is for the tests only: tiny shapes on the CPU, which exercise the harness, not the GPU.
At the end the run prints the parity table and a summary naming every failure. Exit status 0 when every
check that ran passed (exactness, context_parallel, parity exactness, steady counts, graph, compile,
multirank), 1 when one failed, 2 when CUDA is absent.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: torch is imported where the work starts, after the argument check
    import torch
    from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: the sections a plain run runs, in order, with their shares of the budget (they sum to 1)
SHARES = {"exactness": 0.20, "context_parallel": 0.06, "parity": 0.36, "steady": 0.12, "model": 0.10,
          "multirank": 0.16}
#: sections that run only when named in --sections, with the share they would take
EXTRA_SHARES = {"bench": 0.25}
#: relative error allowed between cpattn and the baseline in bfloat16 (parity) and between a replay or a
#: compiled call and eager (steady)
PARITY_TOL = 2e-2
GRAPH_TOL = 1e-2
COMPILE_TOL = 2e-2
SKIPPED_TIME = "time budget of the section spent"
REFUSED = "the schedule refuses this mask"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    default_out = str(Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else "gpu_check.json"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=default_out, help=f"JSON report path (default {default_out})")
    p.add_argument("--quick", action="store_true",
                   help="smaller matrices: fewer dtypes, one context_parallel round, parity at 16K only, bench at 8K")
    p.add_argument("--seqs", default="8192,16384,32768,65536", help="bench sequence lengths")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement (after 2 warm-ups)")
    p.add_argument("--budget", type=float, default=300.0,
                   help="seconds for the whole run (default 300); each section gets a share and records the "
                        "cases it had no time for as skipped")
    p.add_argument("--sections", default=",".join(SHARES),
                   help=f"comma-separated sections to run, in this order (default: {','.join(SHARES)}; "
                        f"also: {','.join(EXTRA_SHARES)})")
    p.add_argument("--skip", default="", help="comma-separated sections to leave out")
    p.add_argument("--multirank-schedules", default="",
                   help="comma-separated schedules for the multirank section (default: every registered one)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="for the tests only: 'cpu' runs the sections with tiny shapes on the CPU, which checks "
                        "the harness and measures nothing")
    args = p.parse_args(argv)
    known = {*SHARES, *EXTRA_SHARES}
    for flag in ("sections", "skip"):
        unknown = [s for s in getattr(args, flag).split(",") if s and s not in known]
        if unknown:
            p.error(f"--{flag}: unknown section(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return args


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------ device helpers
# Every call that exists only on CUDA is in one of these, so that the sections run unchanged on the CPU.
def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _sync(device: torch.device) -> None:
    import torch

    if _is_cuda(device):
        torch.cuda.synchronize(device)


def _time_ms(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after ``warmup`` runs: CUDA events on CUDA,
    ``time.perf_counter`` on the CPU."""
    import torch

    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if _is_cuda(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _wall(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``fn()`` and its wall seconds, the device drained before and after."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def _reset_peak(device: torch.device) -> float | None:
    """Start a new peak; returns the GiB allocated now (what the next peak holds before it starts; None on
    the CPU)."""
    import torch

    if _is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)
        return round(torch.cuda.memory_allocated(device) / 2**30, 3)
    return None


def _peak_gib(device: torch.device) -> float | None:
    """Peak allocated device memory since the last :func:`_reset_peak` (None on the CPU)."""
    import torch

    if _is_cuda(device):
        return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    return None


def _free(device: torch.device) -> None:
    """Give back what the last row held, so that the next one starts from the same memory."""
    import torch

    gc.collect()
    if _is_cuda(device):
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _host_syncs(device: torch.device) -> Iterator[list[str]]:
    """Collect the host synchronisations inside the block: on CUDA, ``set_sync_debug_mode("warn")`` makes
    each one a warning (autograd's worker threads hand theirs to the calling thread); the CPU has none.
    The mode is switched off before the block's caller synchronises on purpose."""
    import torch

    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every occurrence, not once per call site
        if _is_cuda(device):
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            if _is_cuda(device):
                torch.cuda.set_sync_debug_mode(0)
    found.extend(str(w.message)[:300] for w in caught if "synchroniz" in str(w.message).lower())


def _profiler(device: torch.device) -> torch.profiler.profile:
    import torch
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _is_cuda(device) else [])
    return torch.profiler.profile(activities=activities)


def _graphed(fn: Callable[[], Any], device: torch.device) -> tuple[Callable[[], Any], str]:
    """``(replay, how)``: on CUDA ``fn`` captured in a CUDA graph after three warm-up calls on a side stream
    (as torch.cuda.graph requires), ``replay()`` running the graph and returning the captured outputs; on
    the CPU, which has no graphs, ``fn`` itself, so that the comparison around it still runs."""
    import torch

    if not _is_cuda(device):
        return fn, "eager stand-in (no CUDA graphs on the CPU)"
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()

    def replay() -> Any:
        graph.replay()
        return static
    return replay, "torch.cuda.graph"


def _generator(device: torch.device, seed: int) -> torch.Generator:
    import torch

    return torch.Generator(device=device).manual_seed(seed)


def _dynamo_counts() -> dict[str, int]:
    """Compiled graphs, frames dynamo converted (each cache miss) and recompiles so far in this process."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "frames": int(counters["frames"].get("total", 0)),
            "recompiles": int(sum(counters.get("recompiles", {}).values()))}


def _reset_compiled() -> None:
    """Forget every compiled function: a row that times compiled FlexAttention then sees what a process
    that runs only its mask sees. Without it, earlier rows and sections spend the per-function recompile
    limit (8) of ``flex_attention``, after which torch runs it unfused, and later rows would time that."""
    import torch

    torch._dynamo.reset()


# ------------------------------------------------------------------------------------ shared pieces
def _error_of(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()[:2000]


def _failed(case: dict, exc: BaseException) -> dict:
    case.update(ok=False, error=_error_of(exc), trace=traceback.format_exc()[-3000:])
    return case


def _rel(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b|| in float32 (inputs of any dtype; inf when a is not finite)."""
    import torch

    a32, b32 = a.detach().float(), b.detach().float()
    if not bool(torch.isfinite(a32).all()):
        return float("inf")
    return float((a32 - b32).norm() / b32.norm().clamp(min=1e-30))


def _sizes(device: torch.device, quick: bool) -> dict:
    """The shapes each section runs: the GPU's, or tiny ones on the CPU (the tests)."""
    if _is_cuda(device):
        dense = [(16384, "causal", 128), (16384, "full", 128), (16384, "causal", 64), (16384, "causal", 256),
                 (65536, "causal", 128), (65536, "full", 128)]
        return {
            "cp_seq": 256, "cp_schedules": None,
            "parity": {"heads": 32, "kv_heads": 8, "dense": [r for r in dense if not quick or r[0] == 16384],
                       "masked_seq": 32768,
                       "masked": [{"kind": "document", "lengths": [4096] * 8},
                                  {"kind": "sliding_window", "window": 4096},
                                  {"kind": "streaming", "sink": 4, "window": 4096}],
                       "sdpa": ("flash", "cudnn", "efficient")},
            "steady": {"seq": 8192, "heads": 32, "kv_heads": 8, "d": 128,
                       "masks": [{"kind": "causal"}, {"kind": "document", "lengths": [3000, 1000, 4192]},
                                 {"kind": "sliding_window", "window": 1024}],
                       "block": {"dim": 2048, "heads": 16, "kv_heads": 4, "ffn_dim": 5632}},
            "model": {"llama": {"vocab": 32000, "dim": 2048, "layers": 8, "heads": 16, "kv_heads": 4,
                                "ffn_dim": 5632}, "seq": 16384,
                      "hf": {"hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16,
                             "num_key_value_heads": 4, "intermediate_size": 2816, "vocab_size": 32000},
                      "prompt": 32768, "new_tokens": 128},
        }
    return {
        "cp_seq": 64, "cp_schedules": ["ring", "zigzag_ring", "allgather", "ringx1o", "ringx4o", "ulysses"],
        "parity": {"heads": 4, "kv_heads": 1,
                   "dense": [(128, "causal", 16), (128, "full", 16), (128, "causal", 8), (128, "causal", 32)],
                   "masked_seq": 128,
                   "masked": [{"kind": "document", "lengths": [16] * 8}, {"kind": "sliding_window", "window": 16},
                              {"kind": "streaming", "sink": 4, "window": 16}],
                   "sdpa": ("flash", "efficient")},  # efficient does not exist on the CPU: its refusal is recorded
        "steady": {"seq": 256, "heads": 8, "kv_heads": 2, "d": 32,
                   "masks": [{"kind": "causal"}, {"kind": "document", "lengths": [100, 60, 96]},
                             {"kind": "sliding_window", "window": 32}],
                   "block": {"dim": 64, "heads": 4, "kv_heads": 1, "ffn_dim": 128}},
        "model": {"llama": {"vocab": 128, "dim": 64, "layers": 2, "heads": 4, "kv_heads": 1, "ffn_dim": 128},
                  "seq": 256,
                  "hf": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 1, "intermediate_size": 128, "vocab_size": 128},
                  "prompt": 256, "new_tokens": 8},
    }


def _sdpa(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, allowed: Tensor | None, causal: bool, scale: float
          ) -> dict[str, Tensor]:
    """out, dq, dk, dv of torch SDPA in the inputs' dtype ([b, s, h, d] in and out)."""
    import torch.nn.functional as F

    qg, kg, vg = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    mask = None if causal or allowed is None else allowed
    out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=k.shape[2] != q.shape[2])
    out.backward(dout.transpose(1, 2))
    return {"out": out.detach().transpose(1, 2), "dq": qg.grad.transpose(1, 2), "dk": kg.grad.transpose(1, 2),
            "dv": vg.grad.transpose(1, 2)}


def _tolerances(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, allowed: Tensor, kind: Any, scale: float
                ) -> tuple[dict[str, float], dict[str, float]]:
    """2 * e_local + 1e-6 per quantity, e_local from SDPA in the inputs' dtype."""
    from cpattn.masks import BlockKind

    from cpattn.exactness import reference, rel_error

    filled = allowed.clone()
    filled[~filled.any(1)] = True  # SDPA gives NaN on rows with no key
    ref = reference(q, k, v, dout, filled, scale)
    got = _sdpa(q, k, v, dout, filled, kind == BlockKind.CAUSAL, scale)
    e = {n: rel_error(got[n], ref[n]) for n in ("out", "dq", "dk", "dv")}
    e["lse"] = e["out"]
    return {n: 2 * x + 1e-6 for n, x in e.items()}, e


def _merge(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Log-sum-exp merge of [(out [b,s,h,d] float32, lse [b,h,s] float32), ...]."""
    import torch

    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    out = sum(o * torch.exp(lb - safe).transpose(1, 2).unsqueeze(-1) for o, lb in parts)
    return out, lse


def _judge(got: dict, ref: dict, tol: dict, empty_rows: Tensor) -> dict:
    from cpattn.exactness import rel_error

    errors = {n: rel_error(got[n], ref[n]) for n in ("out", "lse", "dq", "dk", "dv")}
    problems = [f"{n}: {errors[n]:.3g} > {tol[n]:.3g}" for n in errors if not errors[n] <= tol[n]]
    if empty_rows.any():
        if not bool((got["out"][:, empty_rows] == 0).all()) or not bool((got["dq"][:, empty_rows] == 0).all()):
            problems.append("rows with no key: out or dq not exactly 0")
        if not bool(got["lse"][:, :, empty_rows].isneginf().all()):
            problems.append("rows with no key: lse not -inf")
    return {"errors": errors, "ok": not problems, "problems": problems}


# ------------------------------------------------------------------------------------ 1. exactness
def exactness(device: torch.device, deadline: float, quick: bool = False) -> list[dict]:
    import torch
    from cpattn.masks import BlockKind

    from cpattn import kernels
    from cpattn.exactness import reference

    dev = device
    available = kernels.available_kernels(dev)
    log(f"available kernel paths: {sorted(available)}")
    results = []
    if _is_cuda(dev):
        # Flex last: its cases compile Triton kernels, the slowest part of the section
        paths = ["flash_cuda", "cudnn_cuda", "efficient_cuda", *kernels.PACKAGE_BACKENDS, "math", "flex_cuda"]
        dtypes = [torch.bfloat16, torch.float32] if quick else [torch.float16, torch.bfloat16, torch.float32]
    else:
        paths, dtypes = ["flash_cpu", "math"], [torch.bfloat16, torch.float32]
    d, h, b, scale = 64, 8, 2, 0.125
    for path in paths:
        if path not in available:
            results.append({"path": path, "skipped": "not available on this machine"})
            continue
        kinds = [BlockKind.PARTIAL] if path == "flex_cuda" else [BlockKind.FULL, BlockKind.CAUSAL]
        if path == "math":
            kinds = [BlockKind.FULL, BlockKind.CAUSAL, BlockKind.PARTIAL]
        for kind in kinds:
            for dtype in dtypes:
                if not kernels.kernel_fits(path, dtype, d):
                    continue
                for hkv in (h, h // 4):
                    sq = 200  # not a multiple of 32 or 128: exercises the lse padding and ragged tiles
                    sk = sq if kind == BlockKind.CAUSAL else 328
                    case = {"path": path, "kind": kind.value, "dtype": str(dtype).replace("torch.", ""),
                            "gqa": h // hkv, "s_q": sq, "s_kv": sk}
                    if time.time() >= deadline:
                        results.append({**case, "skipped": SKIPPED_TIME})
                        continue
                    try:
                        gen = _generator(dev, len(results))
                        q, k, v, dout = (torch.randn(b, s, n, d, generator=gen, device=dev, dtype=torch.float64)
                                         .to(dtype) for s, n in ((sq, h), (sk, hkv), (sk, hkv), (sq, h)))
                        if kind == BlockKind.FULL:
                            allowed, mask = torch.ones(sq, sk, dtype=torch.bool, device=dev), None
                        elif kind == BlockKind.CAUSAL:
                            allowed, mask = torch.ones(sq, sk, dtype=torch.bool, device=dev).tril(), None
                        else:
                            allowed = torch.rand(sq, sk, generator=gen, device=dev) < 0.3
                            allowed[5] = False  # a row with no key
                            allowed[7, : sk // 2] = False  # empty in the first split block only
                            mask = allowed
                        tol, e_local = _tolerances(q, k, v, dout, allowed, kind, scale)
                        ref = reference(q, k, v, dout, allowed, scale)
                        empty = ~allowed.any(1)
                        out, lse = kernels.forward_with(path, q, k, v, kind, scale, mask)
                        grads = kernels.backward_with(path, dout, q, k, v, out.to(dtype), lse, kind, scale, mask)
                        got = {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
                        case.update(e_local=e_local, whole=_judge(got, ref, tol, empty))
                        if kind != BlockKind.CAUSAL:
                            case["split"] = _judge(_split(path, q, k, v, dout, kind, scale, mask), ref, tol, empty)
                        case["ok"] = case["whole"]["ok"] and case.get("split", {"ok": True})["ok"]
                    except Exception as exc:  # one broken path must not hide the others
                        _failed(case, exc)
                    results.append(case)
                    status = "ok" if case["ok"] else f"FAIL {case.get('error') or case['whole']['problems']}"
                    log(f"exactness {path} {case['kind']} {case['dtype']} gqa={case['gqa']}: {status}")
    if "flex_cuda" in available:
        results += softcap_exactness(dev, dtypes, deadline)
    return results


def _capped_reference(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, allowed: Tensor, scale: float, cap: float
                      ) -> dict[str, Tensor]:
    """Soft-capped attention and its gradients in float64, plain torch autograd (GQA by repeating heads)."""
    import torch

    with torch.enable_grad():
        q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
        groups = q.shape[2] // k.shape[2]
        s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(groups, 2)) * scale
        s = (torch.tanh(s / cap) * cap).masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        out = torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(groups, 2))
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.double())
    return {"out": out.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}


def softcap_exactness(device: torch.device, dtypes: list[torch.dtype], deadline: float) -> list[dict]:
    """Soft-capped blocks (Gemma 2's ``tanh(s / c) * c``) on flex_cuda, the path ``auto`` gives them on
    CUDA: forward and backward of every block kind against a float64 autograd reference, whole and split."""
    import torch
    from cpattn.masks import BlockKind

    from cpattn import kernels

    dev, d, h, hkv, b, scale, cap = device, 64, 8, 2, 2, 0.125, 0.5
    results = []
    for kind in (BlockKind.FULL, BlockKind.CAUSAL, BlockKind.PARTIAL):
        for dtype in dtypes:
            sq = 200
            sk = sq if kind == BlockKind.CAUSAL else 328
            case = {"path": "flex_cuda", "softcap": cap, "kind": kind.value,
                    "dtype": str(dtype).replace("torch.", ""), "gqa": h // hkv, "s_q": sq, "s_kv": sk}
            if time.time() >= deadline:
                results.append({**case, "skipped": SKIPPED_TIME})
                continue
            try:
                assert kernels.kernel_for(torch.empty(1, 1, h, d, device=dev, dtype=dtype), kind,
                                          softcap=cap) == "flex_cuda", "auto does not send capped blocks to flex"
                gen = _generator(dev, 100 + len(results))
                q, k, v, dout = (torch.randn(b, s, n, d, generator=gen, device=dev, dtype=torch.float64).to(dtype)
                                 for s, n in ((sq, h), (sk, hkv), (sk, hkv), (sq, h)))
                q = (q * 4).to(dtype)  # scores past the cap
                allowed = torch.ones(sq, sk, dtype=torch.bool, device=dev)
                if kind == BlockKind.CAUSAL:
                    allowed = allowed.tril()
                elif kind == BlockKind.PARTIAL:
                    allowed = torch.rand(sq, sk, generator=gen, device=dev) < 0.3
                    allowed[5] = False
                mask = allowed if kind == BlockKind.PARTIAL else None
                tol, e_local = _tolerances(q, k, v, dout, allowed, kind, scale)
                ref = _capped_reference(q, k, v, dout, allowed, scale, cap)
                empty = ~allowed.any(1)
                out, lse = kernels.forward(q, k, v, kind, scale, mask, softcap=cap)
                dq, dk, dv = kernels.backward(dout, q, k, v, out.to(dtype), lse, kind, scale, mask, softcap=cap)
                got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
                case.update(e_local=e_local, whole=_judge(got, ref, tol, empty))
                case["ok"] = case["whole"]["ok"]
            except Exception as exc:
                _failed(case, exc)
            results.append(case)
            status = "ok" if case["ok"] else f"FAIL {case.get('error') or case['whole']['problems']}"
            log(f"exactness flex_cuda softcap {case['kind']} {case['dtype']}: {status}")
    return results


def _split(path: str, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, kind: Any, scale: float,
           mask: Tensor | None) -> dict[str, Tensor]:
    """The keys in two blocks, merged, each block's backward from the merged out and lse."""
    import torch

    from cpattn import kernels

    sk = k.shape[1]
    cols = [slice(0, sk // 2), slice(sk // 2, sk)]
    masks = [None if mask is None else mask[:, c] for c in cols]
    parts = [kernels.forward_with(path, q, k[:, c], v[:, c], kind, scale, m) for c, m in zip(cols, masks)]
    out, lse = _merge(parts)
    dq = torch.zeros_like(out)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros_like(dk)
    for c, m in zip(cols, masks):
        g = kernels.backward_with(path, dout, q, k[:, c], v[:, c], out.to(q.dtype), lse, kind, scale, m)
        dq += g[0]
        dk[:, c] += g[1]
        dv[:, c] += g[2]
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


# ------------------------------------------------------------------------------------ bench (on request)
def _bench_sdpa(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool, scale: float, reps: int,
                device: torch.device) -> dict:
    """SDPA under the flash backend: forward and forward+backward milliseconds."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt, dt = (x.transpose(1, 2) for x in (q, k, v, dout))

    def fwd() -> Tensor:
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale, enable_gqa=True)

    def fwd_bwd() -> None:
        qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale, enable_gqa=True).backward(dt)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        with torch.no_grad():
            fwd_ms = _time_ms(fwd, device, reps)
        return {"fwd": fwd_ms, "fwd_bwd": _time_ms(fwd_bwd, device, reps)}


def _bench_path(path: str, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, kind: Any, scale: float,
                mask: Tensor | None, reps: int, device: torch.device) -> dict:
    """One kernel path through the contract (float32 results included): forward and forward+backward."""
    from cpattn import kernels

    out, lse = kernels.forward_with(path, q, k, v, kind, scale, mask)
    out = out.to(q.dtype)

    def fwd() -> tuple[Tensor, Tensor]:
        return kernels.forward_with(path, q, k, v, kind, scale, mask)

    def fwd_bwd() -> None:
        kernels.forward_with(path, q, k, v, kind, scale, mask)
        kernels.backward_with(path, dout, q, k, v, out, lse, kind, scale, mask)

    return {"fwd": _time_ms(fwd, device, reps), "fwd_bwd": _time_ms(fwd_bwd, device, reps)}


def bench(device: torch.device, deadline: float, seqs: list[int], reps: int) -> list[dict]:
    import torch
    from cpattn.masks import BlockKind

    from cpattn import kernels

    available = kernels.available_kernels(device)
    b, h, hkv, d, dtype, scale = 1, 32, 8, 128, torch.bfloat16, 128 ** -0.5
    if not _is_cuda(device):
        h, hkv, d, scale, seqs = 8, 2, 32, 32 ** -0.5, [256]
    fused = [p for p in ("flash_cuda", "cudnn_cuda", "efficient_cuda", *kernels.PACKAGE_BACKENDS, "flex_cuda",
                       "flash_cpu")
             if p in available]
    rows = []
    for s in seqs:
        x = {n: torch.randn(b, s, hh, d, device=device, dtype=dtype) for n, hh in (("q", h), ("k", hkv),
                                                                                 ("v", hkv), ("dout", h))}
        args = (x["q"], x["k"], x["v"], x["dout"])
        for kind in (BlockKind.CAUSAL, BlockKind.FULL):
            causal = kind == BlockKind.CAUSAL
            row = {"s": s, "kind": kind.value, "flops_fwd": 4 * b * h * d * s * s // (2 if causal else 1)}
            if time.time() >= deadline:
                rows.append({**row, "skipped": SKIPPED_TIME})
                continue
            try:
                row.update({f"sdpa_flash_{ph}_ms": ms
                            for ph, ms in _bench_sdpa(*args, causal, scale, reps, device).items()})
            except Exception as exc:
                row["sdpa_flash_error"] = _error_of(exc)
            for path in fused:
                pk, mask = kind, None
                if path == "flex_cuda":
                    if s > 16384 or not causal:
                        continue  # the dense mask of one block is s x s bytes
                    pk, mask = BlockKind.PARTIAL, torch.ones(s, s, dtype=torch.bool, device=device).tril()
                try:
                    for phase, ms in _bench_path(path, *args, pk, scale, mask, reps, device).items():
                        row[f"{path}_{phase}_ms"] = ms
                        if row.get(f"sdpa_flash_{phase}_ms"):
                            row[f"{path}_{phase}_vs_sdpa"] = row[f"sdpa_flash_{phase}_ms"] / ms
                except Exception as exc:
                    row[f"{path}_error"] = _error_of(exc)
            rows.append(row)
            ratios = {key: round(val, 3) for key, val in row.items() if key.endswith("_vs_sdpa")}
            log(f"bench S={s} {kind.value}: sdpa flash fwd {row.get('sdpa_flash_fwd_ms', float('nan')):.2f} ms; "
                f"speed relative to it {ratios}")
        del x, args
        _free(device)
    return rows


# ------------------------------------------------------------------------------------ 2. ContextParallel
def _cp_case(case: dict, spec: dict, judged: dict, shape: tuple[int, ...], device: torch.device) -> dict:
    """Run one ``ContextParallel`` case (``case``: schedule, mask, dtype) on the default process group (a
    one-rank world without one) and judge it like ``cpattn verify``: ``case`` gains errors, e_local, ok,
    problems (or error). ``judged`` caches inputs, reference and e_local per (mask, dtype, kv heads): every
    rank draws the same inputs from the same seed, so every rank judges the whole sequence alike."""
    import torch
    from cpattn.masks import from_spec

    import cpattn
    from cpattn.exactness import dense_mask, local_errors, reference, rel_error

    b, seq, h, hkv, d = shape
    scale = d ** -0.5
    try:
        dtype = getattr(torch, case["dtype"])
        key = (case["mask"], case["dtype"], hkv)
        if key not in judged:
            args = {k: v for k, v in spec.items() if k != "kind"} or None
            allowed = dense_mask(case["mask"], seq, args, device=device)
            gen = _generator(device, len(judged))
            x = {n: torch.randn(b, seq, hh, d, generator=gen, device=device, dtype=torch.float64).to(dtype)
                 for n, hh in (("q", h), ("k", hkv), ("v", hkv), ("dout", h))}
            ref = reference(x["q"], x["k"], x["v"], x["dout"], allowed, scale)
            judged[key] = (x, ref, local_errors(x, case["mask"], scale, allowed, ref))
        x, ref, e_local = judged[key]
        cp = cpattn.ContextParallel(seq, from_spec(spec), case["schedule"])
        q, k, v = (cp.shard(x[n], dim=1).detach().requires_grad_() for n in ("q", "k", "v"))
        out, lse = cp.attention(q, k, v, softmax_scale=scale, return_lse=True)
        out.backward(cp.shard(x["dout"], dim=1))
        got = {"out": cp.unshard(out, dim=1), "lse": cp.unshard(lse, dim=2), "dq": cp.unshard(q.grad, dim=1),
               "dk": cp.unshard(k.grad, dim=1), "dv": cp.unshard(v.grad, dim=1)}
        errors = {n: rel_error(got[n].detach(), ref[n]) for n in got}
        bad = [n for n in errors if not errors[n] <= 2 * e_local[n] + 1e-6]
        case.update(errors=errors, e_local=e_local, ok=not bad, problems=bad)
    except Exception as exc:
        _failed(case, exc)
    return case


def _refusal(schedule: str, spec: dict) -> str | None:
    """Why ``schedule`` refuses the mask ``spec`` (None: it accepts it), from the registry."""
    from cpattn.masks import from_spec

    from cpattn import schedules

    try:
        schedules.get(schedule).check_mask(from_spec(spec))
    except (ValueError, NotImplementedError) as exc:
        return str(exc)[:300]
    return None


def context_parallel(device: torch.device, deadline: float, quick: bool = False) -> list[dict]:
    """Every registered schedule x causal, full, sliding_window, document at world 1; refused pairs skipped.
    Round one runs every pair in bfloat16 with GQA 4, round two (not with ``quick``) in float32 with GQA 1,
    so that a budget cut leaves every pair checked once. The reference and e_local of one (mask, dtype,
    GQA) are the same inputs for every schedule and are computed once."""
    from cpattn import schedules
    from cpattn.exactness import example_mask_args

    sizes = _sizes(device, quick)
    seq, b, h, d = sizes["cp_seq"], 2, 8, 64
    if not _is_cuda(device):
        b, d = 1, 16
    names = sizes["cp_schedules"] or schedules.names()
    masks = ["causal", "full", "sliding_window", "document"]
    rounds = [("bfloat16", h // 4)] + ([] if quick else [("float32", h)])
    judged: dict[tuple, tuple] = {}  # (mask, dtype, hkv) -> (inputs, reference, e_local)
    results = []
    for dtype_name, hkv in rounds:
        for schedule in names:
            for mask_name in masks:
                case = {"schedule": schedule, "mask": mask_name, "dtype": dtype_name, "gqa": h // hkv}
                args = example_mask_args(mask_name, seq)
                spec = {"kind": mask_name, **(args or {})}
                why = _refusal(schedule, spec)
                if why is not None:
                    results.append({**case, "skipped": REFUSED, "reason": why})
                    continue
                if time.time() >= deadline:
                    results.append({**case, "skipped": SKIPPED_TIME})
                    continue
                _cp_case(case, spec, judged, (b, seq, h, hkv, d), device)
                results.append(case)
                status = "ok" if case["ok"] else f"FAIL {case.get('error') or case['problems']}"
                log(f"context_parallel {schedule} {mask_name} {dtype_name} gqa={case['gqa']}: {status}")
    return results


# ------------------------------------------------------------------------------------ 3. parity
#: the columns of the parity table: (header, how a row gives the cell)
PARITY_COLUMNS: list[tuple[str, Callable[[dict], str]]] = []


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}" if abs(x) >= 10 ** -digits or x == 0 else f"{x:.1e}"
    return str(x)


def _col(header: str, fn: Callable[[dict], Any], digits: int = 2) -> None:
    PARITY_COLUMNS.append((header, lambda r: "" if "skipped" in r and header not in ("row", "note")
                           else _fmt(fn(r), digits)))


_col("row", lambda r: r["row"])
_col("baseline", lambda r: r.get("baseline"))
_col("cpattn kernel", lambda r: r.get("kernel"))
_col("fwd ms cp", lambda r: r.get("cp", {}).get("fwd_ms"))
_col("fwd ms base", lambda r: r.get("base", {}).get("fwd_ms"))
_col("fwd cp/base", lambda r: r.get("ratio_fwd"))
_col("f+b ms cp", lambda r: r.get("cp", {}).get("fwd_bwd_ms"))
_col("f+b ms base", lambda r: r.get("base", {}).get("fwd_bwd_ms"))
_col("f+b cp/base", lambda r: r.get("ratio_fwd_bwd"))
_col("TFLOP/s fwd cp", lambda r: r.get("cp", {}).get("fwd_tflops"), 0)
_col("TFLOP/s fwd base", lambda r: r.get("base", {}).get("fwd_tflops"), 0)
_col("TFLOP/s f+b cp", lambda r: r.get("cp", {}).get("fwd_bwd_tflops"), 0)
_col("TFLOP/s f+b base", lambda r: r.get("base", {}).get("fwd_bwd_tflops"), 0)
_col("peak GiB cp", lambda r: r.get("cp", {}).get("peak_over_inputs_gib"))  # above the inputs: a fair comparison
_col("peak GiB base", lambda r: r.get("base", {}).get("peak_over_inputs_gib"))
_col("max rel err", lambda r: max(r["errors"].values()) if r.get("errors") else None, 4)
_col("exact", lambda r: r.get("exact"))
_col("note", lambda r: r.get("skipped") or r.get("error") or r.get("note"))


def _tflops(flops: float, ms: float | None) -> float | None:
    return None if not ms else flops / (ms * 1e-3) / 1e12


def _attention_result(fn: Callable[[], Any], leaves: list[Tensor], dout: Tensor) -> dict[str, Tensor]:
    """out and the gradients of ``leaves`` from one call of ``fn`` (which returns out)."""
    import torch

    out = fn()
    grads = torch.autograd.grad(out, leaves, dout)
    return {"out": out.detach(), "dq": grads[0], "dk": grads[1], "dv": grads[2]}


def _time_side(fwd: Callable[[], Any], fwd_bwd: Callable[[], Any], device: torch.device, reps: int,
               flops_fwd: float) -> dict:
    """Forward (no grad) and forward+backward milliseconds, TFLOP/s and the peak memory of the latter:
    ``peak_gib`` as torch.cuda.max_memory_allocated gives it, ``peak_over_inputs_gib`` less what was
    allocated before the calls (the inputs, and the copies a baseline makes of them in its own layout), the
    figure that compares two sides."""
    import torch

    with torch.no_grad():
        fwd_ms = _time_ms(fwd, device, reps)
    held = _reset_peak(device)
    fb_ms = _time_ms(fwd_bwd, device, reps)
    peak = _peak_gib(device)
    return {"fwd_ms": fwd_ms, "fwd_bwd_ms": fb_ms, "fwd_tflops": _tflops(flops_fwd, fwd_ms),
            "fwd_bwd_tflops": _tflops(3.5 * flops_fwd, fb_ms), "peak_gib": peak,
            "peak_over_inputs_gib": None if peak is None else round(peak - held, 3)}


SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def _sdpa_call(causal: bool, scale: float, groups: int, native: bool) -> Callable:
    """SDPA on ``[b, h, s, d]`` views; with ``native`` False the key/value heads are repeated inside the
    call, so that a backend without grouped-query support pays for the copy where it is timed."""
    import torch.nn.functional as F

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if not native and groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=native and groups > 1)
    return call


def _sdpa_backend(name: str, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool, scale: float,
                  device: torch.device, reps: int, flops_fwd: float) -> dict:
    """One SDPA backend on bshd tensors (passed as their [b, h, s, d] transposes, as models call SDPA):
    times, TFLOP/s, peak memory and how it took GQA; ``{"error": ...}`` when it runs neither way."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    groups = q.shape[2] // k.shape[2]
    backend = getattr(SDPBackend, SDPA_BACKENDS[name])
    qt, kt, vt, dt = (x.transpose(1, 2) for x in (q, k, v, dout))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    errors = {}
    for native in (True, False) if groups > 1 else (True,):
        call = _sdpa_call(causal, scale, groups, native)

        def fwd_bwd(call: Callable = call) -> tuple[Tensor, ...]:
            out = call(*(x.transpose(1, 2) for x in leaves))
            return torch.autograd.grad(out, leaves, dt)

        try:
            with sdpa_kernel(backend), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the reasons a backend declines, repeated on every call
                side = _time_side(lambda call=call: call(qt, kt, vt), fwd_bwd, device, reps, flops_fwd)
            return {**side, "gqa": "native" if native or groups == 1 else "repeat_interleave", **(
                {"native_error": errors["native"]} if errors else {})}
        except Exception as exc:
            errors["native" if native else "repeat_interleave"] = _error_of(exc)[:300]
    return {"error": errors}


def _sdpa_outputs(name: str, gqa: str, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool,
                  scale: float) -> dict:
    """out and gradients of one SDPA backend in the way it ran (for the exactness comparison)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    groups = q.shape[2] // k.shape[2]
    call = _sdpa_call(causal, scale, groups, gqa == "native")
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[name])), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = _attention_result(lambda: call(*(x.transpose(1, 2) for x in leaves)), leaves, dout.transpose(1, 2))
    res["out"] = res["out"].transpose(1, 2)
    return res


def best_sdpa(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool, scale: float, device: torch.device,
              reps: int, flops_fwd: float, names: tuple[str, ...]) -> dict:
    """Every SDPA backend of ``names`` timed; ``best`` per phase among those that ran."""
    backends = {n: _sdpa_backend(n, q, k, v, dout, causal, scale, device, reps, flops_fwd) for n in names}
    ran = {n: r for n, r in backends.items() if "error" not in r}
    winner = {ph: min(ran, key=lambda n: ran[n][f"{ph}_ms"]) if ran else None for ph in ("fwd", "fwd_bwd")}
    return {"backends": backends, "winner": winner}


def _flex_rule(spec: dict, device: torch.device) -> Callable:
    """The mask of ``spec`` as a FlexAttention ``mask_mod`` on index tensors (its definition in the mask's
    docstring, written again here so that the baseline does not borrow cpattn's code)."""
    import torch

    kind = spec["kind"]
    if kind == "document":
        lengths = torch.tensor(spec["lengths"], device=device)
        doc = torch.repeat_interleave(torch.arange(len(spec["lengths"]), device=device), lengths)
        causal = spec.get("causal", True)
        return lambda b, h, q, kv: (doc[q] == doc[kv]) & ((kv <= q) | (not causal))
    if kind == "sliding_window":
        w = spec["window"]
        if spec.get("causal", True):
            return lambda b, h, q, kv: (kv <= q) & (q - kv < w)
        return lambda b, h, q, kv: (q - kv < w) & (kv - q < w)
    if kind == "streaming":
        sink, w, bs = spec["sink"], spec["window"], spec.get("block_size", 1)
        return lambda b, h, q, kv: (kv <= q) & ((kv // bs < sink) | (q // bs - kv // bs < w))
    raise ValueError(f"no FlexAttention rule for mask {kind!r}")


def _flex_side(spec: dict, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, scale: float, device: torch.device,
               reps: int, flops_fwd: float) -> tuple[dict, dict]:
    """FlexAttention called directly on contiguous [b, h, s, d] copies (its own layout), compiled on CUDA,
    its block mask built once here, outside every timed call: ``(times, outputs)``. The CPU has no
    FlexAttention backward: its forward runs unfused there and the backward is recorded as skipped."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    s = q.shape[1]
    block_mask = create_block_mask(_flex_rule(spec, device), None, None, s, s, device=device)
    fn = torch.compile(flex_attention) if _is_cuda(device) else flex_attention
    qf, kf, vf, df = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))

    def call(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
        return fn(a, b, c, block_mask=block_mask, scale=scale, enable_gqa=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unfused CPU form warns on every call
        if not _is_cuda(device):
            with torch.no_grad():
                fwd_ms = _time_ms(lambda: call(qf, kf, vf), device, reps)
                out = call(qf, kf, vf).transpose(1, 2)
            return ({"fwd_ms": fwd_ms, "fwd_tflops": _tflops(flops_fwd, fwd_ms), "peak_gib": None,
                     "peak_over_inputs_gib": None,
                     "fwd_bwd_skipped": "FlexAttention has no backward on the CPU"}, {"out": out})
        leaves = [x.detach().requires_grad_() for x in (qf, kf, vf)]

        def fwd_bwd() -> tuple[Tensor, ...]:
            return torch.autograd.grad(call(*leaves), leaves, df)

        side = _time_side(lambda: call(qf, kf, vf), fwd_bwd, device, reps, flops_fwd)
        res = _attention_result(lambda: call(*leaves), leaves, df)
    return side, {n: t.transpose(1, 2) for n, t in res.items()}


def _parity_row(spec: dict, s: int, d: int, sizes: dict, device: torch.device, reps: int) -> dict:
    """One row: cp.attention ("ring", world 1) against SDPA's best backend (causal, full) or FlexAttention."""
    import torch
    from cpattn.masks import BlockKind, allowed_pairs, from_spec

    import cpattn
    from cpattn import kernels

    b, h, hkv, dtype = 1, sizes["heads"], sizes["kv_heads"], torch.bfloat16
    kind = spec["kind"]
    dense = kind in ("causal", "full")
    mask = from_spec(spec)
    pairs = allowed_pairs(mask, s)
    flops = 4 * b * h * d * pairs
    row = {"row": f"{s // 1024}K {kind} d{d}" if s >= 1024 else f"S={s} {kind} d{d}", "mask": spec, "s": s, "d": d,
           "b": b, "h": h, "h_kv": hkv, "dtype": "bfloat16", "allowed_pairs": pairs, "flops_fwd": flops}
    scale = d ** -0.5
    gen = _generator(device, s + d)
    q, k, v, dout = (torch.randn(b, s, n, d, generator=gen, device=device, dtype=dtype) for n in (h, hkv, hkv, h))
    cp = cpattn.ContextParallel(s, mask, "ring")
    if cp.local_len != s:
        raise RuntimeError(f"world 1 should hold all {s} tokens, holds {cp.local_len}")
    paths = {"causal": BlockKind.CAUSAL, "full": BlockKind.FULL}
    row["kernel"] = kernels.kernel_for(q, paths.get(kind, BlockKind.CAUSAL), kv_len=s)
    if not dense:
        row["kernel"] = f"{kernels.kernel_for(q, BlockKind.PARTIAL, kv_len=s)}+{row['kernel']}"
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def cp_fwd_bwd() -> tuple[Tensor, ...]:
        return torch.autograd.grad(cp.attention(*leaves, softmax_scale=scale), leaves, dout)

    row["cp"] = _time_side(lambda: cp.attention(q, k, v, softmax_scale=scale), cp_fwd_bwd, device, reps, flops)
    # both sides are timed before either's outputs are kept, so that each peak holds the same inputs
    if dense:
        found = best_sdpa(q, k, v, dout, kind == "causal", scale, device, reps, flops, sizes["sdpa"])
        row.update(backends=found["backends"], winner=found["winner"])
        if found["winner"]["fwd_bwd"] is None:
            row["error"] = "no SDPA backend ran"
            return row
        fwd_name, fb_name = found["winner"]["fwd"], found["winner"]["fwd_bwd"]
        bf, bb = found["backends"][fwd_name], found["backends"][fb_name]
        row["base"] = {"fwd_ms": bf["fwd_ms"], "fwd_tflops": bf["fwd_tflops"], "fwd_bwd_ms": bb["fwd_bwd_ms"],
                       "fwd_bwd_tflops": bb["fwd_bwd_tflops"], "peak_gib": bb["peak_gib"],
                       "peak_over_inputs_gib": bb["peak_over_inputs_gib"]}
        row["baseline"] = f"sdpa {fb_name}" + ("" if fwd_name == fb_name else f" (fwd: {fwd_name})")
        theirs = _sdpa_outputs(fb_name, bb["gqa"], q, k, v, dout, kind == "causal", scale)
    else:
        row["base"], theirs = _flex_side(spec, q, k, v, dout, scale, device, reps, flops)
        row["baseline"] = "flex" if _is_cuda(device) else "flex (unfused, forward only)"
    mine = _attention_result(lambda: cp.attention(*leaves, softmax_scale=scale), leaves, dout)
    for phase in ("fwd", "fwd_bwd"):
        if row["cp"].get(f"{phase}_ms") and row["base"].get(f"{phase}_ms"):
            row[f"ratio_{phase}"] = row["cp"][f"{phase}_ms"] / row["base"][f"{phase}_ms"]
    row["errors"] = {n: _rel(mine[n], theirs[n]) for n in theirs}
    row["exact"] = all(e <= PARITY_TOL for e in row["errors"].values())
    return row


def parity(device: torch.device, deadline: float, reps: int = 5, quick: bool = False) -> list[dict]:
    """The parity rows, cheapest first; a row whose predicted time does not fit in what is left of the
    share is skipped with the prediction as its reason. A dense row is predicted from the dense rows before
    it in proportion to FLOPs; a masked row takes as long as the masked rows before it (compiling
    FlexAttention, on both sides, dominates those)."""
    sizes = _sizes(device, quick)["parity"]
    rows_todo = [({"kind": kind}, s, d) for s, kind, d in sizes["dense"] if s <= 16384 or not _is_cuda(device)]
    if not quick:
        rows_todo += [(spec, sizes["masked_seq"], 128 if _is_cuda(device) else 16) for spec in sizes["masked"]]
    rows_todo += [({"kind": kind}, s, d) for s, kind, d in sizes["dense"] if s > 16384 and _is_cuda(device)]
    rows: list[dict] = []
    spent = {"dense": [0.0, 0.0, 0], "masked": [0.0, 0.0, 0]}  # seconds, forward FLOPs, rows done
    for spec, s, d in rows_todo:
        group = "dense" if spec["kind"] in ("causal", "full") else "masked"
        label = f"{s // 1024}K {spec['kind']} d{d}" if s >= 1024 else f"S={s} {spec['kind']} d{d}"
        left = deadline - time.time()
        seconds, flops_done, done = spent[group]
        predicted = None
        if done and group == "masked":
            predicted = seconds / done
        elif done:
            from cpattn.masks import allowed_pairs, from_spec

            flops = 4 * sizes["heads"] * d * allowed_pairs(from_spec(spec), s)
            predicted = seconds * flops / flops_done
        if left <= 0 or (predicted is not None and predicted > left):
            why = SKIPPED_TIME if predicted is None or left <= 0 else \
                f"predicted {predicted:.0f} s, {left:.0f} s left in the section's share"
            rows.append({"row": label, "mask": spec, "s": s, "d": d, "skipped": why})
            log(f"parity {label}: skipped ({why})")
            continue
        if group == "masked":
            _reset_compiled()
        t0 = time.time()
        try:
            row = _parity_row(spec, s, d, sizes, device, reps)
        except Exception as exc:
            row = {"row": label, "mask": spec, "s": s, "d": d, "error": _error_of(exc),
                   "trace": traceback.format_exc()[-3000:]}
        row["seconds"] = round(time.time() - t0, 1)
        if "error" not in row:
            spent[group][0] += row["seconds"]
            spent[group][1] += row["flops_fwd"]
            spent[group][2] += 1
        row["ok"] = "error" not in row and row.get("exact") is True
        rows.append(row)
        _free(device)
        cp, base = row.get("cp", {}), row.get("base", {})
        log(f"parity {label}: cp {_fmt(cp.get('fwd_ms'))}/{_fmt(cp.get('fwd_bwd_ms'))} ms, {row.get('baseline')} "
            f"{_fmt(base.get('fwd_ms'))}/{_fmt(base.get('fwd_bwd_ms'))} ms (fwd/fwd+bwd), exact {row.get('exact')}"
            + (f"; ERROR {row['error']}" if "error" in row else ""))
    return rows


def print_parity(rows: list[dict], file: Any = None) -> None:
    """The parity rows as one table (rich when importable, plain text otherwise)."""
    file = file or sys.stdout
    if not rows:
        print("parity: no rows ran", file=file)
        return
    cells = [[fn(r) for _, fn in PARITY_COLUMNS] for r in rows]
    headers = [h for h, _ in PARITY_COLUMNS]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
        print("  ".join(h.ljust(w) for h, w in zip(headers, widths)), file=file)
        for c in cells:
            print("  ".join(x.ljust(w) for x, w in zip(c, widths)), file=file)
        return
    table = Table(title="parity: cp.attention at world 1 against torch's fastest single-GPU kernel "
                        "(ratio = cpattn time / baseline time)")
    for h in headers:
        table.add_column(h, no_wrap=h != "note", overflow="fold")
    for c in cells:
        table.add_row(*c)
    width = sum(max(len(h), *(len(c[i]) for c in cells)) + 3 for i, h in enumerate(headers) if h != "note") + 60
    Console(file=file, width=max(120, width)).print(table)


# ------------------------------------------------------------------------------------ 4. steady state
def _steady_inputs(sizes: dict, device: torch.device, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v (requiring grad) and dout of the steady section's shape, bfloat16, drawn from ``seed``."""
    import torch

    s, h, hkv, d = sizes["seq"], sizes["heads"], sizes["kv_heads"], sizes["d"]
    gen = _generator(device, seed)
    q, k, v = (torch.randn(1, s, n, d, generator=gen, device=device, dtype=torch.bfloat16).requires_grad_()
               for n in (h, hkv, hkv))
    return q, k, v, torch.randn(1, s, h, d, generator=gen, device=device, dtype=torch.bfloat16)


def _steady_case(spec: dict, sizes: dict, device: torch.device) -> dict:
    """3 warm-up forward+backward calls, then one counted: compiles, host-to-device copies, host syncs."""
    import torch
    from cpattn.masks import from_spec

    import cpattn

    s, scale = sizes["seq"], sizes["d"] ** -0.5
    q, k, v, dout = _steady_inputs(sizes, device, 7)
    cp = cpattn.ContextParallel(s, from_spec(spec), "ring")

    def step() -> tuple[Tensor, ...]:
        return torch.autograd.grad(cp.attention(q, k, v, softmax_scale=scale), (q, k, v), dout)

    for _ in range(3):
        step()
    _sync(device)
    before = _dynamo_counts()
    with _profiler(device) as prof:
        with _host_syncs(device) as syncs:
            step()
        _sync(device)
    after = _dynamo_counts()
    names = [e.name for e in prof.events()]
    case = {"compiled": {n: after[n] - before[n] for n in after},
            "htod_copies": sum("HtoD" in n for n in names),
            # context only: the profiler does not say where a copy reads from
            "copy_ops": sum(n in ("aten::copy_", "aten::_to_copy") for n in names),
            "host_syncs": len(syncs), "sync_warnings": syncs[:5], "profiled_events": len(names)}
    problems = [f"{n}: {c}" for n, c in case["compiled"].items() if c]
    problems += [f"{c} host-to-device copies" for c in [case["htod_copies"]] if c]
    problems += [f"{c} host syncs" for c in [case["host_syncs"]] if c]
    case.update(ok=not problems, problems=problems)
    return case


def _graph_case(sizes: dict, device: torch.device) -> dict:
    """fwd+bwd of cp.attention (causal) captured in a CUDA graph, replayed, against eager."""
    import torch

    import cpattn

    s, scale = sizes["seq"], sizes["d"] ** -0.5
    q, k, v, dout = _steady_inputs(sizes, device, 8)
    cp = cpattn.ContextParallel(s, "causal", "ring")

    def step() -> tuple[Tensor, ...]:
        out = cp.attention(q, k, v, softmax_scale=scale)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    replay, how = _graphed(step, device)
    got = [t.detach().clone() for t in replay()]
    _sync(device)
    want = [t.detach() for t in step()]
    names = ("out", "dq", "dk", "dv")
    rel = {n: _rel(a, b) for n, a, b in zip(names, got, want)}
    case = {"how": how, "rel": rel, "max_abs_diff": max(float((a.float() - b.float()).abs().max())
                                                        for a, b in zip(got, want))}
    case["ok"] = all(e <= GRAPH_TOL for e in rel.values())
    return case


def _compile_case(sizes: dict, device: torch.device, reps: int) -> dict:
    """``torch.compile(fullgraph=True)`` of a cpattn Llama block: compile seconds (first fwd+bwd),
    relative difference to eager, eager and compiled fwd+bwd milliseconds. The CPU compiles with
    ``aot_eager`` (the same graph capture, no C++ code generation)."""
    import torch

    import cpattn
    from cpattn.models.llama import Block, rope_angles

    blk_sizes, s = sizes["block"], sizes["seq"]
    dim, heads = blk_sizes["dim"], blk_sizes["heads"]
    torch.manual_seed(0)
    block = Block(dim, heads, blk_sizes["kv_heads"], blk_sizes["ffn_dim"], 1e-5).to(device, torch.bfloat16)
    gen = _generator(device, 9)
    x = torch.randn(1, s, dim, generator=gen, device=device, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(1, s, dim, generator=gen, device=device, dtype=torch.bfloat16)
    rope = rope_angles(torch.arange(s, device=device), dim // heads, 500000.0, torch.bfloat16)
    cp = cpattn.ContextParallel(s, "causal", "ring")
    backend = "inductor" if _is_cuda(device) else "aot_eager"
    compiled = torch.compile(block, fullgraph=True, backend=backend)

    inputs = (x, *block.parameters())  # the weights' gradients too: a training backward

    def run(fn: Callable) -> tuple[Tensor, ...]:
        y = fn(x, cp, rope)
        return (y, *torch.autograd.grad(y, inputs, dy))

    got, compile_s = _wall(lambda: [t.detach() for t in run(compiled)[:2]], device)
    want = [t.detach() for t in run(block)[:2]]
    rel = {n: _rel(a, b) for n, a, b in zip(("out", "dx"), got, want)}
    case = {"backend": backend, "compile_s": round(compile_s, 2), "rel": rel,
            "eager_fwd_bwd_ms": _time_ms(lambda: run(block), device, reps),
            "compiled_fwd_bwd_ms": _time_ms(lambda: run(compiled), device, reps)}
    case["ok"] = all(e <= COMPILE_TOL for e in rel.values())
    return case


def steady(device: torch.device, deadline: float, reps: int = 5) -> dict:
    """The steady-state counts per mask (``cases``), the CUDA graph capture (``graph``) and the compiled
    block (``compile``). The masked cases run last: their warm-up compiles FlexAttention, the slow part,
    and a budget cut should not cost the quick checks."""
    sizes = _sizes(device, False)["steady"]
    out: dict[str, Any] = {"cases": []}

    def counted(spec: dict) -> dict:
        _reset_compiled()  # a fresh process's warm-up: earlier sections' compiled functions do not count
        return {"mask": spec, "seq": sizes["seq"], **_steady_case(spec, sizes, device)}

    first, *masked = sizes["masks"]
    todo = [("cases", first["kind"], lambda: counted(first)), ("graph", "graph", lambda: _graph_case(sizes, device)),
            ("compile", "compile", lambda: _compile_case(sizes, device, reps))]
    todo += [("cases", spec["kind"], lambda spec=spec: counted(spec)) for spec in masked]
    specs = {spec["kind"]: spec for spec in sizes["masks"]}
    for slot, name, run in todo:
        head = {"mask": specs[name], "seq": sizes["seq"]} if slot == "cases" else {}
        if time.time() >= deadline:
            result = {**head, "skipped": SKIPPED_TIME}
        else:
            try:
                result = run()
            except Exception as exc:
                result = _failed(head, exc)
            _free(device)
            log(f"steady {name}: " + ("ok" if result["ok"] else f"FAIL {result.get('error') or result}"[:600]))
        if slot == "cases":
            out["cases"].append(result)
        else:
            out[slot] = result
    return out


# ------------------------------------------------------------------------------------ 5. model
class SdpaAttention:
    """What the Llama's attention layers call, ``cp.attention(q, k, v)`` on ``[b, s, h, d]``, answered by
    torch SDPA (causal, whole sequence) under one backend: the model's baseline with the same weights."""

    def __init__(self, backend: str, gqa: str) -> None:
        self.backend, self.gqa = backend, gqa

    def attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        call = _sdpa_call(True, q.shape[-1] ** -0.5, q.shape[2] // k.shape[2], self.gqa == "native")
        with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[self.backend])):
            return call(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _train_step(cfg_kwargs: dict, s: int, device: torch.device, sdpa_names: tuple[str, ...]) -> dict:
    """One Llama training step (bf16 weights, fused AdamW) with cp.attention and with the fastest SDPA
    backend, the same model and optimizer for both."""
    import torch
    import torch.nn.functional as F

    import cpattn
    from cpattn.models.flops import llama_flops_per_token
    from cpattn.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(**cfg_kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg).to(torch.bfloat16)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        fused = True
    except (RuntimeError, ValueError):  # a torch without the fused kernel for this device
        opt, fused = torch.optim.AdamW(model.parameters(), lr=1e-5), False
    gen = _generator(device, 11)
    tokens = torch.randint(0, cfg.vocab, (1, s + 1), generator=gen, device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(s, device=device)
    # the baseline's backend: the fastest SDPA forward+backward on this model's attention shape
    hd = cfg.head_dim
    probe = [torch.randn(1, s, n, hd, generator=gen, device=device, dtype=torch.bfloat16)
             for n in (cfg.heads, cfg.kv_heads, cfg.kv_heads, cfg.heads)]
    found = best_sdpa(*probe, True, hd ** -0.5, device, 3, 4 * cfg.heads * hd * s * (s + 1) // 2, sdpa_names)
    del probe
    flops_per_token = llama_flops_per_token(cfg, s)
    result: dict[str, Any] = {"config": cfg_kwargs, "seq": s, "fused_adamw": fused, "sdpa_probe": found}
    variants = {"cpattn": cpattn.ContextParallel(s, "causal", "ring")}
    if found["winner"]["fwd_bwd"] is not None:
        name = found["winner"]["fwd_bwd"]
        variants[f"sdpa {name}"] = SdpaAttention(name, found["backends"][name]["gqa"])
    for label, attn in variants.items():
        def step(attn: Any = attn) -> None:
            logits = model(inputs, positions, attn)
            F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        try:
            _reset_peak(device)
            ms = _time_ms(step, device, reps=3)
            result[label] = {"step_ms": ms, "tokens_per_s": s / (ms / 1e3),
                             "tflops": flops_per_token * s / (ms / 1e3) / 1e12, "peak_gib": _peak_gib(device)}
        except Exception as exc:
            result[label] = _failed({}, exc)
        _free(device)
    return result


def _hf_generate(sizes: dict, device: torch.device) -> dict:
    """cpattn's generate at world 1 against transformers' with SDPA: the same random weights, greedy."""
    import copy

    import torch
    try:
        import transformers
        from transformers import AutoModelForCausalLM

        import cpattn
        from cpattn.integrations import hf
        from cpattn.integrations.hf_generate import generate
    except ImportError as exc:
        return {"skipped": f"transformers not installed ({exc})"[:300]}
    config = transformers.LlamaConfig(**sizes["hf"], max_position_embeddings=sizes["prompt"] + sizes["new_tokens"] + 64)
    hf.register()
    models = {}
    for impl in ("cpattn", "sdpa"):
        torch.manual_seed(0)  # the same random weights for both
        with torch.device(device):  # bf16 weights; dtype= keeps the rotary frequencies in float32, as loading does
            models[impl] = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl,
                                                            dtype=torch.bfloat16).eval()
    gen = _generator(device, 12)
    prompt = torch.randint(0, config.vocab_size, (1, sizes["prompt"]), generator=gen, device=device)
    options = {"do_sample": False, "eos_token_id": None}

    def ours(ids: Tensor, new: int) -> Tensor:
        return generate(models["cpattn"], ids, cpattn.ContextParallel(ids.shape[1], "causal", "ring"),
                        max_new_tokens=new, **options)

    def theirs(ids: Tensor, new: int) -> Tensor:
        return models["sdpa"].generate(ids, max_new_tokens=new, **options)

    result: dict[str, Any] = {"prompt": sizes["prompt"], "new_tokens": sizes["new_tokens"], "config": sizes["hf"]}
    seqs = {}
    with torch.no_grad():
        for label, fn in (("cpattn", ours), ("sdpa", theirs)):
            fn(prompt[:, :64], 2)  # first-call set-up is not generation
            _reset_peak(device)
            seqs[label], seconds = _wall(lambda fn=fn: fn(prompt, sizes["new_tokens"]), device)
            result[label] = {"seconds": round(seconds, 3), "peak_gib": _peak_gib(device)}
    a, b = (seqs[n][0, sizes["prompt"]:] for n in ("cpattn", "sdpa"))
    differ = (a != b).nonzero()
    result["tokens_agree"] = bool(torch.equal(a, b))
    result["first_difference"] = int(differ[0]) if differ.numel() else None
    return result


def model(device: torch.device, deadline: float) -> dict:
    sizes = _sizes(device, False)["model"]
    sdpa_names = _sizes(device, False)["parity"]["sdpa"]
    out: dict[str, Any] = {}
    for name, run in (("train_step", lambda: _train_step(sizes["llama"], sizes["seq"], device, sdpa_names)),
                      ("generate", lambda: _hf_generate(sizes, device))):
        if time.time() >= deadline:
            out[name] = {"skipped": SKIPPED_TIME}
            continue
        try:
            out[name] = run()
        except Exception as exc:
            out[name] = _failed({}, exc)
        _free(device)
        log(f"model {name}: {json.dumps(out[name], default=str)[:400]}")
    return out


# ------------------------------------------------------------------------------------ 6. ranks sharing one GPU
#: the masks and dtypes of every schedule at every world size of the multirank section
MULTIRANK_MASKS = ("causal", "full", "document")
MULTIRANK_DTYPES = ("bfloat16", "float32")
MULTIRANK_WORLDS = (2, 4)


def _all_past(deadline: float) -> bool:
    """Whether the deadline has passed on any rank (a MAX all-reduce of a CPU flag, which gloo runs on the
    host), so that every rank skips the same cases and none waits in a collective for another."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if time.time() >= deadline else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _rank_main(rank: int, world: int, backend: str, port: int, outdir: str, device_type: str = "cuda",
               deadline: float = 0.0, schedules_only: tuple[str, ...] = ()) -> None:
    """One rank of a ``world``-process group whose ranks all use cuda:0 (or the CPU); writes rank<r>.json.

    NCCL: constructs a ``ContextParallel``, which must refuse the shared GPU with its own message (before
    NCCL's first operation). gloo: every registered schedule (or ``schedules_only``) x
    :data:`MULTIRANK_MASKS` x :data:`MULTIRANK_DTYPES`, GQA 4:1, S = 256, forward and backward against
    the float64 reference, transfers staged through host buffers (``cpattn.core.staging``)."""
    import torch
    import torch.distributed as dist

    import cpattn
    from cpattn import schedules
    from cpattn.exactness import example_mask_args

    report: dict[str, Any] = {"rank": rank, "backend": backend, "world": world}
    try:
        dev = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        if device_type == "cuda":
            torch.cuda.set_device(0)
        # no device_id: NCCL would then connect at once and fail before cpattn could say why
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        if backend == "nccl":
            try:
                cpattn.ContextParallel(256, "causal", "ring")
                report["refused"] = None
            except ValueError as exc:
                report["refused"] = str(exc)
        else:
            seq, b, h, hkv, d = (256, 1, 8, 2, 64) if device_type == "cuda" else (64, 1, 4, 2, 16)
            judged: dict[tuple, tuple] = {}
            cases = []
            for dtype_name in MULTIRANK_DTYPES:
                for schedule in schedules_only or tuple(schedules.names()):
                    for mask_name in MULTIRANK_MASKS:
                        case = {"world": world, "schedule": schedule, "mask": mask_name, "dtype": dtype_name}
                        spec = {"kind": mask_name, **(example_mask_args(mask_name, seq) or {})}
                        why = _refusal(schedule, spec)
                        if why is not None:
                            cases.append({**case, "skipped": REFUSED, "reason": why})
                        elif _all_past(deadline):
                            cases.append({**case, "skipped": SKIPPED_TIME})
                        else:
                            cases.append(_cp_case(case, spec, judged, (b, seq, h, hkv, d), dev))
            report["cases"] = cases
        dist.destroy_process_group()
    except Exception as exc:
        report["error"] = _error_of(exc)
        report["trace"] = traceback.format_exc()[-2000:]
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(report, default=str))


def _launch(world: int, backend: str, device: torch.device, timeout: float,
            schedules_only: tuple[str, ...] = ()) -> dict:
    """``world`` spawned ranks of one process group on ``device``; their reports, or why there are none.
    The ranks stop starting cases at 85% of ``timeout`` and are killed at ``timeout``."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    from cpattn.core.staging import STAGE_ENV

    with socket.socket() as s_:
        s_.bind(("127.0.0.1", 0))
        port = s_.getsockname()[1]
    started = time.time()
    stage = os.environ.get(STAGE_ENV)
    if not _is_cuda(device):
        os.environ[STAGE_ENV] = "1"  # CPU tensors on gloo are staged only when forced: the tests force it
    try:
        with tempfile.TemporaryDirectory() as outdir:
            ctx = mp.get_context("spawn")
            procs = [ctx.Process(target=_rank_main, args=(r, world, backend, port, outdir, device.type,
                                                          started + 0.85 * timeout, schedules_only))
                     for r in range(world)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(max(0.0, started + timeout - time.time()))
            hung = [p.pid for p in procs if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
            ranks = [json.loads(f.read_text()) for f in sorted(Path(outdir).glob("rank*.json"))]
    finally:
        if stage is None:
            os.environ.pop(STAGE_ENV, None)
        else:
            os.environ[STAGE_ENV] = stage
    entry: dict[str, Any] = {"world": world, "backend": backend, "seconds": round(time.time() - started, 1),
                             "exitcodes": [p.exitcode for p in procs]}
    if hung:
        entry["error"] = f"timed out after {timeout:.0f} s (killed pids {hung})"
    errors = [f"rank {r['rank']}: {r['error']}" for r in ranks if "error" in r]
    if errors:
        entry["error"] = "; ".join(errors)[:2000]
    if len(ranks) < world and "error" not in entry:
        entry["error"] = f"{world - len(ranks)} rank(s) wrote no report (exit codes {entry['exitcodes']})"
    entry["ranks"] = ranks
    return entry


def multirank(device: torch.device, timeout: float, schedules_only: tuple[str, ...] = ()) -> dict:
    """Ranks sharing one GPU (the CPU under ``--device cpu``): on CUDA, NCCL with two ranks on cuda:0 must be
    refused by cpattn with its own message (a check: ``nccl.ok``); then, for P in :data:`MULTIRANK_WORLDS`,
    one launch of P gloo ranks runs every schedule x mask x dtype (:func:`_rank_main`) with staged
    transfers. ``cases`` lists each (P, schedule, mask, dtype) once, judged on rank 0 (every rank holds the
    whole unsharded result); a rank's error fails the launch."""
    launches = (["nccl"] if _is_cuda(device) else []) + [f"gloo{p}" for p in MULTIRANK_WORLDS]
    weights = {"nccl": 1.0, "gloo2": 2.0, "gloo4": 3.0}  # the larger world runs the same cases on more ranks
    if timeout < 8 * len(launches):  # too little to start the processes and a process group each
        return {"skipped": SKIPPED_TIME}
    result: dict[str, Any] = {"cases": []}
    left = timeout
    for i, name in enumerate(launches):
        share = left * weights[name] / sum(weights[n] for n in launches[i:])
        t0 = time.time()
        if name == "nccl":
            entry = _launch(2, "nccl", device, share)
            refusals = [r.get("refused") for r in entry["ranks"]]
            entry["ok"] = (len(refusals) == 2 and all(r and "gloo" in r for r in refusals))
            entry["expected"] = "cpattn refuses two NCCL ranks on one GPU, naming the staged gloo alternative"
            result["nccl"] = entry
            log(f"multirank nccl: {'refused as expected' if entry['ok'] else 'NOT refused: ' + str(entry)[:300]}")
        else:
            world = int(name[4:])
            entry = _launch(world, "gloo", device, share, schedules_only)
            ranks = entry.pop("ranks")
            cases = next((r.get("cases", []) for r in ranks if r.get("rank") == 0), [])
            result["cases"] += cases
            ran = [c for c in cases if "skipped" not in c]
            entry.update(ran=len(ran), passed=sum(bool(c.get("ok")) for c in ran),
                         skipped_for_time=sum(c.get("skipped") == SKIPPED_TIME for c in cases))
            entry["ok"] = "error" not in entry and entry["passed"] == entry["ran"]
            result[name] = entry
            log(f"multirank gloo P={world}: {entry['passed']}/{entry['ran']} exact, "
                f"{entry['skipped_for_time']} skipped for time" + (f"; {entry['error']}" if "error" in entry else ""))
        left = max(0.0, left - (time.time() - t0))
    return result


# ------------------------------------------------------------------------------------ main
def selected_sections(args: argparse.Namespace) -> list[str]:
    """The sections to run, in the order of the default run (``bench`` after ``exactness``)."""
    order = ["exactness", "bench", "context_parallel", "parity", "steady", "model", "multirank"]
    chosen = {s for s in args.sections.split(",") if s} - {s for s in args.skip.split(",") if s}
    return [s for s in order if s in chosen]


def _env(device: torch.device) -> dict:
    import torch

    import cpattn

    env = {"torch": torch.__version__, "device_type": device.type, "cpattn": getattr(cpattn, "__version__", None),
           "available": sorted(cpattn.kernels.available_kernels(device))}
    if _is_cuda(device):
        env.update(cuda=torch.version.cuda, device=torch.cuda.get_device_name(),
                   capability=list(torch.cuda.get_device_capability()), cudnn=torch.backends.cudnn.version())
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: CUDA is not available (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
              "this script checks cpattn's CUDA kernel paths and needs an NVIDIA GPU", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    with _one_thread_on_cpu(device):
        return _run(args, device, started)


@contextlib.contextmanager
def _one_thread_on_cpu(device: torch.device) -> Iterator[None]:
    """The CPU runs take one intra-op thread: their tiny shapes gain nothing from more, and OpenMP workers
    that spin while another process holds a core make them many times slower."""
    import torch

    if _is_cuda(device):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, device: torch.device, started: float) -> int:
    """The selected sections, the parity table and the summary; the exit status."""
    sections = selected_sections(args)
    shares = {**SHARES, **EXTRA_SHARES}
    report: dict[str, Any] = {"env": _env(device), "budget_s": args.budget, "sections": sections,
                              "allotted_s": {}, "seconds": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    seqs = [8192] if args.quick else [int(s) for s in args.seqs.split(",") if s]
    runners: dict[str, Callable[[float], Any]] = {
        "exactness": lambda t: exactness(device, time.time() + t, args.quick),
        "bench": lambda t: bench(device, time.time() + t, seqs, args.reps),
        "context_parallel": lambda t: context_parallel(device, time.time() + t, args.quick),
        "parity": lambda t: parity(device, time.time() + t, args.reps, args.quick),
        "steady": lambda t: steady(device, time.time() + t, args.reps),
        "model": lambda t: model(device, time.time() + t),
        "multirank": lambda t: multirank(device, t, tuple(s for s in args.multirank_schedules.split(",") if s)),
    }
    for i, name in enumerate(sections):
        # this section's share of what is left: time one section leaves unused goes to those after it
        later = sum(shares[s] for s in sections[i:])
        allotted = max(0.0, args.budget - (time.time() - started)) * shares[name] / later
        report["allotted_s"][name] = round(allotted, 1)
        log(f"section {name} ({allotted:.0f} s) ...")
        t0 = time.time()
        try:
            report[name] = runners[name](allotted)
        except Exception as exc:
            report[name] = {"error": _error_of(exc), "trace": traceback.format_exc()[-3000:]}
        report["seconds"][name] = round(time.time() - t0, 1)
        out.write_text(json.dumps(report, indent=1, default=str))
        log(f"section {name} done in {time.time() - t0:.0f} s; report in {out}")
    if isinstance(report.get("parity"), list):
        print_parity(report["parity"])
    failed, notes = failures(report)
    report["failures"], report["notes"] = failed, notes
    report["seconds"]["total"] = round(time.time() - started, 1)
    out.write_text(json.dumps(report, indent=1, default=str))
    log(f"finished in {time.time() - started:.0f} s: {len(failed)} failure(s)" + "".join(f"\n  {f}" for f in failed)
        + "".join(f"\n  note: {n}" for n in notes))
    return 1 if failed else 0


def _brief(case: dict) -> str:
    return json.dumps({k: v for k, v in case.items() if k != "trace"}, default=str)[:400]


def failures(report: dict) -> tuple[list[str], list[str]]:
    """``(failures, notes)``: every check that ran and failed, named; notes for what informs without
    failing the run (a model measurement that ran but disagreed)."""
    failed, notes = [], []
    for section, val in report.items():
        if isinstance(val, dict) and "error" in val and "trace" in val:  # the section itself raised
            failed.append(f"{section}: {val['error']}")
    for section in ("exactness", "context_parallel"):
        for case in report.get(section) if isinstance(report.get(section), list) else []:
            if "skipped" not in case and not case.get("ok"):
                failed.append(f"{section}: {_brief(case)}")
    for row in report.get("parity") if isinstance(report.get("parity"), list) else []:
        if "skipped" not in row and not row.get("ok"):
            why = row.get("error") or f"not exact: errors {row.get('errors')} > {PARITY_TOL}"
            failed.append(f"parity {row['row']}: {why}")
    st = report.get("steady")
    if isinstance(st, dict) and "cases" in st:
        for case in st["cases"]:
            if "skipped" not in case and not case.get("ok"):
                failed.append(f"steady {case['mask']['kind']}: {case.get('error') or case.get('problems')}")
        for name in ("graph", "compile"):
            part = st.get(name, {})
            if "skipped" not in part and not part.get("ok"):
                failed.append(f"steady {name}: {part.get('error') or _brief(part)}")
    md = report.get("model")
    if isinstance(md, dict) and "trace" not in md:
        for name, part in md.items():
            if isinstance(part, dict) and "error" in part:
                failed.append(f"model {name}: {part['error']}")
            for label, sub in part.items() if isinstance(part, dict) else []:
                if isinstance(sub, dict) and "error" in sub and "trace" in sub:
                    failed.append(f"model {name} {label}: {sub['error']}")
        gen = md.get("generate", {})
        if gen.get("tokens_agree") is False:
            notes.append(f"model generate: greedy tokens differ from position {gen.get('first_difference')} "
                         "(bf16 rounding can flip a near tie)")
    mr = report.get("multirank")
    if isinstance(mr, dict) and "trace" not in mr and "skipped" not in mr:
        for case in mr.get("cases", []):
            if "skipped" not in case and not case.get("ok"):
                failed.append(f"multirank: {_brief(case)}")
        for name, entry in mr.items():
            if isinstance(entry, dict) and not entry.get("ok"):
                failed.append(f"multirank {name}: {str(entry.get('error') or entry)[:300]}")
    return failed, notes


if __name__ == "__main__":
    sys.exit(main())
