"""The kernel dispatch (cpattn.kernels.choose_kernel and friends) and the pieces of the CUDA paths that
run without a GPU: grouped-query expansion and reduction, lse trimming and padding, the backward through
a differentiable block, FlexAttention's unfused forward, the op calls on meta tensors, and
scripts/gpu_check.py's command line. The CUDA kernels themselves are checked by scripts/gpu_check.py."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from cpattn.masks import BlockKind

from cpattn import kernels
from cpattn.core import cuda_ops

FULL, CAUSAL, PARTIAL, EMPTY = BlockKind.FULL, BlockKind.CAUSAL, BlockKind.PARTIAL, BlockKind.EMPTY
BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
CPU = frozenset({"flash_cpu", "math"})
GPU = frozenset({"flash_cuda", "cudnn_cuda", "efficient_cuda", "flex_cuda", "math"})
GPU_FA = GPU | {"flash_attn"}
GPU_FA34 = GPU | {"flash_attn3", "flash_attn4"}
NO_FLASH = GPU - {"flash_cuda"}
ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------ the table
TABLE = [
    # device, dtype, head_dim, kind, available, backend -> path
    ("cpu", BF16, 64, FULL, CPU, "auto", "flash_cpu"),
    ("cpu", F64, 64, CAUSAL, CPU, "aten", "flash_cpu"),
    ("cpu", F32, 12, CAUSAL, CPU, "auto", "flash_cpu"),
    ("cpu", F32, 64, PARTIAL, CPU, "auto", "flash_cpu"),  # an additive mask
    ("cpu", BF16, 64, PARTIAL, CPU, "auto", "math"),  # a masked row can keep few keys: low precision stays exact
    ("cpu", F64, 64, PARTIAL, CPU, "aten", "math"),
    ("cpu", F32, 64, FULL, CPU, "math", "math"),
    ("cpu", BF16, 64, FULL, CPU | {"flash_attn"}, "flash_attn", "flash_cpu"),  # flash-attn is CUDA only
    ("cuda", BF16, 128, FULL, GPU, "auto", "flash_cuda"),
    ("cuda", F16, 256, CAUSAL, GPU, "aten", "flash_cuda"),
    ("cuda", BF16, 128, CAUSAL, GPU, "math", "math"),
    ("cuda", F32, 128, FULL, GPU, "auto", "efficient_cuda"),  # flash and cuDNN are half precision only
    ("cuda", F32, 12, FULL, GPU, "aten", "efficient_cuda"),  # float32 rows align to 4
    ("cuda", F16, 12, FULL, GPU, "auto", "math"),  # half rows align to 8 on every fused op
    ("cuda", BF16, 264, FULL, GPU, "auto", "math"),  # above every op's head-dim limit
    ("cuda", F64, 64, FULL, GPU, "auto", "math"),
    ("cuda", BF16, 128, FULL, NO_FLASH, "auto", "cudnn_cuda"),  # flash switched off: cuDNN next
    ("cuda", BF16, 192, FULL, NO_FLASH, "auto", "efficient_cuda"),  # cuDNN stops at 128
    ("cuda", BF16, 128, FULL, frozenset({"efficient_cuda", "math"}), "auto", "efficient_cuda"),
    ("cuda", BF16, 64, PARTIAL, GPU, "auto", "flex_cuda"),
    ("cuda", F32, 64, PARTIAL, GPU, "aten", "flex_cuda"),
    ("cuda", BF16, 8, PARTIAL, GPU, "auto", "math"),  # Flex needs head_dim >= 16
    ("cuda", BF16, 64, PARTIAL, GPU - {"flex_cuda"}, "auto", "math"),
    ("cuda", BF16, 64, PARTIAL, GPU, "math", "math"),
    ("cuda", BF16, 128, CAUSAL, GPU_FA, "flash_attn", "flash_attn"),
    ("cuda", BF16, 128, CAUSAL, GPU_FA, "auto", "flash_cuda"),  # flash-attn only when asked for
    ("cuda", F32, 128, FULL, GPU_FA, "flash_attn", "efficient_cuda"),  # does not fit: the aten order
    ("cuda", BF16, 12, FULL, GPU_FA, "flash_attn", "math"),
    ("cuda", BF16, 64, PARTIAL, GPU_FA, "flash_attn", "flex_cuda"),
    ("cuda", BF16, 128, CAUSAL, GPU_FA34, "flash_attn3", "flash_attn3"),
    ("cuda", F16, 256, FULL, GPU_FA34, "flash_attn3", "flash_attn3"),
    ("cuda", BF16, 128, FULL, GPU_FA34, "flash_attn4", "flash_attn4"),
    ("cuda", BF16, 128, FULL, GPU_FA34, "auto", "flash_cuda"),  # no measured row orders them yet: pinned only
    ("cuda", BF16, 256, FULL, GPU_FA34, "flash_attn4", "flash_cuda"),  # FA4 has no d=256: the aten order
    ("cuda", F32, 64, CAUSAL, GPU_FA34, "flash_attn3", "efficient_cuda"),  # half precision only
    ("cuda", BF16, 64, PARTIAL, GPU_FA34, "flash_attn4", "flex_cuda"),
    ("cpu", BF16, 64, FULL, CPU | {"flash_attn3"}, "flash_attn3", "flash_cpu"),
    ("mps", F32, 64, FULL, frozenset({"math"}), "auto", "math"),
    ("cuda", BF16, 128, FULL, frozenset({"math"}), "auto", "math"),
]


@pytest.mark.parametrize("device,dtype,head_dim,kind,available,backend,want", TABLE)
def test_dispatch_table(device, dtype, head_dim, kind, available, backend, want):
    assert kernels.choose_kernel(device, dtype, head_dim, kind, available, backend) == want


def test_every_path_is_reachable_and_named():
    reached = {row[-1] for row in TABLE}
    assert reached == set(kernels.PATHS)
    for path in kernels.PATHS:
        assert path in kernels._FORWARD and path in kernels._BACKWARD


@pytest.mark.parametrize("device,dtype,head_dim,available,backend,error,match", [
    ("cuda", F64, 64, GPU, "aten", ValueError, "no fused CUDA kernel"),
    ("cuda", BF16, 12, frozenset({"math"}), "aten", ValueError, "backend='aten'"),
    ("mps", F32, 64, frozenset({"math"}), "aten", ValueError, "does not run on device 'mps'"),
    ("cuda", BF16, 128, GPU, "flash_attn", ImportError, "flash_attn package"),
    ("cuda", BF16, 128, GPU_FA, "flash_attn3", ImportError, "FlashAttention-3"),
    ("cuda", BF16, 128, GPU_FA, "flash_attn4", ImportError, "FlashAttention-4"),
    ("cuda", BF16, 128, GPU, "cudnn", ValueError, "unknown"),
    ("cuda", BF16, 128, GPU, "flex", NotImplementedError, "PARTIAL blocks"),
])
def test_dispatch_errors(device, dtype, head_dim, available, backend, error, match):
    with pytest.raises(error, match=match):
        kernels.choose_kernel(device, dtype, head_dim, FULL, available, backend)


@pytest.mark.parametrize("device,head_dim,kind,available,backend,want", [
    ("cuda", 64, FULL, GPU, "auto", "flex_cuda"),  # Flex's score_mod applies the cap
    ("cuda", 64, CAUSAL, GPU, "auto", "flex_cuda"),
    ("cuda", 64, PARTIAL, GPU, "auto", "flex_cuda"),
    ("cuda", 64, FULL, GPU - {"flex_cuda"}, "auto", "math"),  # no Triton: the math path
    ("cuda", 8, CAUSAL, GPU, "auto", "math"),  # Flex needs head_dim >= 16
    ("cuda", 64, FULL, GPU, "math", "math"),
    ("cpu", 64, FULL, CPU, "auto", "math"),  # the fused CPU kernel cannot cap
    ("cpu", 64, PARTIAL, CPU, "auto", "math"),
])
def test_soft_capped_blocks_take_a_path_that_modifies_scores(device, head_dim, kind, available, backend, want):
    assert kernels.choose_kernel(device, BF16, head_dim, kind, available, backend, softcap=True) == want
    assert want in kernels.SOFTCAP_PATHS


@pytest.mark.parametrize("backend", ["aten", "flash_attn"])
def test_soft_capping_on_a_backend_that_cannot_apply_it_raises(backend):
    with pytest.raises(ValueError, match="soft-capping runs on the kernel paths that apply a score modification"):
        kernels.choose_kernel("cuda", BF16, 64, FULL, GPU_FA, backend, softcap=True)


def test_dispatch_rejects_empty_blocks():
    with pytest.raises(ValueError, match="EMPTY"):
        kernels.choose_kernel("cuda", BF16, 64, EMPTY, GPU)


def test_kernel_fits_limits():
    assert kernels.kernel_fits("flash_cuda", BF16, 256) and not kernels.kernel_fits("flash_cuda", BF16, 264)
    assert not kernels.kernel_fits("flash_cuda", F32, 64) and not kernels.kernel_fits("flash_cuda", F16, 60)
    assert kernels.kernel_fits("cudnn_cuda", F16, 128) and not kernels.kernel_fits("cudnn_cuda", F16, 136)
    assert kernels.kernel_fits("efficient_cuda", F32, 60) and not kernels.kernel_fits("efficient_cuda", F16, 60)
    assert not kernels.kernel_fits("efficient_cuda", F64, 64)
    assert kernels.kernel_fits("flex_cuda", F32, 16) and not kernels.kernel_fits("flex_cuda", F32, 8)
    assert kernels.kernel_fits("math", F64, 3) and kernels.kernel_fits("flash_cpu", F64, 3)
    with pytest.raises(ValueError, match="unknown"):
        kernels.kernel_fits("triton", BF16, 64)


def test_check_backend_names_the_missing_package(monkeypatch):
    real = importlib.util.find_spec
    for installed in (False, True):
        found = object() if installed else None
        monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a, f=found: f if n == "flash_attn" else real(n, *a))
        if installed:
            kernels.check_backend("flash_attn")
        else:
            with pytest.raises(ImportError, match="flash_attn package"):
                kernels.check_backend("flash_attn")
    for ok in ("auto", "aten", "math"):
        kernels.check_backend(ok)
    with pytest.raises(NotImplementedError):
        kernels.check_backend("flex")
    with pytest.raises(ValueError):
        kernels.check_backend("cudnn")


def test_available_kernels_off_cuda():
    assert kernels.available_kernels(torch.device("cpu")) == CPU
    assert kernels.available_kernels(torch.device("meta")) == frozenset({"math"})


@pytest.mark.parametrize("capability,flash,cudnn,flex,fa,want", [
    ((9, 0), True, 90100, True, True, GPU_FA),
    ((9, 0), False, 8900, False, False, frozenset({"efficient_cuda", "math"})),
    ((7, 5), True, 90100, True, True, frozenset({"efficient_cuda", "math"})),  # pre-Ampere
])
def test_available_kernels_on_cuda(monkeypatch, capability, flash, cudnn, flex, fa, want):
    real = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: flash)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: cudnn)
    monkeypatch.setattr(cuda_ops, "flex_supported", lambda: flex)
    found = object() if fa else None
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: found if n == "flash_attn" else real(n, *a))
    kernels._cuda_paths.cache_clear()
    try:
        assert kernels.available_kernels(torch.device("cuda", 0)) == want
        # the SDPA switches users already know take fused kernels out of the dispatch
        monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: False)
        monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)
        assert kernels.available_kernels(torch.device("cuda", 0)) == want - {"flash_cuda", "cudnn_cuda"}
    finally:
        kernels._cuda_paths.cache_clear()


# ------------------------------------------------------------------------------------ GQA helpers
def test_expand_kv_is_repeat_interleave_and_reduce_is_its_adjoint():
    torch.manual_seed(3)
    x = torch.randn(2, 5, 3, 8, dtype=F64, requires_grad=True)
    y = kernels.expand_kv(x, 4)
    assert torch.equal(y, x.repeat_interleave(4, dim=2))
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.allclose(kernels.reduce_kv_grad(g, 4), x.grad, atol=1e-12)
    assert kernels.expand_kv(x, 1) is x
    assert kernels.reduce_kv_grad(g.to(BF16), 4).dtype == F32  # summed in the accumulation dtype


def _inputs(dtype, sq=24, sk=24, h=8, hkv=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, sq, h, d, generator=gen).to(dtype)
    k = torch.randn(2, sk, hkv, d, generator=gen).to(dtype)
    v = torch.randn(2, sk, hkv, d, generator=gen).to(dtype)
    dout = torch.randn(2, sq, h, d, generator=gen).to(dtype)
    return q, k, v, dout


@pytest.mark.parametrize("dtype,tol", [(F64, 1e-10), (F32, 2e-5)])
@pytest.mark.parametrize("kind", [FULL, CAUSAL])
@pytest.mark.parametrize("hkv", [8, 2, 1])
def test_expanded_kv_around_the_cpu_kernel_matches_math(dtype, tol, kind, hkv):
    """The expand-then-reduce wrapper the ops without native GQA get, run around the CPU flash op."""
    q, k, v, dout = _inputs(dtype, hkv=hkv, seed=hkv)
    ref_o, ref_l = kernels.forward_with("math", q, k, v, kind, 0.3)
    ref = kernels.backward_with("math", dout, q, k, v, ref_o.to(dtype), ref_l, kind, 0.3)
    for expand in (True, False):
        o, lse = kernels.forward_with("flash_cpu", q, k, v, kind, 0.3, expand=expand)
        assert torch.allclose(o, ref_o, atol=tol) and torch.allclose(lse, ref_l, atol=tol)
        grads = kernels.backward_with("flash_cpu", dout, q, k, v, o.to(dtype), lse, kind, 0.3, expand=expand)
        for got, want in zip(grads, ref):
            assert got.dtype == kernels.acc_dtype(dtype) and got.shape == want.shape
            assert torch.allclose(got, want, atol=tol * 10), (expand, (got - want).abs().max())


def test_cpu_dispatch_is_the_cpu_flash_op():
    """CPU: FULL and CAUSAL blocks run the CPU flash op, bit for bit (bfloat16 blocks of at least
    CPU_FLASH_MIN_KEYS_LOW_PRECISION keys)."""
    n = kernels.CPU_FLASH_MIN_KEYS_LOW_PRECISION
    q, k, v, _ = _inputs(BF16, sq=n, sk=n, hkv=2)
    assert kernels.kernel_for(q, CAUSAL, kv_len=n) == "flash_cpu" and kernels.kernel_for(q, PARTIAL) == "math"
    out, lse = kernels.forward(q, k, v, CAUSAL, 0.25)
    want_o, want_l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True, scale=0.25)
    assert torch.equal(out, want_o.transpose(1, 2).float()) and torch.equal(lse, want_l.float())


# ------------------------------------------------------------------------------------ lse helpers
def test_trim_and_pad_lse():
    lse = torch.randn(2, 3, 40)
    padded = cuda_ops.pad_lse(lse, 32)
    assert padded.shape == (2, 3, 64) and padded.is_contiguous() and padded.dtype == F32
    assert torch.equal(padded[:, :, :40], lse) and bool((padded[:, :, 40:] == 0).all())
    assert torch.equal(cuda_ops.trim_lse(padded, 40), lse)
    assert torch.equal(cuda_ops.trim_lse(lse.unsqueeze(-1), 40), lse)  # cuDNN's [b, h, s, 1]
    assert cuda_ops.pad_lse(torch.randn(1, 1, 64), 32).shape == (1, 1, 64)
    assert cuda_ops.pad_lse(lse, 1).shape == lse.shape


# ------------------------------------------------------------------------------------ block backward
def _masked_block(allowed, scale):
    """A plain differentiable block: (out, lse) of q against k, v under ``allowed [s_q, s_kv]``."""
    def block(q, k, v):
        g = q.shape[2] // k.shape[2]
        kr, vr = kernels.expand_kv(k, g), kernels.expand_kv(v, g)
        s = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale
        s = s.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.masked_fill(lse.isinf(), 0.0).unsqueeze(-1))
        return torch.einsum("bhqk,bkhd->bqhd", p, vr), lse
    return block


@pytest.mark.parametrize("hkv", [4, 2])
def test_grads_through_block_add_up_to_the_row(hkv):
    """Split a row's keys over two PARTIAL blocks: each block's gradients from the final out and lse
    (the recompute-and-reweight backward Flex uses) sum to the whole row's, empty rows included."""
    q, k, v, dout = _inputs(F64, sq=20, sk=30, h=4, hkv=hkv, seed=7)
    allowed = torch.rand(20, 30, generator=torch.Generator().manual_seed(1)) < 0.5
    allowed[4] = False  # empty everywhere
    allowed[6, :15] = False  # empty in the first block only
    allowed[9, 15:] = False  # empty in the second block only
    out, lse = kernels.forward_with("math", q, k, v, PARTIAL, 0.4, allowed)
    want = kernels.backward_with("math", dout, q, k, v, out, lse, PARTIAL, 0.4, allowed)
    total = [0.0, torch.zeros_like(want[1]), torch.zeros_like(want[2])]
    for cols in (slice(0, 15), slice(15, 30)):
        dq, dk, dv = cuda_ops.grads_through_block(_masked_block(allowed[:, cols], 0.4), dout, q,
                                                      k[:, cols], v[:, cols], out, lse)
        assert not any(t.isnan().any() for t in (dq, dk, dv))
        total[0] = total[0] + dq
        total[1][:, cols] += dk
        total[2][:, cols] += dv
    for got, ref in zip(total, want):
        assert torch.allclose(got, ref, atol=1e-10)
    assert bool((total[0][:, 4] == 0).all())


