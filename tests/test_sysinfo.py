"""packer.sysinfo: the one reader of /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from packer import sysinfo

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc here")


def test_stat_fields_survive_a_command_name_with_spaces_and_parentheses(tmp_path):
    odd = tmp_path / "a) b ("  # the command name /proc/<pid>/stat shows in parentheses
    odd.symlink_to(sys.executable)
    child = subprocess.Popen([str(odd), "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while (fields := sysinfo.stat_fields(str(child.pid))) is not None and "a) b" not in (
                sysinfo.proc_text(f"{child.pid}/comm") or "") and time.monotonic() < deadline:
            time.sleep(0.01)  # until the child has exec'd
        assert fields is not None and fields[0] in "RSD"  # the state, not a piece of the name
        assert sysinfo.process_start_time(child.pid) == int(fields[19]) > 0
        assert sysinfo.cpu_seconds(str(child.pid)) is not None
    finally:
        child.kill()
        child.wait()
    assert sysinfo.stat_fields(str(child.pid)) is None and sysinfo.cpu_seconds(str(child.pid)) is None  # gone


def test_cpu_seconds_count_this_threads_work():
    task = f"self/task/{os.getpid()}"  # the main thread
    before = sysinfo.cpu_seconds(task)
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    after = sysinfo.cpu_seconds(task)
    assert before is not None and after is not None and after > before


def test_meminfo_and_missing_files():
    assert sysinfo.meminfo()["MemTotal"] > 0
    assert sysinfo.proc_text("no/such/file") is None


def test_a_command_name_that_is_not_utf8_is_read(tmp_path):
    """/proc shows a command name's bytes as they are: one that is not UTF-8 is read (as lone surrogates), not an
    exception from decoding, so a sweep of stale temporary files or a process's CPU time never fails on it."""
    odd = tmp_path / os.fsdecode(b"py\xff\xfe")
    odd.symlink_to(sys.executable)
    child = subprocess.Popen([str(odd), "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while "\udcff" not in (sysinfo.proc_text(f"{child.pid}/comm") or "") and time.monotonic() < deadline:
            time.sleep(0.01)  # until the child has exec'd
        assert sysinfo.proc_text(f"{child.pid}/stat") is not None
        assert (sysinfo.stat_fields(str(child.pid)) or ["?"])[0] in "RSD"
    finally:
        child.kill()
        child.wait()


def test_proc_links_and_paths():
    assert (sysinfo.proc_link("self/ns/pid") or "").startswith("pid:")
    assert sysinfo.proc_link("no/such/link") is None
    assert sysinfo.proc_path("self/fd/3") == "/proc/self/fd/3"
