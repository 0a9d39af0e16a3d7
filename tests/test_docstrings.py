"""``help()`` explains every argument of the public API: a Google-style ``Args:`` section names each parameter."""

from __future__ import annotations

import inspect
import re

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
