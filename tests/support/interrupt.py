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
