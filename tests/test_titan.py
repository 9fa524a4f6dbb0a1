"""cpattn inside torchtitan 0.3.0 (``cpattn.integrations.torchtitan``), on the CPU with gloo.

Every test here carries the ``titan`` marker: ``make test`` deselects them and never imports torchtitan
(this module imports it only inside tests); ``make test-titan`` installs ``.[titan]`` and runs them. A
test run without torchtitan installed fails, naming ``make test-titan``.

The chain of checks:
- on one process, the debug Llama with cpattn's inner attention and the step's document mask equals
  the same weights with a float64 softmax reference attention over each row's block-causal mask (built
  here from the positions, sharing no code with the integration), in outputs and gradients;
- trained by ``torchrun ... -m cpattn.integrations.torchtitan`` from one seed checkpoint, the first 5
  losses at (dp_shard 2, cp 1) and at (dp_shard 1, cp 2) with ``zigzag_ring`` and ``ringx4o`` (and once
  compiled) equal the one-rank run's within 1e-4 relative, with FSDP2 and selective activation
  checkpointing; each step's attention traffic equals what the schedule declares for one forward and
  one backward per layer (the checkpointing saves the attention op), which full checkpointing exceeds;
- a checkpoint written at CP=2 resumes, continuing the reference's losses;
- the Qwen3 debug model, the second family, at CP=2 equals its one-rank run.
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.titan

#: relative difference allowed between a run's losses and the one-rank run's (float32 parameters)
LOSS_TOLERANCE = 1e-4
STEPS = 5
RUN_TIMEOUT = 1500  # seconds for one torchrun launch; the 2 cores are shared with other tests
CP2 = ["--parallelism.context_parallel_degree", "2"]


@pytest.fixture(scope="module", autouse=True)
def torchtitan_installed():
    for name in ("torchtitan", "triton", "tensorboard"):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            pytest.fail(f"{name} is not installed ({exc}): the titan tests need the titan extra; run "
                        "`make test-titan`", pytrace=False)


class Run:
    """One ``torchrun ... -m cpattn.integrations.torchtitan`` run: its losses and grad norms by step (from
    its tensorboard events) and each rank's ``cpattn_bytes_*`` records by step (its structured log)."""

    def __init__(self, folder: Path, output: str, tb_folder: str) -> None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        self.folder, self.output = folder, output
        self.losses: dict[int, float] = {}
        self.grad_norms: dict[int, float] = {}
        for events in glob.glob(str(folder / tb_folder / "**" / "events*"), recursive=True):
            acc = EventAccumulator(events)
            acc.Reload()
            if "loss_metrics/global_avg_loss" in acc.Tags()["scalars"]:
                self.losses.update({s.step: s.value for s in acc.Scalars("loss_metrics/global_avg_loss")})
                self.grad_norms.update({s.step: s.value for s in acc.Scalars("grad_norm")})
        self.bytes: list[dict[str, dict[int, float]]] = []  # per rank: name -> step -> value
        for path in sorted(glob.glob(str(folder / "structured_logs" / "*.jsonl"))):
            records: dict[str, dict[int, float]] = {"cpattn_bytes_sent": {}, "cpattn_bytes_expected": {}}
            with open(path) as f:
                for line in f:
                    r = json.loads(line)
                    if r.get("log_type_name") == "metric_value" and r.get("event_name") in records:
                        records[r["event_name"]][r["step"]] = r["value"]
            self.bytes.append(records)


