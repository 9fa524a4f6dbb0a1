"""The command line: every command the README and docs/commands.md show parses and runs (at small sizes),
and the shared argument handling (topologies that imply device counts, masks, usage errors versus bugs)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cpattn import cli
from cpattn.cli import args as cli_args

README = Path(__file__).resolve().parents[1] / "README.md"
#: the guide to every command: its commands run here too
COMMANDS_DOC = README.parent / "docs" / "commands.md"


# ------------------------------------------------------------------------------ the README's commands
def readme_commands(*paths: Path) -> list[list[str]]:
    """Every command line the files show (default: README.md): code spans starting with ``cpattn`` (in
    prose or in a code block's comments) and code-block lines starting with ``cpattn``; optional parts in
    ``[...]`` are taken in full. Each as its argv, in order, without repeats."""
    text = "\n".join(path.read_text() for path in paths or (README,))
    fenced = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```[^\n]*$", flags=re.S | re.M)  # indented in lists too
    lines = []
    for block in fenced.findall(text):
        lines += [ln.strip() for ln in block.splitlines() if re.match(r"\s*\$?\s*cpattn(\s|$)", ln)]
        lines += [span for span in re.findall(r"`([^`]+)`", block) if re.match(r"cpattn(\s|$)", span)]
    prose = fenced.sub("", text)
    lines += [span for span in re.findall(r"`([^`]+)`", prose) if re.match(r"cpattn(\s|$)", span)]
    out: list[list[str]] = []
    for line in lines:
        argv = shlex.split(" ".join(line.lstrip("$ ").split()), comments=True)
        if any(tok.startswith("[-") for tok in argv):  # "cpattn bench [--world 2,4 ... --plot out.png]"
            argv = [tok[1:] if tok.startswith("[-") else tok for tok in argv]
            argv[-1] = argv[-1].removesuffix("]")
        if argv not in out:
            out.append(argv)
    return out


COMMANDS = readme_commands(README, COMMANDS_DOC)


def _flags(argv: list[str]) -> list[tuple[str, str | None]]:
    """``[(flag, value or None)]`` of a command's options, in order (values never start with '--')."""
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        assert tok.startswith("-"), f"unexpected token {tok!r} in {argv}"
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        out.append((tok, value))
        i += 1 if value is None else 2
    return out


def _first(value: str) -> str:
    return value.split(",")[0]


def _last(value: str) -> str:
    return value.split(",")[-1]


def _last_mask(value: str) -> str:
    """The last of ``--mask``'s names; a JSON spec (whose commas separate its fields) as it is."""
    return value if value.lstrip().startswith(("{", "[")) else _last(value)


# How each command shrinks: an option -> a function of its README value (None: drop the option), and the
# options added when the README command leaves them out. Sizes become tiny; every list option runs one
# value, so a command starts at most one or two small process worlds.
SHRINK = {
    "bench": ({"--world": lambda v: "2", "--seq": lambda v: "256", "--mask": _last_mask, "--layout": _last,
               "--iters": lambda v: "1", "--warmup": lambda v: "0"},
              {"--seq": "256", "--heads": "2", "--kv-heads": "1", "--head-dim": "16", "--iters": "1",
               "--warmup": "0", "--schedules": "ring,zigzag_ring", "--repeats": "2"}),
    "verify": ({"--world": lambda v: "2", "--schedules": _first},
               {"--world": "2", "--schedules": "ring", "--masks": "causal", "--dtypes": "float32",
                "--no-subgroup": None}),
    "calibrate": ({"--profile": lambda v: "profile.json"}, {"--quick": None, "--profile": "profile.json"}),
    "simulate": ({"--gpus": lambda v: ",".join(v.split(",")[:2])}, {}),
    "plan": ({"--seq": lambda v: "1024", "--time-budget": lambda v: "1"},
             {"--seq": "1024", "--time-budget": "1", "--heads": "4", "--kv-heads": "2", "--head-dim": "16"}),
    "schedules": ({}, {}),
    "reproduce ringx": ({"--gcds": lambda v: "8,16", "--batch": lambda v: "32", "--tokens-per-gcd": lambda v: "1024"},
                        {"--gcds": "8,16", "--batch": "32", "--tokens-per-gcd": "1024"}),
    "reproduce ultraattn": ({"--seq": lambda v: "2048", "--gpus": lambda v: "8", "--heads": lambda v: "1"},
                            {"--seq": "2048", "--gpus": "8", "--heads": "1", "--time-budget": "0.5"}),
    "train": ({"--steps": lambda v: "3", "--seq": lambda v: "64", "--nproc": lambda v: "2", "--dp": lambda v: "1",
               "--batch": lambda v: "4",
               "--cp": lambda v: "2", "--eval-every": lambda v: "3", "--config": lambda v: "tiny"},
              {"--steps": "3", "--nproc": "2"}),
}


def shrink(argv: list[str]) -> list[str]:
    """A README command at small sizes (outputs stay relative: the test runs in a temporary directory).
    A JSON mask's ``block_size``, ``window`` and document ``lengths`` shrink with ``--seq``."""
    sub = argv[2:3] if argv[1] == "reproduce" else []  # a command with subcommands: keyed by both
    command, flags = argv[1], _flags(argv[2 + len(sub):])
    change, add = SHRINK[" ".join([command, *sub])]
    given = dict(flags)
    out = []
    for flag, value in flags:
        if flag in change:
            value = change[flag](value)
            if value is None:
                continue
        out.append((flag, value))
    if command == "bench" and "--topology" in given:  # the topology implies the world size
        out = [(f, v) for f, v in out if f != "--world"]
    out += [(f, v) for f, v in add.items() if f not in given]
    old_seq, new_seq = given.get("--seq"), dict(out).get("--seq")
    if old_seq is None and new_seq:  # the command's default length
        default = getattr(cli.build_parser().parse_args([command, *sub]), "seq", None)
        old_seq = str(default[0] if isinstance(default, list) else default) if default else None
    if old_seq and new_seq and "--mask" in given and given["--mask"].lstrip().startswith("{"):
        spec = json.loads(given["--mask"])
        for key in ("block_size", "window"):
            if key in spec:
                spec[key] = max(1, spec[key] * int(new_seq) // int(old_seq))
        if "lengths" in spec:  # documents: the same proportions, adding up to the new length
            lengths = [max(1, n * int(new_seq) // int(old_seq)) for n in spec["lengths"]]
            spec["lengths"] = [*lengths[:-1], int(new_seq) - sum(lengths[:-1])]
        out = [(f, json.dumps(spec) if f == "--mask" else v) for f, v in out]
    return [command, *sub, *(tok for f, v in out for tok in ((f,) if v is None else (f, v)))]


def _slow(argv: list[str]) -> bool:
    """Calibration (several process worlds, about 15 s even --quick); a bench starts two worlds per
    configuration, so the default run times one README bench (the one with options and no topology)
    and the rest (the bare ``make demo`` one, the 4-rank topology one) are slow."""
    command = argv[1]
    return command == "calibrate" or (command == "bench" and (len(argv) == 2 or "--topology" in argv))


def _label(argv: list[str]) -> str:
    return " ".join(argv[1:3]) or argv[0]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in ``tmp_path``: relative outputs land there, and the profile and plan cache are private."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CPATTN_PROFILE", str(tmp_path / "profile.json"))
    monkeypatch.setenv("CPATTN_CACHE_DIR", str(tmp_path / "plans"))
    return tmp_path


def test_the_readme_and_the_command_guide_show_every_command():
    every = {c.__name__.rsplit(".", 1)[-1] for c in cli.COMMANDS}
    for path in (README, COMMANDS_DOC):
        shown = readme_commands(path)
        assert {argv[1] for argv in shown if len(argv) > 1} == every, path.name
        assert all(argv[0] == "cpattn" for argv in shown)


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(a) for a in COMMANDS])
def test_readme_command_parses_and_is_accepted_at_full_size(argv):
    """The command as written parses; bench and verify also build all their configurations (every
    mask, schedule, layout and world checked), which starts no process."""
    args = cli.build_parser().parse_args(argv[1:])
    if args.command == "bench":
        assert cli.bench.configs(args)
    elif args.command == "verify":
        assert cli.verify.cases(args)


def key_line(small: list[str]) -> str:
    """A pattern of a line a README command (as :func:`shrink` makes it) prints when it worked."""
    command = small[0]
    if command == "simulate":
        return r"llama3-8b at \d+ tokens, cp 128 x dp 32" if "--model" in small else r"cpattn simulate: frontier"
    if command == "reproduce":
        return r"RingX on frontier" if small[1] == "ringx" else r"UltraAttn on dgx-h100"
    return {"bench": r"cpattn bench: P=\d", "verify": r"\d+ passed, 0 failed", "calibrate": r"wrote \S*profile\.json",
            "plan": r"forward placement \(rank per cell", "schedules": r"causal masks only",
            "train": r"(?i)loss"}[command]


@pytest.mark.parametrize("argv", [pytest.param(a, marks=pytest.mark.slow) if _slow(a) else a for a in COMMANDS],
                         ids=[" ".join(a) for a in COMMANDS])
def test_readme_command_runs(argv, in_tmp, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # outside a terminal: tables at full width
    small = shrink(argv)
    rc = cli.main(small)
    out = capsys.readouterr()
    assert rc == 0, f"cpattn {shlex.join(small)} -> {rc}\n{out.out[-3000:]}\n{out.err[-3000:]}"
    assert re.search(key_line(small), out.out + out.err), f"cpattn {shlex.join(small)}: no {key_line(small)!r}"
    if small[0] == "bench" and "ringx4o" in small and "full" in small:  # runs the rest, notes what it left out
        assert "not run for the full mask: ringx4o (causal-only)" in " ".join(out.err.split()), out.err
    for flag in ("--json", "--plot", "--heatmap", "--timeline"):
        if flag in small and small[small.index(flag) + 1]:
            assert (in_tmp / small[small.index(flag) + 1]).stat().st_size > 0, flag
    if small[0] == "calibrate":
        assert (in_tmp / "profile.json").exists()


def test_shrink_keeps_the_command_and_scales_the_mask():
    argv = ["cpattn", "plan", "--topology", "2x2", "--seq", "16384", "--mask",
            '{"kind": "strided", "block_size": 1024, "stride": 4}', "--heatmap", "h.png"]
    small = shrink(argv)
    assert small[:3] == ["plan", "--topology", "2x2"] and small[small.index("--seq") + 1] == "1024"
    assert json.loads(small[small.index("--mask") + 1]) == {"kind": "strided", "block_size": 64, "stride": 4}
    bench = shrink(["cpattn", "bench", "--world", "2,4", "--topology", "2x2", "--predict", "--json", "o.json"])
    assert "--world" not in bench and "--predict" in bench and bench[bench.index("--json") + 1] == "o.json"


# ------------------------------------------------------------------------------ topology implies devices
def test_plan_topology_alone_implies_the_device_count(in_tmp, capsys):
    common = ["plan", "--topology", "2x2", "--seq", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
              "--mask", '{"kind": "strided", "block_size": 16, "stride": 4}', "--time-budget", "1", "--no-cache",
              "--heatmap", "", "--timeline", ""]
    assert cli.main(common) == 0
    assert "2 x 2 devices" in capsys.readouterr().out
    assert cli.main([*common, "--gpus", "4"]) == 0  # agreeing is fine
    capsys.readouterr()
    assert cli.main([*common, "--gpus", "8"]) == 2
    assert "has 4 devices but --gpus is 8" in capsys.readouterr().err


def test_simulate_nxd_topology_implies_gpus(in_tmp, capsys):
    base = ["simulate", "--topology", "2x2", "--seq", "4096", "--heads", "8", "--kv-heads", "2", "--head-dim", "64",
            "--plot", "", "--json", "s.json"]
    assert cli.main(base) == 0
    rows = json.loads((in_tmp / "s.json").read_text())
    assert rows and {r["gpus"] for r in rows} == {4}
    assert cli.main([*base, "--gpus", "4,8"]) == 2
    assert "has 4 devices but --gpus is 4,8" in capsys.readouterr().err


def test_bench_world_must_agree_with_the_topology(capsys):
    assert cli.main(["bench", "--topology", "2x2", "--world", "2"]) == 2  # refused before any process starts
    assert "has 4 devices but --world is 2" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["bench", "--topology", "2x2", "--seq", "256,512", "--schedules", "ring"])
    assert [(c.world, c.seq, c.topology) for c, *_ in cli.bench.configs(args)] == [(4, 256, (2, 2)), (4, 512, (2, 2))]
    args = cli.build_parser().parse_args(["bench", "--mask", "full", "--schedules", "ringx3"])
    with pytest.raises(ValueError, match="ringx3.*cpattn schedules"):  # none of those asked for can run it
        cli.bench.configs(args)


def test_bench_runs_what_it_can_and_notes_what_it_skipped():
    args = cli.build_parser().parse_args(["bench", "--mask", "causal,full", "--schedules", "ring,ringx1o,ringx4"])
    (causal, run_c, skip_c), (full, run_f, skip_f) = cli.bench.configs(args)
    assert (run_c, skip_c) == (["ring", "ringx4"], [("ringx1o", "bidirectional-only")])
    assert (run_f, skip_f) == (["ring", "ringx1o"], [("ringx4", "causal-only")])
    default = cli.build_parser().parse_args(["bench", "--mask", "causal"])
    _, run_d, skip_d = cli.bench.configs(default)[0]
    assert {"ringx1", "ringx1o", "ringx3b"} == {n for n, _ in skip_d} and "ring" in run_d


def test_device_counts():
    two_by_two = cli_args.topology()("2x2")
    assert cli_args.device_counts(two_by_two, None, [8], "--gpus") == [4]
    assert cli_args.device_counts(two_by_two, [4], [8], "--gpus") == [4]
    assert cli_args.device_counts(cli_args.topology()("frontier"), None, [8, 64], "--gpus") == [8, 64]
    assert cli_args.device_counts(None, [3], [2], "--world") == [3]
    with pytest.raises(ValueError, match="--world"):
        cli_args.device_counts(two_by_two, [2, 4], [2], "--world")


# ------------------------------------------------------------------------------ shared parsers
def test_topology_parser():
    parse = cli_args.topology()
    assert parse("2x4").shape == (2, 4) and parse("2X4").devices == 8 and parse("2x4").preset is None
    assert parse("DGX_H100").preset == "dgx-h100" and parse("local").devices is None
    assert str(parse("frontier")) == "frontier"
    for bad in ("3", "2x", "0x4", "nowhere"):
        with pytest.raises(Exception, match=re.escape(repr(bad))):
            parse(bad)
    with pytest.raises(Exception, match="NODESxDEVICES"):
        cli_args.topology(presets=False)("frontier")


def test_mask_parser():
    assert cli_args.masks("causal,full") == ["causal", "full"]
    spec = '{"kind": "strided", "block_size": 1024, "stride": 4}'
    assert cli_args.masks(spec) == [json.loads(spec)]
    assert cli_args.masks(f"[{spec}, \"causal\"]") == [json.loads(spec), "causal"]
    assert cli_args.mask(spec) == json.loads(spec) and cli_args.mask("causal") == "causal"
    with pytest.raises(Exception, match="one mask"):
        cli_args.mask("causal,full")
    with pytest.raises(Exception, match="JSON"):
        cli_args.masks("{not json")
    assert cli_args.csv(int)("2,4,") == [2, 4] and cli_args.layouts("default,balanced") == [None, "balanced"]


# ------------------------------------------------------------------------------ usage errors versus bugs
@pytest.mark.parametrize("argv", [
    ["plan", "--topology", "3"],  # argparse: not a preset nor NxD
    ["bench", "--world", "2,a"],  # argparse: not ints
    ["simulate", "--mask", "causal,full", "--seq", "4096"],  # argparse: one mask only
    ["simulate", "--topology", "frontier"],  # the command: neither --seq nor --seq-per-gpu
    ["bench", "--mask", "diagonal"],  # the command: an unknown mask
    ["verify", "--masks", "diagonal"],  # the command: an unknown mask kind
    ["nosuchcommand"],
])
def test_usage_errors_exit_2_with_a_message(argv, capsys):
    assert cli.main(argv) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["verify", "--world", "0"], ["bench", "--world", "-1"], ["bench", "--seq", "0"],
                                  ["simulate", "--gpus", "0", "--seq", "4096"], ["plan", "--heads", "0"]])
