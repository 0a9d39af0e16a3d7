"""A dataset's files against the sizes and sha256 its manifest records, each version of a file hashed once per process.

``packer verify`` checks every file; a packed dataset read as a source (``write.sources.packed``) checks each
shard before its samples are packed, and ``verify --against`` such a source checks the source too. In one
process the same file is hashed once: digests are kept by the file's identity (device, inode, size, mtime and
ctime), so a file changed since is hashed again, and a forked child's copy still describes the same files.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from packer.errors import PackerError
from packer.layout.manifest import FileInfo
from packer.layout.trust import inside

_BLOCK = 1 << 20  # read into one reused buffer: a new 4 MB bytes per read costs a page fault per 4 KiB
Version = tuple[int, int, int, int, int]
_DIGESTS: dict[Version, str] = {}  # file version -> sha256, this process's


def _version(st: os.stat_result) -> Version:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def sha256_of(path: str | os.PathLike) -> str:
    """The sha256 of the file at ``path`` (OSError where it can't be read), from memory when this version of it
    was hashed before in this process. A file that changes while it is hashed is hashed again next time."""
    with open(path, "rb", buffering=0) as fh:
        before = _version(os.fstat(fh.fileno()))
        known = _DIGESTS.get(before)
        if known is not None:
            return known
        digest, buf = hashlib.sha256(), bytearray(_BLOCK)
        view = memoryview(buf)
        while n := fh.readinto(buf):
            digest.update(view[:n])
        result = digest.hexdigest()
        if _version(os.fstat(fh.fileno())) == before:
            _DIGESTS[before] = result
    return result


def file_problem(directory: Path, info: FileInfo) -> str | None:
    """Why the file ``info`` names is not the one the manifest records (missing, leading out of ``directory``,
    another size, another sha256), in ``packer verify``'s words; None when it is."""
    try:
        path = inside(directory, info.name)
        size = path.stat().st_size
        if size != info.num_bytes:
            return f"{path}: {size} bytes, manifest says {info.num_bytes}"
        if sha256_of(path) != info.sha256:
            return f"{path}: checksum mismatch (damaged or modified)"
    except PackerError as exc:
        return str(exc)
    except OSError as exc:
        return f"{directory / info.name}: {exc.strerror or exc}"
    return None
