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
import itertools
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from packer.errors import DatasetError, PackerError, arg
from packer.storage.client import ObjectInfo
from packer.storage.faults import ObjectNotFound, StorageError
from packer.storage.store import Lanes, ObjectStore, wait
from packer.storage.url import Location
from packer.write.scan import scan_names
from packer.write.sources.base import MAX_LIST_BYTES, Facts, Payload, RecordError, SourceOptions, SourceReader
from packer.write.sources.records import ClassMapper, ScanResult, Source

IN_FLIGHT = 64  # GETs at once: enough to fill a fast link with small objects (docs/remote.md, converting)
AHEAD_BYTES = 64 << 20  # fetched or asked for and not yet handed to the workers, at most (one batch at least)
AHEAD_OBJECTS = 4096  # the same in objects (tiny objects: futures and tasks, not bytes)
BATCH = 16  # GETs handed to the client's loop together, one future for them (docs/remote.md: CPU per object)


@dataclass(frozen=True)
class Listed:
    """A record's locator as listed: the object's size and ETag (the version every GET of it asks for); ``line``:
    the list file's line naming it, if one did."""

    size: int
    etag: str | None
    line: int | None = None


@dataclass(frozen=True)
class Absent:
    """A record a list file names whose object the listing of its root did not hold: an error when read."""

    line: int


@dataclass(frozen=True)
class Fetched:
    """A record's locator once ``admitted`` fetched it: its bytes and facts, or why it could not be read."""

    data: bytes | None
    facts: Facts | None
    error: str | None = None
    line: int | None = None


def object_facts(size: int, etag: str | None) -> Facts:
    """What ``--resume`` compares: the size and a number of the ETag (a new version, a new number)."""
    return [size, int.from_bytes(hashlib.sha256((etag or "").encode()).digest()[:7], "big")]


class RemoteReader(SourceReader):
    """Objects below ``store``'s root by key; ``admitted`` fetches them ``in_flight`` at a time, in order."""

    admitted_where_read = True  # on a cluster each task fetches its shard's objects: they never cross the driver

    def __init__(self, store: ObjectStore, listing: str = "", in_flight: int | None = None,
                 ahead_bytes: int = AHEAD_BYTES, batch: int | None = None, ahead_objects: int = AHEAD_OBJECTS) -> None:
        self.store, self.listing, self.ahead_bytes, self.ahead_objects = store, listing, ahead_bytes, ahead_objects
        self.in_flight, self.batch = in_flight or IN_FLIGHT, max(1, batch or BATCH)

    def admitted(self, records: Iterable[tuple[str, int, Any]]) -> Iterator[tuple[str, int, Any]]:
        """The records in the order given, each with its object's bytes (``Fetched``) as its locator. Records are
        asked for ``batch`` at a time (one hand-over to the client's loop and one future per batch: the CPU per
        small object is what limits their rate) up to ``ahead_bytes``/``ahead_objects`` ahead of the one handed
        on; the loop keeps ``in_flight`` of their GETs out, starting the next as each lands (``Lanes``), so the
        requests in flight depend neither on this consumer's pace nor on a batch's slowest GET. Ctrl-C or a
        consumer that stops cancels what is asked for."""
        pending: deque[tuple[list[tuple[str, int, Any]], Future | None, int, int]] = deque()
        lanes = Lanes.new(self.in_flight)
        held = asked = 0  # bytes and objects asked for and not handed on
        it = iter(records)
        try:
            while True:
                while not pending or (held < self.ahead_bytes and asked < self.ahead_objects):
                    batch = list(itertools.islice(it, self.batch))
                    if not batch:
                        break
                    listed = [(rel, loc.etag) for rel, _, loc in batch if isinstance(loc, Listed)]
                    nbytes = sum(loc.size for _, _, loc in batch if isinstance(loc, Listed))
                    future = self.store.submit_gets(listed, lanes) if listed else None
                    pending.append((batch, future, len(listed), nbytes))
                    held, asked = held + nbytes, asked + len(listed)
                if not pending:
                    return
                batch, future, gets, nbytes = pending.popleft()
                held, asked = held - nbytes, asked - gets
                results = iter(wait(future) if future is not None else [])
                for rel, label, loc in batch:
                    yield rel, label, _fetched(next(results), loc.line) if isinstance(loc, Listed) else loc
        finally:
            for _, future, _, _ in pending:
                if future is not None:
                    future.cancel()

    def _landed(self, future: Future, line: int | None) -> Fetched:
        try:
            return _fetched(wait(future), line)
        except StorageError as exc:
            return _fetched(exc, line)

    def read(self, rel: str, loc: Any) -> tuple[Payload, Facts | None]:
        """The bytes ``admitted`` fetched; a record handed on without them (listed only) is fetched here, one GET."""
        if isinstance(loc, Absent):
            raise RecordError(f"{self.store.location(rel)}: no such object (not listed below {self.store.root})")
        if not isinstance(loc, Fetched):
            listed = loc if isinstance(loc, Listed) else Listed(0, None)
            loc = self._landed(self.store.submit_get(rel, etag=listed.etag), listed.line)
        if loc.error is not None or loc.data is None:
            raise RecordError(loc.error or "not fetched")
        return loc.data, loc.facts

    def facts(self, rel: str, loc: Any) -> Facts | None:
        return object_facts(loc.size, loc.etag) if isinstance(loc, Listed) else None

    def size(self, rel: str, loc: Any) -> int | None:
        return loc.size if isinstance(loc, Listed) else None

    def location(self, rel: str, loc: Any) -> str:
        line = loc.line if isinstance(loc, (Listed, Absent, Fetched)) else None
        where = f" ({self.listing} line {line})" if self.listing and line is not None else ""
        return f"{self.store.location(rel)}{where}"

    def close(self) -> None:
        self.store.close()


