"""``cpattn calibrate``: measure this machine's kernels and collectives into a cost-model profile; on a CUDA
machine, one GPU's kernel rates into a GPU profile, or one derived from a ``scripts/gpu_check.py`` report."""

from __future__ import annotations

import argparse

from ..output import stderr, stdout


def add_parser(sub) -> argparse.ArgumentParser:
    c = sub.add_parser("calibrate", help="measure this machine's kernels and collectives for the cost model")
    c.add_argument("--profile", help="where to write the profile (default: $CPATTN_PROFILE or "
                                     "~/.cache/cpattn/profile.json)")
    c.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (a smoke test, not a profile "
                                                        "to rely on)")
    c.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="calibrate N times back to back, print how much they differ on every figure, and write "
                        "the median of each (default 1)")
    c.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda: one GPU at world size 1 (kernel rates on the path the dispatch takes, the merge "
                        "bandwidth) into a GPU profile; cpu: a local gloo world of CPU ranks; auto (default): cuda "
                        "when a GPU is visible")
    c.add_argument("--kernel-path", default=None, metavar="PATH",
                   help="GPU profiles: the kernel path to time or to read from the report (default: the one the "
                        "dispatch takes, cpattn.kernels.kernel_for / the measured kernel order)")
    c.add_argument("--from-gpu-check", default=None, metavar="REPORT",
                   help="derive a GPU profile from a scripts/gpu_check.py JSON report (its bench rows) instead of "
                        "measuring; memory and its bandwidth from the device's data sheet")
    c.add_argument("--date", default=None, metavar="YYYY-MM-DD",
                   help="--from-gpu-check: the day the report was measured (it does not record it)")
    c.set_defaults(func=run)
    return c


def _spread_table(spread: dict, common: dict, limit: float):
    """Every figure's smallest and largest value over the calibrations and their difference, as measured
    (``spread``) and at a common speed (``common``)."""
    from rich.table import Table

    from ..lab.machine_profile import is_rate

    t = Table(title="difference between the calibrations (rates: largest / smallest - 1)",
              caption="at a common speed: each calibration's figures over its overall speed (median kernel rate "
                      "against the first's), which is what `bench --predict`'s speed probe corrects for")
    for col in ("figure", "smallest", "largest", "difference", "at a common speed"):
        t.add_column(col, justify="left" if col == "figure" else "right")

    def text(name: str, diff: float) -> str:
        cell = f"{diff * 1e6:.1f} us" if name.endswith(" latency") else f"{diff * 100:.0f} points" \
            if name == "overlap" else f"{diff:.1%}"
        return f"[red]{cell}[/red]" if is_rate(name) and diff > limit else cell

    for name, (lo, hi, diff) in spread.items():
        if name.endswith(" latency"):
            cells = (f"{lo * 1e6:.1f} us", f"{hi * 1e6:.1f} us")
        elif name == "overlap":
            cells = (f"{lo:.0%}", f"{hi:.0%}")
        else:
            cells = (f"{lo / 1e9:.3g}", f"{hi / 1e9:.3g}")
        t.add_row(name, *cells, text(name, diff), text(name, common[name][2]) if name in common else "-")
    return t


def _print_spread(out, profiles: list) -> None:
    """How much ``profiles`` (calibrations of one machine) differ on every figure, as measured and at a
    common speed, and each one's overall speed."""
    from ..lab import machine_profile

    spread = machine_profile.spread(profiles)
    speeds = machine_profile.levels(profiles)
    common = machine_profile.spread([machine_profile.at_speed(p, 1.0 / v)
                                     for p, v in zip(profiles, speeds, strict=True)])
    limit = 0.05
    out.print(_spread_table(spread, common, limit))
    for label, figures in (("", spread), (" at a common speed", common)):
        diffs = [(d, name) for name, (_, _, d) in figures.items() if machine_profile.is_rate(name)]
        if diffs:
            worst = max(diffs)
            out.print(f"largest difference between the calibrations{label}: {worst[0]:.1%} ({worst[1]}); "
                      f"{sum(d > limit for d, _ in diffs)} of {len(diffs)} rates differ by more than {limit:.0%}")
    out.print("overall speed of each calibration against the first (median kernel rate): "
              + ", ".join(f"{v:.3f}" for v in speeds))


