#!/usr/bin/env python
"""One run on a CUDA machine that checks cpattn's CUDA kernel paths (docs/cuda.md).

Sections, each written to the JSON report as soon as it finishes (so a run cut short keeps what it did):

1. ``exactness``: every available kernel path (flash_cuda, cudnn_cuda, efficient_cuda, flex_cuda,
   flash_attn, math) x block kind (FULL, CAUSAL, PARTIAL where the path takes it) x dtype (float16,
   bfloat16, float32 where the path takes it) x GQA (1, 4), forward and backward, against a float64
   reference computed on the GPU in plain torch (``cpattn.verify.reference``). Tolerance
   (docs/testing.md): relative error <= 2 * e_local + 1e-6 per quantity, where e_local is the error of
   ``torch.nn.functional.scaled_dot_product_attention`` in the same dtype on the same inputs (rows the
   mask leaves empty are given every key for that measurement, since SDPA makes them NaN); lse, which
   SDPA does not return, is held to out's tolerance. Each FULL / PARTIAL case also runs *split*: the
   keys in two blocks, merged by log-sum-exp, each block's backward given the merged out and lse, as
   the schedules call the kernels. Soft-capped blocks (``softcap``) run on flex_cuda, the path
   ``backend="auto"`` gives them on CUDA, against a float64 autograd reference of the capped scores.
2. ``bench``: forward and forward+backward time of each fused path against SDPA under
   ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)`` at S = 8K..64K (bfloat16, b=1, h=32, h_kv=8, d=128),
   CUDA events, median; causal and full (flex_cuda with a dense causal mask, S <= 16K only).
3. ``context_parallel``: ``cpattn.ContextParallel`` at world size 1 on CUDA (no process group: a
   one-rank world) for a few schedules and masks, judged like ``cpattn verify``.
4. ``multirank``: two processes on cuda:0, NCCL first, then gloo; what happened either way.

Usage: ``python scripts/gpu_check.py --out gpu_check.json`` (or ``$OUT/gpu_check.json`` when ``$OUT``
is set). ``--quick`` runs a smaller matrix and S = 8K only. Exit status 0 when every check that ran
passed, 1 when one failed, 2 when CUDA is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    default_out = str(Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else "gpu_check.json"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=default_out, help=f"JSON report path (default {default_out})")
    p.add_argument("--quick", action="store_true", help="smaller matrix, S = 8K only")
    p.add_argument("--seqs", default="8192,16384,32768,65536", help="benchmark sequence lengths")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per benchmark (after 2 warm-ups)")
    p.add_argument("--budget", type=float, default=450.0,
                   help="seconds for the whole run (default 450); each section gets a share and records the "
                        "cases it had no time for as skipped")
    p.add_argument("--skip", default="", help="comma-separated sections to skip: "
                                              "exactness,bench,context_parallel,multirank")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------ shared pieces
def _error_of(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()[:2000]


def _sdpa(q, k, v, dout, allowed, causal, scale):
    """out, dq, dk, dv of torch SDPA in the inputs' dtype ([b, s, h, d] in and out)."""
    import torch.nn.functional as F

    qg, kg, vg = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    mask = None if causal or allowed is None else allowed
    out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=k.shape[2] != q.shape[2])
    out.backward(dout.transpose(1, 2))
    return {"out": out.detach().transpose(1, 2), "dq": qg.grad.transpose(1, 2), "dk": kg.grad.transpose(1, 2),
            "dv": vg.grad.transpose(1, 2)}


def _tolerances(q, k, v, dout, allowed, kind, scale):
    """2 * e_local + 1e-6 per quantity, e_local from SDPA in the inputs' dtype."""
    from cpattn.masks import BlockKind

    from cpattn.verify import reference, rel_error

    filled = allowed.clone()
    filled[~filled.any(1)] = True  # SDPA gives NaN on rows with no key
    ref = reference(q, k, v, dout, filled, scale)
    got = _sdpa(q, k, v, dout, filled, kind == BlockKind.CAUSAL, scale)
    e = {n: rel_error(got[n], ref[n]) for n in ("out", "dq", "dk", "dv")}
    e["lse"] = e["out"]
    return {n: 2 * x + 1e-6 for n, x in e.items()}, e


