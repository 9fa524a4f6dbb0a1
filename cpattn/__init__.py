"""cpattn: exact context-parallel attention on torch.distributed."""

import sys as _sys

from . import schedules
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
from .core import kernels, layout, masks, merge
from .core.comm import Communicator
from .core.topology import Topology
from .version import __version__

# the public modules keep their short import paths (``from cpattn.masks import causal``): one module
# object under two names, never a second copy
for _name, _module in (("masks", masks), ("layout", layout), ("kernels", kernels), ("merge", merge)):
    _sys.modules[f"{__name__}.{_name}"] = _module
del _name, _module

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
