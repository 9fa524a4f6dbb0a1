"""What is made of a :func:`~cpattn.bench.measure.run` result: the cost model's predictions set against
it (:func:`predict`, with the speed probe's :func:`probe_speeds`), the table and its caption
(:func:`render`, :func:`render_breakdown`), the JSON record, Chrome traces and the plot."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import statistics

import numpy as np

from ..core import masks
from ..timed_calls import square_kernel
from ..timeline import chrome_trace, draw, fraction_text, lanes
from .measure import emulated_topology

#: the probed rows on each side of a row whose probe samples set its speed (:func:`predict`): a row's own
#: samples (one per timed iteration) carry the second-to-second jitter, a whole configuration's miss the
#: drift within it
SPEED_WINDOW = 1


def probe_speeds(probe: dict, problem, device) -> list[float]:
    """The machine's speed against the profile in each sample of one row's speed probe: the seconds
    ``device`` (the topology's: the profile's rates, shared between the ranks as in the estimates) gives the
    probe's kernel calls (launch + FLOPs / rate: the calls alone, as calibration timed them, without the
    epilogue an estimate adds for folding a result into accumulators) over the measured seconds (the
    slowest rank's); above 1: faster than calibrated. ``probe``: ``{"blocks": [(kind, side)], "seconds":
    [...]}`` (a row's ``extra["speed_probe"]``)."""
    calls = [(square_kernel(kind, n), phase) for kind, n in probe["blocks"] for phase in ("forward", "backward")]
    expected = sum(device.launch + k.flops(problem, phase) / device.rate(phase, k.kind, k.q_len, k.kv_len)
                   for k, phase in calls)
    return [expected / sec for sec in probe["seconds"] if sec > 0]


def predict(result: dict, profile=None, speed_window: int | None = SPEED_WINDOW) -> dict:
    """Add the cost model's predictions to a :func:`run` result (in place; also returned).

    Each row gains ``pred_fwd_s``, ``pred_fwd_bwd_s`` and the relative errors ``pred_fwd_error`` and
    ``pred_error`` ((predicted - measured) / measured), and ``extra["prediction_terms"]`` (per phase,
    ``Estimate.terms()``: kernels, merge, launch, exposed_comm seconds), estimated on :func:`emulated_topology` for the
    run's world size, emulated nodes, cores and threads per rank, from ``profile`` (a
    :class:`cpattn.cost.Profile`; None = the profile at the default location, else conservative
    defaults); ``ultra`` from its plan for that topology (on a CPU, the plan its ranks ran). A schedule
    the model cannot estimate keeps NaN and says why in ``extra["prediction"]``. ``result["prediction"]``
    gets the topology used and the median absolute error over the rows.

    Rows run with the speed probe (``run(speed_probe=True)``) get ``speed``: how fast the machine ran
    against the profile, the median of the :func:`probe_speeds` samples of the row and of the
    ``speed_window`` probed rows before and after it (None: of every probed row of the configuration), and
    their predictions are the model's over that speed; the model's own, at the profile's speed, and their
    errors stay in ``extra["at_profile_speed"]`` (``fwd_s``, ``fwd_bwd_s``, ``fwd_error``, ``error``). The
    terms are always at the profile's speed.
    """
    from ..cost import Problem, estimate

    cfg, env = result["config"], result["environment"]
    nodes = cfg["topology"][0] if cfg.get("topology") else 1
    topo = emulated_topology(cfg["world"], nodes, env["threads_per_rank"], env["cores"], profile)
    problem = Problem(cfg["seq"], cfg["world"], cfg["mask"], cfg["batch"], cfg["heads"], cfg["kv_heads"],
                      cfg["head_dim"], cfg["dtype"])
    probed = [(row, probe_speeds(row["extra"]["speed_probe"], problem, topo.device)) for row in result["rows"]
              if row["ok"] and row["extra"].get("speed_probe")]
    for i, (row, _) in enumerate(probed):
        near = probed if speed_window is None else probed[max(0, i - speed_window):i + speed_window + 1]
        samples = [x for _, speeds in near for x in speeds]
        row["speed"] = statistics.median(samples) if samples else float("nan")
    for row in result["rows"]:
        if not row["ok"]:
            continue
        try:
            est_fwd = estimate(row["schedule"], problem, topo, "forward")
            est_both = estimate(row["schedule"], problem, topo, "forward+backward")
        except (NotImplementedError, ValueError) as exc:
            row["extra"]["prediction"] = str(exc)
            continue
        fwd, both = est_fwd.total, est_both.total
        row["extra"]["prediction_terms"] = {"forward": est_fwd.terms(), "forward+backward": est_both.terms()}
        row["extra"]["at_profile_speed"] = {"fwd_s": fwd, "fwd_bwd_s": both, "fwd_error": (fwd - row["fwd_s"]) /
                                            row["fwd_s"], "error": (both - row["fwd_bwd_s"]) / row["fwd_bwd_s"]}
        if np.isfinite(row.get("speed", float("nan"))):
            fwd, both = fwd / row["speed"], both / row["speed"]
        row["pred_fwd_s"], row["pred_fwd_bwd_s"] = fwd, both
        row["pred_fwd_error"] = (fwd - row["fwd_s"]) / row["fwd_s"]
        row["pred_error"] = (both - row["fwd_bwd_s"]) / row["fwd_bwd_s"]
    result["prediction"] = {"topology": topo.name, **prediction_summary([result])}
    return result


def prediction_summary(results: list[dict]) -> dict:
    """Median absolute relative prediction error over every predicted row of ``results`` (forward +
    backward, and forward), with the number of rows; and, where rows were probed (:func:`probe_speeds`), the
    median absolute error of the model at the profile's speed (``median_abs_error_at_profile_speed``) and the
    range of the probed speeds (``speed``: ``[lowest, median, highest]``), else NaN and None."""
    rows = [r for res in results for r in res["rows"] if r["ok"] and np.isfinite(r["pred_error"])]
    if not rows:
        return {"rows": 0, "median_abs_error": float("nan"), "median_abs_fwd_error": float("nan"),
                "median_abs_error_at_profile_speed": float("nan"), "speed": None}
    speeds = [r["speed"] for r in rows if np.isfinite(r.get("speed", float("nan")))]
    return {"rows": len(rows), "median_abs_error": statistics.median(abs(r["pred_error"]) for r in rows),
            "median_abs_fwd_error": statistics.median(abs(r["pred_fwd_error"]) for r in rows),
            "median_abs_error_at_profile_speed": statistics.median(abs(r["extra"]["at_profile_speed"]["error"])
                                                                   for r in rows) if speeds else float("nan"),
            "speed": [min(speeds), statistics.median(speeds), max(speeds)] if speeds else None}


#: the order in which the bench table leaves out columns in a narrow terminal (1 first); the schedule,
#: fwd+bwd ms, vs 1 proc, max rel err and pred err columns are always shown
DROP_ORDER = ("wire MB/rank", "recv MB/rank", "pred fwd ms", "layout work max/mean", "TFLOP/s/rank", "peak MB/rank",
              "flex fwd ms", "fwd ms", "sent MB/rank", "hidden", "vs ring", "vs zigzag_ring", "pred fwd+bwd ms",
              "mask eff")


def render(result: dict, width: int | None = None):
    """A rich table of a :func:`run` result (with prediction columns after :func:`predict`), fitted to
    ``width`` (default: the terminal's, ``$COLUMNS``, or full width outside a terminal) by leaving out
    columns in :data:`DROP_ORDER`. A schedule that failed its check reads "failed (n)" and its whole
    error is note (n) at the head of the caption, so no error is cut short."""
    from ..output import Column, footnotes, table

    cfg, env, base = result["config"], result["environment"], result["baseline"]
    predicted = "prediction" in result
    mask = cfg["mask"] if isinstance(cfg["mask"], str) else json.dumps(cfg["mask"], separators=(",", ":"))
    where = f"P={cfg['world']}"
    if cfg.get("topology"):
        where += f" ({cfg['topology'][0]}x{cfg['topology'][1]})"
    if cfg.get("layout"):
        where += f" layout={cfg['layout']}"
    title = (f"cpattn bench: {where} S={cfg['seq']} b={cfg['batch']} h={cfg['heads']}:{cfg['kv_heads']} "
             f"d={cfg['head_dim']} {mask} {cfg['dtype']} | {env['cores']} cores, "
             f"{env['threads_per_rank']} threads/rank, torch {env['torch']}, {env['backend']}"
             + (f", {env['gpus']} GPU{'s' if env['gpus'] > 1 else ''} shared by {cfg['world']} ranks"
                if env.get("sharing") else ""))
    ok = {r["schedule"]: r for r in result["rows"] if r["ok"]}
    refs = [n for n in ("ring", "zigzag_ring") if n in ok]
    marks, notes = footnotes([f"{r['schedule']} failed: {r['note']}" if not r["ok"] else "" for r in result["rows"]])
    caption = "".join(f"{n}; " for n in notes)
    if env.get("sharing"):
        caption += f"NOTE: {env['sharing']}; "
    limit = env.get("parallel_limit")
    noisy = [r["schedule"] for r in result["rows"] if r["ok"] and r.get("noise")]
    if noisy:
        caption += (f"NOISE: {', '.join(noisy)} measured above {limit}x the one process, more than the "
                    f"{limit} {'GPU' if env.get('gpus') else 'core'}{'s' if limit > 1 else ''} the ranks run on "
                    "allow: the machine's load changed between the timings, so no ratio of this run is a "
                    "result; rerun on an idle machine, or with more --repeats; ")
    repeats = cfg.get("repeats", 1)
    caption += (f"one process ({env['threads_per_rank'] * cfg['world']} threads): "
                f"fwd {_ms(base['fwd_s'], base.get('fwd_range'))} ms, "
                f"fwd+bwd {_ms(base['fwd_bwd_s'], base.get('fwd_bwd_range'))} ms; "
                + (f"times: median (lowest-highest) over {repeats} rounds, the one process and the schedules "
                   "alternating, each round's time the median over its iterations of the slowest rank; "
                   "vs 1 proc = T(one process) / T(schedule) within each round, median (lowest-highest)"
                   if repeats > 1 else "times: median over iterations of the slowest rank")
                + (f", above {limit}x noise (the ranks' {limit} {'GPU' if env.get('gpus') else 'core'}"
                   f"{'s' if limit > 1 else ''} allow no more; on a CPU they share the one process's cores, so "
                   "about 1x is the real ceiling)" if limit else "")
                + "; TFLOP/s counts only allowed (q, k) pairs, bwd = 2.5 x fwd; vs X = T(X) / T(schedule), "
                "forward+backward; layout work max/mean = allowed pairs of the busiest rank's queries over the mean")
    caption += "; peak MB/rank = most live tensor bytes during one forward+backward (cpattn.memory)"
    caption += ("; sent/recv MB/rank = payload (cpattn.core.comm accounting); wire MB/rank = bytes the busiest rank "
                "sends on the wire, forwarding for others included, under the cost model's collective algorithms")
    masked = "causal_fwd_bwd_s" in base
    if masked:
        ratio = masks.allowed_pairs(masks.resolve(cfg["mask"]), cfg["seq"]) / (cfg["seq"] * (cfg["seq"] + 1) / 2)
        caption += (f"; mask eff = T(dense causal, one process: fwd {base['causal_fwd_s'] * 1e3:.1f} ms, fwd+bwd "
                    f"{base['causal_fwd_bwd_s'] * 1e3:.1f} ms) x allowed / causal pairs ({ratio:.3f}) / T(schedule), "
                    f"forward+backward, 1 = at the speed of the mask (one process: {base['mask_efficiency']:.2f})")
    flex = base.get("flex")
    if flex is not None:
        caption += f"; {flex_note(flex, env['threads_per_rank'] * cfg['world'])}"
    if predicted:
        caption += (f"; predicted on topology {result['prediction']['topology']!r}, "
                    "error = (predicted - measured) / measured")
        if result["prediction"].get("speed"):
            caption += ("; predictions at the machine's speed during each row (speed probe; the prediction "
                        "breakdown has the model's at the profile's speed)")
    traced = any("timeline" in r["extra"] for r in result["rows"] if r["ok"])
    if traced:
        caption += ("; hidden = share of the time transfers are in flight (issue to end of wait) during which a "
                    "kernel call runs on the same rank, one extra stamped fwd+bwd step, mean over ranks")
    headers = ["schedule", "fwd ms", *(["flex fwd ms"] if flex is not None else []), "fwd+bwd ms", "TFLOP/s/rank",
               "vs 1 proc", *(["mask eff"] if masked else []), *[f"vs {n}" for n in refs],
               *(["hidden"] if traced else []), "sent MB/rank", "wire MB/rank", "recv MB/rank", "peak MB/rank",
               "layout work max/mean", "max rel err"]
    if predicted:
        headers += ["pred fwd ms", "pred fwd+bwd ms", "pred err"]
    cols = [Column(h, "left" if h == "schedule" else "right",
                   drop=DROP_ORDER.index(h) + 1 if h in DROP_ORDER else 0) for h in headers]
    rows = []
    for r, mark in zip(result["rows"], marks):
        if not r["ok"]:
            rows.append([r["schedule"] if h == "schedule" else f"[red]failed {mark}[/red]" if h == "fwd+bwd ms"
                         else "" for h in headers])
            continue
        work = r["extra"].get("work")
        cells = [r["schedule"], _ms(r["fwd_s"], r.get("fwd_range")),
                 *([f"{flex['fwd_s'] * 1e3:.1f}" if "fwd_s" in flex else "-"] if flex is not None else []),
                 _ms(r["fwd_bwd_s"], r.get("fwd_bwd_range")), f"{r['tflops_per_rank']:.4f}", ratio_text(r),
                 *([f"{r['mask_efficiency']:.2f}"] if masked else []),
                 *[f"{ok[n]['fwd_bwd_s'] / r['fwd_bwd_s']:.2f}x" for n in refs],
                 *([fraction_text(r["extra"].get("timeline", {}).get("hidden_fraction"))] if traced else []),
                 f"{r['bytes_sent'] / 1e6:.1f}", f"{r['wire_sent'] / 1e6:.1f}", f"{r['bytes_recv'] / 1e6:.1f}",
                 f"{r['peak_mem_bytes'] / 1e6:.1f}",
                 f"{work['imbalance']:.2f}" if work else "-", f"{r['error']:.1e}"]
        if predicted:
            if np.isfinite(r["pred_error"]):
                cells += [f"{r['pred_fwd_s'] * 1e3:.1f}", f"{r['pred_fwd_bwd_s'] * 1e3:.1f}",
                          f"{r['pred_error']:+.0%}"]
            else:
                cells += ["-", "-", "not modelled"]
        rows.append(cells)
    return table(cols, rows, title=title, caption=caption, width=width,
                 everything="--json PATH has every figure")


def _finite_range(rng) -> tuple[float, float] | None:
    return tuple(rng) if rng is not None and len(rng) == 2 and all(map(math.isfinite, rng)) else None


def _ms(seconds: float, rng=None) -> str:
    """A time in ms, with the lowest and highest round when there were several."""
    rng = _finite_range(rng)
    if rng is None:
        return f"{seconds * 1e3:.1f}"
    lo, hi = (f"{x * 1e3:.0f}" if x >= 0.01 else f"{x * 1e3:.1f}" for x in rng)
    return f"{seconds * 1e3:.1f} ({lo}-{hi})"


def ratio_text(row: dict) -> str:
    """A row's T(one process) / T(schedule): the median with its range over rounds, or, when the median is
    above what the hardware allows (``row["noise"]``), only the range, marked noise: never a result."""
    rng = _finite_range(row.get("speedup_range"))
    if row.get("noise"):
        return f"noise ({rng[0]:.2f}-{rng[1]:.2f}x)" if rng else "noise"
    return f"{row['speedup']:.2f}x" + (f" ({rng[0]:.2f}-{rng[1]:.2f})" if rng else "")


def measured_kernel_s(row: dict) -> float:
    """Seconds the busiest rank spent in kernel calls during the row's stamped forward+backward step
    (``bench --timeline``), or NaN without a timeline."""
    ranks = row["extra"].get("timeline", {}).get("spans")
    if not ranks:
        return float("nan")
    return max(sum(s["t1"] - s["t0"] for s in rk["compute"]) for rk in ranks) / 1e9


def render_breakdown(result: dict, width: int | None = None):
    """The prediction's terms next to the measured forward+backward time (after :func:`predict`): per
    schedule, predicted kernels, merges, launch overheads and exposed communication (ms), their sum,
    the measured time and the error; with a timeline (``bench --timeline``), also the busiest rank's
    measured kernel time in its stamped step, to set against the predicted kernels."""
    from ..output import Column, table

    rows = [r for r in result["rows"] if r["ok"] and "prediction_terms" in r["extra"]]
    traced = any("timeline" in r["extra"] for r in rows)
    probed = any(np.isfinite(r.get("speed", float("nan"))) for r in rows)
    headers = ["schedule", "kernels", *(["meas kernels"] if traced else []), "merges", "launch", "exposed comm",
               *(["model", "model err", "speed"] if probed else []), "predicted", "measured", "pred err"]
    drop = {"launch": 1, "meas kernels": 2, "merges": 3, "model": 4}
    cols = [Column(h, "left" if h == "schedule" else "right", drop=drop.get(h, 0)) for h in headers]
    cells = []
    for r in rows:
        t = r["extra"]["prediction_terms"]["forward+backward"]
        model = r["extra"]["at_profile_speed"]
        cells.append([r["schedule"], f"{t['kernels'] * 1e3:.1f}",
                      *([f"{measured_kernel_s(r) * 1e3:.1f}"] if traced else []),
                      f"{t['merge'] * 1e3:.1f}", f"{t['launch'] * 1e3:.1f}", f"{t['exposed_comm'] * 1e3:.1f}",
                      *([f"{model['fwd_bwd_s'] * 1e3:.1f}", f"{model['error']:+.0%}", f"{r['speed']:.3f}"]
                        if probed else []),
                      f"{r['pred_fwd_bwd_s'] * 1e3:.1f}", f"{r['fwd_bwd_s'] * 1e3:.1f}", f"{r['pred_error']:+.0%}"])
    caption = ("forward+backward, ms; predicted = kernels + merges + launch + exposed comm (the cost model's terms, "
               "busiest rank per step)")
    if probed:
        caption = ("forward+backward, ms; model = kernels + merges + launch + exposed comm (the cost model's terms "
                   "at the profile's speed, busiest rank per step); speed = how fast the machine ran during the row "
                   "against the profile: the model's time for the speed probe's kernels (fwd+bwd of "
                   + " and ".join(f"{kind} {n}x{n}" for kind, n in rows[0]["extra"]["speed_probe"]["blocks"])
                   + ", every rank at once, before each timed iteration) over their measured time, median over "
                   "the samples of the row and of the rows next to it; predicted = model / speed")
    if traced:
        caption += "; meas kernels = the busiest rank's kernel calls in one stamped step"
    return table(cols, cells, title="prediction breakdown", caption=caption, width=width)


def flex_note(flex: dict, threads: int) -> str:
    """The caption's account of the FlexAttention peer: what was run, or why it was not."""
    if "fwd_s" not in flex:
        return f"flex fwd ms: not run ({flex['note']})"
    out = (f"flex fwd ms = torch FlexAttention, torch.compile (compiled in {flex['compile_s']:.1f} s), forward only, "
           f"one process, {threads} threads, mask as {flex['mask_mod']}, max rel err {flex['error']:.1e}")
    if "fwd_mask_efficiency" in flex:
        out += f", mask eff fwd {flex['fwd_mask_efficiency']:.2f}"
    return out


def save_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")


def trace_name(schedule: str, config: dict) -> str:
    """The file name of a row's Chrome trace: schedule, mask, world and sequence, then the layout,
    topology and dtype when not the defaults (a mask spec: its kind and a short hash of the spec)."""
    mask = config["mask"]
    if not isinstance(mask, str):
        spec = json.dumps(mask, sort_keys=True, separators=(",", ":"))
        mask = f"{mask.get('kind', 'mask')}-{hashlib.sha1(spec.encode()).hexdigest()[:8]}"
    parts = [schedule, mask, f"P{config['world']}", f"S{config['seq']}"]
    if config.get("layout"):
        parts.append(config["layout"])
    if config.get("topology"):
        parts.append(f"{config['topology'][0]}x{config['topology'][1]}")
    if config.get("dtype", "float32") != "float32":
        parts.append(config["dtype"])
    return "_".join(_slug(str(p)) for p in parts) + ".trace.json"


def write_traces(result: dict, directory: str) -> list[str]:
    """One Chrome trace (``cpattn.timeline.chrome_trace``) per row of ``result`` that has a timeline, into
    ``directory`` (created), named by :func:`trace_name`; each row's ``extra["timeline"]["file"]`` gets its
    path. Returns the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for row in result["rows"]:
        tl = row["extra"].get("timeline") if row["ok"] else None
        if tl is None:
            continue
        path = os.path.join(directory, trace_name(row["schedule"], result["config"]))
        meta = {"schedule": row["schedule"], "config": result["config"], "environment": result["environment"],
                "fwd_bwd_s": row["fwd_bwd_s"], "traced_step_s": tl["step_s"],
                "hidden_fraction": tl["hidden_fraction"], "hidden_min": tl["hidden_min"], "per_rank": tl["per_rank"],
                "clock": "perf_counter_ns of each rank (one host clock), zero = the earliest rank's step start"}
        with open(path, "w") as f:
            json.dump(chrome_trace(tl["spans"], meta), f)
        tl["file"] = path
        paths.append(path)
    return paths


#: at most this many per-rank timeline panels in a plot; beyond it, only the last configuration's
PLOT_TIMELINES = 6


def config_label(config: dict) -> str:
    """A configuration in a few words: ranks (and topology), sequence, mask, layout."""
    mask = config["mask"] if isinstance(config["mask"], str) else config["mask"].get("kind", "mask")
    topo = f" ({config['topology'][0]}x{config['topology'][1]})" if config.get("topology") else ""
    layout = f", layout {config['layout']}" if config.get("layout") else ""
    return f"P={config['world']}{topo}, S={config['seq']}, {mask}{layout}, {config['dtype']}"


def plot(results: dict | list[dict], path: str) -> None:
    """PNG: for every configuration of ``results`` (:func:`run` results, or one), a bar panel of the
    forward+backward efficiency (one process / schedule) per schedule, with the lowest and highest round as
    error bars and noise rows hatched, side by side on one scale; below
    them, for rows with a timeline (``run(..., timeline=True)``), a per-rank panel of its stamped step
    (``cpattn.timeline.draw``): every configuration's when there are at most :data:`PLOT_TIMELINES`,
    else the last configuration's (the title says so; ``--trace`` writes them all)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..output import schedule_style

    results = [results] if isinstance(results, dict) else list(results)
    traced = [(res, r) for res in results for r in res["rows"] if r["ok"] and r["extra"].get("timeline")]
    note = ""
    if len(traced) > PLOT_TIMELINES:
        traced = [(res, r) for res, r in traced if res is results[-1]]
        note = f"; timelines of the last configuration only ({config_label(results[-1]['config'])})"
    ncols = min(len(results), 4)
    nrows = math.ceil(len(results) / ncols)
    most = max(len([r for r in res["rows"] if r["ok"]]) for res in results)
    heights = [3.6] * nrows + [0.3 * sum(1 + len(lanes(rk["transfers"])) for rk in r["extra"]["timeline"]["spans"])
                               + 1.4 for _, r in traced]
    width = max(5.0, ncols * (0.7 * most + 1.8), 10.0 if traced else 0.0)
    height = sum(heights) + 0.6
    fig = plt.figure(figsize=(width, height))
    grid = fig.add_gridspec(len(heights), ncols, height_ratios=heights)
    first = None
    for i, res in enumerate(results):
        ax = fig.add_subplot(grid[i // ncols, i % ncols], sharey=first)
        first = first or ax
        rows = [r for r in res["rows"] if r["ok"]]
        ax.bar([r["schedule"] for r in rows], [r["speedup"] for r in rows],
               color=[schedule_style(r["schedule"])["color"] for r in rows],  # a schedule's colour in every panel
               hatch=[("//" if r.get("noise") else "") for r in rows])  # noise: hatched, the caption says why
        spans = [(i, r["speedup"], _finite_range(r.get("speedup_range"))) for i, r in enumerate(rows)]
        spans = [(i, mid, rng) for i, mid, rng in spans if rng]
        if spans:  # the lowest and highest round
            ax.errorbar([i for i, _, _ in spans], [mid for _, mid, _ in spans],
                        yerr=[[mid - rng[0] for _, mid, rng in spans], [rng[1] - mid for _, mid, rng in spans]],
                        fmt="none", ecolor="black", capsize=3, lw=0.8)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        if i % ncols == 0:
            ax.set_ylabel("T(one process) / T(schedule)")
        ax.set_title(config_label(res["config"]), fontsize=9)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    for k, (res, r) in enumerate(traced):
        tl = r["extra"]["timeline"]
        where = f" [{config_label(res['config'])}]" if len(results) > 1 else ""
        draw(fig.add_subplot(grid[nrows + k, :]), tl["spans"],
             f"{r['schedule']}{where}: one stamped fwd+bwd step ({tl['step_s'] * 1e3:.1f} ms), transfer time hidden "
             f"behind kernel calls: {fraction_text(tl['hidden_fraction'])} (mean over ranks)")
    fig.suptitle(f"cpattn bench: forward+backward efficiency against one process, {len(results)} "
                 f"configuration{'s' if len(results) > 1 else ''}{note}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / height))  # the top half inch is the title's
    fig.savefig(path, dpi=120)
    plt.close(fig)
