"""A packer dataset at a URL (s3://, gs://, az://, http(s)://), opened the way a local one is.

Its metadata (``manifest.json``, the ``meta/`` files, ``errors.json``) is fetched once per node into a folder of
the node's cache, ``datasets/<URL digest>/<manifest ETag digest>/``, and checked there by the same code as a local
dataset's (``load_manifest``, ``Index.load``, ``load_fields``: every check, sizes and sha256s). Every open
revalidates it with one HEAD of the manifest (a new ETag: a new folder) and records every object's size and ETag
(one listing of the dataset's prefix; HEADs in flight where the scheme cannot list, http(s)); every later GET
carries that ETag as If-Match, so a dataset replaced in the bucket while a job reads it is reported
(``DatasetReplaced``), never mixed. The bytes come through the node's downloader (packer/storage/downloader.py):
ranges of shard objects (``fetch_ranges``) or whole shards (``fetch_shard``, into ``files/<...>/<name>``, where
the format's own reader opens them by their manifest names), checked before use, the cache bounded by
``cache_limit``. Credentials (the environment, ``storage_options=``) reach the downloader only: never a file,
message or ``repr`` here. Pickled (a spawned DataLoader worker's copy), it holds the URL and digests of the
manifest and of ``objects-<digest>.json`` (every object's size and ETag as opened, written beside it once): the
copy reloads both and the index from the node's cache, checked, asking the store nothing.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer import sysinfo
from packer.errors import DatasetError, InputNotFoundError, PackerError, SharedCacheWarning
from packer.layout.fields import FieldStore, load_fields
from packer.layout.index import Index
from packer.layout.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, load_manifest, sha256_file
from packer.layout.report import ERRORS_NAME, MAX_ERRORS_BYTES
from packer.layout.trust import read_inside
from packer.perprocess import PerProcess
from packer.storage.client import ObjectInfo, StoreSpec
from packer.storage.downloader_client import DownloaderClient, wait_all
from packer.storage.faults import ObjectChanged, ObjectNotFound, RetryPolicy
from packer.storage.node import temp_suffix
from packer.storage.protocol import cache_root, limit_bytes, range_name, store_identity
from packer.storage.url import parse

log = logging.getLogger(__name__)
LISTS = ("s3", "gs", "az")  # schemes whose objects are listed at open; http(s) gets a HEAD per object


class DatasetReplaced(ObjectChanged):
    """An object of the dataset no longer has the ETag recorded when the dataset was opened: the dataset was
    replaced (or a file of it rewritten) while the job read it. Nothing of the new version was used."""


def default_cache_dir() -> Path:
    """Where the command line keeps its cache: ``$XDG_CACHE_HOME/packer``, else ``~/.cache/packer``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "packer"


def warn_if_shared(cache_dir: Path) -> None:
    """Warn (SharedCacheWarning) when ``cache_dir`` lies on a network or parallel filesystem (docs/remote.md)."""
    mount = sysinfo.mount_of(cache_dir)
    kind = sysinfo.fs_kind(mount["fstype"] if mount else None)
    if kind in ("network", "parallel"):
        warnings.warn(f"cache_dir {cache_dir} is on a {kind} filesystem ({mount and mount['fstype']} at "
                      f"{mount and mount['mount_point']}): a node-local disk is the safe and faster choice "
                      "(docs/remote.md)", SharedCacheWarning, stacklevel=3)


def is_remote(location: str | os.PathLike) -> bool:
    """A URL naming object storage (s3, gs, az, http(s)); a path or a ``file://`` URL is local."""
    return isinstance(location, str) and "://" in location and not parse(location).is_local


@dataclass(frozen=True)
class RemoteFile:
    """A file of the dataset as the store holds it: its name in the dataset, size and ETag at open."""

    name: str
    size: int
    etag: str | None


