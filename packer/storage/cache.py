"""The node-wide cache of object ranges under ``cache_dir``, shared by every process and thread on the node.

Entries are keyed by URL + ETag + range, so a replaced object never serves old bytes for new. Processes coordinate
through the directory alone:

- one byte-range lock (``fcntl.lockf``) per entry in ``locks``, taken while its bytes are downloaded, so two
  processes never fetch the same range at once (the second waits, then reads the entry); a crashed downloader's
  lock goes with it;
- an entry is written as ``<name>.tmp-<pid space>-<pid>-<random>`` and renamed into place complete: a partial entry
  never has an entry's name (leftover temporaries of dead processes are swept; another container's or node's,
  told apart by ``pid_space``, only when over an hour old);
- ``usage`` (bytes, updated under the eviction lock) bounds the disk used by ``cache_limit``; when over, the entries
  are listed and an ``EvictionPolicy`` (default ``LRU``; ``KeepNeeded`` drops first what the epoch will not read
  again) chooses what goes, down to 90 % of the limit;
- a checksum per range given by the caller is checked before the bytes are used, on download and on every hit.

Whole objects (a shard fetched whole: packer/storage/downloader.py) are entries too, under ``files/`` by a path the
caller chooses (``files/<dataset>/<version>/<name in the dataset>``, so a local reader opens them by their names);
they count against the limit and are evicted like ranges. What the layers above keep there for themselves
(``datasets/``: a remote dataset's manifest and meta/) is small and never evicted.

Layout: ``<cache_dir>/packer-cache-v1/{locks,usage,entries/<2 hex>/<64 hex>,files/...,datasets/...,tmp/}``
(``tmp/``: objects being hashed for ``verify``, counted while there).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import itertools
import os
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from packer.errors import PackerError
from packer.perprocess import PerProcess
from packer.storage.faults import StorageError
from packer.storage.node import stale_temp, temp_suffix
from packer.storage.url import redact
from packer.units import parse_bytes

Checksum = tuple[str, str]  # (hashlib algorithm, hex digest), e.g. ("sha256", "ab12...")
_EVICT_SLOT = 0  # byte of the lock file that guards usage and eviction; entries lock bytes 1..2**62


class ChecksumMismatch(StorageError):
    """Bytes read from object storage are not the ones the dataset recorded (corrupt or another version)."""


@dataclass(frozen=True)
class Entry:
    """One cached range, as an eviction policy sees it."""

    name: str  # RangeCache.name for a range; the path below the cache's root ("files/...") for a whole object
    size: int
    last_used: float  # mtime: set when written and at every hit


class EvictionPolicy(Protocol):
    def victims(self, entries: list[Entry], to_free: int) -> Iterable[Entry]:
        """Entries to delete, in order, until ``to_free`` bytes are freed (the cache stops when it has enough)."""
        ...


class LRU:
    """Least recently used first."""

    def victims(self, entries: list[Entry], to_free: int) -> Iterable[Entry]:
        return sorted(entries, key=lambda e: e.last_used)


class NextUse:
    """What the reader says it will read again, and when: ``need(names, order)`` marks entries needed at step
    ``order`` of the pass (lower: sooner), ``need(names, None)`` unmarks them (read for the last time this pass).
    Unmarked entries go first (least recently used first), then the marked ones needed last (Belady's choice,
    as far as the reader can tell). Thread-safe: the downloader's clients feed it while it evicts."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}
        self._lock = threading.Lock()

    def need(self, names: Iterable[str], order: int | None) -> None:
        with self._lock:
            if order is None:
                for name in names:
                    self._next.pop(name, None)
            else:
                self._next.update(dict.fromkeys(names, order))

    def victims(self, entries: list[Entry], to_free: int) -> Iterable[Entry]:
        with self._lock:
            marks = {e.name: self._next[e.name] for e in entries if e.name in self._next}
        return sorted(entries, key=lambda e: (e.name in marks, -marks.get(e.name, 0), e.last_used))


@dataclass
class KeepNeeded:
    """What the reader still needs this epoch (entry names, ``RangeCache.name``) is evicted last; among the rest and
    then among those, least recently used first."""

    needed: set[str] = field(default_factory=set)

    def victims(self, entries: list[Entry], to_free: int) -> Iterable[Entry]:
        return sorted(entries, key=lambda e: (e.name in self.needed, e.last_used))


def check(data: bytes | memoryview, checksum: Checksum | None, what: str) -> None:
    """Raise ``ChecksumMismatch`` naming ``what`` unless ``data`` has ``checksum`` (a hashlib algorithm, or "crc32":
    zlib's, 8 hex digits, what conversions record per sample: packer.layout.ranges)."""
    if checksum is None:
        return
    algorithm, expected = checksum
    got = f"{zlib.crc32(data) & 0xFFFFFFFF:08x}" if algorithm == "crc32" else hashlib.new(algorithm, data).hexdigest()
    if got != expected.lower():
        raise ChecksumMismatch(f"{what}: {algorithm} {got[:16]}... of the {len(data)} bytes read is not the "
                               f"recorded {expected[:16]}...: the object is damaged or another version")


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    waits: int = 0  # misses another process or thread was already downloading
    fetched_bytes: int = 0
    evicted: int = 0
    evicted_bytes: int = 0


