"""Pictures of a plan (PNG, matplotlib): which rank computes each cell, and each rank's lanes in time."""

from __future__ import annotations

from .kernel_graph import PHASES
from .model import Plan

_OP_COLORS = {"compute": "tab:blue", "merge": "tab:purple", "send": "tab:orange", "recv": "tab:green"}
_LANES = ("compute", "send", "recv")  # a rank's rows in the timeline, top to bottom


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def heatmap(plan: Plan, path: str) -> None:
    """Forward and backward side by side: cell (i, j) coloured by the rank that computes it (white:
    EMPTY), kernel calls outlined, owners' diagonal blocks framed."""
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    n, world = plan.table.n, plan.world
    fig, axes = plt.subplots(1, 2, figsize=(12, 6.2))
    cmap = plt.get_cmap("tab20" if world <= 20 else "viridis", world)
    for ax, name in zip(axes, PHASES):
        ph = plan.phase(name)
        grid = np.ma.masked_less(np.array(ph.assign, dtype=float).reshape(n, n), 0)
        im = ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=world - 0.5, interpolation="nearest")
        for kn in ph.kernels:
            if len(kn.rows) * len(kn.cols) > 1:
                rows, cols = kn.rows, kn.cols
                contiguous = rows == tuple(range(rows[0], rows[-1] + 1)) and cols == tuple(range(cols[0], cols[-1] + 1))
                if contiguous:
                    ax.add_patch(plt.Rectangle((cols[0] - 0.5, rows[0] - 0.5), len(cols), len(rows), fill=False,
                                               edgecolor="black", linewidth=0.8))
        c = plan.chunks_per_rank
        for r in range(world):
            ax.add_patch(plt.Rectangle((r * c - 0.5, r * c - 0.5), c, c, fill=False, edgecolor="red", linewidth=0.6,
                                       linestyle=":"))
        ax.set_title(f"{name}: predicted {ph.predicted * 1e3:.3g} ms, {len(ph.kernels)} kernels, "
                     f"{len(ph.transfers)} transfers", fontsize=9)
        ax.set_xlabel(f"key/value chunk ({plan.table.chunk} tokens)")
        ax.set_ylabel("query chunk")
        for axis in (ax.xaxis, ax.yaxis):  # cells are whole chunks: ticks on their centres only
            axis.set_major_locator(MaxNLocator(integer=True))
    bar = fig.colorbar(im, ax=axes, label="rank", shrink=0.8)
    bar.ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    key = plan.key
    fig.suptitle(f"UltraAttn plan: mask {key['mask']}, S={key['seq_len']}, {key['nodes']} x "
                 f"{key['devices_per_node']} devices ({key['topology_name']})", fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def timeline(plan: Plan, path: str) -> None:
    """Gantt chart of every rank's compute, send and receive lanes, forward above backward."""
    plt = _pyplot()
    world = plan.world
    height = max(4.0, min(40.0, 0.18 * 3 * world + 1.5))
    fig, axes = plt.subplots(2, 1, figsize=(13, 2 * height))
    for ax, name in zip(axes, PHASES):
        ph = plan.phase(name)
        for r, ops in enumerate(ph.ops):
            for op in ops:
                lane = "compute" if op.kind in ("compute", "merge") else op.kind
                y = r * len(_LANES) + _LANES.index(lane)
                ax.barh(y, (op.end - op.start) * 1e3, left=op.start * 1e3, height=0.8, color=_OP_COLORS[op.kind],
                        edgecolor="none")
        ax.set_yticks([r * len(_LANES) + k for r in range(world) for k in range(len(_LANES))])
        ax.set_yticklabels([f"{r} {lane}" for r in range(world) for lane in _LANES], fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("ms (predicted)")
        ax.set_title(f"{name}: makespan {ph.predicted * 1e3:.3g} ms ({ph.scheduler.get('method')}, "
                     f"{ph.scheduler.get('status')})", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _OP_COLORS.values()]
    fig.legend(handles, list(_OP_COLORS), loc="upper right", ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
