"""Costs of UltraAttn plan tasks beyond kernels (``Device.kernel_time``) and transfers
(``simulator.transfer``) (pure)."""

from __future__ import annotations

from ..topology import Device


def merge_time(device: Device, nbytes: int) -> float:
    """Seconds to fold one received partial result of ``nbytes`` bytes into an accumulator of the same
    size (lse merge of outputs, or a gradient sum): read both and write one, plus one launch."""
    return device.launch + 3.0 * nbytes / device.memory_bandwidth


__all__ = ["merge_time"]
