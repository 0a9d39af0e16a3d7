"""One downloader process per node and cache directory: every process on the node (the main process, forked
DataLoader workers, ThreadLoader threads, other ranks) asks it for ranges and whole objects over a Unix socket in
the cache directory; the bytes travel through the cache's files, never through the socket.

Why a process: obstore hangs in a child forked after its parent made a request (docs/remote.md), and DataLoader
forks its workers. The downloader is started by exec (``python -m packer.storage.downloader``, a fresh runtime) by
the first process that needs it, serves every client with one ``Fetcher`` per store (many GETs in flight, in order
of need), writes each range or object into the ``RangeCache`` (renamed into place complete) and answers with the
entry's name; a client then reads the file. So one download per byte per node, obstore in no forked process, no
data copied through pipes. It exits when its last client has gone (with the node's last process: a dead client's
socket closes); a client that finds it gone starts a new one once, then fails its requests with one error.

Protocol (one JSON object per message, each prefixed by its length as 4 bytes big-endian; ``id`` chosen by the
client, answers may come in any order):

========================================================  ======================================================
client -> downloader                                       answer(s)
========================================================  ======================================================
hello {version, pid, limit}                                hello {version, pid}
store {sid, url, options, policy}                          (none: names a store for later requests)
head {id, sid, key}                                        {id, result: ObjectInfo} | {id, error, message}
list {id, sid, prefix}                                     {id, result: [ObjectInfo]} | error
fetch {id, sid, key, etag, ranges: [[start, end,           one per range: {id, i, entry} (its cache file) |
  [[start, end, algorithm, hexdigest], ...]]], priority}     {id, i, error, message}
fetch_file {id, sid, key, etag, size, sha256, dest,        {id, result: {entry, size, sha256}} | error; ``dest``
  priority}                                                  "files/...": an entry; "datasets/...": metadata, not
                                                             counted, never evicted; null: hashed only, nothing
                                                             kept (``verify``)
cancel {id, i: [...] | null}                               (none: the downloader forgets those requests; a GET no
                                                             client waits for any more is cancelled)
need {names, order}                                        (none: feeds the eviction policy, ``NextUse``)
stats {id}                                                 {id, result: counters, the downloader's CPU seconds}
========================================================  ======================================================

Every GET carries If-Match with the ETag given (``ObjectChanged`` when the object was replaced); each piece of a
range is checked against its checksum and a whole object against its sha256 before its entry gets its name.
Lower ``priority`` goes first (the blocks the reader needs next, then its read-ahead). The downloader uses the
smallest ``cache_limit`` its connected clients asked for (a client may leave it to the others). Which downloader a
process talks to depends on the cache directory and on its storage environment (``AWS_*``, ``GOOGLE_*``,
``AZURE_*``, proxies), which the downloader inherits from the process that started it: processes with other
credentials get their own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from packer.errors import PackerError
from packer.storage.cache import ChecksumMismatch, NextUse, RangeCache, check
from packer.storage.client import ObjectInfo, StoreSpec
from packer.storage.faults import (
    AccessDenied,
    ObjectChanged,
    ObjectNotFound,
    RetryPolicy,
    ShortRead,
    StorageError,
)
from packer.storage.fetch import Fetcher, Range
from packer.storage.url import Location, parse, redact_text
from packer.units import parse_bytes

PROTOCOL = 1
PART = 8 << 20  # a whole object is fetched in parts of this size, many in flight
MAX_IN_FLIGHT = 32  # GETs at once per store
UNBOUNDED = 1 << 62  # the limit of a cache no client has bounded
_HEADER = struct.Struct(">I")
_MAX_MESSAGE = 256 << 20  # a listing of a million objects
_ERRORS: dict[str, type[PackerError]] = {c.__name__: c for c in (
    StorageError, ObjectNotFound, AccessDenied, ObjectChanged, ShortRead, ChecksumMismatch, PackerError)}
_MAX_OUTBOX = 64 << 20  # answers a client may leave unread before it is hung up on


class DownloaderGone(StorageError):
    """The node's downloader process ended and could not be started again."""


# ---- names shared by clients and the downloader ----

def cache_root(cache_dir: str | os.PathLike) -> Path:
    """The folder packer keeps below ``cache_dir`` (``RangeCache``'s)."""
    return Path(cache_dir).absolute() / "packer-cache-v1"