def _merge(parts):
    """Log-sum-exp merge of [(out [b,s,h,d] float32, lse [b,h,s] float32), ...]."""
    import torch

    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    out = sum(o * torch.exp(lb - safe).transpose(1, 2).unsqueeze(-1) for o, lb in parts)
    return out, lse


def _judge(got: dict, ref: dict, tol: dict, empty_rows) -> dict:
    from cpattn.verify import rel_error

    errors = {n: rel_error(got[n], ref[n]) for n in ("out", "lse", "dq", "dk", "dv")}
    problems = [f"{n}: {errors[n]:.3g} > {tol[n]:.3g}" for n in errors if not errors[n] <= tol[n]]
    if empty_rows.any():
        if not bool((got["out"][:, empty_rows] == 0).all()) or not bool((got["dq"][:, empty_rows] == 0).all()):
            problems.append("rows with no key: out or dq not exactly 0")
        if not bool(got["lse"][:, :, empty_rows].isneginf().all()):
            problems.append("rows with no key: lse not -inf")
    return {"errors": errors, "ok": not problems, "problems": problems}


# ------------------------------------------------------------------------------------ 1. exactness
def exactness(quick: bool, deadline: float) -> list[dict]:
    import torch
    from cpattn.masks import BlockKind

    from cpattn import kernels
    from cpattn.verify import reference

    dev = torch.device("cuda")
    available = kernels.available_kernels(dev)
    log(f"available kernel paths: {sorted(available)}")
    results = []
    # Flex last: its cases compile Triton kernels, the slowest part of the run
    paths = ["flash_cuda", "cudnn_cuda", "efficient_cuda", "flash_attn", "math", "flex_cuda"]
    dtypes = [torch.bfloat16, torch.float32] if quick else [torch.float16, torch.bfloat16, torch.float32]
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
                    if time.time() > deadline:
                        results.append({**case, "skipped": "time budget of the section spent"})
                        continue
                    try:
                        gen = torch.Generator(device=dev).manual_seed(len(results))
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
                        case.update(ok=False, error=_error_of(exc), trace=traceback.format_exc()[-3000:])
                    results.append(case)
                    status = "ok" if case["ok"] else f"FAIL {case.get('error') or case['whole']['problems']}"
                    log(f"exactness {path} {case['kind']} {case['dtype']} gqa={case['gqa']}: {status}")
    if "flex_cuda" in available:
        results += softcap_exactness(dtypes, deadline)
    return results


def _capped_reference(q, k, v, dout, allowed, scale, cap):
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


def softcap_exactness(dtypes, deadline: float) -> list[dict]:
    """Soft-capped blocks (Gemma 2's ``tanh(s / c) * c``) on flex_cuda, the path ``auto`` gives them on
    CUDA: forward and backward of every block kind against a float64 autograd reference, whole and split."""
    import torch
    from cpattn.masks import BlockKind

    from cpattn import kernels

    dev, d, h, hkv, b, scale, cap = torch.device("cuda"), 64, 8, 2, 2, 0.125, 0.5
    results = []
    for kind in (BlockKind.FULL, BlockKind.CAUSAL, BlockKind.PARTIAL):
        for dtype in dtypes:
            sq = 200
            sk = sq if kind == BlockKind.CAUSAL else 328
            case = {"path": "flex_cuda", "softcap": cap, "kind": kind.value,
                    "dtype": str(dtype).replace("torch.", ""), "gqa": h // hkv, "s_q": sq, "s_kv": sk}
            if time.time() > deadline:
                results.append({**case, "skipped": "time budget of the section spent"})
                continue
            try:
                assert kernels.kernel_for(torch.empty(1, 1, h, d, device=dev, dtype=dtype), kind,
                                          softcap=cap) == "flex_cuda", "auto does not send capped blocks to flex"
                gen = torch.Generator(device=dev).manual_seed(100 + len(results))
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
                case.update(ok=False, error=_error_of(exc), trace=traceback.format_exc()[-3000:])
            results.append(case)
            status = "ok" if case["ok"] else f"FAIL {case.get('error') or case['whole']['problems']}"
            log(f"exactness flex_cuda softcap {case['kind']} {case['dtype']}: {status}")
    return results


def _split(path, q, k, v, dout, kind, scale, mask):
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


# ------------------------------------------------------------------------------------ 2. bench
def _time(fn, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after 2 warm-ups, by CUDA events."""
    import torch

    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _bench_sdpa(q, k, v, dout, causal: bool, scale: float, reps: int) -> dict:
    """SDPA under the flash backend: forward and forward+backward milliseconds."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt, dt = (x.transpose(1, 2) for x in (q, k, v, dout))

    def fwd():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale, enable_gqa=True)

    def fwd_bwd():
        qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale, enable_gqa=True).backward(dt)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        with torch.no_grad():
            fwd_ms = _time(fwd, reps)
        return {"fwd": fwd_ms, "fwd_bwd": _time(fwd_bwd, reps)}


