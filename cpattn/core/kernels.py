"""Local attention on one device: the single kernel contract every schedule uses.

Tensors are ``[b, s, h, d]`` (q) and ``[b, s_kv, h_kv, d]`` (k, v) with ``h % h_kv == 0`` (GQA: query
head i uses key/value head ``i // (h // h_kv)``). A block has a :class:`~cpattn.masks.BlockKind`: FULL,
CAUSAL (square, local row i attends local columns <= i; square makes top-left and bottom-right
alignment the same, so every kernel's causal flag means the same thing) or PARTIAL (explicit boolean
``mask [s_q, s_kv]``, or a :class:`~cpattn.core.flex_masks.Region`: the mask's structure over the
block, which ``flex_cuda`` turns into a block mask and the other paths into the boolean matrix).

- ``forward(q, k, v, kind, scale, mask) -> (out [b, s_q, h, d], lse [b, h, s_q])``
- ``backward(dout, q, k, v, out, lse, kind, scale, mask, delta=None) -> (dq, dk, dv)``
- ``forward_stacked`` / ``backward_stacked``: the same for ``pieces`` blocks of one kind and shape
  stacked along the batch dimension, in one call (``cpattn.core.blocks.batches``); PARTIAL ones with their
  masks stacked ``[pieces, s_q, s_kv]`` (every PARTIAL path takes one mask per batch row,
  ``cuda_ops.per_row_mask``)

Results are in the *accumulation dtype* (:func:`acc_dtype`: float32, or float64 for float64 inputs) so
schedules merge and sum them without extra casts. The backward takes the *final* ``out`` and ``lse``
of the whole row (after every block is merged): that is what makes per-block gradients add up exactly.
The backward needs ``out`` only through ``D = rowsum(dout * out)`` (``delta [b, h, s_q]``, accumulation
dtype); a caller that has D and not ``out`` passes ``out=None, delta=D``. The ``math`` path takes D
directly (:data:`DELTA_PATHS`); the fused ops compute D from ``out`` themselves, so they get
:func:`out_for_delta`, a tensor whose rowsum with ``dout`` is D (the same gradients, on the same path).
Rows with no allowed key give out 0, lse -inf and zero gradients, never NaN.

Each call runs one named *kernel path* (:data:`PATHS`), chosen by the pure function
:func:`choose_kernel` from the device type, dtype, head dim, block kind, the paths this process has
(:func:`available_kernels`) and the ``backend`` asked for (docs/cuda.md has the table):

- ``flash_cpu``: PyTorch's CPU flash op, FULL and CAUSAL blocks, every dtype; float32 PARTIAL blocks
  with an additive mask (0 / -inf; a row with no allowed key gets lse -inf as the contract says);
- ``flash_cuda``, ``cudnn_cuda``, ``efficient_cuda``: PyTorch's fused CUDA ops, FULL and CAUSAL;
- ``flex_cuda``: FlexAttention with a block mask, PARTIAL blocks on CUDA;
- ``flash_attn``, ``flash_attn3``, ``flash_attn4``: the optional FlashAttention-2, -3 and -4 packages, FULL and
  CAUSAL on CUDA, when pinned (``backend=`` the same name) or ordered by a measured kernel-table row;
- ``math``: plain torch, chunked over queries so memory stays bounded; float64, low-precision PARTIAL
  blocks off CUDA, and whatever no fused kernel fits. It is also the reference-quality path.

The CUDA op wrappers live in :mod:`cpattn.core.cuda_ops`. A path whose op has no grouped-query support
gets its key/value heads expanded (:func:`expand_kv`) and its dk/dv summed back over each group
(:func:`reduce_kv_grad`), in float32.

Why one module over 500 lines: it is the one kernel contract (docs/architecture.md, "Kernels"): the dispatch
table, the paths and the checks every path shares.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from . import cuda_ops, kernel_order, trace
from .flex_masks import Region
from .masks import BlockKind, CausalMask, FullMask

BACKENDS = ("auto", "aten", "flash_attn", "flash_attn3", "flash_attn4", "math")
#: backends that pin an optional package's kernel: FlashAttention-2, -3 (``flash_attn_interface``), -4
#: (``flash_attn.cute``); each is also the name of its kernel path
PACKAGE_BACKENDS = tuple(cuda_ops.FLASH_ATTN_MODULES)
#: every kernel path :func:`choose_kernel` can return
PATHS = ("flash_cpu", "flash_cuda", "cudnn_cuda", "efficient_cuda", "flex_cuda", *PACKAGE_BACKENDS, "math")
#: paths whose backward takes ``delta = rowsum(dout * out)`` in place of ``out``
DELTA_PATHS = frozenset({"math"})
#: paths whose op takes fewer key/value heads than query heads; the others get expanded heads
NATIVE_GQA = frozenset({"flash_cpu", "flash_cuda", "flex_cuda", *PACKAGE_BACKENDS, "math"})
#: the one dtype table: name -> torch dtype of every supported q/k/v dtype (float64: CPU reference work)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
SUPPORTED_DTYPES = tuple(DTYPES.values())
#: query rows per chunk on the math path: bounds the score matrix to chunk x s_kv per head
MATH_CHUNK_ROWS = 512

_HALF = (torch.float16, torch.bfloat16)


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
    return acc_dtype(dtype).itemsize


def element_bytes(name: str, accumulator: bool = False) -> int:
    """Bytes per element of dtype ``name`` (a :data:`DTYPES` key), or of its accumulators."""
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is unknown; accepted: {', '.join(DTYPES)}")
    return acc_bytes(DTYPES[name]) if accumulator else DTYPES[name].itemsize


# --------------------------------------------------------------------------------------- dispatch
def _check_backend_name(backend: str) -> None:
    if backend == "flex":
        raise NotImplementedError(
            "backend='flex' is not a separate choice: FlexAttention already runs PARTIAL blocks on CUDA "
            f"under every other backend; accepted: {', '.join(BACKENDS)}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; accepted: {', '.join(BACKENDS)}")


#: what each package backend needs: its package and the GPUs it runs on
_PACKAGE_NEEDS = {"flash_attn": "the flash_attn package (pip install flash-attn)",
                  "flash_attn3": "FlashAttention-3 (the flash_attn_interface module, built for Hopper GPUs)",
                  "flash_attn4": "FlashAttention-4 (the flash-attn-4 package, flash_attn.cute; Hopper or Blackwell)"}


def _flash_attn_missing(backend: str) -> ImportError:
    return ImportError(f"backend={backend!r} needs {_PACKAGE_NEEDS[backend]}, which this process does not "
                       "have; without it use 'auto', 'aten' or 'math'")


def _installed(backend: str) -> bool:
    """Whether the module of package backend ``backend`` can be imported (a missing parent is missing too)."""
    try:
        return importlib.util.find_spec(cuda_ops.FLASH_ATTN_MODULES[backend]) is not None
    except ModuleNotFoundError:
        return False


def check_backend(backend: str) -> None:
    """Raise for a backend name this process cannot run: ValueError for an unknown name,
    NotImplementedError for ``flex`` (not a separate choice), ImportError naming the package for
    ``flash_attn``, ``flash_attn3`` or ``flash_attn4`` when it is not installed."""
    _check_backend_name(backend)
    if backend in PACKAGE_BACKENDS and not _installed(backend):
        raise _flash_attn_missing(backend)


def kernel_fits(path: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether kernel path ``path`` takes inputs of ``dtype`` and ``head_dim`` (the ops' own limits,
    kept conservative: a case outside them goes to the next path, in the end to ``math``)."""
    if path in ("math", "flash_cpu"):
        return True
    if path in ("flash_cuda", "flash_attn", "flash_attn3"):  # FlashAttention-2/3: half, d <= 256, d % 8 == 0
        return dtype in _HALF and head_dim % 8 == 0 and head_dim <= 256
    if path == "flash_attn4":  # FlashAttention-4: half precision, the head dims it is built for
        return dtype in _HALF and head_dim in (64, 96, 128)
    if path == "cudnn_cuda":  # cuDNN fused attention: half precision, d <= 128 on every GPU generation
        return dtype in _HALF and head_dim % 8 == 0 and head_dim <= 128
    if path == "efficient_cuda":  # memory-efficient kernel: also float32; rows aligned to 8 (half) or 4
        align = 4 if dtype == torch.float32 else 8
        return dtype in (*_HALF, torch.float32) and head_dim % align == 0 and head_dim <= 256
    if path == "flex_cuda":  # Triton FlexAttention: head dims from 16 (smaller tiles are not generated)
        return dtype in (*_HALF, torch.float32) and 16 <= head_dim <= 256
    raise ValueError(f"kernel path {path!r} is unknown; known: {', '.join(PATHS)}")


