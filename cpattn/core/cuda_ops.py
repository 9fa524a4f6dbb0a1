"""The CUDA kernel paths behind the kernel contract (:mod:`cpattn.kernels`): thin wrappers of PyTorch's
fused attention ops that return the log-sum-exp, of FlexAttention, and of the optional flash-attn
package.

Every wrapper takes ``q [b, s_q, h, d]``, ``k, v [b, s_kv, h_kv, d]`` and returns ``out [b, s_q, h, d]``
(input dtype) and ``lse [b, h, s_q]`` (float32, natural log) forward, ``dq, dk, dv`` (input dtype)
backward; :mod:`cpattn.kernels` casts to the accumulation dtype and expands key/value heads for the ops
without grouped-query support (``efficient_cuda``, ``cudnn_cuda``). The backward wrappers take the
row's *final* ``out`` and ``lse`` (after every block is merged), which the fused ops accept as inputs.

What each op assumes, and how it is met here:

- ``aten._scaled_dot_product_flash_attention``: ``[b, h, s, d]`` views with unit stride in ``d``;
  ``lse [b, h, s_q]``; grouped-query heads natively. Its backward treats a *defined* ``cum_seq_q`` as
  variable-length input, so the dense call passes None (an undefined tensor).
- ``aten._scaled_dot_product_efficient_attention``: ``lse`` padded to a multiple of 32 rows
  (:data:`EFFICIENT_LSE_ALIGN`): sliced to ``s_q`` forward, padded back for the backward.
- ``aten._scaled_dot_product_cudnn_attention``: ``lse [b, h, s_q, 1]``: squeezed forward, unsqueezed back
  for the backward; ``out`` and ``dout`` given the same (contiguous ``[b, s, h, d]``) layout.
- causal flags: CAUSAL blocks are square, where the top-left convention (efficient op) and the
  bottom-right one (flash, cuDNN, flash-attn) coincide.
- dropout is always 0: the random-state tensors the backward ops take are placeholders, taken once per
  device from a real forward call so their dtype, shape and device are what this torch build expects.

PARTIAL blocks run FlexAttention, compiled once per process with ``torch.compile``. A region (one call
over a rank's whole step, ``cpattn.core.flex_masks.Region``) brings its block mask from the mask's
structure, and its ``mask_mod`` reads tensors, so new documents or offsets are new data for the compiled
kernel, not new code; a dense boolean mask (blocks from ``cpattn.core.blocks`` without regions) gets one
built from it. Its public API has no backward that takes an external ``out``
and ``lse``; its backward *operator* does (:func:`flex_fused_backward`, lse in log2 units), so the
backward runs no second forward. A torch without that operator (:func:`flex_backward_op` is None)
recomputes the block under autograd instead (:func:`grads_through_block`).

``scripts/gpu_check.py`` checks every path on a GPU (docs/cuda.md).
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from functools import cache

import torch

from . import memo
from .flex_masks import Region
from .masks import BlockKind

#: the memory-efficient op pads lse to this many rows (ROCm builds do not pad)
EFFICIENT_LSE_ALIGN = 32

_aten = torch.ops.aten


def trim_lse(lse: torch.Tensor, s_q: int) -> torch.Tensor:
    """An op's lse (``[b, h, >= s_q]`` or ``[b, h, s_q, 1]``) as ``[b, h, s_q]``."""
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return lse[:, :, :s_q]


def pad_lse(lse: torch.Tensor, multiple: int) -> torch.Tensor:
    """``[b, h, s] -> [b, h, ceil(s / multiple) * multiple]``, contiguous float32, zero in the padding
    rows (which the ops never read)."""
    lse = lse.to(torch.float32)
    pad = -lse.shape[-1] % multiple
    return torch.nn.functional.pad(lse, (0, pad)).contiguous()


def _bhsd(*xs: torch.Tensor) -> list[torch.Tensor]:
    """``[b, s, h, d]`` tensors as contiguous-backed ``[b, h, s, d]`` views, all in the same layout."""
    return [x.contiguous().transpose(1, 2) for x in xs]


