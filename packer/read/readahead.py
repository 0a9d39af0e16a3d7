"""Read-ahead of a batch's bytes by a background thread, so IO overlaps decoding and requests stay large.

One thread per process (each DataLoader worker has its own) reads each batch's spans in file order, in the order
batches were queued; the caller waits for each sample's bytes only (``Pending.wait``). A span inside a block the
order reads whole (a block sampler's hint, ``within``) is widened to the device's request grid (``request_bytes``)
and asked exactly (``POSIX_FADV_RANDOM``, one request per piece); any other span is read in ``PIECE`` pieces that
let the kernel's read-ahead see a stream. Nothing is read that no batch asked for. Neighbouring ranges are read as
one span even in descending file order (a bottom-up BMP mosaic's rows). A read error here is ignored: the caller's
own read reports it with the file and the sample. Why each choice, with figures: docs/results.md ("Reads in the
order decoding needs them").
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

PAGE = mmap.PAGESIZE
_ADVISE = hasattr(os, "posix_fadvise")  # exact pieces asked with POSIX_FADV_WILLNEED (see _piece)
PIECE = 256 << 10  # one pread of a stream: the kernel's read-ahead turns a run of these into >= 1 MB requests
DEFAULT_REQUEST = 254 * 4096  # device request size where /sys does not say (see request_bytes)
MAX_REQUEST = 4 << 20
GAP = 256 << 10  # spans closer than this are read as one (reading the gap beats another request)
_MAX_OPEN = 32
LOOKBACK = 4  # spans a new range may join (see plan)

Range = tuple[str, int, int]  # (path, start, end) of bytes a sample needs


@dataclass
class Pending:
    """The read-ahead of one batch: ``wait(k)`` returns once item ``k``'s bytes have been read."""

    spans: list[Range]
    need: list[tuple[int, int]]  # item -> (span index, end offset) to wait for; (-1, 0) = nothing
    reads: list[tuple[int, int, bool]] = field(default_factory=list)  # per span: bytes read, exactly (widened)?
    _done: int = 0  # spans finished
    _offset: int = 0  # bytes of span _done read up to here
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _over: bool = False
    cancelled: bool = False  # nobody will wait for these bytes any more: the reader stops at its next piece

    def wait(self, k: int, timeout: float = 60.0) -> None:
        if self._over:  # finished (never unset): no lock taken, so a finished job is shared safely across forks
            return
        span, end = self.need[k]
        with self._cond:
            self._cond.wait_for(lambda: self._over or self._done > span or (self._done == span and self._offset >= end),
                                timeout)

    def wait_all(self, items: Sequence[int]) -> None:
        """Return once all these items' bytes have been read (waits for the one that comes in last)."""
        if items:
            self.wait(max(items, key=self.need.__getitem__))

    def arrival_order(self) -> list[int]:
        """Items in the order their bytes come in (file order, except where a span grew downwards,
        e.g. a bottom-up BMP's rows): consume them in this order to overlap work with the reads."""
        return sorted(range(len(self.need)), key=self.need.__getitem__)

    def done(self) -> bool:
        with self._cond:
            return self._over

    @classmethod
    def ready(cls, n: int) -> Pending:
        """A finished read-ahead of ``n`` items with nothing to read (bytes in the cache, or waited for already)."""
        job = cls([], [(-1, 0)] * n)
        job._finish()
        return job

    def cancel(self) -> None:
        """Stop reading what is still queued (a loader that stopped early): later jobs need not wait behind it."""
        self.cancelled = True

    def _advance(self, span: int, offset: int) -> None:
        with self._cond:
            self._done, self._offset = span, offset
            self._cond.notify_all()

    def _finish(self) -> None:
        with self._cond:
            self._done, self._over = len(self.spans), True
            self._cond.notify_all()