#: on the CPU, bfloat16 / float16 blocks with fewer keys run on ``math``: torch's CPU flash kernel loses
#: log-sum-exp precision on short blocks in low precision (relative error about 6e-6 at 16 keys, 2e-6 at
#: 64, 1.4e-6 at 128, against 4e-8 on ``math``), more than the whole sequence's own error, which is the
#: exactness yardstick (testing.md)
CPU_FLASH_MIN_KEYS_LOW_PRECISION = 128
#: dtypes whose PARTIAL blocks run on the CPU flash op with an additive mask: a masked row may keep only
#: a few of the block's keys, which is the short-row case above, so bfloat16 / float16 stay on ``math``;
#: float64 stays on ``math``, the reference-quality path
CPU_FLASH_PARTIAL_DTYPES = (torch.float32,)


def choose_kernel(device_type: str, dtype: torch.dtype, head_dim: int, kind: BlockKind,
                  available: frozenset[str], backend: str = "auto", kv_len: int | None = None,
                  softcap: bool = False, capability: tuple[int, int] | None = None) -> str:
    """The kernel path (a :data:`PATHS` name) for one block: a pure function of its arguments.

    ``available`` is the set of paths this process can run (:func:`available_kernels`). ``math``
    always gets ``math``. CPU: ``flash_cpu`` for FULL and CAUSAL blocks and for float32 PARTIAL ones (an
    additive mask, :data:`CPU_FLASH_PARTIAL_DTYPES`), ``math`` for other PARTIAL ones and for bfloat16 /
    float16 blocks of fewer than :data:`CPU_FLASH_MIN_KEYS_LOW_PRECISION` keys (``kv_len``).
    CUDA: PARTIAL blocks take ``flex_cuda`` when it fits; FULL and CAUSAL blocks take the package a
    :data:`PACKAGE_BACKENDS` backend names when it fits, else the first path of the measured order for the
    GPU's ``capability``, dtype and head dim (:func:`cpattn.core.kernel_order.cuda_order`; None: a GPU not
    measured) that is available and fits; with none, ``auto`` and the package backends fall back to ``math``
    while ``aten`` raises ValueError (it promised a fused kernel). Other devices run ``math`` (``aten`` raises).

    ``softcap``: the block's scores are soft-capped, which only the paths that apply a score
    modification can do: ``flex_cuda`` (its ``score_mod``) on CUDA when it fits, else ``math``, under
    ``auto``; ``math`` under ``math``; any other backend raises ValueError."""
    _check_backend_name(backend)
    if kind == BlockKind.EMPTY:
        raise ValueError("an EMPTY block has nothing to compute; schedules must skip it")
    if backend == "math":
        return "math"
    flex = "flex_cuda" in available and kernel_fits("flex_cuda", dtype, head_dim)
    if softcap:
        check_softcap_backend(backend)
        return "flex_cuda" if device_type == "cuda" and flex else "math"
    if device_type == "cpu":
        short = kv_len is not None and kv_len < CPU_FLASH_MIN_KEYS_LOW_PRECISION and dtype in _HALF
        fits = kind != BlockKind.PARTIAL or dtype in CPU_FLASH_PARTIAL_DTYPES
        return "flash_cpu" if fits and not short and "flash_cpu" in available else "math"
    if device_type != "cuda":
        if backend == "aten":
            raise ValueError(f"backend='aten' does not run on device {device_type!r}; use 'math'")
        return "math"
    if backend in PACKAGE_BACKENDS and backend not in available:
        raise _flash_attn_missing(backend)
    if kind == BlockKind.PARTIAL:
        return "flex_cuda" if flex else "math"
    if backend in PACKAGE_BACKENDS and kernel_fits(backend, dtype, head_dim):
        return backend
    for path in kernel_order.cuda_order(capability, dtype_name(dtype), head_dim):
        if path in available and kernel_fits(path, dtype, head_dim):
            return path
    if backend == "aten":
        raise ValueError(f"backend='aten' has no fused CUDA kernel for dtype={dtype} head_dim={head_dim} "
                         f"(available: {', '.join(sorted(available))}); use 'auto', which falls back to 'math'")
    return "math"


