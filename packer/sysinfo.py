"""Small facts about this machine that the cache and ``packer doctor`` act on: memory, /dev/shm, processes, the mount
holding a path and its kind; and the one reader of /proc (``proc_text``)."""

from __future__ import annotations

import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "9p", "afs", "beegfs", "gpfs",
              "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "virtiofs"}
PARALLEL_FS = {"lustre", "gpfs", "beegfs", "fuse.lustre"}
MEMORY_FS = {"tmpfs", "ramfs"}


TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc's clock ticks per second


def proc_path(name: str) -> str:
    """``/proc/<name>``: where the kernel shows it (a process's descriptors ``self/fd/N`` as paths, for one)."""
    return f"/proc/{name}"


def proc_text(name: str) -> str | None:
    """The text of ``/proc/<name>`` (``meminfo``, ``self/mountinfo``, ``thread-self/schedstat``, ...): the one reader
    of /proc; None where there is none (not Linux, a process or thread gone). Bytes that are not UTF-8 (a command
    name, a mapped file's path) come back as lone surrogates, as ``os.fsdecode`` gives them."""
    try:
        with open(proc_path(name), encoding="utf-8", errors="surrogateescape") as fh:
            return fh.read()
    except OSError:
        return None


def proc_link(name: str) -> str | None:
    """Where the link ``/proc/<name>`` points (``self/ns/pid``: this process's pid namespace); None where there is
    none."""
    try:
        return os.readlink(proc_path(name))
    except OSError:
        return None


def stat_fields(task: str) -> list[str] | None:
    """The fields of ``/proc/<task>/stat`` (``task``: a pid, ``self``, ``self/task/<tid>``) after the command
    name, which may hold spaces: ``[0]`` is the state, ``[11]``/``[12]`` the user/system ticks, ``[19]`` the start
    time (``man 5 proc``'s fields 3 onwards); None where it is gone."""
    text = proc_text(f"{task}/stat")
    return None if text is None else text.rsplit(")", 1)[-1].split()


def cpu_seconds(task: str) -> float | None:
    """User + system CPU seconds a process or thread (``stat_fields``' ``task``) has used; None where it is gone."""
    fields = stat_fields(task)
    try:
        return None if fields is None else (int(fields[11]) + int(fields[12])) / TICK
    except (IndexError, ValueError):
        return None


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (MemTotal, MemAvailable, Cached, Shmem, ...); empty where there is none."""
    out: dict[str, int] = {}
    for line in (proc_text("meminfo") or "").splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            out[name] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
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
    fields = stat_fields(str(pid))
    try:
        return None if fields is None else int(fields[19])
    except (IndexError, ValueError):
        return None



def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts: signalling it is refused, not unknown)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and ``taskset`` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# ------------------------------------------------------------------ mounts


def fs_kind(fstype: str | None) -> str:
    """local, network, parallel, overlay, memory or unknown."""
    if not fstype:
        return "unknown"
    if fstype in PARALLEL_FS:
        return "parallel"
    if fstype in NETWORK_FS or fstype.startswith("nfs"):
        return "network"
    if fstype == "overlay":
        return "overlay"
    if fstype in MEMORY_FS:
        return "memory"
    return "local"


def _unescape(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mountinfo() -> list[dict]:
    """This process's mounts (/proc/self/mountinfo): mount point, filesystem type, source, options."""
    out = []
    for line in (proc_text("self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        f = left.split()
        r = right.split()
        out.append({
            "dev": f[2], "root": f[3], "mount_point": _unescape(f[4]),
            "fstype": r[0] if r else "", "source": _unescape(r[1]) if len(r) > 1 else "",
            "super_options": r[2] if len(r) > 2 else "",
        })
    return out


def mount_of(path: str | os.PathLike) -> dict | None:
    """The /proc/self/mountinfo entry of the mount holding ``path`` (longest matching mount point)."""
    real = os.path.realpath(path)
    best = None
    for m in mountinfo():
        mp = m["mount_point"]
        if real == mp or real.startswith(mp.rstrip("/") + "/") or mp == "/":
            if best is None or len(mp) >= len(best["mount_point"]):
                best = m
    return best
