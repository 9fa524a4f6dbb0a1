"""FlexAttention block masks from a mask's structure (cpattn.core.flex_masks): equal to FlexAttention's
own create_block_mask over the mask's rule at small sizes, for every mask family, combinations and
rectangles off the diagonal; built at S = 65,536 from intervals alone, with no s_q x s_kv tensor."""

from __future__ import annotations

import time

import pytest
import torch

from cpattn import masks as M
from cpattn.core import flex_masks

pytest.importorskip("torch.nn.attention.flex_attention")
from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402

S = 640  # five tiles of 128


def _families():
    table = [[2 if i == j else 1 if j < i and (i - j) % 2 else 0 for j in range(10)] for i in range(10)]
    table[1] = [0] * 10
    return {
        "full": M.full(), "causal": M.causal(),
        "window": M.sliding_window(200), "window_bidirectional": M.sliding_window(150, causal=False),
        "window_aligned": M.sliding_window(256),
        "documents": M.document([300, 1, 128, 211]), "documents_bidirectional": M.document([256, 128, 256], False),
        "streaming": M.streaming(sink=4, window=130), "streaming_blocks": M.streaming(sink=128, window=256,
                                                                                      block_size=64),
        "star": M.star(block_size=80, sink=1), "strided": M.strided(block_size=64, stride=3),
        "global_local": M.global_local(block_size=64, global_blocks=1, local_blocks=2),
        "block_table": M.block_table(table, 64),
        "and": M.sliding_window(300) & M.document([320, 320]),
        "or": M.sliding_window(100) | M.streaming(sink=128, window=1),
    }


def _same(ours, theirs) -> None:
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.shape == b.shape and torch.equal(a.to(b.dtype), b), name
    assert ours.seq_lengths == theirs.seq_lengths


@pytest.mark.parametrize("family", list(_families()))
@pytest.mark.parametrize("rect", [(0, S, 0, S), (256, 640, 0, 384), (0, 300, 200, 557), (128, 256, 512, 640)])
def test_block_mask_from_structure_equals_create_block_mask(family, rect):
    mask = _families()[family]
    q0, q1, k0, k1 = rect
    _, ours = flex_masks.Region.rect(mask, q0, q1, k0, k1).block_mask("cpu")
    theirs = create_block_mask(lambda b, h, qi, ki: mask.mask_mod(qi + q0, ki + k0), None, None, q1 - q0, k1 - k0,
                               device="cpu")
    _same(ours, theirs)
    # the partial tiles' pairs come from the mask's own rule on global positions
    qi, ki = torch.arange(q1 - q0).unsqueeze(1), torch.arange(k1 - k0).unsqueeze(0)
    assert torch.equal(ours.mask_mod(0, 0, qi, ki), mask.dense(q0, q1, k0, k1))


def test_merged_intervals_are_the_row_union():
    starts = torch.tensor([[5, 0, 9, 3], [0, 0, 0, 0], [10, 2, 4, 20]])
    ends = torch.tensor([[9, 3, 12, 4], [0, 0, 0, 0], [12, 4, 6, 25]])
    s, e = flex_masks._merged(starts, ends)
    for row in range(3):
        want = set().union(*(range(a, b) for a, b in zip(starts[row].tolist(), ends[row].tolist())))
        got = [range(a, b) for a, b in zip(s[row].tolist(), e[row].tolist()) if b > a]
        assert set().union(*got) == want and sum(len(r) for r in got) == len(want)  # disjoint


def test_a_mask_without_intervals_keeps_its_own_rule():
    mask = M.from_mask_mod(lambda q, k: (q + k) % 3 == 0)
    with pytest.raises(ValueError, match="no key intervals"):
        flex_masks.Region.rect(mask, 0, 256, 0, 256).tile_kinds()
    _, bm = flex_masks.Region.rect(mask, 0, 256, 0, 256).block_mask("cpu")
    qi, ki = torch.arange(256).unsqueeze(1), torch.arange(256).unsqueeze(0)
    assert torch.equal(bm.mask_mod(0, 0, qi, ki), mask.dense(0, 256, 0, 256))


class _NoSquare:
    """Fails the test when a tensor of ``limit`` elements or more is created."""

    def __init__(self, limit: int) -> None:
        self.limit, self.largest = limit, 0

    def __enter__(self):
        from torch.overrides import TorchFunctionMode

        guard = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        guard.largest = max(guard.largest, t.numel())
                        assert t.numel() < guard.limit, f"{func} made a tensor of {t.numel()} elements"
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


@pytest.mark.parametrize("family", ["documents", "window", "view"])
def test_block_masks_at_64k_tokens_from_intervals_alone(family):
    """S = 65,536: the block masks of every work item of a 4-rank split (16 rectangles) from structure,
    with no tensor of s_q * s_kv elements of any rectangle, in well under a second."""
    s = 65536
    lengths = [4096 + 37 * i for i in range(15)]
    lengths.append(s - sum(lengths))
    mask = {"documents": M.document(lengths), "window": M.sliding_window(4096),
            "view": M.document([8000, 123, 20000, s - 28123]) & M.sliding_window(8192)}[family]
    part = s // 4
    rects = [(i * part, (i + 1) * part, j * part, (j + 1) * part) for i in range(4) for j in range(4)]
    with _NoSquare(part * part) as guard:
        t0 = time.perf_counter()
        kinds = [flex_masks.Region.rect(mask, *r).tile_kinds() for r in rects]
        seconds = time.perf_counter() - t0
    assert guard.largest < part * part // 16
    assert seconds < 2.0, seconds  # on a busy 2-core machine; about 0.1 s when idle
    whole = torch.cat([torch.cat(kinds[i * 4:(i + 1) * 4], 1) for i in range(4)], 0)
    # spot-check tiles against the classifier
    for qt, kt in [(0, 0), (100, 99), (300, 290), (511, 511), (511, 0), (200, 180)]:
        kind = mask.classify(qt * 128, qt * 128 + 128, kt * 128, kt * 128 + 128)
        want = {"EMPTY": 0, "FULL": 2}.get(kind.name, 1)
        assert int(whole[qt, kt]) == want, (qt, kt, kind)
