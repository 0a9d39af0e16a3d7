"""A packed dataset at a URL read in whole-shard mode: the read pipeline's shard files from the node's cache.

``RemoteShards`` is the ``ShardFiles`` of a ``RemoteDataset`` (packer/layout/remote.py): the manifest, index and
fields are the node's checked copy, and each shard's reader is the format's own, opened on the files
``fetch_shard`` put into the node's cache (each checked against the manifest's sha256 there). A reader waits for
its shard before its first read in a process (``FetchedShard``); a batch's shards are asked for together, when the
pipeline asks whether its bytes are cached. A sampler's pass (``follow``: ``BlockShuffleSampler`` hands it the
order it yields) fetches the next shards of the order ahead of the reads, lowest priority first, and tells the
node's eviction policy when each shard is read next (never again this pass: evicted first). Faults (a dataset
replaced in the bucket, a damaged object, a lasting server error) are the PackerError the fetch raised, naming
the URL, in whichever process or thread reads.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from packer.errors import DatasetError, PackerError
from packer.formats.base import Destinations, Format, ShardReader, shard_layout
from packer.layout.fields import FieldStore
from packer.layout.index import Index, shard_starts
from packer.layout.manifest import Manifest, Shard
from packer.layout.remote import RemoteDataset, default_cache_dir
from packer.lru import LRU
from packer.perprocess import PerProcess
from packer.storage.faults import RetryPolicy

T = TypeVar("T")
READ_AHEAD = 64 << 20  # bytes of shards fetched ahead of the reads, as the limit allows (docs/remote.md)
LAG = 512  # indices handed out after a shard's segment before it counts as read (a DataLoader's batches in flight)
KEEP_OPEN = 4  # shard readers a process keeps open: an evicted shard's disk space returns once its reader closes
SCAN = 100_000  # segments of the order looked through for the next shards


class _Process:
    """One process's fetches (shard -> future) and open readers (least recently used first)."""

    def __init__(self) -> None:
        self.futures: dict[int, concurrent.futures.Future] = {}
        self.opened: LRU[int, FetchedShard] = LRU(sys.maxsize)  # the order alone: only idle readers close
        self.busy: collections.Counter[int] = collections.Counter()
        self.lock = threading.Lock()


