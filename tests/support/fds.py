"""The files this process holds open, by path: a test counts the descriptors of its own files, not the process's
(another test's read-ahead thread, an in-process server or a garbage collection opens and closes others meanwhile)."""

from __future__ import annotations

import os
from pathlib import Path


def open_files_under(path: str | Path) -> list[str]:
    """The targets of this process's descriptors open on ``path`` or on a file under it, one entry per descriptor."""
    root = str(path)
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, gone
            continue
        if target == root or target.startswith(root.rstrip("/") + "/"):
            found.append(target)
    return found