def available_kernels(device: torch.device) -> frozenset[str]:
    """The kernel paths this process can run on ``device``. On CUDA: what the GPU, this torch build
    and the installed packages support, less the fused SDPA kernels switched off through
    ``torch.backends.cuda.enable_flash_sdp`` / ``enable_mem_efficient_sdp`` / ``enable_cudnn_sdp``."""
    if device.type == "cpu":
        return frozenset({"flash_cpu", "math"})
    if device.type != "cuda":
        return frozenset({"math"})
    index = device.index if device.index is not None else torch.cuda.current_device()
    switches = {"flash_cuda": torch.backends.cuda.flash_sdp_enabled(),
                "efficient_cuda": torch.backends.cuda.mem_efficient_sdp_enabled(),
                "cudnn_cuda": torch.backends.cuda.cudnn_sdp_enabled()}
    return frozenset(p for p in _cuda_paths(index) if switches.get(p, True))


def capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA ``device`` (None for other devices): the key of the kernel order."""
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@cache
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


@cache
def _cuda_paths(index: int) -> frozenset[str]:
    """Paths the GPU ``index`` supports with this torch build and these packages (before switches)."""
    major, minor = torch.cuda.get_device_capability(index)
    ampere = (major, minor) >= (8, 0)
    supported = {
        "math": True,
        "efficient_cuda": (major, minor) >= (5, 0),
        "flash_cuda": ampere and torch.backends.cuda.is_flash_attention_available(),
        "cudnn_cuda": ampere and torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90000,
        "flex_cuda": ampere and cuda_ops.flex_supported(),
        "flash_attn": ampere and _installed("flash_attn"),
        "flash_attn3": major == 9 and _installed("flash_attn3"),  # built for Hopper only
        "flash_attn4": major in (9, 10) and _installed("flash_attn4"),
    }
    return frozenset(p for p, ok in supported.items() if ok)


def _check_block(q: torch.Tensor, k: torch.Tensor, kind: BlockKind, mask: torch.Tensor | None,
                 pieces: int | None = None) -> None:
    if kind == BlockKind.EMPTY:
        raise ValueError("an EMPTY block has nothing to compute; schedules must skip it")
    if kind == BlockKind.CAUSAL and q.shape[1] != k.shape[1]:
        raise ValueError(f"a CAUSAL block must be square, got s_q={q.shape[1]} s_kv={k.shape[1]}")
    if kind == BlockKind.PARTIAL:
        shape = (q.shape[1], k.shape[1]) if pieces is None else (pieces, q.shape[1], k.shape[1])
        if isinstance(mask, Region) and pieces is None:
            if (mask.s_q, mask.s_kv) != shape:
                raise ValueError(f"a PARTIAL block's region is {mask.s_q} x {mask.s_kv}, its tensors {shape}")
        elif mask is None or mask.shape != shape or mask.dtype != torch.bool:
            raise ValueError(f"a PARTIAL block needs a bool mask of shape {shape} (or a Region, unstacked)")


def _mask_for(path: str, mask):
    """A PARTIAL block's mask as ``path`` takes it: a :class:`~cpattn.core.flex_masks.Region` stays one on
    ``flex_cuda`` (its block mask comes from its structure) and is made dense for the other paths, which
    take a boolean matrix (small blocks only: a region is chosen only where ``flex_cuda`` runs it,
    :func:`region_calls`)."""
    return mask.dense() if isinstance(mask, Region) and path != "flex_cuda" else mask


def region_calls(q: torch.Tensor, mask, backend: str = "auto", softcap: float | None = None) -> bool:
    """Whether the blocks of one rank's step run as one call per region (``cpattn.core.blocks.rectangles``
    with ``regions``): where PARTIAL blocks run on ``flex_cuda`` and ``mask`` (a ``cpattn.masks.Mask``)
    is neither causal nor full, whose blocks the dense kernels run faster."""
    if isinstance(mask, (CausalMask, FullMask)):
        return False
    return kernel_for(q, BlockKind.PARTIAL, backend, softcap=softcap) == "flex_cuda"


# --------------------------------------------------------------------------------------- GQA
def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[b, s, h_kv, d] -> [b, s, h_kv * groups, d]``: head j of the result is head ``j // groups``
    (the GQA convention), for ops that want as many key/value heads as query heads."""
    if groups == 1:
        return x
    b, s, hkv, d = x.shape
    return x.unsqueeze(3).expand(b, s, hkv, groups, d).reshape(b, s, hkv * groups, d)


