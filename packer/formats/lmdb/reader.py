"""LMDB shards read without py-lmdb (it refuses a file already open in the process, so a user's own
``lmdb.Environment`` on a shard would stop packer) and without writing anything, not even a lock file: the header
read as LMDB does (``pages.read_header``, checked against the file and the manifest), payloads zero-copy read-only
views of the reader's own map (``values``) where the spans file says (checked against the B-tree first) or where
one walk of the leaf pages finds them. ``access`` decides whether the kernel reads ahead around each page fault of
that map: on for sequential and block-shuffled passes, off for uniform random access on data larger than RAM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from packer.errors import DatasetError, PackerError
from packer.formats.base import (
    Destinations,
    ShardReader,
    pread_ranges,
    shard_layout,
)
from packer.formats.filemap import check_size, closed_on_error
from packer.formats.lmdb.pages import Tree, page_reads, read_header
from packer.formats.lmdb.values import MappedValues, check_against_btree, load_spans, spans_from_btree
from packer.layout.manifest import Shard
from packer.layout.trust import inside, open_regular
from packer.pagecache import PageCache
from packer.perprocess import PerProcess

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
    with closed_on_error(fd), page_reads(fd):
        os.pread(fd, 2 * HEADER_PAGE, 0)
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

    Values are zero-copy read-only views of the reader's own map of the file (``values``), where the
    shard's spans file says they lie (checked against the B-tree on open), or where one walk of the B-tree's
    leaf pages finds them for a shard written without one. The mapped file is seen to have the manifest's
    size before each read (``filemap.check_size``): a page past the end of a file truncated in place would kill
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
        with closed_on_error(_own_descriptor(self.path)) as fd:
            try:
                return self._checked(fd)
            except OSError as exc:
                raise DatasetError(f"{self.path}: damaged LMDB shard ({exc.strerror or exc})") from None

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

