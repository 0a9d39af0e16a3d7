"""An emulated object store for slow links (what ``--emulate hdd`` is for disks): a local folder served over HTTP
as an S3-compatible subset, with a first-byte latency per request and one bandwidth limit for the whole link.

The subset is what packer's readers and writers use: GET with ``Range`` (and ``If-Match``/``If-None-Match``), HEAD,
ListObjectsV2 with pagination, PUT (``If-None-Match: *`` for a create-only put), multipart uploads and DELETE,
path-style (``http://host:port/<bucket>/<key>``), so the same client reads it as
``s3://<bucket>/...`` through an endpoint URL, or as plain ``http://`` URLs. Signatures are not checked. Bodies go
out with ``os.sendfile`` in paced chunks; ``stats`` counts what the server did (requests, delays applied, bytes
paced), so tests check latency and bandwidth by counting, not by timing. ``faults`` injects failures at the server
(status codes, connections cut mid-body, short bodies, slow bodies, resets) for the storage layer's tests;
``on_write`` is told of each write request and who sent it (a test tells which process put an object).
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit
from xml.etree import ElementTree
from xml.sax.saxutils import escape

CHUNK = 128 << 10  # bytes per paced sendfile call
UPLOADS = ".emulated-uploads"  # under root: puts and multipart parts being received (never listed or served)


@dataclass
class Fault:
    """What the server does instead of answering normally. ``kind``: "status" (answer ``status`` with an S3 error
    ``code``), "cut" (send ``after`` body bytes of the promised length, then close), "short" (a complete response
    whose body and Content-Length are ``after`` bytes shorter than asked, Content-Range as asked), "slow" (send
    the body at ``rate`` bytes/s), "reset" (close the connection with a TCP reset before answering)."""

    kind: str
    status: int = 503
    code: str = "SlowDown"
    after: int = 0
    rate: float = 1024.0


@dataclass
class FaultRule:
    fault: Fault
    key: str | None  # None: any key
    method: str  # "GET", "HEAD", "PUT" (a put, a part or a multipart's completion), "DELETE" or "*"
    times: int  # how many requests it hits; -1: all


class FaultPlan:
    """Faults to inject, in the order added; each rule hits ``times`` matching requests, then stops matching."""

    def __init__(self) -> None:
        self._rules: list[FaultRule] = []
        self._lock = threading.Lock()
        self.applied: list[tuple[str, str, str]] = []  # (kind, method, key) of every fault served

    def add(self, fault: Fault, key: str | None = None, method: str = "GET", times: int = 1) -> FaultPlan:
        with self._lock:
            self._rules.append(FaultRule(fault, key, method, times))
        return self

    def clear(self) -> None:
        """Forget every rule and what was applied."""
        with self._lock:
            self._rules.clear()
            self.applied.clear()

    def take(self, method: str, key: str) -> Fault | None:
        with self._lock:
            for rule in self._rules:
                if rule.times != 0 and rule.method in ("*", method) and rule.key in (None, key):
                    rule.times -= 1 if rule.times > 0 else 0
                    self.applied.append((rule.fault.kind, method, key))
                    return rule.fault
        return None


@dataclass
class ServerStats:
    """The server's own accounting: what it served and the delays it applied."""

    requests: int = 0
    gets: int = 0
    heads: int = 0
    lists: int = 0
    puts: int = 0  # objects written: single puts and completed multipart uploads
    parts: int = 0  # multipart parts received
    deletes: int = 0
    put_bytes: int = 0  # request body bytes received (paced as the link's when a bandwidth is set)
    body_bytes: int = 0  # object bytes sent (all of them are paced when a bandwidth is set)
    latency_delays: int = 0  # first-byte delays applied (one per request when latency > 0)
    latency_seconds: float = 0.0  # their sum, as scheduled
    paced_bytes: int = 0
    paced_seconds: float = 0.0  # link time those bytes were given: paced_bytes / bandwidth
    connections: int = 0
    open_connections: int = 0  # connections the server holds now
    active: int = 0  # object requests being answered now
    max_active: int = 0  # the most at once (a body's last bytes may still be leaving after the client has them)
    waiting: int = 0  # requests in their first-byte delay now (latency > 0)
    max_waiting: int = 0  # the most at once: a client holds each request through this delay, so a bound on its
    # requests in flight shows here exactly, where max_active may count one more whose last bytes are leaving
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def enter(self) -> None:
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)

    def leave(self) -> None:
        with self.lock:
            self.active -= 1

    def delay(self, seconds: float) -> None:
        """Hold a request ``seconds`` before its first byte, counted in ``waiting``."""
        with self.lock:
            self.waiting += 1
            self.max_waiting = max(self.max_waiting, self.waiting)
        try:
            time.sleep(seconds)
        finally:
            with self.lock:
                self.waiting -= 1

    def snapshot(self) -> dict[str, float]:
        with self.lock:
            return {k: v for k, v in vars(self).items() if k != "lock"}

    def settled(self, timeout: float = 10.0) -> dict[str, float]:
        """The counters once no request is being answered: a client can read a body's last byte before the
        server thread has counted it."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if self.active == 0 or time.monotonic() >= deadline:
                    return {k: v for k, v in vars(self).items() if k != "lock"}
            time.sleep(0.001)

    def closed(self, calm: float = 0.2, timeout: float = 10.0) -> dict[str, float]:
        """The counters once every connection has ended and none opened for ``calm`` seconds: after its client is
        killed, requests it had fully sent may still be in the server's socket buffers, unanswered."""
        deadline, quiet_since, seen = time.monotonic() + timeout, time.monotonic(), -1
        while True:
            with self.lock:
                now, state = time.monotonic(), (self.connections, self.open_connections, self.active)
                if state != seen or self.open_connections or self.active:
                    quiet_since, seen = now, state
                if now - quiet_since >= calm or now >= deadline:
                    return {k: v for k, v in vars(self).items() if k != "lock"}
            time.sleep(0.005)


