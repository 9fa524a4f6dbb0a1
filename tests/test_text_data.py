"""Training on local text (``--data``): the corpus reader, the packer and its position, and a text run
that resumes at the same document. Every test writes its own text."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from cpattn import data, train
from cpattn.launcher import RankError

WORDS = ("the cat sat on the mat and the dog ran to the park where a bird sang in the old tree while rain fell "
         "on the roof of the small red house").split()


def _write_corpus(root: Path, documents: int, seed: int = 0) -> Path:
    """``documents`` text files of 20 to 120 words each (a directory corpus)."""
    g = torch.Generator().manual_seed(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(documents):
        n = int(torch.randint(20, 120, (1,), generator=g))
        words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (n,), generator=g)]
        (root / f"doc{i:03d}.txt").write_text(f"document {i}: " + " ".join(words) + ".\n")
    return root


# ---------------------------------------------------------------------------------- no workers
def test_corpus_reads_directories_jsonl_and_files(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text("first")
    (tmp_path / "d" / "empty.txt").write_text("")
    (tmp_path / "d" / ".hidden").write_text("never read")
    lines = [{"text": "second"}, {"text": ""}, {"text": "thïrd", "id": 7}]
    (tmp_path / "d" / "sub" / "b.jsonl").write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n"
                                                    + json.dumps(lines[2]) + "\n")
    corpus = data.TextCorpus(tmp_path / "d")
    assert [corpus.text(i) for i in range(len(corpus))] == ["first", "second", "thïrd"]
    assert corpus.vocab == 256 and corpus.tokens(2).tolist() == list("thïrd".encode())
    assert data.TextCorpus(tmp_path / "d" / "sub" / "b.jsonl").text(1) == "thïrd"
    before = corpus.fingerprint
    (tmp_path / "d" / "a.txt").write_text("First")
    assert data.TextCorpus(tmp_path / "d").fingerprint != before
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*'text' field"):
        data.TextCorpus(tmp_path / "bad.jsonl")
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ValueError, match="holds no text"):
        data.TextCorpus(tmp_path / "nothing")
    with pytest.raises(ValueError, match="does not exist"):
        data.TextCorpus(tmp_path / "missing")


def test_packer_rows_labels_positions_and_resume(tmp_path):
    """Rows of whole documents, a cut document continuing as the next row's first segment with its
    labels carried across the cut; a packer restored from a state packs what the original would."""
    for i, text in enumerate(["abcdefghij", "klm", "nopqrstuvwxyz"]):
        (tmp_path / f"{i}.txt").write_text(text)
    corpus = data.TextCorpus(tmp_path)
    packer = data.TextPacker(corpus, [0, 1, 2], seq_len=8)
    b = packer.next_batch(2)
    text = "".join(corpus.text(i) for i in range(3))
    assert bytes(b["tokens"].flatten().tolist()).decode() == text[:16]
    assert b["lengths"] == [[8], [2, 3, 3]] and b["documents"] == [0, 0]
    assert b["position_ids"][1].tolist() == [0, 1, 0, 1, 2, 0, 1, 2]
    ignore = data.IGNORE
    assert b["labels"][0].tolist() == list(b"bcdefghi")  # the cut: 'h' is followed by 'i'
    assert b["labels"][1].tolist() == [ord("j"), ignore, ord("l"), ord("m"), ignore, ord("o"), ord("p"), ord("q")]
    state = packer.state_dict()
    assert state == {"epoch": 0, "document": 2, "offset": 3}
    again = data.TextPacker(corpus, [0, 1, 2], seq_len=8)
    again.load_state_dict(json.loads(json.dumps(state)))
    nxt, other = packer.next_batch(2), again.next_batch(2)
    assert all(torch.equal(nxt[k], other[k]) for k in ("tokens", "labels", "position_ids"))
    assert nxt["documents"] == [2, 2] and nxt["lengths"][1] == [2, 6]  # "yz", then the next pass begins
    assert packer.state_dict() == {"epoch": 1, "document": 0, "offset": 6}
    with pytest.raises(ValueError, match="outside this corpus"):
        again.load_state_dict({"epoch": 0, "document": 3, "offset": 0})


def test_a_tokenizer_sets_the_vocabulary(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    corpus_dir = _write_corpus(tmp_path / "text", 4)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator((p.read_text() for p in sorted(corpus_dir.iterdir())),
                            tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tok.json"))
    corpus = data.TextCorpus(corpus_dir, tmp_path / "tok.json")
    assert corpus.vocab == tok.get_vocab_size()
    ids = corpus.tokens(0)
    assert tok.decode(ids.tolist()).split()[:3] == ["document", "0", ":"]
    assert int(ids.max()) < corpus.vocab
    assert corpus.fingerprint != data.TextCorpus(corpus_dir).fingerprint


def test_text_configs_are_checked_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="task 'text' trains on --data"):
        train.TrainConfig(task="text")
    with pytest.raises(ValueError, match="--data trains task 'text'"):
        train.TrainConfig(data=str(tmp_path), task="recall")
    with pytest.raises(ValueError, match="not a vit task"):
        train.TrainConfig(model="vit", data=str(tmp_path))
    _write_corpus(tmp_path / "few", 3)
    with pytest.raises(ValueError, match="--eval-every needs held-out documents"):
        train.preflight(train.TrainConfig(data=str(tmp_path / "few"), eval_every=2))
    with pytest.raises(ValueError, match="does not exist"):
        train.preflight(train.TrainConfig(data=str(tmp_path / "missing")))


# ---------------------------------------------------------------------------------- with workers
def _run(worlds, cfg: train.TrainConfig) -> dict:
    results = worlds.get(cfg.world).run(train.run_rank, timeout=300, name=f"text {cfg}",
                                        config=dataclasses.asdict(cfg) | {"documents": []})
    bad = [r for r in results if isinstance(r, RankError)]
    assert not bad, f"{bad[0]}\n{bad[0].traceback}"
    return results[0]


def test_a_text_run_resumes_at_the_same_document(worlds, tmp_path):
    """Packed rows of text files with each step's document mask at cp=2: stopped after step 3 and
    resumed, the run continues at the document the uninterrupted run reached, with its losses."""
    corpus = _write_corpus(tmp_path / "text", 24)
    base = train.TrainConfig(model="llama", config="tiny", dp=1, cp=2, schedule="zigzag_ring", steps=6, seq=128,
                             batch=2, lr=3e-3, seed=1, data=str(corpus), peak_tflops=1.0)
    whole = _run(worlds, base)
    assert whole["losses"][-1] < whole["losses"][0]
    assert whole["documents"] == sorted(whole["documents"]) and whole["documents"][-1] > 2  # through the corpus
    root = str(tmp_path / "ck")
    first = _run(worlds, dataclasses.replace(base, stop_after=3, checkpoint=root))
    resumed = _run(worlds, dataclasses.replace(base, checkpoint=root, resume=True, eval_every=3))
    assert first["documents"] == whole["documents"][:3] and resumed["documents"] == whole["documents"][3:]
    assert resumed["losses"] == whole["losses"] and resumed["data_position"] == whole["data_position"]
    assert [e["step"] for e in resumed["evaluations"]] == [6] and 0 <= resumed["evaluations"][0]["accuracy"] <= 1
    (corpus / "doc000.txt").write_text("changed")
    with pytest.raises(ValueError, match="not what .* was trained on"):
        train.preflight(dataclasses.replace(base, steps=8, checkpoint=root, resume=True))


@pytest.mark.slow
def test_text_runs_follow_the_one_process_run_on_every_mesh(worlds, tmp_path):
    """Each dp rank packs its rows into one sequence with their document mask; at (1, 2), (2, 1) and
    (2, 2), sharded or not, the losses follow the one-process run's (1e-5)."""
    corpus = _write_corpus(tmp_path / "text", 24)
    base = train.TrainConfig(model="llama", config="tiny", steps=6, seq=128, batch=4, lr=3e-3, seed=2,
                             data=str(corpus), peak_tflops=1.0)
    ref = torch.tensor(_run(worlds, base)["losses"], dtype=torch.float64)
    for dp, cp, fsdp in ((1, 2, True), (2, 1, True), (2, 2, True), (2, 2, False)):
        got = torch.tensor(_run(worlds, dataclasses.replace(base, dp=dp, cp=cp, fsdp=fsdp))["losses"],
                           dtype=torch.float64)
        rel = ((got - ref).abs() / ref).max().item()
        assert rel <= 1e-5, (dp, cp, fsdp, rel)
