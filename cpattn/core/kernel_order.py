"""Which fused CUDA kernel runs a FULL or CAUSAL block: the one table, each row citing its measurement.

:func:`cpattn.kernels.choose_kernel` tries the paths of :func:`cuda_order` in turn and takes the first
that is available and fits (``kernels.kernel_fits``); nothing else in the package knows which kernel is
fast. A row matches a device by compute capability (``[first, below)``), a dtype and a head dim; the first
matching row wins, so specific rows come before the catch-all. ``measured`` names the measurement behind
the row (the run is recorded in docs/cuda.md, "Measured kernel order"); a row nobody measured says so.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the fused FULL/CAUSAL paths a row may order (``flash_attn`` runs only when asked for, ``backend=``;
#: FlashAttention-3 and -4 where a row measured them faster: none has yet, so they run only when pinned)
ORDERED_PATHS = frozenset({"flash_cuda", "cudnn_cuda", "efficient_cuda", "flash_attn3", "flash_attn4"})


@dataclass(frozen=True)
class OrderRow:
    """The kernel order for devices of compute capability ``first <= cc < below``, inputs of one of
    ``dtypes`` (:data:`cpattn.kernels.DTYPES` names; empty: any) and head dims ``head_dims[0]..[1]``."""

    first: tuple[int, int]
    below: tuple[int, int]
    dtypes: tuple[str, ...]
    head_dims: tuple[int, int]
    order: tuple[str, ...]
    measured: str

    def matches(self, capability: tuple[int, int], dtype: str, head_dim: int) -> bool:
        return (self.first <= tuple(capability) < self.below and (not self.dtypes or dtype in self.dtypes)
                and self.head_dims[0] <= head_dim <= self.head_dims[1])


ANY_CAPABILITY = ((0, 0), (99, 99))
_HALF = ("bfloat16", "float16")

#: first matching row wins; the last row matches every device
CUDA_ORDER_TABLE: tuple[OrderRow, ...] = (
    OrderRow((9, 0), (10, 0), _HALF, (8, 128), ("cudnn_cuda", "flash_cuda", "efficient_cuda"),
             "NVIDIA H200 (sm90), torch 2.11.0+cu130, cuDNN 9.19, 2026-12-04: through the kernel contract "
             "cudnn_cuda ran 1.53-1.74x flash_cuda's speed forward and 1.56-1.73x forward+backward, bf16, "
             "b=1, 32:8 heads, d=128, S=8K..64K, causal and full (scripts/gpu_check.py bench); "
             "exact in the same run. Head dims below 128 not timed yet (gpu_check's parity section has d=64)"),
    OrderRow(*ANY_CAPABILITY, (), (0, 1 << 30), ("flash_cuda", "cudnn_cuda", "efficient_cuda"),
             "not measured: FlashAttention-2 first, as on the H200 where it matched SDPA's flash backend "
             "(0.97-0.99); cuDNN next; the memory-efficient kernel, the only float32 one, last"),
)


def check_table(table: tuple[OrderRow, ...] = CUDA_ORDER_TABLE) -> None:
    """Raise ValueError unless every row orders known paths, each once, cites a measurement, and the last
    row matches every device."""
    for row in table:
        if set(row.order) - ORDERED_PATHS or len(set(row.order)) != len(row.order):
            raise ValueError(f"kernel order row {row} names an unknown or repeated path; known: "
                             f"{', '.join(sorted(ORDERED_PATHS))}")
        if not row.measured.strip():
            raise ValueError(f"kernel order row {row} cites no measurement")
    last = table[-1]
    if (last.first, last.below) != ANY_CAPABILITY or last.dtypes or last.head_dims[0] > 0:
        raise ValueError("the last kernel order row must match every device, dtype and head dim")


def order_row(capability: tuple[int, int] | None, dtype: str, head_dim: int,
              table: tuple[OrderRow, ...] = CUDA_ORDER_TABLE) -> OrderRow:
    """The row that orders the fused paths for a device of ``capability`` (None: unknown, the catch-all),
    inputs of dtype name ``dtype`` and ``head_dim``."""
    if capability is None:
        return table[-1]
    return next((row for row in table if row.matches(capability, dtype, head_dim)), table[-1])


def cuda_order(capability: tuple[int, int] | None, dtype: str, head_dim: int) -> tuple[str, ...]:
    """The fused FULL/CAUSAL paths to try, fastest measured first (:func:`order_row`)."""
    return order_row(capability, dtype, head_dim).order


check_table()
