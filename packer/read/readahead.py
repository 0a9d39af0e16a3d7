"""Read-ahead of a batch's bytes by a background thread, so IO overlaps decoding and requests stay large.

A batch is read in file order by one thread per process (each DataLoader worker has its own):
each span of neighbouring samples is read with sequential ``pread`` calls of ``PIECE`` bytes
into a scratch buffer, which puts it into the page cache; the caller waits for each sample's
bytes only (``Pending.wait``) and decodes it while the thread reads the next ones.

Why a thread and plain reads rather than ``posix_fadvise(WILLNEED)`` and page faults: measured
under the emulated hard disk (``packer bench --emulate hdd``, 150 IOPS), fadvise-then-fault
splits a batch into requests of ~600 KB on average, varying run to run, while sequential
preads let the kernel's own read-ahead build requests of 1 MB and more (device reads per
196 MB: ~190 instead of 250-310). The thread reads the spans asked for (the kernel may read a
little beyond, as for any sequential read) and, in the background whenever no batch waits, the
``later`` ranges a caller adds (the rest of a block, in block order), through files opened
for them alone: the kernel keeps read-ahead state per open file, and interleaving the two
streams on one file made it take both for random reads (mosaic, block order: 810 KB per
device read on one file, 880 KB on two). Neighbouring ranges are read as one span even when
they come in descending file order (rows of a bottom-up BMP mosaic), which brought mosaic to
1.1-1.2 MB per device read. A read error here is ignored, since the caller's own read reports
it with the file and the sample.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

PIECE = 256 << 10  # one pread: the kernel's sequential read-ahead turns a run of these into >= 1 MB requests
GAP = 256 << 10  # spans closer than this are read as one (reading the gap beats another request)
_MAX_OPEN = 32
LOOKBACK = 4  # spans a new range may join (see plan)

Range = tuple[str, int, int]  # (path, start, end) of bytes a sample needs


@dataclass
class Pending:
    """The read-ahead of one batch: ``wait(k)`` returns once item ``k``'s bytes have been read."""

    spans: list[Range]
    need: list[tuple[int, int]]  # item -> (span index, end offset) to wait for; (-1, 0) = nothing
    later: list[Range] = field(default_factory=list)  # read in the background once no batch waits
    _done: int = 0  # spans finished
    _offset: int = 0  # bytes of span _done read up to here
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _over: bool = False

    def wait(self, k: int, timeout: float = 60.0) -> None:
        span, end = self.need[k]
        with self._cond:
            self._cond.wait_for(lambda: self._over or self._done > span or (self._done == span and self._offset >= end),
                                timeout)

    def arrival_order(self) -> list[int]:
        """Items in the order their bytes come in (file order, except where a span grew downwards,
        e.g. a bottom-up BMP's rows): consume them in this order to overlap work with the reads."""
        return sorted(range(len(self.need)), key=self.need.__getitem__)

    def done(self) -> bool:
        with self._cond:
            return self._over

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
    which order the items' bytes then come in.
    """
    spans: list[list] = []
    need: list[tuple[int, int]] = []
    for ranges in requests:
        last = (-1, 0)
        for path, start, end in sorted(ranges, key=lambda r: (r[0], r[1])):
            if end <= start:
                continue
            for j in range(len(spans) - 1, max(-1, len(spans) - 1 - LOOKBACK), -1):
                s = spans[j]
                if s[0] == path and start <= s[2] + gap and end >= s[1] - gap:  # overlaps or near, either side
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
        self.fds: dict[str, int] = {}  # batch reads
        self.bg_fds: dict[str, int] = {}  # background reads on their own open files: own kernel read-ahead state
        self.jobs: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="packer-readahead", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        buf = bytearray(PIECE)
        view = memoryview(buf)
        fds, bg_fds = self.fds, self.bg_fds
        later: deque[list] = deque()  # background spans [path, offset, end]: read when no batch waits
        while True:
            try:
                job = self.jobs.get(block=not later)
            except queue.Empty:
                job = None
            if job is not None:
                try:
                    for k, (path, start, end) in enumerate(job.spans):
                        offset = start
                        while offset < end:
                            got = _piece(fds, path, offset, end, view)
                            if got <= 0:
                                break  # past the end or unreadable: the caller's own read will say so
                            offset += got
                            job._advance(k, offset)
                        job._advance(k + 1, 0)
                finally:
                    job._finish()
                later.extend([p, a, b] for p, a, b in job.later)
            elif later:  # one piece, then look for a waiting batch again
                span = later[0]
                got = _piece(bg_fds, span[0], span[1], span[2], view)
                span[1] += max(got, 0)
                if got <= 0 or span[1] >= span[2]:
                    later.popleft()
            if not later and self.jobs.empty():  # idle: hold no files open (deleted outputs free their space)
                for table in (fds, bg_fds):
                    for fd in table.values():
                        os.close(fd)
                    table.clear()


def _piece(fds: dict[str, int], path: str, offset: int, end: int, view: memoryview) -> int:
    """Read the next ``PIECE`` bytes of [offset, end) of ``path``: bytes read, 0 or -1.

    Pieces start at the span's start, unaligned: a read that does not follow the previous one on
    its file is read exactly as asked, so a short first piece would cost a device request of
    its own (and a small sample split in two would start the kernel's read-ahead for nothing).
    """
    fd = _fd(fds, path)
    if fd is None:
        return -1
    n = min(end - offset, PIECE)
    try:
        return os.preadv(fd, [view[:n]], offset)
    except OSError:
        return -1


def _fd(fds: dict[str, int], path: str) -> int | None:
    fd = fds.get(path)
    if fd is None:
        if len(fds) >= _MAX_OPEN:
            os.close(fds.pop(next(iter(fds))))
        try:
            fd = fds[path] = os.open(path, os.O_RDONLY)
        except OSError:
            return None
    return fd


_READER: _Reader | None = None
_LOCK = threading.Lock()


def _reader() -> _Reader:
    global _READER
    with _LOCK:
        if _READER is None or _READER.pid != os.getpid():
            _READER = _Reader()  # first use in this process (a forked worker inherits no thread)
        return _READER


def _after_fork() -> None:
    global _READER, _LOCK
    if _READER is not None:  # its thread did not come along: close the copies of the files it held open
        for table in (_READER.fds, _READER.bg_fds):
            for fd in list(table.values()):
                try:
                    os.close(fd)
                except OSError:
                    pass
    _READER, _LOCK = None, threading.Lock()  # the parent's may have been held at fork time


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def start(requests: Sequence[Sequence[Range]], later: Sequence[Range] = (), gap: int = GAP) -> Pending:
    """Queue the read-ahead of ``requests`` (per item, its byte ranges) and return at once.

    ``later``: ranges nobody waits for yet (e.g. the rest of a block), read in the background,
    piece by piece, whenever no batch's own bytes are waiting to be read.
    """
    job = plan(requests, gap)
    job.later = [r for r in later if r[2] > r[1]]
    if job.spans or job.later:
        _reader().jobs.put(job)
    else:
        job._finish()
    return job
