"""Archives read in place, never extracted: ``.tar`` (also a tar of per-class tars, ImageNet's train layout),
``.zip``, and ``.tar.gz``/``.tgz``.

Inside, the layout is ImageFolder's (``class/**/img.jpg``, or flat), or one tar per class
(``n01440764.tar`` -> class ``n01440764``). Records come in ImageFolder order of their member paths
(``write.scan.imagefolder_key``), except in a compressed tar, which can only be read in its stored
order. What the scan keeps per record is small (a tar member's data offset and size; a zip member's
name), so memory follows the number of members, never their bytes.

| archive      | scan                                    | read (per record, any process)             |
|--------------|-----------------------------------------|--------------------------------------------|
| .tar         | headers only, seeking past the data     | ``os.pread`` of (offset, size): no tarfile |
| nested .tar  | each class tar's headers, in place      | the same: outer + inner data offset        |
| .zip         | the central directory                   | a per-process ``ZipFile``; CRC checked     |
| .tar.gz      | streams once (decompressing everything) | streams again, in order, in one process    |

Links, devices, names with ``..`` or absolute, duplicates, data past the end of a truncated tar,
a zip or .tar.gz member compressed more than ``MAX_RATIO`` to 1, a .tar.gz image member declaring more
bytes than an image within the pixel limit: each is an errors.json entry naming the member.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path
from typing import Any

from packer.errors import DatasetError, InputNotFoundError, PackerError
from packer.perprocess import PerProcess
from packer.write.sources.archive_common import Members, archive_kind, clean_member, forget_headers, records_of
from packer.write.sources.archive_gz import scan_tgz
from packer.write.sources.archive_zip import scan_zip
from packer.write.sources.base import Facts, Payload, RecordError, SourceReader
from packer.write.sources.records import ClassMapper, ScanResult, Source


class ArchiveSource(Source):
    """A .tar, .tar.gz/.tgz or .zip laid out as ImageFolder inside, or a tar of per-class tars."""

    type = "archive"

    @classmethod
    def claims(cls, path: Path) -> bool:
        return path.is_file() and archive_kind(path) is not None

    def sequential(self) -> bool:
        return archive_kind(self.path) == "tgz"

    def scan(self, map_classes: ClassMapper | None = None, *, skip_hidden: bool = False,
             allow_empty: bool = False) -> ScanResult:
        path = self.path
        kind = archive_kind(path)
        if not path.is_file():
            raise InputNotFoundError(f"{path}: no such archive")
        if kind == "zip":
            return scan_zip(path)
        if kind == "tgz":
            return scan_tgz(path)
        if kind is None:
            raise PackerError(f"{path}: not an archive packer reads (.tar, .tar.gz, .tgz, .zip)")
        return scan_tar(path)


# ---------------------------------------------------------------- uncompressed tar (and tars inside it)


class _Window:
    """A read-only file over bytes [start, start + size) of an open file: a member tar read in place."""

    def __init__(self, fd: int, start: int, size: int) -> None:
        self.fd, self.start, self.size, self.pos = fd, start, size, 0

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n is None or n < 0 else min(n, self.size - self.pos)
        data = os.pread(self.fd, n, self.start + self.pos) if n > 0 else b""
        self.pos += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos


def _headers(fileobj: Any, where: str, members: Members, prefix: str = "", base: int = 0,
             total: int | None = None) -> list[tuple[str, int, int]]:
    """Walk a tar's headers (seeking past the data); regular files come back as (name, data offset, size).

    ``base``: where this tar starts in the outer file (its offsets are made absolute); ``total``: the
    outer file's size (a member whose data runs past it is truncated). Links, devices and bad names go
    to ``members`` as errors; an unreadable header ends the walk with one error naming where.
    """
    files: list[tuple[str, int, int]] = []
    try:
        tf = tarfile.open(fileobj=fileobj, mode="r:")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise DatasetError(f"{where}: not a readable tar archive ({exc})") from None
    count = 0
    while True:
        try:
            info = tf.next()
        except (tarfile.TarError, EOFError, OSError) as exc:
            members.refuse(f"{prefix}(after {count} members)", f"truncated or damaged archive ({exc}): the rest "
                           "of it can't be read, and is neither packed nor counted", record=False)
            break
        if info is None:
            break
        forget_headers(tf)
        count += 1
        rel, bad = clean_member(info.name)
        shown = prefix + info.name
        if bad is not None:
            members.refuse(prefix + rel, bad, shown)
        elif info.isdir():
            continue
        elif not info.isreg():
            kind = ("a symbolic link" if info.issym() else "a hard link" if info.islnk()
                    else "a device or special file")
            members.refuse(prefix + rel, f"{kind}: not packed (only regular files are read)", shown)
        elif total is not None and base + info.offset_data + info.size > total:
            members.refuse(prefix + rel, "truncated archive: the member's data runs past its end", shown)
        else:
            files.append((rel, base + info.offset_data, info.size))
    return files


def scan_tar(path: Path) -> ScanResult:
    """An uncompressed tar: its members' offsets, and those of the images in class tars (``X.tar`` -> class X)."""
    members = Members(path.name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise PackerError(f"{path}: cannot open ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        for rel, offset, size in _headers(_Window(fd, 0, st.st_size), str(path), members, total=st.st_size):
            if "/" not in rel and rel.lower().endswith(".tar"):
                _nested(fd, path, rel, offset, size, members, st.st_size)
            else:
                members.add(rel, (offset, size))
    finally:
        os.close(fd)
    return records_of(path, members, TarReader(path, st.st_mtime_ns), ordered=True)


def _nested(fd: int, path: Path, rel: str, offset: int, size: int, members: Members, total: int) -> None:
    """The images of class tar ``rel`` (one class: its name less .tar), read in place."""
    cls = rel[: -len(".tar")]
    try:
        inner = _headers(_Window(fd, offset, size), f"{path}: member {rel}", members, f"{rel}/", offset, total)
    except PackerError as exc:
        members.refuse(rel, str(exc).split(": ", 2)[-1], record=False)
        return
    for name, data_offset, data_size in inner:
        members.add(f"{cls}/{name}", (data_offset, data_size), f"{rel}/{name}")


class TarReader(SourceReader):
    """Reads a member's bytes at (offset, size) with one pread: no tarfile object per read; one fd per process."""

    def __init__(self, path: Path, mtime_ns: int) -> None:
        self.path, self.mtime_ns = path, mtime_ns
        self._fd: PerProcess[int] = PerProcess(self._open, inherited=os.close)

    def _open(self) -> int:
        return os.open(self.path, os.O_RDONLY)

    def read(self, rel: str, loc: Any) -> tuple[Payload, Facts | None]:
        offset, size = loc
        try:
            data = os.pread(self._fd.get(), size, offset)
        except OSError as exc:
            raise RecordError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        if len(data) != size:
            raise RecordError(f"truncated archive: {len(data)} of the member's {size} bytes are there")
        return data, [size, self.mtime_ns]

    def facts(self, rel: str, loc: Any) -> Facts | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return [loc[1], st.st_mtime_ns] if loc[0] + loc[1] <= st.st_size else None

    def size(self, rel: str, loc: Any) -> int | None:
        return loc[1]

    def location(self, rel: str, loc: Any) -> str:
        return f"{self.path.name}: member {rel} at byte {loc[0]}"

    def missing(self) -> str | None:
        return None if self.path.is_file() else f"cannot see the archive {self.path}"

    def close(self) -> None:
        self._fd.close(os.close)