def train(folder: Path, nproc: int, *flags: str, env: dict | None = None, tb_folder: str = "tb") -> Run:
    """``torchrun --standalone --nproc-per-node nproc -m cpattn.integrations.torchtitan`` with ``flags``
    (a subcommand such as ``activation-checkpoint:full`` last), writing into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "cpattn.integrations.torchtitan", "--dump_folder", str(folder), "--metrics.enable_tensorboard",
           "--metrics.save_tb_folder", tb_folder, "--metrics.disable_color_printing", *flags]
    # one thread per process, as torchrun sets for several (the one-rank runs too: the cores are shared)
    proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=RUN_TIMEOUT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-6000:]}"
    return Run(folder, output, tb_folder)


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def assert_losses_equal(run: Run, reference: Run, steps) -> None:
    assert sorted(run.losses) == list(steps), f"logged steps {sorted(run.losses)}\n{run.output[-3000:]}"
    for step in steps:
        diff = relative(run.losses[step], reference.losses[step])
        assert diff <= LOSS_TOLERANCE, (f"step {step}: loss {run.losses[step]} against the one-rank "
                                        f"{reference.losses[step]} (relative {diff:.2e})")


def assert_attention_runs_once(run: Run, steps) -> None:
    """Every rank's attention sent what its schedule declares for one forward and backward per layer."""
    assert run.bytes, "no structured log"
    for rank, records in enumerate(run.bytes):
        sent, expected = records["cpattn_bytes_sent"], records["cpattn_bytes_expected"]
        assert sorted(sent) == list(steps), f"rank {rank}: {records}"
        for step in steps:
            assert sent[step] == expected[step] > 0, f"rank {rank}, step {step}: sent {sent[step]}, declared " \
                                                     f"{expected[step]}"


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> Path:
    """The seed checkpoint of the debug Llama."""
    return make_seed(tmp_path_factory.mktemp("titan") / "seed")


def make_seed(folder: Path, *flags: str) -> Path:
    """torchtitan's seed checkpoint (one process, model only) of the config ``flags`` choose."""
    train(folder, 1, *flags, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint")
    step0 = folder / "checkpoint" / "step-0"
    assert step0.is_dir(), f"no seed checkpoint in {folder}"
    return step0


def from_seed(seed: Path, steps: int = STEPS) -> list[str]:
    """Flags of a parity run: the seed's weights, float32 parameters, ``steps`` steps."""
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed),
            "--training.mixed_precision_param", "float32", "--training.steps", str(steps)]


@pytest.fixture(scope="module")
def reference(seed) -> Run:
    """The one-rank run: 2 rows of 256 tokens per step."""
    run = train(seed.parent.parent.parent / "reference", 1, *from_seed(seed))
    assert sorted(run.losses) == list(range(1, STEPS + 1)), run.output[-3000:]
    return run


# ---------------------------------------------------------------------------------------------- one process
def test_inner_attention_equals_a_float64_reference_on_each_rows_documents():
    import torch
    from torchtitan.models import llama3

    import cpattn
    from cpattn.integrations.torchtitan import document_mask, use_cpattn
    from cpattn.integrations.torchtitan.data import ByteTokenizer, row

    class Reference(torch.nn.Module):
        """softmax(q k^T * scale, masked) v in float64; ``attention_masks``: bool [B, L, L]."""

        def forward(self, q, k, v, *, attention_masks, scale=None, **kwargs):
            rep = q.shape[2] // k.shape[2]
            k, v = (t.double().repeat_interleave(rep, dim=2) for t in (k, v))
            scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) * (scale or q.shape[-1] ** -0.5)
            scores = scores.masked_fill(~attention_masks[:, None], float("-inf"))
            return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).to(q.dtype)

    config = llama3.model_registry("debugmodel").model
    use_cpattn(config)
    torch.manual_seed(11)
    model = config.build()
    model.init_weights()
    model = model.double()
    ref_model = config.build()
    ref_model.load_state_dict(model.state_dict())
    ref_model = ref_model.double()
    for layer in ref_model.layers.values():
        layer.attention.inner_attention = Reference()

    b, length = 3, 128
    rows = [row(3, i, length, ByteTokenizer()) for i in range(b)]
    inputs, _labels, positions = (torch.tensor([r[i] for r in rows]) for i in range(3))
    assert int((positions == 0).sum()) >= b + 2, "the rows should hold several documents"
    document = torch.cumsum(positions == 0, dim=1)
    token = torch.arange(length)
    allowed = (document[:, :, None] == document[:, None, :]) & (token[:, None] >= token[None, :])
    out_ref = ref_model(inputs, positions=positions, attention_masks=allowed)

    cp = cpattn.ContextParallel(b * length, "causal", "zigzag_ring")  # one process: no group

    def cpattn_run(view):
        local = model(view.shard(inputs.reshape(1, -1)), positions=view.shard(positions.reshape(1, -1)),
                      attention_masks=view)
        return view.unshard(local, dim=1).reshape(b, length, -1)

    out = cpattn_run(cp.with_mask(document_mask(positions)))
    dy = torch.randn_like(out_ref)
    out.backward(dy)
    out_ref.backward(dy)
    error = float((out - out_ref).detach().norm() / out_ref.detach().norm())
    assert error <= 1e-10, f"logits differ from the reference by {error:.2e}"
    for (name, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
        grad_error = float((p.grad - p_ref.grad).norm() / p_ref.grad.norm())
        assert grad_error <= 1e-10, f"{name}: gradient differs from the reference by {grad_error:.2e}"
    # the comparison can fail: causal attention across the flattened rows is not the rows' documents
    with torch.no_grad():
        wrong = float((cpattn_run(cp) - out_ref).norm() / out_ref.norm())
    assert wrong > 1e-3, f"a causal mask over the whole batch should differ from the reference ({wrong:.2e})"


def test_document_mask_of_positions():
    import torch

    from cpattn import masks
    from cpattn.integrations.torchtitan import document_mask

    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]])  # row 2 starts inside a document
    assert document_mask(positions) == masks.document([3, 2, 1, 2, 4])
    assert document_mask(torch.arange(8)[None]) == masks.causal()


