"""Writing that survives a crash: atomic replacement of small files, fsync of files and folders.

One helper for every small file a conversion writes (journal entries, ``errors.json``, the
manifest), so each is either absent or complete after a kill or a power cut, and a failure
(a full disk, a read-only filesystem) is an ``OSError`` that names the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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
    fd = os.open(directory, os.O_RDONLY)
    try:
        with naming(directory):
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
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


def fsync_tree(directory: Path) -> None:
    """Flush every file below ``directory`` and the folders themselves to disk."""
    for dirpath, _dirnames, filenames in os.walk(directory):
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)
