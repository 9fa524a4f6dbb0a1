"""``ultra``'s backward message of a fetched row carries D = rowsum(dout * out), not ``out``: the kernel
contract's backward from D equals the backward from ``out``, and the message's size and packing are
(q, dout, lse, D). Runs on one process, in milliseconds."""

from __future__ import annotations

import pytest
import torch
from cpattn.masks import BlockKind

from cpattn import kernels
from cpattn.planner.messages import Sizes
from cpattn.schedules.ultra import CODECS

FULL, CAUSAL, PARTIAL = BlockKind.FULL, BlockKind.CAUSAL, BlockKind.PARTIAL


def _block(dtype: torch.dtype, kind: BlockKind, heads: int = 4, kv_heads: int = 2, n: int = 160, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, n, heads, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, n, kv_heads, 16, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(2, n, heads, 16, generator=g).to(dtype)
    mask = torch.rand(n, n, generator=g) < 0.4 if kind == PARTIAL else None
    if mask is not None:
        mask[3] = False  # a row that attends nothing
    out, lse = kernels.forward(q, k, v, kind, 0.25, mask)
    return q, k, v, dout, out.to(dtype), lse, mask


def _delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    acc = kernels.acc_dtype(dout.dtype)
    return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kind", [FULL, CAUSAL, PARTIAL])
def test_backward_from_delta_equals_backward_from_out(dtype, kind):
    q, k, v, dout, out, lse, mask = _block(dtype, kind)
    delta = _delta(dout, out)
    on_math = kernels.backward(dout, q, k, v, None, lse, kind, 0.25, mask, backend="math", delta=delta)
    for a, b in zip(on_math, kernels.backward(dout, q, k, v, out, lse, kind, 0.25, mask, backend="math")):
        assert a.dtype == kernels.acc_dtype(dtype)
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # math takes D: the same arithmetic as D from out
    from_delta = kernels.backward(dout, q, k, v, None, lse, kind, 0.25, mask, delta=delta)  # fused: a stand-in
    fused = kernels.backward(dout, q, k, v, out, lse, kind, 0.25, mask)
    tol = 1e-5 if dtype == torch.float32 else 1e-12 if dtype == torch.float64 else 2e-2
    for a, b in zip(from_delta, fused):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_backward_without_out_keeps_its_path_and_needs_delta(monkeypatch):
    q, k, v, dout, out, lse, _ = _block(torch.float32, CAUSAL)
    delta = _delta(dout, out)
    stand_in = kernels.out_for_delta(dout, delta)
    torch.testing.assert_close(_delta(dout, stand_in), delta, rtol=1e-5, atol=1e-6)
    zero = dout.clone()
    zero[:, 5] = 0  # rows with dout 0 have D 0: the stand-in is 0 there, never NaN
    assert torch.equal(kernels.out_for_delta(zero, _delta(zero, out))[:, 5], torch.zeros_like(zero[:, 5]))
    seen = []
    real = kernels._run_backward
    monkeypatch.setattr(kernels, "_run_backward", lambda path, *a, **kw: seen.append(path) or real(path, *a, **kw))
    kernels.backward(dout, q, k, v, None, lse, CAUSAL, 0.25, delta=delta)
    assert seen == [kernels.kernel_for(q, CAUSAL, "auto", k.shape[1])] and seen[0] != "math"  # the fused path
    assert kernels.DELTA_PATHS <= set(kernels.PATHS)
    with pytest.raises(ValueError, match="delta"):
        kernels.backward(dout, q, k, v, None, lse, FULL, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_row_message_is_q_dout_lse_and_delta(dtype):
    b, n, h, hkv, d = 2, 8, 4, 2, 16
    acc = kernels.acc_dtype(dtype)
    z = Sizes(b, n, h, hkv, d, torch.empty((), dtype=dtype).element_size(), kernels.acc_bytes(dtype))
    # two row-sized tensors in the input dtype plus two floats per row and head, no out
    assert z.item_bytes("qb") == b * n * h * (2 * d * z.elem + 2 * z.acc_elem)
    q, dout = torch.randn(b, n, h, d).to(dtype), torch.randn(b, n, h, d).to(dtype)
    lse, delta = torch.randn(b, h, n, dtype=acc), torch.randn(b, h, n, dtype=acc)
    item = CODECS["qb"]
    buf = item.pack((q, dout, lse, delta))
    shape, buf_dtype = item.buffer(z, dtype, acc)
    assert buf.dtype == buf_dtype and buf.numel() == shape[0] == z.item_bytes("qb")
    for got, want in zip(item.unpack(buf, z, dtype, acc), (q, dout, lse, delta)):
        assert torch.equal(got, want)
