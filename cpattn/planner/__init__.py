"""UltraAttn planner: hierarchical context tiling, the partition ILP, the kernel graph and its
schedule, as a plain-data :class:`Plan` (docs/ultraattn.md). Pure: no process group needed.

Modules: :mod:`.model` (the plan, its JSON and its check), :mod:`.build` (making one), :mod:`.cache`
(the on-disk cache)."""

from .block_table import BlockTable
from .build import Request, build_plan, choose_order, request
from .cache import CACHE_ENV, cache_dir, get_plan, load_plan, save_plan
from .model import Plan, PlanOptions, PlanVersionError, validate

__all__ = ["CACHE_ENV", "BlockTable", "Plan", "PlanOptions", "PlanVersionError", "Request", "build_plan", "cache_dir",
           "choose_order", "get_plan", "load_plan", "request", "save_plan", "validate"]
