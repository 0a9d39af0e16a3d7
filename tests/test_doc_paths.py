"""Every repository path the README, docs/, examples/*.md and the Makefile cite exists, and every test they name
(``tests/x.py::test_y`` or a bare `` `test_y` ``) is a test function of the suite: files move, and the text that
points at them must move too (``make fuzz`` once ran a test file that had moved)."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOP = ("packer", "tests", "examples", "docs", "requirements", ".ci")
# a path under one of TOP, not inside a longer path or URL; its last character is not punctuation of the prose
PATH = re.compile(r"(?<![\w./$-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./*-]*[\w*])(?:::(\w+))?")
BARE_TEST = re.compile(r"`(test_\w+?)(\*?)`")  # a test named alone, or a family of them (`test_extract_*`)


def cited_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").glob("*.md")),
            REPO / "Makefile"]


def citations(text: str) -> list[tuple[int, str, str | None]]:
    """(line, path, test name or None) of every repository path in ``text``."""
    return [(n, m.group(1), m.group(2)) for n, line in enumerate(text.splitlines(), 1) for m in PATH.finditer(line)]


@cache
def defined_tests(path: Path) -> frozenset[str]:
    """Names of the test functions and methods defined in one test file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return frozenset(n.name for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_"))


def all_test_functions() -> frozenset[str]:
    return frozenset().union(*(defined_tests(p) for p in sorted((REPO / "tests").rglob("test_*.py"))))


def missing(path: str, test: str | None) -> str | None:
    """Why a cited path (and test) does not exist, or None."""
    matches = sorted(REPO.glob(path)) if "*" in path else [REPO / path] if (REPO / path).exists() else []
    if not matches:
        return "no such file or folder"
    if test is not None and not any(p.suffix == ".py" and test in defined_tests(p) for p in matches):
        return f"no test function {test} in it"
    return None


def test_the_pattern_finds_paths_in_every_form_the_docs_use():
    text = ("see `packer/read/indexing.py`, [tests](tests/formats/test_fuzz.py) and tests/support/.\n"
            "run `tests/read/test_loaders.py::test_cuda_prefetcher_copies_ahead_on_gpu`; "
            "not https://github.com/x/packer/y.py nor $(DEMO)/imgs.lmdb nor lib/packer/z.py")
    assert citations(text) == [(1, "packer/read/indexing.py", None), (1, "tests/formats/test_fuzz.py", None),
                               (1, "tests/support", None),
                               (2, "tests/read/test_loaders.py", "test_cuda_prefetcher_copies_ahead_on_gpu")]


def test_a_moved_file_or_a_renamed_test_is_found():
    assert missing("tests/test_fuzz.py", None) == "no such file or folder"  # moved to tests/formats/
    assert missing("tests/formats/test_fuzz.py", None) is None
    assert missing("tests/read/test_loaders.py", "test_no_such_test") == "no test function test_no_such_test in it"
    assert missing("tests/read/test_*.py", "test_cuda_prefetcher_copies_ahead_on_gpu") is None


@pytest.mark.parametrize("doc", cited_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_cited_path_exists(doc):
    text = doc.read_text(encoding="utf-8")
    broken = [f"{doc.name}:{n}: {path}{'::' + test if test else ''}: {why}"
              for n, path, test in citations(text) if (why := missing(path, test))]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("doc", cited_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_test_named_alone_exists(doc):
    known = all_test_functions()
    broken = [f"{doc.name}:{n}: {m.group(1)}{m.group(2)}"
              for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
              for m in BARE_TEST.finditer(line)
              if not (any(k.startswith(m.group(1)) for k in known) if m.group(2) else m.group(1) in known)]
    assert not broken, "no such test function in tests/:\n" + "\n".join(broken)