def _bench_path(path, q, k, v, dout, kind, scale, mask, reps: int) -> dict:
    """One kernel path through the contract (float32 results included): forward and forward+backward."""
    from cpattn import kernels

    out, lse = kernels.forward_with(path, q, k, v, kind, scale, mask)
    out = out.to(q.dtype)

    def fwd():
        return kernels.forward_with(path, q, k, v, kind, scale, mask)

    def fwd_bwd():
        kernels.forward_with(path, q, k, v, kind, scale, mask)
        kernels.backward_with(path, dout, q, k, v, out, lse, kind, scale, mask)

    return {"fwd": _time(fwd, reps), "fwd_bwd": _time(fwd_bwd, reps)}


def bench(seqs: list[int], reps: int, deadline: float) -> list[dict]:
    import torch
    from cpattn.masks import BlockKind

    from cpattn import kernels

    dev = torch.device("cuda")
    available = kernels.available_kernels(dev)
    b, h, hkv, d, dtype, scale = 1, 32, 8, 128, torch.bfloat16, 128 ** -0.5
    fused = [p for p in ("flash_cuda", "cudnn_cuda", "efficient_cuda", "flash_attn", "flex_cuda") if p in available]
    rows = []
    for s in seqs:
        x = {n: torch.randn(b, s, hh, d, device=dev, dtype=dtype) for n, hh in (("q", h), ("k", hkv), ("v", hkv),
                                                                              ("dout", h))}
        args = (x["q"], x["k"], x["v"], x["dout"])
        for kind in (BlockKind.CAUSAL, BlockKind.FULL):
            causal = kind == BlockKind.CAUSAL
            row = {"s": s, "kind": kind.value, "flops_fwd": 4 * b * h * d * s * s // (2 if causal else 1)}
            if time.time() > deadline:
                rows.append({**row, "skipped": "time budget of the section spent"})
                continue
            try:
                row.update({f"sdpa_flash_{ph}_ms": ms for ph, ms in _bench_sdpa(*args, causal, scale, reps).items()})
            except Exception as exc:
                row["sdpa_flash_error"] = _error_of(exc)
            for path in fused:
                pk, mask = kind, None
                if path == "flex_cuda":
                    if s > 16384 or not causal:
                        continue  # the dense mask of one block is s x s bytes
                    pk, mask = BlockKind.PARTIAL, torch.ones(s, s, dtype=torch.bool, device=dev).tril()
                try:
                    for phase, ms in _bench_path(path, *args, pk, scale, mask, reps).items():
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
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------ 3. ContextParallel
def context_parallel(quick: bool, deadline: float) -> list[dict]:
    import torch
    from cpattn.masks import from_spec

    import cpattn
    from cpattn.verify import dense_mask, example_mask_args, local_errors, reference, rel_error

    dev = torch.device("cuda")
    seq, b, h, d = 256, 2, 8, 64
    scheds = ["ring", "zigzag_ring", "allgather", "ulysses", "ringx1o", "ringx4o"]
    masks = ["causal", "full", "sliding_window", "document"]
    results = []
    for schedule in scheds[:2] if quick else scheds:
        for mask_name in masks:
            for dtype_name in ("bfloat16", "float32"):
                for hkv in (h, h // 4):
                    case = {"schedule": schedule, "mask": mask_name, "dtype": dtype_name, "gqa": h // hkv}
                    if time.time() > deadline:
                        results.append({**case, "skipped": "time budget of the section spent"})
                        continue
                    try:
                        dtype = getattr(torch, dtype_name)
                        args = example_mask_args(mask_name, seq)
                        allowed = dense_mask(mask_name, seq, args).to(dev)
                        gen = torch.Generator(device=dev).manual_seed(len(results))
                        x = {n: torch.randn(b, seq, hh, d, generator=gen, device=dev, dtype=torch.float64).to(dtype)
                             for n, hh in (("q", h), ("k", hkv), ("v", hkv), ("dout", h))}
                        scale = d ** -0.5
                        ref = reference(x["q"], x["k"], x["v"], x["dout"], allowed, scale)
                        e_local = local_errors(x, mask_name, scale, allowed, ref)
                        cp = cpattn.ContextParallel(seq, from_spec({"kind": mask_name, **(args or {})}), schedule)
                        q, k, v = (cp.shard(x[n], dim=1).detach().requires_grad_() for n in ("q", "k", "v"))
                        out, lse = cp.attention(q, k, v, return_lse=True)
                        out.backward(cp.shard(x["dout"], dim=1))
                        got = {"out": cp.unshard(out, dim=1), "lse": cp.unshard(lse, dim=2),
                               "dq": cp.unshard(q.grad, dim=1), "dk": cp.unshard(k.grad, dim=1),
                               "dv": cp.unshard(v.grad, dim=1)}
                        errors = {n: rel_error(got[n].detach(), ref[n]) for n in got}
                        bad = [n for n in errors if not errors[n] <= 2 * e_local[n] + 1e-6]
                        case.update(errors=errors, e_local=e_local, ok=not bad, problems=bad)
                    except Exception as exc:
                        case.update(ok=False, error=_error_of(exc), trace=traceback.format_exc()[-3000:])
                    results.append(case)
                    status = "ok" if case["ok"] else f"FAIL {case.get('error') or case['problems']}"
                    log(f"context_parallel {schedule} {mask_name} {dtype_name} gqa={case['gqa']}: {status}")
    return results


# ------------------------------------------------------------------------------------ 4. two ranks
def _rank_main(rank: int, world: int, backend: str, port: int, outdir: str) -> None:
    """One rank of a two-process world on cuda:0: a causal zigzag ring and an all-gather, judged
    against the float64 reference; writes rank<r>.json into ``outdir``."""
    import torch
    import torch.distributed as dist

    import cpattn
    from cpattn.verify import dense_mask, local_errors, reference, rel_error

    report = {"rank": rank, "backend": backend}
    try:
        torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", 0) if backend == "nccl" else None)
        dev = torch.device("cuda", 0)
        seq, b, h, hkv, d, scale = 256, 1, 8, 2, 64, 0.125
        allowed = dense_mask("causal", seq).to(dev)
        gen = torch.Generator(device=dev).manual_seed(0)
        x = {n: torch.randn(b, seq, hh, d, generator=gen, device=dev, dtype=torch.float64).to(torch.bfloat16)
             for n, hh in (("q", h), ("k", hkv), ("v", hkv), ("dout", h))}
        ref = reference(x["q"], x["k"], x["v"], x["dout"], allowed, scale)
        e_local = local_errors(x, "causal", scale, allowed, ref)
        for schedule in ("zigzag_ring", "allgather"):
            cp = cpattn.ContextParallel(seq, "causal", schedule)
            q, k, v = (cp.shard(x[n], dim=1).detach().requires_grad_() for n in ("q", "k", "v"))
            out, lse = cp.attention(q, k, v, softmax_scale=scale, return_lse=True)
            out.backward(cp.shard(x["dout"], dim=1))
            got = {"out": cp.unshard(out, dim=1), "lse": cp.unshard(lse, dim=2), "dq": cp.unshard(q.grad, dim=1),
                   "dk": cp.unshard(k.grad, dim=1), "dv": cp.unshard(v.grad, dim=1)}
            errors = {n: rel_error(got[n].detach(), ref[n]) for n in got}
            report[schedule] = {"errors": errors, "ok": all(errors[n] <= 2 * e_local[n] + 1e-6 for n in errors)}
        dist.destroy_process_group()
    except Exception as exc:
        report["error"] = _error_of(exc)
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(report))


def multirank(timeout: float) -> dict:
    import socket
    import tempfile

    import torch.multiprocessing as mp

    results = {}
    for backend in ("nccl", "gloo"):
        with socket.socket() as s_:
            s_.bind(("127.0.0.1", 0))
            port = s_.getsockname()[1]
        with tempfile.TemporaryDirectory() as outdir:
            ctx = mp.get_context("spawn")
            procs = [ctx.Process(target=_rank_main, args=(r, 2, backend, port, outdir)) for r in range(2)]
            for p in procs:
                p.start()
            deadline = time.time() + timeout
            for p in procs:
                p.join(max(0.0, deadline - time.time()))
            hung = [p.pid for p in procs if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
            ranks = [json.loads(f.read_text()) for f in sorted(Path(outdir).glob("rank*.json"))]
        entry = {"ranks": ranks, "exitcodes": [p.exitcode for p in procs]}
        if hung:
            entry["error"] = f"timed out after {timeout:.0f} s (killed pids {hung})"
        entry["ok"] = (not hung and len(ranks) == 2 and all("error" not in r for r in ranks)
                       and all(r[s]["ok"] for r in ranks for s in ("zigzag_ring", "allgather")))
        results[backend] = entry
        why = entry.get("error") or [r.get("error") for r in ranks]
        log(f"multirank {backend}: {'ok' if entry['ok'] else f'not ok: {why}'}")
    return results


# ------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: CUDA is not available (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
              "this script checks cpattn's CUDA kernel paths and needs an NVIDIA GPU", file=sys.stderr)
        return 2
    import cpattn

    skip = {s for s in args.skip.split(",") if s}
    seqs = [8192] if args.quick else [int(s) for s in args.seqs.split(",") if s]
    report = {"env": {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
                      "capability": list(torch.cuda.get_device_capability()),
                      "cudnn": torch.backends.cudnn.version(), "cpattn": getattr(cpattn, "__version__", None),
                      "available": sorted(cpattn.kernels.available_kernels(torch.device("cuda")))}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    share = {"exactness": 0.45, "bench": 0.25, "context_parallel": 0.12, "multirank": 0.18}
    sections = {"exactness": lambda t: exactness(args.quick, time.time() + t),
                "bench": lambda t: bench(seqs, args.reps, time.time() + t),
                "context_parallel": lambda t: context_parallel(args.quick, time.time() + t),
                "multirank": lambda t: multirank(t / 2)}
    for name, run in sections.items():
        if name in skip:
            continue
        log(f"section {name} ...")
        t0 = time.time()
        try:
            report[name] = run(share[name] * args.budget)
        except Exception as exc:
            report[name] = {"error": _error_of(exc), "trace": traceback.format_exc()[-3000:]}
        report.setdefault("seconds", {})[name] = round(time.time() - t0, 1)
        out.write_text(json.dumps(report, indent=1, default=str))
        log(f"section {name} done in {time.time() - t0:.0f} s; report in {out}")
    failed = _failures(report)
    report["failures"] = failed
    out.write_text(json.dumps(report, indent=1, default=str))
    log(f"finished in {time.time() - started:.0f} s: {len(failed)} failure(s)" + "".join(f"\n  {f}" for f in failed))
    return 1 if failed else 0


def _failures(report: dict) -> list[str]:
    failed = []
    for section in ("exactness", "context_parallel"):
        val = report.get(section)
        if isinstance(val, dict) and "error" in val:
            failed.append(f"{section}: {val['error']}")
        for case in val if isinstance(val, list) else []:
            if "skipped" not in case and not case.get("ok"):
                failed.append(f"{section}: " + json.dumps({k: v for k, v in case.items() if k != "trace"},
                                                          default=str)[:400])
    if isinstance(report.get("bench"), dict):
        failed.append(f"bench: {report['bench'].get('error')}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
