"""tests/procs.txt (the tests that start a process, left out by ``make test-fast``) and the guard that fails any other
test starting one (tests/support/procs.py)."""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys

import pytest
from support import procs

REPO = procs.LIST.parents[1]


def test_every_entry_names_a_test_that_exists():
    """A renamed or deleted test leaves no stale line (its successor would run under --no-procs and fail there)."""
    stale = []
    for entry in procs.listed():
        path, _, rest = entry.partition("::")
        name = re.split(r"[\[:]", rest)[0] if rest else ""
        source = REPO / path
        if not source.is_file() or (name and not re.search(rf"^\s*(def|class) {re.escape(name)}\b", source.read_text(),
                                                             re.M)):
            stale.append(entry)
    assert not stale, f"tests/procs.txt names tests that do not exist: {stale}"


def test_entries_match_a_test_its_file_and_its_parameters():
    assert procs.matches("tests/a.py::t[x-1]", "tests/a.py::t")
    assert procs.matches("tests/a.py::t[x-1]", "tests/a.py")
    assert procs.matches("tests/a.py::t[x-1]", "tests/a.py::t[x-1]")
    assert not procs.matches("tests/a.py::t2", "tests/a.py::t")
    assert not procs.matches("tests/a.py::t[x-2]", "tests/a.py::t[x-1]")


@pytest.mark.parametrize("start", [
    lambda: subprocess.run([sys.executable, "-c", "pass"]),
    lambda: os.system("true"),
    lambda: multiprocessing.get_context("fork").Process(target=print).start(),
    lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
], ids=["subprocess", "system", "fork", "spawn"])
def test_the_guard_refuses_every_way_to_start_a_process_and_names_the_test(start, tmp_path):
    guard = procs.Guard(tmp_path / "log")
    guard.current = "tests/x.py::test_y"
    saved = os.fork
    guard.install()
    try:
        with pytest.raises(procs.ProcessStarted, match=r"tests/x.py::test_y started a process"):
            start()
    finally:
        guard.uninstall()
    assert os.fork is saved
    assert (tmp_path / "log").read_text() == "tests/x.py::test_y\n"


def test_the_guard_lets_a_library_lookup_run_ldconfig(tmp_path):
    """ctypes.util.find_library runs ldconfig (packer's libc and libturbojpeg look-ups on import or first use)."""
    import ctypes.util

    guard = procs.Guard(tmp_path / "log")
    guard.install()
    try:
        assert ctypes.util.find_library("c")
    finally:
        guard.uninstall()
    assert not (tmp_path / "log").exists()
