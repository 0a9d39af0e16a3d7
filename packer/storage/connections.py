"""The downloader's socket loop: one thread accepts this user's clients on a Unix socket, reads their messages
(packer/storage/protocol.py) and hands each to the downloader; answers, sent from any thread, queue in the
connection's outbox and go out as the client reads them, so a client that stops reading stalls nobody else."""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packer.errors import PackerError
from packer.storage.protocol import Frames, error_answer, frame, short_path

MAX_OUTBOX = 64 << 20  # answers a client may leave unread before it is hung up on


@dataclass(eq=False)
class Conn:
    """A client's connection and what the protocol keeps per connection: the stores it named (``sid`` -> the
    downloader's store, or the exception that kept it from opening), the requests it waits for, its limit."""

    sock: socket.socket
    wake: Callable[[Conn], None]  # asks the loop thread to send the rest of the outbox
    frames: Frames = field(default_factory=Frames)
    stores: dict[int, Any] = field(default_factory=dict)
    asked: dict[tuple[int, int], str] = field(default_factory=dict)  # (id, i) -> the download it waits for
    limit: int | None = None
    pid: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    outbox: bytearray = field(default_factory=bytearray)
    dead: bool = False

    def send(self, message: dict[str, Any]) -> None:
        """Queue one answer (from any thread) and send what the socket takes now."""
        if self.dead:
            return
        with self.lock:
            self.outbox += frame(message)
            more = self.flush_locked()
        if more:
            self.wake(self)

    def flush_locked(self) -> bool:
        """Send what the socket takes (call holding ``lock``); whether some is left. A client that went away, or
        let more than ``MAX_OUTBOX`` bytes of answers pile up, is hung up on (the loop then forgets it)."""
        while self.outbox and not self.dead:
            try:
                n = self.sock.send(self.outbox)
            except BlockingIOError:
                break
            except OSError:
                n = -1
            if n <= 0 or len(self.outbox) > MAX_OUTBOX:
                self.dead = True
                self.outbox.clear()
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
                break
            del self.outbox[:n]
        return bool(self.outbox)


class Listener:
    """The socket at ``socket_path`` (bound at once, replacing a dead downloader's) and its clients."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with short_path(socket_path) as address:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(socket_path)
            self.sock.bind(address)
        self.sock.listen(128)
        self._inode = os.stat(socket_path).st_ino
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._writers: set[Conn] = set()
        self._lock = threading.Lock()
        self.conns: dict[socket.socket, Conn] = {}

    def run(self, handle: Callable[[Conn, dict[str, Any]], None], dropped: Callable[[Conn], None],
            linger: float) -> None:
        """Serve until no client has been connected for ``linger`` seconds: ``handle(conn, message)`` for each
        message (an exception is answered as the request's error), ``dropped(conn)`` for each client gone."""
        self.selector.register(self.sock, selectors.EVENT_READ, None)
        self.selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        idle_since = time.monotonic()
        while True:
            for key, events in self.selector.select(timeout=min(0.5, max(0.01, linger))):
                if key.data is None:
                    self._accept()
                elif key.data == "wake":
                    self._woken()
                else:
                    if events & selectors.EVENT_WRITE:
                        self._writable(key.data)
                    if events & selectors.EVENT_READ:
                        self._readable(key.data, handle, dropped)
            if self.conns:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= linger:
                return

    def _accept(self) -> None:
        try:
            sock, _ = self.sock.accept()
        except OSError:
            return
        uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid():  # only this user's processes may use its credentials and cache
            sock.close()
            return
        sock.setblocking(False)
        conn = Conn(sock, self._want_write)
        self.conns[sock] = conn
        self.selector.register(sock, selectors.EVENT_READ, conn)

    def _want_write(self, conn: Conn) -> None:
        """From any thread: let the loop send the rest of ``conn``'s answers when the socket takes them."""
        with self._lock:
            self._writers.add(conn)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _woken(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_r.recv(4096)
        with self._lock:
            writers, self._writers = self._writers, set()
        for conn in writers:
            if conn.sock in self.conns:
                self.selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)

    def _writable(self, conn: Conn) -> None:
        with conn.lock:
            more = conn.flush_locked()
        if not more and conn.sock in self.conns:
            self.selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _readable(self, conn: Conn, handle: Callable[[Conn, dict[str, Any]], None],
                  dropped: Callable[[Conn], None]) -> None:
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
            self.drop(conn, dropped)
            return
        for message in messages:
            try:
                handle(conn, message)
            except Exception as exc:  # a malformed request: answered, the downloader goes on
                if "id" in message:
                    conn.send(error_answer(message["id"], exc))

    def drop(self, conn: Conn, dropped: Callable[[Conn], None]) -> None:
        """Forget a client (gone, or hung up on): ``dropped(conn)``, then its socket is closed."""
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn.sock)
        self.conns.pop(conn.sock, None)
        conn.dead = True
        dropped(conn)
        conn.sock.close()

    def close(self, dropped: Callable[[Conn], None]) -> None:
        """Remove the socket (if it is still this downloader's: a new one may have replaced it), drop every
        client."""
        with contextlib.suppress(OSError):
            if os.stat(self.socket_path).st_ino == self._inode:
                os.unlink(self.socket_path)
        self.sock.close()
        for conn in list(self.conns.values()):
            self.drop(conn, dropped)
        self._wake_r.close()
        self._wake_w.close()
        self.selector.close()
