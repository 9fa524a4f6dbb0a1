"""What a run shows: each evaluation as a line, the rich progress bar on rank 0, the JSON log and the
loss-curve PNG (:func:`plot_losses`), and :func:`results_table`, the runs compared (losses, held-out
evaluation, throughput, MFU, against ``ring`` and the cp=1 run), printed by :func:`cpattn.output.show_wide`."""

from __future__ import annotations

import json
from pathlib import Path

from .config import TrainConfig


def evaluation_line(ev: dict, chance: float | None = None) -> str:
    """One evaluation as a line: ``step 50: held-out loss 1.234, accuracy 0.412 (chance 0.042)``."""
    if "mse" in ev:
        return (f"step {ev['step']}: held-out MSE {ev['mse']:.4g} (persistence {ev['persistence_mse']:.4g}, "
                f"ratio {ev['mse'] / ev['persistence_mse']:.3f})")
    note = f" (chance {chance:.3f})" if chance else ""
    return f"step {ev['step']}: held-out loss {ev['loss']:.4f}, accuracy {ev['accuracy']:.3f}{note}"


class _Progress:
    """Rich progress on rank 0: step, loss, tokens/s, MFU."""

    def __init__(self, cfg: TrainConfig, last: int, first: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        mode = "fsdp" if cfg.fsdp else "replicated"
        self.bar = Progress(TextColumn(f"[bold]{cfg.model} dp{cfg.dp} x cp{cfg.cp} {cfg.schedule} {mode} "
                                       f"{cfg.dtype}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeElapsedColumn())
        self.bar.start()
        self.task = self.bar.add_task("train", total=last, completed=first, info="")

    def update(self, step: int, loss: float, rate: dict) -> None:
        info = f"loss {loss:.4f}  {rate['tokens_per_s']:.0f} tok/s  MFU {100 * rate['mfu']:.1f}%"
        self.bar.update(self.task, completed=step, info=info)

    def print(self, line: str) -> None:
        self.bar.console.print(line, markup=False, highlight=False)

    def close(self) -> None:
        self.bar.stop()


def _write_outputs(cfg: TrainConfig, record: dict) -> None:
    if cfg.log:
        saved = {k: v for k, v in record.items() if k != "params"}
        Path(cfg.log).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.log).write_text(json.dumps(saved, indent=1))
    if cfg.plot:
        plot_losses({run_label(record): record}, cfg.plot)


def run_label(rec: dict) -> str:
    c = rec["config"]
    extra = " replicated" * (not c.get("fsdp", True)) + " bf16" * (c.get("dtype") == "bfloat16")
    return f"dp{c['dp']} x cp{c['cp']} {rec['schedule']}{extra}"


def results_table(records: list[dict]):
    """A rich Table of runs: losses, the last held-out evaluation, throughput and MFU, against ``ring``
    on the same mesh and the cp=1 run of the same schedule (columns no run has a value for are left
    out); its caption says what MFU is taken against."""
    from rich.table import Table

    first = records[0]["config"]
    what = first["task"] if first["task"] != "text" else f"text {first['data']}"
    peaks = {}  # what MFU is taken against, per number of ranks (a measured peak is measured per world)
    for rec in records:
        c = rec["config"]
        peaks.setdefault(rec["peak_source"], {})[c["dp"] * c["cp"]] = rec["peak_tflops_per_rank"]
    parts = []
    for source, by in peaks.items():
        each = [f"{tf:.3g} TFLOP/s per rank" + (f" at {n} rank{'s' * (n > 1)}" if len(by) > 1 else "")
                for n, tf in sorted(by.items())]
        parts.append(f"{source}: {', '.join(each)}")
    against = "; ".join(parts)
    chance = records[0].get("chance")
    evaluated = any(rec["evaluations"] for rec in records)
    held = f"held-out acc: the recall answers' accuracy (chance {chance:.3f}); " if chance and evaluated else ""
    table = Table(title=f"{first['model']} {first['config']}, {what}, seq {first['seq']}, batch {first['batch']}",
                  caption=f"{held}MFU: model FLOPs per second and rank over the {against}; step time excludes "
                          f"batch preparation")
    def key(rec: dict) -> tuple:
        c = rec["config"]
        return c["dp"], c["cp"], rec["schedule"], c.get("fsdp", True), c.get("dtype")

    by_key = {key(r): r for r in records}

    def ratio(rec: dict, other: dict | None) -> str:
        if other is None or other is rec or not other["tokens_per_s"]:
            return "-"
        return f"{rec['tokens_per_s'] / other['tokens_per_s']:.2f}"

    rows = []
    for rec in records:
        dp, cp, schedule, fsdp, dtype = key(rec)
        ring = by_key.get((dp, cp, "ring", fsdp, dtype))
        single = by_key.get((dp, 1, schedule, fsdp, dtype)) or next(
            (r for k, r in by_key.items() if k[0] == dp and k[1] == 1 and k[3:] == (fsdp, dtype)), None)
        losses = rec["losses"][rec["first_step"] - 1:]  # the steps this run trained (a resumed run: the rest)
        rows.append([run_label(rec), f"{rec['first_step']}-{rec['first_step'] + len(losses) - 1}",
                     f"{losses[0]:.4f}" if losses else "-", f"{losses[-1]:.4f}" if losses else "-",
                     _held_out(rec), f"{rec['tokens_per_s']:.0f}", f"{100 * rec['mfu']:.1f}%", ratio(rec, ring),
                     ratio(rec, single)])
    header = ("run", "steps", "first loss", "last loss", "held-out", "tokens/s", "MFU", "x ring", "x cp=1")
    optional = {"held-out", "x ring", "x cp=1"}  # left out when no run has a value
    keep = [i for i, col in enumerate(header) if col not in optional or any(r[i] != "-" for r in rows)]
    for i in keep:
        table.add_column(header[i], justify="right")
    for row in rows:
        table.add_row(*(row[i] for i in keep))
    return table


def _held_out(rec: dict) -> str:
    """The last evaluation, in a table cell."""
    if not rec["evaluations"]:
        return "-"
    ev = rec["evaluations"][-1]
    if "mse" in ev:
        return f"MSE {ev['mse'] / ev['persistence_mse']:.3f} x persistence"
    return f"acc {ev['accuracy']:.3f}"


def plot_losses(runs: dict[str, dict], path: str) -> None:
    """A PNG of the training-loss curves of ``runs`` (label -> record), with each run's held-out
    evaluations (accuracy, or the ViT's MSE over persistence's) as markers on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    right = None
    for i, (label, rec) in enumerate(runs.items()):
        color = f"C{i % 10}"
        steps = list(range(1, len(rec["losses"]) + 1))
        ax.plot(steps, rec["losses"], label=label, color=color, linestyle=("-", "--", ":", "-.")[i // 10 % 4])
        evals = rec.get("evaluations") or []
        if evals:
            right = right or ax.twinx()
            vit = "mse" in evals[0]
            values = [e["mse"] / e["persistence_mse"] if vit else e["accuracy"] for e in evals]
            right.plot([e["step"] for e in evals], values, marker="o", color=color, linestyle="none",
                       label=f"{label}: held-out")
            right.set_ylabel("held-out MSE / persistence's (markers)" if vit else "held-out accuracy (markers)")
            right.set_ylim(0, max(1.0 if vit else 0.0, *values) * 1.1)
            if rec.get("chance"):
                right.axhline(rec["chance"], color="grey", linestyle=":", linewidth=1)
                right.annotate("chance", (1, rec["chance"]), textcoords="offset points", xytext=(0, 3), fontsize=7,
                               color="grey")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over the global batch)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.2g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.2g"))
    ax.legend(fontsize=8, loc="upper center")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
