"""One object fetched whole by the node's downloader: in parts of ``PART`` bytes, many in flight through the store's
``Fetcher``, each written at its offset into a temporary file, the whole hashed, checked against its sha256 and
renamed into place complete (a shard for a format's own reader, a dataset's metadata), or only hashed and
deleted (``packer verify``). The room it takes is counted against the cache's limit while it is fetched."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from packer.storage.cache import ChecksumMismatch, RangeCache
from packer.storage.fetch import Fetcher, Range
from packer.storage.node import temp_suffix
from packer.storage.protocol import error_answer

PART = 8 << 20  # a whole object is fetched in parts of this size, many in flight


class WholeObject:
    """Object ``key`` at version ``etag`` (``size`` bytes, ``sha256`` if known) into ``cache.root / dest`` ("files/..."
    counts against the limit, "datasets/..." does not; None: hashed only). ``done(answer)`` is called once: the
    protocol's result (entry, size, sha256), an error answer, or None when cancelled. ``where``: the object's URL
    for messages (redacted)."""

    def __init__(self, fetcher: Fetcher, cache: RangeCache, work: concurrent.futures.Executor, key: str,
                 etag: str | None, size: int, sha256: str | None, dest: str | None, where: str,
                 done: Callable[[dict[str, Any] | None], None]) -> None:
        self.fetcher, self.cache, self.work, self.done = fetcher, cache, work, done
        self.key, self.etag, self.size, self.sha256, self.dest, self.where = key, etag, size, sha256, dest, where
        self.path = cache.root / (dest or f"tmp/{os.getpid()}-{os.urandom(6).hex()}")
        self.tmp = self.path.with_name(f"{self.path.name}{temp_suffix()}")
        self.counted = dest is None or dest.startswith("files/")  # metadata (datasets/...) is not an entry
        self.futures: list[concurrent.futures.Future] = []
        self.left = 0
        self.fd = -1
        self.lock = threading.Lock()
        self.over = False

    def start(self, priority: int) -> None:
        """Make room, open the temporary file, ask for every part (at ``priority``)."""
        try:
            if self.counted:
                self.cache.make_room(self.size)
        except BaseException as exc:
            self.done(error_answer(0, exc))
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
            self.work.submit(self.finish)
            return
        self.futures = self.fetcher.fetch(parts, priority)
        for fut, part in zip(self.futures, parts):
            fut.add_done_callback(lambda f, p=part: self.work.submit(self.landed, f, p))

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
            digest = sha256_file(self.tmp)
            if self.sha256 is not None and digest != self.sha256:
                raise ChecksumMismatch(f"{self.where}: sha256 {digest[:16]}... of the {self.size} bytes read is not "
                                       f"the recorded {self.sha256[:16]}...: the object is damaged or another version")
            if self.dest is None:
                os.unlink(self.tmp)
                self.cache.release_room(self.size)  # hashed only: the room goes back
            else:
                os.replace(self.tmp, self.path)
        except BaseException as exc:
            self.fail(exc)
            return
        with self.lock:
            self.over = True
        self.done({"result": {"entry": self.dest, "size": self.size, "sha256": digest}})

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
            self.cache.release_room(self.size)
        self.done(None if exc is None else error_answer(0, exc))

    def cancel(self) -> None:
        self.fail(None)


def sha256_file(path: Path) -> str:
    digest, buf = hashlib.sha256(), bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()
