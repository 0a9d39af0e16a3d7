"""User-facing text names things by what they are, not by the project's history: no "issue 19's decode limit",
"Session 21" or "#17" in the README, docs/ (docs/results.md keeps dated sections, named by what changed), the
examples, or packer's strings and docstrings (what a user reads in messages and ``help()``). A reader has no
issue tracker or session log to look them up in."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HISTORY = re.compile(r"\b(issues?|sessions?)\s*#?\d+|(?<![\w&:{#])#\d+\b", re.IGNORECASE)


def strings_of(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string literal of a Python file, docstrings included (comments are not user-facing)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    return [(tok.start[0], tok.string) for tok in tokens if tok.type == tokenize.STRING]


def history(lines: list[tuple[int, str]]) -> list[str]:
    return [f"{n}: {m.group(0)!r} in {text.strip()[:100]!r}" for n, text in lines for m in HISTORY.finditer(text)]


def text_files() -> list[Path]:
    examples = [p for p in sorted((REPO / "examples").iterdir()) if p.suffix in (".py", ".md")]
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *examples]


def test_the_pattern_finds_history_and_nothing_else():
    found = [m.group(0) for m in HISTORY.finditer(
        "Issue #17's targets; issue 19's decode limit; docs/results.md, \"Session 21\"; since session 8; see #42. "
        "Not: {magic:#010x}, &#39;, ### Heading, the 2 sessions, issues of 3 kinds, a[#1]")]
    assert found == ["Issue #17", "issue 19", "Session 21", "session 8", "#42", "#1"]


@pytest.mark.parametrize("path", text_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_docs_and_examples_say_what_they_mean(path):
    lines = list(enumerate(path.read_text(encoding="utf-8").splitlines(), 1))
    found = history(lines)
    assert not found, f"{path.relative_to(REPO)}: say what is meant instead of\n" + "\n".join(found)


def test_packer_strings_and_docstrings_say_what_they_mean():
    found = [f"{p.relative_to(REPO)}:{line}" for p in sorted((REPO / "packer").rglob("*.py"))
             for line in history(strings_of(p))]
    assert not found, "say what is meant instead of\n" + "\n".join(found)
