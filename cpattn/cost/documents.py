"""Packed documents for predictions: document lengths sampled from a published length distribution.

A benchmark of packed (variable-length) attention states how its documents were drawn; predicting it
needs the same lengths. :func:`pack` draws documents from a binned length distribution (bins of
document lengths with their counts), splits any longer than ``chunk`` tokens into chunks of ``chunk``
plus a remainder, and packs them in order into ``total`` tokens, cutting the last one (pure: a seeded
generator, no process group). :data:`DISTRIBUTIONS` holds the published ones by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthDistribution:
    """Documents per length bin: ``bins`` of ``(first, last, count)`` (tokens, inclusive; count of
    documents), each document of a bin taken at the bin's middle ``(first + last) // 2``. ``chunk_ratio``:
    documents longer than ``chunk_ratio x`` the packed length are split into chunks of that length (so
    no document spans the whole sequence). ``source``: where the figures come from."""

    name: str
    bins: tuple[tuple[int, int, int], ...]
    chunk_ratio: float
    source: str

    def __post_init__(self) -> None:
        if not self.bins or any(not (1 <= lo <= hi) or n < 0 for lo, hi, n in self.bins):
            raise ValueError(f"{self.name}: bins must be (first, last, count) with 1 <= first <= last, count >= 0")
        if not 0 < self.chunk_ratio <= 1:
            raise ValueError(f"{self.name}: chunk_ratio must be in (0, 1], got {self.chunk_ratio!r}")


#: MagiAttention's distributed benchmark (SandAI-org/MagiAttention, exps/dist_attn: benchmark_conf.py
#: SAMPLE_CONFIG, dataset doc_length_distribution.csv, sampler benchmark/utils.py DatasetSampler; blog
#: "Long-Context Attention Benchmark", docs/source/blog/cp_benchmark.md): 13.5 million documents of a
#: training set in 14 length bins, each taken at its middle, those longer than a quarter of the packed
#: length split into quarter-length chunks.
MAGIATTENTION = LengthDistribution(
    "magiattention",
    ((1, 10, 30254), (11, 50, 391188), (51, 100, 699596), (101, 200, 1377757), (201, 500, 3794735),
     (501, 1024, 3316785), (1025, 2048, 2106566), (2049, 4096, 988525), (4097, 8192, 410002),
     (8193, 16384, 173574), (16385, 32768, 115007), (32769, 65536, 18428), (65537, 131072, 22513),
     (131073, 196608, 18284)),
    0.25,
    "MagiAttention exps/dist_attn/benchmark/datasets/default/doc_length_distribution.csv (bins [0, 10] .. "
    "[131073, 196608]), chunk_ratio 0.25 (benchmark_conf.py)")

DISTRIBUTIONS = {MAGIATTENTION.name: MAGIATTENTION}


def pieces(distribution: LengthDistribution, total: int) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, counts)`` of the pieces a pack of ``total`` tokens draws from: each bin's documents at
    the bin's middle, split into ``floor(chunk_ratio x total)``-token chunks and a remainder (tokens,
    documents)."""
    chunk = max(1, int(distribution.chunk_ratio * total))
    out: dict[int, int] = {}
    for lo, hi, count in distribution.bins:
        length = (lo + hi) // 2
        whole, rest = divmod(length, chunk)
        if whole:
            out[chunk] = out.get(chunk, 0) + whole * count
        if rest:
            out[rest] = out.get(rest, 0) + count
    lengths = np.array(sorted(out), dtype=np.int64)
    return lengths, np.array([out[n] for n in lengths], dtype=np.int64)


def pack(distribution: LengthDistribution | str, total: int, seed: int = 0) -> list[int]:
    """Document lengths (tokens) summing to ``total``: pieces (:func:`pieces`) drawn at random in
    proportion to their counts, as a shuffled dataset packs them in order, the last one cut to fit.
    Deterministic for a ``seed``."""
    dist = DISTRIBUTIONS[distribution] if isinstance(distribution, str) else distribution
    if not isinstance(total, int) or total < 1:
        raise ValueError(f"total must be a positive int (tokens), got {total!r}")
    lengths, counts = pieces(dist, total)
    rng = np.random.default_rng(seed)
    out, left = [], total
    while left > 0:
        # draw in batches: the mean piece is hundreds of tokens, so a batch of total / 64 rarely runs short
        draws = lengths[rng.choice(len(lengths), size=max(16, total // 64), p=counts / counts.sum())]
        for n in draws.tolist():
            out.append(min(n, left))
            left -= out[-1]
            if left == 0:
                break
    return out


__all__ = ["DISTRIBUTIONS", "MAGIATTENTION", "LengthDistribution", "pack", "pieces"]
