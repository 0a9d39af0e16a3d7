"""Kill a conversion half-way, at a point the journal proves: after some shards, before the last."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path


def kill_after_shards(cmd: list[str], env: dict, journal: Path, shards: int = 1, timeout: float = 60) -> int:
    """Run ``cmd``, SIGKILL it once ``journal`` records ``shards`` finished shards; returns how many it had."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        if journal.is_dir() and len(list(journal.glob("shard-*.json"))) >= shards:
            break
        time.sleep(0.001)
    assert proc.poll() is None, "conversion ended before it could be interrupted"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return len(list(journal.glob("shard-*.json")))


# A child running the packer CLI that acts once, at an exact point of its work: the first time it
# opens a file for writing (audit event "open") or renames a path (audit event "os.rename") whose
# path ends with ``target``. Audit hooks see the real calls: no packer function is patched.
_HOOKED_CLI = r"""
import os, signal, sys

event, target, action, argv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
armed = [True]


def fill(path):
    # take every free byte of the filesystem holding path: the next write there fails with ENOSPC
    with open(path, "wb", buffering=0) as fh:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    fh.write(b"\0" * size)
            except OSError:
                pass


def hook(name, args):
    to = event == "os.rename-to"  # a rename whose destination is target
    if not armed[0] or name != ("os.rename" if to else event):
        return
    path = args[1] if to else args[0]
    if not isinstance(path, (str, bytes, os.PathLike)):
        return
    if name == "open" and not (args[2] or 0) & (os.O_WRONLY | os.O_RDWR):
        return
    if os.fsdecode(os.fspath(path)).endswith(target):
        armed[0] = False
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "int":
            os.kill(os.getpid(), signal.SIGINT)
        elif action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            fill(action.removeprefix("fill:"))


sys.addaudithook(hook)
from packer.cli import main

sys.exit(main(argv))
"""


def run_cli_at(argv: list[str], env: dict, event: str, target: str, action: str,
               timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``packer *argv``; the first ``event`` ("open" for writing, "os.rename" of a path, "os.rename-to" a
    path) on a path ending in ``target`` makes the child ``action``: "kill" (SIGKILL itself), "int" (SIGINT, a
    Ctrl-C), "stop" (SIGSTOP: see ``stopped_at``) or "fill:PATH" (fill the filesystem holding PATH, a new file:
    the write that follows gets ENOSPC)."""
    import sys

    return subprocess.run([sys.executable, "-c", _HOOKED_CLI, event, target, action, *map(str, argv)],
                          env=env, capture_output=True, text=True, timeout=timeout)


def stopped_at(argv: list[str], env: dict, event: str, target: str) -> subprocess.Popen:
    """``packer *argv`` started, and stopped (SIGSTOP) at the first ``event`` on ``target`` as ``run_cli_at`` finds
    it; returned once stopped: ``proc.send_signal(signal.SIGCONT)`` lets it go on. Fails if it ends first."""
    import os
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _HOOKED_CLI, event, target, "stop", *map(str, argv)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status = os.waitpid(proc.pid, os.WUNTRACED)  # returns once it stops (or ends)
    if not os.WIFSTOPPED(status):
        proc.returncode = os.waitstatus_to_exitcode(status)
        raise AssertionError(f"packer {' '.join(map(str, argv))} ended ({proc.returncode}) before stopping at "
                             f"{event} {target}: {proc.communicate()}")
    return proc