class RemoteDataset:
    """The dataset at ``url``: manifest, index and fields checked, every object's ETag recorded. ``cache_dir``:
    the node's cache (shared by every process and rank using it); ``cache_limit``: the disk it may use ("20GB";
    None: leave it to the node's other clients);
    ``strict``: raise the first problem found at open (a file missing or of another size), else keep them in
    ``problems`` (``packer info``). Picklable: a forked or spawned process reads through its own connection to
    the same downloader, re-fetching nothing."""

    def __init__(self, url: str, cache_dir: str | os.PathLike, cache_limit: int | str | None = "20GB",
                 storage_options: Mapping[str, Any] | None = None, policy: RetryPolicy | None = None, *,
                 strict: bool = True, linger: float = 2.0) -> None:
        self.location = parse(url)
        if self.location.is_local:
            raise PackerError(f"{self.location}: a local path, not object storage (open it as a folder)")
        self.spec = StoreSpec(self.location.url, dict(storage_options or {}), policy or RetryPolicy())
        self.cache_dir = Path(cache_dir).absolute()
        warn_if_shared(self.cache_dir)
        self.cache_limit = limit_bytes(cache_limit)
        self.linger = linger
        self._client: PerProcess[DownloaderClient] = PerProcess(self._connect, inherited=DownloaderClient.forget)
        key = hashlib.sha256(store_identity(self.spec).encode()).hexdigest()[:24]
        self._key = key
        try:
            for attempt in range(3):
                try:
                    self._open(strict)
                    break
                except DatasetReplaced:
                    if attempt == 2:
                        raise
        except BaseException:
            self.close()  # a failed open leaves no connection (nor its thread) behind
            raise

    def _connect(self) -> DownloaderClient:
        return DownloaderClient(self.cache_dir, self.cache_limit, linger=self.linger)

    @property
    def client(self) -> DownloaderClient:
        """This process's connection to the node's downloader."""
        return self._client.get()

    def where(self, name: str = "") -> str:
        """A file of the dataset as messages name it: its URL, redacted."""
        return str(self.location.join(name) if name else self.location)

    # ---- open: revalidate, list, fetch the metadata once per node, check it as a local dataset's ----

    def _open(self, strict: bool) -> None:
        client = self.client
        try:
            head = client.head(self.spec, MANIFEST_NAME)
        except ObjectNotFound:
            raise InputNotFoundError(f"{self.where()}: no packer dataset there ({MANIFEST_NAME} is missing: not a "
                                     "dataset, or an upload that did not finish)") from None
        version = hashlib.sha256(f"{head.etag}\0{head.size}".encode()).hexdigest()[:16]
        self.version = head.etag
        self.folder = cache_root(self.cache_dir) / "datasets" / self._key / version
        self.files_dest = f"files/{self._key}/{version}"
        listed = self._list() if self.location.scheme in LISTS else None
        self._fetch_meta(RemoteFile(MANIFEST_NAME, head.size, head.etag), None)
        where = self.where(MANIFEST_NAME)
        # the objects under the prefix bound the files a manifest may list (http(s) can't list: HEADs follow)
        held = len(listed) if listed is not None else None
        self.manifest_sha256 = sha256_file(self.folder / MANIFEST_NAME)  # what an unpickled copy reloads
        manifest = load_manifest(self.folder, where, lambda n: n if held is None else held, self.manifest_sha256)
        self.manifest_object = RemoteFile(MANIFEST_NAME, head.size, head.etag)
        listing = self._objects(listed, manifest)
        self.objects = listing
        if any(f.etag is None for f in listing.values()):
            log.warning("%s: the server sends no ETag for some objects: a dataset replaced there while a job reads it "
                        "cannot be detected", self.where())
        self.problems = manifest.size_problems({n: f.size for n, f in listing.items()}, self.where)
        if self.problems and strict:
            raise DatasetError(self.problems[0])
        self.manifest = manifest
        manifest.pickle_as((getattr, (self, "manifest")))
        errors = listing.get(ERRORS_NAME)
        if errors is not None and errors.size > MAX_ERRORS_BYTES:
            raise DatasetError(f"{self.where(ERRORS_NAME)}: implausibly large ({errors.size} bytes, at most "
                               f"{MAX_ERRORS_BYTES} expected)")
        self._load_meta([errors] if errors is not None else [])

    def _objects(self, listed: dict[str, RemoteFile] | None, manifest: Manifest) -> dict[str, RemoteFile]:
        """Every object of the dataset: the manifest's files and errors.json, from ``listed`` under its prefix (other
        objects there are not the dataset's: one added later must not read as the dataset replaced), else (http(s)
        can't list) by HEAD; the manifest as opened."""
        names = [f.name for f in manifest.all_files()] + [ERRORS_NAME]
        listing = ({n: listed[n] for n in names if n in listed} if listed is not None else self._heads(names))
        listing[MANIFEST_NAME] = self.manifest_object
        return listing

    def _load_meta(self, also: Sequence[RemoteFile] = ()) -> None:
        """Fetch the manifest's ``meta/`` files (and ``also``) into the node's cache (hits where they are there:
        one message each) and load the index and fields from them, checked as a local dataset's. Each pickles as a
        reference to this dataset, which reloads them so (``__setstate__``): a spawned worker's pickle holds no
        per-sample array."""
        manifest, listing = self.manifest, self.objects
        good = [f for f in manifest.meta_files if f.name in listing and listing[f.name].size == f.num_bytes]
        wait_all([self._fetch_meta(listing[f.name], f.sha256, wait=False) for f in good]
                 + [self._fetch_meta(f, None, wait=False) for f in also])
        if len(good) < len(manifest.meta_files):
            self.index: Index | None = None  # a meta file is missing: self.problems says which
            self.fields: FieldStore | None = None
            return
        self.index = Index.load(self.folder, manifest.num_samples, files=manifest.meta_files,
                                num_classes=len(manifest.classes), source_records=manifest.source_records)
        self.fields = load_fields(self.folder, manifest)
        self.index.pickle_as((getattr, (self, "index")))
        self.fields.pickle_as((getattr, (self, "fields")))

    def __getstate__(self) -> dict:
        """The URL, the version opened and digests of its manifest and of the record of every object's size and
        ETag (written into the node's cache once), not what grows with the shards or samples: the unpickled copy
        reloads them from there, checked (``__setstate__``), and reads exactly what this one opened (a file
        replaced in the bucket since is ``DatasetReplaced`` there too). Unpickled on another node (or after the
        cache was cleared), it fetches the manifest and lists the objects again: they must be those opened."""
        state = dict(self.__dict__)
        for name in ("index", "fields", "manifest", "objects", "problems"):
            state.pop(name, None)
        if "manifest" in self.__dict__:  # opened (a failed open pickles nothing to reload)
            state["objects_sha256"] = self._record_objects()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if "objects_sha256" in state:
            if not os.path.lexists(self.folder / MANIFEST_NAME):  # another node, or its cache cleared: fetch it
                self._fetch_meta(self.manifest_object, self.manifest_sha256)  # the version opened, checked
            self.manifest = load_manifest(self.folder, self.where(MANIFEST_NAME), lambda n: n, self.manifest_sha256)
            self.manifest.pickle_as((getattr, (self, "manifest")))
            self.objects = self._recorded_objects()
            self.problems = self.manifest.size_problems({n: f.size for n, f in self.objects.items()}, self.where)
            self._load_meta()

    def _record_objects(self) -> str:
        """The sha256 of the record of every object's size and ETag as opened, written once into the dataset's
        folder of the node's cache as ``objects-<digest>.json`` (a temporary file renamed: ranks of a node may
        write it at once); one found there with other bytes (a crash, another user) is replaced."""
        digest = self.__dict__.get("objects_sha256")
        if digest is None:
            self.objects_sha256 = digest = self._write_record(self.objects)
        return digest

    def _write_record(self, objects: dict[str, RemoteFile]) -> str:
        """Write the record of ``objects`` (``objects-<digest>.json``) unless it is there already; its sha256."""
        data = json.dumps({n: [f.size, f.etag] for n, f in sorted(objects.items())}).encode()
        digest = hashlib.sha256(data).hexdigest()
        path = self.folder / f"objects-{digest[:16]}.json"
        try:
            found = read_inside(self.folder, path.name, len(data))
        except PackerError:
            found = None
        if found != data:
            tmp = path.with_name(path.name + temp_suffix())
            try:
                with open(tmp, "xb") as fh:
                    fh.write(data)
                os.replace(tmp, path)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                raise PackerError(f"{self.where()}: cannot record its objects in the node's cache ({path}: "
                                  f"{exc.strerror or exc})") from None
        return digest

    def _recorded_objects(self) -> dict[str, RemoteFile]:
        """Every object's size and ETag as the pickled copy's original opened them (``_record_objects``), checked
        against the digest it pickled; missing (another node, its cache cleared), the objects listed again, which
        must be those."""
        name = f"objects-{self.objects_sha256[:16]}.json"
        if not os.path.lexists(self.folder / name):
            objects = self._objects(self._list() if self.location.scheme in LISTS else None, self.manifest)
            if self._write_record(objects) != self.objects_sha256:
                raise DatasetReplaced(f"{self.where()}: the dataset was replaced since it was opened (its objects "
                                      "differ): restart the job")
            return objects
        try:
            raw = read_inside(self.folder, name, MAX_MANIFEST_BYTES)
        except PackerError:
            raw = b""
        if hashlib.sha256(raw).hexdigest() != self.objects_sha256:
            raise DatasetError(f"{self.where()}: the record of its objects as opened ({self.folder / name}) is "
                               "missing or changed in the node's cache (the cache folder was changed): open the "
                               "dataset again")
        return {n: RemoteFile(n, size, etag) for n, (size, etag) in json.loads(raw).items()}

    def _list(self) -> dict[str, RemoteFile]:
        return {i.key: RemoteFile(i.key, i.size, i.etag) for i in self.client.list(self.spec)}

    def _heads(self, names: Iterable[str]) -> dict[str, RemoteFile]:
        """Size and ETag of each object by HEAD, many in flight (a missing one is left out)."""
        futures = {name: self.client.submit_head(self.spec, name) for name in dict.fromkeys(names)}
        out = {}
        for name, fut in futures.items():
            try:
                info: ObjectInfo = self._translate(fut).result()
            except ObjectNotFound:
                continue
            except BaseException:
                for f in futures.values():
                    f.cancel()
                raise
            out[name] = RemoteFile(name, info.size, info.etag)
        return out

    def _fetch_meta(self, obj: RemoteFile, sha256: str | None, wait: bool = True) -> Any:
        dest = f"{self.folder.relative_to(cache_root(self.cache_dir))}/{obj.name}"
        fut = self._translate(self.client.fetch_file(self.spec, obj.name, obj.etag, obj.size, sha256, dest))
        return fut.result() if wait else fut

    # ---- reading: ranges, whole shards, the eviction policy ----

    def file(self, name: str) -> RemoteFile:
        """The object of the dataset's file ``name`` as recorded at open."""
        try:
            return self.objects[name]
        except KeyError:
            raise PackerError(f"{self.where(name)}: not a file of the dataset as opened") from None

    def fetch_ranges(self, name: str, ranges: Sequence[tuple[int, int, Sequence[tuple[int, int, str, str]]]],
                     priority: int = 0) -> list[concurrent.futures.Future]:
        """Ranges ``(start, end, pieces)`` of file ``name`` into the node's cache (each range one entry: a
        sampler's block, say); one future per range giving the entry's path. ``pieces``: ``(start, end,
        algorithm, hexdigest)`` (a sample's payload and its checksum), each checked before the entry exists.
        Lower ``priority`` is fetched first (what is needed next before the read-ahead)."""
        obj = self.file(name)
        futures = self.client.fetch(self.spec, name, obj.etag, ranges, priority)
        return [self._translate(f) for f in futures]

    def read_range(self, name: str, start: int, end: int,
                   pieces: Sequence[tuple[int, int, str, str]] = ()) -> bytes:
        """The bytes ``[start, end)`` of file ``name``, through the cache (fetched again if evicted before it
        could be opened)."""
        for _ in range(3):
            path = wait_all(self.fetch_ranges(name, [(start, end, pieces)]))[0]
            try:
                with open(path, "rb") as fh:
                    return fh.read()
            except FileNotFoundError:
                continue
        raise PackerError(f"{self.where(name)} bytes {start}-{end}: evicted from the cache again and again before "
                          "it could be read: raise cache_limit")

    @property
    def shard_root(self) -> Path:
        """The folder whole shards are fetched into, under their names in the dataset: a format's reader opens a
        fetched shard there as it opens a local dataset's."""
        return cache_root(self.cache_dir) / self.files_dest

    def fetch_shard(self, shard: int, priority: int = 0) -> concurrent.futures.Future:
        """Every file of shard ``shard`` whole into ``shard_root``, each checked against the manifest's size and
        sha256; the future gives ``shard_root`` once all are there."""
        futures = [self._translate(self.client.fetch_file(self.spec, f.name, self.file(f.name).etag, f.num_bytes,
                                                          f.sha256, self.file_entry(f.name), priority))
                   for f in self.manifest.shards[shard].files]
        return gather(futures, lambda _: self.shard_root)

    def range_entry(self, name: str, start: int, end: int) -> str:
        """The cache entry of ``[start, end)`` of file ``name`` (for ``need``)."""
        return range_name(self.spec, name, self.file(name).etag, start, end)

    def file_entry(self, name: str) -> str:
        """The cache entry of file ``name`` fetched whole (for ``need``)."""
        return f"{self.files_dest}/{name}"

    def need(self, entries: Iterable[str], order: int | None) -> None:
        """Feed the node's eviction policy: ``entries`` are read again at step ``order`` of this pass (lower:
        sooner), or, with None, not again this pass: they are evicted first."""
        self.client.need(entries, order)

    def verify_files(self, progress: Callable[[int], None] | None = None, at_once: int = 2) -> list[str]:
        """Every file of the dataset streamed through sha256 and compared with the manifest; the problems, in
        ``packer verify``'s words. Nothing is kept: each file passes through a temporary file counted against the
        cache limit, ``at_once`` files at a time (each fetched in parts, many in flight), so a verify beside a
        training job evicts little. ``progress(nbytes)`` is called as each file is done."""
        problems = list(self.problems)
        todo = collections.deque(f for f in self.manifest.all_files()
                                 if f.name in self.objects and self.objects[f.name].size == f.num_bytes)
        window: collections.deque = collections.deque()
        try:
            while todo or window:
                while todo and len(window) < at_once:
                    f = todo.popleft()
                    window.append((f, self._translate(self.client.fetch_file(
                        self.spec, f.name, self.objects[f.name].etag, f.num_bytes, None, None))))
                info, fut = window.popleft()
                if fut.result()[1] != info.sha256:
                    problems.append(f"{self.where(info.name)}: checksum mismatch (damaged or modified)")
                if progress is not None:
                    progress(info.num_bytes)
        except BaseException:
            for _, fut in window:
                fut.cancel()
            raise
        return problems

    def _translate(self, fut: concurrent.futures.Future) -> concurrent.futures.Future:
        """``fut`` with an object replaced since the open reported as the dataset replaced."""
        out: concurrent.futures.Future = concurrent.futures.Future()

        def done(f: concurrent.futures.Future) -> None:
            if f.cancelled():
                out.cancel()
                return
            exc = f.exception()
            if isinstance(exc, ObjectChanged) and not isinstance(exc, DatasetReplaced):
                exc = DatasetReplaced(f"{self.where()}: the dataset was replaced while being read ({exc}): "
                                      "restart the job")
            _set(out, f.result() if exc is None else None, exc)

        out.add_done_callback(lambda o: fut.cancel() if o.cancelled() else None)
        fut.add_done_callback(done)
        return out

    def close(self) -> None:
        """Hang up this process's connection (the downloader exits once its last client has)."""
        self._client.close(lambda c: c.close())

    def __enter__(self) -> RemoteDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteDataset({self.where()!r}, cache_dir={str(self.cache_dir)!r})"


def _set(fut: concurrent.futures.Future, result: Any, exc: BaseException | None) -> None:
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled meanwhile


def gather(futures: Sequence[concurrent.futures.Future],
           result: Callable[[list[Any]], Any]) -> concurrent.futures.Future:
    """One future for ``futures``: ``result(their results)`` once all are done, the first error as soon as one
    fails (the others cancelled); cancelling it cancels them all."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one(f: concurrent.futures.Future) -> None:
        if f.cancelled() or f.exception() is not None:
            if not out.done():
                _set(out, None, f.exception() if not f.cancelled() else concurrent.futures.CancelledError())
            for g in futures:
                g.cancel()
            return
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            _set(out, result([g.result() for g in futures]), None)

    out.add_done_callback(lambda o: [g.cancel() for g in futures] if o.cancelled() else None)
    if not futures:
        _set(out, result([]), None)
    for f in futures:
        f.add_done_callback(one)
    return out
