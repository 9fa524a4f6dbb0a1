"""``cpattn bench``: time every schedule on N local processes against one process (docs/bench.md).

:mod:`.measure` runs the schedules and collects their times and bytes; :mod:`.report` predicts, tabulates,
records, traces and plots what it collected.
"""

from .measure import (
    CHECK_TOLERANCE,
    FLEX_DENSE_MAX_SEQ,
    SPEED_PROBE,
    BenchConfig,
    BenchRow,
    emulated_topology,
    flex_mask_mod,
    flops,
    is_masked,
    mask_efficiency,
    parallel_limit,
    probe_blocks,
    rank_device,
    round_figures,
    run,
    sharing,
    spread,
)
from .report import (
    DROP_ORDER,
    PLOT_TIMELINES,
    SPEED_WINDOW,
    config_label,
    measured_kernel_s,
    plot,
    predict,
    prediction_summary,
    probe_speeds,
    render,
    render_breakdown,
    save_json,
    trace_name,
    write_traces,
)

__all__ = ["CHECK_TOLERANCE", "DROP_ORDER", "FLEX_DENSE_MAX_SEQ", "PLOT_TIMELINES", "SPEED_PROBE", "SPEED_WINDOW",
           "BenchConfig", "BenchRow", "config_label", "emulated_topology", "flex_mask_mod", "flops", "is_masked",
           "mask_efficiency", "measured_kernel_s", "parallel_limit", "plot", "predict", "prediction_summary",
           "probe_blocks", "probe_speeds", "rank_device", "render", "render_breakdown", "round_figures", "run",
           "save_json", "sharing", "spread", "trace_name", "write_traces"]
