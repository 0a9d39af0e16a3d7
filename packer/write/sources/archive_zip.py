"""A .zip read in place: the central directory lists the members; each process opens its own ``ZipFile``.

Refused members (errors.json entries naming them): links, names with ``..`` or absolute, encrypted
ones, those larger than ``MAX_MEMBER_BYTES`` or compressed more than ``MAX_RATIO`` to 1 (a zip bomb);
a wrong CRC is found when the member is read.
"""

from __future__ import annotations

import os
import stat
import zipfile
import zlib
from pathlib import Path
from typing import Any

from packer.errors import DatasetError
from packer.perprocess import PerProcess
from packer.write.sources.archive_common import MAX_RATIO, Members, clean_member, records_of
from packer.write.sources.base import Facts, Payload, RecordError, SourceReader
from packer.write.sources.records import ScanResult

MAX_MEMBER_BYTES = 1 << 30  # no image file is larger


def _refusal(info: zipfile.ZipInfo) -> str | None:
    """Why a regular-looking member is not read, or None."""
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        return "a symbolic link: not packed (only regular files are read)"
    if stat.S_IFMT(mode) and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):  # no type bits: a plain file
        return "a device or special file: not packed"
    if info.flag_bits & 0x1:
        return "encrypted: not packed"
    if info.file_size > MAX_MEMBER_BYTES:
        return f"{info.file_size} bytes uncompressed: larger than any image, not read"
    if info.file_size > (1 << 20) and info.file_size > MAX_RATIO * max(info.compress_size, 1):
        return (f"compressed {info.file_size // max(info.compress_size, 1)}:1 (more than {MAX_RATIO}:1, a zip bomb?): "
                "not read")
    return None


def scan_zip(path: Path) -> ScanResult:
    """The members of a zip from its central directory (nothing is decompressed)."""
    members = Members(path.name)
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
        mtime = os.stat(path).st_mtime_ns
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise DatasetError(f"{path}: not a readable zip archive ({exc})") from None
    for info in infos:
        rel, bad = clean_member(info.filename)
        if bad is None and info.is_dir():
            continue
        why = bad if bad is not None else _refusal(info)
        if why is not None:
            members.refuse(rel, why, info.filename)
        else:
            members.add(rel, info.filename, info.filename)
    return records_of(path, members, ZipReader(path, mtime), ordered=True)


class ZipReader(SourceReader):
    """Reads a member by name with this process's own ``ZipFile``; zipfile checks the CRC at the end."""

    def __init__(self, path: Path, mtime_ns: int) -> None:
        self.path, self.mtime_ns = path, mtime_ns
        self._zip: PerProcess[zipfile.ZipFile] = PerProcess(self._open)

    def _open(self) -> zipfile.ZipFile:
        return zipfile.ZipFile(self.path)

    def read(self, rel: str, loc: Any) -> tuple[Payload, Facts | None]:
        try:
            zf = self._zip.get()
            info = zf.getinfo(loc)
            with zf.open(info) as fh:
                data = fh.read(MAX_MEMBER_BYTES + 1)
        except zipfile.BadZipFile as exc:
            raise RecordError(f"damaged zip member ({exc})") from None
        except (OSError, EOFError, zlib.error, KeyError, ValueError, NotImplementedError) as exc:
            raise RecordError(f"cannot read the zip member ({type(exc).__name__}: {exc})") from None
        return data, [info.file_size, self.mtime_ns]

    def facts(self, rel: str, loc: Any) -> Facts | None:
        try:
            st = os.stat(self.path)
            return [self._zip.get().getinfo(loc).file_size, st.st_mtime_ns]
        except (OSError, KeyError, zipfile.BadZipFile):
            return None

    def size(self, rel: str, loc: Any) -> int | None:
        return None

    def location(self, rel: str, loc: Any) -> str:
        return f"{self.path.name}: member {loc}"

    def missing(self) -> str | None:
        return None if self.path.is_file() else f"cannot see the archive {self.path}"

    def close(self) -> None:
        self._zip.close(lambda zf: zf.close())