# ------------------------------------------------------------------------------------ Flex on the CPU
@pytest.mark.parametrize("hkv", [4, 2])
def test_flex_forward_unfused_matches_math(hkv):
    """The Flex wrapper (block mask from the dense mask, lse, empty rows) on its unfused CPU
    implementation; the CUDA run compiles the same call."""
    q, k, v, _ = _inputs(F32, sq=40, sk=70, h=4, hkv=hkv, d=16, seed=2)
    allowed = torch.rand(40, 70, generator=torch.Generator().manual_seed(5)) < 0.3
    allowed[3] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, lse = cuda_ops.flex_forward(q, k, v, PARTIAL, 0.3, allowed, compiled=False)
    ref_o, ref_l = kernels.forward_with("math", q, k, v, PARTIAL, 0.3, allowed)
    assert out.shape == ref_o.shape and lse.shape == ref_l.shape
    assert torch.allclose(out.float(), ref_o, atol=1e-5)
    assert torch.equal(lse.isinf(), ref_l.isinf()) and bool(torch.isneginf(lse[:, :, 3]).all())
    assert torch.allclose(lse[~lse.isinf()], ref_l[~ref_l.isinf()], atol=1e-5)
    assert bool((out[:, 3] == 0).all())


def test_flex_forward_of_stacked_partial_blocks_matches_math():
    """Stacked PARTIAL blocks on the Flex wrapper: one block mask with a mask per batch row."""
    q, k, v, _ = _inputs(F32, sq=40, sk=70, h=4, hkv=2, d=16, seed=4)  # batch 2 = 1 row x 2 pieces
    masks = torch.rand(2, 40, 70, generator=torch.Generator().manual_seed(6)) < 0.3
    masks[1, 9] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, lse = cuda_ops.flex_forward(q, k, v, PARTIAL, 0.3, masks, compiled=False)
    ref_o, ref_l = kernels.forward_stacked(q, k, v, PARTIAL, 0.3, 2, "math", masks)
    assert torch.allclose(out.float(), ref_o, atol=1e-5) and torch.equal(lse.isinf(), ref_l.isinf())
    assert bool(torch.isneginf(lse[1, :, 9]).all()) and bool((out[1, 9] == 0).all())