def reduce_kv_grad(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of :func:`expand_kv` for gradients: ``[b, s, h_kv * groups, d] -> [b, s, h_kv, d]``,
    each key/value head's gradient summed over its group in the accumulation dtype."""
    if groups == 1:
        return dx
    b, s, h, d = dx.shape
    return dx.to(acc_dtype(dx.dtype)).view(b, s, h // groups, groups, d).sum(3)


# --------------------------------------------------------------------------------------- CPU flash path
def _bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of the CPU flash op (0 allowed, -inf not; the op wants the query dtype) of a
    bool ``[s_q, s_kv]`` or per-batch-row ``[B, s_q, s_kv]`` mask: ``[1 or B, 1, s_q, s_kv]``."""
    m = mask if mask.dim() == 3 else mask.unsqueeze(0)
    return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf")).unsqueeze(1)


def _cpu_flash_forward(q, k, v, kind, scale, mask):
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    dense = cuda_ops.per_row_mask(mask, q.shape[0], q.device) if kind == BlockKind.PARTIAL else None
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qt, kt, vt, 0.0, kind == BlockKind.CAUSAL, attn_mask=None if dense is None else _bias(dense, q.dtype),
        scale=scale)
    if dense is not None:  # the op gives a row with no allowed key out 0 and lse 0; the contract says -inf
        lse = lse.masked_fill(cuda_ops.empty_rows(dense).unsqueeze(-2), float("-inf"))
    return out.transpose(1, 2), lse


def _cpu_flash_backward(dout, q, k, v, out, lse, kind, scale, mask):
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    dt, ot = dout.transpose(1, 2), out.transpose(1, 2)
    lse = lse.to(acc_dtype(q.dtype)).contiguous()
    bias = None
    if kind == BlockKind.PARTIAL:
        bias = _bias(cuda_ops.per_row_mask(mask, q.shape[0], q.device), q.dtype)
        # a row with no key anywhere has lse -inf, and the op's exp(-inf - lse) would be NaN: any finite
        # lse gives its masked scores weight 0 (a row this block masks but others reach has a finite one)
        lse = lse.masked_fill(torch.isneginf(lse), 0.0)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dt, qt, kt, vt, ot, lse, 0.0, kind == BlockKind.CAUSAL, attn_mask=bias, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# --------------------------------------------------------------------------------------- math path
def _scores(qc: torch.Tensor, kf: torch.Tensor, scale: float, softcap: float | None, kind: BlockKind,
            mask: torch.Tensor | None, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores ``[b, h_kv, g, r1 - r0, s_kv]`` of the block's query rows r0..r1 (``qc [b, r1 - r0, h_kv, g, d]``
    against ``kf [b, s_kv, h_kv, d]``), soft-capped as ``tanh(s / softcap) * softcap`` (Gemma 2) and -inf
    where the block leaves a pair out (its kind, or its mask: ``[s_q, s_kv]``, or a stacked ``[pieces, s_q,
    s_kv]`` one over the ``b`` batch rows, taken as ``[b, 1, 1, r1 - r0, s_kv]``); and ``tanh(s / softcap)``
    for the backward's chain rule (None without capping)."""
    s = torch.einsum("bqngd,bknd->bngqk", qc, kf) * scale
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(s / softcap)
        s = tanh * softcap
    if kind == BlockKind.FULL:
        return s, tanh
    if kind == BlockKind.CAUSAL:
        qi = torch.arange(r0, r1, device=qc.device).unsqueeze(1)
        allowed = torch.arange(kf.shape[1], device=qc.device).unsqueeze(0) <= qi
    elif mask.dim() == 2:
        allowed = mask[r0:r1].to(qc.device)
    else:
        allowed = cuda_ops.per_row_mask(mask[:, r0:r1], qc.shape[0], qc.device)[:, None, None]
    return s.masked_fill(~allowed, float("-inf")), tanh


def _math_forward(q, k, v, kind, scale, mask, softcap=None):
    acc = acc_dtype(q.dtype)
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    kf, vf = k.to(acc), v.to(acc)
    out = torch.empty(b, sq, h, d, dtype=acc, device=q.device)
    lse = torch.empty(b, h, sq, dtype=acc, device=q.device)
    for r0 in range(0, sq, MATH_CHUNK_ROWS):
        r1 = min(sq, r0 + MATH_CHUNK_ROWS)
        qc = q[:, r0:r1].to(acc).view(b, r1 - r0, hkv, g, d)
        s, _ = _scores(qc, kf, scale, softcap, kind, mask, r0, r1)
        m = torch.logsumexp(s, dim=-1)  # [b, n, g, q]; -inf where the row has no key
        p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m).unsqueeze(-1))
        o = torch.einsum("bngqk,bknd->bqngd", p, vf)
        out[:, r0:r1] = o.reshape(b, r1 - r0, h, d)
        lse[:, :, r0:r1] = m.reshape(b, h, r1 - r0)
    return out, lse


