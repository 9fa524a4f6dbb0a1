"""UltraAttn planner: hierarchical context tiling, the partition ILP, the kernel graph and its
schedule, as a plain-data :class:`Plan` (ultraattn.md). Pure: no process group needed."""

from .block_table import BlockTable
from .plan import (
    Plan,
    PlanOptions,
    Request,
    build_plan,
    cache_dir,
    choose_order,
    get_plan,
    load_plan,
    request,
    save_plan,
    validate,
)

__all__ = ["BlockTable", "Plan", "PlanOptions", "Request", "build_plan", "cache_dir", "choose_order", "get_plan",
           "load_plan", "request", "save_plan", "validate"]
