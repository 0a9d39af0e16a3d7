"""The filesystem work packer does on its outputs, in one place: destinations checked before anything is
written (``extract``, ``sample``), and writes that survive a crash (atomic replacement of small files, fsync of
files and folders: journal entries, ``errors.json``, the manifest are each absent or complete after a kill).

A read-only filesystem, a missing permission or a file where a folder should be is refused up front with one
line naming the path and the reason; an OSError while writing names the file.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from packer.errors import OutputExistsError, PackerError


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
        raise OutputExistsError(f"{path}: cannot be the {what}: {probe} is not a folder")
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


@contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Make an ``OSError`` raised inside name ``path`` (a failed write or flush names no file)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = os.fspath(path)
        raise


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename or a new file inside it) to disk."""
    fsync_file(directory)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file (or a folder's entries) to disk; an error names the path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        with naming(path):
            os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it, fsynced, renamed, folder fsynced.

    On failure the temporary file is removed and the ``OSError`` names ``path``.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        with naming(path), open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # the error that matters is the one being raised
        raise
    with naming(path):
        os.replace(tmp, path)
    fsync_dir(path.parent)


def write_plain(path: Path, text: str) -> None:
    """Write ``path`` with no flush of its own (a caller's ``fsync_tree`` follows); the ``OSError`` names ``path``."""
    with naming(path), open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def fsync_tree(directory: Path) -> None:
    """Flush every file below ``directory`` and the folders themselves to disk."""
    for dirpath, _dirnames, filenames in os.walk(directory):
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)
