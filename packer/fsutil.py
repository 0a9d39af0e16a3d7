"""Destinations packer writes files into (``extract``, ``sample``): checked before anything is written.

A read-only filesystem, a missing permission or a file where a folder should be is refused up
front with one line naming the path and the reason, instead of a traceback half-way.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from packer.errors import PackerError


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists."""
    probe = Path(os.path.abspath(path))
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    return probe


def why_not_writable(directory: Path) -> str | None:
    """Why files can't be created in the existing ``directory`` (None: they can)."""
    if os.access(directory, os.W_OK | os.X_OK):
        return None
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return "read-only file system"
    except OSError:
        pass
    return "permission denied"


def destination_dir(path: str | os.PathLike, what: str = "destination") -> Path:
    """Create the folder ``path`` (and its parents) after checking that files can be written there.

    Refused with a PackerError naming the path and the reason: a file in the way, a read-only
    filesystem, no permission. Nothing is created when it is refused.
    """
    path = Path(path)
    probe = nearest_existing(path)
    try:
        mode = os.stat(probe).st_mode
    except OSError as exc:  # a dangling link, a loop
        raise PackerError(f"{path}: cannot use {probe} as a folder ({exc.strerror or exc})") from None
    if not stat.S_ISDIR(mode):
        raise PackerError(f"{path}: cannot be the {what}: {probe} is not a folder")
    reason = why_not_writable(probe)
    if reason is not None:
        raise PackerError(f"{path}: cannot write the {what} there ({probe}: {reason})")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PackerError(f"{path}: cannot create the {what} ({exc.strerror or exc})") from None
    return path


def create_temp(directory: Path) -> tuple[int, Path]:
    """A new file ``directory/.packer-<random>.tmp`` open for writing: short whatever the final name's length,
    never through a symlink, never an existing file."""
    while True:
        tmp = directory / f".packer-{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), tmp
        except FileExistsError:
            continue