class RemoteShards:
    """The shard files of ``remote``, fetched whole into the node's cache as the reads need them; ``read_ahead``:
    bytes of shards a sampler's pass fetches ahead (at least one shard, as many as the cache limit leaves room for
    beside the shard being read and two more); ``keep_open``: shard readers a process keeps open; ``lag``: indices
    handed out after a shard's segment before the eviction policy hears it was read."""

    def __init__(self, remote: RemoteDataset, read_ahead: int = READ_AHEAD, keep_open: int = KEEP_OPEN,
                 lag: int = LAG) -> None:
        if remote.index is None or remote.fields is None:
            raise DatasetError(remote.problems[0] if remote.problems else f"{remote.where()}: metadata missing")
        self.remote = remote
        self.root: Path = remote.folder
        self.name = remote.where()
        self.keep_open, self.lag = keep_open, lag
        biggest = max((sum(f.num_bytes for f in s.files) for s in remote.manifest.shards), default=0)
        limit = remote.cache_limit
        # shards ahead: at least one, where the limit holds them beside the shard being read and two more (shards
        # the order reads again soon, left in the cache: in a cache of a few shards, fetching ahead would evict them)
        want = max(1, read_ahead // max(biggest, 1))
        self.read_ahead = want if limit is None else min(want, max(0, limit // max(biggest, 1) - 3))
        self.starts = shard_starts([s.num_samples for s in remote.manifest.shards])
        self._process: PerProcess[_Process] = PerProcess(_Process)

    def __getstate__(self) -> dict:
        """All but the shards' first positions, made again from the manifest where unpickled (the remote dataset,
        unpickled first, has reloaded it: ``RemoteDataset.__setstate__``)."""
        state = dict(self.__dict__)
        del state["starts"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.starts = shard_starts([s.num_samples for s in self.remote.manifest.shards])

    # ---- ShardFiles ----

    def open(self) -> tuple[Manifest, Index, FieldStore, None]:
        assert self.remote.index is not None and self.remote.fields is not None  # checked in __init__
        return self.remote.manifest, self.remote.index, self.remote.fields, None

    def reader(self, fmt: Format, k: int, shard: Shard, payload: str, access: str) -> ShardReader:
        return FetchedShard(self, k, fmt, shard, payload, access)

    def where(self, name: str) -> str:
        return self.remote.where(name)

    def follow(self, stored: np.ndarray, indices: Iterator[int], start: int) -> Iterator[int]:
        return PassPlan(self, stored).run(indices, start)

    def close(self) -> None:
        state = self._process.peek()
        if state is not None:
            with state.lock:
                cancel_all(state.futures)
                state.opened.clear()
        self.remote.close()

    # ---- fetching ----

    def entries(self, k: int) -> list[str]:
        """The cache entries of shard ``k``'s files (for the eviction policy)."""
        return [self.remote.file_entry(f.name) for f in self.remote.manifest.shards[k].files]

    def start(self, k: int, priority: int = 0, again: bool = False) -> concurrent.futures.Future:
        """Fetch shard ``k`` in the background unless this process already asked (``again``: ask the node once
        more if that fetch is done, as it may have been evicted since: a hit costs one message); its fetch."""
        state = self._process.get()
        with state.lock:
            fut = state.futures.get(k)
            if fut is None or fut.cancelled() or (again and fut.done()):
                fut = state.futures[k] = self.remote.fetch_shard(k, priority)
            return fut  # under the lock: another thread may drop the entry (closing idle readers) right after

    def acquire(self, reader: FetchedShard) -> None:
        """Wait for ``reader``'s shard (fetching it now if nobody asked) and mark it in use in this process;
        readers idle longest are closed past ``keep_open``."""
        state = self._process.get()
        fut = self.start(reader.k)
        try:
            fut.result()
        except BaseException as exc:
            with state.lock:
                if state.futures.get(reader.k) is fut:
                    del state.futures[reader.k]  # a failed or interrupted fetch is tried again by the next read
            if isinstance(exc, concurrent.futures.CancelledError):
                raise PackerError(f"{self.name}: shard {reader.k}: the dataset was closed while it was read") from None
            raise
        with state.lock:
            state.busy[reader.k] += 1
            state.opened.put(reader.k, reader)
            idle = [k for k in state.opened if state.busy[k] == 0]
            for k in idle[: max(0, len(state.opened) - self.keep_open)]:
                idle_reader = state.opened.pop(k)
                if idle_reader is not None:
                    idle_reader.close()
                state.futures.pop(k, None)  # the next read asks the node again: its files may be gone by then

    def release(self, reader: FetchedShard) -> None:
        state = self._process.get()
        with state.lock:
            state.busy[reader.k] -= 1

    def forget(self, reader: FetchedShard) -> None:
        """``reader``'s files were evicted before it opened them: close it and fetch its shard again."""
        state = self._process.get()
        with state.lock:
            state.futures.pop(reader.k, None)
            state.opened.pop(reader.k)
            inner, reader.inner = reader.inner, None
        if inner is not None:
            inner.close()

    def lock(self) -> threading.Lock:
        """This process's lock over its fetches and readers."""
        return self._process.get().lock

    def present(self, k: int) -> bool:
        """Every file of shard ``k`` is in the cache now."""
        root = self.remote.shard_root
        return all(os.path.exists(root / f.name) for f in self.remote.manifest.shards[k].files)

    def __repr__(self) -> str:
        return f"RemoteShards({self.name!r})"


class FetchedShard(ShardReader):
    """The format's reader of shard ``k``, made once its files are in the node's cache (some readers look into
    their files when made); its ``fixed_shape`` is the manifest's, as every format's reader takes it."""

    def __init__(self, files: RemoteShards, k: int, fmt: Format, shard: Shard, payload: str,  # noqa: D107
                 access: str) -> None:
        self.files, self.k, self.fmt, self.shard, self.payload, self.access = files, k, fmt, shard, payload, access
        self.inner: ShardReader | None = None
        self.fixed_shape = shard_layout(shard.facts, files.where(shard.files[0].name)) \
            if shard.facts.get("layout") == "fixed" else None

    def __len__(self) -> int:
        return self.shard.num_samples

    def made(self) -> ShardReader:
        """The format's reader (made now if this is the first read since the shard was fetched)."""
        with self.files.lock():
            if self.inner is None:
                self.inner = self.fmt.Reader(self.files.remote.shard_root, self.shard, self.payload,
                                             access=self.access)
            return self.inner

    def _call(self, read: Callable[[ShardReader], T]) -> T:
        for _ in range(3):
            self.files.acquire(self)
            try:
                return read(self.made())
            except (PackerError, OSError):
                if self.files.present(self.k):
                    raise
                self.files.forget(self)  # evicted between its fetch and its opening here: fetch it again
            finally:
                self.files.release(self)
        raise PackerError(f"{self.files.where(self.shard.files[0].name)}: evicted from the cache again and again "
                          "before it could be opened: raise cache_limit")

    def read(self, pos: int) -> Any:
        return self._call(lambda r: r.read(pos))

    def read_many(self, positions: Sequence[int]) -> list:
        return self._call(lambda r: r.read_many(positions))

    def read_copies(self, positions: Sequence[int], buf: Destinations = None) -> list:
        return self._call(lambda r: r.read_copies(positions, buf))

    def read_into(self, positions: Sequence[int], out: np.ndarray) -> None:
        self._call(lambda r: r.read_into(positions, out))

    def file_spans(self, positions: Sequence[int]) -> list[list]:
        """None to read ahead locally: the shard's fetch is its read-ahead (started here)."""
        self.files.start(self.k)
        return [[] for _ in positions]

    def cached(self, positions: Sequence[int]) -> np.ndarray:
        """All: a fetched shard was just written (its pages cached); the fetch starts here, with the batch's
        other shards', before the first of them is waited for."""
        self.files.start(self.k)
        return np.ones(len(positions), dtype=bool)

    def will_need(self, positions: Sequence[int]) -> None:
        self.files.start(self.k)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def cancel_all(futures: dict[int, concurrent.futures.Future]) -> None:
    """Cancel this process's fetches (read-ahead nobody waits for any more) and forget them."""
    for fut in futures.values():
        fut.cancel()
    futures.clear()


class Pass:
    """A sampler's pass over storage positions in runs of one unit (a shard, or a ranged group: ``of`` gives each
    position's unit): entering a run fetches the next units of the order; leaving it, ``lag`` positions later (read
    by then), says when its unit is read next. Subclasses say what entering and leaving do."""

    def __init__(self, of: np.ndarray, lag: int) -> None:
        self.begin = np.concatenate([[0], np.flatnonzero(np.diff(of)) + 1]).astype(np.int64) \
            if len(of) else np.zeros(0, dtype=np.int64)
        self.unit: list[int] = of[self.begin].tolist() if len(of) else []
        self.next_same = [-1] * len(self.unit)  # the run where the same unit is read next, or -1
        seen: dict[int, int] = {}
        for i in range(len(self.unit) - 1, -1, -1):
            self.next_same[i] = seen.get(self.unit[i], -1)
            seen[self.unit[i]] = i
        self.size = len(of)
        self.lag = lag
        self.asked: set[int] = set()  # units this pass fetched ahead and has not read since
        self.live: collections.Counter[int] = collections.Counter()  # units entered and not yet left

    def run(self, indices: Iterator[int], start: int) -> Iterator[int]:
        """``indices`` (from position ``start`` of the pass), with the fetches and needs as they are reached."""
        if not self.unit:
            yield from indices
            return
        seg = int(np.searchsorted(self.begin, start, side="right")) - 1
        self._starting(seg)
        self._enter(seg)
        edge = int(self.begin[seg + 1]) if seg + 1 < len(self.unit) else self.size
        left: collections.deque[tuple[int, int]] = collections.deque()  # (position it is due, run left)
        j = start
        for i in indices:
            if j >= edge:
                left.append((j + self.lag, seg))
                seg += 1
                self._enter(seg)
                edge = int(self.begin[seg + 1]) if seg + 1 < len(self.unit) else self.size
            while left and j >= left[0][0]:
                self._leave(left.popleft()[1])
            j += 1
            yield i
        for _, done in left:
            self._leave(done)
        self._leave(seg)  # the pass was read to its end

    def _starting(self, seg: int) -> None:
        """Before the first run ``seg`` is entered (nothing by default)."""

    def _enter(self, seg: int) -> None:
        raise NotImplementedError

    def _leave(self, seg: int) -> None:
        raise NotImplementedError


class PassPlan(Pass):
    """A pass in shard segments (runs of one shard): entering a segment starts the next shards' fetches and tells
    the node's eviction policy when each is read next."""

    def __init__(self, files: RemoteShards, stored: np.ndarray) -> None:
        super().__init__(np.searchsorted(files.starts, np.asarray(stored, dtype=np.int64), side="right") - 1,
                         files.lag)
        self.files = files

    def _need(self, shard: int, seg: int) -> None:
        self.files.remote.need(self.files.entries(shard), None if seg < 0 else int(self.begin[seg]))

    def _starting(self, seg: int) -> None:
        """Each shard of the pass from ``seg`` on: needed at its first use (entries of the last pass no longer
        read go first); the first one fetched where the pass starts (a DataLoader's main process, while its
        workers start up), not when a worker first reads it (``_enter`` fetches the shards after it)."""
        first: dict[int, int] = {}
        for i in range(seg, len(self.unit)):
            first.setdefault(self.unit[i], i)
        for shard, i in first.items():
            self._need(shard, i)
        self.files.start(self.unit[seg], again=True)

    def _leave(self, seg: int) -> None:
        """Segment ``seg`` was handed out ``lag`` indices ago (read by now): its shard is needed next where the
        order reads it again, or never this pass (evicted first)."""
        self._need(self.unit[seg], self.next_same[seg])
        self.asked.discard(self.unit[seg])  # it may be evicted before it is read again: ask the node again then
        self.live[self.unit[seg]] -= 1

    def _enter(self, seg: int) -> None:
        """Segment ``seg`` starts being handed out: fetch the next shards of the order not being read now."""
        self.live[self.unit[seg]] += 1
        ahead: list[int] = []
        for i in range(seg + 1, min(len(self.unit), seg + 1 + SCAN)):
            if len(ahead) >= self.files.read_ahead:
                break
            if self.live[self.unit[i]] <= 0 and self.unit[i] not in ahead:
                ahead.append(self.unit[i])
        for distance, shard in enumerate(ahead, 1):
            if shard not in self.asked:
                self.asked.add(shard)
                self.files.start(shard, priority=distance, again=True)


def open_remote(url: str, cache_dir: str | os.PathLike | None, cache_limit: int | str | None,
                storage_options: Mapping[str, Any] | None, policy: RetryPolicy | None = None,
                read_ahead: int = READ_AHEAD) -> RemoteShards:
    """The dataset at ``url`` opened for reading (metadata fetched once per node and checked); ``cache_dir`` None:
    ``~/.cache/packer``."""
    remote = RemoteDataset(url, default_cache_dir() if cache_dir is None else cache_dir, cache_limit,
                           storage_options, policy)
    try:
        return RemoteShards(remote, read_ahead)
    except BaseException:
        remote.close()
        raise
