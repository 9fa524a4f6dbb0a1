"""cpattn: exact context-parallel attention on torch.distributed."""

from . import kernels, layout, masks, merge, schedules
from .api import (
    ContextParallel,
    allgather_attn_func,
    ring_attn_func,
    ringx1_attn_func,
    ringx1o_attn_func,
    ringx2_attn_func,
    ringx2o_attn_func,
    ringx3_attn_func,
    ringx3b_attn_func,
    ringx4_attn_func,
    ringx4o_attn_func,
    stripe_ring_attn_func,
    ulysses_attn_func,
    zigzag_ring_attn_func,
)
from .comm import Communicator
from .topology import Topology
from .version import __version__

__all__ = [
    "__version__",
    "Communicator",
    "ContextParallel",
    "Topology",
    "allgather_attn_func",
    "kernels",
    "layout",
    "masks",
    "merge",
    "ring_attn_func",
    "ringx1_attn_func",
    "ringx1o_attn_func",
    "ringx2_attn_func",
    "ringx2o_attn_func",
    "ringx3_attn_func",
    "ringx3b_attn_func",
    "ringx4_attn_func",
    "ringx4o_attn_func",
    "schedules",
    "stripe_ring_attn_func",
    "ulysses_attn_func",
    "zigzag_ring_attn_func",
]