def _math_backward(dout, q, k, v, out, lse, kind, scale, mask, delta=None, softcap=None):
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
        lc = lse[:, :, r0:r1].to(acc).reshape(b, hkv, g, n)
        s, tanh = _scores(qc, kf, scale, softcap, kind, mask, r0, r1)
        p = torch.exp(s - torch.where(torch.isinf(lc), 0.0, lc).unsqueeze(-1))
        dv += torch.einsum("bngqk,bqngd->bknd", p, doc)
        dp = torch.einsum("bqngd,bknd->bngqk", doc, vf)
        if delta is None:
            dc = (doc * out[:, r0:r1].to(acc).view(b, n, hkv, g, d)).sum(-1).permute(0, 2, 3, 1)
        else:
            dc = delta[:, :, r0:r1].to(acc).reshape(b, hkv, g, n)
        ds = p * (dp - dc.unsqueeze(-1))  # dc: [b, n, g, q]
        if tanh is not None:  # through the cap: d(tanh(x / c) c) / dx = 1 - tanh^2
            ds = ds * (1 - tanh * tanh)
        dq[:, r0:r1] = (torch.einsum("bngqk,bknd->bqngd", ds, kf) * scale).reshape(b, n, h, d)
        dk += torch.einsum("bngqk,bqngd->bknd", ds, qc) * scale
    return dq, dk, dv