def _gpu_profiles(args) -> list:
    """The GPU profiles ``--from-gpu-check`` or ``--device cuda`` asks for (``--repeat`` of them when
    measured)."""
    import json

    from ..cost import presets, profile

    if args.from_gpu_check:
        if args.date is None:
            raise ValueError("--from-gpu-check needs --date YYYY-MM-DD: the report does not record when it ran")
        with open(args.from_gpu_check) as f:
            report = json.load(f)
        env = report.get("env", {}) if isinstance(report, dict) else {}
        model = presets.gpu_model(str(env.get("device", "")))
        if model is None or model.model not in presets.DATA_SHEETS:
            raise ValueError(f"{args.from_gpu_check}: no data sheet is known for device {env.get('device')!r} "
                             f"(known: {', '.join(presets.DATA_SHEETS)}); its memory and bandwidth are needed")
        memory, bandwidth, source = presets.DATA_SHEETS[model.model]
        path = args.kernel_path or _report_path(env)
        return [profile.from_gpu_check(report, path, measured=args.date, memory=memory, memory_bandwidth=bandwidth,
                                       figures_source=source, source=args.from_gpu_check)]
    if not _cuda_visible():
        raise ValueError("--device cuda: no CUDA device is visible to torch here; calibrate the CPU ranks with "
                         "--device cpu, or derive a GPU profile from a report with --from-gpu-check")
    if args.date is not None:
        raise ValueError("--date dates a --from-gpu-check report; a measurement is dated when it runs")
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ..lab import machine_profile

    settings = machine_profile.GPU_QUICK if args.quick else machine_profile.GpuSettings()
    if args.kernel_path:
        from dataclasses import replace

        settings = replace(settings, path=args.kernel_path)
    profiles = []
    with Progress(TextColumn("calibrate: {task.description}"), BarColumn(), TimeElapsedColumn(), console=stderr(),
                  transient=True) as progress:
        for _ in range(args.repeat):
            task = progress.add_task("GPU", total=None)

            def update(what: str, done: int, total: int, task=task) -> None:
                progress.update(task, description=what, completed=done, total=total)

            profiles.append(machine_profile.calibrate_gpu(settings, "cuda", progress=update))
    return profiles


def _report_path(env: dict) -> str:
    """The dense kernel path the dispatch takes on the report's GPU (``kernels.choose_kernel`` for its
    capability and the paths it had, at the bench's bfloat16 and head dim 128)."""
    import torch

    from ..core import kernels
    from ..core.masks import BlockKind

    cap = env.get("capability")
    capability = tuple(cap) if isinstance(cap, list) and len(cap) == 2 else None
    available = frozenset(env.get("available", kernels.PATHS))
    return kernels.choose_kernel("cuda", torch.bfloat16, 128, BlockKind.FULL, available, capability=capability)


def _print_gpu(out, prof) -> None:
    from rich.table import Table

    gpu = prof.gpu
    out.print(f"{gpu.device} (compute capability {gpu.capability[0]}.{gpu.capability[1]}), measured {gpu.measured}; "
              + ", ".join(f"{k} {v}" for k, v in gpu.software.items()), highlight=False)
    t = Table(title="kernel throughput, TFLOP/s (extrapolated: blocks of sides not measured)")
    for col in ("kind", "path", "block", "forward", "backward", "measured"):
        t.add_column(col, justify="left" if col in ("kind", "path", "measured") else "right")
    rates = {(p.kind, p.q_len, p.phase): p.flop_per_s for p in prof.kernels}
    for kind, n in sorted({(p.kind, p.q_len) for p in prof.kernels}):
        t.add_row(kind, gpu.paths.get(kind, "-"), f"{n}x{n}",
                  *(f"{rates.get((kind, n, ph), float('nan')) / 1e12:.1f}" for ph in ("forward", "backward")),
                  "yes" if n in gpu.measured_tokens else "extrapolated")
    out.print(t)
    out.print(f"epilogue memory bandwidth {prof.memory_bandwidth / 1e9:.0f} GB/s; memory {prof.memory / 1e9:.1f} GB")
    out.print(gpu.note, highlight=False)


