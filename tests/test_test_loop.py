"""make test's schedule: the files holding slow tests start first (tests/conftest.py sorts them so), which
pytest-xdist keeps only under --no-loadscope-reorder: by default --dist loadfile reorders files by their number of
tests, and in a make test run of 2026-12-07 (load 6-8 on 2 cores) the pasted formats pages (7 tests) and README (5)
started 19.6 and 24.3 minutes into its 26.3, on one worker, while the other had ended at 23.8."""

from __future__ import annotations

import re

from support.pasted import REPO


def test_make_test_keeps_the_slow_files_first():
    xdist = re.search(r"^XDIST\s*=\s*(.*)$", (REPO / "Makefile").read_text(), re.M)
    assert xdist, "XDIST not found in the Makefile"
    options = xdist.group(1).split()
    assert "loadfile" in options or "--dist=loadfile" in options, options
    assert "--no-loadscope-reorder" in options, f"make test's XDIST lets pytest-xdist reorder the files: {options}"


def test_the_suite_has_one_conftest():
    """Tests import helpers with ``from conftest import ...``; a second conftest.py (tests/write/conftest.py did)
    takes the module name ``conftest`` in whichever worker imports it last, and those imports fail there."""
    assert sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("conftest.py")) == [
        "tests/conftest.py"]
