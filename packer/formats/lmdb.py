"""LMDB: one memory-mapped B-tree file per shard, keys in order, values = payloads.

| file                 | holds                                                              |
|----------------------|--------------------------------------------------------------------|
| shard-00000.lmdb     | LMDB environment (``subdir=False``, no lock file); key ``%010d`` of |
|                      | the sample's position in the shard (ASCII), value the payload:      |
|                      | encoded file bytes, or raw HWC uint8 RGB bytes (shape in ``meta/``) |
| shard-00000.spans.npy| [N, 3] int64: each sample's leaf page offset and value start/end in |
|                      | the file: readers slice values from their own map of the file with   |
|                      | them (``lmdb_values``), read-ahead plans with them (packer.read.readahead)|

Raw payloads resized to one shape (``--resize HxW``) are recorded as such in the manifest (shard
facts ``layout: fixed``, ``shape``): ``get_batch`` then copies whole batches (``read_into``).

Written with ``append=True`` (keys arrive sorted: pages fill completely, no splits), committed
in batches, the map grown on ``MapFullError`` instead of reserving a huge map up front. The
same samples in the same order give the same file, byte for byte (LMDB's page allocation is
deterministic and ``meminit`` zeroes unused bytes).

Readers never open the file with py-lmdb (it refuses a file already open in the process, so a user's own
``lmdb.Environment`` on a shard would stop packer) and write nothing, not even a lock file (safe on read-only
and network filesystems). They read its header as LMDB does (``lmdb_pages.read_header``: page size, last page,
entry count, checked against the file and the manifest). Payloads are zero-copy read-only views of the reader's
own read-only map of the file (``lmdb_values``), where the spans file says they lie (checked against
the B-tree first) or, for shards written without one, where one walk of the B-tree's leaf pages finds
them (``lmdb_pages`` reads those pages). ``access`` decides
whether the kernel reads ahead around each page fault of that map: on for sequential and block-shuffled
passes (measured here a cold sequential pass is ~26x faster with it: docs/results.md), off for uniform
random access on datasets larger than RAM, where read-ahead only evicts useful pages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np

from packer.errors import DatasetError, PackerError
from packer.formats.base import (
    Destinations,
    Format,
    PreparedSample,
    ShardReader,
    ShardWriter,
    check_addition,
    check_size,
    fixed_shape,
    pread_ranges,
    shard_layout,
)
from packer.formats.lmdb_pages import Tree, page_reads, read_header
from packer.formats.lmdb_values import MappedValues, check_against_btree, key, load_spans, spans_from_btree
from packer.layout.manifest import Shard
from packer.layout.trust import inside, open_regular
from packer.pagecache import PageCache
from packer.perprocess import PerProcess

_BATCH_BYTES = 4 << 20  # commit about every 4 MB: measured ~30% faster than 16 MB here (dirty pages stay cache-hot)
_INITIAL_MAP = 64 << 20


def shard_name(shard_id: int) -> str:
    return f"shard-{shard_id:05d}.lmdb"


class Writer(ShardWriter):
    def __init__(self, directory: Path, shard_id: int, num_samples: int, payload: str, options: dict) -> None:
        self.name = shard_name(shard_id)
        self.path = directory / self.name
        self.planned = num_samples
        self.shape = fixed_shape(payload, options)  # raw payloads of one shape: the manifest says so (read_into)
        self._map_size = _INITIAL_MAP
        self._env = self._open(self.path)
        self._batch: list[tuple[bytes, bytes]] = []
        self._batch_bytes = 0
        self._count = 0

    def _open(self, path: Path) -> lmdb.Environment:
        return lmdb.open(
            str(path), map_size=self._map_size, subdir=False, lock=False, sync=False,
            metasync=False, readahead=False, meminit=True, max_dbs=0,
        )

    def add(self, sample: PreparedSample) -> None:
        check_addition(self.path, self._count, self.planned, sample, self.shape)
        value = sample.payload if isinstance(sample.payload, bytes) else sample.payload.tobytes()
        self._batch.append((key(self._count), value))
        self._batch_bytes += len(value)
        self._count += 1
        if self._batch_bytes >= _BATCH_BYTES:
            self._commit()

    def _commit(self) -> None:
        while self._batch:
            try:
                with self._env.begin(write=True) as txn:
                    with txn.cursor() as cur:
                        for k, v in self._batch:
                            if not cur.put(k, v, append=True):
                                raise PackerError(f"{self.path}: LMDB refused key {k!r}")
                self._batch, self._batch_bytes = [], 0
            except lmdb.MapFullError:
                self._map_size *= 2  # the aborted transaction wrote nothing; grow and retry
                self._env.set_mapsize(self._map_size)

    def close(self) -> tuple[list[str], dict]:
        self._commit()
        self._env.close()
        np.save(self.path.with_name(spans_name(self.name)), value_spans(self.path, self._count), allow_pickle=False)
        facts: dict = {"map_size": self._map_size}
        if self.shape is not None:
            facts.update(layout="fixed", shape=list(self.shape))
        return [self.name, spans_name(self.name)], facts

    def abort(self) -> None:
        self._env.close()
        for path in (self.path, self.path.with_name(spans_name(self.name))):
            path.unlink(missing_ok=True)


def spans_name(shard_file: str) -> str:
    return shard_file.removesuffix(".lmdb") + ".spans.npy"


def value_spans(path: Path, count: int) -> np.ndarray:
    """[count, 3] int64: each sample's leaf page offset and value start/end in the file, found by one walk of
    the just-written file's leaf pages (``lmdb_values.spans_from_btree``): readers map values with them."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = read_header(fd, path)
        return spans_from_btree(Tree(fd, path, header.psize, header.txnid), count)
    finally:
        os.close(fd)


