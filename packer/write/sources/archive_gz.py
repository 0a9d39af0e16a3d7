"""A compressed tar (.tar.gz, .tgz): no random access, so it is streamed: once to scan, once more to read.

Records keep the archive's stored order (a gzip stream can't be read in any other without
decompressing it again per record); ``convert`` therefore needs ``--order source`` and one process
reads (workers still validate and decode). Memory stays bounded: one member at a time, and no member
larger than an image can be (``archive_common.declared_problem``, from its header, before it is read);
a member inflating more than ``MAX_RATIO``:1 ends the stream (``GzTar``). Tars inside a compressed tar
are not opened (counted in ``ignored``): decompress it to a .tar for that.
"""

from __future__ import annotations

import os
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from packer.errors import DatasetError
from packer.write.scan import is_image_name
from packer.write.sources.archive_common import (
    MAX_RATIO,
    Members,
    clean_member,
    declared_problem,
    forget_headers,
    inflation_problem,
    records_of,
)
from packer.write.sources.base import Facts, Payload, RecordError, SourceReader, read_one_in_order
from packer.write.sources.records import ScanResult

STREAM_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error)
_CHUNK = 1 << 20  # a member's data passes in reads of this size, its inflation checked after each


class GzTar:
    """A compressed tar streamed once, in stored order, in bounded memory and time.

    ``members`` yields each member's header; its data then passes through ``data`` (by the caller, or
    here when the caller moves on) in 1 MiB reads, with the compressed bytes consumed meanwhile counted:
    a member inflating more than ``MAX_RATIO``:1 stops the stream (``stopped`` says which and why), since
    nothing after it can be reached without inflating it (a 2 MB file can declare and inflate to 2 GiB).
    """

    def __init__(self, path: Path) -> None:
        self.raw = open(path, "rb")  # closed by close()
        try:
            self.tf = tarfile.open(fileobj=self.raw, mode="r|gz")
        except BaseException:
            self.raw.close()
            raise
        self.stopped: tuple[str, str] | None = None  # (member name, reason) of the member the stream stopped at
        self._unread: tarfile.TarInfo | None = None  # the member whose data is still ahead in the stream

    def __enter__(self) -> GzTar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.tf.close()
        finally:
            self.raw.close()

    def members(self) -> Iterator[tuple[int, tarfile.TarInfo]]:
        """(member number, header) in stored order; ends early when a member's data stopped the stream."""
        for n, info in enumerate(self.tf):
            forget_headers(self.tf)
            self._unread = info
            yield n, info
            if self._unread is not None:  # not read by the caller: passed over here, checked the same way
                self.data(info, keep=False)
            if self.stopped is not None:
                return

    def data(self, info: tarfile.TarInfo, keep: bool) -> bytes | str:
        """The member's bytes (b"" unless ``keep``), or why reading it stopped the stream (``inflation_problem``).
        A member cut short raises tarfile's ReadError (one of ``STREAM_ERRORS``)."""
        self._unread = None
        if not info.isreg() or info.size == 0:
            return b""
        fh = self.tf.extractfile(info)
        if fh is None:
            return b""
        start, got, parts = self.raw.tell(), 0, []
        while got < info.size:
            chunk = fh.read(min(_CHUNK, info.size - got))
            if not chunk:
                break
            got += len(chunk)
            if keep:
                parts.append(chunk)
            why = inflation_problem(got, self.raw.tell() - start)
            if why is not None:
                self.stopped = (info.name, why)
                return why
        return b"".join(parts)


def rest_not_read(name: str) -> str:
    """The reason for what follows a member that stopped the stream (``GzTar.stopped``)."""
    return (f"not read: member {name} before it inflates more than {MAX_RATIO}:1, and a compressed stream can't "
            "pass a member without inflating it; the rest is neither packed nor counted")


def scan_tgz(path: Path) -> ScanResult:
    """Stream the archive once: its members in stored order, each located by its number in the stream.

    An image member declaring more than ``member_limit`` is refused from its header; every member's data
    is passed with its inflation watched (``GzTar``), and one inflating like a bomb ends the scan.
    """
    members = Members(path.name)
    count = 0
    try:
        mtime = os.stat(path).st_mtime_ns
        with GzTar(path) as stream:
            for n, info in stream.members():
                count += 1
                rel, bad = clean_member(info.name)
                if bad is not None:
                    members.refuse(rel, bad, info.name)
                elif info.isdir():
                    continue
                elif not info.isreg():
                    members.refuse(rel, "a link or special file: not packed (only regular files are read)",
                                   info.name)
                elif "/" not in rel and rel.lower().endswith(".tar"):
                    members.ignored["tar inside a compressed tar (decompress the archive to read it)"] += 1
                elif is_image_name(rel) and (why := declared_problem(info.size)) is not None:
                    members.refuse(rel, why, info.name)
                else:
                    members.add(rel, (n, info.size), info.name)
                bomb = stream.data(info, keep=False)  # passed over, its inflation watched
                if isinstance(bomb, str):  # the stream ends here
                    if members.found and members.found[-1][1] == (n, info.size):  # kept above: refused instead
                        members.found.pop()
                        members.refuse(rel, bomb, info.name)
                    members.refuse(f"(after {count} members)", rest_not_read(info.name), record=False)
    except STREAM_ERRORS as exc:
        if count == 0:
            raise DatasetError(f"{path}: not a readable .tar.gz archive ({exc})") from None
        members.refuse(f"(after {count} members)", f"truncated or damaged archive ({exc}): the rest of "
                       "it can't be read, and is neither packed nor counted", record=False)
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
            with GzTar(self.path) as stream:
                for n, info in stream.members():
                    while nxt is not None and nxt[1][0] < n:  # a member the stream passed (can't happen in order)
                        yield RecordError("records asked for out of the archive's order")
                        nxt = next(wanted, None)
                    if nxt is None:
                        return
                    if nxt[1][0] == n:
                        yield self._member(stream, info)
                        nxt = next(wanted, None)
                gone = None if stream.stopped is None else rest_not_read(stream.stopped[0])
        except STREAM_ERRORS as exc:
            gone = f"truncated or damaged archive before this member ({type(exc).__name__}: {exc})"
        while nxt is not None:
            yield RecordError(gone or "not in the archive any more (it changed since the scan?)")
            nxt = next(wanted, None)

    def _member(self, stream: GzTar, info: tarfile.TarInfo) -> tuple[Payload, Facts | None] | RecordError:
        """The member's bytes, or why not: a declared size above ``member_limit`` refuses it unread."""
        why = declared_problem(info.size)
        data = stream.data(info, keep=True) if why is None else why
        if isinstance(data, str):
            return RecordError(data)
        if len(data) != info.size:
            return RecordError(f"truncated archive: {len(data)} of the member's {info.size} bytes are there")
        return data, [info.size, self.mtime_ns]

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