def test_every_data_parallel_degree_sees_the_same_global_batches():
    import torch

    from cpattn.integrations.torchtitan.data import ByteTokenizer, GeneratedTextLoader

    def batches(world: int, local: int, n: int, start_rows: int = 0):
        per_rank = []
        for rank in range(world):
            loader = GeneratedTextLoader(GeneratedTextLoader.Config(seed=2), dp_world_size=world, dp_rank=rank,
                                         tokenizer=ByteTokenizer(), seq_len=64, local_batch_size=local)
            loader.load_state_dict({"rows": torch.tensor(start_rows)})
            it = iter(loader)
            per_rank.append([next(it) for _ in range(n)])
        return [{key: torch.cat([per_rank[r][i][0][key] for r in range(world)]) for key in ("input", "positions")}
                | {"labels": torch.cat([per_rank[r][i][1] for r in range(world)])} for i in range(n)]

    one, two = batches(1, 4, 3), batches(2, 2, 3)
    for a, b in zip(one, two):
        assert all(torch.equal(a[key], b[key]) for key in a)
    assert not torch.equal(one[0]["input"], one[1]["input"])
    # labels are the next token inside each document
    first = one[0]
    same_doc = first["positions"][:, 1:] != 0
    assert torch.equal(first["input"][:, 1:][same_doc], first["labels"][:, :-1][same_doc])
    # a resumed loader continues at the same row, and refuses a position that is not a whole batch
    assert all(torch.equal(one[2][key], batches(2, 2, 1, start_rows=8)[0][key]) for key in one[2])
    with pytest.raises(ValueError, match="not a whole number of global batches"):
        batches(2, 2, 1, start_rows=6)


@pytest.mark.parametrize("flags, message", [
    (["--cpattn.schedule", "ringx1"], "runs bidirectional masks only"),
    (["--cpattn.schedule", "nope"], "is unknown"),
    (["--parallelism.tensor_parallel_degree", "2"], "data (FSDP2, HSDP) x"),
    (["--parallelism.spmd_backend", "spmd_types"], "needs 'partial_dtensor'"),
    (["--validator.enable"], "does not run it"),
])
def test_settings_it_cannot_run_are_refused_when_parsed(flags, message, capsys):
    from torchtitan.config import ConfigManager

    import cpattn.integrations.torchtitan  # noqa: F401  (the shims)

    with pytest.raises(SystemExit):
        ConfigManager().parse_args(["--module", "cpattn.integrations.torchtitan", "--config", "llama3_debugmodel",
                                    *flags])
    printed = " ".join("".join(capsys.readouterr()).replace("│", " ").split())
    assert message in printed, printed[-2000:]