# --------------------------------------------------------------------------------------- contract
def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


_FORWARD: dict[str, Callable] = {
    "flash_cpu": _cpu_flash_forward, "math": _math_forward,
    "flash_cuda": cuda_ops.flash_forward, "cudnn_cuda": cuda_ops.cudnn_forward,
    "efficient_cuda": cuda_ops.efficient_forward, "flex_cuda": cuda_ops.flex_forward,
    "flash_attn": cuda_ops.flash_attn_forward, "flash_attn3": cuda_ops.flash_attn3_forward,
    "flash_attn4": cuda_ops.flash_attn4_forward,
}
_BACKWARD: dict[str, Callable] = {
    "flash_cpu": _cpu_flash_backward, "math": _math_backward,
    "flash_cuda": cuda_ops.flash_backward, "cudnn_cuda": cuda_ops.cudnn_backward,
    "efficient_cuda": cuda_ops.efficient_backward, "flex_cuda": cuda_ops.flex_backward,
    "flash_attn": cuda_ops.flash_attn_backward, "flash_attn3": cuda_ops.flash_attn3_backward,
    "flash_attn4": cuda_ops.flash_attn4_backward,
}


def _expands(path: str, q: torch.Tensor, k: torch.Tensor, expand: bool | None) -> int:
    """The GQA group size to expand key/value heads by for ``path`` (1: none)."""
    groups = q.shape[2] // k.shape[2]
    if expand is None:
        expand = path not in NATIVE_GQA
    return groups if expand else 1


