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
    if not armed[0] or name != event or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    if name == "open" and not (args[2] or 0) & (os.O_WRONLY | os.O_RDWR):
        return
    if os.fsdecode(os.fspath(args[0])).endswith(target):
        armed[0] = False
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "int":
            os.kill(os.getpid(), signal.SIGINT)
        else:
            fill(action.removeprefix("fill:"))


sys.addaudithook(hook)
from packer.cli import main

sys.exit(main(argv))
"""


def run_cli_at(argv: list[str], env: dict, event: str, target: str, action: str,
               timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``packer *argv``; the first ``event`` ("open" for writing, or "os.rename") on a path ending in
    ``target`` makes the child ``action``: "kill" (SIGKILL itself), "int" (SIGINT, a Ctrl-C) or
    "fill:PATH" (fill the filesystem holding PATH, a new file: the write that follows gets ENOSPC)."""
    import sys

    return subprocess.run([sys.executable, "-c", _HOOKED_CLI, event, target, action, *map(str, argv)],
                          env=env, capture_output=True, text=True, timeout=timeout)