HEADER_PAGE = 4096  # LMDB's page where the OS page is 4 KiB: its two meta pages open the file


def _own_descriptor(path: Path) -> int:
    """The shard open for this reader, checked again as on opening the dataset (``inside``: a regular file in its
    directory; a FIFO, a device or a link out put there since is refused, not waited on or followed), its header
    pages read first without read-ahead, so that py-lmdb's header read leaves no read-ahead mark for the B-tree
    reads to act on (CI saw 64 KB of values read on open; py-lmdb's open did that, ``read_header`` reads them
    again)."""
    try:
        fd = open_regular(inside(path.parent, path.name))[0]
    except OSError as exc:
        raise DatasetError(f"{path}: cannot open LMDB shard ({exc.strerror or exc})") from None
    try:
        with page_reads(fd):
            os.pread(fd, 2 * HEADER_PAGE, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class _Handle:
    """What a reader holds open in one process."""

    fd: int  # our own descriptor of the file, for the size checks
    psize: int
    spans: np.ndarray  # [N, 3] leaf page, value start, value end
    values: MappedValues  # the values as views of our map


class Reader(ShardReader):
    """Reads one shard; opens lazily in each process.

    Values are zero-copy read-only views of the reader's own map of the file (``lmdb_values``), where the
    shard's spans file says they lie (checked against the B-tree on open), or where one walk of the B-tree's
    leaf pages finds them for a shard written without one. The mapped file is seen to have the manifest's
    size before each read (``base.check_size``): a page past the end of a file truncated in place would kill
    the process with SIGBUS, and no value is handed out that lies past the end.
    """

    def __init__(self, directory: Path, shard: Shard, payload: str, access: str = "sequential") -> None:
        self.path = directory / shard.files[0].name
        self.num_bytes = shard.files[0].num_bytes
        self.spans_path = directory / shard.files[1].name if len(shard.files) > 1 else None  # older datasets: none
        self.num_samples = shard.num_samples
        self.readahead = access != "random"
        if "layout" in shard.facts:  # raw payloads of one shape (--resize HxW): read_into copies batches
            self.fixed_shape = shard_layout(shard.facts, self.path)
            if payload != "raw":
                raise DatasetError(f"{self.path}: manifest gives a fixed shape to {payload} payloads")
        self._handle: PerProcess[_Handle] = PerProcess()
        self._cache: PerProcess[PageCache] = PerProcess(inherited=PageCache.close)

    def _open(self) -> _Handle:
        fd = _own_descriptor(self.path)
        try:
            return self._checked(fd)
        except OSError as exc:
            os.close(fd)
            raise DatasetError(f"{self.path}: damaged LMDB shard ({exc.strerror or exc})") from None
        except BaseException:
            os.close(fd)
            raise

    def _checked(self, fd: int) -> _Handle:
        size = os.fstat(fd).st_size
        with page_reads(fd):  # the header and the B-tree's pages alone: read-ahead would bring values in
            header = read_header(fd, self.path)
            # LMDB trusts its own page numbers: pages past the end of a truncated file would fault (SIGBUS)
            # in a map. Its pages must all lie inside the file.
            needed = (header.last_pgno + 1) * header.psize
            if needed > size:
                raise DatasetError(f"{self.path}: truncated: LMDB records {needed} bytes of pages, the file holds "
                                   f"{size}")
            if header.entries != self.num_samples:
                raise DatasetError(f"{self.path}: holds {header.entries} samples, the manifest says "
                                   f"{self.num_samples}")
            check_size(fd, self.num_bytes, self.path)  # mapped at the manifest's size, or not at all
            spans = None if self.spans_path is None else load_spans(self.spans_path, self.num_samples, size,
                                                                    header.psize)
            tree = Tree(fd, self.path, header.psize, header.txnid)
            if spans is not None and self.spans_path is not None:
                check_against_btree(tree, spans, self.path, self.spans_path)
            else:  # written before spans files existed (or where /proc was missing)
                spans = spans_from_btree(tree, self.num_samples)
        values = MappedValues(fd, self.path, spans, random=not self.readahead)
        return _Handle(fd, header.psize, spans, values)

    def _get(self) -> _Handle:
        """What this process holds open, the file seen to have the manifest's size (a map would fault on a
        shorter one)."""
        h = self._handle.get(self._open)
        check_size(h.fd, self.num_bytes, self.path)
        return h

    def __len__(self) -> int:
        return self.num_samples

    def read(self, pos: int) -> memoryview:
        """A read-only view of the value in the file."""
        return self._get().values.read(pos)

    def read_many(self, positions: list[int]) -> list[memoryview]:
        """One slice of the map per sample."""
        return self._get().values.read_many(positions)

    def read_copies(self, positions: list[int], buf: Destinations = None) -> list[memoryview]:
        """The values where the spans say they lie, copied from the map under the SIGBUS guard or read with ``pread``
        (``ShardReader.read_copies``)."""
        h = self._get()
        rows = h.spans[np.asarray(positions, dtype=np.int64)]
        return [a.data for a in pread_ranges(h.fd, rows[:, 1].tolist(), rows[:, 2].tolist(), buf, self.path,
                                             self.num_bytes, mapped=(h.values.array, 0))]

    def read_into(self, positions: list[int], out: np.ndarray) -> None:
        """Fixed shape only: copy the samples at ``positions`` into ``out[0:len]`` (one gather from the map)."""
        if self.fixed_shape is None:
            raise PackerError(f"{self.path}: read_into needs a fixed-shape shard")
        self._get().values.read_into(list(positions), out)

    def file_spans(self, positions: list[int]) -> list[list[tuple[str, int, int]]]:
        """Per position, the file span reading it touches: its value (see packer.read.readahead)."""
        path, rows = str(self.path), self._get().spans[np.asarray(positions, dtype=np.int64)].tolist()
        return [[(path, a, b)] for _leaf, a, b in rows]

    def _page_cache(self) -> PageCache:
        spans = self._get().spans
        return PageCache(self.path, holding=(spans[:, 1], spans[:, 2]))  # the values: leaf pages are never read

    def cached(self, positions: list[int]) -> np.ndarray:
        """From the same spans as ``file_spans``."""
        rows = self._get().spans[np.asarray(positions, dtype=np.int64)]
        return self._cache.get(self._page_cache).resident_each(rows[:, 1], rows[:, 2])

    def close(self) -> None:
        """Forget this process's handles; views handed out keep the map (not the file descriptor) alive."""
        self._cache.close(PageCache.close)
        self._handle.close(self._close_handle)

    def _close_handle(self, h: _Handle) -> None:
        os.close(h.fd)


FORMAT = Format(
    name="lmdb", dataset_class="LMDBDataset", payloads=frozenset({"encoded", "raw", "none"}),
    Writer=Writer, Reader=Reader,
    default_shard_bytes=1 << 30,
)
