"""Small facts about this machine that the cache and ``packer doctor`` act on: memory, /dev/shm, processes."""

from __future__ import annotations

import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (MemTotal, MemAvailable, Cached, Shmem, ...); empty where there is none."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[name] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        pass
    return out


def memory_available() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), None if unknown."""
    return meminfo().get("MemAvailable")


def disk_space(path: str | os.PathLike) -> tuple[int, int] | None:
    """(free bytes for unprivileged users, size) of the filesystem holding ``path``."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def process_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (tells a live pid from a reused one)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(text.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None



def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and ``taskset`` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