@cache
def _rng_placeholders(op: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(seed, offset) as a forward call of ``op`` on ``device`` returns them (used only with dropout)."""
    x = torch.zeros(1, 1, 8, 16, dtype=torch.float16, device=device)
    if op == "flash":
        return _aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)[6:8]
    if op == "efficient":
        return _aten._scaled_dot_product_efficient_attention(x, x, x, None, True, 0.0, False)[2:4]
    return _aten._scaled_dot_product_cudnn_attention(x, x, x, None, True, 0.0, False, False)[6:8]


# ------------------------------------------------------------------------------ aten flash (CUDA)
def flash_forward(q, k, v, kind, scale, mask):
    qt, kt, vt = _bhsd(q, k, v)
    res = _aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, kind == BlockKind.CAUSAL, False, scale=scale)
    return res[0].transpose(1, 2), trim_lse(res[1], q.shape[1])


def flash_backward(dout, q, k, v, out, lse, kind, scale, mask):
    qt, kt, vt, ot, dt = _bhsd(q, k, v, out.to(q.dtype), dout.to(q.dtype))
    seed, offset = _rng_placeholders("flash", q.device)
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
        dt, qt, kt, vt, ot, lse.to(torch.float32).contiguous(), None, None, q.shape[1], k.shape[1], 0.0,
        kind == BlockKind.CAUSAL, seed, offset, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ------------------------------------------------------------------------------ memory-efficient
def efficient_forward(q, k, v, kind, scale, mask):
    qt, kt, vt = _bhsd(q, k, v)
    res = _aten._scaled_dot_product_efficient_attention(qt, kt, vt, None, True, 0.0, kind == BlockKind.CAUSAL,
                                                         scale=scale)
    return res[0].transpose(1, 2), trim_lse(res[1], q.shape[1])


def efficient_backward(dout, q, k, v, out, lse, kind, scale, mask):
    qt, kt, vt, ot, dt = _bhsd(q, k, v, out.to(q.dtype), dout.to(q.dtype))
    seed, offset = _rng_placeholders("efficient", q.device)
    align = 1 if torch.version.hip else EFFICIENT_LSE_ALIGN
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dt, qt, kt, vt, None, ot, pad_lse(lse, align), seed, offset, 0.0, [True, True, True, False],
        kind == BlockKind.CAUSAL, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ------------------------------------------------------------------------------ cuDNN
def cudnn_forward(q, k, v, kind, scale, mask):
    qt, kt, vt = _bhsd(q, k, v)
    res = _aten._scaled_dot_product_cudnn_attention(qt, kt, vt, None, True, 0.0, kind == BlockKind.CAUSAL, False,
                                                    scale=scale)
    return res[0].transpose(1, 2), trim_lse(res[1], q.shape[1])


def cudnn_backward(dout, q, k, v, out, lse, kind, scale, mask):
    qt, kt, vt, ot, dt = _bhsd(q, k, v, out.to(q.dtype), dout.to(q.dtype))
    seed, offset = _rng_placeholders("cudnn", q.device)
    lse4 = lse.to(torch.float32).unsqueeze(-1).contiguous()
    dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
        dt, qt, kt, vt, ot, lse4, seed, offset, None, None, None, q.shape[1], k.shape[1], 0.0,
        kind == BlockKind.CAUSAL, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ------------------------------------------------------------------------------ FlexAttention
@cache
def _compiled_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _block_mask(dense: torch.Tensor):
    """A FlexAttention block mask from a bool ``[s_q, s_kv]`` mask, or a per-batch-row ``[B, s_q, s_kv]``."""
    from torch.nn.attention.flex_attention import create_block_mask

    if dense.dim() == 2:
        return create_block_mask(lambda b, h, q_idx, kv_idx: dense[q_idx, kv_idx], None, None,
                                 dense.shape[0], dense.shape[1], device=dense.device)
    return create_block_mask(lambda b, h, q_idx, kv_idx: dense[b, q_idx, kv_idx], dense.shape[0], None,
                             dense.shape[1], dense.shape[2], device=dense.device)


def per_row_mask(mask: torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """A PARTIAL mask on ``device``: ``[s_q, s_kv]`` as is; a stacked ``[pieces, s_q, s_kv]`` one repeated
    to one mask per batch row (row ``i * pieces + p`` is piece p, as ``kernels.forward_stacked`` stacks).
    The one rule for stacked masks: the CPU flash and math paths in :mod:`cpattn.kernels` use it too."""
    dense = mask.to(device)
    return dense if dense.dim() == 2 or dense.shape[0] == batch else dense.repeat(batch // dense.shape[0], 1, 1)


def empty_rows(dense: torch.Tensor) -> torch.Tensor:
    """``[s_q]`` or ``[B, s_q]``: rows of a :func:`per_row_mask` with no allowed key (their lse is -inf by
    the kernel contract, whatever an op leaves there)."""
    return ~dense.any(-1)


def flex_supported() -> bool:
    """Whether FlexAttention can run here: Triton to compile it and a torch that returns its lse
    through ``AuxRequest``."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        from torch.nn.attention.flex_attention import AuxRequest  # noqa: F401
    except ImportError:
        return False
    return True


@cache
def _softcap_mod(softcap: float) -> Callable:
    """FlexAttention's ``score_mod`` for soft-capped scores: ``tanh(s / softcap) * softcap`` (the scale
    is applied before it, as the kernel contract scales before capping). One function per cap value, so
    a compiled kernel sees the same ``score_mod`` on every call and never recompiles for it."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    return score_mod


def _causal_rule(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _causal_mask(s_q: int, s_kv: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_causal_rule, None, None, s_q, s_kv, device=device)


def _partial_mask(mask: torch.Tensor, batch: int, device: torch.device) -> tuple:
    """``(mask, empty rows, block mask)`` of a PARTIAL mask repeated to ``batch`` rows on ``device``; the
    mask itself is kept with them, so its identity (the cache key) stays its own while they are kept."""
    dense = per_row_mask(mask, batch, device)
    return mask, empty_rows(dense), _block_mask(dense)


def _flex_mask(q, k, kind, mask):
    """``(empty, block_mask)`` of a block for FlexAttention: a PARTIAL block's rows with no allowed key
    (``[s_q]`` or ``[b, s_q]``, :func:`empty_rows`) and its block mask, a CAUSAL block's block mask, None
    for FULL. Both are kept in the run's cache (``memo.cached``: the ``ContextParallel``'s, bounded), a
    PARTIAL one per mask tensor (its identity and version: an in-place change builds again), since the
    executor keeps each block list's masks on the device across calls: a steady-state call builds none
    and hands the compiled kernel the same ``mask_mod`` every time. A region
    (:class:`~cpattn.core.flex_masks.Region`) is kept per its value: built once from the mask's structure,
    with no dense matrix and no copy from the host after that."""
    if isinstance(mask, Region):
        return memo.cached(("flex_region", mask, str(q.device)), lambda: mask.block_mask(q.device))
    if kind == BlockKind.PARTIAL:
        key = ("flex_partial_mask", id(mask), mask._version, q.shape[0], str(q.device))
        _, empty, block_mask = memo.cached(key, lambda: _partial_mask(mask, q.shape[0], q.device))
        return empty, block_mask
    if kind == BlockKind.CAUSAL:
        key = ("flex_causal_mask", q.shape[1], k.shape[1], str(q.device))
        return None, memo.cached(key, lambda: _causal_mask(q.shape[1], k.shape[1], q.device))
    return None, None


def flex_block(q, k, v, mask, scale, compiled: bool = True, kind=BlockKind.PARTIAL, softcap: float | None = None):
    """FlexAttention of one block, differentiable: ``(out [b, s_q, h, d], lse [b, h, s_q])``. A PARTIAL
    block (or stacked ones, ``mask [pieces, s_q, s_kv]``) brings its mask; FULL and CAUSAL blocks run
    here only soft-capped (``softcap``: FlexAttention's ``score_mod``). Rows with no allowed key give
    out 0 and lse -inf whatever the kernel leaves there. ``compiled=False`` runs the unfused
    implementation (the only one on the CPU, forward only)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    fn = _compiled_flex() if compiled else flex_attention
    qt, kt, vt = _bhsd(q, k, v)
    empty, block_mask = _flex_mask(q, k, kind, mask)
    # the Triton backend is the one whose backward accepts a gradient of lse (grads_through_block)
    out, aux = fn(qt, kt, vt, block_mask=block_mask, scale=scale,
                  score_mod=None if softcap is None else _softcap_mod(softcap),
                  enable_gqa=k.shape[2] != q.shape[2], return_aux=AuxRequest(lse=True),
                  kernel_options={"BACKEND": "TRITON"})
    out = out.transpose(1, 2)
    if empty is None:
        return out, aux.lse
    return (out.masked_fill(empty[..., None, None], 0.0), aux.lse.masked_fill(empty.unsqueeze(-2), float("-inf")))


def flex_forward(q, k, v, kind, scale, mask, compiled: bool = True, softcap: float | None = None):
    with torch.no_grad():  # detached: the CPU's FlexAttention refuses inputs that require grad
        return flex_block(q.detach(), k.detach(), v.detach(), mask, scale, compiled, kind, softcap)


@cache
def flex_backward_op() -> Callable | None:
    """FlexAttention's backward operator, which takes the row's ``out`` and ``lse`` as the fused ops do,
    or None where this torch does not expose it (then :func:`flex_backward` recomputes the block's
    forward, :func:`grads_through_block`). It is private to torch: its arguments are checked here once."""
    try:
        from torch._higher_order_ops.flex_attention import flex_attention_backward
        from torch.nn.attention.flex_attention import BlockMask, _apply_kernel_options, _identity
    except ImportError:
        return None
    params = inspect.signature(flex_attention_backward.__call__).parameters
    want = ["query", "key", "value", "out", "logsumexp", "grad_out", "grad_logsumexp", "fw_graph", "joint_graph",
            "block_mask", "scale", "kernel_options"]
    if list(params)[:len(want)] != want or not hasattr(BlockMask, "as_tuple") or _apply_kernel_options is None \
            or _identity is None:
        return None
    return flex_attention_backward


@cache
def flex_backward_compilable() -> bool:
    """Whether ``torch.compile`` can trace a direct call of the backward operator with a plain ``score_mod``
    (its dynamo support derives the joint graph itself; older releases only replay graphs that
    FlexAttention's own autograd traced). Where it cannot, :func:`flex_backward` recomputes instead."""
    if flex_backward_op() is None:
        return False
    try:
        from torch._dynamo.variables.higher_order_ops import FlexAttentionBackwardHighOrderVariable
    except ImportError:
        return False
    return hasattr(FlexAttentionBackwardHighOrderVariable, "_derive_joint_graph")


def _flex_backward_call(query, key, value, out, lse2, grad_out, score_mod, joint, block_mask, scale,
                        kernel_options):
    """One call of the backward operator, ``[b, h, s, d]`` tensors, ``lse2`` in log2 units (what its forward
    returns; the public API converts to natural log). Compiled on CUDA, where it becomes the fused kernel
    (the compiler derives the joint graph of ``score_mod`` itself: ``joint`` None); eager, ``score_mod`` and
    ``joint`` are the traced graphs of :func:`_eager_graphs`."""
    dq, dk, dv, _ = flex_backward_op()(query, key, value, out, lse2, grad_out, None, score_mod, joint,
                                       block_mask, scale, kernel_options, (), ())
    return dq, dk, dv


@cache
def _eager_graphs(score_mod: Callable, dtype: torch.dtype, device: torch.device) -> tuple[Callable, Callable]:
    """The forward and joint graphs of ``score_mod`` that the operator's eager form takes."""
    from torch._higher_order_ops.flex_attention import create_fw_bw_graph

    scalar = torch.zeros((), dtype=dtype, device=device, requires_grad=True)
    index = torch.zeros((), dtype=torch.int, device=device)
    return create_fw_bw_graph(score_mod, (scalar, index, index, index, index), ())


@cache
def _compiled_flex_backward() -> Callable:
    return torch.compile(_flex_backward_call, fullgraph=True)


LN2 = 0.6931471805599453


def flex_fused_backward(dout, q, k, v, out, lse, kind, scale, mask, compiled: bool = True,
                        softcap: float | None = None):
    """dq, dk, dv of one FlexAttention block from the row's final ``out`` and ``lse`` through the backward
    operator (:func:`flex_backward_op`), with no second forward: its ``dS = P (dP - rowsum(dout * out))``
    with ``P = exp(s - lse)`` is the kernel contract's gradient for any ``lse``, the block's own or the
    row's. ``compiled=False`` runs its eager (unfused) form, which the CPU tests check."""
    from torch.nn.attention.flex_attention import AuxRequest, _apply_kernel_options, _create_empty_block_mask, _identity

    qt, kt, vt, ot, dt = _bhsd(q, k, v, out.to(q.dtype), dout.to(q.dtype))
    _, block_mask = _flex_mask(q, k, kind, mask)
    if block_mask is None:  # a FULL block: every tile full
        block_mask = _create_empty_block_mask(qt, kt)
    options = _apply_kernel_options(qt, kt, vt, True, {"BACKEND": "TRITON"}, AuxRequest(lse=True))
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse2 = (lse.to(acc) / LN2).contiguous()  # -inf stays -inf
    score_mod = _identity if softcap is None else _softcap_mod(softcap)
    if compiled:
        dq, dk, dv = _compiled_flex_backward()(qt, kt, vt, ot, lse2, dt, score_mod, None, block_mask.as_tuple(),
                                               scale, options)
    else:
        dq, dk, dv = _flex_backward_call(qt, kt, vt, ot, lse2, dt, *_eager_graphs(score_mod, q.dtype, q.device),
                                         block_mask.as_tuple(), scale, options)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def flex_backward(dout, q, k, v, out, lse, kind, scale, mask, compiled: bool = True, softcap: float | None = None):
    if flex_backward_compilable() if compiled else flex_backward_op() is not None:
        dq, dk, dv = flex_fused_backward(dout, q, k, v, out, lse, kind, scale, mask, compiled, softcap)
    else:
        dq, dk, dv = grads_through_block(lambda a, b, c: flex_block(a, b, c, mask, scale, compiled, kind, softcap),
                                         dout, q, k, v, out, lse)
    if kind == BlockKind.PARTIAL:  # rows with no allowed key: dq 0 whatever the kernel leaves there
        dq = dq.masked_fill(_flex_mask(q, k, kind, mask)[0][..., None, None], 0.0)
    return dq, dk, dv


def grads_through_block(block: Callable, dout, q, k, v, out, lse):
    """dq, dk, dv of one block from a differentiable ``block(q, k, v) -> (o_b, lse_b)`` that knows only
    its own keys, given the row's final ``out`` and ``lse``.

    The row's probabilities are ``P = w * P_b`` with ``w = exp(lse_b - lse)``, and the contract's
    gradient of the scores is ``dS = P * (dout . v_j - dout . out)``. Back-propagating ``g_out``
    into ``o_b`` and ``g_lse`` into ``lse_b`` gives ``dS_b = P_b * (g_out . v_j - g_out . o_b + g_lse)``,
    which equals ``dS`` for ``g_out = w * dout`` and ``g_lse = w * dout . (o_b - out)``."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.enable_grad():
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        o_b, lse_b = block(qg, kg, vg)
        final = lse.to(acc)
        w = torch.exp(lse_b.detach().to(acc) - final.masked_fill(torch.isinf(final), 0.0))
        w = w.masked_fill(torch.isinf(final), 0.0).transpose(1, 2).unsqueeze(-1)  # [b, s_q, h, 1]
        g_out = w * dout.to(acc)
        g_lse = (g_out * (o_b.detach().to(acc) - out.to(acc))).sum(-1).transpose(1, 2)
        return torch.autograd.grad((o_b, lse_b), (qg, kg, vg), (g_out.to(o_b.dtype), g_lse.to(lse_b.dtype)))


# ------------------------------------------------------------------------------ flash-attn package
def flash_attn_forward(q, k, v, kind, scale, mask):
    from flash_attn import flash_attn_func

    with torch.no_grad():
        out, lse, _ = flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, scale,
                                      kind == BlockKind.CAUSAL, return_attn_probs=True)
    return out, trim_lse(lse, q.shape[1])


def flash_attn_backward(dout, q, k, v, out, lse, kind, scale, mask):
    from flash_attn import flash_attn_interface

    return _backward_into(flash_attn_interface._flash_attn_backward, dout, q, k, v, out, lse, kind, scale)


def _backward_into(fn: Callable, dout, q, k, v, out, lse, kind, scale):
    """``(dq, dk, dv)`` from a backward that writes into the buffers it is given (FlashAttention-2's and -3's
    ``_flash_attn_backward``), called with the names its release takes (:func:`flash_attn_call`: the causal
    flag is ``causal`` or ``is_causal``, the window one pair or two numbers)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    causal = kind == BlockKind.CAUSAL
    values = {"dout": dout.to(q.dtype).contiguous(), "q": q, "k": k, "v": v, "out": out.to(q.dtype).contiguous(),
              "softmax_lse": lse.to(torch.float32).contiguous(), "dq": dq, "dk": dk, "dv": dv,
              "dropout_p": 0.0, "softmax_scale": scale, "causal": causal, "is_causal": causal,
              "window_size": (-1, -1), "window_size_left": -1, "window_size_right": -1, "softcap": 0.0,
              "alibi_slopes": None, "deterministic": False, "rng_state": None}
    flash_attn_call(fn, values)
    return dq, dk, dv


# ------------------------------------------------------------------------------ FlashAttention-3 / -4 packages
#: the module each optional FlashAttention path imports its functions from
FLASH_ATTN_MODULES = {"flash_attn": "flash_attn", "flash_attn3": "flash_attn_interface",
                      "flash_attn4": "flash_attn.cute.interface"}


def _out_and_lse(result, q: torch.Tensor, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` from what a FlashAttention forward returned: ``out`` the tensor shaped like the queries
    ``[b, s_q, h, d]``, ``lse`` the ``[b, h, >= s_q]`` one (releases return them in different tuples)."""
    b, s, h, _ = q.shape
    tensors = [t for t in (result if isinstance(result, (tuple, list)) else (result,)) if isinstance(t, torch.Tensor)]
    out = next((t for t in tensors if t.dim() == 4 and tuple(t.shape[:3]) == (b, s, h)), None)
    lse = next((t for t in tensors if t.dim() == 3 and tuple(t.shape[:2]) == (b, h) and t.shape[2] >= s), None)
    if out is None or lse is None:
        raise RuntimeError(f"{path}: its forward returned no [b, s_q, h, d] output and [b, h, s_q] lse for "
                           f"queries of shape {tuple(q.shape)} (got {[tuple(t.shape) for t in tensors]})")
    return out, trim_lse(lse, s)


def flash_attn3_forward(q, k, v, kind, scale, mask):
    fa3 = importlib.import_module(FLASH_ATTN_MODULES["flash_attn3"])
    with torch.no_grad():
        res = flash_attn_call(fa3._flash_attn_forward, {"q": q.contiguous(), "k": k.contiguous(), "v": v.contiguous(),
                                                        "softmax_scale": scale, "causal": kind == BlockKind.CAUSAL})
    return _out_and_lse(res, q, "flash_attn3")


def flash_attn3_backward(dout, q, k, v, out, lse, kind, scale, mask):
    fa3 = importlib.import_module(FLASH_ATTN_MODULES["flash_attn3"])
    return _backward_into(fa3._flash_attn_backward, dout, q, k, v, out, lse, kind, scale)


def flash_attn4_forward(q, k, v, kind, scale, mask):
    fa4 = importlib.import_module(FLASH_ATTN_MODULES["flash_attn4"])
    with torch.no_grad():
        res = flash_attn_call(fa4._flash_attn_fwd, {"q": q.contiguous(), "k": k.contiguous(), "v": v.contiguous(),
                                                    "softmax_scale": scale, "causal": kind == BlockKind.CAUSAL,
                                                    "return_lse": True})
    return _out_and_lse(res, q, "flash_attn4")


def flash_attn4_backward(dout, q, k, v, out, lse, kind, scale, mask):
    fa4 = importlib.import_module(FLASH_ATTN_MODULES["flash_attn4"])
    return flash_attn_call(fa4._flash_attn_bwd, {
        "q": q.contiguous(), "k": k.contiguous(), "v": v.contiguous(), "out": out.to(q.dtype).contiguous(),
        "dout": dout.to(q.dtype).contiguous(), "lse": lse.to(torch.float32).contiguous(), "softmax_scale": scale,
        "causal": kind == BlockKind.CAUSAL})[:3]


def flash_attn_call(fn: Callable, values: dict):
    """Call a flash-attn internal function with the arguments its signature names (they changed
    between releases: ``window_size`` became ``window_size_left`` / ``_right``, ``softcap`` appeared);
    a parameter with no value here raises TypeError naming it."""
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    missing = [n for n, p in params.items() if n not in values and p.default is inspect.Parameter.empty]
    if missing:
        raise TypeError(f"flash_attn's {getattr(fn, '__name__', fn)} takes arguments cpattn does not know: "
                        f"{', '.join(missing)}")
    return fn(**{n: values[n] for n in params if n in values})