def check_softcap_backend(backend: str) -> None:
    """Raise unless ``backend`` can soft-cap scores ("auto" or "math": they choose a path that applies a
    score modification)."""
    if backend not in ("auto", "math"):
        raise ValueError(f"soft-capping runs on the kernel paths that apply a score modification (FlexAttention "
                         f"on CUDA, 'math'), not backend={backend!r}: use backend='auto' or 'math'")


#: the kernel paths that apply a score modification, so soft-capping
SOFTCAP_PATHS = frozenset({"math", "flex_cuda"})


def _check_softcap(path: str, softcap: float | None) -> dict:
    """The keyword a kernel path takes for ``softcap`` (:data:`SOFTCAP_PATHS` apply it; others raise)."""
    if softcap is None:
        return {}
    if path not in SOFTCAP_PATHS:
        raise ValueError(f"soft-capping (softcap={softcap}) runs on the {' and '.join(sorted(SOFTCAP_PATHS))} "
                         f"kernel paths only, not {path!r}: use backend='auto' or 'math'")
    return {"softcap": softcap}


def _run_forward(path, q, k, v, kind, scale, mask, expand, softcap=None):
    groups = _expands(path, q, k, expand)
    extra = _check_softcap(path, softcap)
    out, lse = _FORWARD[path](q, expand_kv(k, groups), expand_kv(v, groups), kind, scale, _mask_for(path, mask),
                              **extra)
    acc = acc_dtype(q.dtype)
    return out.to(acc), lse.to(acc)


def _run_backward(path, dout, q, k, v, out, lse, kind, scale, mask, expand, delta=None, softcap=None):
    groups = _expands(path, q, k, expand)
    extra = _check_softcap(path, softcap)
    if delta is not None and path in DELTA_PATHS:
        extra["delta"] = delta
    elif out is None:  # a fused path gets a stand-in out for delta; math takes delta as is
        out = out_for_delta(dout, delta)
    dq, dk, dv = _BACKWARD[path](dout, q, expand_kv(k, groups), expand_kv(v, groups), out, lse, kind, scale,
                                 _mask_for(path, mask), **extra)
    acc = acc_dtype(q.dtype)
    return dq.to(acc), reduce_kv_grad(dk, groups).to(acc), reduce_kv_grad(dv, groups).to(acc)