def _capped_reference(q, k, v, allowed, scale, cap):
    """Soft-capped attention in float64, written out: ``[b, s, h, d]`` inputs, GQA by repeating heads."""
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    s = torch.tanh(torch.einsum("bqhd,bkhd->bhqk", q, k) * scale / cap) * cap
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), v), lse


@pytest.mark.parametrize("kind", [FULL, CAUSAL, PARTIAL])
def test_flex_forward_soft_capped_unfused_matches_a_float64_reference(kind):
    """FlexAttention's score_mod caps the scores of every block kind (the CUDA path for soft-capped
    blocks; its backward runs through the same differentiable block and is checked by gpu_check)."""
    q, k, v, _ = _inputs(F32, sq=48, sk=48, h=4, hkv=2, d=16, seed=7)
    q = q * 3  # scores large enough that the cap of 0.7 matters
    allowed = {FULL: torch.ones(48, 48, dtype=torch.bool), CAUSAL: torch.ones(48, 48, dtype=torch.bool).tril(),
               PARTIAL: torch.rand(48, 48, generator=torch.Generator().manual_seed(8)) < 0.4}[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, lse = cuda_ops.flex_forward(q, k, v, kind, 0.25, allowed if kind == PARTIAL else None,
                                             compiled=False, softcap=0.7)
    ref_o, ref_l = _capped_reference(q, k, v, allowed, 0.25, 0.7)
    plain, _ = _capped_reference(q, k, v, allowed, 0.25, 1e6)
    assert (plain - ref_o).abs().max() > 0.05  # the cap changes the result
    rows = allowed.any(-1)
    assert torch.allclose(out.double()[:, rows], ref_o[:, rows], atol=1e-5)
    assert torch.allclose(lse.double()[:, :, rows], ref_l[:, :, rows], atol=1e-5)


# ------------------------------------------------------------------------------------ ops on meta tensors
@pytest.mark.parametrize("path", ["flash_cuda", "efficient_cuda", "cudnn_cuda"])
@pytest.mark.parametrize("kind", [FULL, CAUSAL])
def test_cuda_op_calls_on_meta_tensors(path, kind):
    """Argument order, undefined tensors, lse shapes and the GQA expansion of every fused CUDA op,
    through PyTorch's shape functions for those ops (no GPU needed)."""
    b, s, h, hkv, d = 2, 40, 8, 2, 64
    q = torch.empty(b, s, h, d, dtype=BF16, device="meta")
    k = torch.empty(b, s, hkv, d, dtype=BF16, device="meta")
    out, lse = kernels.forward_with(path, q, k, k, kind, 0.125)
    assert out.shape == (b, s, h, d) and out.dtype == F32 and lse.shape == (b, h, s) and lse.dtype == F32
    dq, dk, dv = kernels.backward_with(path, q, q, k, k, out.to(BF16), lse, kind, 0.125)
    assert dq.shape == (b, s, h, d) and dk.shape == dv.shape == (b, s, hkv, d)
    assert dq.dtype == dk.dtype == F32


# ------------------------------------------------------------------------------------ flash-attn calls
def test_flash_attn_call_follows_the_signature():
    values = {"q": 1, "window_size": (-1, -1), "window_size_left": -1, "window_size_right": -1, "softcap": 0.0}

    def v26(q, window_size, alibi_slopes=None):
        return ("v26", q, window_size)

    def v27(q, window_size_left, window_size_right, softcap):
        return ("v27", q, window_size_left, window_size_right, softcap)

    class CustomOp:  # flash-attn >= 2.7 wraps its functions in torch custom ops
        _init_fn = staticmethod(v27)

        def __call__(self, **kw):
            return v27(**kw)

    assert cuda_ops.flash_attn_call(v26, values) == ("v26", 1, (-1, -1))
    assert cuda_ops.flash_attn_call(CustomOp(), values) == ("v27", 1, -1, -1, 0.0)

    def v99(q, new_argument):
        return q

    with pytest.raises(TypeError, match="new_argument"):
        cuda_ops.flash_attn_call(v99, values)


def _fake_attend(q, k, v, scale, causal):
    """Float64 attention of ``[b, s, h, d]`` tensors (GQA by repeating k/v heads): ``(out, lse [b, h, s])``."""
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v.repeat_interleave(g, 2)), s.logsumexp(-1)


