"""Sources at a URL (``s3://``, ``gs://``, ``az://``): an ImageFolder-shaped prefix read from object storage.

The listing (every page) gives each object's key, size and ETag; the records are those the local folder source
would find in a folder holding the same files (``write.scan.scan_names``: classes, order, extension filter).
Objects are fetched in the converting process with many GETs in flight (``RemoteReader.admitted``), in record
order, a bounded window ahead of the pool workers, and travel to them with their records: a prefix of small
objects converts at the link's speed, not one round trip per file. Each GET carries the listed ETag (If-Match):
an object replaced, deleted or refused after the listing is an errors.json entry naming its URL, never bytes of
another version. The bytes packed are the object's bytes.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer.errors import PackerError, arg
from packer.storage.faults import ObjectNotFound, StorageError
from packer.storage.store import ObjectStore, wait
from packer.storage.url import Location
from packer.write.scan import scan_names
from packer.write.sources.base import Facts, Payload, RecordError, SourceOptions, SourceReader
from packer.write.sources.records import ClassMapper, ScanResult, Source

IN_FLIGHT = 64  # GETs at once: 100 KB objects at 20 ms first-byte latency need about 32 to fill 1 Gbit/s
AHEAD_BYTES = 64 << 20  # fetched and not yet handed to the workers, at most (one object at least)


@dataclass(frozen=True)
class Listed:
    """A record's locator as listed: the object's size and ETag (the version every GET of it asks for)."""

    size: int
    etag: str | None


@dataclass(frozen=True)
class Fetched:
    """A record's locator once ``admitted`` fetched it: its bytes and facts, or why it could not be read."""

    data: bytes | None
    facts: Facts | None
    error: str | None = None


def object_facts(size: int, etag: str | None) -> Facts:
    """What ``--resume`` compares: the size and a number of the ETag (a new version, a new number)."""
    return [size, int.from_bytes(hashlib.sha256((etag or "").encode()).digest()[:7], "big")]


class RemoteReader(SourceReader):
    """Objects below ``store``'s root by key; ``admitted`` fetches them ``in_flight`` at a time, in order."""

    def __init__(self, store: ObjectStore, in_flight: int = IN_FLIGHT, ahead_bytes: int = AHEAD_BYTES) -> None:
        self.store, self.in_flight, self.ahead_bytes = store, in_flight, ahead_bytes

    def admitted(self, records: Iterable[tuple[str, int, Any]]) -> Iterator[tuple[str, int, Any]]:
        """The records in the order given, each with its object's bytes (``Fetched``) as its locator; up to
        ``in_flight`` GETs and ``ahead_bytes`` are out ahead of the one handed on. Ctrl-C or a consumer that stops
        cancels what is in flight."""
        pending: deque[tuple[tuple[str, int, Any], Future | None]] = deque()
        held, it = 0, iter(records)
        try:
            while True:
                while len(pending) < self.in_flight and (held < self.ahead_bytes or not pending):
                    record = next(it, None)
                    if record is None:
                        break
                    rel, _, loc = record
                    future = self.store.submit_get(rel, etag=loc.etag) if isinstance(loc, Listed) else None
                    held += loc.size if isinstance(loc, Listed) else 0
                    pending.append((record, future))
                if not pending:
                    return
                (rel, label, loc), future = pending.popleft()
                held -= loc.size if isinstance(loc, Listed) else 0
                yield rel, label, loc if future is None else self._landed(rel, future)
        finally:
            for _, future in pending:
                if future is not None:
                    future.cancel()

    def _landed(self, rel: str, future: Future) -> Fetched:
        try:
            data, info = wait(future)
        except StorageError as exc:
            return Fetched(None, None, _reason(exc))
        return Fetched(bytes(data), object_facts(len(data), info.etag))

    def read(self, rel: str, loc: Any) -> tuple[Payload, Facts | None]:
        """The bytes ``admitted`` fetched; a record handed on without them (listed only) is fetched here, one GET."""
        if not isinstance(loc, Fetched):
            loc = self._landed(rel, self.store.submit_get(rel, etag=loc.etag if isinstance(loc, Listed) else None))
        if loc.error is not None or loc.data is None:
            raise RecordError(loc.error or "not fetched")
        return loc.data, loc.facts

    def facts(self, rel: str, loc: Any) -> Facts | None:
        return object_facts(loc.size, loc.etag) if isinstance(loc, Listed) else None

    def size(self, rel: str, loc: Any) -> int | None:
        return loc.size if isinstance(loc, Listed) else None

    def location(self, rel: str, loc: Any) -> str:
        return str(self.store.location(rel))

    def close(self) -> None:
        self.store.close()


def _reason(exc: StorageError) -> str:
    """Why an object listed could not be read, for errors.json (its location is the URL)."""
    return f"{exc}: listed, then gone before it was read" if isinstance(exc, ObjectNotFound) else str(exc)


class RemoteFolderSource(Source):
    """The objects below a prefix (``s3://bucket/train/``) laid out as ImageFolder: ``<class>/**/<image>``."""

    type = "folder"

    def __init__(self, path: Path, options: SourceOptions, location: Location | None = None) -> None:
        super().__init__(path, options)
        if location is None:
            raise PackerError(f"{path}: a folder at a URL is opened by open_remote")
        self.location = location

    @classmethod
    def claims(cls, path: Path) -> bool:
        return False  # chosen by open_remote, never by a local path

    def scan(self, map_classes: ClassMapper | None = None, *, skip_hidden: bool = False,
             allow_empty: bool = False) -> ScanResult:
        store = ObjectStore(self.location.join(""))
        listed = {info.key: info for info in store.list() if not info.key.endswith("/")}
        if not listed:
            raise PackerError(f"{self.location}: no objects below this prefix")
        scan = scan_names(self.path, listed, skip_hidden=skip_hidden, allow_empty=allow_empty)
        scan.reader = RemoteReader(store)
        scan.locs = [Listed(listed[rel].size, listed[rel].etag) for rel in scan.rel_paths]
        scan.url = str(self.location)
        return scan


def open_remote(location: Location, options: SourceOptions) -> Source:
    """The source reading ``location`` (a URL that is no local path): a prefix as an ImageFolder."""
    kind = options.type
    if kind not in (None, "folder"):
        raise PackerError(f"{location}: {arg('source_type', kind)} is not read from object storage yet (a prefix "
                          "laid out as ImageFolder is: --source-type folder)")
    if options.root is not None or options.classes_file is not None:
        raise PackerError(f"{location}: {arg('root')} and {arg('classes_file')} are for list files, not a prefix")
    return RemoteFolderSource(Path(str(location)), options, location)