def plan(requests: Sequence[Sequence[Range]], gap: int = GAP) -> Pending:
    """Spans to read, in the order given, neighbours on the same file merged; what each item waits for.

    Items should come in file order (the caller reads them in that order too). A range joins one
    of the last ``LOOKBACK`` spans when it overlaps it or lies within ``gap`` of it, before or after
    (an LMDB value after the previous value, its leaf page on a span read before; a bottom-up BMP
    row band below the previous one), else opens a new span; ``Pending.arrival_order`` says in
    which order the items' bytes then come in. An item with nothing to read (its bytes cached) may
    lie in such a gap: a later range joins the spans before it only where it overlaps or touches them,
    so its bytes are not read (copied) again.
    """
    spans: list[list] = []
    need: list[tuple[int, int]] = []
    floor = 0  # spans from here on may take a range across a gap; those before an item with nothing to read may not
    for ranges in requests:
        last = (-1, 0)
        if not any(end > start for _path, start, end in ranges):
            floor = len(spans)
        for path, start, end in sorted(ranges, key=lambda r: (r[0], r[1])):
            if end <= start:
                continue
            for j in range(len(spans) - 1, max(-1, len(spans) - 1 - LOOKBACK), -1):
                s, g = spans[j], gap if j >= floor else 0
                if s[0] == path and start <= s[2] + g and end >= s[1] - g:  # overlaps or near, either side
                    s[1], s[2] = min(s[1], start), max(s[2], end)
                    break
            else:
                j = len(spans)
                spans.append([path, start, end])
            last = max(last, (j, end))
        need.append(last)
    return Pending([(p, a, b) for p, a, b in spans], need)


class _Reader:
    """The per-process thread and its queue."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.fds: dict[str, int] = {}  # batch reads, the kernel reading ahead
        self.exact_fds: dict[str, int] = {}  # batch reads inside a block: exactly as asked (POSIX_FADV_RANDOM)
        self.jobs: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="packer-readahead", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        view = memoryview(bytearray(MAX_REQUEST))
        fds, exact_fds = self.fds, self.exact_fds
        while True:
            job = self.jobs.get()
            try:
                _read_job(job, fds, exact_fds, view)
            except Exception:  # noqa: BLE001 - the caller's own read reports any problem; this thread must live on
                pass
            finally:
                job._finish()
            if self.jobs.empty():  # idle: hold no files open (deleted outputs free their space)
                for table in (fds, exact_fds):
                    for fd in table.values():
                        os.close(fd)
                    table.clear()


def _read_job(job: Pending, fds: dict[str, int], exact_fds: dict[str, int], view: memoryview) -> None:
    """Read a job's spans in order, telling waiters how far each has come; stop early once it is cancelled."""
    for k, (path, start, end) in enumerate(job.spans):
        offset, stop, exact = job.reads[k] if job.reads else (start, end, False)
        piece = view[:request_bytes(path)] if exact else view[:PIECE]
        while offset < stop and not job.cancelled:
            got = _piece(exact_fds if exact else fds, path, offset, stop, piece, exact)
            if got <= 0:
                break  # past the end or unreadable: the caller's own read will say so
            offset += got
            job._advance(k, offset)
        job._advance(k + 1, 0)


def _piece(fds: dict[str, int], path: str, offset: int, end: int, view: memoryview, exact: bool) -> int:
    """Read the next ``len(view)`` bytes of [offset, end) of ``path`` into the page cache: bytes read, 0 or -1.
    ``exact``: through files opened with ``POSIX_FADV_RANDOM`` (each piece one device request, nothing read
    beyond it), asked with ``POSIX_FADV_WILLNEED`` (the request a ``pread`` would make, its bytes copied
    nowhere: half the thread's CPU, docs/results.md) and waited for by reading its last byte (a hint, not a
    promise: a byte still in flight is waited for by whoever maps or reads it).

    Pieces start at the span's start, unaligned: a read that does not follow the previous one on
    its file is read exactly as asked, so a short first piece would cost a device request of
    its own (and a small sample split in two would start the kernel's read-ahead for nothing).
    """
    fd = _fd(fds, path, exact)
    if fd is None:
        return -1
    n = min(end - offset, len(view))
    try:
        if exact and _ADVISE:
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_WILLNEED)
            return n if os.preadv(fd, [view[:1]], offset + n - 1) == 1 else -1
        return os.preadv(fd, [view[:n]], offset)
    except OSError:
        return -1


_REQUEST: dict[int, int] = {}  # st_dev -> request bytes


