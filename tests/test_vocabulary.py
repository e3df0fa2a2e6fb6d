"""The repository speaks of what the project is, not of how it was built: no tracked file names a
work session, a lent machine or an issue number, and every docs/ or benchmarks/ file and docs
section title a text cites is in the repository. Recorded outputs (benchmarks/, fixtures/: what a
tool printed or wrote, kept as it wrote them) are not read. Files listed in EXEMPT and
CITES_MISSING hold known hits, each for its stated reason; each entry must still have its hit, so
the lists only shrink."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ("benchmarks/", "fixtures/")
BINARY = (".safetensors", ".npz", ".png", ".npy")

# A lab notebook's words: when and where something was measured instead of what it is.
NOTEBOOK = re.compile(
    r"\bsessions?[ -]\d+"            # "session 22", "sessions 11 and 12", "session-12"
    r"|\bdevice (?:sessions?|calls?)\b"
    r"|\blent\b"
    r"|\bthis \d+-core\b"
    r"|\bissues? #?\d+"              # no issue tracker is in the repository
    r"|\.\./shared\b"
    r"|\bREFERENCES\.md\b",          # not in the repository: docs/references.md is
    re.IGNORECASE)
REFERENCES = re.compile(r"\bREFERENCES\.md\b")   # case matters: docs/references.md is fine
CITED = re.compile(r"(?<![\w/.])((?:docs|benchmarks)/[\w.-]+\.(?:md|json|log))\b")
PLACEHOLDER = "docs/foo.md"   # README's "add a pair" names the files a new pair adds

# CI's script and the mlx-bun tox env find the sources CI lays beside the clone (DeepSpec, mlx-bun,
# mlx-c) there by default; nothing a user reads.
EXEMPT = {".ci/run": "../shared", "tox.ini": "../shared"}
CITES_MISSING: dict[str, str] = {}
# `docs/x.md "Title"` or `[x.md](x.md), "Title"`: a section cited by its title.
SECTION = re.compile(r'(?:docs/)?\b([\w-]+\.md)\]?(?:\([^)]*\))?,? "([^"\n]+)"')


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    here = str(Path(__file__).resolve().relative_to(ROOT))   # this file holds the words as its controls
    return [p for p in out.decode().split("\0")
            if p and p != here and not p.startswith(RECORDED) and not p.endswith(BINARY)]


def _text(path: str) -> str:
    try:
        return (ROOT / path).read_text(encoding="utf-8")
    except (UnicodeDecodeError, FileNotFoundError):
        return ""


def notebook_words(text: str) -> list[str]:
    return [m.group(0) for m in NOTEBOOK.finditer(text)
            if not m.group(0).lower().endswith("references.md") or REFERENCES.fullmatch(m.group(0))]


def missing_citations(text: str) -> list[str]:
    """docs/ and benchmarks/ files the text cites that are not here, and sections it cites by title
    (`docs/benchmarks.md "The draft step"`) that no heading of that page begins with."""
    files = {c for c in CITED.findall(text) if c != PLACEHOLDER and not (ROOT / c).exists()}
    for name, title in SECTION.findall(text):
        page = next((p for p in (ROOT / "docs" / name, ROOT / name) if p.is_file()), None)
        if page is None:
            files.add(name)
        elif not any(h.lower().startswith(title.lower()) for h in _headings(page)):
            files.add(f'{name} "{title}"')
    return sorted(files)


def _headings(page: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("#")]


def test_no_tracked_file_speaks_of_how_it_was_built():
    hits = {p: words for p in _tracked() if p not in EXEMPT and (words := notebook_words(_text(p)))}
    assert not hits, f"lab-notebook words (say what the project is; cite docs sections): {hits}"


def test_no_tracked_file_cites_a_file_the_repository_lacks():
    hits = {p: c for p in _tracked() if p not in CITES_MISSING and (c := missing_citations(_text(p)))}
    assert not hits, f"citations of files not in the repository: {hits}"


@pytest.mark.parametrize("allowed, find", [(EXEMPT, notebook_words), (CITES_MISSING, missing_citations)],
                         ids=["notebook-words", "missing-files"])
def test_each_allowed_file_still_holds_its_hit(allowed, find):
    """The allow-lists only shrink: an entry whose file no longer has the hit must go."""
    stale = {p: hit for p, hit in allowed.items() if not any(hit in w for w in find(_text(p)))}
    assert not stale, f"clean now, remove from the list: {stale}"


@pytest.mark.parametrize("text, words", [
    ("measured in session 22 on the H200", ["session 22"]),
    ("see docs/benchmarks.md, \"Session 25\"", ["Session 25"]),
    ("sessions 11 and 12", ["sessions 11"]),
    ("held to the session-12 table", ["session-12"]),
    ("the next device session", ["device session"]),
    ("one lent H100", ["lent"]),
    ("on this 2-core CPU", ["this 2-core"]),
    ("item 3 of issue 19", ["issue 19"]),
    ("REFERENCES.md's shapes", ["REFERENCES.md"]),
    ("../shared/references", ["../shared"]),
    ("pytest_sessionstart(session); docs/references.md; a silent session", []),
], ids=["session", "Session", "sessions", "hyphen", "device-session", "lent", "cores", "issue", "REFERENCES",
        "shared", "clean"])
def test_the_notebook_words_are_found(text, words):
    """Control of the scan: each kind of word planted in a text is found; the project's own words
    (pytest's session hook, docs/references.md) are not."""
    assert notebook_words(text) == words


def test_a_citation_of_a_missing_file_or_section_is_found():
    """Control: a citation of a removed file or of a section title no heading has is found; one of
    a file and a section that are here is not."""
    assert missing_citations("docs/benchmarks-history.md and docs/bench-h200-run9.json") == [
        "docs/bench-h200-run9.json", "docs/benchmarks-history.md"]
    assert missing_citations('[benchmarks.md](benchmarks.md), "Session 22"') == ['benchmarks.md "Session 22"']
    assert missing_citations('REFERENCES.md, "Reference deltas"') == ["REFERENCES.md"]
    assert missing_citations('docs/benchmarks.md, benchmarks/step-h100-1.json; docs/benchmarks.md "The draft step"; '
                             '[bench.md](bench.md), "The code"') == []
