"""A new user's first hour: the docs' CPU commands run as written (at small sizes), every mistake gets one
line and the right exit status, tables fit the terminal, plots tell their lines and configurations
apart and ``[b, h, s, d]`` tensors go in with ``qkv_format="bhsd"``. (The README's commands:
tests/test_cli.py; clean exits, a failing script's included: tests/test_clean_exit.py.)"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from test_bench import _synthetic
from test_cli import _slow, shrink

import cpattn
from cpattn import bench, cli, output, schedules

ROOT = Path(__file__).resolve().parents[1]
#: the comment that marks a docs code block whose ``cpattn`` commands run on the CPU
CPU_MARK = re.compile(r"^<!-- runs on the CPU\b[^\n]*-->\n```[^\n]*\n(.*?)^```", re.S | re.M)


# ------------------------------------------------------------------------------ the docs' CPU commands
def docs_commands() -> list[tuple[str, list[str]]]:
    """``(docs file, argv)`` of every ``cpattn`` command in a docs code block marked as runnable on the
    CPU (continued lines joined, comments dropped); optional ``[...]`` parts are not used in docs blocks."""
    out = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for block in CPU_MARK.findall(path.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                if re.match(r"\s*cpattn\s", line):
                    out.append((path.name, shlex.split(line, comments=True)))
    return out


DOCS = docs_commands()


def _docs_param(name: str, argv: list[str]):
    # a bench starts process worlds per configuration and verify one per world size: slow, like calibrate;
    # the cost model walks a block-sparse mask's blocks per rank pair: a minute at 64 GPUs on two cores
    sparse = argv[1] == "simulate" and any(a.startswith("{") for a in argv)
    slow = _slow(argv) or argv[1] in ("bench", "verify") or sparse
    return pytest.param(argv, marks=pytest.mark.slow if slow else (), id=f"{name}: {shlex.join(argv[1:])}")


def test_the_docs_mark_commands_runnable_on_the_cpu():
    files = {name for name, _ in DOCS}
    assert {"bench.md", "costmodel.md", "testing.md"} <= files
    assert {argv[1] for _, argv in DOCS} >= {"bench", "simulate", "reproduce", "verify"}


KEY = {"bench": r"cpattn bench: P=\d", "verify": r"\d+ passed, 0 failed", "simulate": r"cpattn simulate: ",
       "reproduce": r"RingX on frontier|UltraAttn on dgx-h100"}


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in ``tmp_path`` with a private profile and plan cache, outside a terminal, without $COLUMNS."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CPATTN_PROFILE", str(tmp_path / "profile.json"))
    monkeypatch.setenv("CPATTN_CACHE_DIR", str(tmp_path / "plans"))
    monkeypatch.delenv("COLUMNS", raising=False)
    return tmp_path


def shrink_docs(argv: list[str]) -> list[str]:
    """:func:`test_cli.shrink`, and a simulation of a mask other than causal or full at 16K tokens, its
    blocks scaled alike (the cost model walks such a mask's blocks for every schedule)."""
    small = shrink(argv)
    if small[0] != "simulate" or "--mask" not in small or not small[small.index("--mask") + 1].startswith("{") \
            or "--seq" not in small:
        return small
    seq = small.index("--seq") + 1
    spec = json.loads(small[small.index("--mask") + 1])
    if "block_size" in spec:
        spec["block_size"] = max(1, spec["block_size"] * 16384 // int(small[seq]))
    small[seq], small[small.index("--mask") + 1] = "16384", json.dumps(spec)
    return small


@pytest.mark.parametrize("argv", [_docs_param(name, argv) for name, argv in DOCS])
def test_docs_command_runs(argv, in_tmp, capsys):
    small = shrink_docs(argv)
    rc = cli.main(small)
    out = capsys.readouterr()
    assert rc == 0, f"cpattn {shlex.join(small)} -> {rc}\n{out.out[-3000:]}\n{out.err[-3000:]}"
    assert re.search(KEY[small[0]], out.out), f"cpattn {shlex.join(small)}: no {KEY[small[0]]!r} in\n{out.out[:2000]}"


# ------------------------------------------------------------------------------ mistakes: one line each
@pytest.mark.parametrize("argv, message", [
    (["bench", "--world", "0"], r"argument --world/-P: expected a positive integer, got 0"),
    (["bench", "--world", "-1"], r"argument --world/-P: expected a positive integer, got -1"),
    (["verify", "--world", "0"], r"argument --world: expected a positive integer, got 0"),
    (["bench", "--seq", "1024", "--mask", "causal", "--schedules", "ringx1o"],
     r"no schedule asked for can run the causal mask \(ringx1o: bidirectional-only\); `cpattn schedules`"),
    (["simulate", "--mask", "causal,full", "--seq", "4096"], r"this command takes one mask"),
    (["plan", "--topology", "3"], r"expected a preset .* or NODESxDEVICES"),
    (["schedules", "--json"], r"argument --json: expected one argument"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_a_command_line_mistake_is_one_line_and_status_2(argv, message, capsys):
    """Refused before any process starts: status 2, one error line (after argparse's usage line), no
    traceback."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if "error" in ln]
    assert len(errors) == 1 and re.search(message, errors[0]), err
    assert "Traceback" not in err


@pytest.mark.slow  # the README's bench command (tests/test_cli.py) shows a skipped schedule in make test
def test_bench_runs_the_schedules_that_can_and_lists_what_it_skipped(in_tmp, capsys):
    """The issue's first mistake at a tiny size: ringx1o cannot run causal; ring runs, status 0."""
    rc = cli.main(["bench", "--seq", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--iters", "1",
                   "--warmup", "0", "--mask", "causal", "--schedules", "ring,ringx1o", "--json", "b.json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "not run for the causal mask: ringx1o (bidirectional-only) (`cpattn schedules` lists what each runs)" \
        in " ".join(out.err.split())
    assert [r["schedule"] for r in json.loads((in_tmp / "b.json").read_text())["rows"]] == ["ring"]


def test_a_heads_first_tensor_is_named_and_qkv_format_takes_it():
    """World size 1 (no process group): a [b, h, s, d] tensor where [b, s, h, d] is expected names both
    layouts and the two ways out; the same tensors with qkv_format="bhsd" give the result of the
    transposed call; a bad format is one line naming what is accepted."""
    cp = cpattn.ContextParallel(seq_len=32, mask="causal", schedule="ring")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 32, 8, generator=gen) for h in (4, 2, 2))
    with pytest.raises(ValueError, match=r"it looks like \[batch, heads, seq, head_dim\]: cpattn takes \[batch, seq, "
                                         r"heads, head_dim\], so pass q.transpose\(1, 2\), or .*qkv_format='bhsd'"):
        cp.attention(q, k, v)
    out = cp.attention(q, k, v, qkv_format="bhsd")
    assert out.shape == q.shape
    assert torch.equal(out, cp.attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2))
    with pytest.raises(ValueError, match=r"it looks like \[batch, seq, heads, head_dim\]: leave out qkv_format"):
        cp.attention(*(t.transpose(1, 2) for t in (q, k, v)), qkv_format="bhsd")
    with pytest.raises(ValueError, match=r"qkv_format='sbhd' is unknown; accepted: 'bshd'"):
        cp.attention(q, k, v, qkv_format="sbhd")


def test_qkv_format_bhsd_is_exact_on_two_ranks(worlds):
    """[b, h, s, d] inputs on zigzag_ring with GQA, forward and backward, against float64; the same bits
    as the [b, s, h, d] call; a whole-sequence tensor is told to use cp.shard(..., dim=2)."""
    results = worlds.get(2).run("first_hour_workers.heads_first", timeout=240, seed=11)
    for res in results:
        assert res["world"] == 2 and res["same_as_bshd"], res
        assert res["shapes"] == ((2, 8, res["local_len"], 16), (2, 8, res["local_len"])), res
        for key, err in res["errors"].items():
            assert err <= 2 * res["local"][key] + 1e-6, (key, res)
        assert "[batch, heads, seq, head_dim] (qkv_format='bhsd')" in res["message"]
        assert "cp.shard(q_full, dim=2)" in res["message"]
    assert results[0]["message"] == results[1]["message"]  # the same error on every rank


# ------------------------------------------------------------------------------ cpattn schedules
def test_schedules_say_which_masks_each_runs_as_its_check_does(capsys, monkeypatch):
    """The masks column agrees with what each schedule's check accepts (no "any" beside causal False)."""
    from cpattn.cli.schedules import runs
    from cpattn.core.masks import causal, full

    monkeypatch.delenv("COLUMNS", raising=False)

    def accepts(name, mask) -> bool:
        try:
            schedules.get(name).check_mask(mask)
        except (ValueError, NotImplementedError):
            return False
        return True

    expect = {(True, True): "every mask", (True, False): "causal masks only", (False, True): "bidirectional masks only"}
    rows = schedules.available()
    for row in rows:
        assert runs(row) == expect[accepts(row["name"], causal()), accepts(row["name"], full())], row
    assert cli.main(["schedules"]) == 0
    out = capsys.readouterr().out
    assert "masks it runs" in out and "causal masks only" in out and "bidirectional masks only" in out
    assert "│ any " not in out and "bidirectional ┃" not in out  # no "any" cells, no separate causal columns


def test_json_to_stdout_replaces_the_table(capsys):
    assert cli.main(["schedules", "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in rows} == set(schedules.names()) and all("runs" in r for r in rows)


# ------------------------------------------------------------------------------ tables that fit
def test_the_bench_table_fits_100_columns_and_names_what_it_left_out(monkeypatch):
    flex = {"fwd_s": 0.03, "compile_s": 12.0, "mask_mod": "arithmetic", "error": 2e-7, "fwd_mask_efficiency": 0.9}
    result = _synthetic(predicted=True, masked=True, flex=flex)
    monkeypatch.setenv("COLUMNS", "100")
    t = bench.render(result)
    headers = [c.header for c in t.columns]
    for kept in ("schedule", "fwd+bwd ms", "vs 1 proc", "max rel err", "pred err"):
        assert kept in headers
    every = [c.header for c in bench.render(result, width=10_000).columns]
    left_out = [h for h in every if h not in headers]
    droppable = [h for h in bench.DROP_ORDER if h in every]
    assert left_out and set(left_out) == set(droppable[:len(left_out)])  # in the stated order
    assert str(t.caption).startswith(f"not shown at 100 columns: {', '.join(left_out)} (COLUMNS=")
    console = output.stdout()
    with console.capture() as cap:
        console.print(t)
    text = cap.get()
    assert max(map(len, text.splitlines())) <= 100
    words = " ".join(text.split())
    for name in ("ring", "zigzag_ring", "wrong_one", "allgather"):  # names are never cut
        assert re.search(rf"\b{name}\b", words)
    assert "WRONG: relative error 3.00e-01 vs one process" in words  # the error, whole, in the caption
    monkeypatch.delenv("COLUMNS")
    assert [c.header for c in bench.render(result).columns] == every  # no terminal: every column


def test_a_narrow_table_wraps_at_spaces_and_never_cuts_a_word():
    note = "ulysses splits the 32 query heads over a Ulysses degree of 64: heads must be divisible by it"
    cols = [output.Column("name", "left"), output.Column("value"),
            output.Column("note", "left", wrap=True, min_width=12), output.Column("extra", drop=1)]
    t = output.table(cols, [["zigzag_ring", "1.5e+04", note, "12345"]], width=40)
    assert [c.header for c in t.columns] == ["name", "value", "note"] and "extra" in str(t.caption)
    console = output.stdout()
    console.width = 40
    with console.capture() as cap:
        console.print(t)
    text = cap.get()
    assert max(map(len, text.splitlines())) <= 40
    cells = " ".join(re.sub(r"[│┃┏┓┗┛┡┩└┘━─╇┳┻╈┼╋┬┴├┤┣┫]", " ", text).split())
    for word in note.split() + ["zigzag_ring", "1.5e+04"]:
        assert re.search(rf"(^|\s){re.escape(word)}(\s|$)", cells), word


def test_line_styles_are_distinct():
    styles = [tuple(output.line_style(i).values()) for i in range(110)]
    assert len(set(styles)) == 110
    assert len({(s["color"], s["marker"]) for s in map(output.schedule_style, schedules.names())}) == \
        len(schedules.names())


@pytest.fixture
def figures(monkeypatch):
    """The matplotlib figures saved while the test runs (still written to their files)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    saved, real = [], Figure.savefig

    def keep(self, *args, **kwargs):
        saved.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def test_simulate_fits_100_columns_with_notes_below_and_plots_every_line_alike_to_none(in_tmp, capsys, figures,
                                                                                       monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert cli.main(["simulate", "--topology", "frontier", "--gpus", "8,64", "--seq", "65536", "--plot", "s.png"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 100
    lines = out.splitlines()
    ulysses = [ln for ln in lines if re.search(r"│\s+64 │.*│ ulysses ", ln)]
    assert len(ulysses) == 1 and ulysses[0].rstrip(" │").endswith("(1)")  # the note is a footnote ...
    assert sum(ln.startswith("(1) ulysses splits the 32 query heads") for ln in lines) == 1  # ... printed once
    assert "not shown at 100 columns:" in out
    (fig,) = figures
    drawn = fig.axes[0].get_lines()
    assert len(drawn) >= 11
    looks = {(ln.get_color(), ln.get_marker(), ln.get_linestyle()) for ln in drawn}
    assert len(looks) == len(drawn), "two schedules share a colour, marker and dash pattern"


def test_bench_plot_draws_one_panel_per_configuration(tmp_path, figures):
    causal, full = _synthetic(), _synthetic()
    full["config"] = {**full["config"], "mask": "full"}
    bench.plot([causal, full], str(tmp_path / "b.png"))
    (fig,) = figures
    titled = {ax.get_title() for ax in fig.axes if ax.patches}
    assert titled == {bench.config_label(causal["config"]), bench.config_label(full["config"])}


def test_plan_heatmap_ticks_whole_cells_and_ranks(in_tmp, figures):
    assert cli.main(["plan", "--topology", "2x2", "--seq", "1024", "--heads", "4", "--kv-heads", "2", "--head-dim",
                     "16", "--mask", '{"kind": "strided", "block_size": 64, "stride": 3}', "--no-solver",
                     "--no-cache", "--heatmap", "h.png", "--timeline", ""]) == 0
    (fig,) = figures
    cells, bar = fig.axes[:2], fig.axes[-1]
    for axis in [ax.xaxis for ax in cells] + [ax.yaxis for ax in cells] + [bar.yaxis]:
        low, high = sorted(axis.get_view_interval())
        ticks = [t for t in axis.get_majorticklocs() if low <= t <= high]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_reproduce_says_gib_in_table_and_plot(in_tmp, capsys, figures):
    assert cli.main(["reproduce", "ringx", "--gcds", "8,16", "--batch", "32", "--tokens-per-gcd", "1024", "--plot",
                     "r.png"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    (fig,) = figures
    title = fig._suptitle.get_text()
    assert "64 GiB of a GCD" in out and "64 GiB of a GCD" in title
    assert not re.search(r"\bGB\b(?!/s)", title + out)  # GB only in bandwidths (GB/s)
