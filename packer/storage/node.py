"""Which machine and which pid space a process is in, and whether the writer of a temporary file in the cache is
gone: a cache folder may be shared by containers and by nodes (docs/remote.md), where a pid means something only in
its own pid namespace on its own kernel."""

from __future__ import annotations

import hashlib
import os
import socket

from packer.sysinfo import proc_link, proc_text, stat_fields

STALE_TEMP_SECONDS = 3600.0  # a temporary file of a writer this process cannot look up is swept past this age
_IDS: dict[str, str] = {}  # the raw boot id and pid namespace, read once


def node_id() -> str:
    """This machine: ``n`` and 12 hex digits of the kernel's boot id (containers of one host share it), else of the
    host name. A cache folder shared by nodes gives each node's downloader its own socket by it."""
    if "node" not in _IDS:
        raw = (proc_text("sys/kernel/random/boot_id") or "").strip()
        _IDS["node"] = raw or socket.gethostname()
    return "n" + hashlib.sha256(_IDS["node"].encode()).hexdigest()[:12]


def pid_space() -> str:
    """Where this process's pid means something: the node and its pid namespace (a container's own), ``n`` and 12
    hex digits. A temporary file's writer is looked up by pid only from the same space."""
    if "pids" not in _IDS:
        _IDS["pids"] = proc_link("self/ns/pid") or ""
    return "n" + hashlib.sha256(f"{node_id()} {_IDS['pids']}".encode()).hexdigest()[:12]


def temp_suffix() -> str:
    """The suffix of a file being written into the cache: ``.tmp-<pid space>-<pid>-<random>``."""
    return f".tmp-{pid_space()}-{os.getpid()}-{os.urandom(4).hex()}"


def temp_writer(name: str) -> tuple[str | None, int | None]:
    """The pid space and pid of the process that named a temporary entry with ``temp_suffix`` (an older packer's
    name has no space: None; a name that is not one: no pid)."""
    parts = name.split(".tmp-", 1)[1].split("-") if ".tmp-" in name else []
    space = parts.pop(0) if parts and parts[0].startswith("n") else None
    return space, int(parts[0]) if parts and parts[0].isdigit() else None


def stale_temp(name: str, mtime: float, now: float) -> bool:
    """A temporary entry left by a writer that is gone (no such pid in this pid space, a minute on) or over an hour
    old (a writer in another container or on another node sharing the folder, whose pid means nothing here)."""
    if now - mtime > STALE_TEMP_SECONDS:
        return True
    space, pid = temp_writer(name)
    if space is not None and space != pid_space():
        return False
    try:
        if pid is None:
            raise ValueError(name)
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return now - mtime > 60
    except PermissionError:
        return False
    return _zombie(pid) and now - mtime > 60  # killed, not reaped yet (a detached downloader's parent is init)


def _zombie(pid: int) -> bool:
    fields = stat_fields(str(pid))
    return bool(fields) and fields[0] == "Z"