def _fake_grads(dout, q, k, v, scale, causal):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, _ = _fake_attend(*leaves, scale, causal)
    return [g.to(q.dtype) for g in torch.autograd.grad(out, leaves, dout.double())]


def _fake_flash_attn3():
    """A module with FlashAttention-3's ``_flash_attn_forward`` / ``_flash_attn_backward`` signatures."""
    mod = types.ModuleType("flash_attn_interface")

    def _flash_attn_forward(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None,
                            cu_seqlens_k=None, cu_seqlens_k_new=None, seqused_q=None, seqused_k=None,
                            max_seqlen_q=None, max_seqlen_k=None, page_table=None, kv_batch_idx=None, leftpad_k=None,
                            rotary_cos=None, rotary_sin=None, seqlens_rotary=None, q_descale=None, k_descale=None,
                            v_descale=None, softmax_scale=None, causal=False, window_size_left=-1,
                            window_size_right=-1, attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):
        out, lse = _fake_attend(q.double(), k.double(), v.double(), softmax_scale, causal)
        return out.to(q.dtype), lse.float(), torch.empty(0), torch.empty(0)

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None,
                             sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None,
                             softmax_scale=None, is_causal=False, window_size_left=-1, window_size_right=-1,
                             softcap=0.0, deterministic=False, sm_margin=0):
        for buf, g in zip((dq, dk, dv), _fake_grads(dout, q, k, v, softmax_scale, is_causal)):
            buf.copy_(g)
        return torch.empty(0)

    mod._flash_attn_forward, mod._flash_attn_backward = _flash_attn_forward, _flash_attn_backward
    return mod


