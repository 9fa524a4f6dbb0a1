"""``cpattn simulate``: predict every schedule on a topology at many GPU counts (the cost model)."""

from __future__ import annotations

import argparse

from . import args as a
from .output import stderr, stdout

DEFAULT_GPUS = [8, 64, 512, 4096]


def add_parser(sub) -> argparse.ArgumentParser:
    m = sub.add_parser("simulate", help="predict every schedule on a topology preset at many GPU counts")
    m.add_argument("--topology", type=a.topology(), default="frontier",
                   help="frontier, dgx-h100, dgx-a100 or local (default frontier), or NxD (generic figures, "
                        "implies --gpus)")
    m.add_argument("--gpus", type=a.csv(int), default=None,
                   help="comma-separated GPU counts (default 8,64,512,4096, or the devices of an NxD topology)")
    m.add_argument("--seq", type=int, default=None, help="global sequence length (strong scaling)")
    m.add_argument("--seq-per-gpu", type=int, default=None, help="tokens per GPU (weak scaling)")
    m.add_argument("--mask", type=a.mask, default="causal",
                   help='causal, full, or a mask spec (cpattn.masks.from_spec) as JSON, e.g. '
                        '\'{"kind": "star", "block_size": 2048, "sink": 1}\'')
    m.add_argument("--batch", type=int, default=1)
    m.add_argument("--heads", type=int, default=32)
    m.add_argument("--kv-heads", type=int, default=8)
    m.add_argument("--head-dim", type=int, default=128)
    m.add_argument("--dtype", default="bfloat16", choices=a.dtypes())
    m.add_argument("--phase", default="forward+backward", choices=["forward", "backward", "forward+backward"])
    m.add_argument("--schedules", type=a.csv(str), default=None,
                   help="comma-separated (default: all registered; ultra only for masks other than causal and full)")
    m.add_argument("--profile", help="calibration profile for --topology local")
    m.add_argument("--json", help="also write the rows as JSON to this path")
    m.add_argument("--plot", default="simulate.png", help="scaling plot PNG (default simulate.png; '' for none)")
    m.set_defaults(func=run)
    return m


