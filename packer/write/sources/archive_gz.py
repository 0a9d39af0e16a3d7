"""A compressed tar (.tar.gz, .tgz): no random access, so it is streamed: once to scan, once more to read.

Records keep the archive's stored order (a gzip stream can't be read in any other without
decompressing it again per record); ``convert`` therefore needs ``--order source`` and one process
reads (workers still validate and decode). Memory stays bounded: one member at a time. Tars inside
a compressed tar are not opened (counted in ``ignored``): decompress it to a .tar for that.
"""

from __future__ import annotations

import os
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from packer.errors import DatasetError, PackerError
from packer.write.scan import ScanResult
from packer.write.sources.archive_common import Members, clean_member, forget_headers, records_of
from packer.write.sources.base import Facts, Payload, RecordError, SourceReader, read_one_in_order

_STREAM_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error)


def _stream(path: Path) -> Iterator[tuple[int, tarfile.TarInfo, tarfile.TarFile]]:
    """(member number, header, the open stream) for each member, in stored order, bounded memory."""
    with tarfile.open(path, mode="r|gz") as tf:
        for n, info in enumerate(tf):
            forget_headers(tf)
            yield n, info, tf


def scan_tgz(path: Path) -> ScanResult:
    """Stream the archive once: its members in stored order, each located by its number in the stream."""
    members = Members(path.name)
    try:
        mtime = os.stat(path).st_mtime_ns
        stream = _stream(path)
        count = 0
        while True:
            try:
                item = next(stream, None)
            except _STREAM_ERRORS as exc:
                if count == 0:
                    raise DatasetError(f"{path}: not a readable .tar.gz archive ({exc})") from None
                members.refuse(f"(after {count} members)", f"truncated or damaged archive ({exc}): the rest of "
                               "it can't be read, and is neither packed nor counted")
                break
            if item is None:
                break
            n, info, _ = item
            count += 1
            rel, bad = clean_member(info.name)
            if bad is not None:
                members.refuse(rel, bad, info.name)
            elif info.isdir():
                continue
            elif not info.isreg():
                members.refuse(rel, "a link or special file: not packed (only regular files are read)", info.name)
            elif "/" not in rel and rel.lower().endswith(".tar"):
                members.ignored["tar inside a compressed tar (decompress the archive to read it)"] += 1
            else:
                members.add(rel, (n, info.size), info.name)
    except OSError as exc:
        raise PackerError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return records_of(path, members, GzTarReader(path, mtime), ordered=False)


class GzTarReader(SourceReader):
    """Streams the archive and hands out the wanted members' bytes, in stored order (``sequential``)."""

    sequential = True

    def __init__(self, path: Path, mtime_ns: int) -> None:
        self.path, self.mtime_ns = path, mtime_ns

    def read(self, rel: str, loc: Any) -> tuple[Payload, Facts | None]:
        return read_one_in_order(self, rel, loc)

    def read_in_order(self, records: Iterable[tuple[str, Any]]) -> Iterator[tuple[Payload, Facts | None] | RecordError]:
        wanted = iter(records)
        nxt = next(wanted, None)
        if nxt is None:
            return
        try:
            for n, info, tf in _stream(self.path):
                while nxt is not None and nxt[1][0] < n:  # a member the stream passed (can't happen in order)
                    yield RecordError("records asked for out of the archive's order")
                    nxt = next(wanted, None)
                if nxt is None:
                    return
                if nxt[1][0] == n:
                    fh = tf.extractfile(info)
                    data = fh.read() if fh is not None else b""
                    yield (data, [info.size, self.mtime_ns]) if len(data) == info.size else RecordError(
                        f"truncated archive: {len(data)} of the member's {info.size} bytes are there")
                    nxt = next(wanted, None)
        except _STREAM_ERRORS as exc:
            reason = f"truncated or damaged archive before this member ({type(exc).__name__}: {exc})"
            while nxt is not None:
                yield RecordError(reason)
                nxt = next(wanted, None)
            return
        while nxt is not None:
            yield RecordError("not in the archive any more (it changed since the scan?)")
            nxt = next(wanted, None)

    def facts(self, rel: str, loc: Any) -> Facts | None:
        try:
            return [loc[1], os.stat(self.path).st_mtime_ns]
        except OSError:
            return None

    def size(self, rel: str, loc: Any) -> int | None:
        return loc[1]

    def location(self, rel: str, loc: Any) -> str:
        return f"{self.path.name}: member {rel} (number {loc[0]})"

    def missing(self) -> str | None:
        return None if self.path.is_file() else f"cannot see the archive {self.path}"