def _fake_flash_attn4():
    """A module with FlashAttention-4's ``_flash_attn_fwd`` / ``_flash_attn_bwd`` signatures."""
    mod = types.ModuleType("flash_attn.cute.interface")

    def _flash_attn_fwd(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                        page_table=None, softmax_scale=None, causal=False, softcap=None, window_size_left=None,
                        window_size_right=None, learnable_sink=None, m_block_size=128, n_block_size=128,
                        num_threads=384, num_splits=1, pack_gqa=None, return_lse=False, out=None, lse=None):
        o, lse = _fake_attend(q.double(), k.double(), v.double(), softmax_scale, causal)
        return o.to(q.dtype), lse.float() if return_lse else None

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, m_block_size=64,
                        n_block_size=128, num_threads=256, pack_gqa=False, cu_seqlens_q=None, cu_seqlens_k=None,
                        seqused_q=None, seqused_k=None):
        return tuple(_fake_grads(dout, q, k, v, softmax_scale, causal))

    mod._flash_attn_fwd, mod._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    return mod


@pytest.mark.parametrize("path,module,fake", [("flash_attn3", "flash_attn_interface", _fake_flash_attn3),
                                              ("flash_attn4", "flash_attn.cute.interface", _fake_flash_attn4)])
@pytest.mark.parametrize("kind", [FULL, CAUSAL])
def test_flash_attention_3_and_4_wrappers_against_modules_of_their_signature(monkeypatch, path, module, fake, kind):
    """The wrappers call the packages' functions by their parameter names and read out and lse from what
    they return: with a stand-in of the same signature, forward and backward match the math path."""
    monkeypatch.setitem(sys.modules, module, fake())
    assert cuda_ops.FLASH_ATTN_MODULES[path] == module
    gen = torch.Generator().manual_seed(3)
    b, s, h, hkv, d = 2, 24, 4, 2, 16
    q, dout = (torch.randn(b, s, h, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, s, hkv, d, generator=gen) for _ in range(2))
    out, lse = kernels.forward_with(path, q, k, v, kind, 0.3)
    ref_out, ref_lse = kernels.forward_with("math", q, k, v, kind, 0.3)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    grads = kernels.backward_with(path, dout, q, k, v, out, lse, kind, 0.3)
    for got, want in zip(grads, kernels.backward_with("math", dout, q, k, v, ref_out, ref_lse, kind, 0.3)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_forward_that_returns_no_lse_is_an_error_naming_the_path(monkeypatch):
    mod = _fake_flash_attn4()
    mod._flash_attn_fwd = lambda q, k, v, softmax_scale=None, causal=False: (q, None)  # an older release
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", mod)
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(RuntimeError, match="flash_attn4: its forward returned no"):
        kernels.forward_with("flash_attn4", q, q, q, FULL, 0.25)


# ------------------------------------------------------------------------------------ the GPU script
def test_gpu_check_help_and_clear_exit_without_cuda():
    script = ROOT / "scripts" / "gpu_check.py"
    res = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0 and "--out" in res.stdout, res.stderr
    if torch.cuda.is_available():
        return
    res = subprocess.run([sys.executable, str(script), "--out", "/dev/null"], capture_output=True, text=True,
                         cwd=ROOT)
    assert res.returncode == 2 and "CUDA" in res.stderr and "Traceback" not in res.stderr, res.stderr


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_short_low_precision_cpu_blocks_run_on_math(dtype):
    """The CPU flash op's log-sum-exp loses precision on short low-precision blocks; they run on math
    (float32 inside), longer ones and float32 ones on flash."""
    n = kernels.CPU_FLASH_MIN_KEYS_LOW_PRECISION
    avail = kernels.available_kernels(torch.device("cpu"))
    assert kernels.choose_kernel("cpu", dtype, 16, FULL, avail, kv_len=n - 1) == "math"
    assert kernels.choose_kernel("cpu", dtype, 16, CAUSAL, avail, kv_len=n) == "flash_cpu"
    assert kernels.choose_kernel("cpu", F32, 16, FULL, avail, kv_len=16) == "flash_cpu"
    q, k, v, _ = _inputs(dtype, sq=16, sk=16)
    _, lse = kernels.forward(q, k, v, FULL, 0.25)
    s64 = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(4, 2)) * 0.25
    ref = torch.logsumexp(s64, -1)
    assert ((lse.double() - ref).norm() / ref.norm()).item() < 1e-6