def run(args) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from ..cost import profile
    from ..lab import machine_profile

    if args.repeat < 1:
        raise SystemExit(f"cpattn calibrate: --repeat must be at least 1, got {args.repeat}")
    if args.from_gpu_check or args.device == "cuda" or (args.device == "auto" and _cuda_visible()):
        profiles = _gpu_profiles(args)
        prof = machine_profile.combine(profiles) if len(profiles) > 1 else profiles[0]
        path = profile.save(prof, args.profile)
        out = stdout()
        _print_gpu(out, prof)
        if len(profiles) > 1:
            _print_spread(out, profiles)
        out.print(f"wrote {path}")
        return 0
    settings = machine_profile.QUICK if args.quick else machine_profile.Settings()
    profiles, warnings = [], []
    with Progress(TextColumn("calibrate: {task.description}"), BarColumn(), TimeElapsedColumn(), console=stderr(),
                  transient=True) as progress:
        for n in range(args.repeat):
            task = progress.add_task("starting a local world", total=None)
            where = f"{n + 1}/{args.repeat} " if args.repeat > 1 else ""

            def update(what: str, done: int, total: int, task=task, where=where) -> None:
                progress.update(task, description=where + what, completed=done, total=total)

            watch = machine_profile.Interference()
            profiles.append(machine_profile.calibrate(settings, progress=update, interference=watch))
            if watch.warning():
                warnings.append(f"calibration {n + 1}: {watch.warning()}" if args.repeat > 1 else watch.warning())
    prof = machine_profile.combine(profiles) if len(profiles) > 1 else profiles[0]
    path = profile.save(prof, args.profile)
    out, err = stdout(), stderr()
    out.print(f"{prof.ranks} ranks x {prof.threads_per_rank} threads on {prof.cores} cores; kernel shape "
              f"{prof.host.get('kernel_shape', '')}; other processes took "
              + ", ".join(f"{float(p.host.get('interference', 'nan')):.0%}" for p in profiles)
              + " of the cores while it measured (load average at the start "
              + ", ".join(p.host.get("load_before", "?") for p in profiles) + ")")
    for n, p in enumerate(profiles):
        speeds = [float(x) for x in p.host.get("pass_speed", "").split()]
        if speeds:
            out.print(("" if len(profiles) == 1 else f"calibration {n + 1}: ")
                      + f"the machine's speed from pass to pass ranged {min(speeds):.2f}-{max(speeds):.2f} of the "
                      f"calibration's median over {len(speeds)} passes (drift on this scale moves any two "
                      "calibrations, and any two runs, apart)")
    t = Table(title="kernel throughput, GFLOP/s per rank" + (" (median of the calibrations)" if len(profiles) > 1
                                                               else ""))
    for col in ("kind", "block", "forward", "backward"):
        t.add_column(col, justify="left" if col == "kind" else "right")
    rates = {(p.kind, p.q_len, p.phase): p.flop_per_s for p in prof.kernels}
    for kind, n in sorted({(p.kind, p.q_len) for p in prof.kernels}):
        t.add_row(kind, f"{n}x{n}", *(f"{rates.get((kind, n, ph), float('nan')) / 1e9:.1f}"
                                      for ph in ("forward", "backward")))
    out.print(t)
    t = Table(title="communication (fitted to each op's cost formula)")
    for col in ("op", "latency us", "bandwidth GB/s"):
        t.add_column(col, justify="left" if col == "op" else "right")
    for op, link in prof.links.items():
        t.add_row(op, f"{link.latency * 1e6:.1f}", f"{link.bandwidth / 1e9:.3f}")
    out.print(t)
    out.print(f"epilogue memory bandwidth {prof.memory_bandwidth / 1e9:.1f} GB/s; a transfer hides "
              f"{prof.overlap:.0%} behind a concurrent kernel")
    if len(profiles) > 1:
        _print_spread(out, profiles)
    for w in warnings:
        err.print(f"[yellow]warning:[/yellow] {w}")
    out.print(f"wrote {path}")
    return 0


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()
