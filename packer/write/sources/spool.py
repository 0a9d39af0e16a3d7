"""Sources at a URL that are files: tar/zip archives, WebDataset shards (one, a brace pattern or a prefix of them),
Parquet/Arrow files, an MXNet ``.rec`` (with its ``.idx`` beside it) and a packer dataset (every object below its
prefix). Each object is downloaded whole into a local folder first (``TMPDIR``; ranged GETs of
``CHUNK`` bytes, many in flight, each If-Match the listed ETag, written in place), then read by the local source of
its kind, by the same rules (docs/sources.md). The folder needs room for the objects (checked before the first
byte) and is removed once the conversion no longer holds the scan.

Large objects read sequentially gain nothing from per-record GETs (a tar's headers lie between its members: one
round trip each), so a shard is fetched at the link's speed as one object instead.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from packer.errors import PackerError
from packer.storage.faults import StorageError
from packer.storage.store import ObjectStore, wait
from packer.storage.url import Location
from packer.units import human_bytes
from packer.write.sources.base import SourceOptions
from packer.write.sources.records import ClassMapper, ScanResult, Source
from packer.write.sources.remote import source_url
from packer.write.sources.wdstar import expand_braces

SPOOLED_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip", ".parquet", ".arrow")
SPOOLED_TYPES = ("webdataset", "archive", "hf", "recordio", "packed")  # --source-type kinds read from a local copy
COMPANIONS = {".rec": ".idx"}  # a file named by its URL, and the one beside it fetched with it when there
CHUNK = 8 << 20  # bytes per GET of an object being downloaded
IN_FLIGHT = 16  # GETs at once (CHUNK each: the memory bound of a download)
ROOM = 256 << 20  # free space left beside the objects, at least

Opener = Callable[[Path, SourceOptions, Mapping[str, Any] | None], Source]


def is_spooled(location: Location) -> bool:
    """Whether ``location`` names files read whole: a name ending in ``SPOOLED_SUFFIXES`` (or an MXNet ``.rec``) or
    a brace pattern."""
    return location.key.lower().endswith((*SPOOLED_SUFFIXES, *COMPANIONS)) or "{" in location.key


def holds_files(names: list[str]) -> bool:
    """Whether the keys listed below a prefix are files read whole (shards, archives, Parquet) and no images:
    the prefix is then read as the folder of those files, not as an ImageFolder."""
    seen = [n for n in names if not posixpath.basename(n).startswith(".")]
    return bool(seen) and all(n.lower().endswith(SPOOLED_SUFFIXES + (".txt", ".json")) for n in seen) and any(
        n.lower().endswith(SPOOLED_SUFFIXES) for n in seen)


class LocalCopy:
    """A temporary folder for the objects, removed when dropped (or at exit) by the process that made it only:
    forked pool workers that inherit it never remove it under the others."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="packer-source-"))
        self._remove = weakref.finalize(self, _remove, self.path, os.getpid())

    def cleanup(self) -> None:
        self._remove()


def _remove(path: Path, pid: int) -> None:
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


