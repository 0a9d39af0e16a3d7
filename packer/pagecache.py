"""Is a file's byte range in the page cache already? (``mincore`` on a mapping that is never touched.)

Read-ahead of bytes already cached only copies them once more through another thread; asking the
kernel first costs a system call or a few per batch and shard, and less for a file of up to a GiB seen whole
in the cache (``WHOLE_FILE_PAGES``): that answer is kept for a second, checked against each question's
first range (an evicted file is noticed at once; a partly evicted one, within the second). "Whole" means
the pages that hold samples where the reader says which (``holding``): an LMDB file's B-tree pages are
never read once its values are located, so they stay out of the cache. Any failure to ask answers False
(not known to be cached), so callers read ahead as before.
"""

from __future__ import annotations

import mmap
import os
import resource
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from packer.libc import LIBC
from packer.lru import LRU
from packer.perprocess import PerProcess

PAGE = mmap.PAGESIZE
Ranges = tuple[np.ndarray, np.ndarray]  # (starts, ends) of byte ranges of a file
GAP_PAGES = 64  # ranges closer than this are asked about in one call
WHOLE_FILE_PAGES = 1 << 18  # files up to this many pages (1 GiB) are asked about whole, now and then
HULL_BYTES = 1 << 20  # a file's ranges within this hull are asked about in one call (an N5 block's samples)
WHOLE_FILE_SECONDS = 1.0  # a whole-file answer is kept this long, or 200x what asking took if longer



def all_of_each(ok: np.ndarray, owners: np.ndarray, n: int) -> np.ndarray:
    """Per sample k < n, whether every piece it owns (``owners``: each piece's sample) has ``ok`` True."""
    out = np.ones(n, dtype=bool)
    out[owners[~ok]] = False
    return out


