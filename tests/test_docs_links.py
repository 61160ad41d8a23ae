"""The shipped text points only at what a user has: no paths into the development papers folder,
the design notes (DESIGN.md) or the workspace's shared tools (../shared/), and every relative markdown link of README.md and docs/*.md resolves (file, and anchor where one
is given).

Papers are cited by title / first author / arXiv id (docs/references.md), never by a path such
as ``papers/lasp.txt`` or ``../shared/papers/``: a clone or an installed wheel has no such folder.
Reads files only; no torch, no processes.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve()

# What a user gets: the package, its docs, recipes, benchmarks, tests and the top-level files.
# CHANGELOG.md is history (it may name what an entry removed) and is not scanned.
SCANNED_DIRS = ("lightning_seqpar", "docs", "recipes", "benchmarks", "tests")
SCANNED_TOP = ("README.md", "pyproject.toml")
SCANNED_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".cfg", ".txt", ".sh", ".rst"}

# A path into the papers folder: "papers/x.txt", "../shared/papers/", "shared/papers", and a bare
# paper file name "lasp.txt" (the old citation style without the folder).
_PAPER_PATH = re.compile(
    r"(?<![\w./-])(?:\.\./|\./)*(?:shared/)?papers/"
    r"|shared/papers"
    r"|\b(?:lightseq(?:_appendix)?|lss_transformer|lasp|loongtrain)\.txt\b"
)


# The development workspace's files: the design notes and the shared tools folder beside the clone.
_WORKSPACE_PATH = re.compile(r"\bDESIGN\.md\b|(?<![\w.-])\.\./shared\b|(?<![\w./-])shared/tools\b")


def _scanned_files() -> list[Path]:
    files = [ROOT / name for name in SCANNED_TOP if (ROOT / name).is_file()]
    for d in SCANNED_DIRS:
        for p in sorted((ROOT / d).rglob("*")):
            if p.is_file() and p.suffix in SCANNED_SUFFIXES and "__pycache__" not in p.parts and p.resolve() != THIS:
                files.append(p)
    return files


def _paper_path_hits(text: str) -> list[tuple[int, str]]:
    return [
        (lineno, line.strip())
        for lineno, line in enumerate(text.splitlines(), 1)
        if _PAPER_PATH.search(line) or _WORKSPACE_PATH.search(line)
    ]


def test_pattern_catches_the_old_citation_styles_and_spares_citations():
    bad = [
        "LoongTrain (papers/loongtrain.txt §4.5) writes",
        "see ../shared/papers/lightseq.txt §3.2",
        "(shared/papers/lasp.txt Alg. 2)",
        "`papers/lss_transformer.txt`, Principle 3",
        "lightseq_appendix.txt Alg. 1",
    ]
    good = [
        "LoongTrain (Gu et al., arXiv:2406.18485, §4.5) writes",
        "LightSeq (Li et al., arXiv:2310.03294) §3.2",
        "https://huggingface.co/papers/2310.03294",
        "see [references](references.md)",
        "the Megatron-LM baseline of the papers: TP+SP",
    ]
    assert [s for s in bad if not _PAPER_PATH.search(s)] == []
    assert [s for s in good if _PAPER_PATH.search(s)] == []


def test_pattern_catches_the_workspace_files():
    bad = ['code and configs (DESIGN.md "Notes on the models")', "bash ../shared/tools/fa4_wheels.sh",
           "see shared/tools/fa4_wheels.sh", "the layout rules in DESIGN.md"]
    good = ["a shared/ folder of your own", "DESIGNS.md", "the shared memory of the GPU", "docs/strategy.md"]
    assert [s for s in bad if not _WORKSPACE_PATH.search(s)] == []
    assert [s for s in good if _WORKSPACE_PATH.search(s)] == []


def test_no_path_into_the_papers_folder():
    files = _scanned_files()
    assert any(p.name == "README.md" for p in files) and any(p.parent.name == "docs" for p in files)
    hits = [
        f"{p.relative_to(ROOT)}:{lineno}: {line}"
        for p in files
        for lineno, line in _paper_path_hits(p.read_text(encoding="utf-8", errors="replace"))
    ]
    assert hits == [], (
        "cite papers by title / first author / arXiv id and section (see docs/references.md), "
        "not by a path a user does not have:\n" + "\n".join(hits)
    )


# ----------------------------------------------------------------------------------------------
# Markdown links
# ----------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`+[^`]*`+")
# [text](target) or [text](target "title"); images ![alt](src) too. Text may hold nested [..].
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    in_fence = False
    for lineno, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            yield lineno, _INLINE_CODE.sub("", line)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation removed, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text)  # inline html
    text = text.replace("`", "").lower()
    out = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in " -_" or cat[0] in "LN" or cat == "Mn":
            out.append("-" if ch == " " else ch)
    return "".join(out)


def _anchors(path: Path) -> set[str]:
    """Every anchor a markdown file defines: headings (with GitHub's -1, -2 suffixes for repeats)
    and explicit <a name=...> / id=... tags."""
    seen: dict[str, int] = {}
    anchors: set[str] = set()
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        anchors.update(_HTML_ANCHOR.findall(line))
        m = _HEADING.match(line)
        if m:
            base = _slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            anchors.add(base if n == 0 else f"{base}-{n}")
    return anchors


def _relative_links(path: Path) -> list[tuple[int, str]]:
    text = path.read_text(encoding="utf-8")
    links = []
    for lineno, line in _prose_lines(text):
        for m in _LINK.finditer(line):
            target = m.group(1)
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:, ...
                continue
            links.append((lineno, target))
    return links


def _broken(path: Path, target: str) -> str | None:
    file_part, _, anchor = target.partition("#")
    dest = path if not file_part else (path.parent / file_part).resolve()
    if file_part and not dest.exists():
        return "no such file"
    if file_part and ROOT not in dest.parents and dest != ROOT:
        return "points outside the repository"
    if anchor and dest.is_file() and dest.suffix == ".md" and anchor.lower() not in _anchors(dest):
        return f"no heading with anchor #{anchor} in {dest.relative_to(ROOT)}"
    return None


def test_slug_follows_github():
    assert _slug("Set-up") == "set-up"
    assert _slug("`SequenceParallelStrategy`") == "sequenceparallelstrategy"
    assert _slug("`head_parallel_size`") == "head_parallel_size"
    assert _slug("Gathered K/V (LSS fused communication)") == "gathered-kv-lss-fused-communication"
    assert _slug("Beyond one machine: multi-node launch") == "beyond-one-machine-multi-node-launch"


def test_link_parser_finds_relative_links_only(tmp_path):
    md = tmp_path / "a.md"
    md.write_text(
        "# Title\n[x](b.md) and [y](b.md#part) [z](https://e.org/a.md) [w](#title)\n"
        "`[not](code.md)`\n```\n[not](fenced.md)\n```\n![img](img/p.png \"t\")\n",
        encoding="utf-8",
    )
    assert _relative_links(md) == [(2, "b.md"), (2, "b.md#part"), (2, "#title"), (7, "img/p.png")]


@pytest.mark.parametrize("md", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_markdown_links_resolve(md: Path):
    links = _relative_links(md)
    broken = [f"{md.relative_to(ROOT)}:{lineno}: ({target}) {why}" for lineno, target in links if (why := _broken(md, target))]
    assert broken == [], "broken relative links:\n" + "\n".join(broken)


# ----------------------------------------------------------------------------------------------
# Notes cited by the docs
# ----------------------------------------------------------------------------------------------

_NOTE = re.compile(r"Note \[([^\]\n]+)\]")


def test_notes_cited_in_the_docs_exist_in_the_code():
    """A "Note [X]" that README.md or a docs page sends the reader to is written in some module of
    the package, the benchmarks or the tests."""
    code = "\n".join(
        p.read_text(encoding="utf-8")
        for d in ("lightning_seqpar", "benchmarks", "tests")
        for p in sorted((ROOT / d).rglob("*.py"))
        if p.resolve() != THIS
    )
    defined = set(_NOTE.findall(code))
    cited = {
        (md.relative_to(ROOT).as_posix(), name)
        for md in _markdown_files()
        for name in _NOTE.findall(md.read_text(encoding="utf-8"))
    }
    assert cited, "the docs cite no Note at all: the pattern is wrong"
    missing = sorted(f"{where}: Note [{name}]" for where, name in cited if name not in defined)
    assert missing == [], "Notes cited by the docs that no module contains:\n" + "\n".join(missing)
