"""A packed dataset at a URL read in ranged mode: the batches' payloads from large ranged GETs into the node's cache.

Where a conversion recorded each sample's payload range and CRC-32 (packer.layout.ranges), the samples are cut
into *groups* of neighbours in file order (about ``group_bytes`` of one file, never across a shard; ``Groups``): a group
is one ranged GET and one entry of the node's cache, fetched by the node's downloader with every sample's CRC-32
checked before the entry exists (packer.storage.downloader), and read again by its payloads' offsets. The same
groups every pass and in every process, so a second pass through a cache as large as the dataset is all hits.

``RangedSource.start`` asks for a batch's groups (highest priority); a sampler's pass (``follow``:
``BlockShuffleSampler`` hands it the order it yields) fetches the groups the order reads next, ``read_ahead``
bytes ahead, and tells the node's eviction policy when each is read next (never again this pass: evicted
first). ``payloads`` reads each sample from its group's entry and checks its CRC-32 again (``ChecksumMismatch``
naming the URL: a damaged cache file is never decoded). Faults are the PackerError the fetch raised, naming the
URL, in whichever process or thread reads (DataLoader workers, ThreadLoader threads, get_batch).
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from packer.errors import OptionError, PackerError
from packer.layout.ranges import ALGORITHM, PayloadRanges
from packer.layout.remote import RemoteDataset
from packer.perprocess import PerProcess
from packer.read.hints import Ahead
from packer.read.readahead import Pending
from packer.read.remote import Pass, RemoteShards, cancel_all
from packer.read.source import SampleSource
from packer.read.store import ShardFiles
from packer.storage.cache import check

GROUP_BYTES = 1 << 20  # one ranged GET: large enough that a GET's cost is small, small enough for a quick 1st batch
READ_AHEAD = 32 << 20  # bytes of groups a sampler's pass fetches ahead of the reads (as cache_limit allows)
RAMP = 8 << 20  # read-ahead at a pass's start, growing by twice what the pass entered: the first batch's GETs
# do not share the link with a full window of read-ahead
GAP = 64 << 10  # payloads this close (an lmdb page's keys between them) share a group; farther apart, a new one
SLACK = 1 / 16  # of a file's payload bytes, at most this many more are fetched with them (bytes between payloads)
LAG = 512  # indices handed out after a group's run before it counts as read (a DataLoader's batches in flight)
SCAN = 10_000  # runs of the order looked through for the next groups
TRIES = 3  # reads of a group's entry evicted between its fetch and its opening before giving up


class Groups:
    """The groups of a dataset: per sample its group; per group its samples (``members[first:stop]``, storage
    positions in file order), its file (the manifest's name) and its bytes [start, end) there.

    Groups are made by file offset, not by storage order: each file's payloads sorted by offset, neighbours joined
    into runs across the bytes between them (gaps under ``gap``, the largest of a file left out until those bridged
    hold at most ``slack`` of its payload bytes: ``_bridged``), each run cut every ``group_bytes``. Where payloads
    lie in storage order (photos in lmdb's overflow pages, memmap, hdf5, ...) that is a run of storage order; lmdb's
    small values lie in its leaf pages, several to a page in descending order and the pages not quite in order, so
    a group of storage order would be a few values spanning other values' bytes (fetched twice), and the free
    space at each leaf page's end is their ``slack``."""

    def __init__(self, ranges: PayloadRanges, nbytes: np.ndarray, files: Sequence[Sequence[str]],
                 counts: Sequence[int], group_bytes: int = GROUP_BYTES, gap: int = GAP, slack: float = SLACK) -> None:
        n = len(nbytes)
        base = np.concatenate([[0], np.cumsum([len(f) for f in files])[:-1]]).astype(np.int64)
        self.names = [name for shard in files for name in shard]
        gfile = np.repeat(base, counts) + ranges.file.astype(np.int64)
        off = ranges.offset.astype(np.int64)
        end = off + nbytes.astype(np.int64)
        self.members = np.lexsort((off, gfile)).astype(np.int64)  # by file, then offset (ties: storage order)
        f, o, e = gfile[self.members], off[self.members], end[self.members]
        brk = np.ones(n, dtype=bool)
        if n > 1:  # another file, too far after the last payload's end, or a gap cut for the slack: a new run
            brk[1:] = ~_bridged(f, o, e, gap, slack)
        run_start = o[np.flatnonzero(brk)][np.cumsum(brk) - 1] if n else o
        cut = (np.maximum(e - 1, o) - run_start) // max(1, group_bytes)  # a run cut every group_bytes
        new = brk.copy()
        if n > 1:
            new[1:] |= cut[1:] != cut[:-1]
        self.of = np.empty(n, dtype=np.int64)
        self.of[self.members] = np.cumsum(new) - 1
        self.first = np.flatnonzero(new).astype(np.int64)
        self.stop = np.append(self.first[1:], n).astype(np.int64)
        self.file = f[self.first] if n else f
        self.start = o[self.first] if n else o
        self.end = np.maximum.reduceat(e, self.first) if n else e
        self.offset, self.nbytes, self.crc = off, nbytes.astype(np.int64), ranges.crc32

    def __len__(self) -> int:
        return len(self.first)

    def size(self, g: int) -> int:
        return int(self.end[g] - self.start[g])

    def name(self, g: int) -> str:
        return self.names[int(self.file[g])]

    def pieces(self, g: int) -> list[tuple[int, int, str, str]]:
        """Each payload of group ``g`` with its CRC-32, as the downloader checks them (in file order)."""
        at = self.members[int(self.first[g]):int(self.stop[g])]
        return [(o, o + n, ALGORITHM, f"{c:08x}") for o, n, c in
                zip(self.offset[at].tolist(), self.nbytes[at].tolist(), self.crc[at].tolist(), strict=True)]


def _bridged(f: np.ndarray, o: np.ndarray, e: np.ndarray, gap: int, slack: float) -> np.ndarray:
    """Per pair of neighbours in file order (``f``, ``o``, ``e``: file, offset and end of each payload, sorted by
    file and offset): whether one GET reads across the bytes between them. Not across files nor gaps over ``gap``;
    of a file's other gaps the largest are left out until the rest hold at most ``slack`` times its payload bytes,
    so that a pass fetches at most ``1 + slack`` times what it delivers in the fewest GETs that allow it."""
    between = o[1:] - e[:-1]
    bridged = (f[1:] == f[:-1]) & (between <= gap)
    cand = np.flatnonzero(bridged & (between > 0))
    if not len(cand):
        return bridged
    cand = cand[np.lexsort((-between[cand], f[cand + 1]))]  # per file, the largest gap first
    owner, sizes = f[cand + 1], between[cand]
    payload = np.bincount(f, weights=e - o)
    excess = np.bincount(owner, weights=sizes, minlength=len(payload)) - slack * payload  # bytes to leave out
    done = np.cumsum(sizes)
    first = np.searchsorted(owner, owner)  # each file's first gap in ``cand``
    before = done - sizes - (done[first] - sizes[first])  # bytes of the file's larger gaps left out before this
    bridged[cand[before < excess[owner]]] = False
    return bridged


class GroupPending(Pending):
    """A batch's reads in ranged mode: item ``k`` (a position, in file order) waits for its group's fetch."""

    def __init__(self, futures: list[concurrent.futures.Future], item_future: list[int]) -> None:
        super().__init__([], [(-1, 0)] * len(item_future))
        self.futures, self.item_future = futures, item_future

    def wait(self, k: int, timeout: float = 60.0) -> None:
        concurrent.futures.wait([self.futures[self.item_future[k]]], timeout)  # errors: raised by payloads, named

    def wait_all(self, items: Sequence[int]) -> None:
        concurrent.futures.wait({self.futures[self.item_future[k]] for k in items})

    def arrival_order(self) -> list[int]:
        """Items of groups fetched already first, then in file order (the order the groups were asked for)."""
        done = [f.done() for f in self.futures]
        return sorted(range(len(self.item_future)), key=lambda k: (not done[self.item_future[k]], k))

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def cancel(self) -> None:
        """Nothing: the fetches are shared with other batches of this process (closing the source cancels)."""


class _Process:
    """One process's fetches: group -> its entry's future."""

    def __init__(self) -> None:
        self.futures: dict[int, concurrent.futures.Future] = {}
        self.lock = threading.Lock()


class RangedSource(SampleSource):
    """The samples of ``remote`` (whose conversion recorded ``ranges``) in groups of about ``group_bytes``
    fetched by ranged GETs; ``read_ahead``: bytes of groups a sampler's pass fetches ahead (at most a quarter of
    the cache limit); ``lag``: indices handed out after a group's run before the eviction policy hears it was
    read."""

    def __init__(self, remote: RemoteDataset, ranges: PayloadRanges, group_bytes: int = GROUP_BYTES,
                 read_ahead: int = READ_AHEAD, lag: int = LAG) -> None:
        assert remote.index is not None and remote.fields is not None  # RemoteShards checked them
        self.remote, self.manifest, self.index, self.fields = remote, remote.manifest, remote.index, remote.fields
        self.payload = self.manifest.payload
        self.name = remote.where()
        self.group_bytes = group_bytes
        self.groups = self._groups(ranges)
        limit = remote.cache_limit
        self.read_ahead = read_ahead if limit is None else min(read_ahead, limit // 4)
        self.lag = lag
        self._entries: dict[int, str] = {}
        self._process: PerProcess[_Process] = PerProcess(_Process)

    def _groups(self, ranges: PayloadRanges) -> Groups:
        shards = self.manifest.shards
        return Groups(ranges, self.index.nbytes, [[f.name for f in s.files] for s in shards],
                      [s.num_samples for s in shards], self.group_bytes)

    def __getstate__(self) -> dict:
        """All but the groups (per-sample arrays), made again where unpickled from the payload ranges in the
        node's cache (``__setstate__``; the remote dataset, unpickled first, has fetched them again there)."""
        state = dict(self.__dict__)
        del state["groups"]
        state["_entries"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        ranges = PayloadRanges.load(self.remote.folder, self.manifest, self.index)
        if ranges is None:
            raise PackerError(f"{self.name}: its payload ranges are no longer in the node's cache")
        self.groups = self._groups(ranges)

    # ---- fetching ----

    def entry(self, g: int) -> str:
        """The cache entry of group ``g`` (for the eviction policy)."""
        got = self._entries.get(g)
        if got is None:
            got = self._entries[g] = self.remote.range_entry(self.groups.name(g), int(self.groups.start[g]),
                                                             int(self.groups.end[g]))
        return got

    def fetch(self, groups: Sequence[int], priority: int = 0, again: bool = False) -> list[concurrent.futures.Future]:
        """Each group's entry, fetched in the background unless this process asked already (``again``: ask the
        node once more where that fetch is done, as the entry may have been evicted since: a hit is one message)."""
        state = self._process.get()
        with state.lock:
            out: dict[int, concurrent.futures.Future] = {}
            todo = []
            for g in groups:
                fut = state.futures.get(g)
                if fut is None or fut.cancelled() or (fut.done() and (again or fut.exception() is not None)):
                    todo.append(g)
                else:
                    out[g] = fut
            by_file: dict[int, list[int]] = collections.defaultdict(list)
            for g in todo:
                by_file[int(self.groups.file[g])].append(g)
            for gs in by_file.values():
                asked = [(int(self.groups.start[g]), int(self.groups.end[g]), self.groups.pieces(g)) for g in gs]
                for g, fut in zip(gs, self.remote.fetch_ranges(self.groups.name(gs[0]), asked, priority), strict=True):
                    out[g] = state.futures[g] = fut
            return [out[g] for g in groups]

    def start(self, positions: np.ndarray, ahead: Sequence[Ahead] = (), skip_cached: bool = True) -> Pending:
        """Ask for the groups of these positions (``SampleSource.start``): one ranged GET each, unless cached or
        under way; items (the positions in file order) wait for their group."""
        ordered = np.sort(np.asarray(positions, dtype=np.int64), kind="stable")
        of = self.groups.of[ordered]
        groups, item = np.unique(of, return_inverse=True)
        return GroupPending(self.fetch(groups.tolist()), item.tolist())

    def payloads(self, positions: Sequence[int] | np.ndarray, pending: Pending | None = None,
                 into: Callable[[int], np.ndarray] | None = None,
                 places: Sequence[np.ndarray | None] | None = None) -> list:
        """``SampleSource.payloads``: each sample read from its group's entry at its offset, its CRC-32 checked;
        copies in ``places`` (raw pixels of the slot's size), in ``into``'s memory, or bytes of their own."""
        idx = np.asarray(positions, dtype=np.int64)
        if not len(idx):
            return []
        sizes = self.index.nbytes[idx].astype(np.int64)
        dests: list[np.ndarray | None] = [None] * len(idx)
        if places is not None and self.payload == "raw" and all(
                p is not None and p.nbytes == n for p, n in zip(places, sizes.tolist(), strict=True)):
            dests = list(places)
        elif into is not None:
            block, ends = into(int(sizes.sum())), np.cumsum(sizes)
            dests = [block[int(e - n):int(e)] for e, n in zip(ends.tolist(), sizes.tolist(), strict=True)]
        of = self.groups.of[idx]
        out: list = [None] * len(idx)
        for g in np.unique(of).tolist():
            ks = np.flatnonzero(of == g).tolist()
            self._read_group(g, idx, ks, dests, out)
        if self.payload == "raw":
            heights, widths = self.index.heights[idx].tolist(), self.index.widths[idx].tolist()
            out = [np.frombuffer(b, dtype=np.uint8).reshape(h, w, 3) if isinstance(b, bytes) else b.reshape(h, w, 3)
                   for b, h, w in zip(out, heights, widths, strict=True)]
        return out

    def _read_group(self, g: int, idx: np.ndarray, ks: list[int], dests: list, out: list) -> None:
        """Samples ``idx[ks]`` of group ``g`` from its entry (fetched again if evicted before it was opened)."""
        base, name = int(self.groups.start[g]), self.groups.name(g)
        for attempt in range(TRIES):
            path = Path(self.fetch([g], again=attempt > 0)[0].result())
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                for k in ks:
                    pos = int(idx[k])
                    off, n = int(self.groups.offset[pos]), int(self.index.nbytes[pos])
                    dest = dests[k]
                    if dest is None:
                        data = os.pread(fd, n, off - base)
                        got = len(data)
                    else:
                        data = dest.reshape(-1)
                        got = os.preadv(fd, [data], off - base)
                    if got != n:
                        raise PackerError(f"{self.remote.where(name)} bytes {off}-{off + n}: the node's cache holds "
                                          f"{got} of its {n} bytes (damaged cache entry {path})")
                    check(data, (ALGORITHM, f"{int(self.groups.crc[pos]):08x}"),
                          f"{self.remote.where(name)} bytes {off}-{off + n} (sample {pos}, node cache {path})")
                    out[k] = data
            finally:
                os.close(fd)
            return
        raise PackerError(f"{self.remote.where(name)} bytes {base}-{int(self.groups.end[g])}: evicted from the cache "
                          "again and again before it could be read: raise cache_limit")

    # ---- a sampler's pass ----

    def follow(self, stored: np.ndarray, indices: Iterator[int], start: int) -> Iterator[int]:
        return GroupPass(self, stored).run(indices, start)

    def close(self) -> None:
        state = self._process.peek()
        if state is not None:
            with state.lock:
                cancel_all(state.futures)

    def __repr__(self) -> str:
        return f"RangedSource({self.name!r}, groups={len(self.groups)})"


class GroupPass(Pass):
    """A pass in runs of one group: entering a run fetches the next groups of the order (``read_ahead`` bytes,
    ``RAMP`` at first) and marks when each is read; leaving it marks when it is read next (never again this pass:
    evicted first)."""

    def __init__(self, source: RangedSource, stored: np.ndarray) -> None:
        super().__init__(source.groups.of[np.asarray(stored, dtype=np.int64)], source.lag)
        self.source = source
        self.entered = 0  # bytes of the groups of the runs entered so far (the read-ahead grows with it)

    def _starting(self, seg: int) -> None:
        """The pass's first group fetched where the pass starts (a DataLoader's main process, while its workers
        start up: spawned, that takes seconds), not when a worker first reads it (``_enter`` fetches the groups
        after the run entered, its own being asked for by the batch that reads it)."""
        g = self.unit[seg]
        self.source.remote.need([self.source.entry(g)], int(self.begin[seg]))
        self.source.fetch([g], again=True)

    def _leave(self, seg: int) -> None:
        g, again = self.unit[seg], self.next_same[seg]
        self.source.remote.need([self.source.entry(g)], None if again < 0 else int(self.begin[again]))
        self.asked.discard(g)  # it may be evicted before it is read again: ask the node again then
        self.live[g] -= 1

    def _enter(self, seg: int) -> None:
        """Run ``seg`` starts being handed out: fetch the next groups of the order not being read now, nearest
        first, and mark them needed where they are first read."""
        self.live[self.unit[seg]] += 1
        sizes, total = self.source.groups, 0
        self.entered += sizes.size(self.unit[seg])
        budget = min(self.source.read_ahead, RAMP + 2 * self.entered)
        ahead: dict[int, int] = {}
        for i in range(seg + 1, min(len(self.unit), seg + 1 + SCAN)):
            g = self.unit[i]
            if total >= budget:
                break
            if self.live[g] <= 0 and g not in ahead:
                ahead[g] = i
                total += sizes.size(g)
        todo = [g for g in ahead if g not in self.asked]
        for distance, g in enumerate(todo, 1):
            self.asked.add(g)
            self.source.remote.need([self.source.entry(g)], int(self.begin[ahead[g]]))
            self.source.fetch([g], priority=distance, again=True)


def ranged_source(files: ShardFiles, mode: str) -> RangedSource | None:
    """The ranged source of a URL's shard files for ``mode`` (``open_dataset``'s ``remote_mode``: "auto" where
    the conversion recorded payload ranges, "ranged" required, "shard" never), or None: whole-shard mode."""
    if mode == "shard" or not isinstance(files, RemoteShards):
        return None
    remote = files.remote
    assert remote.index is not None
    ranges = PayloadRanges.load(remote.folder, remote.manifest, remote.index)
    if ranges is None:
        if mode == "ranged":
            raise OptionError(f"{remote.where()}: its conversion recorded no payload ranges (an older packer, or a "
                              f"format whose payloads are no plain byte ranges: {remote.manifest.format}): open it "
                              "with remote_mode='shard' or 'auto'")
        return None
    return RangedSource(remote, ranges)