@pytest.mark.parametrize("dtype,tol", [(F64, 1e-10), (F32, 2e-5)])
def test_partial_blocks_on_the_cpu_flash_op_match_math(dtype, tol):
    """A PARTIAL block on the CPU flash op (an additive mask) gives math's out, lse and gradients, and a
    row with no allowed key gets out 0, lse -inf and zero dq (the op itself gives lse 0 there)."""
    q, k, v, dout = _inputs(dtype, sq=40, sk=56, hkv=2, seed=7)
    allowed = torch.rand(40, 56, generator=torch.Generator().manual_seed(3)) < 0.3
    allowed[5] = False
    ref_o, ref_l = kernels.forward_with("math", q, k, v, PARTIAL, 0.3, allowed)
    ref = kernels.backward_with("math", dout, q, k, v, ref_o.to(dtype), ref_l, PARTIAL, 0.3, allowed)
    o, lse = kernels.forward_with("flash_cpu", q, k, v, PARTIAL, 0.3, allowed)
    assert torch.allclose(o, ref_o, atol=tol) and torch.equal(lse.isinf(), ref_l.isinf())
    assert bool(torch.isneginf(lse[:, :, 5]).all()) and bool((o[:, 5] == 0).all())
    fin = ~ref_l.isinf()
    assert torch.allclose(lse[fin], ref_l[fin], atol=tol)
    grads = kernels.backward_with("flash_cpu", dout, q, k, v, o.to(dtype), lse, PARTIAL, 0.3, allowed)
    for got, want in zip(grads, ref):
        assert not got.isnan().any() and torch.allclose(got, want, atol=tol * 10), (got - want).abs().max()
    assert bool((grads[0][:, 5] == 0).all())


@pytest.mark.parametrize("backend", ["auto", "math"])
def test_stacked_partial_blocks_match_one_call_per_block(backend):
    """PARTIAL blocks stacked with their own masks (batch row i * pieces + p is piece p) give what each
    block gives alone, forward and backward, on the CPU flash op (auto, float32) and on math."""
    pieces, b = 3, 2
    q, k, v, dout = _inputs(F32, sq=24, sk=32, hkv=2, seed=11)
    gen = torch.Generator().manual_seed(5)
    masks = torch.rand(pieces, 24, 32, generator=gen) < 0.4
    masks[1, 7] = False
    qs, ks, vs, ds = (torch.randn(b * pieces, *x.shape[1:], generator=gen) for x in (q, k, v, dout))
    o, lse = kernels.forward_stacked(qs, ks, vs, PARTIAL, 0.3, pieces, backend, masks)
    grads = kernels.backward_stacked(ds, qs, ks, vs, o, lse, PARTIAL, 0.3, pieces, backend, masks)
    for i in range(b):
        for p in range(pieces):
            r = i * pieces + p
            one = (qs[r:r + 1], ks[r:r + 1], vs[r:r + 1])
            o1, l1 = kernels.forward(*one, PARTIAL, 0.3, masks[p], backend)
            assert torch.allclose(o[r:r + 1], o1, atol=1e-6) and torch.equal(lse[r:r + 1].isinf(), l1.isinf())
            g1 = kernels.backward(ds[r:r + 1], *one, o1, l1, PARTIAL, 0.3, masks[p], backend)
            for got, want in zip(grads, g1):
                assert torch.allclose(got[r:r + 1], want, atol=1e-5)
    with pytest.raises(ValueError, match="bool mask"):
        kernels.forward_stacked(qs, ks, vs, PARTIAL, 0.3, pieces, backend, masks[0])