class SpooledSource(Source):
    """Objects downloaded into a local folder, then read by the local source ``open_local`` gives for it (with the
    same ``storage_options``: a ``--classes-file`` may be at a URL too)."""

    type = "spooled"  # never recorded: the manifest records the local source's type (``local().type``)

    def __init__(self, path: Path, options: SourceOptions, location: Location, open_local: Opener,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(path, options, storage_options)
        self.location, self.open_local = location, open_local
        self._folder: LocalCopy | None = None
        self._local: Source | None = None

    @classmethod
    def claims(cls, path: Path) -> bool:
        return False  # chosen by the registry for a URL, never for a local path

    def local(self) -> Source:
        """The local source over the downloaded objects (downloaded on first use)."""
        if self._local is None:
            folder = LocalCopy()
            try:
                self._local = self.open_local(download(self.location, folder.path, self.storage_options),
                                              self.options, self.storage_options)
            except BaseException:
                folder.cleanup()
                raise
            self._folder = folder
        return self._local

    def sequential(self) -> bool:
        """A compressed archive named is known by its name, before a byte is downloaded; others once downloaded."""
        return self.location.key.lower().endswith((".tar.gz", ".tgz")) or self.local().sequential()

    def scan(self, map_classes: ClassMapper | None = None, *, skip_hidden: bool = False,
             allow_empty: bool = False) -> ScanResult:
        scan = self.local().scan(map_classes, skip_hidden=skip_hidden, allow_empty=allow_empty)
        scan.url, scan.held = source_url(self.location), self._folder
        return scan


def download(location: Location, folder: Path, storage_options: Mapping[str, Any] | None = None) -> Path:
    """The objects ``location`` names, downloaded below ``folder`` by their names relative to the prefix listed;
    the local path that names them as ``location`` did (a file, a brace pattern, or ``folder`` for a prefix)."""
    key = location.key
    brace = key.find("{")
    base = key[:brace].rpartition("/")[0] if brace >= 0 else (key.rpartition("/")[0] if is_spooled(location)
                                                                 else key.rstrip("/"))
    store = ObjectStore(Location(location.scheme, location.bucket, base, "", location.userinfo), storage_options)
    try:
        listed = {info.key: info for info in store.list() if not info.key.endswith("/")}
        inner = key[len(base):].lstrip("/")
        if brace >= 0:
            wanted = [n for n in expand_braces(inner) if n in listed]  # a shard not there: the local source says so
        elif is_spooled(location):
            if inner not in listed:
                raise PackerError(f"{location}: no such object")
            stem, suffix = posixpath.splitext(inner)
            beside = stem + COMPANIONS.get(suffix.lower(), suffix)
            wanted = [inner] + ([beside] if beside != inner and beside in listed else [])
        else:
            wanted = sorted(listed)
        if not wanted and brace < 0:
            raise PackerError(f"{location}: no objects below this prefix")
        unsafe = [n for n in wanted if posixpath.normpath(n) != n or n.startswith(("/", "../")) or "\\" in n]
        if unsafe:
            raise PackerError(f"{store.location(unsafe[0])}: a key that names no file below a folder ('..', '//')")
        folders = {n[:i] for n in wanted for i in range(len(n)) if n[i] == "/"}
        clash = sorted(folders.intersection(wanted))
        if clash:  # an object "a" and an object "a/b": no local folder holds both
            raise PackerError(f"{store.location(clash[0])}: an object and a folder of objects of the same name; a "
                              "local copy cannot hold both (move one away)")
        total = sum(listed[n].size for n in wanted)
        free = shutil.disk_usage(folder).free
        if total + ROOM > free:
            raise PackerError(f"{location}: its objects ({human_bytes(total)}) are read whole from a local copy, "
                              f"and {folder.parent} has {human_bytes(free)} free (set TMPDIR to a folder with room)")
        fetch(store, [(n, listed[n].size, listed[n].etag) for n in wanted], folder)
    finally:
        store.close()
    return folder / inner if inner else folder


def fetch(store: ObjectStore, objects: list[tuple[str, int, str | None]], folder: Path) -> None:
    """Each (key, size, etag) written to ``folder/key``: ``CHUNK``-byte ranged GETs, ``IN_FLIGHT`` at once, each
    If-Match its ETag (an object replaced meanwhile is an error, never a mix of versions)."""
    fds: dict[str, int] = {}
    todo = deque((key, start, min(start + CHUNK, size), etag) for key, size, etag in objects
                 for start in range(0, size, CHUNK))
    pending: deque[tuple[str, int, Future]] = deque()
    try:
        for key, size, _ in objects:
            path = folder / key
            path.parent.mkdir(parents=True, exist_ok=True)
            fds[key] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            if size:
                os.ftruncate(fds[key], size)
        while todo or pending:
            while todo and len(pending) < IN_FLIGHT:
                key, start, end, etag = todo.popleft()
                pending.append((key, start, store.submit_get(key, start, end, etag=etag)))
            key, start, future = pending.popleft()
            try:
                data, _ = wait(future)
            except StorageError as exc:
                raise PackerError(f"{exc} (downloading it to read it whole)") from None
            view = memoryview(data)
            while view:
                view = view[os.pwrite(fds[key], view, start + len(data) - len(view)):]
    finally:
        for _, _, future in pending:
            future.cancel()
        for fd in fds.values():
            os.close(fd)
