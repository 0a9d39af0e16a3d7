"""Many ranged GETs in flight, ahead of use: ``Fetcher.fetch(ranges)`` returns one future per range at once.

Adjacent ranges of one object version (gaps up to ``coalesce_gap`` bytes, fetched and dropped) are joined into GETs
of up to ``max_request`` bytes, at most ``max_in_flight`` of them at a time, the next one started when one lands
(no thread of the fetcher's own: the client's loop runs the requests). Queued GETs start in order of ``priority``
(lower first: what the reader needs next before its read-ahead), then in the order asked; a GET whose every range's
future was cancelled is dropped, or cancelled when already in flight. With a ``RangeCache`` each range is read
from the cache when there, else locked node-wide, fetched once, checked against its checksum, cached and handed
out; ranges another process is downloading are waited for on one small thread. ``close()`` (and Ctrl-C in a wait,
through ``store.wait``) cancels what is queued and in flight and joins that thread: nothing is left running.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field

from packer.storage.cache import Checksum, RangeCache, check
from packer.storage.store import ObjectStore


@dataclass(frozen=True)
class Range:
    """``[start, end)`` of object ``key`` (relative to the store's root) at version ``etag``, with the checksum its
    bytes must have (None: unchecked)."""

    key: str
    start: int
    end: int
    etag: str | None = None
    checksum: Checksum | None = None


@dataclass
class _Group:
    """One GET: the members' hull."""

    key: str
    etag: str | None
    start: int
    end: int
    members: list[tuple[Range, Future, str | None]] = field(default_factory=list)  # range, its future, cache name
    priority: int = 0
    request: Future | None = None  # the GET, once started

    def abandoned(self) -> bool:
        """Every range of this GET was cancelled by whoever asked for it."""
        return all(fut.cancelled() for _, fut, _ in self.members)


@dataclass
class FetchStats:
    ranges: int = 0
    requests: int = 0
    requested_bytes: int = 0  # bytes asked of the server (gaps included)
    hits: int = 0
    waits: int = 0


class Fetcher:
    """Ranged reads of ``store`` with ``max_in_flight`` GETs at once; optionally through a node-wide ``cache``."""

    def __init__(self, store: ObjectStore, cache: RangeCache | None = None, *, max_in_flight: int = 32,
                 max_request: int = 16 << 20, coalesce_gap: int = 0) -> None:
        if max_in_flight < 1 or max_request < 1 or coalesce_gap < 0:
            raise ValueError("max_in_flight >= 1, max_request >= 1 and coalesce_gap >= 0 expected")
        self.store, self.cache = store, cache
        self.max_in_flight, self.max_request, self.coalesce_gap = max_in_flight, max_request, coalesce_gap
        self.stats = FetchStats()
        self._lock = threading.Lock()
        self._queue: list[tuple[int, int, _Group]] = []  # a heap: (priority, order asked, GET)
        self._order = itertools.count()
        self._in_flight: dict[Future, _Group] = {}
        self._waiting: list[tuple[Range, Future, str]] = []
        self._waiter: threading.Thread | None = None
        self._closed = False

    def url(self, key: str) -> str:
        return self.store.location(key).url

    def fetch(self, ranges: list[Range], priority: int = 0) -> list[Future]:
        """Start reading ``ranges``; their futures, in the order given (each gives the range's bytes). GETs of a
        lower ``priority`` start first. Cancelling every future of a GET drops it (or cancels it in flight)."""
        futures: list[Future] = [Future() for _ in ranges]
        todo: list[tuple[Range, Future, str | None]] = []
        for rng, fut in zip(ranges, futures):
            self.stats.ranges += 1
            name = None
            if self.cache is not None:
                name = self.cache.name(self.url(rng.key), rng.etag, rng.start, rng.end)
                hit = self.cache.read(name, rng.checksum, self._what(rng))
                if hit is not None:
                    self.stats.hits += 1
                    fut.set_result(hit)
                    continue
                if not self.cache.acquire(name, block=False):
                    self._wait_for(rng, fut, name)
                    continue
            todo.append((rng, fut, name))
        groups = self._groups(todo, priority)
        with self._lock:
            if self._closed:
                self._abandon(todo)
                return futures
            for group in groups:
                heapq.heappush(self._queue, (priority, next(self._order), group))
        for group in groups:
            for _, member, _ in group.members:
                member.add_done_callback(lambda f, g=group: self._dropped(g) if f.cancelled() else None)
        self._pump()
        return futures

    def _dropped(self, group: _Group) -> None:
        """A range's future was cancelled: once all of its GET's are, cancel the GET if it is in flight (a queued
        one is skipped when its turn comes)."""
        with self._lock:
            request = group.request if group.abandoned() else None
        if request is not None:
            request.cancel()

    def _what(self, rng: Range) -> str:
        return f"{self.store.location(rng.key)} bytes {rng.start}-{rng.end}"

    def _groups(self, todo: list[tuple[Range, Future, str | None]], priority: int) -> list[_Group]:
        out: list[_Group] = []
        for item in sorted(todo, key=lambda t: (t[0].key, t[0].etag or "", t[0].start)):
            rng = item[0]
            last = out[-1] if out else None
            if (last is not None and (last.key, last.etag) == (rng.key, rng.etag)
                    and rng.start <= last.end + self.coalesce_gap and max(last.end, rng.end) - last.start
                    <= self.max_request):
                last.end = max(last.end, rng.end)
                last.members.append(item)
            else:
                out.append(_Group(rng.key, rng.etag, rng.start, rng.end, [item], priority))
        return out

    def _pump(self) -> None:
        """Start queued GETs while fewer than ``max_in_flight`` are out."""
        while True:
            with self._lock:
                if self._closed or not self._queue or len(self._in_flight) >= self.max_in_flight:
                    return
                group = heapq.heappop(self._queue)[2]
                failed: BaseException | None = None
                if group.abandoned():
                    dropped = True
                else:
                    dropped = False
                    self.stats.requests += 1
                    self.stats.requested_bytes += group.end - group.start
                    try:
                        fut = group.request = self.store.submit_get(group.key, group.start, group.end, group.etag)
                    except Exception as exc:  # the store could not be opened (no obstore, a refused URL)
                        failed = exc
                    else:
                        self._in_flight[fut] = group
            if dropped:
                self._abandon(group.members)
                continue
            if failed is not None:
                for _, member, name in group.members:
                    self._finish(member, name, exc=failed)
                continue
            fut.add_done_callback(self._landed)

    def _landed(self, fut: Future) -> None:
        with self._lock:
            group = self._in_flight.pop(fut)
        try:
            data = fut.result()[0]
        except CancelledError:
            self._abandon(group.members)
        except BaseException as exc:
            for _, member, name in group.members:
                self._finish(member, name, exc=exc)
        else:
            view = memoryview(data)
            for rng, member, name in group.members:
                part = bytes(view[rng.start - group.start:rng.end - group.start])
                try:
                    check(part, rng.checksum, self._what(rng))
                    if self.cache is not None and name is not None:
                        self.cache.store(name, part)
                except BaseException as exc:
                    self._finish(member, name, exc=exc)
                else:
                    self._finish(member, name, part)
        self._pump()

    def _finish(self, fut: Future, name: str | None, data: bytes | None = None,
                exc: BaseException | None = None) -> None:
        if name is not None and self.cache is not None:
            self.cache.release(name)
        if fut.set_running_or_notify_cancel():
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(data)

    def _abandon(self, members) -> None:
        for _, fut, name in members:
            if name is not None and self.cache is not None:
                self.cache.release(name)
            fut.cancel()

    # ---- ranges another process is downloading ----

    def _wait_for(self, rng: Range, fut: Future, name: str) -> None:
        self.stats.waits += 1
        with self._lock:
            self._waiting.append((rng, fut, name))
            if self._waiter is None:
                self._waiter = threading.Thread(target=self._watch, name="packer-fetch-wait", daemon=True)
                self._waiter.start()

    def _watch(self) -> None:
        """Poll the locks of ranges others are fetching: read each once its lock is free (fetch it if the other
        process died before finishing)."""
        assert self.cache is not None
        while True:
            with self._lock:
                if self._closed:
                    return
                waiting, self._waiting = self._waiting, []
            still = []
            for rng, fut, name in waiting:
                if fut.cancelled():
                    continue
                if not self.cache.acquire(name, block=False):
                    still.append((rng, fut, name))
                    continue
                hit = self.cache.read(name, rng.checksum, self._what(rng))
                if hit is not None:
                    self._finish(fut, name, hit)
                else:  # the other downloader died or the entry was evicted: fetch it here
                    group = _Group(rng.key, rng.etag, rng.start, rng.end, [(rng, fut, name)])
                    with self._lock:
                        closed = self._closed
                        if not closed:
                            heapq.heappush(self._queue, (group.priority, next(self._order), group))
                    if closed:
                        self._abandon(group.members)
                    self._pump()
            with self._lock:
                self._waiting.extend(still)
            time.sleep(0.005 if still else 0.02)

    def close(self) -> None:
        """Cancel every queued and in-flight read (their futures are cancelled) and join the waiting thread."""
        with self._lock:
            self._closed = True
            queued, self._queue = [g for _, _, g in self._queue], []
            in_flight = list(self._in_flight)
            waiting, self._waiting = self._waiting, []
            waiter = self._waiter
        for group in queued:
            self._abandon(group.members)
        for fut in in_flight:
            fut.cancel()  # the request is dropped; _landed releases its members
        for _, fut, _name in waiting:
            fut.cancel()
        if waiter is not None:
            waiter.join()

    def __enter__(self) -> Fetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
