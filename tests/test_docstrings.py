"""``help()`` explains every argument of the public API: a Google-style ``Args:`` section names each parameter."""

from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest

import packer

DOCUMENTED = ["open_dataset", "PackedDataset", "convert", "Writer", "BlockShuffleSampler", "BlockBatchSampler",
              "ThreadLoader", "BackgroundLoader", "CUDAPrefetcher", "CachedDataset", "export_wds"]


def args_section(doc: str) -> dict[str, str]:
    """Google style: ``Args:``, then one ``name: text`` entry per argument, indented one step, continued deeper."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), None)
    if start is None:
        return {}
    indent = len(lines[start]) - len(lines[start].lstrip())
    entries: dict[str, str] = {}
    name = None
    for line in lines[start + 1:]:
        depth = len(line) - len(line.lstrip())
        if line.strip() and depth <= indent:
            break  # the next section (Returns:, Raises:) or the end of this one
        m = re.match(rf"^ {{{indent + 4}}}(\*{{0,2}}\w+)(?: \([^)]*\))?: (.+)$", line)
        if m:
            name = m.group(1).lstrip("*")
            entries[name] = m.group(2)
        elif name is not None and line.strip():
            entries[name] += " " + line.strip()
    return entries


@pytest.mark.parametrize("name", DOCUMENTED)
def test_every_argument_is_explained(name):
    obj = getattr(packer, name)
    doc = inspect.getdoc(obj) or ""
    documented = args_section(doc)
    params = [p for p in inspect.signature(obj).parameters if p != "self"]
    missing = [p for p in params if p not in documented]
    assert not missing, f"{name}: Args: does not explain {missing}"
    extra = sorted(set(documented) - set(params))
    assert not extra, f"{name}: Args: explains arguments it does not take: {extra}"
    assert all(len(text) > 12 and not text.startswith("see ") for text in documented.values()), documented


def test_the_parser_reads_google_style():
    def f(a, *, b_c=1, **rest):
        """Do it.

        Args:
            a: the first, explained at length
                on two lines.
            b_c (int): the second.
            **rest: everything else.

        Returns:
            Nothing.
        """

    got = args_section(inspect.getdoc(f) or "")
    assert got == {"a": "the first, explained at length on two lines.", "b_c": "the second.",
                   "rest": "everything else."}


# ------------------------------------------------------------------ no timings in code


# A timing or a measured rate: 17 us, 2 ms, 853 img/s, 150 MB/s, ~2x faster, ~5x, 5-10 % slower, 91 % -> 93 %,
# ~0.3 s, 84 s to reject. Figures belong in docs/ with the command that measured them (docs/results.md).
TIMING = re.compile(
    r"\d\s*(?:ns|us|µs|ms)\b"
    r"|\d\s*(?:img|images|samples|photos|tiles|MB|GB|KB|MiB|GiB|KiB|MP)/s\b"
    r"|\d(?:\.\d+)?\s*x\s+(?:faster|slower|quicker)\b"
    r"|~\s*\d[\d.]*x\b"
    r"|\d\s*%\s*(?:faster|slower|quicker|less|more|fewer)\b"
    r"|\d\s*%\s*->\s*\d"
    r"|~\s*\d[\d.,]*\s*s\b"
    r"|\b\d[\d.,]*\s*s\s+(?:per|to|for|of)\b", re.IGNORECASE)
PACKAGE = Path(packer.__file__).resolve().parent


def docs_and_comments(source: str) -> list[tuple[int, str]]:
    """(line, text) of every docstring (module, class, function) and comment of a Python source."""
    tree = ast.parse(source)
    out = [(node.body[0].lineno, node.body[0].value.value) for node in ast.walk(tree)
           if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
           and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
           and isinstance(node.body[0].value.value, str)]
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return out + [(tok.start[0], tok.string) for tok in tokens if tok.type == tokenize.COMMENT]


def timings(source: str) -> list[str]:
    return [f"{line}: {m.group(0)!r}" for line, text in docs_and_comments(source) for m in TIMING.finditer(text)]


def test_the_pattern_finds_timings_and_not_sizes_or_thresholds():
    quoted = ('"""Reads faster (17 us per sample, 2-3 ms a batch, 853 img/s, 150 MB/s, ~2x faster than PIL).\n'
              '\n5-10 % slower; 91-92 % -> 93-94 %; ~0.3 s; 84 s to reject."""\n'
              "x = 1  # ~300x h5py's fancy indexing\n")
    assert len(timings(quoted)) == 10
    plain = ('"""224x224 tiles, 4 MB batches, at most 1 s, 10 % of the step, 2 workers, ``sleep(0.01)``."""\n'
             'def f():\n    """Up to 10 % smaller; 3 bytes per pixel."""\n    return "12 ms"  # 1 << 20\n')
    assert timings(plain) == []


def test_no_docstring_or_comment_in_packer_quotes_a_timing():
    found = {p.relative_to(PACKAGE).as_posix(): timings(p.read_text(encoding="utf-8"))
             for p in sorted(PACKAGE.rglob("*.py"))}
    quoting = {rel: hits for rel, hits in found.items() if hits}
    assert not quoting, (
        f"timings in packer's docstrings or comments (move them to docs/results.md with their command): {quoting}")