def environment_key(environ: dict[str, str] | None = None) -> str:
    """Which downloader a process may share: one per storage environment (credentials, endpoints, proxies), so a
    process never reads with another's credentials. A digest: the values never appear in a file name."""
    env = os.environ if environ is None else environ
    items = sorted((k, v) for k, v in env.items() if k.upper().startswith(("AWS_", "GOOGLE_", "AZURE_"))
                   or k.lower() in ("http_proxy", "https_proxy", "no_proxy", "all_proxy"))
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def store_identity(spec: StoreSpec) -> str:
    """What names a store's objects in cache entries: its root URL and endpoint (two servers may have buckets of
    the same name), never its credentials in clear."""
    endpoint = spec.options.get("endpoint") or spec.options.get("aws_endpoint") or ""
    if not endpoint and spec.url.startswith("s3://"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT", "")
    return f"{spec.url}#{endpoint}" if endpoint else spec.url


def range_name(spec: StoreSpec, key: str, etag: str | None, start: int, end: int) -> str:
    """The cache entry of ``[start, end)`` of object ``key`` at version ``etag`` (what ``need`` takes)."""
    return RangeCache.name(f"{store_identity(spec)}/{key}", etag, start, end)


def _entry_path(root: Path, name: str) -> Path:
    return root / name if "/" in name else root / "entries" / name[:2] / name


def _checked_dest(dest: str) -> str:
    """A whole object's place: a relative path below ``files/`` (an entry, counted and evicted) or ``datasets/``
    (metadata the layers above keep: neither), never outside the cache."""
    parts = dest.split("/")
    if (len(parts) < 2 or parts[0] not in ("files", "datasets") or any(p in ("", ".", "..") for p in parts)
            or "\0" in dest or "\\" in dest or ".tmp-" in dest):
        raise PackerError(f"{dest!r}: a whole object's place in the cache must be a relative path below files/ "
                          "or datasets/")
    return dest


# ---- framing ----

def _frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(len(body)) + body


class _Frames:
    """Messages out of a stream's bytes."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self.buf += data
        out = []
        while len(self.buf) >= 4:
            (n,) = _HEADER.unpack_from(self.buf)
            if n > _MAX_MESSAGE:
                raise PackerError(f"a downloader message of {n} bytes (at most {_MAX_MESSAGE})")
            if len(self.buf) < 4 + n:
                break
            out.append(json.loads(bytes(self.buf[4:4 + n])))
            del self.buf[:4 + n]
        return out


@contextlib.contextmanager
def _short_path(path: Path) -> Iterator[str]:
    """``path`` as a Unix socket address: a path too long for one (108 bytes) is reached through its folder's
    descriptor (``/proc/self/fd/N/name``)."""
    text = str(path)
    if len(text.encode()) < 100:
        yield text
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def try_connect(path: Path) -> socket.socket | None:
    """A stream socket connected to the Unix socket at ``path``; None when nothing listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _short_path(path) as address:
            sock.connect(address)
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    return sock


# ---- the downloader process ----

@dataclass
class _Waiter:
    conn: _Conn
    rid: int
    i: int  # the range's number in its request; -1: a whole-object request


@dataclass
class _Pending:
    """One download under way (a range or a whole object) and the requests waiting for it."""

    name: str
    waiters: list[_Waiter]
    cancel: Any = None  # callable that stops the download


@dataclass(eq=False)
class _Conn:
    """A client's connection. Its socket is non-blocking: answers queue in ``outbox`` and go out as the client
    reads them (the selector thread sends the rest), so a client that stops reading stalls nobody else."""

    sock: socket.socket
    wake: Any  # asks the selector thread to send the rest of the outbox
    frames: _Frames = field(default_factory=_Frames)
    stores: dict[int, _Store | Exception] = field(default_factory=dict)  # an Exception: the store did not open
    asked: dict[tuple[int, int], str] = field(default_factory=dict)  # (id, i) -> pending name
    limit: int | None = None
    pid: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    outbox: bytearray = field(default_factory=bytearray)
    dead: bool = False

    def send(self, message: dict[str, Any]) -> None:
        """Queue one answer and send what the socket takes now."""
        if self.dead:
            return
        with self.lock:
            self.outbox += _frame(message)
            more = self.flush_locked()
        if more:
            self.wake(self)

    def flush_locked(self) -> bool:
        """Send what the socket takes (call holding ``lock``); whether some is left. A client that went away, or
        let more than ``_MAX_OUTBOX`` bytes of answers pile up, is hung up on (the selector then forgets it)."""
        while self.outbox and not self.dead:
            try:
                n = self.sock.send(self.outbox)
            except BlockingIOError:
                break
            except OSError:
                n = -1
            if n <= 0 or len(self.outbox) > _MAX_OUTBOX:
                self.dead = True
                self.outbox.clear()
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
                break
            del self.outbox[:n]
        return bool(self.outbox)


class _Store:
    """A store shared by every client that names it: one client connection pool, one fetcher."""

    def __init__(self, spec: StoreSpec) -> None:
        from packer.storage.store import ObjectStore

        self.spec = spec
        self.identity = store_identity(spec)
        self.store = ObjectStore(spec.url, spec.options, spec.policy)
        self.fetcher = Fetcher(self.store, max_in_flight=MAX_IN_FLIGHT, max_request=PART)

    def url(self, key: str) -> str:
        return f"{self.identity}/{key}"

    def where(self, key: str) -> str:
        """The object's URL as messages show it (redacted)."""
        return str(self.store.location(key))

    def close(self) -> None:
        self.fetcher.close()
        self.store.close()


class DownloaderServer:
    """The downloader: accepts clients on ``socket_path`` and serves their requests until none is left for
    ``linger`` seconds."""

    def __init__(self, cache_dir: Path, socket_path: Path, limit: int, linger: float) -> None:
        self.policy = NextUse()
        self.cache = RangeCache(cache_dir, limit, self.policy)
        self.root = self.cache.root
        self.linger = linger
        self.socket_path = socket_path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with _short_path(socket_path) as address:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(socket_path)
            self.listener.bind(address)
        self.listener.listen(128)
        self._inode = os.stat(socket_path).st_ino
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._writers: set[_Conn] = set()
        self.conns: dict[socket.socket, _Conn] = {}
        self.stores: dict[str, _Store] = {}
        self.pending: dict[str, _Pending] = {}
        self.lock = threading.Lock()
        self.work = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="packer-downloader-work")
        self.counts: dict[str, int] = dict.fromkeys(
            ("requests", "ranges", "hits", "waits", "misses", "fetched_bytes", "files", "file_hits", "file_bytes",
             "cancelled", "errors", "clients_seen"), 0)

    def count(self, **deltas: int) -> None:
        with self.lock:
            for name, value in deltas.items():
                self.counts[name] += value

    # -- the loop --

    def serve(self) -> None:
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        idle_since = time.monotonic()
        try:
            while True:
                for key, events in self.selector.select(timeout=min(0.5, max(0.01, self.linger))):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        self._woken()
                    else:
                        if events & selectors.EVENT_WRITE:
                            self._writable(key.data)
                        if events & selectors.EVENT_READ:
                            self._readable(key.data)
                if self.conns:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since >= self.linger:
                    return
        finally:
            self.shutdown()

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid():  # only this user's processes may use its credentials and cache
            sock.close()
            return
        sock.setblocking(False)
        conn = _Conn(sock, self._want_write)
        self.conns[sock] = conn
        self.selector.register(sock, selectors.EVENT_READ, conn)
        self.count(clients_seen=1)

    def _want_write(self, conn: _Conn) -> None:
        """From any thread: let the selector thread send the rest of ``conn``'s answers when it can."""
        with self.lock:
            self._writers.add(conn)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _woken(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_r.recv(4096)
        with self.lock:
            writers, self._writers = self._writers, set()
        for conn in writers:
            if conn.sock in self.conns:
                self.selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)

    def _writable(self, conn: _Conn) -> None:
        with conn.lock:
            more = conn.flush_locked()
        if not more and conn.sock in self.conns:
            self.selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _readable(self, conn: _Conn) -> None:
        if conn.sock not in self.conns:
            return
        try:
            data = conn.sock.recv(1 << 16)
            messages = conn.frames.feed(data) if data and not conn.dead else None
        except BlockingIOError:
            return
        except (OSError, ValueError, PackerError):
            messages = None
        if messages is None:
            self._drop(conn)
            return
        for message in messages:
            try:
                self._handle(conn, message)
            except Exception as exc:  # a malformed request: answered, the downloader goes on
                if "id" in message:
                    conn.send(_error(message["id"], exc))

    def _drop(self, conn: _Conn) -> None:
        """A client went away: its requests are cancelled (GETs nobody else waits for stop)."""
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn.sock)
        self.conns.pop(conn.sock, None)
        conn.dead = True
        with self.lock:
            asked = list(conn.asked.items())
        self._cancel(conn, [k for k, _ in asked])
        conn.sock.close()
        self._set_limit()

    def _set_limit(self) -> None:
        """The smallest limit a connected client asked for (none asked: as it was)."""
        limits = [int(c.limit) for c in self.conns.values() if c.limit]
        if limits:
            self.cache.limit = min(limits)

    def shutdown(self) -> None:
        """Stop every download, close every store, remove the socket (if it is still this downloader's)."""
        with contextlib.suppress(OSError):
            if os.stat(self.socket_path).st_ino == self._inode:
                os.unlink(self.socket_path)
        self.listener.close()
        for conn in list(self.conns.values()):
            self._drop(conn)
        for store in self.stores.values():
            store.close()
        self.work.shutdown(wait=True, cancel_futures=True)
        self.cache.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- requests --

    def _handle(self, conn: _Conn, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "hello":
            conn.limit, conn.pid = msg.get("limit"), int(msg["pid"])
            self._set_limit()
            conn.send({"op": "hello", "version": PROTOCOL, "pid": os.getpid()})
        elif op == "store":
            try:
                spec = StoreSpec(msg["url"], dict(msg["options"]), RetryPolicy(**msg["policy"]))
                text = json.dumps([spec.url, spec.options, msg["policy"]], sort_keys=True)
                if text not in self.stores:
                    self.stores[text] = _Store(spec)
                conn.stores[int(msg["sid"])] = self.stores[text]
            except Exception as exc:  # said to each request naming it
                conn.stores[int(msg["sid"])] = exc
        elif op in ("head", "list"):
            store = _store_of(conn, msg)
            kw = {"prefix": msg.get("prefix", "")} if op == "list" else {}
            fut = store.store.client.submit(op, msg.get("key", ""), **kw)
            fut.add_done_callback(lambda f, rid=msg["id"]: conn.send(_answer(rid, f, op)))
        elif op == "fetch":
            self._fetch(conn, msg)
        elif op == "fetch_file":
            self._fetch_file(conn, msg)
        elif op == "cancel":
            with self.lock:
                keys = [k for k in conn.asked if k[0] == msg["id"] and (msg.get("i") is None or k[1] in msg["i"])]
            self._cancel(conn, keys)
        elif op == "need":
            self.policy.need(msg["names"], msg.get("order"))
        elif op == "stats":
            conn.send({"id": msg["id"], "result": self.stats()})
        else:
            raise PackerError(f"unknown downloader request {op!r}")

    def stats(self) -> dict[str, Any]:
        use = resource.getrusage(resource.RUSAGE_SELF)
        with self.lock:
            counts: dict[str, Any] = dict(self.counts)
            counts["in_flight"] = len(self.pending)
        counts.update(pid=os.getpid(), clients=len(self.conns), cpu_s=use.ru_utime + use.ru_stime,
                      limit=self.cache.limit, usage=self.cache.usage(), evicted=self.cache.stats.evicted,
                      evicted_bytes=self.cache.stats.evicted_bytes,
                      gets=sum(s.fetcher.stats.requests for s in self.stores.values()),
                      requested_bytes=sum(s.fetcher.stats.requested_bytes for s in self.stores.values()))
        return counts

    def _wait_or_start(self, conn: _Conn, rid: int, i: int, name: str) -> _Pending | None:
        """Register request ``(rid, i)`` as waiting for download ``name``: a new ``_Pending`` when it is the first
        (the caller starts it), else None."""
        with self.lock:
            conn.asked[(rid, i)] = name
            pending = self.pending.get(name)
            if pending is not None:
                pending.waiters.append(_Waiter(conn, rid, i))
                self.counts["waits"] += 1
                return None
            pending = self.pending[name] = _Pending(name, [_Waiter(conn, rid, i)])
            return pending

    def _fetch(self, conn: _Conn, msg: dict[str, Any]) -> None:
        store = _store_of(conn, msg)
        key, etag, rid = msg["key"], msg.get("etag"), msg["id"]
        todo: list[tuple[Range, _Pending, list]] = []
        self.count(requests=1, ranges=len(msg["ranges"]))
        for i, (start, end, pieces) in enumerate(msg["ranges"]):
            if not (0 <= start < end and all(start <= p[0] <= p[1] <= end for p in pieces)):
                conn.send({"id": rid, "i": i, "error": "PackerError",
                           "message": f"{store.where(key)}: bad range {start}-{end} or pieces outside it"})
                continue
            name = RangeCache.name(store.url(key), etag, start, end)
            if _present(_entry_path(self.root, name), end - start):
                self.count(hits=1)
                conn.send({"id": rid, "i": i, "entry": name})
                continue
            pending = self._wait_or_start(conn, rid, i, name)
            if pending is not None:
                todo.append((Range(key, start, end, etag), pending, pieces))
        if not todo:
            return
        futures = store.fetcher.fetch([r for r, _, _ in todo], priority=int(msg.get("priority", 0)))
        for fut, (rng, pending, pieces) in zip(futures, todo):
            pending.cancel = fut.cancel
            fut.add_done_callback(lambda f, r=rng, p=pending, c=pieces: self.work.submit(
                self._landed, f, store, r, p, c))

    def _landed(self, fut: concurrent.futures.Future, store: _Store, rng: Range, pending: _Pending,
                pieces: list) -> None:
        if fut.cancelled():
            self._settle(pending, None)
            return
        try:
            data = fut.result()
            view = memoryview(data)
            for start, end, algorithm, digest in pieces:
                check(view[start - rng.start:end - rng.start], (algorithm, digest),
                      f"{store.where(rng.key)} bytes {start}-{end}")
            with self.cache.claim(pending.name):
                if not _present(self.cache.path(pending.name), len(data)):
                    self.cache.store(pending.name, data)
            self.count(misses=1, fetched_bytes=len(data))
        except BaseException as exc:
            self._settle(pending, _error(0, exc))
            return
        self._settle(pending, {"entry": pending.name})

    def _settle(self, pending: _Pending, answer: dict[str, Any] | None) -> None:
        """A download ended: answer everyone waiting for it (``answer`` None: cancelled, nobody waits)."""
        with self.lock:
            if self.pending.get(pending.name) is pending:
                del self.pending[pending.name]
            waiters, pending.waiters = pending.waiters, []
            for w in waiters:
                w.conn.asked.pop((w.rid, w.i), None)
            if answer is not None and "error" in answer:
                self.counts["errors"] += 1
        if answer is None:
            return
        for w in waiters:
            reply = {**answer, "id": w.rid}
            if w.i >= 0:
                reply["i"] = w.i
            w.conn.send(reply)

    def _cancel(self, conn: _Conn, keys: Iterable[tuple[int, int]]) -> None:
        stop = []
        with self.lock:
            for key in keys:
                name = conn.asked.pop(key, None)
                pending = self.pending.get(name) if name is not None else None
                if pending is None or name is None:
                    continue
                pending.waiters = [w for w in pending.waiters if (w.conn, w.rid, w.i) != (conn, *key)]
                if not pending.waiters:
                    del self.pending[name]
                    self.counts["cancelled"] += 1
                    stop.append(pending.cancel)
        for cancel in stop:
            if cancel is not None:
                cancel()

    def _fetch_file(self, conn: _Conn, msg: dict[str, Any]) -> None:
        store = _store_of(conn, msg)
        key, etag, rid, size = msg["key"], msg.get("etag"), msg["id"], int(msg["size"])
        dest = _checked_dest(msg["dest"]) if msg.get("dest") else None
        if dest is not None and _present(self.root / dest, size):
            self.count(file_hits=1)
            conn.send({"id": rid, "result": {"entry": dest, "size": size, "sha256": msg.get("sha256")}})
            return
        name = dest or f"digest:{store.url(key)}\0{etag}\0{size}"
        pending = self._wait_or_start(conn, rid, -1, name)
        if pending is not None:
            job = _FileJob(self, store, key, etag, size, msg.get("sha256"), dest, pending)
            pending.cancel = job.cancel
            job.start(int(msg.get("priority", 0)))


def _store_of(conn: _Conn, msg: dict[str, Any]) -> _Store:
    """The store a request names; the reason it could not be opened is the request's error."""
    store = conn.stores[msg["sid"]]
    if isinstance(store, Exception):
        raise store
    return store


def _present(path: Path, size: int) -> bool:
    """An entry of ``size`` bytes is at ``path``; its last use is now (LRU)."""
    try:
        if os.stat(path).st_size != size:
            return False
        os.utime(path)
    except FileNotFoundError:
        return False
    return True


def _answer(rid: int, fut: concurrent.futures.Future, op: str) -> dict[str, Any]:
    try:
        result = fut.result()
    except BaseException as exc:
        return _error(rid, exc)
    return {"id": rid, "result": [asdict(i) for i in result] if op == "list" else asdict(result)}


def _error(rid: int, exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, concurrent.futures.CancelledError):
        kind, message = "StorageError", "cancelled: the downloader is stopping"
    elif isinstance(exc, PackerError):
        kind = next((c.__name__ for c in type(exc).__mro__ if c.__name__ in _ERRORS), "PackerError")
        message = str(exc)
    else:  # a bug or an OS error (disk full): one line
        kind, message = "StorageError", f"the downloader failed: {type(exc).__name__}: {exc}"
    return {"id": rid, "error": kind, "message": redact_text(message)}


class _FileJob:
    """A whole object fetched in parts, many in flight, written into a temporary file at their offsets, hashed,
    checked against its sha256 and renamed into place (or, with no destination, only hashed and deleted)."""

    def __init__(self, server: DownloaderServer, store: _Store, key: str, etag: str | None, size: int,
                 sha256: str | None, dest: str | None, pending: _Pending) -> None:
        self.server, self.store, self.key, self.etag, self.size = server, store, key, etag, size
        self.sha256, self.dest, self.pending = sha256, dest, pending
        self.path = server.root / (dest or f"tmp/{os.getpid()}-{os.urandom(6).hex()}")
        self.tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
        self.counted = dest is None or dest.startswith("files/")  # metadata (datasets/...) is not an entry
        self.futures: list[concurrent.futures.Future] = []
        self.left = 0
        self.fd = -1
        self.lock = threading.Lock()
        self.over = False

    def start(self, priority: int) -> None:
        try:
            if self.counted:
                self.server.cache.make_room(self.size)
        except BaseException as exc:
            self.server._settle(self.pending, _error(0, exc))
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.ftruncate(self.fd, self.size)
        except BaseException as exc:
            self.fail(exc)
            return
        parts = [Range(self.key, s, min(s + PART, self.size), self.etag) for s in range(0, self.size, PART)]
        self.left = len(parts)
        if not parts:
            self.server.work.submit(self.finish)
            return
        self.futures = self.store.fetcher.fetch(parts, priority)
        for fut, part in zip(self.futures, parts):
            fut.add_done_callback(lambda f, p=part: self.server.work.submit(self.landed, f, p))

    def landed(self, fut: concurrent.futures.Future, part: Range) -> None:
        if fut.cancelled():
            self.fail(None)
            return
        try:
            data = fut.result()
            with self.lock:
                if self.over:
                    return
                os.pwrite(self.fd, data, part.start)
                self.left -= 1
                last = self.left == 0
        except BaseException as exc:
            self.fail(exc)
            return
        if last:
            self.finish()

    def finish(self) -> None:
        try:
            os.close(self.fd)
            self.fd = -1
            digest = _sha256_file(self.tmp)
            if self.sha256 is not None and digest != self.sha256:
                raise ChecksumMismatch(f"{self.store.where(self.key)}: sha256 {digest[:16]}... of the {self.size} "
                                       f"bytes read is not the recorded {self.sha256[:16]}...: the object is "
                                       "damaged or another version")
            if self.dest is None:
                os.unlink(self.tmp)
                self.server.cache.release_room(self.size)  # hashed only: the room goes back
            else:
                os.replace(self.tmp, self.path)
        except BaseException as exc:
            self.fail(exc)
            return
        with self.lock:
            self.over = True
        self.server.count(files=1, file_bytes=self.size)
        self.server._settle(self.pending, {"result": {"entry": self.dest, "size": self.size, "sha256": digest}})

    def fail(self, exc: BaseException | None) -> None:
        """Stop (an error, or ``None``: cancelled), once: the other parts are cancelled, the temporary file goes,
        the room taken is given back."""
        with self.lock:
            if self.over:
                return
            self.over = True
        for fut in self.futures:
            fut.cancel()
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)
        if self.counted:
            self.server.cache.release_room(self.size)
        self.server._settle(self.pending, None if exc is None else _error(0, exc))

    def cancel(self) -> None:
        self.fail(None)