# ------------------------------------------------------------------------------------ the measured order
H200 = (9, 0)


@pytest.mark.parametrize("capability,dtype,head_dim,kind,available,backend,want", [
    (H200, BF16, 128, FULL, GPU, "auto", "cudnn_cuda"),  # measured 1.5-1.7x flash_cuda fwd+bwd
    (H200, F16, 64, CAUSAL, GPU, "aten", "cudnn_cuda"),
    (H200, BF16, 256, FULL, GPU, "auto", "flash_cuda"),  # cuDNN stops at 128: the catch-all row
    (H200, BF16, 128, FULL, GPU - {"cudnn_cuda"}, "auto", "flash_cuda"),  # enable_cudnn_sdp(False) pins flash
    (H200, BF16, 128, FULL, GPU - {"cudnn_cuda", "flash_cuda"}, "auto", "efficient_cuda"),
    (H200, F32, 128, FULL, GPU, "auto", "efficient_cuda"),  # the only float32 kernel
    (H200, BF16, 128, FULL, GPU, "math", "math"),
    (H200, BF16, 128, CAUSAL, GPU_FA, "flash_attn", "flash_attn"),  # backend= pins the package
    (H200, BF16, 128, PARTIAL, GPU, "auto", "flex_cuda"),
    ((8, 0), BF16, 128, FULL, GPU, "auto", "flash_cuda"),  # not measured: the catch-all
    ((10, 0), BF16, 128, FULL, GPU, "auto", "flash_cuda"),
    (None, BF16, 128, FULL, GPU, "auto", "flash_cuda"),
])
def test_dispatch_follows_the_measured_order(capability, dtype, head_dim, kind, available, backend, want):
    assert kernels.choose_kernel("cuda", dtype, head_dim, kind, available, backend, capability=capability) == want


def test_kernel_table_rows_cite_measurements_and_end_in_a_catch_all():
    from cpattn.core import kernel_order as kt

    kt.check_table()
    assert kt.order_row(H200, "bfloat16", 128) is kt.CUDA_ORDER_TABLE[0]
    assert kt.order_row(H200, "float32", 128) is kt.CUDA_ORDER_TABLE[-1]
    assert kt.order_row(None, "bfloat16", 128) is kt.CUDA_ORDER_TABLE[-1]
    catch_all = kt.CUDA_ORDER_TABLE[-1]
    bad = [(kt.OrderRow((9, 0), (10, 0), (), (0, 512), ("cudnn_cuda", "triton"), "x"), catch_all),
           (kt.OrderRow((9, 0), (10, 0), (), (0, 512), ("cudnn_cuda", "cudnn_cuda"), "x"), catch_all),
           (kt.OrderRow((9, 0), (10, 0), (), (0, 512), ("cudnn_cuda",), " "), catch_all),
           (kt.CUDA_ORDER_TABLE[0],)]
    for table in bad:
        with pytest.raises(ValueError):
            kt.check_table(table)


def test_kernel_table_is_in_the_docs():
    """docs/cuda.md shows every row's order, so a reader sees the table the dispatch reads."""
    from cpattn.core import kernel_order as kt

    doc = (ROOT / "docs" / "cuda.md").read_text()
    assert "## Measured kernel order" in doc
    for row in kt.CUDA_ORDER_TABLE:
        assert " > ".join(f"`{p}`" for p in row.order) in doc


@pytest.mark.parametrize("row", range(2))
def test_every_ordered_path_runs_on_meta_tensors(row):
    """Each path of each row, at a dtype and head dim the row covers, through the ops' shape functions."""
    from cpattn.core import kernel_order as kt

    r = kt.CUDA_ORDER_TABLE[row]
    dtype = kernels.DTYPES[r.dtypes[0]] if r.dtypes else BF16
    d = min(r.head_dims[1], 128)
    q = torch.empty(1, 40, 4, d, dtype=dtype, device="meta")
    k = torch.empty(1, 40, 2, d, dtype=dtype, device="meta")
    for path in r.order:
        assert kernels.kernel_fits(path, dtype, d)
        out, lse = kernels.forward_with(path, q, k, k, CAUSAL, 0.1)
        dq, dk, dv = kernels.backward_with(path, q, q, k, k, out.to(dtype), lse, CAUSAL, 0.1)
        assert out.shape == q.shape and dk.shape == k.shape


def test_capability_is_read_once_per_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: calls.append(index) or (9, 0))
    kernels._capability.cache_clear()
    try:
        assert kernels.capability(torch.device("cuda", 0)) == (9, 0) == kernels.capability(torch.device("cuda", 0))
        assert calls == [0]
        assert kernels.capability(torch.device("cpu")) is None
    finally:
        kernels._capability.cache_clear()