def run(args) -> int:
    import json

    from rich.progress import Progress
    from rich.table import Table

    from .. import cost, schedules
    from ..masks import resolve
    from ..steps import split_phase

    if (args.seq is None) == (args.seq_per_gpu is None):
        raise ValueError("give exactly one of --seq (global tokens) and --seq-per-gpu (tokens per GPU)")
    gpus = a.device_counts(args.topology, args.gpus, DEFAULT_GPUS, "--gpus")
    mask = resolve(args.mask)
    names, skipped, unmodelled = [], [], []
    candidates = args.schedules or cost.default_candidates(mask)
    unplanned = [] if args.schedules else [n for n in schedules.names() if n not in candidates]
    for name in candidates:
        try:
            schedules.get(name).check_mask(mask)
        except (ValueError, NotImplementedError):
            skipped.append(name)
            continue
        (names if cost.estimable(name) else unmodelled).append(name)
    prof = a.load_profile(args.profile) if args.topology.preset == "local" else None
    rows, bounds = [], {}
    with Progress(console=stderr(), transient=True) as progress:
        task = progress.add_task("simulate", total=len(gpus) * len(names))
        for p in gpus:
            topo = args.topology.build(p, prof)
            seq = args.seq if args.seq is not None else args.seq_per_gpu * p
            try:
                problem = cost.Problem(seq, p, mask, args.batch, args.heads, args.kv_heads, args.head_dim, args.dtype)
            except ValueError as exc:
                rows += [{"gpus": p, "seq": seq, "schedule": n, "estimate": None, "note": str(exc)} for n in names]
                progress.advance(task, len(names))
                continue
            dev = topo.device  # the bound: every rank does 1/P of the work at the large-block rates
            bounds[p] = sum(problem.flops(ph) / p / (dev.forward_flops if ph == "forward" else dev.backward_flops)
                            for ph in split_phase(args.phase))
            for name in names:
                progress.update(task, description=f"P={p} {name}")
                rows.append(_row(name, problem, topo, args.phase))
                progress.advance(task)
    t = Table(title=f"cpattn simulate: {args.topology}, {mask!r}, h={args.heads}:{args.kv_heads} d={args.head_dim} "
                    f"b={args.batch} {args.dtype}, {args.phase}",
              caption="times on the busiest rank; TFLOP/s counts allowed (q, k) pairs (bwd = 2.5 x fwd); "
                      "vs ring = T(ring) / T(schedule)")
    for col in ("GPUs", "seq", "schedule", "total ms", "compute ms", "comm ms", "exposed ms", "TFLOP/s/GPU",
                "vs ring", "sent MB/GPU", "peak GiB/GPU", "note"):
        t.add_column(col, justify="left" if col in ("schedule", "note") else "right")
    ring = {r["gpus"]: r["estimate"] for r in rows if r["schedule"] == "ring" and r["estimate"] is not None}
    for r in rows:
        e = r["estimate"]
        if e is None:
            t.add_row(str(r["gpus"]), str(r["seq"]), r["schedule"], *[""] * 8, f"[dim]{r['note']}[/dim]")
            continue
        vs = f"{ring[r['gpus']].total / e.total:.2f}x" if r["gpus"] in ring else "-"
        t.add_row(str(r["gpus"]), str(r["seq"]), r["schedule"], f"{e.total * 1e3:.4g}", f"{e.compute * 1e3:.4g}",
                  f"{e.comm * 1e3:.4g}", f"{e.exposed_comm * 1e3:.4g}", f"{e.tflops_per_rank(r['gpus']):.3g}", vs,
                  f"{e.bytes_per_rank / 1e6:.4g}", f"{e.peak_memory / 2**30:.3g}", r["note"])
    out = stdout()
    out.print(t)
    if bounds:
        out.print("balanced bound (every GPU does 1/P of the work at the device's large-block rate, no "
                  "communication): " + ", ".join(f"P={p}: {b * 1e3:.4g} ms" for p, b in bounds.items()))
    if skipped:
        out.print(f"not shown, they cannot run the {mask.name} mask: {', '.join(skipped)}")
    if unmodelled:
        out.print(f"not modelled (they do not implement steps(problem, phase)): {', '.join(unmodelled)}")
    if unplanned:
        out.print(f"not planned for the {mask.name} mask unless named in --schedules (planning takes seconds "
                  f"per size): {', '.join(unplanned)}")
    if args.json:
        from dataclasses import asdict

        with open(args.json, "w") as f:
            json.dump([{**r, "estimate": asdict(r["estimate"]) if r["estimate"] else None} for r in rows], f,
                      indent=2)
        stderr().print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args, mask.name, args.plot)
        stderr().print(f"wrote {args.plot}")
    return 0


def _row(name: str, problem, topo, phase: str) -> dict:
    """One table row: the estimate, a note when it exceeds the device memory, or why there is none.
    ``check_supports`` refuses with ValueError, TypeError or NotImplementedError (its contract);
    ``estimate`` with ValueError or NotImplementedError. Anything else is a bug and propagates."""
    from .. import cost

    row = {"gpus": problem.world, "seq": problem.seq_len, "schedule": name, "estimate": None, "note": ""}
    try:
        cost.check_supports(name, problem)
    except (ValueError, TypeError, NotImplementedError) as exc:
        row["note"] = str(exc)
        return row
    try:
        est = cost.estimate(name, problem, topo, phase)
    except (ValueError, NotImplementedError) as exc:
        row["note"] = str(exc)
        return row
    row["estimate"] = est
    if est.peak_memory > topo.device.memory:
        row["note"] = f"exceeds {topo.device.memory / 2**30:.0f} GiB"
    return row


def plot(rows: list[dict], args, mask_label: str, path: str) -> None:
    """PNG: predicted time and TFLOP/s per GPU versus GPUs, one line per schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(r["schedule"] for r in rows):
        pts = [(r["gpus"], r["estimate"]) for r in rows if r["schedule"] == name and r["estimate"] is not None]
        if not pts:
            continue
        gpus = [g for g, _ in pts]
        ax_t.plot(gpus, [e.total for _, e in pts], marker="o", label=name)
        ax_f.plot(gpus, [e.tflops_per_rank(g) for g, e in pts], marker="o", label=name)
    scaling = f"{args.seq} tokens" if args.seq is not None else f"{args.seq_per_gpu} tokens per GPU"
    for ax, label in ((ax_t, "predicted time (s)"), (ax_f, "attention TFLOP/s per GPU")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    ax_f.legend(fontsize=8)
    fig.suptitle(f"{args.topology}: {mask_label}, {scaling}, h={args.heads}:{args.kv_heads} d={args.head_dim}, "
                 f"{args.phase}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
