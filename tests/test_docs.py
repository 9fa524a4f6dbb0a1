"""The documents a newcomer enters by: the README stays short, ``docs/README.md`` indexes every document
(one line each), every relative link resolves, every document the package, docs, scripts and tests name
exists, and the README and ``docs/architecture.md`` describe the same four layers."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
#: a document named in text: its bare file name (``ringx.md``), or under ``docs/`` or ``../``
MENTION = re.compile(r"(?<![\w./-])((?:\.\./|docs/)?[\w-]+\.md)\b")


def _texts() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 120


def test_the_docs_index_lists_every_document_once():
    index = (DOCS / "README.md").read_text()
    listed = re.findall(r"^- \[([\w-]+\.md)\]\(\1\): \S", index, re.M)
    documents = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")
    missing = sorted(set(documents) - set(listed))
    assert not missing, f"docs/README.md has no line for {missing}"
    assert sorted(listed) == documents, "a document listed twice, or one that does not exist"


def test_every_relative_link_resolves():
    dead = []
    for path in _texts():
        for target in LINK.findall(path.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address, or an anchor in the same page
            if not (path.parent / target.split("#")[0]).exists():
                dead.append(f"{path.relative_to(ROOT)}: {target}")
    assert not dead, "dead links:\n" + "\n".join(dead)


def test_every_named_document_exists():
    """A document named in the package, the docs, the scripts or the tests is one of the docs (or the README);
    citations of other projects' files carry their own folders and are not checked."""
    files = [*_texts(), *sorted((ROOT / "cpattn").rglob("*.py")), *sorted((ROOT / "scripts").glob("*.py")),
             *sorted((ROOT / "tests").glob("*.py")), *sorted((ROOT / "examples").glob("*.py"))]
    missing = []
    for path in files:
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            for name in MENTION.findall(line):
                base = name.split("/")[-1]
                if not ((DOCS / base).exists() or (ROOT / base).exists()):
                    missing.append(f"{path.relative_to(ROOT)}:{line_no}: {name}")
    assert not missing, "documents named but absent:\n" + "\n".join(missing)


def test_the_readme_and_the_architecture_describe_the_same_layers():
    readme = (ROOT / "README.md").read_text()
    arch = (DOCS / "architecture.md").read_text()
    layers = ["core", "schedules", "model", "tools"]
    assert re.findall(r"^(\d)\. \*\*(\w+)\*\*", readme, re.M) == [(str(i), n) for i, n in enumerate(layers, 1)]
    assert re.findall(r"^ (\d)  (\w+) ", arch, re.M) == [(str(i), n) for i, n in reversed(list(enumerate(layers, 1)))]
    assert "Four layers" in readme and "cpattn is four layers" in arch