class PageCache:
    """Asks the kernel which pages of ``path`` are cached, through a read-only mapping of it.

    The mapping is made on first use and never read from, so it faults nothing in and keeps nothing
    mapped; ``close`` drops it. Not for sharing across fork: make one per process (``PerProcess``).
    """

    def __init__(self, path: str | os.PathLike, holding: Ranges | Callable[[], Ranges | None] | None = None) -> None:
        self.path = os.fspath(path)
        # (starts, ends) of the byte ranges that hold samples, or what makes them (called once, only for a file asked
        # about whole, up to WHOLE_FILE_PAGES: HDF5 looks up every chunk for them); None: the whole file
        self._holding = holding
        self._mask: np.ndarray | None = None  # per page of the file: does it hold sample bytes (from _holding)
        self._map: mmap.mmap | None = None
        self._base = 0  # the mapping's address
        self._size = 0
        self._vec = np.zeros(0, dtype=np.uint8)  # mincore's answer, reused
        self._vec_at = 0  # its address (asking numpy for it costs more than a small mincore call)
        self._lock = threading.Lock()  # one answer vector: two loaders' feeder threads may ask at once
        self._failed = LIBC is None
        self._whole = False  # the whole file was resident when last asked
        self._whole_until = -1.0  # time.monotonic() until which that answer stands

    def _open(self) -> bool:
        try:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size == 0:
                    return False
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            self._failed = True
            return False
        self._size = size
        self._base = np.frombuffer(self._map, dtype=np.uint8).ctypes.data  # the address; no page touched
        return True

    def pages(self) -> tuple[int, int] | None:
        """(pages of the file in the page cache, pages in all), from one ``mincore`` call over the whole file; None
        where the kernel can't be asked."""
        with self._lock:
            if LIBC is None or self._failed:
                return None
            if self._map is None and not self._open():
                return None if self._failed else (0, 0)  # an empty file has no pages
            pages = -(-self._size // PAGE)
            if LIBC.mincore(self._base, pages * PAGE, self._answer(pages)) != 0:
                return None
            return int((self._vec[:pages] & 1).sum()), pages

    def resident(self, starts: np.ndarray, ends: np.ndarray) -> bool:
        """True when every byte of every range [starts[k], ends[k]) of the file is in the page cache."""
        with self._lock:
            each = self._resident_each(starts, ends)
        return each is not None and bool(each.all())

    def resident_each(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Per range [starts[k], ends[k]) of the file, whether all its bytes are in the page cache (an empty range:
        yes; where the kernel can't be asked, or any range lies past the end of the file: no, for every range)."""
        with self._lock:
            each = self._resident_each(starts, ends)
        return np.zeros(len(starts), dtype=bool) if each is None else each

    def _resident_each(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
        """Per range, all its pages cached; None: not known (no mincore, no map, nothing asked, past the end)."""
        libc = LIBC
        if libc is None or self._failed or not len(starts) or (self._map is None and not self._open()):
            return None
        starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        out = np.ones(len(starts), dtype=bool)  # an empty range has nothing to read
        keep = np.flatnonzero(ends > starts)
        if not len(keep):
            return out
        lo, hi = starts[keep] // PAGE, (ends[keep] - 1) // PAGE + 1  # pages [lo, hi) of each range
        if int(hi.max()) * PAGE > self._size + PAGE - 1:
            return None  # past the end of the file as mapped: the reader's own checks will say why
        if self._whole_file_resident(int(lo[0]), int(hi[0])):
            return out
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], hi[order]
        reach = np.maximum.accumulate(hi)
        # ranges within GAP_PAGES of the ones before share one call over their hull (its extra pages are cheap)
        heads = np.concatenate(([0], np.flatnonzero(lo[1:] > reach[:-1] + GAP_PAGES) + 1))
        tails = np.concatenate((heads[1:], [len(lo)]))
        first, last = lo[heads], reach[tails - 1]
        at = np.concatenate(([0], np.cumsum(last - first)))  # each hull's answer at vec[at[k]:at[k + 1]]
        addr = self._answer(int(at[-1]))
        for f, n, a in zip(first.tolist(), (last - first).tolist(), at[:-1].tolist()):
            if libc.mincore(self._base + f * PAGE, n * PAGE, addr + a) != 0:
                return None
        # each range's pages, placed in its hull's answer, all cached: counted at once from a running sum
        cached = np.concatenate(([0], np.cumsum(self._vec[:int(at[-1])] & 1)))
        shift = np.repeat(at[:-1] - first, tails - heads)
        out[keep[order]] = cached[hi + shift] - cached[lo + shift] == hi - lo
        return out

    def hull_each(self, starts: np.ndarray, ends: np.ndarray, first: int, last: int) -> np.ndarray:
        """``resident_each`` for ranges within a small hull [first, last) (an N5 block's samples), from one ``mincore``
        call over it: when its pages all are cached, or none is (a cold batch), every range's answer follows without
        working out which pages each covers. A file seen whole in the cache within the second only has the hull's
        first page asked about."""
        n = len(starts)
        with self._lock:
            if LIBC is None or self._failed or (self._map is None and not self._open()):
                return np.zeros(n, dtype=bool)
            if last <= first:
                return np.ones(n, dtype=bool)
            lo, hi = first // PAGE, (last - 1) // PAGE + 1
            if hi * PAGE > self._size + PAGE - 1:  # past the end: not known, unless only empty ranges reach there
                each = self._resident_each(starts, ends)
                return np.zeros(n, dtype=bool) if each is None else each
            if self._whole_file_resident(lo, lo + 1):
                return np.ones(n, dtype=bool)
            if LIBC.mincore(self._base + lo * PAGE, (hi - lo) * PAGE, self._answer(hi - lo)) != 0:
                return np.zeros(n, dtype=bool)
            vec = self._vec[:hi - lo] & 1
        if vec.all():
            return np.ones(n, dtype=bool)
        empty = ends <= starts  # nothing to read: cached
        if not vec.any():
            return empty
        cached = np.concatenate(([0], np.cumsum(vec)))
        a, b = (np.minimum(x // PAGE - lo, hi - lo) for x in (starts, np.maximum(ends - 1, starts) + PAGE))
        return empty | (cached[b] - cached[a] == b - a)

    def _whole_file_resident(self, lo: int, hi: int) -> bool:
        """Whether the whole file was in the cache when last asked (asked again once that answer is old, for
        files of up to WHOLE_FILE_PAGES) and pages [lo, hi) still are (a cheap check that catches an eviction)."""
        pages = -(-self._size // PAGE)
        if pages > WHOLE_FILE_PAGES or LIBC is None:
            return False
        now = time.monotonic()
        if now >= self._whole_until:
            self._whole = self._all_cached(0, pages, self._holding_mask(pages))
            self._whole_until = time.monotonic() + max(WHOLE_FILE_SECONDS, 200 * (time.monotonic() - now))
        if self._whole and not self._all_cached(lo, hi):
            self._whole, self._whole_until = False, now + WHOLE_FILE_SECONDS  # evicted since: ask range by range
        return self._whole

    def _all_cached(self, lo: int, hi: int, mask: np.ndarray | None = None) -> bool:
        """One mincore call: pages [lo, hi) of the file all resident (only those ``mask`` marks, where given)."""
        addr = self._answer(hi - lo)
        if LIBC is None or LIBC.mincore(self._base + lo * PAGE, (hi - lo) * PAGE, addr) != 0:
            return False
        if hi - lo == 1 and mask is None:  # one page (a file seen whole): no array operations
            return bool(self._vec[0] & 1)
        vec = self._vec[:hi - lo]
        return bool((vec & 1).all()) if mask is None else bool((vec[mask] & 1).all())

    def _answer(self, pages: int) -> int:
        """The address of an answer vector of at least ``pages`` bytes (``self._vec``, grown when needed)."""
        if pages > len(self._vec) or not self._vec_at:
            self._vec = np.zeros(max(pages, 1), dtype=np.uint8)
            self._vec_at = self._vec.ctypes.data
        return self._vec_at

    def _holding_mask(self, pages: int) -> np.ndarray | None:
        """Which of the file's ``pages`` hold sample bytes (made once from ``holding``); None: all of them."""
        if self._holding is None:
            return None
        if self._mask is None or len(self._mask) != pages:
            holding = self._holding() if callable(self._holding) else self._holding
            if holding is None:  # not known after all: every page
                self._holding = None
                return None
            starts, ends = (np.asarray(a, dtype=np.int64) for a in holding)
            keep = ends > starts
            edges = np.zeros(pages + 1, dtype=np.int64)
            np.add.at(edges, np.minimum(starts[keep] // PAGE, pages), 1)
            np.add.at(edges, np.minimum((ends[keep] - 1) // PAGE + 1, pages), -1)
            self._mask = np.cumsum(edges[:-1]) > 0
        return self._mask

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still exported (never here: the address was taken from a temporary)
                pass
            self._map = None


def resident_pages(path: str | os.PathLike) -> tuple[int, int] | None:
    """(pages of ``path`` in the page cache, pages in all); None when the kernel can't be asked. The file is mapped
    without touching it (mapping faults nothing in), asked, and unmapped."""
    cache = PageCache(path)
    try:
        return cache.pages()
    finally:
        cache.close()


def mapped_files_limit() -> int:
    """How many files one reader keeps mapped per process: each map holds a descriptor, so a sixteenth of the
    open-file limit, 64 to 1,024: a file mapped again costs its page faults again, and asking about one no longer
    mapped a map and an unmap (docs/results.md)."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return 64
    return 1024 if soft == resource.RLIM_INFINITY else max(64, min(1024, soft // 16))


KEEP_FILES = mapped_files_limit()  # files a SpanResidency keeps mapped; older ones are mapped again when asked


class _Files:
    """One process's PageCache per file, at most ``keep`` of them (the least recently asked closed first)."""

    def __init__(self, keep: int = KEEP_FILES) -> None:
        self.caches: LRU[str, PageCache] = LRU(keep, drop=PageCache.close)
        self.lock = threading.Lock()  # two loaders' feeder threads may ask at once

    def close(self) -> None:
        with self.lock:
            self.caches.clear()


class SpanResidency:
    """Whether byte ranges of several files are all in the page cache (a ``PageCache`` per file).

    For readers that know their samples' ranges (``ShardReader.file_spans``) but not a faster way to ask:
    a warm batch then skips the read-ahead, which would only copy its bytes once more (a thread's
    ``pread`` of every byte). At most ``keep`` files stay mapped
    (a dataset of block files has thousands). Per process; pickles empty.
    """

    def __init__(self, keep: int = KEEP_FILES) -> None:
        self.keep = keep
        self._files: PerProcess[_Files] = PerProcess(partial(_Files, keep), inherited=_Files.close)

    def each(self, spans: Sequence[Sequence[tuple[str, int, int]]]) -> np.ndarray:
        """Per sample (its ranges, as ``ShardReader.file_spans`` gives them), True when every range is cached; False
        when any is not, or its ranges are unknown (none given)."""
        ids: dict[str, int] = {}
        file_of, starts, ends, owners = [], [], [], []
        for k, ranges in enumerate(spans):
            for path, start, end in ranges:
                file_of.append(ids.setdefault(path, len(ids)))
                starts.append(start)
                ends.append(end)
                owners.append(k)
        ok = self.ranges(list(ids), *(np.array(v, dtype=np.int64) for v in (file_of, starts, ends)))
        has = np.array([len(ranges) > 0 for ranges in spans], dtype=bool)
        return has & all_of_each(ok, np.array(owners, dtype=np.int64), len(spans))

    def ranges(self, paths: Sequence[str], file_of: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Per range, bytes [starts[k], ends[k]) of file ``paths[file_of[k]]``, whether all are cached: each file
        asked about once, for all its ranges (``each`` for readers that have their ranges as arrays: N5's), each
        file's hull found for all at once."""
        out = np.ones(len(starts), dtype=bool)
        if not len(starts):
            return out
        order = np.argsort(file_of, kind="stable")
        of, lo, hi = file_of[order], starts[order], ends[order]
        heads = np.concatenate(([0], np.flatnonzero(np.diff(of)) + 1))
        tails = np.concatenate((heads[1:], [len(order)])).tolist()
        firsts, lasts = np.minimum.reduceat(lo, heads).tolist(), np.maximum.reduceat(hi, heads).tolist()
        hulls = zip(of[heads].tolist(), firsts, lasts, strict=True)
        files = self._files.get()
        with files.lock:
            for a, b, (f, first, last) in zip(heads.tolist(), tails, hulls, strict=True):
                cache = self._cache(files, paths[int(f)])
                if last - first > HULL_BYTES:  # far apart: page by page (pages between them do not count)
                    out[order[a:b]] = cache.resident_each(lo[a:b], hi[a:b])
                else:  # one small call answers them all
                    out[order[a:b]] = cache.hull_each(lo[a:b], hi[a:b], first, last)
        return out

    @staticmethod
    def _cache(files: _Files, path: str) -> PageCache:
        """The PageCache of ``path``, now the most recently asked (the oldest beyond ``keep`` closed)."""
        return files.caches.get(path) or files.caches.put(path, PageCache(path))

    def close(self) -> None:
        """Drop this process's mappings."""
        self._files.close(_Files.close)
