"""Local attention on one device: the single kernel contract every schedule uses.

Tensors are ``[b, s, h, d]`` (q) and ``[b, s_kv, h_kv, d]`` (k, v) with ``h % h_kv == 0`` (GQA: query
head i uses key/value head ``i // (h // h_kv)``; repeated heads are never materialised on the CPU
paths). A block has a :class:`~cpattn.masks.BlockKind`: FULL, CAUSAL (square, local row i attends local
columns <= i) or PARTIAL (explicit boolean ``mask [s_q, s_kv]``).

- ``forward(q, k, v, kind, scale, mask) -> (out [b, s_q, h, d], lse [b, h, s_q])``
- ``backward(dout, q, k, v, out, lse, kind, scale, mask) -> (dq, dk, dv)``

Results are in the *accumulation dtype* (:func:`acc_dtype`: float32, or float64 for float64 inputs) so
schedules merge and sum them without extra casts. The backward takes the *final* ``out`` and ``lse``
of the whole row (after every block is merged): that is what makes per-block gradients add up exactly.
Rows with no allowed key give out 0, lse -inf and zero gradients, never NaN.

Backends: ``aten`` (PyTorch's flash kernels: the CPU op, or the CUDA op for fp16/bf16) for FULL and
CAUSAL blocks; ``math`` (plain torch, chunked over queries so memory stays bounded) for PARTIAL
blocks, float64, and as the reference-quality path. ``auto`` takes ``aten`` where it applies.
"""

from __future__ import annotations

import math

import torch

from . import trace
from .masks import BlockKind

BACKENDS = ("auto", "aten", "math")
#: the one dtype table: name -> torch dtype of every supported q/k/v dtype (float64: CPU reference work)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
SUPPORTED_DTYPES = tuple(DTYPES.values())
#: query rows per chunk on the math path: bounds the score matrix to chunk x s_kv per head
MATH_CHUNK_ROWS = 512


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of partial outputs, lse and gradient accumulators for inputs of ``dtype`` (the one
    accumulator rule: float64 for float64 inputs, float32 otherwise)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """The :data:`DTYPES` name of a torch dtype (ValueError for an unsupported one)."""
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not supported; accepted: {', '.join(DTYPES)}")