def _fetched(result: tuple[Any, ObjectInfo] | StorageError, line: int | None) -> Fetched:
    """A GET's result (its bytes and the object's info, or the error it gave) as a record's locator."""
    if isinstance(result, StorageError):
        return Fetched(None, None, _reason(result), line)
    data, info = result
    return Fetched(bytes(data), object_facts(len(data), info.etag), None, line)


def _reason(exc: StorageError) -> str:
    """Why an object listed could not be read, for errors.json (its location is the URL)."""
    return f"{exc}: listed, then gone before it was read" if isinstance(exc, ObjectNotFound) else str(exc)


class RemoteFolderSource(Source):
    """The objects below a prefix (``s3://bucket/train/``) laid out as ImageFolder: ``<class>/**/<image>``;
    ``listed``: the prefix's listing when already made (``list_prefix``), else listed by ``scan``."""

    type = "folder"

    def __init__(self, path: Path, options: SourceOptions, location: Location | None = None,
                 listed: dict[str, ObjectInfo] | None = None, storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(path, options, storage_options)
        if location is None:
            raise PackerError(f"{path}: a folder at a URL is opened by the registry (open_url)")
        if options.root is not None or options.classes_file is not None:
            raise PackerError(f"{location}: {arg('root')} and {arg('classes_file')} are for list files, not a "
                              "prefix")
        self.location, self.listed = location, listed

    @classmethod
    def claims(cls, path: Path) -> bool:
        return False  # chosen by the registry for a URL, never for a local path

    def scan(self, map_classes: ClassMapper | None = None, *, skip_hidden: bool = False,
             allow_empty: bool = False) -> ScanResult:
        listed = self.listed if self.listed is not None else list_prefix(self.location, self.storage_options)
        scan = scan_names(self.path, listed, skip_hidden=skip_hidden, allow_empty=allow_empty)
        scan.reader = RemoteReader(ObjectStore(self.location.join(""), self.storage_options))
        scan.locs = [Listed(listed[rel].size, listed[rel].etag) for rel in scan.rel_paths]
        scan.url = source_url(self.location)
        return scan


def source_url(location: Location) -> str:
    """A source's URL as the manifest records it: redacted, readable (``{000..009}``, ``é``: not %-escaped)."""
    return unquote(str(location))


def list_prefix(location: Location, storage_options: Mapping[str, Any] | None = None) -> dict[str, ObjectInfo]:
    """Every object below the prefix ``location`` (all pages) by key relative to it; a PackerError when none."""
    with ObjectStore(location.join(""), storage_options) as store:
        listed = {info.key: info for info in store.list_tree() if not info.key.endswith("/")}
    if not listed:
        raise PackerError(f"{location}: no objects below this prefix")
    return listed


def objects_below(root: Location, scan: ScanResult, listing: str, lines: list[int],
                  storage_options: Mapping[str, Any] | None = None) -> ScanResult:
    """``scan`` (a list file's records, keys relative to ``root``) read from the objects below ``root``: one listing
    (every page) gives each its size and ETag; a record whose object it lacks is an error when read (``Absent``)."""
    store = ObjectStore(root, storage_options)
    listed = {info.key: info for info in store.list()}
    scan.locs = [Listed(listed[rel].size, listed[rel].etag, line) if rel in listed else Absent(line)
                 for rel, line in zip(scan.rel_paths, lines)]
    scan.reader = RemoteReader(store, listing)
    return scan


def read_text_object(location: Location, storage_options: Mapping[str, Any] | None = None) -> str:
    """A list file at a URL as text (UTF-8, a BOM dropped); a PackerError naming it when it is too large or not
    text."""
    parent, name = location.key.rpartition("/")[0], location.name
    with ObjectStore(Location(location.scheme, location.bucket, parent, "", location.userinfo),
                     storage_options) as store:
        info = store.head(name)
        if info.size > MAX_LIST_BYTES:
            raise DatasetError(f"{location}: {info.size} bytes is too large for a list file")
        data = store.get(name, etag=info.etag)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{location}: not UTF-8 text (byte {exc.start}): not a list file") from None
