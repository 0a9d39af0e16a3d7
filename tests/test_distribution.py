"""The name people install: a distribution name of its own, both commands, and every message saying it."""

import re
from pathlib import Path

import tomllib

from packer._version import DISTRIBUTION

REPO = Path(__file__).resolve().parents[1]


def test_the_distribution_has_its_own_name_and_both_commands():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION != "packer"  # "packer" on the index is an unrelated 2013 project
    assert project["scripts"] == {"packer": "packer.cli:run", DISTRIBUTION: "packer.cli:run"}  # run: main, then exit
    assert isinstance(project["license"], str)  # an SPDX string: the table form prints a deprecation warning


def test_every_pip_install_of_packer_names_the_distribution():
    """Messages and docs never tell users to `pip install packer` (the wrong project) or 'packer[extra]'."""
    wrong = re.compile(r"pip install ['\"]?packer(\[|['\"\s`]|$)")
    files = [*(REPO / "packer").rglob("*.py"), REPO / "README.md", *(REPO / "docs").glob("*.md")]
    offenders = [f"{p.relative_to(REPO)}:{n}" for p in files
                 for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if wrong.search(line)]
    assert not offenders, offenders