def test_counts_below_one_are_one_line_errors(argv, capsys):
    """A world size, length or head count below 1 is refused by the parser in one line, before anything
    runs (it used to end in a ZeroDivisionError, or in two tracebacks for a negative world)."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "expected a positive integer" in err and "Traceback" not in err


def test_help_exits_0(capsys):
    assert cli.main(["plan", "--help"]) == 0
    assert "--topology" in capsys.readouterr().out


def test_a_bug_in_a_command_propagates(monkeypatch):
    def broken(args):
        raise TypeError("a bug, not a usage error")

    monkeypatch.setattr(cli.schedules, "run", broken)
    with pytest.raises(TypeError, match="a bug"):
        cli.main(["schedules"])


def test_a_value_error_from_a_command_is_a_usage_error(monkeypatch, capsys):
    def refuses(args):
        raise ValueError("bad input [1, 2]")

    monkeypatch.setattr(cli.schedules, "run", refuses)
    assert cli.main(["schedules"]) == 2
    assert "bad input [1, 2]" in capsys.readouterr().err  # printed as is (no markup)


def test_importing_cpattn_or_its_cli_loads_no_heavy_dependency():
    code = ("import sys, cpattn, cpattn.cli; "
            "print(sorted(m for m in ('rich', 'matplotlib', 'ortools') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_module_entry_point(tmp_path):
    res = subprocess.run([sys.executable, "-m", "cpattn.cli", "schedules"], capture_output=True, text=True,
                         cwd=tmp_path, check=False)
    assert res.returncode == 0 and "zigzag_ring" in res.stdout
