"""cpattn: exact context-parallel attention on torch.distributed."""

import sys as _sys

from . import schedules
from .api import ContextParallel
from .core import kernels, layout, masks, merge
from .core.comm import Communicator
from .core.old_paths import warn_moved as _warn_moved
from .functional import ATTN_FUNCS
from .version import __version__

# the public modules keep their short import paths (``from cpattn.masks import causal``): one module
# object under two names, never a second copy
for _name, _module in (("masks", masks), ("layout", layout), ("kernels", kernels), ("merge", merge)):
    _sys.modules[f"{__name__}.{_name}"] = _module
del _name, _module
globals().update(ATTN_FUNCS)  # ring_attn_func, ..., one per registered schedule


def __getattr__(name: str):
    # one public path per name: ``Topology`` is ``cpattn.cost.Topology``; the old short path still works
    if name == "Topology":
        _warn_moved("cpattn.Topology", "cpattn.cost.Topology")
        from .core.topology import Topology

        return Topology
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["__version__", "Communicator", "ContextParallel", "kernels", "layout", "masks", "merge",
           "schedules", *sorted(ATTN_FUNCS)]
