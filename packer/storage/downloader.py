"""The node's downloader: one process per node and cache directory (and storage environment) that every process on
the node (the main process, forked DataLoader workers, ThreadLoader threads, other ranks) asks for ranges and whole
objects over a Unix socket in the cache directory (packer/storage/protocol.py); the bytes travel through the
cache's files, never through the socket.

Why a process: obstore hangs in a child forked after its parent made a request (docs/remote.md), and DataLoader
forks its workers. The downloader is started by exec (``python -m packer.storage.downloader``, a fresh runtime) by
the first client that needs it (packer/storage/downloader_client.py), serves every client with one ``Fetcher`` per
store (many GETs in flight, in order of need), writes each range or object into the ``RangeCache`` (renamed into
place complete) and answers with the entry's name; the client then reads the file. So one download per byte per
node, obstore in no forked process, no data copied through pipes. Two clients asking for the same range share one
download; a GET no client waits for any more is cancelled. It exits when its last client has gone (with the node's
last process: a dead client's socket closes).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import resource
import signal
import sys
import threading
import traceback
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from packer.errors import PackerError
from packer.storage.cache import NextUse, RangeCache, check
from packer.storage.client import StoreSpec
from packer.storage.connections import Conn, Listener
from packer.storage.faults import RetryPolicy
from packer.storage.fetch import Fetcher, Range
from packer.storage.protocol import (
    PROTOCOL,
    cache_root,
    checked_dest,
    entry_path,
    error_answer,
    store_identity,
)
from packer.storage.url import redact_text
from packer.storage.wholeobject import PART, WholeObject

log = logging.getLogger(__name__)  # this process's stderr is the log file its starter gave it

MAX_IN_FLIGHT = 32  # GETs at once per store


@dataclass
class _Waiter:
    conn: Conn
    rid: int
    i: int  # the range's number in its request; -1: a whole-object request


@dataclass
class _Pending:
    """One download under way (a range or a whole object) and the requests waiting for it."""

    name: str
    waiters: list[_Waiter]
    cancel: Any = None  # callable that stops the download


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
        self.listener = Listener(socket_path)
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

    def serve(self) -> None:
        """Serve until no client has been connected for ``linger`` seconds, then stop everything."""
        try:
            self.listener.run(self._handle, self._dropped, self.linger)
        finally:
            self.shutdown()

    def _dropped(self, conn: Conn) -> None:
        """A client went away: its requests are cancelled (GETs nobody else waits for stop)."""
        with self.lock:
            asked = list(conn.asked)
        self._cancel(conn, asked)
        self._set_limit()

    def _set_limit(self) -> None:
        """The smallest limit a connected client asked for (none asked: as it was)."""
        limits = [int(c.limit) for c in self.listener.conns.values() if c.limit]
        if limits:
            self.cache.limit = min(limits)

    def shutdown(self) -> None:
        """Stop every download, close every store, remove the socket (if it is still this downloader's)."""
        self.listener.close(self._dropped)
        for store in self.stores.values():
            store.close()
        self.work.shutdown(wait=True, cancel_futures=True)
        self.cache.close()

    # -- requests --

    def _handle(self, conn: Conn, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "hello":
            conn.limit, conn.pid = msg.get("limit"), int(msg["pid"])
            self.count(clients_seen=1)
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
        counts.update(pid=os.getpid(), clients=len(self.listener.conns), cpu_s=use.ru_utime + use.ru_stime,
                      limit=self.cache.limit, usage=self.cache.usage(), evicted=self.cache.stats.evicted,
                      evicted_bytes=self.cache.stats.evicted_bytes,
                      gets=sum(s.fetcher.stats.requests for s in self.stores.values()),
                      requested_bytes=sum(s.fetcher.stats.requested_bytes for s in self.stores.values()))
        return counts

    def _wait_or_start(self, conn: Conn, rid: int, i: int, name: str) -> _Pending | None:
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

    def _fetch(self, conn: Conn, msg: dict[str, Any]) -> None:
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
            if _present(entry_path(self.root, name), end - start):
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
            self._settle(pending, error_answer(0, exc))
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

    def _cancel(self, conn: Conn, keys: Iterable[tuple[int, int]]) -> None:
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

    def _fetch_file(self, conn: Conn, msg: dict[str, Any]) -> None:
        store = _store_of(conn, msg)
        key, etag, rid, size = msg["key"], msg.get("etag"), msg["id"], int(msg["size"])
        dest = checked_dest(msg["dest"]) if msg.get("dest") else None
        if dest is not None and _present(self.root / dest, size):
            self.count(file_hits=1)
            conn.send({"id": rid, "result": {"entry": dest, "size": size, "sha256": msg.get("sha256")}})
            return
        name = dest or f"digest:{store.url(key)}\0{etag}\0{size}"
        pending = self._wait_or_start(conn, rid, -1, name)
        if pending is not None:
            def done(answer: dict[str, Any] | None) -> None:
                if answer is not None and "result" in answer:
                    self.count(files=1, file_bytes=size)
                self._settle(pending, answer)

            job = WholeObject(store.fetcher, self.cache, self.work, key, etag, size, msg.get("sha256"), dest,
                              store.where(key), done)
            pending.cancel = job.cancel
            job.start(int(msg.get("priority", 0)))


def _store_of(conn: Conn, msg: dict[str, Any]) -> _Store:
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
        return error_answer(rid, exc)
    return {"id": rid, "result": [asdict(i) for i in result] if op == "list" else asdict(result)}


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
        log.error("%s", redact_text(traceback.format_exc()))
        raise



if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