def _sha256_file(path: Path) -> str:
    digest, buf = hashlib.sha256(), bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def serve(cache_dir: str, socket_name: str, limit: int, linger: float) -> None:
    """The downloader's entry point (``python -m packer.storage.downloader``): bind, detach from the starter
    (a second fork: the starter's child exits at once and the downloader is nobody's child to reap), say
    ``ready PID`` on stdout, serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the clients, which stop their requests
    server = DownloaderServer(Path(cache_dir), cache_root(cache_dir) / socket_name, limit, linger)
    if os.fork():
        os._exit(0)
    os.setsid()
    print(f"ready {os.getpid()}", flush=True)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    try:
        server.serve()
    except BaseException:
        sys.stderr.write(redact_text(traceback.format_exc()))
        raise


# ---- the client: one per process (and per dataset: see packer/layout/remote.py) ----

@dataclass
class _Request:
    message: dict[str, Any]
    futures: list[concurrent.futures.Future]
    op: str
    left: int = 0


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def limit_bytes(cache_limit: int | str | None) -> int | None:
    """``cache_limit`` in bytes ("20GB" or an int); None stays None (no say in the limit)."""
    if cache_limit is None:
        return None
    limit = parse_bytes(cache_limit) if isinstance(cache_limit, str) else int(cache_limit)
    if limit <= 0:
        raise PackerError(f"cache_limit {cache_limit!r}: a positive size expected (e.g. 20GB)")
    return limit


class DownloaderClient:
    """This process's connection to the node's downloader for ``cache_dir`` (started by exec when none runs).
    ``cache_limit``: the bytes the cache may hold ("20GB"; None: no say, as ``packer info`` and ``verify``, which
    keep nothing but metadata); ``linger``: how long a downloader waits for a new
    client once its last one has gone. Not to be used in a process forked from the one that made it."""

    def __init__(self, cache_dir: str | os.PathLike, cache_limit: int | str | None, *,
                 linger: float = 2.0) -> None:
        self.cache_dir = Path(cache_dir).absolute()
        self.root = cache_root(cache_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.limit = limit_bytes(cache_limit)
        self.linger = linger
        key = environment_key()
        self.socket_path = self.root / f"downloader-{key}.sock"
        self.log_path = self.root / "downloader.log"
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Request] = {}
        self._ids = itertools.count()
        self._specs: dict[str, tuple[int, dict[str, Any]]] = {}  # spec text -> (sid, store message)
        self._restarts = 0
        self._closing = False
        self.server_pid = 0
        self._frames = _Frames()
        self._sock = self._connect()
        self._reader = threading.Thread(target=self._read, name="packer-downloader-client", daemon=True)
        self._reader.start()

    # -- connecting, and starting the downloader --

    def _connect(self) -> socket.socket:
        for _ in range(5):
            sock = try_connect(self.socket_path)
            if sock is None:
                with _file_lock(self.socket_path.with_suffix(".lock")):
                    sock = try_connect(self.socket_path)
                    if sock is None:
                        self._start()
                        sock = try_connect(self.socket_path)
            if sock is None:
                continue
            try:
                return self._hello(sock)
            except (OSError, EOFError):  # it was exiting as we came: start one again
                sock.close()
        raise DownloaderGone(f"could not reach the downloader of {self.cache_dir} (see {self.log_path})")

    def _hello(self, sock: socket.socket) -> socket.socket:
        sock.settimeout(60)
        sock.sendall(_frame({"op": "hello", "version": PROTOCOL, "pid": os.getpid(), "limit": self.limit}))
        frames = _Frames()
        while True:
            data = sock.recv(1 << 16)
            if not data:
                raise EOFError
            got = frames.feed(data)
            if got:
                break
        if got[0].get("version") != PROTOCOL:
            raise DownloaderGone(f"the downloader of {self.cache_dir} speaks protocol {got[0].get('version')}, "
                                 f"this packer {PROTOCOL}: let the jobs of the other packer end first")
        self.server_pid = int(got[0]["pid"])
        self._frames = frames  # what came after the answer (nothing yet: no request was sent)
        sock.settimeout(None)
        return sock

    def _start(self) -> None:
        """Start a downloader (exec, a fresh interpreter) and wait until it listens."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[2])] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "packer.storage.downloader", str(self.cache_dir), self.socket_path.name,
                 str(self.limit or UNBOUNDED), str(self.linger)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=env, close_fds=True)
        assert proc.stdout is not None
        try:
            line = proc.stdout.readline().decode(errors="replace").split()
        finally:
            proc.stdout.close()
            proc.wait()  # the starter's child: it exits once the downloader is detached
        if len(line) != 2 or line[0] != "ready":
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:] if self.log_path.exists() \
                else []
            raise DownloaderGone(f"the downloader of {self.cache_dir} did not start (exit {proc.returncode})"
                                 + (f": {redact_text(tail[0])}" if tail else ""))

    # -- requests --

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise PackerError("a DownloaderClient belongs to the process that made it (a forked child makes its "
                              "own: packer's remote datasets do, through PerProcess)")

    def _store_id(self, spec: StoreSpec) -> int:
        text = json.dumps([spec.url, spec.options, asdict(spec.policy)], sort_keys=True)
        with self._lock:
            known = self._specs.get(text)
            if known is not None:
                return known[0]
            sid = len(self._specs)
            message = {"op": "store", "sid": sid, "url": spec.url, "options": spec.options,
                       "policy": asdict(spec.policy)}
            self._specs[text] = (sid, message)
        self._send(message)
        return sid

    def _send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            self._sock.sendall(_frame(message))

    def _submit(self, op: str, count: int, **fields: Any) -> list[concurrent.futures.Future]:
        self._check_process()
        futures: list[concurrent.futures.Future] = [concurrent.futures.Future() for _ in range(count)]
        if not count:
            return futures
        with self._lock:
            rid = next(self._ids)
            message = {"op": op, "id": rid, **fields}
            self._pending[rid] = _Request(message, futures, op, count)
        for i, fut in enumerate(futures):
            fut.add_done_callback(lambda f, i=i: self._cancelled(rid, i) if f.cancelled() else None)
        try:
            self._send(message)
        except OSError:
            pass  # the reader finds the downloader gone and sends it again to the next one
        return futures

    def _cancelled(self, rid: int, i: int) -> None:
        with self._lock:
            req = self._pending.get(rid)
            if req is None:
                return
            req.left -= 1
            if req.left <= 0:
                del self._pending[rid]
        with contextlib.suppress(OSError):
            self._send({"op": "cancel", "id": rid, "i": [i]})

    def head(self, spec: StoreSpec, key: str) -> ObjectInfo:
        """Size and ETag of object ``key`` (``ObjectNotFound`` for a missing one)."""
        return _wait(self._submit("head", 1, sid=self._store_id(spec), key=key)[0])

    def submit_head(self, spec: StoreSpec, key: str) -> concurrent.futures.Future:
        """``head`` without waiting: many in flight."""
        return self._submit("head", 1, sid=self._store_id(spec), key=key)[0]

    def list(self, spec: StoreSpec, prefix: str = "") -> list[ObjectInfo]:
        """Every object below the store's root whose key starts with ``prefix``."""
        return _wait(self._submit("list", 1, sid=self._store_id(spec), prefix=prefix)[0])

    def fetch(self, spec: StoreSpec, key: str, etag: str | None, ranges: Sequence[tuple[int, int, Sequence]],
              priority: int = 0) -> list[concurrent.futures.Future]:
        """Ranges ``(start, end, pieces)`` of object ``key`` at version ``etag`` into the cache; one future per
        range giving its entry's path. ``pieces``: ``(start, end, algorithm, hexdigest)`` inside the range, each
        checked before the entry is made. Lower ``priority`` is fetched first; cancelling a future ends its
        request."""
        wire = [[int(s), int(e), [[int(a), int(b), alg, dig] for a, b, alg, dig in pieces]] for s, e, pieces in ranges]
        return self._submit("fetch", len(wire), sid=self._store_id(spec), key=key, etag=etag, ranges=wire,
                            priority=int(priority))

    def fetch_file(self, spec: StoreSpec, key: str, etag: str | None, size: int, sha256: str | None,
                   dest: str | None, priority: int = 0) -> concurrent.futures.Future:
        """Object ``key`` whole into the cache entry ``dest`` ("files/...", a path below the cache's root), checked
        against ``size`` and ``sha256``; the future gives ``(path or None, sha256)``. ``dest`` None: the object is
        only hashed (in a temporary file counted against the limit, deleted once hashed)."""
        return self._submit("fetch_file", 1, sid=self._store_id(spec), key=key, etag=etag, size=int(size),
                            sha256=sha256, dest=None if dest is None else _checked_dest(dest),
                            priority=int(priority))[0]

    def need(self, names: Iterable[str], order: int | None) -> None:
        """Tell the eviction policy that entries ``names`` are read again at step ``order`` of this pass (lower:
        sooner), or, with None, not again this pass (they go first when room is needed)."""
        self._check_process()
        self._send({"op": "need", "names": list(names), "order": order})

    def stats(self) -> dict[str, Any]:
        """The downloader's counters: GETs, bytes fetched, hits, waits, evictions, its CPU seconds, its pid."""
        return _wait(self._submit("stats", 1)[0])

    def path(self, entry: str) -> Path:
        """The file of cache entry ``entry`` (a ``fetch`` answer's name)."""
        return _entry_path(self.root, entry)

    # -- answers --

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(1 << 16)
                messages = self._frames.feed(data) if data else None
            except (OSError, ValueError, PackerError):
                messages = None
            if messages is None:
                if self._closing or not self._recover():
                    return
                continue
            for message in messages:
                self._dispatch(message)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        with self._lock:
            req = self._pending.get(msg["id"])
            if req is None:
                return
            fut = req.futures[msg.get("i", 0)]
            if fut.done():
                return
            req.left -= 1
            if req.left <= 0:
                del self._pending[msg["id"]]
        if "error" in msg:
            _settle(fut, exc=_ERRORS.get(msg["error"], StorageError)(msg["message"]))
        elif req.op == "fetch":
            _settle(fut, self.path(msg["entry"]))
        elif req.op == "fetch_file":
            result = msg["result"]
            _settle(fut, (None if result["entry"] is None else self.root / result["entry"], result["sha256"]))
        elif req.op == "head":
            _settle(fut, ObjectInfo(**msg["result"]))
        elif req.op == "list":
            _settle(fut, [ObjectInfo(**i) for i in msg["result"]])
        else:
            _settle(fut, msg["result"])

    def _recover(self) -> bool:
        """The downloader went away with requests of ours under way: start it again, once, and send them again;
        after that, fail them with one error."""
        with self._lock:
            gone = self.server_pid
            again = self._restarts < 1
            self._restarts += 1
        if again:
            try:
                self._sock.close()
                self._sock = self._connect()
                with self._lock:
                    messages = [m for _, m in self._specs.values()] + [r.message for r in self._pending.values()]
                for message in messages:
                    self._send(message)
                return True
            except (OSError, PackerError):
                pass
        error = DownloaderGone(f"the downloader of {self.cache_dir} (pid {gone}) ended"
                               f"{' twice' if not again else ' and could not be started again'}; see "
                               f"{self.log_path}")
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for req in pending:
            for fut in req.futures:
                _settle(fut, exc=error)
        return False

    def close(self) -> None:
        """Hang up (the downloader cancels what only this client waited for) and join the reader thread; the
        futures still pending are cancelled."""
        if self._closing or os.getpid() != self._pid:
            return
        self._closing = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._reader.join()
        self._sock.close()
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for req in pending:
            for fut in req.futures:
                fut.cancel()

    def forget(self) -> None:
        """In a forked child: drop the parent's connection without hanging it up (the parent still uses it)."""
        with contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> DownloaderClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DownloaderClient({str(self.cache_dir)!r}, pid {self.server_pid})"


def _settle(fut: concurrent.futures.Future, result: Any = None, exc: BaseException | None = None) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)


def _wait(fut: concurrent.futures.Future) -> Any:
    """``fut.result()``; Ctrl-C cancels the request (the downloader forgets it)."""
    try:
        return fut.result()
    except BaseException:
        fut.cancel()
        raise


def wait_all(futures: Sequence[concurrent.futures.Future]) -> list[Any]:
    """Every result in order; on an error or Ctrl-C the others are cancelled first."""
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        raise


def location_of(spec: StoreSpec, key: str) -> Location:
    return parse(spec.url).join(key) if key else parse(spec.url)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