# ---------------------------------------------------------------------------------------------- torchrun
@pytest.mark.parametrize("name, flags", [
    ("dp_shard2-cp1", ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "1"]),
    ("cp2-zigzag_ring", [*CP2, "--cpattn.schedule", "zigzag_ring"]),
    ("cp2-ringx4o", [*CP2, "--cpattn.schedule", "ringx4o"]),
])
def test_losses_equal_the_one_rank_run(seed, reference, name, flags):
    run = train(seed.parent.parent.parent / name, 2, *from_seed(seed), *flags)
    assert "Applied SelectiveCpattnAC activation checkpointing" in run.output
    assert "Applied FSDP to the model" in run.output
    assert_losses_equal(run, reference, range(1, STEPS + 1))
    if "context_parallel_degree" in " ".join(flags):
        assert_attention_runs_once(run, range(1, STEPS + 1))


def test_compiled_losses_equal_the_one_rank_run_without_recompiling(seed, reference):
    run = train(seed.parent.parent.parent / "cp2-compiled", 2, *from_seed(seed), *CP2, "--compile.enable",
                env={"TORCH_LOGS": "recompiles"})
    assert "Compiling each TransformerBlock with torch.compile" in run.output
    assert "Recompiling" not in run.output, "a block was compiled again (a new view each step must not)"
    assert_losses_equal(run, reference, range(1, STEPS + 1))
    assert_attention_runs_once(run, range(1, STEPS + 1))


def test_full_checkpointing_runs_the_attention_again(seed):
    """The traffic check can fail: full activation checkpointing reruns each block's forward, its
    attention included."""
    run = train(seed.parent.parent.parent / "cp2-full-ac", 2, *from_seed(seed, steps=2), *CP2,
                "activation-checkpoint:full")
    for records in run.bytes:
        for step in (1, 2):
            assert records["cpattn_bytes_sent"][step] > records["cpattn_bytes_expected"][step], records


def test_a_checkpoint_written_at_cp2_resumes(seed, reference):
    """A 5-step run at CP=2 saves at step 3 (and at its end); without its last checkpoint, as if stopped
    after step 3, the next run loads step 3 and its steps 4 and 5 equal the one-rank run's."""
    folder = seed.parent.parent.parent / "cp2-resume"
    first = train(folder, 2, *from_seed(seed), *CP2, "--checkpoint.interval", "3")
    assert_losses_equal(first, reference, range(1, STEPS + 1))
    assert (folder / "checkpoint" / "step-3").is_dir(), first.output[-3000:]
    shutil.rmtree(folder / "checkpoint" / f"step-{STEPS}")
    resumed = train(folder, 2, *from_seed(seed), *CP2, tb_folder="tb-resumed")
    assert "Training starts at step 4" in resumed.output, resumed.output[-3000:]
    assert_losses_equal(resumed, reference, range(4, STEPS + 1))


def test_qwen3_at_cp2_equals_its_one_rank_run(tmp_path):
    """The second model family: torchtitan's Qwen3 debug model (GQA 16:8, head dim 128, q/k norms, tied
    embeddings), 2 steps of 2 x 128 tokens, at CP=2 on ringx4o against one rank."""
    qwen3 = ["--config", "qwen3_debugmodel", "--training.seq_len", "128"]
    seed = make_seed(tmp_path / "seed", *qwen3)
    flags = [*qwen3, *from_seed(seed, steps=2)]
    one = train(tmp_path / "one", 1, *flags)
    two = train(tmp_path / "cp2", 2, *flags, *CP2, "--cpattn.schedule", "ringx4o")
    assert_losses_equal(two, one, (1, 2))
    assert_attention_runs_once(two, (1, 2))