def forward_with(path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: BlockKind, scale: float,
                 mask: torch.Tensor | None = None, expand: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward` on the named kernel path (no dispatch, no trace record). ``expand`` forces (True)
    or skips (False) the key/value head expansion; None expands for paths without native GQA."""
    _check_block(q, k, kind, mask)
    return _run_forward(path, q, k, v, kind, scale, mask, expand)


def backward_with(path: str, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, kind: BlockKind, scale: float,
                  mask: torch.Tensor | None = None, expand: bool | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`backward` on the named kernel path (no dispatch, no trace record); ``expand`` as in
    :func:`forward_with`."""
    _check_block(q, k, kind, mask)
    return _run_backward(path, dout, q, k, v, out, lse, kind, scale, mask, expand)


def kernel_for(q: torch.Tensor, kind: BlockKind, backend: str = "auto", kv_len: int | None = None,
               softcap: float | None = None) -> str:
    """The kernel path :func:`forward` and :func:`backward` run for queries like ``q``, ``kind`` and
    ``kv_len`` keys (soft-capped when ``softcap`` is given)."""
    return choose_kernel(q.device.type, q.dtype, q.shape[3], kind, available_kernels(q.device), backend, kv_len,
                         softcap is not None, capability(q.device))


def row_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``D = rowsum(dout * out)`` per row and head, ``[b, h, s_q]`` in the accumulation dtype: all of the
    row's final ``out`` that a backward uses (pass it as ``backward(..., out=None, delta=D)``)."""
    acc = acc_dtype(dout.dtype)
    return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()


def out_for_delta(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A stand-in for ``out`` (``dout``'s shape and dtype) whose rowsum with ``dout`` is ``delta`` ([b, h,
    s_q]): ``dout * D / rowsum(dout^2)`` per row and head (0 where ``dout`` is 0, where D is 0 too). A
    backward uses ``out`` only through that rowsum, so its gradients are those of the real ``out``; in
    low precision D is rounded like a rowsum over a stored ``out`` (one rounding per element)."""
    acc = acc_dtype(dout.dtype)
    d = dout.to(acc)
    norm = (d * d).sum(-1)  # [b, s, h]
    scale = torch.where(norm > 0, delta.to(acc).transpose(1, 2) / norm.clamp_min(torch.finfo(acc).tiny), 0.0)
    return (d * scale.unsqueeze(-1)).to(dout.dtype)


def _call(phase: str, q: torch.Tensor, k: torch.Tensor, kind: BlockKind, mask, backend: str, softcap: float | None,
          pieces: int | None, run: Callable[[str], Any]):
    """One kernel call of the contract: the block checked, recorded (one trace event per block of a stacked
    call), and ``run`` on the path :func:`kernel_for` chooses."""
    _check_block(q, k, kind, mask, pieces)
    span = trace.compute(phase, kind.value, q.shape[1], k.shape[1], pieces or 1)
    result = run(kernel_for(q, kind, backend, k.shape[1], softcap))
    trace.computed(span)
    return result


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: BlockKind, scale: float,
            mask: torch.Tensor | None = None, backend: str = "auto", softcap: float | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block. Returns ``out [b, s_q, h, d]`` and ``lse [b, h, s_q]`` in the
    accumulation dtype. ``softcap``: scores become ``tanh(s / softcap) * softcap`` (:data:`SOFTCAP_PATHS`)."""
    return _call("forward", q, k, kind, mask, backend, softcap, None,
                 lambda path: _run_forward(path, q, k, v, kind, scale, mask, None, softcap))


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None,
             lse: torch.Tensor, kind: BlockKind, scale: float, mask: torch.Tensor | None = None,
             backend: str = "auto", delta: torch.Tensor | None = None, softcap: float | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the row's final ``out`` (input dtype) and ``lse``, or, with ``out``
    None, its ``delta [b, h, s_q] = rowsum(dout * out)`` (accumulation dtype: ``math`` takes it as is,
    a fused path gets :func:`out_for_delta`). Returns ``dq [b, s_q, h, d]``, ``dk, dv [b, s_kv, h_kv, d]``
    in the accumulation dtype."""
    if out is None and delta is None:
        raise ValueError("backward needs the row's final out, or its delta = rowsum(dout * out)")
    return _call("backward", q, k, kind, mask, backend, softcap, None,
                 lambda path: _run_backward(path, dout, q, k, v, out, lse, kind, scale, mask, None, delta, softcap))


def forward_stacked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: BlockKind, scale: float, pieces: int,
                    backend: str = "auto", mask: torch.Tensor | None = None, softcap: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward` of ``pieces`` equal-shaped blocks of one kind stacked along the batch dimension
    (``q [b * pieces, s_q, h, d]``, batch row ``i * pieces + p`` is piece p), in one kernel call;
    PARTIAL blocks bring their masks stacked, ``mask [pieces, s_q, s_kv]``. The trace records one
    compute event per block, so recordings count blocks as ``steps()`` do (a timeline: one span for the
    call)."""
    return _call("forward", q, k, kind, mask, backend, softcap, pieces,
                 lambda path: _run_forward(path, q, k, v, kind, scale, mask, None, softcap))


def backward_stacked(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, kind: BlockKind, scale: float, pieces: int, backend: str = "auto",
                     mask: torch.Tensor | None = None, softcap: float | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`backward` of ``pieces`` stacked blocks, as :func:`forward_stacked` (one call, one trace event
    per block); each block's rows carry its rows' final ``out`` and ``lse``."""
    return _call("backward", q, k, kind, mask, backend, softcap, pieces,
                 lambda path: _run_backward(path, dout, q, k, v, out, lse, kind, scale, mask, None, None, softcap))