class Link:
    """One shared link: every body chunk of every connection is given its slot of ``bandwidth`` (bytes/s) in turn,
    so the server's total rate is the link's, whatever the number of requests in flight."""

    def __init__(self, bandwidth: float | None) -> None:
        self.bandwidth = bandwidth
        self._free_at = 0.0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> float:
        """Book ``nbytes`` on the link; returns the monotonic time at which they may be sent."""
        if not self.bandwidth:
            return 0.0
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + nbytes / self.bandwidth
        return start


def _etag(st: os.stat_result) -> str:
    return f'"{st.st_size:x}-{st.st_mtime_ns:x}-{st.st_ino:x}"'


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` / ``a-`` / ``-n`` -> [start, end) within ``size``; None for no range; ValueError unsatisfiable."""
    if not header:
        return None
    unit, _, spec = header.partition("=")
    first, dash, last = spec.strip().partition("-")
    if unit.strip() != "bytes" or not dash or "," in spec:
        raise ValueError(header)
    if first == "":
        start, end = max(0, size - int(last)), size
    else:
        start, end = int(first), size if last == "" else min(size, int(last) + 1)
    if start >= size or start >= end:
        raise ValueError(header)
    return start, end


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args) -> None:  # quiet: tests and benches read the counters instead
        pass

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.store.stats.add(connections=1, open_connections=1)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.store.stats.add(open_connections=-1)

    def _target(self) -> tuple[str, str, dict[str, list[str]]]:
        parts = urlsplit(self.path)
        bucket, _, key = unquote(parts.path).lstrip("/").partition("/")
        return bucket, key, parse_qs(parts.query, keep_blank_values=True)

    def _error(self, status: int, code: str, message: str = "", close: bool = False) -> None:
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f"<Message>{escape(message or code)}</Message></Error>").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _first_byte(self) -> None:
        store = self.server.store
        store.stats.add(requests=1)
        if store.latency > 0:
            store.stats.delay(store.latency)
            store.stats.add(latency_delays=1, latency_seconds=store.latency)

    def do_HEAD(self) -> None:
        self._object("HEAD")

    def do_PUT(self) -> None:
        self._write("PUT")

    def do_POST(self) -> None:
        self._write("POST")

    def do_DELETE(self) -> None:
        self._write("DELETE")

    def do_GET(self) -> None:
        bucket, key, query = self._target()
        if bucket == self.server.store.bucket and (key == "" and "list-type" in query):
            self._first_byte()
            self.server.store.stats.add(lists=1)
            self._list(query)
        else:
            self._object("GET")

    def _object(self, method: str) -> None:
        self.server.store.stats.enter()
        try:
            self._answer(method)
        finally:
            self.server.store.stats.leave()

    def _answer(self, method: str) -> None:
        store = self.server.store
        bucket, key, _ = self._target()
        self._first_byte()
        store.stats.add(**{"gets" if method == "GET" else "heads": 1})
        fault = store.faults.take(method, key) if store.faults is not None else None
        if fault is not None and fault.kind == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        if fault is not None and fault.kind == "status":
            return self._error(fault.status, fault.code, close=fault.status >= 500)
        path = store.resolve(bucket, key)
        if path is None:
            return self._error(404, "NoSuchKey" if bucket == store.bucket else "NoSuchBucket")
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return self._error(404, "NoSuchKey")
        try:
            self._send_object(method, fd, fault)
        finally:
            os.close(fd)

    def _send_object(self, method: str, fd: int, fault: Fault | None) -> None:
        st = os.fstat(fd)
        etag = ("W/" if self.server.store.weak_etags else "") + _etag(st)
        if_match, if_none = self.headers.get("If-Match"), self.headers.get("If-None-Match")
        if if_match and (if_match.strip() != "*" and (if_match.strip() != etag or etag.startswith("W/"))):
            return self._error(412, "PreconditionFailed", "the object's ETag is not the one given in If-Match")
        if if_none and if_none.strip() in ("*", etag):
            self.send_response(304)
            self.send_header("ETag", etag)
            self.send_header("Content-Length", "0")
            return self.end_headers()
        try:
            span = _parse_range(self.headers.get("Range"), st.st_size) if method == "GET" else None
        except ValueError:
            return self._error(416, "InvalidRange", "The requested range is not satisfiable")
        start, end = span or (0, st.st_size)
        length = end - start
        if fault is not None and fault.kind == "short":
            length = max(0, length - max(1, fault.after))
        self.send_response(206 if span else 200)
        self.send_header("Content-Length", str(length))
        self.send_header("ETag", etag)
        self.send_header("Last-Modified", formatdate(st.st_mtime, usegmt=True))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        if span:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{st.st_size}")
        self.end_headers()
        if method == "GET":
            self.wfile.flush()
            cut = fault is not None and fault.kind == "cut"
            rate = fault.rate if fault is not None and fault.kind == "slow" else None
            self._send_body(fd, start, min(length, fault.after) if cut and fault else length, rate)
            if cut:
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True

    def _write(self, method: str) -> None:
        """PUT an object or a part, POST to start or complete a multipart upload, DELETE an object or an upload."""
        store = self.server.store
        store.stats.enter()
        try:
            bucket, key, query = self._target()
            if store.on_write is not None:
                store.on_write(method, key, self.client_address)
            self._first_byte()
            body = self._receive()
            if method == "POST" and bucket == store.bucket and not key and "delete" in query:
                return self._delete_many(body)
            if bucket != store.bucket or not key or store.resolve_new(key) is None:
                return self._error(404 if bucket != store.bucket else 400, "NoSuchBucket" if bucket != store.bucket
                                   else "InvalidObjectName")
            fault = store.faults.take("DELETE" if method == "DELETE" else "PUT", key) if store.faults else None
            if fault is not None and fault.kind == "status":
                return self._error(fault.status, fault.code, close=fault.status >= 500)
            if method == "DELETE":
                return self._delete(key, query)
            if method == "POST" and "uploads" in query:
                upload = store.new_upload(key)
                return self._xml(200, f"<InitiateMultipartUploadResult><Bucket>{escape(bucket)}</Bucket><Key>"
                                      f"{escape(key)}</Key><UploadId>{upload}</UploadId></InitiateMultipartUploadResult>")
            if "uploadId" in query:
                upload = query["uploadId"][0]
                if method == "PUT":
                    etag = store.put_part(upload, int(query["partNumber"][0]), body)
                    store.stats.add(parts=1)
                    return self._xml(200, "", etag)
                etag = store.complete_upload(key, upload, self.headers.get("If-None-Match"))
            else:
                etag = store.put(key, body, self.headers.get("If-None-Match"))
        except FileExistsError:
            return self._error(412, "PreconditionFailed", "an object exists there (If-None-Match: *)")
        except KeyError:
            return self._error(404, "NoSuchUpload")
        finally:
            store.stats.leave()
        store.stats.add(puts=1)
        if "uploadId" in query:
            return self._xml(200, f"<CompleteMultipartUploadResult><Bucket>{escape(bucket)}</Bucket><Key>"
                                  f"{escape(key)}</Key><ETag>{escape(etag)}</ETag></CompleteMultipartUploadResult>",
                             etag)
        self._xml(200, "", etag)

    def _receive(self) -> bytes:
        """The request's body (Content-Length), paced as the link's bytes."""
        store, remaining, chunks = self.server.store, int(self.headers.get("Content-Length") or 0), []
        while remaining > 0:
            n = min(CHUNK, remaining)
            wait = store.link.reserve(n) - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            chunk = self.rfile.read(n)
            if not chunk:
                raise ConnectionError("the body ended early")
            chunks.append(chunk)
            remaining -= len(chunk)
            store.stats.add(put_bytes=len(chunk), **({"paced_bytes": len(chunk), "paced_seconds": len(chunk) /
                                                      store.link.bandwidth} if store.link.bandwidth else {}))
        return b"".join(chunks)

    def _delete(self, key: str, query: dict[str, list[str]]) -> None:
        store = self.server.store
        if "uploadId" in query:
            store.abort_upload(query["uploadId"][0])
        else:
            store.delete(key)
            store.stats.add(deletes=1)
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _delete_many(self, body: bytes) -> None:
        """DeleteObjects (POST ?delete): every key named, one request."""
        store = self.server.store
        keys = [k.text or "" for k in ElementTree.fromstring(body).iter() if k.tag.rsplit("}", 1)[-1] == "Key"]
        for key in keys:
            fault = store.faults.take("DELETE", key) if store.faults is not None else None
            if fault is not None and fault.kind == "status":
                return self._error(fault.status, fault.code, close=fault.status >= 500)
        for key in keys:
            store.delete(key)
        store.stats.add(deletes=len(keys))
        self._xml(200, "<DeleteResult>" + "".join(f"<Deleted><Key>{escape(k)}</Key></Deleted>" for k in keys)
                  + "</DeleteResult>")

    def _xml(self, status: int, inner: str, etag: str | None = None) -> None:
        body = f'<?xml version="1.0" encoding="UTF-8"?>{inner}'.encode() if inner else b""
        self.send_response(status)
        if etag is not None:
            self.send_header("ETag", etag)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_body(self, fd: int, offset: int, length: int, rate: float | None) -> None:
        store, sock = self.server.store, self.connection
        chunk = CHUNK if rate is None else max(1, int(rate / 10))
        sent = 0
        while sent < length:
            n = min(chunk, length - sent)
            at = store.link.reserve(n) if rate is None else time.monotonic() + n / rate
            wait = at - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            done = 0
            while done < n:
                k = os.sendfile(sock.fileno(), fd, offset + sent + done, n - done)
                if k == 0:
                    raise ConnectionError("file shrank while sent")
                done += k
            sent += n
            store.stats.add(body_bytes=n, **({"paced_bytes": n, "paced_seconds": n / store.link.bandwidth}
                                             if store.link.bandwidth and rate is None else {}))

    def _list(self, query: dict[str, list[str]]) -> None:
        store = self.server.store
        prefix = query.get("prefix", [""])[0]
        delimiter = query.get("delimiter", [""])[0]
        after = query.get("continuation-token", query.get("start-after", [""]))[0]
        limit = min(store.page_size, int(query.get("max-keys", ["1000"])[0]))
        entries: list[tuple[str, os.stat_result | None]] = []
        truncated = False
        for key, path in store.walk(prefix, delimiter, after):
            if len(entries) == limit:
                truncated = True
                break
            try:
                entries.append((key, None if path is None else os.stat(path)))
            except FileNotFoundError:  # deleted since the walk
                continue
        parts = [f"<Name>{escape(store.bucket)}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(entries)}"
                 f"</KeyCount><MaxKeys>{limit}</MaxKeys><IsTruncated>{str(truncated).lower()}</IsTruncated>"]
        if delimiter:
            parts.append(f"<Delimiter>{escape(delimiter)}</Delimiter>")
        if truncated:
            parts.append(f"<NextContinuationToken>{escape(entries[-1][0])}</NextContinuationToken>")
        for key, st in entries:
            if st is None:
                parts.append(f"<CommonPrefixes><Prefix>{escape(key)}</Prefix></CommonPrefixes>")
            else:
                modified = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(st.st_mtime))
                parts.append(f"<Contents><Key>{escape(key)}</Key><LastModified>{modified}</LastModified><ETag>"
                             f"{escape(_etag(st))}</ETag><Size>{st.st_size}</Size>"
                             "<StorageClass>STANDARD</StorageClass></Contents>")
        body = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/'
                f'2006-03-01/">{"".join(parts)}</ListBucketResult>').encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, address: tuple[str, int], store: EmulatedStore) -> None:
        self.store = store
        super().__init__(address, _Handler)

    def handle_error(self, request, client_address) -> None:
        """A client that went away mid-body (a cancelled read) is normal here; anything else is printed."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class EmulatedStore:
    """Serve ``root`` as bucket ``bucket`` on ``host:port`` (0: a free port) with ``latency`` seconds before each
    response and ``bandwidth`` bytes/s for the whole link (None: unlimited). A context manager; ``endpoint`` is
    the URL to give the S3 client, ``url(key)`` a plain http URL of an object."""

    def __init__(self, root: str | os.PathLike, bucket: str = "packer", *, latency: float = 0.0,
                 bandwidth: float | None = None, host: str = "127.0.0.1", port: int = 0, page_size: int = 1000,
                 faults: FaultPlan | None = None, weak_etags: bool = False,
                 on_write: Callable[[str, str, tuple[str, int]], None] | None = None) -> None:
        if latency < 0 or (bandwidth is not None and bandwidth <= 0) or page_size < 1:
            raise ValueError("latency >= 0, bandwidth > 0 (or None) and page_size >= 1 expected")
        self.root = Path(root).resolve()
        self.bucket, self.latency, self.page_size, self.faults = bucket, latency, page_size, faults
        self.weak_etags = weak_etags  # GET and HEAD send W/"..." (nginx or a CDN that compresses): If-Match fails
        self.on_write = on_write  # (method, key, client address) of each write, in its thread, before it is answered
        self.link = Link(bandwidth)
        self.stats = ServerStats()
        self._address = (host, port)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._write_lock = threading.Lock()

    def resolve(self, bucket: str, key: str) -> Path | None:
        """The regular file under ``root`` that ``key`` names, or None (outside root, missing, not a file)."""
        if bucket != self.bucket or not key or "\0" in key or key.split("/")[0] == UPLOADS:
            return None
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root) or not path.is_file():
            return None
        return path

    def resolve_new(self, key: str) -> Path | None:
        """Where an object ``key`` is written under ``root`` (None: outside it, or the uploads' folder)."""
        if not key or "\0" in key or key.split("/")[0] == UPLOADS:
            return None
        path = Path(os.path.abspath(self.root / key))
        return path if path.is_relative_to(self.root) and path != self.root else None

    def _incoming(self) -> Path:
        folder = self.root / UPLOADS
        folder.mkdir(exist_ok=True)
        return folder

    def put(self, key: str, data: bytes, if_none_match: str | None = None) -> str:
        """Write ``key`` whole (a temporary file renamed into place); ``If-None-Match: *``: FileExistsError if there."""
        tmp = self._incoming() / f"put-{uuid.uuid4().hex}"
        tmp.write_bytes(data)
        return self._place(key, tmp, if_none_match)

    def _place(self, key: str, tmp: Path, if_none_match: str | None) -> str:
        path = self.resolve_new(key)
        assert path is not None
        with self._write_lock:
            if if_none_match is not None and if_none_match.strip() == "*" and path.exists():
                tmp.unlink()
                raise FileExistsError(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
            return _etag(os.stat(path))

    def delete(self, key: str) -> None:
        path = self.resolve(self.bucket, key)
        if path is not None:
            path.unlink(missing_ok=True)
            for parent in path.parents:  # folders it leaves empty, up to root (a bucket has no folders)
                if parent == self.root or any(parent.iterdir()):
                    break
                parent.rmdir()

    def new_upload(self, key: str) -> str:
        upload = uuid.uuid4().hex
        (self._incoming() / f"mp-{upload}").mkdir()
        return upload

    def put_part(self, upload: str, number: int, data: bytes) -> str:
        folder = self._incoming() / f"mp-{upload}"
        if not folder.is_dir():
            raise KeyError(upload)
        (folder / f"{number:05d}").write_bytes(data)
        return f'"{upload[:8]}-{number}-{len(data):x}"'

    def complete_upload(self, key: str, upload: str, if_none_match: str | None = None) -> str:
        """The parts received, in number order, become ``key`` (a client names the parts it sends: all of them)."""
        folder = self._incoming() / f"mp-{upload}"
        if not folder.is_dir():
            raise KeyError(upload)
        tmp = self._incoming() / f"put-{upload}"
        with open(tmp, "wb") as out:
            for part in sorted(folder.iterdir()):
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        shutil.rmtree(folder)
        return self._place(key, tmp, if_none_match)

    def abort_upload(self, upload: str) -> None:
        shutil.rmtree(self._incoming() / f"mp-{upload}", ignore_errors=True)

    def walk(self, prefix: str, delimiter: str, after: str = "") -> Iterator[tuple[str, str | None]]:
        """(key, file path) of every file whose key starts with ``prefix`` and sorts after ``after``, in key order;
        with ``delimiter``, the common prefixes below ``prefix`` as (prefix, None). Names only, and without a
        delimiter lazily, folder by folder, skipping folders wholly before ``after``: a page of a large prefix
        costs about its own entries (and its folder's names), not the whole prefix's."""
        if delimiter:
            yield from (entry for entry in self._walk_all(prefix, delimiter) if entry[0] > after)
        else:
            yield from self._walk_sorted(str(self.root), "", prefix, after)

    def _walk_sorted(self, folder: str, rel: str, prefix: str, after: str) -> Iterator[tuple[str, str | None]]:
        entries: list[tuple[str, str, bool]] = []  # (key, or key + "/" for a folder; path; is a folder)
        with os.scandir(folder) as it:
            for e in it:
                if not rel and e.name == UPLOADS:
                    continue
                is_dir = e.is_dir()
                key = f"{rel}{e.name}/" if is_dir else f"{rel}{e.name}"
                entries.append((key, e.path, is_dir and not e.is_symlink()))  # as os.walk: no symlinked folders
        for key, path, is_dir in sorted(entries):  # a folder's keys all sort as its "name/" among its siblings
            if key.endswith("/"):
                if not is_dir or not (key.startswith(prefix) or prefix.startswith(key)):
                    continue
                if key < after and not after.startswith(key):  # every key below it sorts before ``after``
                    continue
                yield from self._walk_sorted(path, key, prefix, after)
            elif key.startswith(prefix) and key > after:
                yield key, path

    def _walk_all(self, prefix: str, delimiter: str) -> list[tuple[str, str | None]]:
        out: dict[str, str | None] = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if not (dirpath == str(self.root) and d == UPLOADS))
            rel = os.path.relpath(dirpath, self.root)
            for name in filenames:
                key = name if rel == "." else f"{rel}/{name}".replace(os.sep, "/")
                if not key.startswith(prefix):
                    continue
                rest = key[len(prefix):]
                if delimiter and delimiter in rest:
                    out[prefix + rest.split(delimiter, 1)[0] + delimiter] = None
                else:
                    out[key] = os.path.join(dirpath, name)
        return sorted(out.items())

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise RuntimeError("the emulated store is not running: use it as a context manager or call start()")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def url(self, key: str) -> str:
        return f"{self.endpoint}/{self.bucket}/{quote(key)}"

    def start(self) -> EmulatedStore:
        self._server = _Server(self._address, self)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="packer-emulated-store", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self._server = self._thread = None

    def __enter__(self) -> EmulatedStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
