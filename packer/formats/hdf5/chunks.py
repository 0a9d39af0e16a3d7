"""Zero-copy reads of an uncompressed chunked HDF5 dataset: views of the mapped file at its chunks' offsets.

HDF5 stores an uncompressed chunk as its plain bytes, whole, at an offset its chunk index gives
(``H5Dget_chunk_info_by_coord``). Mapping the file and slicing there returns what h5py would copy
out, without the copy (docs/results.md). Chunks'
offsets are found in one pass of the chunk index, at the first use (up to ``INDEX_AT_ONCE`` chunks) or once a few
were looked up one by one, and a chunk is refused, when read, unless it lies whole inside the file the manifest
describes; a range across chunks is one view where they follow each other in the file (as h5py writes them), else
joined from its pieces (a copy).
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import cast

import h5py
import numpy as np

from packer.errors import DatasetError
from packer.formats.base import Destinations, joined, pread_ranges, split_ranges
from packer.formats.filemap import check_size, map_bytes
from packer.pagecache import PageCache, all_of_each

INDEX_AT_ONCE = 1 << 17  # shards of up to this many chunks have them all looked up at the first one
LOOKUPS_BEFORE_INDEX = 64  # larger ones after this many one by one (each costs more the further its chunk lies)


class MappedChunks:
    """The bytes of ``dataset`` (uncompressed, chunked along its first axis) as views of the mapped file.

    ``fd`` is the open file (HDF5's own descriptor will do: the map keeps a copy), already checked to
    have the manifest's ``num_bytes``, so the map covers every chunk this admits.
    """

    def __init__(self, path: Path, dataset: h5py.Dataset, fd: int, num_bytes: int, access: str) -> None:
        check_size(fd, num_bytes, path)
        self.path = path
        self.dataset = dataset
        self.num_bytes = num_bytes
        self.data = map_bytes(path, fd, num_bytes, access)
        self.chunk_bytes = int(np.prod(dataset.chunks or (1,)))
        self.size = int(np.prod(dataset.shape, dtype=object))  # the dataset's bytes
        self._offsets = np.full(-(-self.size // self.chunk_bytes), -1, dtype=np.int64)  # -1: not looked up yet
        self._indexed = False  # every chunk looked up at once (``_index``)
        self._lookups = 0  # chunks looked up one by one
        self._residency: PageCache | None = None

    def chunk(self, c: int) -> int:
        """File offset of chunk ``c`` (the ``c``-th along the first axis), refused unless stored whole in the file."""
        offset = int(self._offsets[c])
        if offset < 0 and not self._indexed and (len(self._offsets) <= INDEX_AT_ONCE
                                                 or self._lookups >= LOOKUPS_BEFORE_INDEX):
            self._index()
            offset = int(self._offsets[c])
        if offset < 0:
            self._lookups += 1
            coord = (c * self.chunk_bytes,) if self.dataset.ndim == 1 else (c,) + (0,) * (self.dataset.ndim - 1)
            info = self.dataset.id.get_chunk_info_by_coord(coord)
            if info.byte_offset is None or info.size != self.chunk_bytes or \
                    info.byte_offset + info.size > self.num_bytes:
                raise DatasetError(f"{self.path}: {self.dataset.name} chunk {c} is {info.size} bytes at "
                                   f"offset {info.byte_offset}; the writer stores every chunk whole "
                                   f"({self.chunk_bytes} bytes) inside the file")
            offset = self._offsets[c] = info.byte_offset
        return offset

    def _index(self) -> None:
        """Every chunk's offset from one pass over HDF5's chunk index (``H5Dchunk_iter``; looking each up by its
        coordinate costs more the further it lies, docs/results.md), keeping those stored whole inside the file; any
        other is looked up, and refused, when read (``chunk``)."""
        self._indexed = True
        offsets, step = self._offsets, int((self.dataset.chunks or (1,))[0])
        size, last = self.chunk_bytes, self.num_bytes - self.chunk_bytes  # the last offset a whole chunk may have

        def visit(info) -> None:  # straight into the offsets: nothing allocated per chunk
            (c, rest), off = divmod(int(info.chunk_offset[0]), step), info.byte_offset
            if off is not None and rest == 0 and 0 <= c < len(offsets) and info.size == size and 0 <= off <= last:
                offsets[c] = off

        try:
            self.dataset.id.chunk_iter(visit)
        except (AttributeError, NotImplementedError, RuntimeError, ValueError):  # an HDF5 library without it
            return

    def flat(self, a: int, b: int) -> np.ndarray:
        """Bytes [a, b) of the dataset, flat in C order, read-only: a view when they lie in one chunk, else joined."""
        if a >= b:
            return self.data[:0]
        size = self.chunk_bytes
        first, last = a // size, (b - 1) // size
        if first == last:
            start = self.chunk(first) + a - first * size
            return self.data[start : start + b - a]
        starts, ends, _ = self._file_ranges(np.array([a], dtype=np.int64), np.array([b], dtype=np.int64))
        pieces = [self.data[start : stop] for start, stop in zip(starts.tolist(), ends.tolist(), strict=True)]
        return pieces[0] if len(pieces) == 1 else joined(pieces)

    def samples(self, positions: list[int], offsets: np.ndarray | None) -> list[np.ndarray]:
        """``flat`` of many samples (``offsets``: a blob's, else one sample per chunk), their pieces found at once
        (``read_many``; docs/results.md)."""
        starts, ends, owners = self.sample_ranges(positions, offsets)
        views = [self.data[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
        if len(views) == len(positions) and np.array_equal(owners, np.arange(len(positions))):
            return views  # each sample in one chunk: a view each
        out, at = [], 0
        for count in np.bincount(owners, minlength=len(positions)).tolist():
            out.append(self.data[:0] if count == 0 else views[at] if count == 1 else joined(views[at:at + count]))
            at += count
        return out

    def sample_ranges(self, positions: list[int], offsets: np.ndarray | None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The file's (starts, ends) holding many samples (``offsets``: a blob's, else one sample per chunk), one per
        chunk touched or fewer where chunks follow each other in the file, and each one's place in ``positions``."""
        pos, size = np.asarray(positions, dtype=np.int64), self.chunk_bytes
        a, b = (pos * size, (pos + 1) * size) if offsets is None else (offsets[pos], offsets[pos + 1])
        return self._file_ranges(a, b)

    def copies(self, fd: int, positions: list[int], offsets: np.ndarray | None, buf: Destinations) -> list:
        """``samples``' bytes copied into ``buf`` (``base.pread_ranges``: from the map under the SIGBUS guard, or read
        from the open file ``fd``), each sample's pieces joined, flat (``ShardReader.read_copies``)."""
        starts, ends, owners = self.sample_ranges(positions, offsets)
        return pread_ranges(fd, starts.tolist(), ends.tolist(), buf, self.path, self.num_bytes, owners.tolist(),
                            len(positions), mapped=(self.data, 0))

    def file_spans(self, positions: list[int], offsets: np.ndarray | None) -> list[list[tuple[str, int, int]]]:
        """``ShardReader.file_spans`` from ``sample_ranges``: per position, (file, start, end) of each piece."""
        out: list[list[tuple[str, int, int]]] = [[] for _ in positions]
        path = str(self.path)
        starts, ends, owners = self.sample_ranges(positions, offsets)
        for k, a, b in zip(owners.tolist(), starts.tolist(), ends.tolist(), strict=True):
            out[k].append((path, a, b))
        return out

    def _file_ranges(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The file's ranges holding dataset bytes [a[k], b[k]) for each k, and the k of each (empty: none)."""
        chunks, lo, hi, owners = split_ranges(a, b, self.chunk_bytes)
        for c in np.unique(chunks[self._offsets[chunks] < 0]).tolist():
            self.chunk(c)  # looked up and checked once
        starts, ends = self._offsets[chunks] + lo, self._offsets[chunks] + hi
        if len(starts) < 2:
            return starts, ends, owners
        # a piece that goes on where the one before it (the same sample's) ends in the file joins it: a sample
        # across chunks h5py wrote one after the other is one range, read as a view, not a copy
        heads = np.flatnonzero(np.concatenate(([True], (owners[1:] != owners[:-1]) | (starts[1:] != ends[:-1]))))
        return starts[heads], ends[np.concatenate((heads[1:], [len(ends)])) - 1], owners[heads]

    def cached(self, positions: list[int], offsets: np.ndarray | None) -> np.ndarray:
        """Per sample, whether every file page holding it is in the page cache. The file's whole-file answer
        (``PageCache``) counts only the pages holding the dataset: HDF5's own metadata, read at open, may be dropped
        from the cache since, and counted, every batch would be asked about range by range (docs/results.md). Those
        pages are found only for a file asked about whole."""
        if self._residency is None:
            me = weakref.ref(self)  # no cycle through the question: the data's map goes with its last reference
            self._residency = PageCache(self.path, holding=lambda: cast(MappedChunks, me())._holding())
        starts, ends, owners = self.sample_ranges(positions, offsets)
        return all_of_each(self._residency.resident_each(starts, ends), owners, len(positions))

    def _holding(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The file's ranges holding the dataset's bytes (every chunk looked up at once); None, the whole file, where
        a chunk is not stored whole (reading it says so, not this question)."""
        if not self._indexed:
            self._index()
        if (self._offsets < 0).any():
            return None
        return self._file_ranges(np.array([0], dtype=np.int64), np.array([self.size], dtype=np.int64))[:2]

    def close(self) -> None:
        """Drop the page-cache question's own mapping (the data's goes with its last view)."""
        if self._residency is not None:
            self._residency.close()