class RangeCache:
    """Ranges of objects on local disk under ``cache_dir``, at most ``cache_limit`` bytes ("20GB" or an int)."""

    def __init__(self, cache_dir: str | os.PathLike, cache_limit: int | str,
                 policy: EvictionPolicy | None = None) -> None:
        limit = parse_bytes(cache_limit) if isinstance(cache_limit, str) else int(cache_limit)
        if limit <= 0:
            raise PackerError(f"cache_limit {cache_limit!r}: a positive size expected (e.g. 20GB)")
        self.root = Path(cache_dir).absolute() / "packer-cache-v1"
        self.entries = self.root / "entries"
        self.files = self.root / "files"
        self.entries.mkdir(parents=True, exist_ok=True)
        (self.root / "locks").touch()
        self.limit, self.policy = limit, policy or LRU()
        self.stats = CacheStats()
        # opened by partials, not methods: the finalizer below holds these, and must not hold the cache
        self._fd: PerProcess[int] = PerProcess(functools.partial(os.open, self.root / "locks", os.O_RDWR))
        self._usage: PerProcess[int] = PerProcess(functools.partial(os.open, self.root / "usage",
                                                                    os.O_RDWR | os.O_CREAT, 0o644))
        self._local = PerProcess(_Local)
        self._close = weakref.finalize(self, _close_files, self._fd, self._usage)  # a cache dropped unclosed too
        self._close.atexit = False  # at exit the process's end releases it, as before

    @staticmethod
    def name(url: str, etag: str | None, start: int, end: int) -> str:
        """The entry name of ``[start, end)`` of ``url`` at version ``etag`` (what ``KeepNeeded`` holds)."""
        return hashlib.sha256(f"{url}\0{etag or ''}\0{start}\0{end}".encode()).hexdigest()

    def path(self, name: str) -> Path:
        """Where entry ``name`` lies: a range's under ``entries/``, a whole object's at its path ("files/...")."""
        return self.root / name if "/" in name else self.entries / name[:2] / name

    def read(self, name: str, checksum: Checksum | None = None, what: str = "") -> bytes | None:
        """The entry's bytes (checked), or None; a damaged entry is deleted and reads as missing."""
        path = self.path(name)
        try:
            with open(path, "rb") as fh:
                data = fh.read()
            os.utime(path)  # last use, for LRU
        except FileNotFoundError:
            return None
        try:
            check(data, checksum, what or name)
        except ChecksumMismatch:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return None
        self.stats.hits += 1
        return data

    def acquire(self, name: str, block: bool = True) -> bool:
        """Take the entry's download lock (node-wide: other processes and this one's threads); False instead of
        waiting when ``block`` is False and it is held. Any thread of this process may ``release`` it."""
        local = self._local.get()
        lock = local.lock_for(name)
        if not lock.acquire(blocking=block):
            local.done(name)
            return False
        try:
            fcntl.lockf(self._fd.get(), fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB), 1, _slot(name))
        except BlockingIOError:
            lock.release()
            local.done(name)
            return False
        except BaseException:
            lock.release()
            local.done(name)
            raise
        return True

    def release(self, name: str) -> None:
        local = self._local.get()
        fcntl.lockf(self._fd.get(), fcntl.LOCK_UN, 1, _slot(name))
        local.held(name).release()
        local.done(name)

    @contextlib.contextmanager
    def claim(self, name: str, block: bool = True) -> Iterator[bool]:
        """``acquire`` ... ``release`` around a block; yields whether the lock is held."""
        mine = self.acquire(name, block)
        try:
            yield mine
        finally:
            if mine:
                self.release(name)

    def store(self, name: str, data: bytes | memoryview) -> None:
        """Write an entry (call while holding its claim): room is made first, then a temporary file is renamed
        into place."""
        self.make_room(len(data))
        path = self.path(name)
        tmp = path.with_name(f"{name}{temp_suffix()}")
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:  # the entry's folder's first entry (a mkdir per entry cost as much as a write)
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with open(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._add_usage(-len(data))
            raise

    def get(self, url: str, etag: str | None, start: int, end: int, fetch: Callable[[], bytes],
            checksum: Checksum | None = None) -> bytes:
        """The bytes of ``[start, end)`` of ``url``: from the cache, else ``fetch()``ed once on the node, checked
        against ``checksum`` before anything uses or caches them."""
        name = self.name(url, etag, start, end)
        what = f"{redact(url)} bytes {start}-{end}"
        hit = self.read(name, checksum, what)
        if hit is not None:
            return hit
        with self.claim(name, block=False) as mine:
            if not mine:
                self.stats.waits += 1
        with self.claim(name):
            hit = self.read(name, checksum, what)  # another process may have fetched it meanwhile
            if hit is not None:
                return hit
            data = fetch()
            check(data, checksum, what)
            self.stats.misses += 1
            self.stats.fetched_bytes += len(data)
            self.store(name, data)
            return data

    # ---- usage and eviction, under the eviction lock ----

    @contextlib.contextmanager
    def _evict_lock(self):
        with self._local.get().evict:
            fd = self._fd.get()
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, _EVICT_SLOT)
            try:
                yield
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, _EVICT_SLOT)

    def _read_usage(self) -> int:
        try:
            return int(os.pread(self._usage.get(), 64, 0).strip() or b"0")
        except ValueError:  # damaged (a write torn by a crash): counted again
            return self.usage(rescan=True)

    def _write_usage(self, value: int) -> None:
        """In place, one fixed-width write under the eviction lock (a rename per entry stored cost milliseconds:
        ext4 flushes a file renamed over another)."""
        os.pwrite(self._usage.get(), f"{max(0, value):020d}\n".encode(), 0)

    def _add_usage(self, delta: int) -> None:
        with self._evict_lock():
            self._write_usage(self._read_usage() + delta)

    def usage(self, rescan: bool = False) -> int:
        """Bytes in entries and in downloads under way: the recorded figure, or counted on disk with ``rescan``."""
        if not rescan:
            with self._evict_lock():
                return self._read_usage()
        entries, writing = self._list()
        return sum(e.size for e in entries) + writing

    def _list(self) -> tuple[list[Entry], int]:
        """Every entry, and the bytes of the temporary files being written now (downloads under way take room
        too, though nothing can evict them); temporary files of dead writers are deleted."""
        out, writing = [], 0
        now = time.time()
        for sub in self.entries.iterdir() if self.entries.exists() else ():
            for item in os.scandir(sub):
                with contextlib.suppress(FileNotFoundError):
                    st = item.stat()
                    if ".tmp-" not in item.name:
                        out.append(Entry(item.name, st.st_size, st.st_mtime))
                    elif stale_temp(item.name, st.st_mtime, now):
                        os.unlink(item.path)
                    else:
                        writing += st.st_size
        for folder, _dirs, names in itertools.chain(os.walk(self.files), os.walk(self.root / "tmp")):
            for item in names:
                path = os.path.join(folder, item)
                with contextlib.suppress(FileNotFoundError):
                    st = os.stat(path)
                    if ".tmp-" not in item:
                        out.append(Entry(os.path.relpath(path, self.root), st.st_size, st.st_mtime))
                    elif stale_temp(item, st.st_mtime, now):
                        os.unlink(path)
                    else:
                        writing += st.st_size
        return out, writing

    def release_room(self, nbytes: int) -> None:
        """Give back room taken by ``make_room`` for bytes that were never stored (a failed download)."""
        self._add_usage(-nbytes)

    def make_room(self, nbytes: int) -> None:
        """Count ``nbytes`` about to be written, evicting first what the policy chooses if the limit would be
        passed (down to 90 % of it)."""
        if nbytes > self.limit:
            raise PackerError(f"cache_limit {self.limit} bytes is smaller than one range of {nbytes} bytes: "
                              "raise cache_limit")
        with self._evict_lock():
            used = self._read_usage() + nbytes
            if used > self.limit:
                entries, writing = self._list()
                used = sum(e.size for e in entries) + writing + nbytes
                target = int(self.limit * 0.9)
                for entry in self.policy.victims(entries, used - target):
                    if used <= target:
                        break
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path(entry.name))
                        used -= entry.size
                        self.stats.evicted += 1
                        self.stats.evicted_bytes += entry.size
            self._write_usage(used)

    def close(self) -> None:
        """Close the lock and usage files (this process's; reopened on next use)."""
        _close_files(self._fd, self._usage)

    def __enter__(self) -> RangeCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_files(*files: PerProcess[int]) -> None:
    for fd in files:
        fd.close(os.close)


def _slot(name: str) -> int:
    """The lock file byte that stands for entry ``name`` (byte 0 is the eviction lock's)."""
    key = name if "/" not in name else hashlib.sha256(name.encode()).hexdigest()
    return 1 + int(key[:15], 16)


class _Local:
    """This process's share of the locking: fcntl locks do not exclude threads of one process, these do."""

    def __init__(self) -> None:
        self.evict = threading.Lock()
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    def lock_for(self, name: str) -> threading.Lock:
        with self._guard:
            lock, users = self._locks.get(name, (threading.Lock(), 0))
            self._locks[name] = (lock, users + 1)
            return lock

    def held(self, name: str) -> threading.Lock:
        with self._guard:
            return self._locks[name][0]

    def done(self, name: str) -> None:
        with self._guard:
            lock, users = self._locks[name]
            if users <= 1:
                del self._locks[name]
            else:
                self._locks[name] = (lock, users - 1)
