"""A process's connection to the node's downloader (packer/storage/downloader.py): ``DownloaderClient`` starts the
downloader by exec when none listens on the cache directory's socket, sends requests (packer/storage/protocol.py)
and turns the answers into futures: a range or an object as the path of its cache file, an error as the storage
error it was. Ctrl-C in a wait, or cancelling a future, ends the request (the downloader forgets it). A downloader
that goes away with requests under way is started again once and the requests sent again; after that they fail
with one error. One client per process: a forked child makes its own (packer/layout/remote.py keeps one in a
``PerProcess``); obstore is never loaded here.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from packer.errors import PackerError
from packer.storage.client import ObjectInfo, StoreSpec
from packer.storage.faults import StorageError
from packer.storage.node import node_id
from packer.storage.protocol import (
    ERRORS,
    PROTOCOL,
    UNBOUNDED,
    DownloaderGone,
    Frames,
    cache_root,
    checked_dest,
    entry_path,
    environment_key,
    frame,
    limit_bytes,
    try_connect,
)
from packer.storage.url import redact_text


@dataclass
class _Request:
    """A request under way: its message (sent again to a restarted downloader) and one future per answer."""

    message: dict[str, Any]
    futures: list[concurrent.futures.Future]
    op: str
    left: int = 0


@dataclass
class _Line:
    """The client's socket, shared with its reader thread and its finalizer (neither may hold the client)."""

    sock: socket.socket


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class DownloaderClient:
    """This process's connection to the node's downloader for ``cache_dir`` (started by exec when none runs).
    ``cache_limit``: the bytes the cache may hold ("20GB"; None: no say, as ``packer info`` and ``verify``, which
    keep nothing but metadata); ``linger``: how long a downloader it starts waits for a new client once its last
    one has gone. Not to be used in a process forked from the one that made it (``forget`` it there)."""

    def __init__(self, cache_dir: str | os.PathLike, cache_limit: int | str | None, *,
                 linger: float = 2.0) -> None:
        self.cache_dir = Path(cache_dir).absolute()
        self.root = cache_root(cache_dir)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            os.close(os.open(self.root / "usage", os.O_RDWR | os.O_CREAT, 0o644))  # writable, or refused here
        except OSError as exc:
            raise PackerError(f"{self.cache_dir}: cannot keep a cache there ({exc.strerror or exc})") from None
        self.limit = limit_bytes(cache_limit)
        self.linger = linger
        key = environment_key()
        self.socket_path = self.root / f"downloader-{node_id()}-{key}.sock"  # a folder shared by nodes: one each
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
        self._frames = Frames()
        self._line = _Line(self._connect())
        # the reader and the finalizer hold the socket, not the client: one dropped unclosed is collected, hangs up
        self._reader = threading.Thread(target=_read_answers, args=(weakref.ref(self), self._line),
                                        name="packer-downloader-client", daemon=True)
        self._reader.start()
        self._finalizer = weakref.finalize(self, _hang_up, self._line, self._pid)
        self._finalizer.atexit = False  # at exit: the process's end hangs up (a hang-up first would set _recover going)

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
        sock.sendall(frame({"op": "hello", "version": PROTOCOL, "pid": os.getpid(), "limit": self.limit}))
        frames = Frames()
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
        with contextlib.suppress(OSError):  # the downloader is gone: the reader sends it again to the next one
            self._send(message)
        return sid

    def _send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            self._line.sock.sendall(frame(message))

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
        """Object ``key`` whole into ``dest``, a path below the cache's root: "files/..." (an entry, counted and
        evicted) or "datasets/..." (metadata: neither), checked against ``size`` and ``sha256``; the future gives
        ``(path or None, sha256)``. ``dest`` None: the object is only hashed (in a temporary file counted against
        the limit, deleted once hashed)."""
        return self._submit("fetch_file", 1, sid=self._store_id(spec), key=key, etag=etag, size=int(size),
                            sha256=sha256, dest=None if dest is None else checked_dest(dest),
                            priority=int(priority))[0]

    def need(self, names: Iterable[str], order: int | None) -> None:
        """Tell the eviction policy that entries ``names`` are read again at step ``order`` of this pass (lower:
        sooner), or, with None, not again this pass (they go first when room is needed)."""
        self._check_process()
        with contextlib.suppress(OSError):  # a hint: lost with a downloader that went away
            self._send({"op": "need", "names": list(names), "order": order})

    def stats(self) -> dict[str, Any]:
        """The downloader's counters: GETs, bytes fetched, hits, waits, evictions, its CPU seconds, its pid."""
        return _wait(self._submit("stats", 1)[0])

    def path(self, entry: str) -> Path:
        """The file of cache entry ``entry`` (a ``fetch`` answer's name)."""
        return entry_path(self.root, entry)

    # -- answers --

    def _answers(self, data: bytes | None) -> bool:
        """Handle what the reader thread received (None or nothing: the connection ended); False: stop reading."""
        try:
            messages = self._frames.feed(data) if data else None
        except (ValueError, PackerError):
            messages = None
        if messages is None:
            return not self._closing and self._recover()
        for message in messages:
            self._dispatch(message)
        return True

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if "error" in msg and "i" not in msg:  # the whole request failed (a fetch's store could not open)
            with self._lock:
                req = self._pending.pop(msg["id"], None)
            for fut in req.futures if req is not None else ():
                _settle(fut, exc=ERRORS.get(msg["error"], StorageError)(msg["message"]))
            return
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
            _settle(fut, exc=ERRORS.get(msg["error"], StorageError)(msg["message"]))
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
                self._line.sock.close()
                self._line.sock = self._connect()
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
        self._finalizer.detach()
        with contextlib.suppress(OSError):
            self._line.sock.shutdown(socket.SHUT_RDWR)
        self._reader.join()
        self._line.sock.close()
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for req in pending:
            for fut in req.futures:
                fut.cancel()

    def forget(self) -> None:
        """In a forked child: drop the parent's connection without hanging it up (the parent still uses it)."""
        with contextlib.suppress(OSError):
            self._line.sock.close()

    def __enter__(self) -> DownloaderClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DownloaderClient({str(self.cache_dir)!r}, pid {self.server_pid})"


def _read_answers(client_ref: weakref.ReferenceType[DownloaderClient], line: _Line) -> None:
    """The reader thread: waits for answers holding only the socket, then the client while it handles them."""
    while True:
        try:
            data: bytes | None = line.sock.recv(1 << 16)
        except OSError:
            data = None
        client = client_ref()
        if client is None or not client._answers(data):
            return
        del client


def _hang_up(line: _Line, pid: int) -> None:
    """A client collected unclosed: end its connection (in the process that made it; a forked child's copy of the
    socket is only closed, by ``forget``), so its reader ends and the downloader may exit."""
    if os.getpid() != pid:
        return
    with contextlib.suppress(OSError):
        line.sock.shutdown(socket.SHUT_RDWR)
    line.sock.close()


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