def acc_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of the accumulators of inputs of ``dtype`` (:func:`acc_dtype`)."""
    return torch.empty((), dtype=acc_dtype(dtype)).element_size()


def element_bytes(name: str, accumulator: bool = False) -> int:
    """Bytes per element of dtype ``name`` (a :data:`DTYPES` key), or of its accumulators."""
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is unknown; accepted: {', '.join(DTYPES)}")
    return acc_bytes(DTYPES[name]) if accumulator else torch.empty((), dtype=DTYPES[name]).element_size()


def check_backend(backend: str) -> None:
    if backend in ("flash_attn", "flex"):
        raise NotImplementedError(
            f"backend={backend!r} is not available in this build; accepted: {', '.join(BACKENDS)}"
        )
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; accepted: {', '.join(BACKENDS)}")


def _use_aten(q: torch.Tensor, kind: BlockKind, backend: str) -> bool:
    if kind == BlockKind.PARTIAL or backend == "math":
        return False
    if q.device.type == "cpu":
        return True
    if q.device.type == "cuda":
        if q.dtype in (torch.float16, torch.bfloat16):
            return True
        if backend == "aten":
            raise ValueError(f"backend='aten' on CUDA needs float16 or bfloat16, got {q.dtype}; use 'auto'")
        return False
    if backend == "aten":
        raise ValueError(f"backend='aten' does not run on device {q.device.type!r}; use 'math'")
    return False


def _check_block(q: torch.Tensor, k: torch.Tensor, kind: BlockKind, mask: torch.Tensor | None) -> None:
    if kind == BlockKind.EMPTY:
        raise ValueError("an EMPTY block has nothing to compute; schedules must skip it")
    if kind == BlockKind.CAUSAL and q.shape[1] != k.shape[1]:
        raise ValueError(f"a CAUSAL block must be square, got s_q={q.shape[1]} s_kv={k.shape[1]}")
    if kind == BlockKind.PARTIAL:
        if mask is None or mask.shape != (q.shape[1], k.shape[1]) or mask.dtype != torch.bool:
            raise ValueError(f"a PARTIAL block needs a bool mask of shape {(q.shape[1], k.shape[1])}")


# --------------------------------------------------------------------------------------- aten path
def _aten_forward(q, k, v, causal: bool, scale: float):
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qt, kt, vt, 0.0, causal, scale=scale)
        return out.transpose(1, 2), lse
    groups = q.shape[2] // k.shape[2]  # the CUDA flash op wants equal heads: repeat locally only
    if groups > 1:
        kt, vt = kt.repeat_interleave(groups, 1), vt.repeat_interleave(groups, 1)
    res = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=scale)
    return res[0].transpose(1, 2), res[1]


def _aten_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    dt, ot = dout.transpose(1, 2), out.transpose(1, 2)
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dt, qt, kt, vt, ot, lse.contiguous(), 0.0, causal, scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        kt, vt = kt.repeat_interleave(groups, 1), vt.repeat_interleave(groups, 1)
    sq, sk = q.shape[1], k.shape[1]
    empty = torch.empty(0, dtype=torch.long, device=q.device)
    zero = torch.zeros((), dtype=torch.long, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dt, qt, kt, vt, ot, lse.contiguous(), empty, empty, sq, sk, 0.0, causal, zero, zero, scale=scale)
    if groups > 1:
        b, h, s, d = dk.shape
        dk = dk.view(b, h // groups, groups, s, d).sum(2)
        dv = dv.view(b, h // groups, groups, s, d).sum(2)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# --------------------------------------------------------------------------------------- math path
def _allowed(kind: BlockKind, mask: torch.Tensor | None, r0: int, r1: int, sk: int, device) -> torch.Tensor | None:
    """Boolean [r1 - r0, sk] for query rows r0..r1 of the block, or None when every pair attends."""
    if kind == BlockKind.FULL:
        return None
    if kind == BlockKind.CAUSAL:
        qi = torch.arange(r0, r1, device=device).unsqueeze(1)
        return torch.arange(sk, device=device).unsqueeze(0) <= qi
    return mask[r0:r1].to(device)


def _math_forward(q, k, v, kind, scale, mask):
    acc = acc_dtype(q.dtype)
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    kf, vf = k.to(acc), v.to(acc)
    out = torch.empty(b, sq, h, d, dtype=acc, device=q.device)
    lse = torch.empty(b, h, sq, dtype=acc, device=q.device)
    for r0 in range(0, sq, MATH_CHUNK_ROWS):
        r1 = min(sq, r0 + MATH_CHUNK_ROWS)
        qc = q[:, r0:r1].to(acc).view(b, r1 - r0, hkv, g, d)
        s = torch.einsum("bqngd,bknd->bngqk", qc, kf) * scale
        allowed = _allowed(kind, mask, r0, r1, sk, q.device)
        if allowed is not None:
            s = s.masked_fill(~allowed, float("-inf"))
        m = torch.logsumexp(s, dim=-1)  # [b, n, g, q]; -inf where the row has no key
        p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m).unsqueeze(-1))
        o = torch.einsum("bngqk,bknd->bqngd", p, vf)
        out[:, r0:r1] = o.reshape(b, r1 - r0, h, d)
        lse[:, :, r0:r1] = m.reshape(b, h, r1 - r0)
    return out, lse


def _math_backward(dout, q, k, v, out, lse, kind, scale, mask):
    acc = acc_dtype(q.dtype)
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    kf, vf = k.to(acc), v.to(acc)
    dq = torch.empty(b, sq, h, d, dtype=acc, device=q.device)
    dk = torch.zeros(b, sk, hkv, d, dtype=acc, device=q.device)
    dv = torch.zeros(b, sk, hkv, d, dtype=acc, device=q.device)
    for r0 in range(0, sq, MATH_CHUNK_ROWS):
        r1 = min(sq, r0 + MATH_CHUNK_ROWS)
        n = r1 - r0
        qc = q[:, r0:r1].to(acc).view(b, n, hkv, g, d)
        doc = dout[:, r0:r1].to(acc).view(b, n, hkv, g, d)
        oc = out[:, r0:r1].to(acc).view(b, n, hkv, g, d)
        lc = lse[:, :, r0:r1].to(acc).reshape(b, hkv, g, n)
        s = torch.einsum("bqngd,bknd->bngqk", qc, kf) * scale
        allowed = _allowed(kind, mask, r0, r1, sk, q.device)
        if allowed is not None:
            s = s.masked_fill(~allowed, float("-inf"))
        p = torch.exp(s - torch.where(torch.isinf(lc), 0.0, lc).unsqueeze(-1))
        dv += torch.einsum("bngqk,bqngd->bknd", p, doc)
        dp = torch.einsum("bqngd,bknd->bngqk", doc, vf)
        delta = (doc * oc).sum(-1).permute(0, 2, 3, 1).unsqueeze(-1)  # [b, n, g, q, 1]
        ds = p * (dp - delta)
        dq[:, r0:r1] = (torch.einsum("bngqk,bknd->bqngd", ds, kf) * scale).reshape(b, n, h, d)
        dk += torch.einsum("bngqk,bqngd->bknd", ds, qc) * scale
    return dq, dk, dv


# --------------------------------------------------------------------------------------- contract
def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: BlockKind, scale: float,
            mask: torch.Tensor | None = None, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block. Returns ``out [b, s_q, h, d]`` and ``lse [b, h, s_q]`` in the
    accumulation dtype."""
    _check_block(q, k, kind, mask)
    trace.compute("forward", kind.value, q.shape[1], k.shape[1])
    if _use_aten(q, kind, backend):
        out, lse = _aten_forward(q, k, v, kind == BlockKind.CAUSAL, scale)
        acc = acc_dtype(q.dtype)
        return out.to(acc), lse.to(acc)
    return _math_forward(q, k, v, kind, scale, mask)


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, kind: BlockKind, scale: float, mask: torch.Tensor | None = None,
             backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the row's final ``out`` (input dtype) and ``lse``.
    Returns ``dq [b, s_q, h, d]``, ``dk, dv [b, s_kv, h_kv, d]`` in the accumulation dtype."""
    _check_block(q, k, kind, mask)
    trace.compute("backward", kind.value, q.shape[1], k.shape[1])
    if _use_aten(q, kind, backend):
        lse32 = lse.to(torch.float32) if q.dtype != torch.float64 else lse
        dq, dk, dv = _aten_backward(dout, q, k, v, out, lse32, kind == BlockKind.CAUSAL, scale)
        acc = acc_dtype(q.dtype)
        return dq.to(acc), dk.to(acc), dv.to(acc)
    return _math_backward(dout, q, k, v, out, lse, kind, scale, mask)