def _size(path: str) -> int:
    """The file's size now (0 where it can't be asked: the span is then read as asked)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def request_bytes(path: str) -> int:
    """The largest read the device holding ``path`` takes as one request from page-cache pages.

    Pages read into the cache this way are single pages, so a request holds at most ``max_segments`` of
    them (and at most ``max_sectors_kb``); a read across that grid becomes two requests, which an
    IO-limited device charges both (docs/results.md). Without /sys (network filesystems, other systems):
    ``DEFAULT_REQUEST``.
    """
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return DEFAULT_REQUEST
    got = _REQUEST.get(dev)
    if got is None:
        got = _REQUEST[dev] = _device_request(dev)
    return got


def _device_request(dev: int) -> int:
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for q in (f"{base}/queue", f"{base}/../queue"):  # a partition's queue is its disk's
        try:
            with open(f"{q}/max_segments") as fh:
                segments = int(fh.read())
            with open(f"{q}/max_sectors_kb") as fh:
                sectors = int(fh.read()) << 10
        except (OSError, ValueError):
            continue
        return max(page, min(segments * page, sectors, 256 * page, MAX_REQUEST))  # 256 pages: one bio's most
    return DEFAULT_REQUEST


def _fd(fds: dict[str, int], path: str, exact: bool) -> int | None:
    fd = fds.get(path)
    if fd is None:
        if len(fds) >= _MAX_OPEN:
            os.close(fds.pop(next(iter(fds))))
        try:
            fd = fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        if exact and hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            except OSError:
                pass  # read with the kernel's read-ahead, as any other span
    return fd


_READER: _Reader | None = None
_LOCK = threading.Lock()


def _reader() -> _Reader:
    global _READER
    with _LOCK:
        if _READER is None or _READER.pid != os.getpid() or not _READER.thread.is_alive():
            _READER = _Reader()  # first use in this process (a forked worker inherits no thread), or after a crash
        return _READER


def _after_fork() -> None:
    global _READER, _LOCK
    if _READER is not None:  # its thread did not come along: close the copies of the files it held open
        for table in (_READER.fds, _READER.exact_fds):
            for fd in list(table.values()):
                try:
                    os.close(fd)
                except OSError:
                    pass
    _READER, _LOCK = None, threading.Lock()  # the parent's may have been held at fork time


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def start(requests: Sequence[Sequence[Range]], gap: int = GAP, within: Sequence[Range] = (),
          whole_cells: bool = False) -> Pending:
    """Queue the read-ahead of ``requests`` (per item, its byte ranges) and return at once. ``within``: ranges the
    order being iterated reads whole (its blocks): a span inside one is widened to whole device requests
    (``request_bytes``) and read exactly, rather than with a short request at each end; clipped to the block,
    or, with ``whole_cells`` (the data stays in the page cache until the neighbouring blocks are read: it fits in
    memory), the whole request at a block's edge, so that two neighbouring blocks share one request, not two."""
    if not any(requests):  # all in the page cache already (or nothing asked): nothing to plan or read
        return Pending.ready(len(requests))
    job = plan(requests, gap)
    blocks: dict[str, list[tuple[int, int]]] = {}
    for path, a, b in within:
        blocks.setdefault(path, []).append((a, b))
    job.reads = [_widened(span, blocks.get(span[0], ()), whole_cells) for span in job.spans]
    if job.spans:
        _reader().jobs.put(job)
    else:
        job._finish()
    return job


def _widened(span: Range, within: Sequence[tuple[int, int]], whole_cells: bool = False) -> tuple[int, int, bool]:
    """The bytes to read for ``span``: inside a block the order reads whole (``within``: the blocks' byte ranges
    in the span's file), widened to the device's request grid (clipped to the block from the page its first byte
    lies in, unless ``whole_cells``) and read exactly; elsewhere the span, the kernel reading ahead as it sees fit."""
    path, start, end = span
    for a, b in within:
        if a <= start and end <= b:
            grid = request_bytes(path)
            lo, hi = start - start % grid, -(-end // grid) * grid
            if not whole_cells:
                return max(a - a % PAGE, lo), min(b, hi), True
            return lo, min(hi, max(_size(path), end)), True  # not past the file's end: its last byte is waited for
    return start, end, False