# ------------------------------------------------------------------------------------ Flex's backward operator
@pytest.mark.parametrize("hkv", [4, 1])
def test_flex_backward_operator_from_the_row_out_and_lse_matches_math(hkv):
    """The masked backward with no second forward, in its eager form, float64: the keys split over two
    PARTIAL blocks, each block's gradients from the merged row's out and lse (rows with no key anywhere,
    and rows empty in one block only), GQA; their sum is the math path's whole-row gradient."""
    if cuda_ops.flex_backward_op() is None:
        pytest.skip("this torch has no FlexAttention backward operator")  # the recompute path is tested above
    q, k, v, dout = _inputs(F64, sq=150, sk=200, h=4, hkv=hkv, d=16, seed=11)
    allowed = torch.rand(150, 200, generator=torch.Generator().manual_seed(12)) < 0.3
    allowed[4] = False
    allowed[6, :100] = False
    allowed[9, 100:] = False
    out, lse = kernels.forward_with("math", q, k, v, PARTIAL, 0.3, allowed)
    want = kernels.backward_with("math", dout, q, k, v, out, lse, PARTIAL, 0.3, allowed)
    total = [torch.zeros_like(want[0]), torch.zeros_like(want[1]), torch.zeros_like(want[2])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for cols in (slice(0, 100), slice(100, 200)):
            dq, dk, dv = cuda_ops.flex_backward(dout, q, k[:, cols], v[:, cols], out, lse, PARTIAL, 0.3,
                                                    allowed[:, cols], compiled=False)
            total[0] += dq
            total[1][:, cols] += dk
            total[2][:, cols] += dv
    for got, ref in zip(total, want):
        assert not got.isnan().any() and torch.allclose(got, ref, atol=1e-10), (got - ref).abs().max()
    assert bool((total[0][:, 4] == 0).all())


@pytest.mark.parametrize("kind", [FULL, CAUSAL, PARTIAL])
def test_flex_backward_operator_soft_capped_and_stacked(kind):
    """Soft-capped blocks of every kind, and stacked PARTIAL blocks with a mask per piece, through the
    backward operator's eager form against the math path (float64)."""
    if cuda_ops.flex_backward_op() is None:
        pytest.skip("this torch has no FlexAttention backward operator")
    q, k, v, dout = _inputs(F64, sq=64, sk=64, h=4, hkv=2, d=16, seed=13)
    q = q * 3
    mask = None
    if kind == PARTIAL:  # batch 2 = 1 row x 2 pieces, each with its own mask
        mask = torch.rand(2, 64, 64, generator=torch.Generator().manual_seed(14)) < 0.4
        mask[1, 7] = False
    for cap in (None, 0.7):
        extra = {} if cap is None else {"softcap": cap}
        out, lse = kernels._run_forward("math", q, k, v, kind, 0.25, mask, None, cap)
        want = kernels._run_backward("math", dout, q, k, v, out, lse, kind, 0.25, mask, None, None, cap)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = cuda_ops.flex_backward(dout, q, k, v, out, lse, kind, 0.25, mask, compiled=False, **extra)
        for g, w in zip(got, want):
            assert torch.allclose(g, w, atol=1e-10), (cap, (g - w).abs().max())


@pytest.mark.parametrize("op,compilable,compiled,want", [
    (True, True, True, "fused"), (True, False, True, "recompute"), (True, False, False, "fused"),
    (False, False, False, "recompute"), (False, False, True, "recompute")])
def test_flex_backward_takes_the_operator_only_where_it_runs(monkeypatch, op, compilable, compiled, want):
    """The fused backward runs where this torch has the operator (eager), and compiled only where dynamo can
    trace a direct call of it; elsewhere the block's forward is recomputed, as before."""
    cuda_ops.flex_backward_op.cache_clear()
    cuda_ops.flex_backward_compilable.cache_clear()
    monkeypatch.setattr(cuda_ops, "flex_backward_op", lambda: object() if op else None)
    monkeypatch.setattr(cuda_ops, "flex_backward_compilable", lambda: compilable)
    taken = []
    monkeypatch.setattr(cuda_ops, "flex_fused_backward", lambda *a, **k: taken.append("fused") or (1, 2, 3))
    monkeypatch.setattr(cuda_ops, "grads_through_block", lambda *a, **k: taken.append("recompute") or (1, 2, 3))
    q = torch.zeros(1, 4, 2, 16)
    assert cuda_ops.flex_backward(q, q, q, q, q, torch.zeros(1, 2, 4), FULL, 0.1, None, compiled=compiled) \
        == (1, 2, 3)
    assert taken == [want]


def test_a_partial_mask_builds_its_block_mask_once_per_run_cache(monkeypatch):
    """The executor keeps each block list's masks on the device across calls: inside a run's cache (a
    ``ContextParallel`` lends its own) the Flex path builds a mask's block mask on the first call only;
    an in-place change, a new tensor or another batch builds again; outside any cache every call builds."""
    from cpattn.core import memo

    built = []
    real = cuda_ops._block_mask
    monkeypatch.setattr(cuda_ops, "_block_mask", lambda dense: built.append(1) or real(dense))
    q, k, v, _ = _inputs(F32, sq=40, sk=70, h=4, hkv=2, d=16, seed=2)
    allowed = torch.rand(40, 70, generator=torch.Generator().manual_seed(5)) < 0.3
    allowed[3] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with memo.scope(memo.BoundedCache(16)):
            first = cuda_ops.flex_forward(q, k, v, PARTIAL, 0.3, allowed, compiled=False)
            again = cuda_ops.flex_forward(q, k, v, PARTIAL, 0.3, allowed, compiled=False)
            assert len(built) == 1 and torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
            cuda_ops.flex_forward(q[:1], k[:1], v[:1], PARTIAL, 0.3, allowed, compiled=False)  # another batch
            assert len(built) == 2
            allowed[5] = False  # in place: the old block mask no longer describes it
            changed = cuda_ops.flex_forward(q, k, v, PARTIAL, 0.3, allowed, compiled=False)
            assert len(built) == 3 and bool((changed[0][:, 5] == 0).all()) and not bool((first[0][:, 5] == 0).all())
            ref_o, _ = kernels.forward_with("math", q, k, v, PARTIAL, 0.3, allowed)
            assert torch.allclose(changed[0].float(), ref_o, atol=1e-5)
        cuda_ops.flex_forward(q, k, v, PARTIAL, 0.3, allowed, compiled=False)
        cuda_ops.flex_forward(q, k, v, PARTIAL, 0.3, allowed, compiled=False)
        assert len(built) == 5
